"""The native decoder step (engine/csrc/decoder_step.c) against the torch layer loop it replaces
for short-query batches: same logits, same EAGLE3 auxiliary hidden states, same KV written.

On the exact engine: the two loops round their norms differently (~1e-7), and the default
engine's int8 activation quantization would turn that into a rounding step now and then."""

import random
from contextlib import contextmanager

import pytest
import torch

from engine.batch import SeqChunk
from engine.kv_layout import SCALE_BYTES, decode_rows


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


@contextmanager
def _prefilled(engine, prefixes: dict[str, list[int]], room: dict[str, int]):
    """Each prefix computed into the cache (none found cached by an earlier test), with room for
    room[seq] more tokens; everything rolled back and freed after."""
    blocks, allocated = engine.blocks, []
    blocks.clear_prefix_cache()
    try:
        for s, prefix in prefixes.items():
            blocks.allocate(s, prefix)
            allocated.append(s)
            engine.runner.forward([SeqChunk(prefix, 0, blocks.block_table(s), 1)])
            blocks.commit(s, prefix)
            assert blocks.reserve(s, room[s])
        yield
    finally:
        for s in allocated:
            blocks.rollback(s)
            blocks.free(s)
        blocks.clear_prefix_cache()


@pytest.mark.parametrize("seed", [0, 1])
def test_native_step_matches_the_torch_layers(exact_engine, seed):
    """A batch of single-token decodes, a 5-token chain crossing a block boundary and a tree
    span, with auxiliary hidden states: both paths give the same outputs and cache contents."""
    engine = exact_engine
    model, blocks, bs = engine.runner.model, engine.blocks, engine.config.block_size
    assert model.native is not None  # the default CPU fp32 engine runs it
    rng = random.Random(seed)
    prefixes = {"a": _tokens(rng, 20), "b": _tokens(rng, 2 * bs - 2), "c": _tokens(rng, 9), "d": _tokens(rng, 33)}
    spans = {"a": (_tokens(rng, 1), None), "b": (_tokens(rng, 5), None), "c": (_tokens(rng, 1), None),
             "d": (_tokens(rng, 4), [-1, -1, 0])}  # the root, two children of it, a grandchild
    with _prefilled(engine, prefixes, {s: len(tokens) for s, (tokens, _) in spans.items()}):
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
        assert torch.allclose(written, engine.runner.kv_cache, rtol=1e-4, atol=1e-4)


