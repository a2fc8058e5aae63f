"""Paged forward over mixed batches == a contiguous, cache-free forward of each whole sequence.

The reference is transformers' forward over each sequence's full token list (no KV cache at
all); ours runs prefixes first, then one mixed batch of fresh prefills, chunked prefills over a
cached prefix, single-token decodes, 5-token verification spans crossing block boundaries and a
sequence sharing another's prefix blocks through the prefix cache.
"""

import random

import pytest
import torch

from engine.batch import SeqChunk



def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _run(engine, items: list[tuple[str, list[int], int]]) -> torch.Tensor:
    """items: (seq_id, new tokens, start); reserves their slots, runs one forward, commits."""
    chunks = []
    for seq_id, tokens, start in items:
        missing = len(tokens) - engine.blocks.num_reserved(seq_id)
        if missing > 0:
            assert engine.blocks.reserve(seq_id, missing)
        chunks.append(SeqChunk(tokens, start, engine.blocks.block_table(seq_id), num_logits=len(tokens)))
    logits = engine.runner.forward(chunks).logits
    for seq_id, tokens, _ in items:
        engine.blocks.commit(seq_id, tokens)
    return logits


def _reference(hf_model, full: list[int], n_new: int) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([full])).logits[0, -n_new:]


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch_matches_contiguous_forward(exact_engine, hf_model, seed):
    rng = random.Random(seed)
    bs = exact_engine.config.block_size
    exact_engine.blocks.clear_prefix_cache()
    shared = _tokens(rng, 2 * bs)
    prefixes = {  # seq -> tokens already in the cache before the mixed batch
        "B": _tokens(rng, 2 * bs), "C": _tokens(rng, 30), "D": _tokens(rng, 2 * bs - 2),
        "F": shared, "G": _tokens(rng, 3 * bs + 3),
    }
    for seq_id, prefix in prefixes.items():
        exact_engine.blocks.allocate(seq_id, prefix[:1])
        _run(exact_engine, [(seq_id, prefix[:1], 0)])
        _run(exact_engine, [(seq_id, prefix[1:], 1)])
    new = {"A": _tokens(rng, 40), "B": _tokens(rng, 9), "C": _tokens(rng, 1), "D": _tokens(rng, 5),
           "E": _tokens(rng, 20), "G": _tokens(rng, 20)}
    exact_engine.blocks.allocate("A", new["A"])
    assert exact_engine.blocks.allocate("E", shared + new["E"]) == len(shared)  # shares F's blocks
    assert exact_engine.blocks.block_table("E")[:2] == exact_engine.blocks.block_table("F")[:2]
    full = {s: prefixes.get(s, shared if s == "E" else []) + new[s] for s in new}
    order = ["C", "A", "D", "B", "E", "G"]
    try:
        logits = _run(exact_engine, [(s, new[s], len(full[s]) - len(new[s])) for s in order])
        row = 0
        for s in order:
            ref = _reference(hf_model, full[s], len(new[s]))
            ours = logits[row : row + len(new[s])]
            row += len(new[s])
            assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-3, s
    finally:
        for s in list(prefixes) + ["A", "E"]:
            exact_engine.blocks.free(s)


def test_uniform_decode_batch_matches(exact_engine, hf_model):
    """The dense fast path: every sequence decodes one token (no row gather/scatter)."""
    rng = random.Random(7)
    seqs = {f"d{i}": _tokens(rng, 17 + 5 * i) for i in range(3)}
    try:
        for s, toks in seqs.items():
            exact_engine.blocks.allocate(s, toks[:-1])
            _run(exact_engine, [(s, toks[:-1], 0)])
        logits = _run(exact_engine, [(s, toks[-1:], len(toks) - 1) for s, toks in seqs.items()])
        for i, toks in enumerate(seqs.values()):
            ref = _reference(hf_model, toks, 1)
            assert ((logits[i] - ref[0]).abs().max() / ref.abs().max()).item() <= 1e-3
    finally:
        for s in seqs:
            exact_engine.blocks.free(s)
