"""Prompt-lookup (n-gram) drafting: if the sequence's last n tokens appeared earlier, propose
the tokens that followed them there. Longest n first (prompt_lookup_max down to _min), most
recent earlier occurrence first. Costs no model forward; pays off on text that copies its context.

Two uses: method `ngram` drafts this alone; `prompt_lookup_branch` with method `eagle3` adds it
to each EAGLE3 tree as one more branch from the root (`LookupBranch`), so a step accepts
whichever of the two the target agrees with further. Small models' greedy text repeats itself
often enough (lists, numbers copied from the question) that the two fail at different places.
"""

import torch

from engine.sequence import Sequence
from engine.spec.proposer import Proposal, Proposer, StatelessProposer


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of min_n..max_n tokens; [] when none occurs."""
    last = tokens[-1] if tokens else None
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        # Scan right to left over earlier starts; the match may not be the suffix itself.
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start + n - 1] == last and tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


class NgramProposer(StatelessProposer):
    needs_aux = False

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], chain_slots: list[int]) -> list[Proposal]:
        return [Proposal(lookup(s.token_ids, k, self.min_n, self.max_n) if k else []) for s, k in zip(seqs, chain_slots)]


class LookupBranch:
    """Another proposer's drafts plus the prompt-lookup continuation (as long as the slots reserved
    for the chain) merged into the same tree; every other call goes to that proposer."""

    def __init__(self, inner: Proposer, min_n: int, max_n: int, max_tokens: int):
        self.inner, self.min_n, self.max_n, self.max_tokens = inner, min_n, max_n, max_tokens
        self.needs_aux = inner.needs_aux

    def propose(self, seqs: list[Sequence], chain_slots: list[int]) -> list[Proposal]:
        proposals = self.inner.propose(seqs, chain_slots)
        return [p.with_branch(lookup(s.token_ids, k, self.min_n, self.max_n), self.max_tokens) if k else p
                for s, k, p in zip(seqs, chain_slots, proposals)]

    @property
    def positions_drafted(self) -> int:  # a metric of the EAGLE3 proposer's
        return self.inner.positions_drafted

    @property
    def confidence_threshold(self) -> float:
        return self.inner.confidence_threshold

    @confidence_threshold.setter
    def confidence_threshold(self, value: float) -> None:
        self.inner.confidence_threshold = value

    def observe(self, seq: Sequence, start: int, aux: torch.Tensor | None) -> None:
        self.inner.observe(seq, start, aux)

    def release(self, seq: Sequence) -> None:
        self.inner.release(seq)

    def write_prompt_blocks(self, seqs: list[Sequence]) -> None:
        self.inner.write_prompt_blocks(seqs)

    def prefill_draft(self, seq: Sequence, first_token: int) -> torch.Tensor | None:
        return self.inner.prefill_draft(seq, first_token)

    def adopt(self, seq: Sequence, position: int, hidden: torch.Tensor | None) -> None:
        self.inner.adopt(seq, position, hidden)
