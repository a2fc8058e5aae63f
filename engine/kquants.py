"""GGUF's K-quant super-blocks (256 weights; what most published `Q4_K_M` files hold) decoded
into the 32-weight blocks the kernels stream, with fp32 scales that hold ggml's products exactly:

- Q4_K (144 bytes): fp16 d and dmin, twelve bytes of 6-bit scales sc[8] and mins m[8], 128 bytes
  of nibbles; sub-block j of 32: w = (d sc_j) q - (dmin m_j). As a Q4 block with fp32 scale
  d sc_j and min -(dmin m_j): an fp16 times a 6-bit integer needs 17 bits, so fp16 cannot hold it.
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, sixteen int8 scales, fp16
  d; sub-block j of 16: w = (d sc_j)(q - 32). As an int8 block q - 32 with two fp32 scales.

`decode_*` return (scale fields, quants) per 32-block, the fields as fp32 [rows, blocks, n]; the
products are rounded as gguf's own dequantization rounds them, so dequantizing the decoded
blocks is bit-identical to it.
"""

import torch

QK_K = 256


def halves(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [..., 1] fp32 of the little-endian fp16 they hold (every GGUF block's scales)."""
    return b.contiguous().view(torch.float16).float()


def _q4_k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] packed bytes -> 6-bit scales and mins [..., 8] (ggml's get_scale_min_k4)."""
    s = s.to(torch.int32)
    low, high = s[..., 0:4], s[..., 4:8]  # bytes 0-3: sc 0-3 (+2 bits of sc 4-7); 4-7: m 0-3 (+2 bits of m 4-7)
    tail = s[..., 8:12]  # sc 4-7 (low nibble) and m 4-7 (high nibble), 4 bits each
    sc = torch.cat([low & 63, (tail & 15) | ((low >> 6) << 4)], dim=-1)
    mins = torch.cat([high & 63, (tail >> 4) | ((high >> 6) << 4)], dim=-1)
    return sc.float(), mins.float()


def decode_q4_k(data: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 [rows, cols / 256 * 144] -> scale, min fp32 [rows, cols / 32] and the quants 0..15
    uint8 [rows, cols / 32, 32] in k order."""
    blocks = data.reshape(rows, cols // QK_K, 144)
    d, dmin = halves(blocks[..., 0:2]), halves(blocks[..., 2:4])
    sc, mins = _q4_k_scales(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(rows, cols // QK_K, 4, 1, 32)  # four runs of 64 weights: low nibbles, then high
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(rows, cols // 32, 32)
    return (d * sc).reshape(rows, -1), (-(dmin * mins)).reshape(rows, -1), q


def decode_q6_k(data: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [rows, cols / 256 * 210] -> scales fp32 [rows, cols / 32, 2] (one per 16 weights) and
    the quants q - 32 int8 [rows, cols / 32, 32] in k order."""
    blocks = data.reshape(rows, cols // QK_K, 210)
    n = cols // QK_K
    # Weight 128c + r (c: half of the super-block) has its low 4 bits in byte 64c + r % 64 of ql
    # (nibble r // 64) and its high 2 bits in byte 32c + r % 32 of qh (bits 2 (r // 32)).
    ql = blocks[..., 0:128].reshape(rows, n, 2, 1, 64)
    low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(rows, n, 2, 128)
    qh = blocks[..., 128:192].reshape(rows, n, 2, 1, 32)
    high = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=3).reshape(rows, n, 2, 128)
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(rows, cols // 32, 32)
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    d = halves(blocks[..., 208:210])
    return (d * scales).reshape(rows, cols // 32, 2), q
