"""Speculation beyond a plain chain, end to end: confidence thresholds, chains with leaves, EAGLE-2's
dynamic trees and static token trees, each lossless against plain greedy decoding
(test_draft_tree.py: the tree's construction alone)."""

import pytest

from engine.config import EngineConfig, SpeculativeConfig
from engine.engine import Engine
from engine.params import SamplingParams
from tests.engine_runs import run_requests


def test_a_confidence_threshold_ends_chains_early_and_stays_lossless(spec_prompts, spec_plain_outputs):
    """With the shipped head, a threshold drafts fewer tokens, a larger share of them accepted; in a
    batch of B the threshold is B times higher per sequence, so fewer still are drafted, and none
    once it reaches 1 (the draft's cache is still brought up to date, for when the batch shrinks)."""
    params = SamplingParams(max_tokens=32)

    def run(threshold: float, which: list[int], batched: bool, batch_limit: int | None = None) -> tuple[int, int]:
        engine = Engine(EngineConfig(num_kv_blocks=256, speculative={
            "adaptive": False, "method": "eagle3", "num_speculative_tokens": 5, "draft_confidence_threshold": threshold,
            "disable_by_batch_size": batch_limit}))
        chosen = [spec_prompts[i] for i in which]
        outs = (run_requests(engine, chosen, [params] * len(chosen)) if batched
                else [run_requests(engine, [p], [params])[0] for p in chosen])
        assert outs == [spec_plain_outputs[i] for i in which]
        assert engine.blocks.num_used_blocks == 0
        return engine.counters["draft_tokens"], engine.counters["accepted_tokens"]

    drafted_all, accepted_all = run(0.0, [0, 1, 2, 3], batched=False)
    drafted, accepted = run(0.1, [0, 1, 2, 3], batched=False)
    assert 0 < drafted < drafted_all
    assert accepted / drafted > accepted_all / drafted_all
    assert run(0.1, [0, 1, 2, 3], batched=True)[0] < drafted
    long, short = 0, 1
    assert len(spec_plain_outputs[long]) == 32 > len(spec_plain_outputs[short])
    assert run(0.5, [long, 2], batched=True)[0] == 0  # 0.5 x 2 sequences: nothing drafted
    assert run(0.5, [long, short], batched=True)[0] > 0  # drafting resumes once `short` finished
    assert run(0.0, [long, 2], batched=True, batch_limit=1)[0] == 0  # more sequences than the limit
    assert run(0.0, [long, short], batched=True, batch_limit=1)[0] > 0


def test_tree_drafts_are_lossless_and_return_every_block(spec_prompts, spec_plain_outputs):
    """draft_top_k: requests verify trees (the chain plus its positions' runner-up tokens); some
    accepted paths end in a leaf, whose KV moves next to its chain (else the tokens after it
    would differ from plain decoding). A sampled request in the batch leaves the greedy ones
    lossless (its tokens: test_speculative.py::test_sampled_speculation_emits_exactly_plain_samplings_tokens)."""
    def engine(top_k: int, num_kv_blocks: int = 256) -> Engine:
        return Engine(EngineConfig(num_kv_blocks=num_kv_blocks, max_num_seqs=8, speculative={
            "adaptive": False, "method": "eagle3", "num_speculative_tokens": 8, "draft_top_k": top_k}))

    tree = engine(4)
    moves, move_kv = [], tree.runner.move_kv
    tree.runner.move_kv = lambda table, src, dst: (moves.append(len(src)), move_kv(table, src, dst))
    for batch in (1, 3, 8):
        params = [SamplingParams(max_tokens=32, num_speculative_tokens=1 + (i + batch) % 8) for i in range(batch)]
        assert run_requests(tree, spec_prompts[:batch], params) == spec_plain_outputs[:batch]
    assert moves and tree.blocks.num_used_blocks == 0
    sampled = SamplingParams(max_tokens=32, temperature=0.8, seed=7)
    mixed = run_requests(tree, spec_prompts[:3], [SamplingParams(max_tokens=32), sampled, SamplingParams(max_tokens=32)])
    assert mixed[0] == spec_plain_outputs[0] and mixed[2] == spec_plain_outputs[2]
    # A pool too short for the leaves' slots drops them (and may preempt): still lossless.
    tight = engine(4, num_kv_blocks=12)
    assert run_requests(tight, spec_prompts[:4], [SamplingParams(max_tokens=32)] * 4) == spec_plain_outputs[:4]
    assert tight.blocks.num_used_blocks == 0


def _lossless_tree_proposals(spec: dict, spec_prompts, spec_plain_outputs, n: int) -> list:
    """An eagle3 engine of `spec` (every step drafting, threshold 0) runs n spec_prompts alone, then
    together: each greedy output equals plain decoding's and no block stays used. Returns every
    proposal it drafted."""
    engine = Engine(EngineConfig(num_kv_blocks=256, speculative={
        "adaptive": False, "method": "eagle3", "draft_confidence_threshold": 0.0, **spec}))
    proposals = []
    propose = engine.proposer.propose
    engine.proposer.propose = lambda seqs, slots: proposals.extend(out := propose(seqs, slots)) or out
    params = SamplingParams(max_tokens=32)
    assert [run_requests(engine, [p], [params])[0] for p in spec_prompts[:n]] == spec_plain_outputs[:n]
    assert run_requests(engine, spec_prompts[:n], [params] * n) == spec_plain_outputs[:n]
    assert engine.blocks.num_used_blocks == 0
    return proposals


