"""Prompt-lookup (n-gram) drafting: if the sequence's last n tokens appeared earlier, propose
the tokens that followed them there. Longest n first (prompt_lookup_max down to _min), most
recent earlier occurrence first. Costs no model forward; pays off on text that copies its context.
"""

from engine.sequence import Sequence
from engine.spec.proposer import Proposal, StatelessProposer


class NgramProposer(StatelessProposer):
    needs_aux = False

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        return [Proposal(self._lookup(s.token_ids, k) if k else []) for s, k in zip(seqs, num_tokens)]

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # Scan right to left over earlier starts; the match may not be the suffix itself.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + k]
                    if follow:
                        return follow
        return []

