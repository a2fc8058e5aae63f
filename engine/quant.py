"""Weights kept in a GGUF's block-quantized form: the tensor type, its dequantization, and the
repack into the panels the CPU kernels stream (engine/csrc/packed_gemm.c, quant_dot.c).

A GGUF stores a matrix [rows, cols] as rows of 32-weight blocks. The formats kept as they are:
- Q8_0: fp16 scale d, 32 int8 q                      -> w = q * d          (34 bytes per block)
- Q4_0: fp16 d, 16 bytes of nibbles                   -> w = (q - 8) * d    (18 bytes)
- Q4_1: fp16 d, fp16 min m, 16 bytes of nibbles       -> w = q * d + m      (20 bytes)
(nibble byte j holds element j in its low half and j + 16 in its high half), and the K-quants
Q4_K and Q6_K in super-blocks of 256 (engine/kquants.py). `dequantize` here gives the fp32 values
gguf's own dequantization gives. The exact kernels widen each weight to that value, so their GEMM
is bit-identical to the fp32 GEMM over `dequantize(w)`; with `int8_dot` the activations are
quantized to int8 per block instead and the dots are integer (llama.cpp's arithmetic).
"""

from dataclasses import dataclass

import numpy as np
import torch

from engine.kquants import decode_q4_k, decode_q6_k, halves

QBLOCK = 32
BLOCKS_FILE = "gguf/blocks.safetensors"  # in a converted GGUF's directory (engine/gguf_convert.py)
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}
BLOCK_WEIGHTS = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q6_K": 256}
QUANT_TYPES = tuple(BLOCK_BYTES)
# The kernels' panel formats, per 32-block: Q8 (fp16 scale, int8), Q4 (fp16 scale and min,
# nibbles; Q4_0 becomes m = -8d), Q4F (Q4 with fp32 scale and min: Q4_K's sub-blocks) and Q8H
# (int8 with an fp32 scale per 16: Q6_K's sub-blocks).
KERNEL_FORMAT = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q4_K": 6, "Q6_K": 10}
# A panel's bytes per column and block, per kernel format (Q8_BYTES ... in csrc/kernels.h).
PANEL_BLOCK_BYTES = {8: 34, 4: 20, 6: 24, 10: 40}
# Bytes of a column kept together in a panel: one for the exact kernel (a vector of columns per k),
# four for the int8 dot products (one 32-bit lane per column, its next 4 k values).
GROUP = {False: 1, True: 4}
# Q4_0 runs as Q4_1 with m = -8d in fp16 (kernel_blocks): a scale beyond this overflows that min.
Q4_0_MAX_SCALE = 65504 / 8


