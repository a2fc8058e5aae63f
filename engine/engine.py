"""One engine: scheduler + model runner + proposer + verifier + output streams, driven by `step()`.

Each step:
1. the scheduler picks prefill chunks and decoding sequences, reserving K draft slots for the
   latter when speculation is on (fewer, or none, when the pool is short);
2. the proposer drafts up to K tokens per decoding sequence (a chain, or a tree whose extra
   leaves get their slots here, see spec/proposer.py);
3. one target forward runs over everything: prefill chunks, and [last token + drafts] spans
   (a tree's tokens see only their ancestors);
4. the verifier accepts a path of each span's drafts from its root and adds one token (plain
   sampling is the zero-draft case);
5. the KV of the chunk's tokens and accepted drafts is committed (full blocks become
   prefix-cacheable; an accepted leaf's KV first moves next to its chain), the rejected slots
   are rolled back, and the proposer sees the target's features for the committed positions;
6. new tokens become text deltas; stop tokens, stop strings and limits end requests.
"""

import collections
import itertools
import time
from collections.abc import Iterator, Sequence as Seq

import torch

from engine.batch import SeqChunk
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import CapacityExceeded, InvalidRequest, RequestIdInUse
from engine.handoff import Handoff
from engine.inference import inference
from engine.output import OutputStream, RequestOutput, Usage
from engine.runner import ModelRunner
from engine.params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler, context_cost
from engine.sequence import Sequence
from engine.spec.factory import make_proposer
from engine.spec.governor import RowPrice, SpeculationGovernor
from engine.spec.proposer import Proposal
from engine.spec.rejection import make_verify_input, verify
from engine.stats import EngineStats
from engine.tokenizer import Tokenizer


