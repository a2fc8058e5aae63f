"""Weights kept in a GGUF's block-quantized form: the tensor type, its dequantization, and the
repack into the panels the CPU kernels stream (engine/csrc/packed_gemm.c, quant_dot.c).

A GGUF stores a matrix [rows, cols] as rows of 32-weight blocks. The formats kept as they are:
- Q8_0: fp16 scale d, 32 int8 q                      -> w = q * d          (34 bytes per block)
- Q4_0: fp16 d, 16 bytes of nibbles                   -> w = (q - 8) * d    (18 bytes)
- Q4_1: fp16 d, fp16 min m, 16 bytes of nibbles       -> w = q * d + m      (20 bytes)
(nibble byte j holds element j in its low half and j + 16 in its high half). `dequantize` here
gives the fp32 values gguf's own dequantization gives. The exact kernels widen each weight to
that value, so their GEMM is bit-identical to the fp32 GEMM over `dequantize(w)`; with `int8_dot`
the activations are quantized to int8 per block instead and the dots are integer (llama.cpp's
arithmetic).
"""

from dataclasses import dataclass

import torch

QBLOCK = 32
BLOCKS_FILE = "gguf/blocks.safetensors"  # in a converted GGUF's directory (engine/gguf_convert.py)
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
QUANT_TYPES = tuple(BLOCK_BYTES)
# The kernels' two panel formats: Q8 (scale only) and Q4 (scale and min; Q4_0 becomes m = -8d).
KERNEL_FORMAT = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}
# A panel's bytes per column and block, per kernel format (Q8_BYTES, Q4_BYTES in csrc/kernels.h).
PANEL_BLOCK_BYTES = {8: 34, 4: 20}
# Bytes of a column kept together in a panel: one for the exact kernel (a vector of columns per k),
# four for the int8 dot products (one 32-bit lane per column, its next 4 k values).
GROUP = {False: 1, True: 4}


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
        if self.cols % QBLOCK or self.data.shape[1] != self.cols // QBLOCK * BLOCK_BYTES[self.qtype]:
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
        if step != 1 or start % QBLOCK or stop % QBLOCK:
            raise ValueError(f"{self.qtype} columns can only be sliced at multiples of {QBLOCK} (got {start}:{stop})")
        size = BLOCK_BYTES[self.qtype]
        return QuantizedTensor(self.qtype, data[:, start // QBLOCK * size : stop // QBLOCK * size], stop - start,
                               self.int8_dot)

    def contiguous(self) -> "QuantizedTensor":
        return QuantizedTensor(self.qtype, self.data.contiguous(), self.cols, self.int8_dot)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
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


def quantize_matrices(weights: dict) -> dict:
    """Every float matrix (2-D, columns in whole blocks) as Q8_0 blocks with int8 activations;
    norms, biases, index tables and tensors already quantized are kept as they are."""
    return {name: quantize_q8_0(w) if isinstance(w, torch.Tensor) and w.is_floating_point() and w.dim() == 2
            and w.shape[1] % QBLOCK == 0 else w for name, w in weights.items()}


def cat_rows(parts: list) -> "QuantizedTensor | torch.Tensor":
    """Stack matrices by rows (a fused projection): quantized parts of one type stay quantized;
    float parts, or quantized parts of different types, become fp32 (dequantized exactly)."""
    if all(isinstance(p, QuantizedTensor) for p in parts) and len({(p.qtype, p.cols, p.int8_dot) for p in parts}) == 1:
        return QuantizedTensor(parts[0].qtype, torch.cat([p.data for p in parts]), parts[0].cols, parts[0].int8_dot)
    floats = [p.dequantize() if isinstance(p, QuantizedTensor) else p for p in parts]
    return torch.cat([f.to(torch.promote_types(f.dtype, torch.float32)) for f in floats])


def dequantize_blocks(qtype: str, data: torch.Tensor) -> torch.Tensor:
    """fp32 [rows, blocks * 32] from uint8 [rows, blocks * block bytes] (also for any leading shape)."""
    blocks = data.reshape(*data.shape[:-1], -1, BLOCK_BYTES[qtype])
    d = _halves(blocks[..., 0:2])
    if qtype == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).flatten(-2)
    q = _nibbles(blocks[..., -16:]).float()
    if qtype == "Q4_0":
        return ((q - 8) * d).flatten(-2)
    return (q * d + _halves(blocks[..., 2:4])).flatten(-2)


def _halves(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [..., 1] fp32 of the little-endian fp16 they hold."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values 0..15: the low nibbles, then the high ones."""
    return torch.cat([b & 15, b >> 4], dim=-1)


def pack_panels(w: QuantizedTensor, width: int) -> torch.Tensor:
    """uint8 [ceil(rows / width), blocks * panel block bytes]: `width` rows side by side per block,
    their quant bytes in groups of GROUP[w.int8_dot] (the layouts of csrc/packed_gemm.c and
    csrc/quant_dot.c; rows padded with zero blocks)."""
    rows, cols = w.shape
    blocks = w.data.reshape(rows, cols // QBLOCK, BLOCK_BYTES[w.qtype])
    pad = -rows % width
    if pad:
        blocks = torch.cat([blocks, blocks.new_zeros(pad, *blocks.shape[1:])])
    # [panels, blocks, width, block bytes]: one block of every row of a panel together.
    blocks = blocks.reshape(-1, width, *blocks.shape[1:]).transpose(1, 2)
    d = blocks[..., 0:2]
    if w.qtype == "Q8_0":
        scales, quants = [d], blocks[..., 2:]
    elif w.qtype == "Q4_1":
        scales, quants = [d, blocks[..., 2:4]], blocks[..., 4:]
    else:  # Q4_0 as Q4_1 with m = -8d (exact in fp16: a power-of-two scaling)
        scales, quants = [d, (_halves(d) * -8).half().view(torch.uint8)], blocks[..., 2:]
    # Scales: `width` fp16 values in a row. Quants [.., width, n] -> [.., n / g, width, g]: group j of every row together.
    g = GROUP[w.int8_dot]
    quants = quants.reshape(*quants.shape[:3], -1, g).transpose(2, 3)
    parts = [s.reshape(*s.shape[:2], -1) for s in scales] + [quants.reshape(*quants.shape[:2], -1)]
    return torch.cat(parts, dim=-1).reshape(blocks.shape[0], -1).contiguous()
