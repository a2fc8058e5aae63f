"""EAGLE-2's draft tree bookkeeping (engine/spec/draft_tree.py), without a model."""

from types import SimpleNamespace

import torch

from engine.spec.draft_tree import DraftTree
from engine.spec.eagle3_proposer import Eagle3Proposer


def test_a_width_one_tree_is_the_chain_with_its_leaves():
    tree = DraftTree(width=1, max_spine=3, threshold=0.1)
    tree.add_children(-1, [10, 11, 12], [0.6, 0.3, 0.05])
    assert tree.grow() == [0] and tree.is_chain()
    tree.add_children(0, [20, 21], [0.4, 0.15])
    assert tree.grow() == [3]
    proposal = tree.proposal(max_tokens=15)
    assert proposal.token_ids == [10, 20, 11, 21]  # the chain, then leaves by probability (12 fails the threshold)
    assert proposal.parents == [-1, 0, -1, 0]


def test_each_level_drafts_from_its_most_likely_nodes_whoever_their_parent():
    tree = DraftTree(width=2, max_spine=6, threshold=0.0)
    tree.add_children(-1, [10, 11, 12], [0.5, 0.4, 0.1])
    assert tree.grow() == [0, 1] and not tree.is_chain()
    tree.add_children(0, [20, 21], [0.2, 0.1])
    tree.add_children(1, [30, 31], [0.35, 0.03])
    assert tree.grow() == [5, 3]  # 30 (0.35) under 11, then 20 (0.2) under 10
    proposal = tree.proposal(max_tokens=5)
    assert proposal.token_ids == [10, 11, 30, 20, 12]  # the spine, then the best leaf that fits
    assert proposal.parents == [-1, -1, 1, 0, -1]


def test_the_spine_stops_at_its_slots_and_below_the_threshold():
    tree = DraftTree(width=3, max_spine=2, threshold=0.2)
    tree.add_children(-1, [10, 11, 12], [0.5, 0.3, 0.1])
    assert tree.grow() == [0, 1]  # room for 2; 12 would not pass anyway
    tree = DraftTree(width=2, max_spine=8, threshold=0.45)
    tree.add_children(-1, [10, 11], [0.5, 0.4])
    assert tree.grow() == [0]
    assert tree.proposal(max_tokens=15).parents is None  # a chain of one


def test_a_static_tree_verifies_no_deeper_than_the_sequences_draft_slots():
    """A request's K (or the tokens it may still emit) bounds the tree's depth: a shape two levels
    deep, with one slot, verified a second level the output then cut."""
    tree = DraftTree(width=1, max_spine=1, threshold=0.0, shape=frozenset({(0,), (0, 0), (1,)}))
    tree.add_children(-1, [5, 6], [0.6, 0.3])
    assert tree.grow() == [0] and not tree.expands()
    proposal = tree.proposal(max_tokens=8)
    assert proposal.token_ids == [5, 6] and proposal.parents == [-1, -1]


def test_a_static_tree_keeps_its_paths_and_drafts_its_inner_nodes_further():
    """vLLM-style shape [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]: the root's two best, the
    first's two best, the second's best, and one more level under [0, 0]."""
    shape = frozenset({(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)})
    tree = DraftTree(width=1, max_spine=3, threshold=0.0, shape=shape)
    tree.add_children(-1, [10, 11, 12], [0.5, 0.3, 0.1])  # rank 2 is not in the shape
    assert [n.token for n in tree.nodes] == [10, 11]
    assert tree.grow() == [0, 1] and tree.expands() and not tree.is_chain()  # both have children in the shape
    tree.add_children(0, [20, 21], [0.3, 0.1])
    tree.add_children(1, [30, 31], [0.2, 0.1])  # only rank 0 under [1]
    assert tree.grow() == [2] and tree.expands()  # [0, 0]: its child [0, 0, 0] is in the shape
    tree.add_children(2, [40, 41], [0.2, 0.1])
    assert tree.grow() == [] and not tree.expands()
    proposal = tree.proposal(max_tokens=15)
    assert proposal.token_ids == [10, 11, 20, 30, 40, 21]  # inner nodes, then the leaves by probability
    assert proposal.parents == [-1, -1, 0, 1, 2, 0]


class _DeviceLogits:
    """Logits as a GPU's would answer (the choice off CPU takes torch's path, not the C kernel)."""

    def __init__(self, logits: torch.Tensor):
        self.logits, self.device = logits, torch.device("cuda")

    def topk(self, *args, **kwargs):
        return self.logits.topk(*args, **kwargs)

    def float(self) -> torch.Tensor:
        return self.logits.float()


def test_a_tree_off_cpu_ranks_its_leaves_by_their_probabilities():
    """Off CPU, a chain with siblings (top_k 4, no threshold) got all-ones probabilities, so its
    leaves were cut in the order they were drafted, not by how likely they are."""
    proposer = Eagle3Proposer.__new__(Eagle3Proposer)  # _choose reads only these
    proposer.top_k, proposer.width, proposer.confidence_threshold = 4, 1, 0.0
    proposer.draft = SimpleNamespace(to_target_ids=lambda ids: ids)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    choice, prob = proposer._choose(_DeviceLogits(logits), [1.0, 0.5, 0.25])
    values, indices = torch.softmax(logits, dim=-1).topk(4, dim=-1)
    assert choice == indices.tolist()
    assert torch.allclose(torch.tensor(prob), values * torch.tensor([[1.0], [0.5], [0.25]]))
