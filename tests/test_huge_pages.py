"""The memory a decode step streams (packed weights, the KV cache) is mapped on 2 MiB pages where
the kernel gives them (engine/huge_pages.py), with the same bytes as ordinary memory."""

from pathlib import Path

import pytest
import torch

from engine import huge_pages
from engine.config import EngineConfig
from engine.engine import Engine

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                               reason="this kernel gives no transparent huge pages")


def huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping holding t's first byte, from /proc/self/smaps."""
    address, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and ":" not in first:
            start, end = (int(x, 16) for x in first.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_gathered_tensors_keep_their_values_each_on_a_cache_line():
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int16), torch.randn(64, 33).to(torch.bfloat16)]
    copies = huge_pages.gather(tensors)
    assert all(torch.equal(t, c) and c.dtype == t.dtype for t, c in zip(tensors, copies))
    assert all(c.data_ptr() % huge_pages.ALIGN == 0 for c in copies)
    assert copies[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not huge_pages.zeros((5, 3), torch.float32).any()


@needs_thp
def test_a_decode_step_streams_huge_pages():
    engine = Engine(EngineConfig(num_kv_blocks=64, max_num_seqs=2))
    model = engine.runner.model
    engine.runner.kv_cache.zero_()  # every page faulted in (untouched memory has none yet)
    streamed = {"kv cache": engine.runner.kv_cache, "a layer's qkv": model.layers[0].qkv.weight,
                "the lm_head": model.lm_head.weight}
    assert {name: huge_kib(t) >= 2048 for name, t in streamed.items()} == {name: True for name in streamed}
