"""EAGLE3 chain drafting on the paged draft cache.

Per sequence the proposer keeps the target's auxiliary features (projected by `fc`) for the
positions the draft has not yet seen with *target* features: after a prefill, the prompt; after
a verification, the last token and the accepted drafts (the draft's own KV written while
drafting them came from its own hidden states and is overwritten here). Proposing K tokens is:
1. one draft forward over all pending positions p (input: token p+1, hidden: target features
   at p), whose last row predicts the first draft token;
2. K-1 single-row forwards, each at the next position with the previous draft token and the
   draft's own output hidden state.
All sequences of the batch go through each forward together.

With a confidence threshold P, a sequence's chain ends before the first token at which the
product of the draft's probabilities along the chain falls below P times the number of
sequences drafting. The product is the draft's estimate that the token and every one before it
are accepted (the head is calibrated: see its model card), i.e. the tokens it is expected to
add. A draft token costs about the same wall time at any batch size (a draft row and a
verification row), while a step's output grows with the batch, so it pays at batch B only if it
adds about B times what it must add at batch 1.

A sequence that drafts nothing this step (no slots reserved, e.g. above the engine's
`disable_by_batch_size`, or P times the batch reached 1 so no chain can pass) only needs its
draft cache up to date for when it drafts again. Once some sequence lags more than CATCH_UP
positions behind, every sequence's pending positions but the last get their draft KV written in
one batched call that computes only the keys and values (not attention, MLP or logits: about a
tenth of a draft forward's arithmetic) and reads the weights once instead of once per step. The
same call covers a prompt before its first draft, a prompt whose prefill is handed off, and what
is still pending when a sequence leaves (its full blocks stay in the prefix cache, and a request
that reuses them reads their draft entries too). While a sequence lags, up to CATCH_UP of its
positions have no draft entries yet; a request reusing those blocks meanwhile drafts from stale
ones there, which costs acceptance, never correctness (verification decides every token).

With top_k > 1, each draft step also proposes the head's next k - 1 choices at that position as
leaves of a tree: siblings of the chain's token, verified in the same target forward but not
drafted further. They cost no draft work (the chain's logits hold them) and one verification
row each, so they pass the same rule as the chain, by their path's probability (the chain's
before them times their own), and the most likely are kept when the tree would outgrow a
verification span.

The target's features reach `observe` one sequence at a time; they are projected by `fc` for the
whole batch at once, when next needed.
"""

import torch

from engine.attention import SHORT_QUERY
from engine.batch import SeqChunk
from engine.sequence import Sequence, SeqStatus
from engine.spec.proposer import Proposal

CATCH_UP = 32  # pending positions past which a sequence's draft cache is brought up to date
MAX_TREE_TOKENS = SHORT_QUERY - 1  # a tree span ([last token] + drafts) is a short attention query


