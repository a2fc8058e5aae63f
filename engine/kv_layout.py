"""The one description of a worker's KV cache, shared by the workers and kvtransfer.

Memory layout (target and draft alike): a block-major tensor
    [num_blocks, num_layers, 2 (key, value), block_size, num_kv_heads, head_dim]
so one block of one cache is a single contiguous run of `block_bytes` bytes: a KV transfer moves
one region per block, and a NIXL descriptor is (base + block_id * block_bytes, block_bytes).
The draft (EAGLE3) cache is a second tensor indexed by the same block ids.
"""

from dataclasses import dataclass, fields

import torch


class KVLayoutMismatch(ValueError):
    """Two workers' caches cannot exchange blocks; the message names the differing field."""


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class KVLayout:
    model: str  # identity of the weights the KV was computed with
    dtype: str  # torch dtype name, e.g. "float32"
    block_size: int
    target: CacheShape
    draft: CacheShape | None  # None when no EAGLE3 head is loaded

    def block_shape(self, cache: CacheShape) -> tuple[int, ...]:
        return (cache.num_layers, 2, self.block_size, cache.num_kv_heads, cache.head_dim)

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
    return torch.zeros((num_blocks, *layout.block_shape(cache)), dtype=getattr(torch, layout.dtype), device=device)
