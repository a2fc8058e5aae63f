"""Native CPU kernels: compiled once per machine and ISA level with the system C compiler,
loaded via ctypes.

The source lives in `engine/csrc/`. The kernels' speed comes from the vector width, and their
register tiles are chosen per width (`csrc/vector_isa.h`), so they are built for one of three
ISA levels:
- `avx512`: the machine's own `-march=native` build on a CPU with AVX-512F;
- `avx2`: x86-64-v3 (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE), what every x86 machine here has;
- `portable`: the architecture's baseline (x86-64's SSE2; on arm64 the compiler's, NEON).
The best level the CPU supports is used unless `PDSPEC_CPU_ISA` names a lower one, so a
machine can run (and test) the paths of the machines below it; hold torch to the same level
with `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` when comparing. Each build is cached
under `pdspec_home()` keyed by the source, the compiler and what the flags target on this CPU (the
macros it defines for them: `-march=native` resolves to features /proc/cpuinfo may not list), so
it is compiled at most once and never loaded on a CPU it was not built for.
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
from engine.kv_layout import row_elements
from engine.quant import GROUP, KERNEL_FORMAT, PANEL_BLOCK_BYTES, QBLOCK, QuantizedTensor, pack_panels

ISA_ENV = "PDSPEC_CPU_ISA"
ISA_LEVELS = ("avx512", "avx2", "portable")  # best first
_ISA_FLAGS = {"avx512": ["-march=native"], "avx2": ["-march=x86-64-v3", "-mtune=native"], "portable": []}
# What each level's code may use: x86-64-v3 lets the compiler emit BMI1/2, LZCNT and MOVBE anywhere,
# and the AVX-512 paths use AVX512BW's byte and word operations.
_V3 = {"avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}
_ISA_CPU_FLAGS = {"avx512": _V3 | {"avx512f", "avx512bw"}, "avx2": _V3, "portable": set()}
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("packed_gemm.c", "quant_dot.c", "attention_tile.c", "paged_attention.c", "decoder_step.c", "logit_rows.c")
KERNEL_FILES = _SOURCES + ("vector_isa.h", "kernels.h", "attention_tile.h", "quant_dot_portable.h")  # what a build reads from its csrc directory
_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
TOP_K_MAX = 64  # the most candidates top_probs keeps a row (csrc/logit_rows.c: PD_TOP_K_MAX)
_KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # csrc/kernels.h: PD_KV_F32, ...
# Limits of paged_attention.c and attention_tile.c (checked here so callers can pick another path up front).
ATTENTION_MAX_HEAD_DIM, ATTENTION_MAX_GROUP = 256, 64


def _cpu_signature() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty off x86; without /proc/cpuinfo,
    the words of platform.processor())."""
    return set(_cpu_signature().split()) if platform.machine().lower() in ("x86_64", "amd64") else set()


@functools.cache
def supported_isas() -> tuple[str, ...]:
    """The ISA levels this CPU runs, best first ('portable' everywhere)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("portable",)
    return tuple(isa for isa in ISA_LEVELS if _ISA_CPU_FLAGS[isa] <= cpu_flags())


def selected_isa() -> str:
    """`$PDSPEC_CPU_ISA` if set (it must be a level this CPU runs), else the best one."""
    supported = supported_isas()
    wanted = os.environ.get(ISA_ENV, "").strip().lower()
    if not wanted:
        return supported[0]
    if wanted not in supported:
        known = f"this CPU runs {', '.join(supported)}" if wanted in ISA_LEVELS else f"allowed: {', '.join(ISA_LEVELS)}"
        raise ValueError(f"{ISA_ENV}={wanted!r} cannot be used: {known}")
    return wanted


def c_compiler() -> str:
    """$CC, else gcc or cc from PATH."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError(
            "pdspec's CPU kernels need a C compiler (gcc) to build engine/csrc/*.c; "
            "install gcc or set CC, or run with device 'cuda'"
        )
    return compiler


def isa_flags(isa: str) -> list[str]:
    """The compiler flags that target `isa` (what the kernels of that level are built with). The
    portable level names x86-64's baseline: a toolchain whose default is x86-64-v3 would build
    the AVX2 paths under its name."""
    if isa == "portable" and platform.machine().lower() in ("x86_64", "amd64"):
        return ["-march=x86-64"]
    return list(_ISA_FLAGS[isa])


