"""The interface every draft proposer implements, and the trivial one.

The engine calls, per step: `propose` for the sequences whose next token is sampled, with the
draft slots each reserved (0: propose nothing; a stateful proposer may catch up instead);
after the target forward, `observe` with the span of positions whose KV became final (the
prefill chunk, or the last token plus the accepted drafts) and the target's auxiliary hidden
states for them (when `needs_aux`; None for a decode step above disable_by_batch_size, where
nothing drafts and the engine captures none); `release` when a sequence leaves the batch
(finished, or preempted). Across a prefill/decode split, `prefill_draft` (prefill side) and `adopt` (decode
side) move the proposer's state with the KV.

A `Proposal` is a chain of draft tokens, or a tree: with `parents`, token i continues token
parents[i] (-1: the sequence's last token), parents come before their children, and siblings
are distinct. `chain_slots` counts the slots
reserved before drafting, which bound the proposal's leading chain (a stateful proposer writes
its own cache there); tokens past it are leaves the engine reserves slots for afterwards, or
drops when the pool is short.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sequence import Sequence


@dataclass
class Proposal:
    token_ids: list[int]  # target-vocabulary ids
    parents: list[int] | None = None  # None: a chain

    @property
    def chain_length(self) -> int:
        """Leading tokens that form a chain from the root."""
        if self.parents is None:
            return len(self.token_ids)
        return next((i for i, p in enumerate(self.parents) if p != i - 1), len(self.parents))

    @property
    def depth(self) -> int:
        """Draft positions its deepest path from the root reaches (a chain: its length)."""
        if self.parents is None:
            return len(self.token_ids)
        depths: list[int] = []
        for parent in self.parents:  # a node's parent comes before it
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return max(depths, default=0)

    def chain(self) -> "Proposal":
        return Proposal(self.token_ids[: self.chain_length])

    def first(self, n: int) -> "Proposal":
        """Its first n tokens: a tree still (a node's parent comes before it), past the chain the
        least likely leaves dropped (EAGLE3 orders them so)."""
        if self.parents is None:
            return Proposal(self.token_ids[:n])
        parents = self.parents[:n]
        return Proposal(self.token_ids[:n], None if parents == list(range(-1, len(parents) - 1)) else parents)

    def with_branch(self, branch: list[int], max_tokens: int) -> "Proposal":
        """This tree plus `branch`, a path of tokens from the root: its leading tokens that are
        already in the tree are shared, the rest become new nodes at the end. To fit max_tokens,
        trailing childless nodes past the chain (the least likely leaves, as EAGLE3 orders them)
        make room first; what still does not fit of the branch is cut."""
        tokens = list(self.token_ids)
        parents = list(self.parents) if self.parents is not None else list(range(-1, len(tokens) - 1))
        node, shared = -1, 0
        for token in branch:
            child = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == token), None)
            if child is None:
                break
            node, shared = child, shared + 1
        new = branch[shared:]
        # The last node has no children (they would come after it); past `node` it is off the shared path.
        while len(tokens) + len(new) > max_tokens and len(tokens) - 1 > max(node, self.chain_length - 1):
            tokens.pop()
            parents.pop()
        for token in new[: max(0, max_tokens - len(tokens))]:
            tokens.append(token)
            parents.append(node)
            node = len(tokens) - 1
        is_chain = parents == list(range(-1, len(tokens) - 1))
        return Proposal(tokens, None if is_chain else parents)


class Proposer(Protocol):
    needs_aux: bool
    positions_drafted: int  # positions run through a draft model with target features (a metric)

    def propose(self, seqs: list[Sequence], chain_slots: list[int]) -> list[Proposal]: ...

    def observe(self, seq: Sequence, start: int, aux: torch.Tensor | None) -> None: ...

    def release(self, seq: Sequence) -> None:
        """`seq` leaves the batch: finished (`seq.finish_reason` set) or preempted (to be recomputed
        later). Its blocks are still allocated until this returns."""
        ...

    def write_prompt_blocks(self, seqs: list[Sequence]) -> None:
        """`seqs` are mid-prompt, their chunks computed this step: the blocks they filled enter the
        prefix cache now, so whatever draft state a block holds must be in it now too."""
        ...

    def prefill_draft(self, seq: Sequence, first_token: int) -> torch.Tensor | None:
        """Disaggregated prefill: run the draft over the prompt but its last position; return
        that position's draft input hidden state (it travels with the KV) or None. The last
        position's entry, whose input is `first_token`, is written too where its block is full
        (the prefix cache keeps it for later requests; the decode side computes its own)."""
        ...

    def adopt(self, seq: Sequence, position: int, hidden: torch.Tensor | None) -> None:
        """Take over a sequence prefilled elsewhere: `hidden` is prefill_draft's result."""
        ...


class StatelessProposer:
    """Base for proposers that keep no per-sequence state."""

    positions_drafted = 0

    def observe(self, seq: Sequence, start: int, aux: torch.Tensor | None) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def write_prompt_blocks(self, seqs: list[Sequence]) -> None:
        pass

    def prefill_draft(self, seq: Sequence, first_token: int) -> torch.Tensor | None:
        return None

    def adopt(self, seq: Sequence, position: int, hidden: torch.Tensor | None) -> None:
        pass


class NoProposer(StatelessProposer):
    """Plain decoding."""

    needs_aux = False

    def propose(self, seqs: list[Sequence], chain_slots: list[int]) -> list[Proposal]:
        return [Proposal([]) for _ in seqs]