class Engine(Handoff):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = Tokenizer.from_dir(self.runner.model_dir)
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        spec = config.speculative
        # Left unset (the CPU default), the draft confidence threshold follows what a verification row costs here.
        self.row_price = RowPrice() if spec.method == "eagle3" and spec.draft_confidence_threshold is None else None
        if self.row_price is not None:
            spec = spec.model_copy(update={"draft_confidence_threshold": self.row_price.threshold()})
        self.proposer = make_proposer(spec, self.runner, self.blocks.block_table)
        # A preempted sequence is recomputed later (mostly from the prefix cache): the proposer
        # leaves its state as after a finish.
        self.scheduler = Scheduler(config, self.blocks, on_preempt=lambda seq: self.proposer.release(seq),
                                   context_cost=context_cost(config, self.runner.model_config.hidden_size),
                                   arriving=lambda: len(self.incoming))
        self.verify = verify if config.device == "cpu" else _triton_verify()
        self.max_model_len = self.runner.max_model_len
        self.seqs: dict[str, Sequence] = {}
        self.streams: dict[str, OutputStream] = {}
        self.handed_off: dict[str, Sequence] = {}  # prefilled here, blocks pinned until release()
        self.incoming: dict[str, Sequence] = {}  # blocks allocated, KV arriving from a prefill worker
        self._ids = itertools.count()
        self.counters: collections.Counter[str] = collections.Counter()  # monotonic totals, for metrics
        self.governor = SpeculationGovernor() if spec.method != "none" and spec.adaptive else None
        self._drafting = True  # this step's choice (the governor's, when adaptive)
        self.stalled = False  # the last step had nothing it could run (every sequence waits for blocks)
        # Where the steps that drafted spent their time (seconds): draft, verify (the target's
        # forward), bookkeeping (scheduling, acceptance, KV commits, outputs); for bench spec.
        self.drafting_seconds: collections.Counter[str] = collections.Counter()

    def stats(self) -> EngineStats:
        counters = dict(self.counters)
        counters["draft_positions_with_target_features"] = self.proposer.positions_drafted
        counters["kv_blocks_retired"] = self.blocks.num_retired_blocks  # see retire_incoming
        return EngineStats(kv_blocks_used=self.blocks.num_used_blocks, kv_blocks_total=self.blocks.num_blocks,
                           running=len(self.scheduler.running),
                           waiting=len(self.scheduler.waiting) + len(self.incoming),
                           pinned=len(self.handed_off), kv_blocks_waiting=self.scheduler.waiting_blocks,
                           counters=counters)

    def add_request(self, prompt_token_ids: Seq[int], params: SamplingParams, request_id: str | None = None,
                    prefill_only: bool = False) -> str:
        """Queue a request. With prefill_only, it stops after its first token and is handed off
        (see KVHandle): its blocks stay allocated until `release`."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.validate(request_id, prompt_token_ids, params)
        seq = Sequence.new(request_id, prompt_token_ids, params)
        seq.prefill_only = prefill_only
        self.seqs[request_id] = seq
        self.streams[request_id] = OutputStream(self.tokenizer, params)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """End a request (`reason`: "error" when the engine failed it, not a client)."""
        if request_id in self.incoming:
            # Its KV may be arriving right now, written into its blocks by a handler thread: they
            # are freed when the transfer has ended (admit_prefilled, drop_incoming), never under it.
            if self.incoming[request_id].finish_reason != "abort":  # aborted once, however often asked
                self.incoming[request_id].finish_reason = "abort"
                self.counters["finished_abort"] += 1
            return RequestOutput(request_id, [], "", finished=True, finish_reason="abort")
        seq = self.seqs.get(request_id)
        return self._finish(seq, reason, [], "") if seq else None

    def close(self) -> None:
        """Release what outlives the object otherwise: tensor-parallel rank processes."""
        self.runner.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @inference
    def step(self) -> list[RequestOutput]:
        batch, start = len(self.scheduler.running), time.perf_counter()
        # Above disable_by_batch_size nothing drafts: the governor neither chooses nor measures there
        # (its "draft" figures were plain steps), and the run of steps it measures is broken.
        draftable = self._draftable(batch)
        self._drafting = draftable and (self.governor is None or self.governor.should_draft(batch))
        ended = self._end_unfit_waiting()
        scheduled = self.scheduler.schedule(self._lookahead)
        self.stalled = not scheduled and not ended
        if not scheduled:
            return ended
        scheduled_at = time.perf_counter()
        proposals = self._propose(scheduled)
        chunks = [self._chunk(s, p) for s, p in zip(scheduled, proposals)]
        drafted_at = time.perf_counter()
        # The target's features for the proposer: above disable_by_batch_size for prompts only
        # (their blocks are shared through the prefix cache). Keeping the draft cache current for
        # every decoded position there cost 4-7 % of a batch-16 step, for sequences that may never
        # draft again (engine/spec/eagle3_proposer.py).
        captured = [draftable or c.start < s.seq.num_prompt_tokens for s, c in zip(scheduled, chunks)]
        out = self.runner.forward(chunks, return_aux=self.proposer.needs_aux and any(captured))
        verified_at = time.perf_counter()
        sampling = [i for i, s in enumerate(scheduled) if s.yields_token]
        seqs = [scheduled[i].seq for i in sampling]
        verdict = self.verify(make_verify_input([s.params for s in seqs], [s.seed for s in seqs],
                                                [len(s.token_ids) for s in seqs],
                                                [proposals[i].token_ids for i in sampling], out.logits,
                                                [proposals[i].parents for i in sampling]))
        paths = dict(zip(sampling, verdict.paths))
        # The output first: a stop inside an accepted run ends it there, and no KV may stay past it
        # (a full block of it would be prefix-cached with draft entries never corrected).
        pushed = {i: self._push(scheduled[i].seq, verdict.tokens[j]) for j, i in enumerate(sampling)
                  if not scheduled[i].seq.prefill_only}
        row = 0
        for i, (s, chunk) in enumerate(zip(scheduled, chunks)):
            # KV stays for the chunk's real tokens and the accepted drafts; the rest rolls back.
            rows = self._kept_rows(chunk, len(proposals[i].token_ids), paths.get(i, []))
            if i in pushed:  # the output's last token has no KV yet, nor anything after it
                rows = rows[: len(s.seq.token_ids) - 1 - chunk.start]
            self.blocks.commit(s.seq.seq_id, [chunk.token_ids[r] for r in rows])
            if s.num_lookahead:
                self.blocks.rollback(s.seq.seq_id)
            s.seq.num_computed += len(rows)  # first: without features, observe writes the blocks full by now
            if rows:  # none where the sequence ended at once (no room left: retired blocks shrank its limit)
                self.proposer.observe(s.seq, chunk.start, _rows(out.aux_hidden, row, rows) if captured[i] else None)
            row += len(chunk.token_ids)
        mid_prompt = [s.seq for i, s in enumerate(scheduled) if i not in paths]  # (yields_token has moved on)
        if mid_prompt:
            self.proposer.write_prompt_blocks(mid_prompt)
        outputs, emitted_drafts = [], 0
        for j, i in enumerate(sampling):
            # Accepted drafts the output took: none after a stop or the length limit (they were
            # right, but nobody got them; counted, they overstated a request's acceptance and the
            # governor's tokens per drafting step).
            seq, a = scheduled[i].seq, len(paths[i])
            if i in pushed:
                a = max(0, min(a, len(pushed[i][0]) - 1))
            emitted_drafts += a
            if scheduled[i].num_lookahead:
                seq.acceptance.record(len(proposals[i].token_ids), a, depth=proposals[i].depth)
                self.counters["draft_tokens"] += len(proposals[i].token_ids)
                self.counters["accepted_tokens"] += a
                self.counters["verify_steps"] += 1
            outputs.append(self._prefilled_handle(seq, verdict.tokens[j][0]) if seq.prefill_only
                           else self._emit(seq, *pushed[i]))
        self._note_time(batch, scheduled, [proposals[i] for i in sampling], emitted_drafts,
                        sum(len(c.token_ids) for c in chunks),
                        (start, scheduled_at, drafted_at, verified_at, time.perf_counter()))
        return ended + outputs

    def _end_unfit_waiting(self) -> list[RequestOutput]:
        """End ("length") the waiting sequences at the queue's head that the pool can no longer
        hold: blocks retired for good (a transfer that may still write) shrink it under a preempted
        sequence, which admission, in order, would then wait on forever, and every request behind
        it (a decode worker takes no hand-off while one waits); or to its length, where it would
        wait for the whole pool to be free, be recomputed, and find no room for another token."""
        ended = []
        while self.scheduler.waiting and len(self.scheduler.waiting[0].token_ids) >= self.context_limit():
            ended.append(self._finish(self.scheduler.waiting[0], "length", [], ""))
        return ended

    def _note_time(self, batch: int, scheduled: list[ScheduledSeq], proposals: list[Proposal], accepted: int,
                   rows: int, times: tuple[float, ...]) -> None:
        """A step's timings: where a drafting step's time went (bench spec), the verification rows'
        price and the governor's figures. proposals: the sampling sequences'; rows: the forward's;
        times: start, scheduled, drafted, verified, end."""
        start, scheduled_at, drafted_at, verified_at, end = times
        emitted = len(proposals) + accepted
        if any(p.token_ids for p in proposals):
            self.drafting_seconds.update(draft=drafted_at - scheduled_at, verify=verified_at - drafted_at,
                                         bookkeeping=(scheduled_at - start) + (end - verified_at))
            self.counters["drafting_steps"] += 1
            self.counters["drafting_step_tokens"] += emitted
            self.counters["verify_rows"] += len(proposals) + sum(len(p.token_ids) for p in proposals)
        if not all(s.num_tokens == 1 for s in scheduled):
            return  # a prefill chunk's cost would skew the figures below
        if not self._draftable(batch):  # the figures below are for where drafting may run
            if self.governor is not None:
                self.governor.interrupt()  # the draft cache falls behind meanwhile: catching up is no step to average
            return
        if self.row_price is not None:
            self.row_price.observe(rows, verified_at - drafted_at)
            self.proposer.confidence_threshold = self.row_price.threshold()
        if self.governor is not None and len(scheduled) == batch:  # a decode step of the whole running batch
            self.governor.record(batch, self._drafting, end - start, emitted)

    def _draftable(self, batch: int) -> bool:
        limit = self.config.speculative.disable_by_batch_size
        return limit is None or batch <= limit

    @property
    def draft_confidence_threshold(self) -> float:
        """The threshold drafting uses now: the config's, or the verification rows' price here."""
        if self.row_price is None:
            return self.config.speculative.draft_confidence_threshold
        return self.proposer.confidence_threshold

    def _kept_rows(self, chunk: SeqChunk, num_drafts: int, path: list[int]) -> list[int]:
        """The chunk's rows whose KV stays: its real tokens and the accepted drafts. A tree's
        accepted path may skip rows: their KV moves down so that the kept tokens sit in
        consecutive slots, as if the path had been verified alone."""
        first_draft = len(chunk.token_ids) - num_drafts
        rows = list(range(first_draft)) + [first_draft + d for d in path]
        moved = [(r, k) for k, r in enumerate(rows) if r != k]
        if moved:
            self.runner.move_kv(chunk.block_table, [chunk.start + r for r, _ in moved], [chunk.start + k for _, k in moved])
        return rows

    def generate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Run one request to completion, yielding its outputs as they come."""
        request_id = self.add_request(prompt_token_ids, params)
        while True:
            for out in self.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return

    def context_limit(self) -> int:
        """The longest sequence this engine can ever hold: max_model_len, or its whole KV pool if
        that holds fewer tokens (blocks retired for good not counted): what `validate` refuses a
        prompt at, where a sequence ends with "length", and what a worker registers. A sequence
        past the pool could never be scheduled again once preempted, and would block the queue."""
        return min(self.max_model_len, self.blocks.num_usable_blocks * self.config.block_size)

    def _lookahead(self, seq: Sequence) -> int:
        """Draft tokens to reserve for a decoding sequence: never more than it may still emit - 1,
        none in a step the governor decided not to draft, none while the batch is larger than
        speculative.disable_by_batch_size, and none for a
        prefill that is handed off after its first token (a chunked prefill whose last chunk is
        one token looks like a decoding sequence)."""
        if not self._drafting or seq.prefill_only or not self._draftable(len(self.scheduler.running)):
            return 0
        k = seq.params.num_speculative_tokens
        k = self.num_speculative_tokens if k is None else min(k, self.num_speculative_tokens)
        room = min(seq.params.max_tokens - seq.num_generated, self.context_limit() - len(seq.token_ids)) - 1
        return max(0, min(k, room))

    @property
    def num_speculative_tokens(self) -> int:
        spec = self.config.speculative
        return spec.num_speculative_tokens if spec.method != "none" else 0

    def _propose(self, scheduled: list[ScheduledSeq]) -> list[Proposal]:
        """Drafts for every sampling sequence, a chain up to its reserved slots (0: the proposer
        may still use the call to keep its state current) and perhaps a tree's leaves past them,
        which get slots here or are dropped when the pool is short."""
        sampling = [s for s in scheduled if s.yields_token]
        proposals = self.proposer.propose([s.seq for s in sampling], [s.num_lookahead for s in sampling])
        # The leaves' verification rows come out of the forward's token budget too (the scheduler
        # kept the reserved slots within it): what does not fit is cut, the least likely leaves first.
        spare = self.config.max_num_batched_tokens - sum(s.num_tokens + s.num_lookahead for s in scheduled)
        for i, (s, p) in enumerate(zip(sampling, proposals)):
            if len(p.token_ids) > s.num_lookahead + spare:
                p = proposals[i] = p.first(s.num_lookahead + spare)
            extra = len(p.token_ids) - s.num_lookahead
            if extra > 0 and not self.blocks.reserve(s.seq.seq_id, extra):  # the chain the slots hold
                proposals[i] = p.chain().first(s.num_lookahead)
            elif extra > 0:
                spare -= extra
        by_seq = {s.seq.seq_id: p for s, p in zip(sampling, proposals)}
        return [by_seq.get(s.seq.seq_id, Proposal([])) for s in scheduled]

    def _chunk(self, s: ScheduledSeq, proposal: Proposal) -> SeqChunk:
        start = s.seq.num_computed
        drafts = proposal.token_ids
        tokens = s.seq.token_ids[start : start + s.num_tokens] + drafts
        return SeqChunk(tokens, start, self.blocks.block_table(s.seq.seq_id), 1 + len(drafts) if s.yields_token else 0,
                        draft_parents=proposal.parents)

    def _push(self, seq: Sequence, new_tokens: list[int]) -> tuple[list[int], str, str | None]:
        """The step's new tokens into the output, up to its end: (ids kept, their text, finish reason)."""
        # (below 0 when retired blocks shrank the limit under the sequence: it ends now)
        room = max(0, min(seq.params.max_tokens - seq.num_generated, self.context_limit() - len(seq.token_ids)))
        new_tokens = new_tokens[:room]
        ids, text, reason = self.streams[seq.seq_id].push(new_tokens)
        seq.token_ids.extend(ids)  # not accepted drafts after a stop token or string: the output ended before them
        if reason is None and len(new_tokens) == room:
            reason = "length"
        return ids, text, reason

    def _emit(self, seq: Sequence, ids: list[int], text: str, reason: str | None) -> RequestOutput:
        return self._finish(seq, reason, ids, text) if reason is not None else RequestOutput(seq.seq_id, ids, text)

    def _finish(self, seq: Sequence, reason: str, ids: list[int], text: str) -> RequestOutput:
        self.counters[f"finished_{reason}"] += 1
        self.counters["generated_tokens"] += seq.num_generated
        seq.finish_reason = reason
        try:
            self.proposer.release(seq)  # before the blocks are freed: it may still write into them
        finally:  # failed (as after a failed step in the proposer): the sequence must not run on, its blocks held
            self.scheduler.remove(seq)
            stream = self.streams.pop(seq.seq_id)
            del self.seqs[seq.seq_id]
        if reason != "stop":
            text += stream.finish()
        return RequestOutput(seq.seq_id, ids, text, finished=True, finish_reason=reason,
                             acceptance=seq.acceptance if self.num_speculative_tokens else None,
                             usage=Usage(seq.num_prompt_tokens, seq.num_generated, seq.num_cached_prompt,
                                         seq.queue_seconds))

    def validate(self, request_id: str, prompt: Seq[int], params: SamplingParams) -> None:
        """Raises InvalidRequest (naming the field) or CapacityExceeded for a request this engine can
        never take, RequestIdInUse for an id it still holds."""
        if request_id in self.seqs or request_id in self.incoming or request_id in self.handed_off:
            raise RequestIdInUse(f"request_id {request_id!r} is already running on this worker")
        if not prompt:
            raise InvalidRequest("prompt", "must contain at least one token")
        vocab = self.runner.model_config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest("token_ids", f"token id {bad} outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequest("prompt", f"{len(prompt)} tokens leave no room to generate within the context limit of {self.max_model_len} tokens")
        if len(prompt) >= self.context_limit():
            blocks = -(-(len(prompt) + 1) // self.config.block_size)
            raise CapacityExceeded(f"prompt needs {blocks} KV blocks; this worker's pool has "
                                   f"{self.blocks.num_usable_blocks}")


def _rows(hidden: torch.Tensor | None, first: int, rows: list[int]) -> torch.Tensor | None:
    """hidden's rows first + r for r in rows (ascending from 0)."""
    if hidden is None:
        return None
    if rows[-1] == len(rows) - 1:  # consecutive (a tree's path may skip rows): a view, no copy
        return hidden[first : first + len(rows)]
    return hidden[[first + r for r in rows]]


def _triton_verify():
    from engine.spec.triton_rejection import triton_verify

    return triton_verify
