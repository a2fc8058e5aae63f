"""Continuous batching: which sequences run in the next forward and how many tokens each.

Every step the decoding sequences go first (oldest first): one token each. Then waiting sequences
are admitted while the batch size and the KV pool allow, then, when a speculative proposer is
active, the decoding sequences get `lookahead` extra KV slots for draft tokens from what is left,
and prompts are computed shortest-remaining first, within the token budget, each at most
long_prefill_token_threshold tokens a step. On CPU
that cap counts a prompt token at its cost: attention over p cached positions makes a token at
position p cost 1 + p / context_cost tokens, so a long prompt's chunks shrink as its context grows
and its steps stay about as short as a short prompt's prefill. In a step where some prompt
finishes, chunks of prompts that do not finish wait, unless they already waited in the step
before: a request that arrives while a long prompt prefills waits for at most the step under way,
then runs without it, and the long prompt still progresses at least every other step.
When the pool cannot supply a decoding sequence's next slot, the youngest running sequence is
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


# Cached positions whose attention costs a prompt token as much as its weight GEMMs, per unit of
# hidden size. Per token and layer the GEMMs do ~12 h^2 multiply-adds (q/k/v/o and the MLP) and
# attention 2 h per cached position (q.k and p.v over all heads): equal at ~6 h positions. Our CPU
# attention runs ~5x fewer multiply-adds a second than the int8 GEMMs (BENCHMARKS, issue 19's
# fairness run: SmolLM2-135M, one thread: 0.52 ms a token, +0.70 us per cached position).
CPU_CONTEXT_COST_PER_HIDDEN = 1.25


def context_cost(config: EngineConfig, hidden_size: int) -> float | None:
    """The `context_cost` of Scheduler for this engine: None (a token counts 1) off the CPU."""
    return CPU_CONTEXT_COST_PER_HIDDEN * hidden_size if config.device == "cpu" else None


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 on_preempt: Callable[[Sequence], None] = lambda seq: None, context_cost: float | None = None,
                 arriving: Callable[[], int] = lambda: 0):
        """on_preempt(seq): called while a preempted sequence still holds its blocks. context_cost:
        cached positions that make a prompt token count double against the prefill cap (None:
        every token counts 1). arriving(): sequences whose KV is arriving from elsewhere, each
        holding a place in the batch it joins when its KV is in (add_running)."""
        self.config = config
        self.blocks = block_manager
        self.on_preempt = on_preempt
        self.arriving = arriving
        self.context_cost = context_cost
        self.waiting: deque[Sequence] = deque()
        # The blocks the waiting sequences' tokens fill (a cached prefix counted too): work queued
        # here that load reports must show, kept as a count (stats read it from another thread).
        self.waiting_blocks = 0
        self.running: list[Sequence] = []
        self._passed_over: set[str] = set()  # prompts that got no chunk in the last step

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.waiting_blocks += self._blocks(seq)

    def _blocks(self, seq: Sequence) -> int:
        return -(-len(seq.token_ids) // self.config.block_size)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.waiting_blocks -= self._blocks(seq)
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
        budget = self.config.max_num_batched_tokens
        decoding: list[Sequence] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.num_pending > 1:  # preempted in this loop, or prefilling
                continue
            if self._reserve(seq, 1):  # its victims are younger: never one already in `decoding`
                decoding.append(seq)
                budget -= 1
        # Waiting prompts take their blocks before draft slots do: drafts are speculation, and
        # taken first they kept a prompt waiting at a full pool (evicting the cached prefix it
        # would have reused for their own blocks).
        if budget > 0:
            self._admit()
        # Draft slots once every decoding sequence has its token's: an older sequence's drafts
        # never cost a younger one its place (speculation degrades, sequences are not preempted).
        # Their verification rows are the forward's too, so they come out of its token budget, but
        # not out of the chunks owed to prompts passed over last step: drafting every step at a
        # tight budget kept a prompt from its first chunk until some decoder finished.
        owed = min(budget, sum(self._next_chunk(s) for s in self.running if s.seq_id in self._passed_over))
        scheduled, draft_budget = [], budget - owed
        for seq in decoding:
            drafts = self._draft_slots(seq, min(lookahead(seq), draft_budget))
            draft_budget -= drafts
            budget -= drafts
            scheduled.append(ScheduledSeq(seq, 1, drafts))
        scheduled += self._prefill_chunks(budget, decoding)
        return scheduled

    def _admit(self) -> None:
        """Waiting sequences into the running batch (their prompt's blocks allocated), in order."""
        while self.waiting and len(self.running) + self.arriving() < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.can_allocate(seq.token_ids):
                break
            self.waiting.popleft()
            self.waiting_blocks -= self._blocks(seq)
            cached = self.blocks.allocate(seq.seq_id, seq.token_ids)
            if not seq.admitted:  # its cache hits and queue time: a preempted one's recompute hits its own blocks
                seq.admitted = True
                seq.num_cached_prompt = cached
                seq.queue_seconds = time.monotonic() - seq.arrived
            seq.num_computed = cached
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def _prefill_chunks(self, budget: int, decoding: list[Sequence]) -> list[ScheduledSeq]:
        """This step's prompt chunks: those passed over in the last step first, then shortest
        remaining first, within `budget` tokens, each within the cost cap. When some prompt
        finishes in this step, chunks that leave their prompt unfinished wait (unless they were
        passed over already): a newcomer's step is not lengthened by a long prompt's chunk. A prompt
        admitted with one token left (a 1-token prompt, or one cached but for its last token) is a
        1-token chunk here: it missed this step's decoding, and waited a step (on an idle engine,
        the loop's 0.1 s nap) for the next."""
        decoding_ids = {s.seq_id for s in decoding}
        prompts = [s for s in self.running
                   if s.num_pending > 1 or (s.num_pending == 1 and s.seq_id not in decoding_ids)]
        prefilling = sorted(prompts, key=lambda s: (s.seq_id not in self._passed_over, s.num_pending))
        plan: list[ScheduledSeq] = []
        for seq in prefilling:
            n = min(budget, self._next_chunk(seq))
            if n > 0:
                plan.append(ScheduledSeq(seq, n, 0))  # the prompt's slots were allocated at admission
                budget -= n
        finishing = any(item.yields_token for item in plan)
        chunks = [item for item in plan
                  if not finishing or item.yields_token or item.seq.seq_id in self._passed_over]
        chosen = {item.seq.seq_id for item in chunks}
        self._passed_over = {s.seq_id for s in prefilling if s.seq_id not in chosen}
        return chunks

    def _next_chunk(self, seq: Sequence) -> int:
        """The tokens of a prompt's next chunk (within the cost cap)."""
        return min(seq.num_pending, self._tokens_within(seq.num_computed, self.config.prefill_chunk()))

    def _token_cost(self, position: int) -> float:
        return 1.0 if self.context_cost is None else 1.0 + position / self.context_cost

    def _tokens_within(self, position: int, cap: int) -> int:
        """Prompt tokens from `position` that cost at most `cap` (at least one)."""
        return max(1, int(cap / self._token_cost(position)))

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Reserve slots for `num_tokens`, preempting younger sequences if needed; False if `seq`
        itself had to go."""
        while True:
            missing = num_tokens - self.blocks.num_reserved(seq.seq_id)
            if missing <= 0 or self.blocks.reserve(seq.seq_id, missing):
                return True
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False

    def _draft_slots(self, seq: Sequence, wanted: int) -> int:
        """`wanted` draft slots after the token's if the pool has them now, else none."""
        missing = 1 + wanted - self.blocks.num_reserved(seq.seq_id)
        return wanted if wanted and (missing <= 0 or self.blocks.reserve(seq.seq_id, missing)) else 0

    def _preempt(self, seq: Sequence) -> None:
        self.on_preempt(seq)
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.waiting_blocks += self._blocks(seq)
