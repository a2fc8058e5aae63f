"""Continuous batching: which sequences run in the next forward and how many tokens each.

Every step the running sequences go first (oldest first): each runs its pending tokens (one
in steady decode, more while its prompt is still being prefilled, in chunks of at most
long_prefill_token_threshold, so that a long prompt leaves room in the budget, and a short wait,
for requests that arrive while it prefills) and, when a
speculative proposer is active, reserves `lookahead` extra KV slots for draft tokens. Then
waiting sequences are admitted while the token budget, the batch size and the KV pool allow.
When the pool cannot supply a running sequence's next slot, the youngest running sequence is
preempted (its blocks freed, to be recomputed later, mostly from the prefix cache). A
speculative reservation that does not fit degrades to no speculation for that step.
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens from seq.num_computed to run in this forward
    num_lookahead: int  # speculative slots reserved after them

    @property
    def yields_token(self) -> bool:
        """This chunk reaches the end of the known tokens, so its last row yields a new token."""
        return self.seq.num_computed + self.num_tokens == len(self.seq.token_ids)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 on_preempt: Callable[[Sequence], None] = lambda seq: None):
        """on_preempt(seq): called while a preempted sequence still holds its blocks."""
        self.config = config
        self.blocks = block_manager
        self.on_preempt = on_preempt
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def detach(self, seq: Sequence) -> None:
        """Stop scheduling a running sequence but keep its blocks (its KV is handed off)."""
        self.running.remove(seq)
        seq.status = SeqStatus.FINISHED

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose prompt KV arrived from elsewhere: it decodes from the next step."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def schedule(self, lookahead: Callable[[Sequence], int]) -> list[ScheduledSeq]:
        """lookahead(seq): draft slots wanted by a decoding sequence this step."""
        budget, chunk = self.config.max_num_batched_tokens, self.config.prefill_chunk()
        scheduled: list[ScheduledSeq] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted by an older sequence in this loop
                continue
            item = self._reserve(seq, min(seq.num_pending, budget, chunk), lookahead(seq) if seq.num_pending == 1 else 0)
            if item is not None:
                scheduled.append(item)
                budget -= item.num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.can_allocate(seq.token_ids):
                break
            self.waiting.popleft()
            cached = self.blocks.allocate(seq.seq_id, seq.token_ids)
            if seq.num_generated == 0:  # first admission (a preempted sequence comes back with tokens)
                seq.num_cached_prompt = cached
                seq.queue_seconds = time.monotonic() - seq.arrived
            seq.num_computed = cached
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_pending, budget, chunk)
            scheduled.append(ScheduledSeq(seq, n, 0))
            budget -= n
        return scheduled

    def _reserve(self, seq: Sequence, num_tokens: int, lookahead: int) -> ScheduledSeq | None:
        """Reserve slots for `num_tokens` (+ `lookahead`), preempting younger sequences if needed."""
        while True:
            missing = num_tokens + lookahead - self.blocks.num_reserved(seq.seq_id)
            if missing <= 0 or self.blocks.reserve(seq.seq_id, missing):
                return ScheduledSeq(seq, num_tokens, lookahead)
            if lookahead:
                lookahead = 0
                continue
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return None

    def _preempt(self, seq: Sequence) -> None:
        self.on_preempt(seq)
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
