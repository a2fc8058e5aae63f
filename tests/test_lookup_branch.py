"""prompt_lookup_branch: the prompt-lookup continuation merged into each EAGLE3 tree as one more
branch from the root. The merge itself, the lookup, and the engine end to end (lossless, every
block returned, and the branch accepted where the head alone is not)."""

import pytest
from pydantic import ValidationError

from engine.config import EngineConfig, SpeculativeConfig
from engine.engine import Engine
from engine.params import SamplingParams
from engine.spec.ngram import lookup
from engine.spec.proposer import Proposal

CHAIN_AND_LEAVES = Proposal([1, 2, 3, 7, 8, 9], [-1, 0, 1, -1, 0, 1])  # chain 1 2 3; leaves 7, 8, 9


@pytest.mark.parametrize("tree, branch, max_tokens, tokens, parents", [
    (Proposal([1, 2, 3]), [1, 2, 9, 8], 15, [1, 2, 3, 9, 8], [-1, 0, 1, 1, 3]),  # shares the chain's first two
    (Proposal([1, 2, 3]), [1, 2, 3, 4], 15, [1, 2, 3, 4], None),  # extends the chain: still a chain
    (Proposal([1, 2, 3]), [5, 6], 15, [1, 2, 3, 5, 6], [-1, 0, 1, -1, 3]),  # a second root child
    (Proposal([]), [5, 6], 15, [5, 6], None),  # nothing drafted: the branch is the chain
    (CHAIN_AND_LEAVES, [7, 4], 15, [1, 2, 3, 7, 8, 9, 4], [-1, 0, 1, -1, 0, 1, 3]),  # continues leaf 7
    # Full: the trailing leaves make room, never the chain or the shared path (leaf 7), then the branch is cut.
    (CHAIN_AND_LEAVES, [5, 6, 7], 7, [1, 2, 3, 7, 5, 6, 7], [-1, 0, 1, -1, -1, 4, 5]),
    (CHAIN_AND_LEAVES, [7, 6, 5], 7, [1, 2, 3, 7, 8, 6, 5], [-1, 0, 1, -1, 0, 3, 5]),
    (CHAIN_AND_LEAVES, [5, 6, 7], 5, [1, 2, 3, 5, 6], [-1, 0, 1, -1, 3]),
    (Proposal([1, 2, 3]), [5, 6], 3, [1, 2, 3], None),
])
def test_a_branch_merges_into_the_tree(tree, branch, max_tokens, tokens, parents):
    merged = tree.with_branch(branch, max_tokens)
    assert (merged.token_ids, merged.parents) == (tokens, parents)


def test_a_trees_depth_is_its_deepest_path():
    assert (Proposal([1, 2, 3]).depth, Proposal([]).depth, CHAIN_AND_LEAVES.depth) == (3, 0, 3)
    assert Proposal([1, 5, 6, 7], [-1, -1, 1, 2]).depth == 3  # a branch longer than the one-token chain


def test_lookup_takes_the_longest_suffix_at_its_latest_occurrence():
    assert lookup([1, 2, 3, 9, 2, 3, 5, 1, 2, 3], 3, 1, 4) == [9, 2, 3]  # "1 2 3" beats the later "2 3"
    assert lookup([4, 2, 3, 9, 2, 3, 5, 1, 2, 3], 3, 1, 4) == [5, 1, 2]  # only "2 3": the latest one
    assert lookup([4, 2, 3, 9, 2, 3, 5, 1, 2, 3], 3, 3, 4) == []  # no 3-token match
    assert lookup([7], 3, 1, 4) == []


def test_bad_lookup_branch_names_the_field():
    with pytest.raises(ValidationError, match="prompt_lookup_branch needs method 'eagle3'"):
        SpeculativeConfig(method="ngram", prompt_lookup_branch=True)


def test_the_branch_is_accepted_where_the_head_fails_and_output_stays_lossless(engine):
    """The shipped head with and without the branch on prompts whose answers copy text: the same
    tokens as plain decoding, in batches of 1 and 3, and fewer verification steps with the branch."""
    questions = ["Repeat after me: the quick brown fox jumps over the lazy dog.", "Count from 1 to 20.",
                 "List the days of the week, then list them again."]
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=48)
    plain = [[t for o in engine.generate(p, params) for t in o.token_ids] for p in prompts]

    def run(branch: bool, batch: int) -> int:
        spec = Engine(EngineConfig(num_kv_blocks=128, speculative={
            "adaptive": False, "method": "eagle3", "num_speculative_tokens": 5, "draft_top_k": 4, "prompt_lookup_branch": branch,
            "prompt_lookup_min": 2, "disable_by_batch_size": None}))  # drafting at batch 3 too (the CPU default stops at 2)
        ids = [spec.add_request(p, params) for p in prompts[:batch]]
        out = {i: [] for i in ids}
        while spec.has_unfinished():
            for o in spec.step():
                out[o.request_id].extend(o.token_ids)
                if o.finished:  # positions counted to the tree's depth: an accepted branch may outrun the chain
                    a = o.acceptance
                    assert len(a.accepted_at) <= len(a.drafted_at), (a.drafted_at, a.accepted_at)
                    assert all(n <= d for n, d in zip(a.accepted_at, a.drafted_at)), (a.drafted_at, a.accepted_at)
        assert [out[i] for i in ids] == plain[:batch]
        assert spec.blocks.num_used_blocks == 0
        return spec.counters["verify_steps"]

    assert run(True, 3) > 0
    assert run(True, 1) < run(False, 1)
