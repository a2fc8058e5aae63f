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
adds about B times what it must add at batch 1. Once P times the batch reaches 1 no chain can
pass: the draft forward then only brings the draft's cache up to date (no logits).
"""

import torch

from engine.batch import SeqChunk
from engine.sequence import Sequence
from engine.spec.proposer import Proposal


class Eagle3Proposer:
    needs_aux = True

    def __init__(self, runner, block_table, confidence_threshold: float = 0.0):
        """runner: the ModelRunner holding the draft and its cache; block_table(seq_id) -> block ids;
        confidence_threshold: per sequence drafting, the least product of draft probabilities a
        proposed chain may have."""
        self.runner = runner
        self.confidence_threshold = confidence_threshold
        self.draft = runner.draft
        self.block_table = block_table
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}  # seq -> (first position, hidden [n, H])
        self.positions_drafted = 0  # positions run through the draft with target features (a metric)

    def observe(self, seq: Sequence, start: int, aux: torch.Tensor | None) -> None:
        hidden = self.draft.project(aux)
        first, old = self.pending.get(seq.seq_id, (start, hidden[:0]))
        if first + old.shape[0] != start:  # not contiguous (e.g. recomputed after preemption): restart
            first, old = start, hidden[:0]
        self.pending[seq.seq_id] = (first, torch.cat([old, hidden]))

    def release(self, seq_id: str) -> None:
        self.pending.pop(seq_id, None)

    @torch.inference_mode()
    def prefill_draft(self, seq: Sequence) -> torch.Tensor | None:
        first, hidden = self.pending.pop(seq.seq_id)
        last = len(seq.token_ids) - 1  # the prompt's last position: its next token is not chosen yet here
        if last > first:
            chunk = SeqChunk(seq.token_ids[first + 1 : last + 1], first, self.block_table(seq.seq_id), num_logits=0)
            self.runner.forward_draft([chunk], hidden[: last - first])
            self.positions_drafted += last - first
        return hidden[last - first :].contiguous()

    def adopt(self, seq: Sequence, position: int, hidden: torch.Tensor | None) -> None:
        if hidden is not None:
            self.pending[seq.seq_id] = (position, hidden.to(self.runner.dtype))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        active = [(s, k) for s, k in zip(seqs, num_tokens) if k > 0 and s.seq_id in self.pending]
        drafts: dict[str, list[int]] = {s.seq_id: [] for s, _ in active}
        if active and self.confidence_threshold * len(active) >= 1.0:
            self.runner.forward_draft(*self._take_pending([s for s, _ in active], num_logits=0))
        elif active:
            self._draft(active, drafts)
        return [Proposal(drafts.get(s.seq_id, [])) for s in seqs]

    def _take_pending(self, seqs: list[Sequence], num_logits: int) -> tuple[list[SeqChunk], torch.Tensor]:
        """The draft forward's input over each sequence's pending positions (target features)."""
        chunks, hidden = [], []
        for seq in seqs:
            first, h = self.pending.pop(seq.seq_id)
            # Position p reads token p+1; the last pending position reads the newest token.
            chunks.append(SeqChunk(seq.token_ids[first + 1 : first + 1 + h.shape[0]], first,
                                   self.block_table(seq.seq_id), num_logits=num_logits))
            hidden.append(h)
        hidden = torch.cat(hidden)
        self.positions_drafted += hidden.shape[0]
        return chunks, hidden

    def _draft(self, active: list[tuple[Sequence, int]], drafts: dict[str, list[int]]) -> None:
        seqs, limits = [s for s, _ in active], [k for _, k in active]
        chunks, hidden = self._take_pending(seqs, num_logits=1)
        chain_prob = torch.ones(len(seqs), device=hidden.device)
        threshold = self.confidence_threshold * len(seqs)
        while True:
            out = self.runner.forward_draft(chunks, hidden)
            tokens, chain_prob = self._choose(out.logits, chain_prob)
            confident = (chain_prob >= threshold).tolist()
            last_rows = torch.tensor([len(c.token_ids) for c in chunks], device=hidden.device).cumsum(0) - 1
            last_hidden = out.hidden.index_select(0, last_rows)
            for seq, token, ok in zip(seqs, tokens, confident):
                if ok:
                    drafts[seq.seq_id].append(token)
            keep = [i for i, seq in enumerate(seqs) if confident[i] and len(drafts[seq.seq_id]) < limits[i]]
            if not keep:
                return
            # Next step: one row per sequence at the next position, fed its own last hidden state.
            chunks = [SeqChunk([tokens[i]], chunks[i].end, chunks[i].block_table, num_logits=1) for i in keep]
            hidden, chain_prob = last_hidden[keep], chain_prob[keep]
            seqs, limits = [seqs[i] for i in keep], [limits[i] for i in keep]

    def _choose(self, logits: torch.Tensor, chain_prob: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Each row's most likely token (target ids), and the chain's probability extended by it."""
        if self.confidence_threshold == 0.0:  # the probabilities are not needed
            return self.draft.to_target_ids(logits.argmax(dim=-1)).tolist(), chain_prob
        prob, choice = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        return self.draft.to_target_ids(choice).tolist(), chain_prob * prob
