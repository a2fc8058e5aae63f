"""CPU memory the kernels stream every step (packed weights, the KV cache) on 2 MiB pages.

Why: a decode step reads every weight and its sequences' KV blocks, all of it spread over 4 KiB
pages, and the KV cache's reads hop between blocks hundreds of KiB apart (a block holds every
layer): with the TLB covering a few MiB, most pages cost a page walk. Linux backs anonymous
memory with transparent huge pages where asked (`transparent_hugepage=madvise`, a common
default, gives torch's allocations none), so this memory is mapped here and advised. Where the
kernel has them off, or off Linux, the same calls give ordinary pages: the bytes and their
layout are the same either way.
"""

import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor in a shared mapping starts on a cache line


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on huge pages (anonymous memory comes zeroed)."""
    return _mapping(torch.Size(shape).numel() * dtype.itemsize).view(dtype).view(shape)


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (contiguous, CPU) side by side in one mapping on huge pages: one for a
    model's matrices, so the small ones share pages instead of each rounding up to its own."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.nbytes // ALIGN) * ALIGN
    memory = _mapping(total)
    return [memory[offset : offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
            for t, offset in zip(tensors, offsets)]


def _mapping(nbytes: int) -> torch.Tensor:
    """uint8 [>= nbytes] starting on a huge page boundary; the mapping lives as long as a view of it."""
    size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to align the start
    # Private: a shared mapping is shmem, whose huge pages another switch (usually "never") governs.
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; before the first touch: the pages are chosen then
        mapping.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping
    start = -memory.data_ptr() % HUGE_PAGE
    return memory[start : start + nbytes]