def _target_signature(compiler: str, flags: list[str]) -> bytes:
    """The compiler's version and the macros it defines for `flags` here (__AVX512BF16__ and
    kin): what the build really targets, which the CPU's flags line need not show."""
    version = subprocess.run([compiler, "--version"], capture_output=True).stdout
    macros = subprocess.run([compiler, *flags, "-E", "-dM", "-x", "c", os.devnull], capture_output=True).stdout
    return version + b"".join(sorted(macros.splitlines()))


def build_kernels(isa: str, csrc: Path = _CSRC) -> Path:
    """The kernel library of the sources in `csrc` (engine/csrc, or another revision's copy of it
    for a comparison) built for `isa`: compiled once, then cached under pdspec_home()."""
    compiler = c_compiler()
    flags = _FLAGS + isa_flags(isa)
    source = b"".join((csrc / name).read_bytes() for name in KERNEL_FILES)
    signature = " ".join(flags).encode() + _cpu_signature().encode() + _target_signature(compiler, flags)
    key = hashlib.sha256(source + signature).hexdigest()[:16]
    target = pdspec_home() / "kernels" / f"pdspec_cpu-{isa}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: processes that start together never see half a file.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            cmd = [compiler, *flags, f"-I{csrc}", *(str(csrc / name) for name in _SOURCES), "-o", str(built), "-lm"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"building pdspec's CPU kernels ({isa}) with {compiler} failed:\n{result.stderr}")
            os.replace(built, target)
    return target


