"""The one description of a worker's KV cache, shared by the workers and kvtransfer.

Memory layout (target and draft alike): a block-major tensor
    [num_blocks, num_layers, 2 (key, value), block_size, num_kv_heads, row]
so one block of one cache is a single contiguous run of `block_bytes` bytes: a KV transfer moves
one region per block, and a NIXL descriptor is (base + block_id * block_bytes, block_bytes).
The draft (EAGLE3) cache is a second tensor indexed by the same block ids.

A row is one head's key or value at one position: head_dim elements of the cache's dtype, and in
an int8 cache 4 more bytes, the row's fp32 scale s (values round-half-even(x / s) within +-127,
s = max|x| / 127: one scale per row, where llama.cpp's q8_0 cache has an fp16 scale per 32). The
scale travels inside its row, so a block stays one contiguous run and a transfer or a KV move
copies rows whole. encode_rows and decode_rows are the torch side of that format; the C kernels
write and read the same bytes.
"""

from dataclasses import dataclass, fields

import torch

from engine import huge_pages


class KVLayoutMismatch(ValueError):
    """Two workers' caches cannot exchange blocks; the message names the differing field."""


SCALE_BYTES = 4  # an int8 row's trailing fp32 scale


def row_elements(dtype: str, head_dim: int) -> int:
    """Elements (of the cache's dtype) in one head's key or value row."""
    return head_dim + SCALE_BYTES if dtype == "int8" else head_dim


def encode_rows(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim] floats as a cache of `cache_dtype` stores them ([..., row])."""
    if cache_dtype != torch.int8:
        return x.to(cache_dtype)
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax.isfinite(), amax / 127, torch.nan)  # a NaN or inf in the row: it reads back NaN
    values = torch.where(scale > 0, torch.round(x / scale), 0).clamp(-127, 127).to(torch.int8)
    return torch.cat([values, scale.view(torch.int8)], -1)


def decode_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row] back to [..., head_dim] of `dtype`."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class KVLayout:
    model: str  # identity of the weights the KV was computed with
    dtype: str  # torch dtype name: "float32", "bfloat16" or "int8"
    block_size: int
    target: CacheShape
    draft: CacheShape | None  # None when no EAGLE3 head is loaded
    # Identity of the EAGLE3 head's weights ("" without one): two heads of one shape compute other
    # draft KV, which would only cost acceptance, silently.
    draft_model: str = ""

    def block_shape(self, cache: CacheShape) -> tuple[int, ...]:
        return (cache.num_layers, 2, self.block_size, cache.num_kv_heads, row_elements(self.dtype, cache.head_dim))

    def block_bytes(self, cache: CacheShape) -> int:
        elements = 1
        for n in self.block_shape(cache):
            elements *= n
        return elements * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def bytes_per_block(self) -> int:
        """One block of positions across every cache (what a KV transfer moves per block)."""
        return sum(self.block_bytes(cache) for cache in self.caches().values())

    def caches(self) -> dict[str, CacheShape]:
        """The caches a block spans, by name ("target", and "draft" when present)."""
        return {"target": self.target} | ({"draft": self.draft} if self.draft else {})

    def check_compatible(self, other: "KVLayout") -> None:
        """Raise KVLayoutMismatch naming the first field that differs."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                raise KVLayoutMismatch(f"KV layout field {f.name!r} differs: local {mine}, remote {theirs}")


def allocate_cache(layout: KVLayout, cache: CacheShape, num_blocks: int, device: torch.device) -> torch.Tensor:
    shape, dtype = (num_blocks, *layout.block_shape(cache)), getattr(torch, layout.dtype)
    if device.type == "cpu":  # read all over every step: see engine/huge_pages.py
        return huge_pages.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)
