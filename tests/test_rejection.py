"""Verification's rules (engine/spec/rejection.py): acceptance down a tree of the target's choice
at each row (its argmax, or its draw), which reproduces the target's distribution."""

import torch

from engine.spec.rejection import VerifyInput, verify


def test_tree_verification_walks_down_from_the_root():
    """Greedy tree acceptance: a child is accepted when it is the argmax at its parent's row; the
    walk ends at the first node none of whose children match, and the argmax there follows."""
    vocab = 10
    # drafts (parent): 0:5(-1) 1:6(0) 2:7(-1) 3:8(2) 4:9(2)   target argmax per row: root 7, after
    # draft 0: 1, after 1: 1, after 2: 9, after 3: 1, after 4: 3
    drafts, parents, argmax = [5, 6, 7, 8, 9], [-1, 0, -1, 2, 2], [7, 1, 1, 9, 1, 3]
    logits = torch.zeros(len(argmax), vocab)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 1.0
    out = verify(VerifyInput([drafts], logits, None, [True], torch.zeros(6), parents=[parents]))
    assert out.paths == [[2, 4]] and out.tokens == [[7, 9, 3]]


def test_rejection_sampling_reproduces_the_target_distribution():
    """Small vocabulary, known p, one greedy-style draft per sequence (the proposal is one-hot):
    the emitted token follows p, and a draft is accepted with probability p(draft)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    n = 20000
    drafts = torch.randint(0, 5, (n,), generator=gen)
    out = verify(VerifyInput(
        drafts=[[d] for d in drafts.tolist()], target_logits=torch.zeros(2 * n, 5), target_probs=p.repeat(2 * n, 1),
        greedy=[False] * n, uniforms=torch.rand(2 * n, generator=gen),
    ))
    first = torch.tensor([t[0] for t in out.tokens])
    freq = torch.bincount(first, minlength=5).float() / n
    assert (freq - p).abs().max() < 0.015
    accept_rate = sum(map(len, out.paths)) / n
    assert abs(accept_rate - p[drafts].mean()) < 0.015  # P(accept d) = p(d)


def test_tree_rejection_sampling_reproduces_the_target_distribution():
    """One-hot candidates in a tree: tokens 1 and 2 as the root's children, token 3 under 1. The
    first token follows the root's p, the second the p after whichever token came first."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.05, 0.4, 0.25, 0.2, 0.1],  # after the root
                      [0.3, 0.1, 0.2, 0.3, 0.1],  # after token 1
                      [0.1, 0.1, 0.1, 0.1, 0.6],  # after token 2
                      [0.2, 0.2, 0.2, 0.2, 0.2]])  # after 1, 3
    n = 20000
    out = verify(VerifyInput(
        drafts=[[1, 2, 3]] * n, target_logits=torch.zeros(4 * n, 5), target_probs=p.repeat(n, 1), greedy=[False] * n,
        uniforms=torch.rand(4 * n, generator=gen), parents=[[-1, -1, 0]] * n,
    ))
    first, second = (torch.tensor([t[k] if len(t) > k else -1 for t in out.tokens]) for k in (0, 1))
    assert (torch.bincount(first, minlength=5).float() / n - p[0]).abs().max() < 0.015
    for token, row in ((1, 1), (2, 2)):
        after = second[first == token]
        assert (torch.bincount(after, minlength=5).float() / len(after) - p[row]).abs().max() < 0.025
    assert any(path[:1] == [1] for path in out.paths)  # a sibling was accepted