class CpuKernels:
    """The kernel library built for one ISA level. Weights packed by one level's `pack_weight`
    are read by that level's `packed_gemm` only (the panel width follows the vector width)."""

    def __init__(self, isa: str, library: Path | None = None):
        """library: a build of `isa` (default: engine/csrc's, built if needed)."""
        self.isa = isa
        lib = ctypes.CDLL(str(library or build_kernels(isa)))
        lib.pd_pack_width.restype = ctypes.c_int
        for gemm in (lib.pd_packed_gemm, lib.pd_packed_gemm_bf16):
            gemm.restype = None
            gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        for gemm in (lib.pd_quant_gemm, lib.pd_quant_gemm_i8):
            gemm.restype = ctypes.c_int
            gemm.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        lib.pd_norm_rows.restype = None
        lib.pd_norm_rows.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2 + [ctypes.c_void_p, ctypes.c_float,
                                                                                ctypes.c_void_p]
        lib.pd_panel_rows.restype = ctypes.c_int
        lib.pd_panel_rows.argtypes = [ctypes.c_int] * 2 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p,
                                                            ctypes.c_int, ctypes.c_void_p]
        lib.pd_argmax_rows.restype = None
        lib.pd_argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        lib.pd_top_probs.restype = None
        lib.pd_top_probs.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 2
        lib.pd_probabilities.restype = None
        lib.pd_probabilities.argtypes = ([ctypes.c_void_p] + [ctypes.c_int] * 2 + [ctypes.c_float, ctypes.c_int, ctypes.c_float]
                                         + [ctypes.c_void_p] * 2 + [ctypes.c_int])
        lib.pd_inverse_cdf.restype = None
        lib.pd_inverse_cdf.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 2
        lib.pd_paged_attention.restype = ctypes.c_int
        lib.pd_paged_attention.argtypes = (
            [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_long] * 3 + [ctypes.c_void_p, ctypes.c_int]
            + [ctypes.c_void_p] * 2
            + [ctypes.c_int] * 5 + [ctypes.c_float] + [ctypes.c_void_p] * 2 + [ctypes.c_int]
        )
        lib.pd_decoder_layers.restype = ctypes.c_int
        lib.pd_decoder_layers.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 4
                                          + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int])
        lib.pd_write_kv.restype = ctypes.c_int
        lib.pd_write_kv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int]
        self._lib = lib
        self.pack_width = lib.pd_pack_width()
        self._gemms = {torch.float32: lib.pd_packed_gemm, torch.bfloat16: lib.pd_packed_gemm_bf16}

    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] fp32 or bf16 -> [ceil(N/P), K, P] panels (zero-padded rows), the layout packed_gemm
        reads; the dtype is kept (bf16 panels halve the weight traffic, the math stays fp32)."""
        width = self.pack_width
        n, k = weight.shape
        padded_n = -(-n // width) * width
        if padded_n != n:
            weight = torch.cat([weight, weight.new_zeros(padded_n - n, k)])
        return weight.reshape(padded_n // width, width, k).transpose(1, 2).contiguous()

    def packed_gemm(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        """x[M, K] fp32 @ W^T (+ fp32 bias) -> fp32, for W packed (fp32 or bf16) by `pack_weight`."""
        x = x.contiguous()
        m, k = x.shape
        if packed.shape[1] != k:
            raise ValueError(f"packed_gemm: x has {k} features, the weight expects {packed.shape[1]}")
        if packed.shape[2] != self.pack_width:
            raise ValueError(f"packed_gemm: weight packed {packed.shape[2]} wide, the {self.isa} kernels read "
                             f"{self.pack_width}; pack it with the same kernels")
        if out_features > packed.shape[0] * packed.shape[2] or (bias is not None and bias.shape != (out_features,)):
            raise ValueError(f"packed_gemm: {out_features} outputs from a weight of {packed.shape[0] * packed.shape[2]} "
                             f"packed rows, bias {None if bias is None else tuple(bias.shape)}")
        y = torch.empty(m, out_features, dtype=torch.float32)
        if m == 0:
            return y
        self._gemms[packed.dtype](
            x.data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(),
            m, k, out_features, torch.get_num_threads(),
        )
        return y

    def pack_quantized(self, weight: QuantizedTensor) -> torch.Tensor:
        """GGUF blocks -> the panels `quant_gemm` reads (see engine/quant.py)."""
        return pack_panels(weight, self.pack_width)

    def quant_gemm(self, x: torch.Tensor, panels: torch.Tensor, qtype: str, out_features: int,
                   bias: torch.Tensor | None = None, int8_dot: bool = False) -> torch.Tensor:
        """x[M, K] fp32 @ W^T (+ fp32 bias) -> fp32, for W of `qtype` packed by `pack_quantized`
        (with the same int8_dot): bit-identical to `packed_gemm` over the dequantized weight, or
        with int8_dot, llama.cpp's arithmetic (x quantized per 32-block, integer dots)."""
        x = x.contiguous()
        m, k = x.shape
        fmt = KERNEL_FORMAT[qtype]
        panel_bytes = k // QBLOCK * PANEL_BLOCK_BYTES[fmt] * self.pack_width
        if k % QBLOCK or panels.shape[1] != panel_bytes:
            raise ValueError(f"quant_gemm: x has {k} features; the {qtype} panels hold {panels.shape[1]} bytes per "
                             f"panel, {self.isa} kernels with {k} features expect {panel_bytes}")
        y = torch.empty(m, out_features, dtype=torch.float32)
        if m == 0:
            return y
        gemm = self._lib.pd_quant_gemm_i8 if int8_dot else self._lib.pd_quant_gemm
        rc = gemm(fmt, x.data_ptr(), panels.data_ptr(), bias.data_ptr() if bias is not None else None,
                  y.data_ptr(), m, k, out_features, torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"quant_gemm: no memory for the {m}-row batch's buffers")
        return y

    def panel_rows(self, panels: torch.Tensor, qtype: str, cols: int, ids: torch.Tensor,
                   int8_dot: bool = False) -> torch.Tensor:
        """fp32 rows `ids` of the [N, cols] matrix `pack_quantized` packed (an embedding lookup),
        exactly its dequantized values."""
        ids = ids.to(torch.long).contiguous()
        out = torch.empty(len(ids), cols)
        rows = panels.shape[0] * self.pack_width
        if self._lib.pd_panel_rows(KERNEL_FORMAT[qtype], GROUP[int8_dot], panels.data_ptr(), cols, rows, ids.data_ptr(),
                                   len(ids), out.data_ptr()):
            raise IndexError(f"panel_rows: ids outside the {rows} packed rows")
        return out

    def argmax_rows(self, logits: torch.Tensor) -> list[int]:
        """Each row's argmax of logits [rows, V] fp32, as torch.argmax(-1) gives it (first of equal
        maxima, first NaN): torch's own took ~55 us for a 4-row verification span over 49K logits."""
        _check_logits(logits, "argmax_rows")
        logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.long)
        if logits.shape[0]:
            self._lib.pd_argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(),
                                     torch.get_num_threads())
        return out.tolist()

    def top_probs(self, logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
        """Each row's k largest logits' indices (largest first; the first of equal values first)
        and their softmax probabilities, for logits [rows, V] fp32: what the draft chooses from
        (torch's softmax and topk took ~35 us a row, ~85 us four). A row with a NaN gets NaN
        probabilities."""
        _check_logits(logits, "top_probs")
        if not 1 <= k <= min(TOP_K_MAX, logits.shape[1]):
            raise ValueError(f"top_probs: k must be in 1..{min(TOP_K_MAX, logits.shape[1])} (got {k})")
        logits = logits.contiguous()
        ids = torch.empty(logits.shape[0], k, dtype=torch.long)
        probs = torch.empty(logits.shape[0], k)
        self._lib.pd_top_probs(logits.data_ptr(), logits.shape[0], logits.shape[1], k, ids.data_ptr(), probs.data_ptr())
        return ids.tolist(), probs.tolist()

    def probabilities(self, logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
        """engine/sampling.py's sampling distribution of each row of logits [rows, V] fp32 (its
        torch definition took ~0.2-0.3 ms a row: a quarter of a batch-16 step at top-p)."""
        _check_logits(logits, "probabilities")
        logits = logits.contiguous()
        out = torch.empty_like(logits)
        threads = torch.get_num_threads()
        scratch = torch.empty(threads, logits.shape[1])
        top_k = top_k if 0 < top_k < logits.shape[1] else 0  # at or past the vocabulary: no filter
        self._lib.pd_probabilities(logits.data_ptr(), logits.shape[0], logits.shape[1], temperature, top_k, top_p,
                                   out.data_ptr(), scratch.data_ptr(), threads)
        return out

    def inverse_cdf(self, weights: torch.Tensor, rows: list[int], u: torch.Tensor) -> list[int]:
        """Per draw e: the first index of row rows[e] of weights [n, V] fp32 (>= 0) where the
        running sum exceeds u[e] times the row's total (engine/spec/rejection.py's inverse_cdf, to
        rounding: sums by spans of four vectors, then fp64, where torch's fp64 scan of a 49K row
        took ~100 us), without copying the rows."""
        _check_logits(weights, "inverse_cdf")
        if len(u) != len(rows) or any(not 0 <= r < weights.shape[0] for r in rows):
            raise ValueError(f"inverse_cdf: {len(rows)} rows of {weights.shape[0]} (each in range), {len(u)} draws")
        weights, u = weights.contiguous(), u.to(torch.float32).contiguous()
        index = torch.tensor(rows, dtype=torch.long)
        out = torch.empty(len(rows), dtype=torch.long)
        self._lib.pd_inverse_cdf(weights.data_ptr(), weights.shape[1], index.data_ptr(), len(rows), u.data_ptr(),
                                 out.data_ptr())
        return out.tolist()

    def norm_rows(self, x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(x[rows]) * weight for x [T, hidden] fp32 contiguous, rows int64 (in range: the
        batch's own logits indices)."""
        out = torch.empty(len(rows), x.shape[1])
        self._lib.pd_norm_rows(x.data_ptr(), rows.data_ptr(), len(rows), x.shape[1], weight.data_ptr(), eps,
                               out.data_ptr())
        return out

    def decoder_layers(self, model, layers, num_layers: int, batch, x: torch.Tensor, aux: torch.Tensor,
                       aux_ids, num_aux: int, scratch: torch.Tensor) -> None:
        """The decoder layer loop of csrc/decoder_step.c over x in place (engine/native_decoder.py
        builds the structures)."""
        rc = self._lib.pd_decoder_layers(model, layers, num_layers, batch, x.data_ptr(), aux.data_ptr(), aux_ids,
                                         num_aux, scratch.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("native decoder step: a kernel refused its shapes or found no memory")

    def write_kv(self, model, layer, kv, skip: int, batch, x: torch.Tensor, scratch: torch.Tensor) -> None:
        """The first layer's cache entries alone, from csrc/decoder_step.c (engine/native_decoder.py
        builds the structures)."""
        threads = torch.get_num_threads()
        if self._lib.pd_write_kv(model, layer, kv, skip, batch, x.data_ptr(), scratch.data_ptr(), threads):
            raise RuntimeError("native draft KV write: the GEMM refused its shapes or found no memory")

    def paged_attention(self, q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                        out: torch.Tensor, span_masks: torch.Tensor | None = None) -> None:
        """Fill out[T, heads*D] for every sequence of the batch.

        q: [T, heads, D] fp32; layer_cache: [blocks, 2, block_size, kv_heads, row] rows of fp32, bf16
        or int8 (engine/kv_layout.py; any block/kv/offset strides, heads and rows contiguous);
        block_tables int64 [B, max_blocks]; query_start_loc and context_lens int32; span_masks:
        int32 [T] tree masks (see engine/attention.py) or None."""
        q, block_tables = q.contiguous(), block_tables.to(torch.long).contiguous()  # the rows' stride: their width
        _, heads, dim = q.shape
        ints = [t for t in (query_start_loc, context_lens, span_masks) if t is not None]
        if any(t.dtype != torch.int32 or not t.is_contiguous() for t in ints) or q.dtype != torch.float32 \
                or out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != q.numel():
            raise ValueError("paged_attention: q and out contiguous fp32 [T, heads*D]; query_start_loc, context_lens "
                             "and span_masks contiguous int32")
        s_block, s_kv, s_offset = layer_cache.stride()[:3]
        rc = self._lib.pd_paged_attention(
            q.data_ptr(), layer_cache.data_ptr(), kv_type(layer_cache, dim, layer_cache.shape[3]), s_block, s_kv,
            s_offset,
            block_tables.data_ptr(), block_tables.shape[1], query_start_loc.data_ptr(), context_lens.data_ptr(),
            context_lens.shape[0], heads, layer_cache.shape[3], dim, layer_cache.shape[2], scale,
            out.data_ptr(), span_masks.data_ptr() if span_masks is not None else None, torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"paged_attention: shapes outside the kernel's limits (heads={heads}, head_dim={dim}), "
                             "or no memory")


def kernels(isa: str | None = None) -> CpuKernels:
    """The kernels of `isa` (default: `selected_isa()`); raises RuntimeError if they cannot be built."""
    return _kernels_for(isa or selected_isa())


@functools.cache
def _kernels_for(isa: str) -> CpuKernels:
    if isa not in supported_isas():
        raise ValueError(f"CPU kernels for {isa!r}: this CPU runs {', '.join(supported_isas())}")
    return CpuKernels(isa)


def kv_type(cache: torch.Tensor, head_dim: int, kv_heads: int) -> int:
    """The C kernels' code for a KV cache's element type, once its last axes are checked to be
    contiguous [kv_heads, row] rows (engine/kv_layout.py), where the kernels read and write them."""
    if cache.dtype not in _KV_TYPES:
        raise ValueError(f"a {cache.dtype} KV cache: the C kernels read float32, bfloat16 or int8 rows")
    row = row_elements(str(cache.dtype).removeprefix("torch."), head_dim)
    if cache.shape[-2:] != (kv_heads, row) or cache.stride()[-2:] != (row, 1):
        raise ValueError(f"the KV cache's last axes must be contiguous [{kv_heads}, {row}] {cache.dtype} rows for "
                         f"head size {head_dim}, not {tuple(cache.shape)} with strides {cache.stride()}")
    return _KV_TYPES[cache.dtype]


def unpack_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of the original [N, K] weight, read out of the packed layout (embedding lookup)."""
    width = packed.shape[2]
    return packed[rows // width, :, rows % width]


def attention_supported(heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
    return (head_dim % 16 == 0 and head_dim <= ATTENTION_MAX_HEAD_DIM and heads % kv_heads == 0
            and heads // kv_heads <= ATTENTION_MAX_GROUP)


def _check_logits(logits: torch.Tensor, name: str) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu":
        raise ValueError(f"{name}: logits must be a 2-D fp32 CPU tensor (got {tuple(logits.shape)} "
                         f"{logits.dtype} on {logits.device})")
    if logits.shape[0] and not logits.shape[1]:
        raise ValueError(f"{name}: rows of 0 logits have no maximum")
