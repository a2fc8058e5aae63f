"""The small building blocks of the Llama-family forward: linear, RMSNorm, RoPE.

`Linear` is where the CPU speed comes from: on CPU with fp32 or bf16 weights it multiplies
through the packed small-M GEMM (engine/csrc/packed_gemm.c), whose cost stays flat from 1 row to
a register tile's height, so verifying K+1 speculative tokens costs about one decode step. It
accumulates in fp32 whatever the weights' type, so a bf16 engine computes the same sums on every
CPU, with or without native bf16 instructions (torch's bf16 matmul picks a different kernel per
CPU). A GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K weights (engine/quant.py) stay in their blocks and go through the
same kernels' quantized tiles, bit-identical to the fp32 path over the dequantized weights.
Elsewhere (CUDA, fp16) it is torch's own `F.linear`.
"""

import math

import torch
import torch.nn.functional as F

from engine import cpu_kernels, huge_pages
from engine.config import ModelConfig
from engine.quant import QuantizedTensor


def share_huge_pages(linears: list["Linear"]) -> None:
    """The packed matrices' panels moved side by side onto huge pages (engine/huge_pages.py): a
    forward streams them all. Before anything keeps their addresses (NativeDecoder.bind)."""
    packed = [lin for lin in linears if lin.packed]
    for lin, weight in zip(packed, huge_pages.gather([lin.weight for lin in packed])):
        lin.weight = weight


def uses_packed_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


class Linear:
    """y = x @ W^T + b, with W stored in the layout the device's fastest GEMM reads.

    `packed_dtype=torch.bfloat16` stores packed CPU weights in bf16 (half the memory traffic,
    fp32 math); the EAGLE3 draft uses it, an fp32 target keeps its weights exact. On the packed
    path the output has the input's dtype, computed in fp32 and rounded once."""

    def __init__(self, weight: "torch.Tensor | QuantizedTensor", bias: torch.Tensor | None = None,
                 packed_dtype: torch.dtype | None = None):
        self.out_features, self.in_features = weight.shape
        self.qtype = weight.qtype if isinstance(weight, QuantizedTensor) else None
        self.int8_dot = self.qtype is not None and weight.int8_dot
        self.packed = self.qtype is not None or uses_packed_gemm(weight.device, weight.dtype)
        if self.qtype is not None:
            if weight.device.type != "cpu":
                raise ValueError(f"{self.qtype} weights run on CPU only; load them dequantized for {weight.device}")
            self.kernels = cpu_kernels.kernels()
            self.weight = self.kernels.pack_quantized(weight)
            bias = bias.float() if bias is not None else None
        elif self.packed:
            # The kernels that pack a weight are the ones that read it (panel width = vector width).
            self.kernels = cpu_kernels.kernels()
            self.weight = self.kernels.pack_weight(weight.to(packed_dtype or weight.dtype))
            bias = bias.float() if bias is not None else None  # the kernel adds an fp32 bias
        else:
            self.weight = weight.contiguous()
        self.bias = bias.contiguous() if bias is not None else None

    def __call__(self, x: torch.Tensor, first_output: int = 0) -> torch.Tensor:
        """first_output: compute only output features [first_output:] (e.g. k and v of a fused
        qkv projection), reading only their weights."""
        bias = self.bias
        if self.packed:
            # Start at the panel holding first_output; drop the columns before it.
            panel, skip = self.panel_of(first_output)
            start = first_output - skip
            bias = bias[start:] if bias is not None else None
            if self.qtype is not None:
                y = self.kernels.quant_gemm(x.float(), self.weight[panel:], self.qtype, self.out_features - start, bias,
                                            self.int8_dot)
            else:
                y = self.kernels.packed_gemm(x.float(), self.weight[panel:], self.out_features - start, bias)
            y = y.to(x.dtype)
            return y[:, skip:] if skip else y
        if first_output:
            bias = bias[first_output:] if bias is not None else None
            return F.linear(x, self.weight[first_output:], bias)
        return F.linear(x, self.weight, bias)

    def panel_of(self, feature: int) -> tuple[int, int]:
        """Packed weights: the panel holding output `feature`, and the features before it there."""
        return divmod(feature, self.kernels.pack_width)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of W (an embedding lookup when the head is tied to the embeddings); fp32 for
        quantized weights."""
        if self.qtype is not None:
            return self.kernels.panel_rows(self.weight, self.qtype, self.in_features, ids, self.int8_dot)
        if self.packed:
            return cpu_kernels.unpack_rows(self.weight, ids)
        return self.weight[ids]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim/2], with Llama-3.1-style scaling when configured (the
    only scaling ModelConfig lets through)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.float()
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled).float()


class Rotary:
    """Rotate-half RoPE (HF convention) from a precomputed cos/sin table."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype):
        inv_freq = rope_inv_freq(config)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions`, shaped [T, 1, D] to broadcast over heads; gathered once per forward."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D]."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