class Eagle3Proposer:
    needs_aux = True

    def __init__(self, runner, block_table, confidence_threshold: float = 0.0, top_k: int = 1):
        """runner: the ModelRunner holding the draft and its cache; block_table(seq_id) -> block ids;
        confidence_threshold: per sequence drafting, the least product of draft probabilities a
        proposed chain may have; top_k: candidates per draft position."""
        self.runner = runner
        self.confidence_threshold = confidence_threshold
        self.top_k = top_k
        self.draft = runner.draft
        self.block_table = block_table
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}  # seq -> (first position, hidden [n, H])
        self.unprojected: list[tuple[str, int, torch.Tensor]] = []  # (seq, first position, aux [n, 3H])
        self.unprojected_rows = 0  # their rows together (checked every step: not summed every step)
        self.positions_drafted = 0  # positions run through the draft with target features (a metric)

    def observe(self, seq: Sequence, start: int, aux: torch.Tensor | None) -> None:  # needs_aux: never None
        self.unprojected.append((seq.seq_id, start, aux))
        self.unprojected_rows += aux.shape[0]

    @torch.inference_mode()
    def release(self, seq: Sequence) -> None:
        """Write the draft KV still pending: full blocks become prefix-cacheable, and a request
        that reuses them later reads their draft entries as well as the target's."""
        self._project()
        if seq.seq_id in self.pending and seq.status is SeqStatus.RUNNING:  # else it holds no blocks
            self._catch_up([seq], keep_last=False)
        self.pending.pop(seq.seq_id, None)

    def _project(self) -> None:
        """Move the observed target features into `pending`, through one `fc` for all of them."""
        if not self.unprojected:
            return
        hidden = self.draft.project(torch.cat([aux for _, _, aux in self.unprojected]))
        row = 0
        for seq_id, start, aux in self.unprojected:
            h, row = hidden[row : row + aux.shape[0]], row + aux.shape[0]
            first, old = self.pending.get(seq_id, (start, h[:0]))
            if first + old.shape[0] != start:  # not contiguous (e.g. recomputed after preemption): restart
                first, old = start, h[:0]
            self.pending[seq_id] = (first, torch.cat([old, h]))
        self.unprojected, self.unprojected_rows = [], 0

    @torch.inference_mode()
    def prefill_draft(self, seq: Sequence) -> torch.Tensor | None:
        self._project()
        self._catch_up([seq])
        # Left pending: the prompt's last position, whose next token is not chosen yet here.
        return self.pending.pop(seq.seq_id)[1].contiguous()

    def adopt(self, seq: Sequence, position: int, hidden: torch.Tensor | None) -> None:
        if hidden is not None:
            self.pending[seq.seq_id] = (position, hidden.to(self.runner.device, self.runner.dtype))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], chain_slots: list[int]) -> list[Proposal]:
        if not any(chain_slots) and self.unprojected_rows <= CATCH_UP * len(seqs):
            # Nobody drafts this step (a plain step of the governor's): the target's features wait,
            # to be projected and written in one batch when drafting resumes or they pile up.
            return [Proposal([]) for _ in seqs]
        self._project()
        known = [(s, k) for s, k in zip(seqs, chain_slots) if s.seq_id in self.pending]
        if any(self.pending[s.seq_id][1].shape[0] > CATCH_UP for s, _ in known):
            self._catch_up([s for s, _ in known])
        drafting = [(s, k) for s, k in known if k > 0]
        drafts: dict[str, list[int]] = {s.seq_id: [] for s, _ in drafting}
        leaves: dict[str, list[tuple[float, int, int]]] = {s.seq_id: [] for s, _ in drafting}
        if drafting and self.confidence_threshold * len(drafting) < 1.0:
            self._draft(drafting, drafts, leaves)
        return [_proposal(drafts.get(s.seq_id, []), leaves.get(s.seq_id, [])) for s in seqs]

    def _catch_up(self, seqs: list[Sequence], keep_last: bool = True) -> None:
        """Write the draft cache's KV for the pending positions, in one batched call that computes
        nothing else. keep_last: leave the last position pending (the next draft step reads it)."""
        chunks, hidden = [], []
        for seq in seqs:
            first, h = self.pending[seq.seq_id]
            # Position p needs token p+1: after a stop token, accepted drafts beyond it are not kept.
            n = min(h.shape[0] - keep_last, len(seq.token_ids) - 1 - first)
            if n > 0:
                chunks.append(self._chunk(seq, first, n, num_logits=0))
                hidden.append(h[:n])
                self.pending[seq.seq_id] = (first + n, h[n:])
        if chunks:
            hidden = torch.cat(hidden)
            self.runner.write_draft_kv(chunks, hidden)
            self.positions_drafted += hidden.shape[0]

    def _chunk(self, seq: Sequence, first: int, num_positions: int, num_logits: int) -> SeqChunk:
        """Draft input over positions [first, first + num_positions): position p reads token p+1
        (the last pending position reads the newest token)."""
        return SeqChunk(seq.token_ids[first + 1 : first + 1 + num_positions], first,
                        self.block_table(seq.seq_id), num_logits=num_logits)

    def _take_pending(self, seqs: list[Sequence]) -> tuple[list[SeqChunk], torch.Tensor]:
        """The first draft forward's input: each sequence's pending positions (target features)."""
        chunks, hidden = [], []
        for seq in seqs:
            first, h = self.pending.pop(seq.seq_id)
            chunks.append(self._chunk(seq, first, h.shape[0], num_logits=1))
            hidden.append(h)
        hidden = torch.cat(hidden)
        self.positions_drafted += hidden.shape[0]
        return chunks, hidden

    def _draft(self, active: list[tuple[Sequence, int]], drafts: dict[str, list[int]],
               leaves: dict[str, list[tuple[float, int, int]]]) -> None:
        """Fill each sequence's chain (drafts) and, with top_k > 1, its leaves (path probability,
        parent's index in the chain, token)."""
        seqs, limits = [s for s, _ in active], [k for _, k in active]
        chunks, hidden = self._take_pending(seqs)
        chain_prob = torch.ones(len(seqs), device=hidden.device)
        threshold = self.confidence_threshold * len(seqs)
        while True:
            out = self.runner.forward_draft(chunks, hidden)
            choices, path_prob = self._choose(out.logits, chain_prob)
            chain_prob = path_prob[:, 0]
            passes = (path_prob >= threshold).tolist()
            last_rows = torch.tensor([len(c.token_ids) for c in chunks], device=hidden.device).cumsum(0) - 1
            last_hidden = out.hidden.index_select(0, last_rows)
            for seq, tokens, ok, probs in zip(seqs, choices, passes, path_prob.tolist()):
                chain = drafts[seq.seq_id]
                leaves[seq.seq_id] += [(p, len(chain) - 1, t) for t, o, p in zip(tokens[1:], ok[1:], probs[1:]) if o]
                if ok[0]:
                    chain.append(tokens[0])
            keep = [i for i, seq in enumerate(seqs) if passes[i][0] and len(drafts[seq.seq_id]) < limits[i]]
            if not keep:
                return
            # Next step: one row per sequence at the next position, fed its own last hidden state.
            chunks = [SeqChunk([choices[i][0]], chunks[i].end, chunks[i].block_table, num_logits=1) for i in keep]
            hidden, chain_prob = last_hidden[keep], chain_prob[keep]
            seqs, limits = [seqs[i] for i in keep], [limits[i] for i in keep]

    def _choose(self, logits: torch.Tensor, chain_prob: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
        """Each row's top_k tokens (target ids, most likely first) and the chain's probability
        extended by each (all ones when no threshold needs them)."""
        if self.confidence_threshold == 0.0:  # the probabilities are not needed
            choice = logits.topk(self.top_k, dim=-1).indices if self.top_k > 1 else logits.argmax(-1, keepdim=True)
            return self.draft.to_target_ids(choice).tolist(), torch.ones(choice.shape, device=logits.device)
        prob, choice = torch.softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)
        return self.draft.to_target_ids(choice).tolist(), chain_prob[:, None] * prob


def _proposal(chain: list[int], leaves: list[tuple[float, int, int]]) -> Proposal:
    """The chain, then the most likely leaves that fit in a verification span."""
    leaves = sorted(leaves, key=lambda leaf: -leaf[0])[: max(0, MAX_TREE_TOKENS - len(chain))]
    if not leaves:
        return Proposal(chain)
    return Proposal(chain + [t for _, _, t in leaves], list(range(-1, len(chain) - 1)) + [p for _, p, _ in leaves])