def test_a_row_computes_the_same_bits_however_it_is_batched(engine):
    """The default engine (int8 activations): a prompt prefilled in one chunk or in three, and
    its next token decoded alone or beside another sequence's prefill chunk, give bit-identical
    KV and logits. (With two paths, a last-bit difference could turn into a different token.)"""
    rng = random.Random(3)
    blocks, prompt, other = engine.blocks, _tokens(rng, 45), _tokens(rng, 30)
    blocks.clear_prefix_cache()
    runs = []
    for chunks, beside in (([45], False), ([20, 9, 16], True)):
        blocks.allocate("x", prompt)
        try:
            start = 0
            for n in chunks:
                out = engine.runner.forward([SeqChunk(prompt[start : start + n], start, blocks.block_table("x"), 1)])
                start += n
            blocks.commit("x", prompt)
            assert blocks.reserve("x", 1)
            step = [SeqChunk([prompt[-1] + 1], len(prompt), blocks.block_table("x"), 1)]
            if beside:
                blocks.allocate("y", other)
                step.append(SeqChunk(other, 0, blocks.block_table("y"), 1))
            decoded = engine.runner.forward(step).logits[0]
            table, bs = blocks.block_table("x"), engine.runner.config.block_size
            written = [(table[p // bs], p % bs) for p in range(len(prompt) + 1)]  # a block's other slots: stale
            kv = torch.stack([engine.runner.kv_cache[b, :, :, o] for b, o in written])
            runs.append((out.logits[-1], decoded, kv))
        finally:
            blocks.rollback("x")
            blocks.free("x")
            if beside:
                blocks.free("y")
        blocks.clear_prefix_cache()
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_the_layer_loop_computes_the_same_bits_on_one_or_two_threads(engine):
    """From 4 rows on, the per-row work between the GEMMs (norms, RoPE, cache writes, SiLU,
    residual adds) is split between the threads (decoder_step.c, FOR_ROWS); with the GEMMs and
    attention (thread-invariant already), a forward gives the same logits, features and KV on one
    thread as on two."""
    rng = random.Random(5)
    blocks, prompts = engine.blocks, {"a": _tokens(rng, 40), "b": _tokens(rng, 23)}
    threads = torch.get_num_threads()
    with _prefilled(engine, prompts, {"a": 5, "b": 5}):
        step = [SeqChunk(_tokens(rng, 1), 40, blocks.block_table("a"), 1),
                SeqChunk(_tokens(rng, 5), 23, blocks.block_table("b"), 5)]  # 6 rows
        runs = []
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                out = engine.runner.forward(step, return_aux=True)
                runs.append((out.logits, out.aux_hidden, engine.runner.kv_cache.clone()))
        finally:
            torch.set_num_threads(threads)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_the_native_draft_midlayer_matches_its_torch_layer():
    """The EAGLE3 head's midlayer (its attention input given, 2H wide) through the native step:
    the same hidden states, logits and draft-cache entries as the torch layer, for a multi-row
    first forward and the one-row chain steps after it. On the exact engine, as the target's test:
    with int8 activations the two paths' ~1e-7 norm differences turn into a rounding step of an
    activation now and then."""
    from engine.config import EngineConfig
    from engine.engine import Engine

    engine = Engine(EngineConfig(speculative={"method": "eagle3"}, num_kv_blocks=64, quantization="exact"))
    runner, draft, blocks = engine.runner, engine.runner.draft, engine.blocks
    assert draft.native is not None
    rng = random.Random(0)
    prompt = _tokens(rng, 21)
    blocks.allocate("s", prompt)
    assert blocks.reserve("s", 3)
    table = blocks.block_table("s")
    g = torch.Generator().manual_seed(0)
    steps = [(SeqChunk(prompt[1:] + [7], 0, table, 3), torch.randn(21, draft.config.layer.hidden_size, generator=g)),
             (SeqChunk([9], 21, table, 1), torch.randn(1, draft.config.layer.hidden_size, generator=g))]
    results = {}
    for path in ("native", "torch"):
        saved = draft.native
        draft.native = saved if path == "native" else None
        try:
            outs = [runner.forward_draft([chunk], hidden) for chunk, hidden in steps]
        finally:
            draft.native = saved
        results[path] = (outs, runner.draft_cache.clone())
    (native, native_cache), (reference, reference_cache) = results["native"], results["torch"]
    for a, b in zip(native, reference):
        assert torch.allclose(a.hidden, b.hidden, rtol=1e-4, atol=1e-4)
        assert torch.allclose(a.logits, b.logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))
    assert torch.allclose(native_cache, reference_cache, rtol=1e-4, atol=1e-4)
    engine.close()


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_the_native_draft_kv_write_is_what_a_draft_forward_writes(kv_cache_dtype):
    """The draft's catch-up (keys and values alone, in one native call) writes the bits a whole
    native midlayer forward writes at the same positions, and nothing anywhere else; the torch
    KV-only write agrees within rounding. An int8 cache's rows (values, then their fp32 scale)
    come out of C and torch in one format: the same bytes but where the two paths' ~1e-7
    differences cross a rounding boundary, and never more than one step apart."""
    from engine.config import EngineConfig
    from engine.engine import Engine

    engine = Engine(EngineConfig(speculative={"method": "eagle3"}, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype,
                                 quantization="exact"))
    runner, draft, blocks = engine.runner, engine.runner.draft, engine.blocks
    prompt = _tokens(random.Random(1), 37)  # past two blocks' boundaries
    blocks.allocate("s", prompt)
    chunk = SeqChunk(prompt[1:], 0, blocks.block_table("s"), num_logits=0)
    hidden = torch.randn(36, draft.config.layer.hidden_size, generator=torch.Generator().manual_seed(1))
    caches = {}
    for how in ("forward", "native", "torch"):
        runner.draft_cache.zero_()
        saved = draft.native
        draft.native = None if how == "torch" else saved
        try:
            if how == "forward":
                runner.forward_draft([chunk], hidden)
            else:
                runner.write_draft_kv([chunk], hidden)
        finally:
            draft.native = saved
        caches[how] = runner.draft_cache.clone()
    assert caches["native"].abs().sum() > 0
    assert torch.equal(caches["native"], caches["forward"])
    table, positions, bs = torch.tensor(blocks.block_table("s")), torch.arange(36), engine.config.block_size
    written = {how: c[table[positions // bs], :, :, positions % bs] for how, c in caches.items()}  # the 36 positions
    native, reference = (decode_rows(caches[how], torch.float32) for how in ("native", "torch"))
    if kv_cache_dtype == "int8":
        assert (written["native"] == written["torch"]).float().mean() > 0.99
        step = caches["torch"][..., -SCALE_BYTES:].contiguous().view(torch.float32)  # a row's quantization step
        assert ((native - reference).abs() <= 1.01 * step + 1e-6).all()
    else:  # where the paths' ~1e-7 differences cross a bf16 rounding boundary: one bf16 step apart
        assert torch.allclose(native, reference, rtol=2**-7, atol=1e-6)
    engine.close()


def test_native_entries_refuse_inputs_they_would_misread(engine):
    """The layer loop writes x in place through its pointer, as wide as the model: rows of another
    width or dtype were overrun or misread. A GEMM asked for more outputs than its packed rows, or
    draws from rows outside the logits, read past their buffers."""
    from engine.batch import build_batch
    from engine.cpu_kernels import kernels

    native, blocks = engine.runner.model.native, engine.blocks
    blocks.allocate("x", [5, 6, 7])
    try:
        batch = build_batch([SeqChunk([5, 6, 7], 0, blocks.block_table("x"), 1)], engine.config.block_size,
                            torch.device("cpu"))
        hidden = engine.runner.model_config.hidden_size
        for x in (torch.zeros(3, hidden + 8), torch.zeros(3, hidden, dtype=torch.bfloat16)):
            with pytest.raises(ValueError, match="NativeDecoder: x is"):
                native.layers(x, batch, engine.runner.kv_cache, [])
    finally:
        blocks.free("x")
    k = kernels()
    packed = k.pack_weight(torch.randn(2 * k.pack_width, 8))
    with pytest.raises(ValueError, match="packed rows"):
        k.packed_gemm(torch.randn(1, 8), packed, 3 * k.pack_width)
    with pytest.raises(ValueError, match="inverse_cdf"):
        k.inverse_cdf(torch.rand(2, 10), [0, 2], torch.rand(2))
