"""Disaggregation, the engine's side: hand a prefilled request to another engine (its blocks
pinned until `release`), or take one over (blocks reserved, the KV pulled in by the caller,
then `admit_prefilled`). A mixin of Engine: these methods work on its scheduler, blocks,
proposer and request tables, and the decode worker's service calls them through the loop."""

from collections.abc import Sequence as Seq

from engine.errors import InvalidRequest
from engine.output import KVHandle, OutputStream, RequestOutput
from engine.params import SamplingParams
from engine.sequence import Sequence


class Handoff:
    def _prefilled_handle(self, seq: Sequence, first_token: int) -> RequestOutput:
        draft_hidden = self.proposer.prefill_draft(seq, first_token)  # first: if it fails, an abort still finds seq running
        self.scheduler.detach(seq)
        handle = KVHandle(
            block_table=self.blocks.block_table(seq.seq_id),
            first_token=first_token,
            seed=seq.seed,
            draft_hidden=draft_hidden,
            cached_prompt_tokens=seq.num_cached_prompt,
            queue_seconds=seq.queue_seconds,
        )
        seq.finish_reason = "prefilled"
        try:
            self.proposer.release(seq)
        except BaseException:  # detached, the sequence's blocks are no longer any abort's to free
            self.blocks.free(seq.seq_id)
            raise
        self.counters["finished_prefilled"] += 1  # (a failure above ends it as an error, counted once)
        del self.seqs[seq.seq_id], self.streams[seq.seq_id]
        self.handed_off[seq.seq_id] = seq
        return RequestOutput(seq.seq_id, [first_token], "", finished=True, finish_reason="prefilled", handle=handle)

    def release(self, request_id: str) -> bool:
        """Free a handed-off request's blocks (the decode side has its KV, or gave up)."""
        seq = self.handed_off.pop(request_id, None)
        if seq is not None:
            self.blocks.free(request_id)
        return seq is not None

    def take_over(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams
                  ) -> tuple[int, list[int]] | None:
        """`reserve_prefilled` if there is room now: a batch slot, the blocks its prompt still
        needs, and no preempted sequence waiting to come back (new arrivals would take every
        freed block first and starve it); else None. A request it can never take raises
        (`validate`), rather than waiting for room."""
        self.validate(request_id, prompt_token_ids, params)
        busy = len(self.scheduler.running) + len(self.incoming)
        if self.scheduler.waiting or busy >= self.config.max_num_seqs or not self.blocks.can_allocate(prompt_token_ids):
            return None
        return self._reserve_prefilled(request_id, prompt_token_ids, params)

    def reserve_prefilled(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams) -> tuple[int, list[int]]:
        """Allocate blocks for a request prefilled elsewhere; returns (prompt tokens already cached
        here, block table). The caller fills the blocks past the cached ones, then calls
        `admit_prefilled` (or `drop_incoming` if the transfer failed)."""
        self.validate(request_id, prompt_token_ids, params)
        return self._reserve_prefilled(request_id, prompt_token_ids, params)

    def _reserve_prefilled(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams
                           ) -> tuple[int, list[int]]:
        cached = self.blocks.allocate(request_id, prompt_token_ids)
        seq = Sequence.new(request_id, prompt_token_ids, params)
        seq.num_cached_prompt = cached
        self.incoming[request_id] = seq
        return cached, self.blocks.block_table(request_id)

    def drop_incoming(self, request_id: str) -> None:
        """Free a request's blocks from `reserve_prefilled` once its transfer has ended without
        `admit_prefilled` (it failed): nothing writes into them any more."""
        if self.incoming.pop(request_id, None) is not None:
            self.blocks.free(request_id)

    def retire_incoming(self, request_id: str) -> None:
        """Drop a request from `reserve_prefilled` whose transfer failed and could not be stopped:
        its blocks never return to the pool, since the transfer may still write into them."""
        if self.incoming.pop(request_id, None) is not None:
            self.blocks.retire(request_id)

    def admit_prefilled(self, request_id: str, handle: KVHandle) -> RequestOutput:
        """The prompt's KV is in place: join the running batch; returns the first token's output
        (a finished "abort" one if the request was aborted while its KV arrived)."""
        seq = self.incoming[request_id]
        if seq.finish_reason == "abort":
            self.drop_incoming(request_id)
            return RequestOutput(request_id, [], "", finished=True, finish_reason="abort")
        try:  # the handle's state, before anything else changes: one that does not fit frees the blocks
            self.proposer.adopt(seq, len(seq.token_ids) - 1, handle.draft_hidden)
        except (RuntimeError, ValueError) as e:
            self.drop_incoming(request_id)
            raise InvalidRequest("prefilled", f"its draft hidden state does not fit this engine: {e}") from None
        seq.seed = handle.seed  # the draws go on as the prefill side's began
        del self.incoming[request_id]
        self.blocks.commit(request_id, seq.token_ids[seq.num_cached_prompt :])
        seq.num_computed = len(seq.token_ids)
        seq.num_cached_prompt = handle.cached_prompt_tokens  # usage reports the prefill side's cache hits
        seq.queue_seconds = handle.queue_seconds  # and its queue
        seq.admitted = True  # kept if it is preempted here and admitted again
        self.seqs[request_id] = seq
        self.streams[request_id] = OutputStream(self.tokenizer, seq.params)
        self.scheduler.add_running(seq)
        return self._emit(seq, *self._push(seq, [handle.first_token]))
