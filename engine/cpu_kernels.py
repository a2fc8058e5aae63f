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

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("packed_gemm.c", "paged_attention.c")]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
# Limits of paged_attention.c (checked here so callers can pick another path up front).
ATTENTION_MAX_HEAD_DIM, ATTENTION_MAX_GROUP = 256, 64


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
            "pdspec's CPU kernels need a C compiler (gcc) to build engine/csrc/*.c; "
            "install gcc or set CC, or run with device 'cuda'"
        )
    source = b"".join(src.read_bytes() for src in _SOURCES)
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = pdspec_home() / "kernels" / f"pdspec_cpu-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: processes that start together never see half a file.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            cmd = [compiler, *_FLAGS, *map(str, _SOURCES), "-o", str(built), "-lm"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"building pdspec's CPU kernels with {compiler} failed:\n{result.stderr}")
            os.replace(built, target)
    lib = ctypes.CDLL(str(target))
    lib.pd_pack_width.restype = ctypes.c_int
    for gemm in (lib.pd_packed_gemm, lib.pd_packed_gemm_bf16):
        gemm.restype = None
        gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    lib.pd_paged_attention.restype = ctypes.c_int
    lib.pd_paged_attention.argtypes = (
        [ctypes.c_void_p] * 2 + [ctypes.c_long] * 3 + [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 2
        + [ctypes.c_int] * 6 + [ctypes.c_float] + [ctypes.c_void_p] * 2 + [ctypes.c_int]
    )
    return lib


def pack_width() -> int:
    return load_library().pd_pack_width()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 or bf16 -> [ceil(N/P), K, P] panels (zero-padded rows), the layout packed_gemm
    reads; the dtype is kept (bf16 panels halve the weight traffic, the math stays fp32)."""
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
    """x[M, K] fp32 @ W^T (+ fp32 bias) -> fp32, for W packed (fp32 or bf16) by `pack_weight`."""
    x = x.contiguous()
    m, k = x.shape
    if packed.shape[1] != k:
        raise ValueError(f"packed_gemm: x has {k} features, the weight expects {packed.shape[1]}")
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m == 0:
        return y
    lib = load_library()
    gemm = {torch.float32: lib.pd_packed_gemm, torch.bfloat16: lib.pd_packed_gemm_bf16}[packed.dtype]
    gemm(
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


def attention_supported(heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
    return (head_dim % 16 == 0 and head_dim <= ATTENTION_MAX_HEAD_DIM
            and heads // kv_heads <= ATTENTION_MAX_GROUP)


def paged_attention(q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, context_lens: torch.Tensor, max_query_len: int,
                    scale: float, out: torch.Tensor, span_masks: torch.Tensor | None = None) -> None:
    """Fill out[T, heads*D] for every sequence with at most max_query_len query tokens.

    q: [T, heads, D] fp32; layer_cache: [blocks, 2, block_size, kv_heads, D] (any block/kv/offset
    strides, heads and D contiguous); block_tables int64 [B, max_blocks]; query_start_loc and
    context_lens int32; span_masks: int32 [T] tree masks (see engine/attention.py) or None."""
    q = q.contiguous()
    _, heads, dim = q.shape
    s_block, s_kv, s_offset, s_head, s_dim = layer_cache.stride()
    if s_dim != 1 or s_head != dim:
        raise ValueError("paged_attention: the cache's kv-head and head-dim axes must be contiguous")
    rc = load_library().pd_paged_attention(
        q.data_ptr(), layer_cache.data_ptr(), s_block, s_kv, s_offset,
        block_tables.data_ptr(), block_tables.shape[1], query_start_loc.data_ptr(), context_lens.data_ptr(),
        context_lens.shape[0], max_query_len, heads, layer_cache.shape[3], dim, layer_cache.shape[2], scale,
        out.data_ptr(), span_masks.data_ptr() if span_masks is not None else None, torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"paged_attention: shapes outside the kernel's limits (heads={heads}, head_dim={dim})")
