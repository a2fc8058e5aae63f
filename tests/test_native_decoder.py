"""The native decoder step (engine/csrc/decoder_step.c) against the torch layer loop it replaces
for short-query batches: same logits, same EAGLE3 auxiliary hidden states, same KV written."""

import random

import pytest
import torch

from engine.batch import SeqChunk


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1])
def test_native_step_matches_the_torch_layers(engine, seed):
    """A batch of single-token decodes, a 5-token chain crossing a block boundary and a tree
    span, with auxiliary hidden states: both paths give the same outputs and cache contents."""
    model, blocks, bs = engine.runner.model, engine.blocks, engine.config.block_size
    assert model.native is not None  # the default CPU fp32 engine runs it
    rng = random.Random(seed)
    prefixes = {"a": _tokens(rng, 20), "b": _tokens(rng, 2 * bs - 2), "c": _tokens(rng, 9), "d": _tokens(rng, 33)}
    spans = {"a": (_tokens(rng, 1), None), "b": (_tokens(rng, 5), None), "c": (_tokens(rng, 1), None),
             "d": (_tokens(rng, 4), [-1, -1, 0])}  # the root, two children of it, a grandchild
    try:
        for s, prefix in prefixes.items():
            blocks.allocate(s, prefix)
            engine.runner.forward([SeqChunk(prefix, 0, blocks.block_table(s), 1)])
            blocks.commit(s, prefix)
            assert blocks.reserve(s, len(spans[s][0]))
        chunks = [SeqChunk(tokens, len(prefixes[s]), blocks.block_table(s), len(tokens), parents)
                  for s, (tokens, parents) in spans.items()]
        native = engine.runner.forward(chunks, return_aux=True)
        written = engine.runner.kv_cache.clone()
        saved, model.native = model.native, None
        try:
            torch_path = engine.runner.forward(chunks, return_aux=True)
        finally:
            model.native = saved
        assert torch.allclose(native.logits, torch_path.logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(native.logits.argmax(-1), torch_path.logits.argmax(-1))
        assert torch.allclose(native.aux_hidden, torch_path.aux_hidden, rtol=1e-4, atol=1e-4)
        assert torch.allclose(written, engine.runner.kv_cache, rtol=1e-4, atol=1e-5)
    finally:
        for s in prefixes:
            blocks.rollback(s)
            blocks.free(s)


def test_prefill_chunks_take_the_torch_layers(engine):
    """Long queries are not the native step's: the torch loop (with SDPA) runs them."""
    chunk = SeqChunk(list(range(100, 140)), 0, [0, 1, 2], 1)
    from engine.batch import build_batch

    batch = build_batch([chunk], engine.config.block_size, torch.device("cpu"))
    assert batch.attention.long and not engine.runner.model.native.applies(batch)
