"""Native CPU kernels: compiled once per machine with the system C compiler, loaded via ctypes.

The source lives in `engine/csrc/`. It is compiled with `-march=native` because the kernel's
speed comes from the widest vectors the CPU has; the build is cached under `pdspec_home()`
keyed by the source, the compiler flags and the CPU, so a machine compiles it at most once.
ctypes releases the GIL for the call, so serving threads keep running while a GEMM runs.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from engine.home import pdspec_home

_SOURCE = Path(__file__).parent / "csrc" / "packed_gemm.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]


def _cpu_signature() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


@functools.cache
def load_library() -> ctypes.CDLL:
    """Compile (if needed) and load the kernel library; raises RuntimeError if it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError(
            "pdspec's CPU kernels need a C compiler (gcc) to build engine/csrc/packed_gemm.c; "
            "install gcc or set CC, or run with device 'cuda'"
        )
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = pdspec_home() / "kernels" / f"packed_gemm-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: processes that start together never see half a file.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built)], capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"building {_SOURCE.name} with {compiler} failed:\n{result.stderr}")
            os.replace(built, target)
    lib = ctypes.CDLL(str(target))
    lib.pd_pack_width.restype = ctypes.c_int
    lib.pd_packed_gemm.restype = None
    lib.pd_packed_gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    return lib


def pack_width() -> int:
    return load_library().pd_pack_width()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 -> [ceil(N/P), K, P] panels (zero-padded rows), the layout packed_gemm reads."""
    width = pack_width()
    n, k = weight.shape
    padded_n = -(-n // width) * width
    if padded_n != n:
        weight = torch.cat([weight, weight.new_zeros(padded_n - n, k)])
    return weight.reshape(padded_n // width, width, k).transpose(1, 2).contiguous()


def unpack_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of the original [N, K] weight, read out of the packed layout (embedding lookup)."""
    width = packed.shape[2]
    return packed[rows // width, :, rows % width]


def packed_gemm(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x[M, K] @ W^T (+ bias) for W packed by `pack_weight`; x is made contiguous fp32 on CPU."""
    x = x.contiguous()
    m, k = x.shape
    if packed.shape[1] != k:
        raise ValueError(f"packed_gemm: x has {k} features, the weight expects {packed.shape[1]}")
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m == 0:
        return y
    load_library().pd_packed_gemm(
        x.data_ptr(),
        packed.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        y.data_ptr(),
        m,
        k,
        out_features,
        torch.get_num_threads(),
    )
    return y