@dataclass(frozen=True)
class QuantizedTensor:
    """A [rows, cols] matrix as GGUF blocks: `data` is uint8 [rows, cols / 32 * block bytes].
    int8_dot: multiply it with int8-quantized activations (llama.cpp's arithmetic, csrc/quant_dot.c)
    instead of widening it to its exact fp32 values (csrc/packed_gemm.c)."""

    qtype: str
    data: torch.Tensor
    cols: int
    int8_dot: bool = False

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"quantized type {self.qtype!r} is not one of {', '.join(QUANT_TYPES)}")
        size = BLOCK_WEIGHTS[self.qtype]
        if self.cols % size or self.data.shape[1] != self.cols // size * BLOCK_BYTES[self.qtype]:
            raise ValueError(f"{self.qtype} data of shape {tuple(self.data.shape)} does not hold {self.cols} columns")

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.cols

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __getitem__(self, index) -> "QuantizedTensor":
        """Row slices (`w[a:b]`) and whole-block column slices (`w[:, a:b]`), as sharding takes them."""
        rows, cols = (index, slice(None)) if not isinstance(index, tuple) else index
        data = self.data[rows]
        start, stop, step = cols.indices(self.cols)
        if (start, stop) == (0, self.cols):
            return QuantizedTensor(self.qtype, data, self.cols, self.int8_dot)
        block = BLOCK_WEIGHTS[self.qtype]
        if step != 1 or start % block or stop % block:
            raise ValueError(f"{self.qtype} columns can only be sliced at multiples of {block} (got {start}:{stop})")
        size = BLOCK_BYTES[self.qtype]
        return QuantizedTensor(self.qtype, data[:, start // block * size : stop // block * size], stop - start,
                               self.int8_dot)

    def contiguous(self) -> "QuantizedTensor":
        return QuantizedTensor(self.qtype, self.data.contiguous(), self.cols, self.int8_dot)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows = self.data.shape[0]
        if self.qtype == "Q4_K":
            scale, low, q = decode_q4_k(self.data, rows, self.cols)
            return (q.float() * scale[..., None] + low[..., None]).reshape(rows, self.cols).to(dtype)
        if self.qtype == "Q6_K":
            scales, q = decode_q6_k(self.data, rows, self.cols)
            return (q.float().view(rows, -1, 2, 16) * scales[..., None]).reshape(rows, self.cols).to(dtype)
        return dequantize_blocks(self.qtype, self.data).to(dtype)


def quantize_q8_0(w: torch.Tensor, int8_dot: bool = True) -> QuantizedTensor:
    """A float [rows, cols] matrix (cols a multiple of 32) as Q8_0 blocks, bit-identical to
    gguf's (and ggml's) quantizer: d = max|x| / 127, q = x / d rounded half away from zero."""
    rows, cols = w.shape
    if cols % QBLOCK:
        raise ValueError(f"Q8_0 needs columns in blocks of {QBLOCK}; this matrix has {cols}")
    blocks = w.detach().float().reshape(-1, QBLOCK)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    v = blocks * torch.where(d == 0, torch.zeros_like(d), 1 / d)
    a = v.abs()
    q = v.sign() * (a.floor() + (2 * (a - a.floor())).floor())
    data = torch.cat([d.half().view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=1)
    return QuantizedTensor("Q8_0", data.reshape(rows, -1).contiguous(), cols, int8_dot)


def q5_0_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """GGUF Q5_0 blocks (fp16 d, 32 high bits, 16 bytes of low nibbles; w = (q - 16) d) as Q8_0
    blocks of the same values (int8 q - 16 with the same d): exact, so the Q8 kernels run them;
    8.5 bits a weight instead of 5.5. uint8 [rows, blocks * 22] -> [rows, blocks * 34]."""
    blocks = raw.reshape(*raw.shape[:-1], -1, 22)
    high = (blocks[..., 2:6].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    nibbles = np.concatenate([blocks[..., 6:] & 15, blocks[..., 6:] >> 4], axis=-1)
    q = (nibbles | (high.astype(np.uint8) << 4)).astype(np.int16) - 16
    out = np.concatenate([blocks[..., 0:2], q.astype(np.int8).view(np.uint8)], axis=-1)
    return out.reshape(*raw.shape[:-1], -1)


def quantize_matrices(weights: dict) -> dict:
    """Every float matrix (2-D, columns in whole blocks) as Q8_0 blocks with int8 activations;
    norms, biases, index tables and tensors already quantized are kept as they are."""
    return {name: quantize_q8_0(w) if isinstance(w, torch.Tensor) and w.is_floating_point() and w.dim() == 2
            and w.shape[1] % QBLOCK == 0 else w for name, w in weights.items()}


def cat_rows(parts: list) -> "QuantizedTensor | torch.Tensor":
    """Stack matrices by rows (a fused projection): quantized parts of one type stay quantized.
    Quantized parts of different types (a Q4_K_M file's Q4_K q/k beside a Q6_K v) become one Q8_0
    matrix of their values when they run with int8 activations (an approximation already: ~8 bits
    a weight instead of 32), else fp32, dequantized exactly. Float parts of one dtype keep it (a
    bf16 model's fused q/k/v stays bf16: half the bytes, and CUDA's linear wants the input's
    dtype); any other mix becomes fp32."""
    if all(isinstance(p, QuantizedTensor) for p in parts):
        if len({(p.qtype, p.cols, p.int8_dot) for p in parts}) == 1:
            return QuantizedTensor(parts[0].qtype, torch.cat([p.data for p in parts]), parts[0].cols, parts[0].int8_dot)
        if all(p.int8_dot for p in parts):
            return quantize_q8_0(torch.cat([p.dequantize() for p in parts]))
    if not any(isinstance(p, QuantizedTensor) for p in parts) and len({p.dtype for p in parts}) == 1:
        return torch.cat(parts)
    floats = [p.dequantize() if isinstance(p, QuantizedTensor) else p for p in parts]
    return torch.cat([f.to(torch.promote_types(f.dtype, torch.float32)) for f in floats])


def dequantize_blocks(qtype: str, data: torch.Tensor) -> torch.Tensor:
    """fp32 [rows, blocks * 32] from uint8 [rows, blocks * block bytes] (also for any leading shape)."""
    blocks = data.reshape(*data.shape[:-1], -1, BLOCK_BYTES[qtype])
    d = halves(blocks[..., 0:2])
    if qtype == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).flatten(-2)
    q = _nibbles(blocks[..., -16:]).float()
    if qtype == "Q4_0":
        return ((q - 8) * d).flatten(-2)
    return (q * d + halves(blocks[..., 2:4])).flatten(-2)


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values 0..15: the low nibbles, then the high ones."""
    return torch.cat([b & 15, b >> 4], dim=-1)


def fits_kernels(w: QuantizedTensor) -> bool:
    """Whether w's blocks have a panel form: all do but Q4_0 with a scale beyond Q4_0_MAX_SCALE
    (such a tensor runs dequantized; a NaN or infinite scale is garbage either way)."""
    if w.qtype != "Q4_0":
        return True
    d = w.data.reshape(w.shape[0], -1, BLOCK_BYTES["Q4_0"])[..., 0:2].contiguous().view(torch.float16)
    return not bool((d.float().abs() > Q4_0_MAX_SCALE).any())


def kernel_blocks(w: QuantizedTensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """w's 32-blocks as its kernel format holds them: the scale fields (each [rows, blocks] or
    [rows, blocks, 2], fp16 or fp32) and the quant bytes [rows, blocks, 16 or 32] (nibble bytes
    as Q4_1 packs them; int8 as uint8)."""
    rows, cols = w.shape
    if w.qtype == "Q4_K":
        scale, low, q = decode_q4_k(w.data, rows, cols)
        return [scale, low], q[..., :16] | (q[..., 16:] << 4)
    if w.qtype == "Q6_K":
        scales, q = decode_q6_k(w.data, rows, cols)
        return [scales], q.view(torch.uint8)
    blocks = w.data.reshape(rows, cols // QBLOCK, BLOCK_BYTES[w.qtype])
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if w.qtype == "Q8_0":
        return [d], blocks[..., 2:]
    if w.qtype == "Q4_1":
        return [d, blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]], blocks[..., 4:]
    if not fits_kernels(w):
        raise ValueError(f"Q4_0 scales beyond {Q4_0_MAX_SCALE:g} overflow the Q4 kernels' fp16 min: run it dequantized")
    return [d, d * -8], blocks[..., 2:]  # Q4_0 as Q4_1 with m = -8d (exact in fp16: a power-of-two scaling)


def pack_panels(w: QuantizedTensor, width: int) -> torch.Tensor:
    """uint8 [ceil(rows / width), blocks * panel block bytes]: `width` rows side by side per block
    (each scale field as `width` values in a row, then the quant bytes in groups of
    GROUP[w.int8_dot]: group j of every row together), the layouts of csrc/packed_gemm.c and
    csrc/quant_dot.c; rows padded with zero blocks."""
    scales, quants = kernel_blocks(w)
    pad = -w.shape[0] % width

    def panels(t: torch.Tensor) -> torch.Tensor:  # [rows, blocks, ...] -> [panels, blocks, width, ...]
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
        return t.reshape(-1, width, *t.shape[1:]).transpose(1, 2)

    # A field with two values per block (Q8H's scales per 16) is two fields, one after the other.
    fields = [f for s in scales for f in (s.unbind(-1) if s.dim() == 3 else [s])]
    parts = [panels(f).contiguous().view(torch.uint8) for f in fields]
    g = GROUP[w.int8_dot]
    q = panels(quants)
    parts.append(q.reshape(*q.shape[:3], -1, g).transpose(2, 3))
    n_panels, n_blocks = parts[0].shape[:2]
    return torch.cat([p.reshape(n_panels, n_blocks, -1) for p in parts], dim=-1).reshape(n_panels, -1).contiguous()