def test_a_dynamic_tree_drafts_several_branches_deep_and_stays_lossless(spec_prompts, spec_plain_outputs):
    """EAGLE-2's tree (width 2): some step drafts further from two different first tokens (a
    tree the chain-with-leaves cannot make); greedy output stays the target's, alone and batched."""
    proposals = _lossless_tree_proposals({"num_speculative_tokens": 8, "draft_top_k": 3, "draft_tree_width": 2},
                                         spec_prompts, spec_plain_outputs, 4)

    def branched(parents: list[int] | None) -> bool:  # two depth-1 nodes with children of their own
        return parents is not None and len({p for p in parents if p >= 0 and parents[p] == -1}) >= 2
    assert any(branched(p.parents) for p in proposals)
    assert all(len(p.token_ids) <= 15 for p in proposals)


def test_a_static_token_tree_drafts_its_shape_and_stays_lossless(spec_prompts, spec_plain_outputs):
    """speculative_token_tree (vLLM's name): every proposal is the shape's paths (the threshold 0
    keeps all of them while the slots allow), greedy output stays the target's, alone and batched."""
    tree = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]
    proposals = _lossless_tree_proposals({"num_speculative_tokens": 3, "speculative_token_tree": tree},
                                         spec_prompts, spec_plain_outputs, 3)

    def shape(parents: list[int]) -> list[tuple[int, int]]:  # (depth, children) of each node, sorted
        depth = []
        for p in parents:  # parents precede their children
            depth.append(1 if p < 0 else depth[p] + 1)
        return sorted((depth[i], parents.count(i)) for i in range(len(parents)))
    full = [p for p in proposals if len(p.token_ids) == len(tree)]
    assert full and all(shape(p.parents) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 0), (2, 2), (3, 0), (3, 0)]
                        for p in full)


def test_a_static_tree_past_its_reserved_slots_is_cut_to_them_when_no_slot_is_left(spec_prompts, spec_plain_outputs,
                                                                                   monkeypatch):
    """A chain-shaped static tree with a leaf below its last drafted node proposes one token more
    than the chain's reserved slots; when the pool has no slot for it (a fault injected: every
    extra reservation refused), the proposal is cut to the reserved slots, never verified past
    them (that failed the step: a span longer than its slots)."""
    engine = Engine(EngineConfig(num_kv_blocks=256, speculative={
        "adaptive": False, "method": "eagle3", "draft_confidence_threshold": 0.0, "num_speculative_tokens": 1,
        "speculative_token_tree": [[0], [0, 0]]}))
    proposing, propose, reserve = [False], engine._propose, engine.blocks.reserve

    def short_pool_propose(scheduled):
        proposing[0] = True
        try:
            return propose(scheduled)
        finally:
            proposing[0] = False

    monkeypatch.setattr(engine, "_propose", short_pool_propose)
    monkeypatch.setattr(engine.blocks, "reserve", lambda seq_id, n: not proposing[0] and reserve(seq_id, n))
    assert run_requests(engine, spec_prompts[:2], [SamplingParams(max_tokens=32)] * 2) == spec_plain_outputs[:2]
    assert engine.counters["accepted_tokens"] > 0 and engine.blocks.num_used_blocks == 0


def test_tree_leaves_fit_the_forwards_token_budget(spec_prompts, spec_plain_outputs):
    """max_num_batched_tokens counts the drafts' verification rows: the scheduler grants draft slots
    within it, and the leaves past them (top-4 trees here, up to 15 tokens a sequence against 5
    slots) are cut to what it leaves; they went past it (a budget of 16: forwards of up to 32 rows)."""
    engine = Engine(EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16, speculative={
        "adaptive": False, "method": "eagle3", "num_speculative_tokens": 5, "draft_top_k": 4,
        "draft_confidence_threshold": 0.0}))
    rows, forward = [], engine.runner.forward

    def counted(chunks, *args, **kwargs):
        rows.append(sum(len(c.token_ids) for c in chunks))
        return forward(chunks, *args, **kwargs)

    engine.runner.forward = counted
    assert run_requests(engine, spec_prompts[:3], [SamplingParams(max_tokens=32)] * 3) == spec_plain_outputs[:3]
    assert max(rows) <= 16 and engine.counters["draft_tokens"] > 0 and engine.blocks.num_used_blocks == 0


def test_a_static_token_tree_is_checked_when_configured():
    def spec(**fields):
        return EngineConfig(speculative={"method": "eagle3", **fields})
    tree = spec(speculative_token_tree=[[0], [0, 0]]).speculative
    assert tree.draft_top_k == 1  # not the cpu default's 4
    assert SpeculativeConfig(**tree.model_dump()) == tree  # a dumped config reads back (the local launcher's)
    for fields, message in [
        ({"speculative_token_tree": [[0], [1, 0]]}, r"needs its parent \[1\]"),
        ({"speculative_token_tree": [[0], [0]]}, "distinct"),
        ({"speculative_token_tree": [[0], [9]]}, "ranks from 0 to 7"),
        ({"speculative_token_tree": [[0], [0, 0], [0, 0, 0]], "num_speculative_tokens": 1}, "at least 2"),
        ({"speculative_token_tree": [[0]], "draft_top_k": 2}, "leave draft_top_k unset"),
    ]:
        with pytest.raises(ValueError, match=message):
            spec(**fields)
    with pytest.raises(ValueError, match="needs method 'eagle3'"):
        EngineConfig(speculative={"method": "ngram", "speculative_token_tree": [[0]]})
