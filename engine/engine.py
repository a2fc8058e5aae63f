"""One engine: scheduler + model runner + sampler + output streams, driven by `step()`.

Each step runs one forward over everything the scheduler picked (prefill chunks and decode
tokens together), samples one token for every sequence whose chunk reached its end, commits
the computed tokens' KV in the block manager (which makes full blocks prefix-cacheable) and
returns the new tokens and text per request.
"""

import itertools
from collections.abc import Iterator, Sequence as Seq

from engine.batch import SeqChunk
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import CapacityExceeded, InvalidRequest
from engine.output import OutputStream, RequestOutput
from engine.runner import ModelRunner
from engine.sampling import SamplingParams, sample
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = Tokenizer.from_dir(self.runner.model_dir)
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.blocks)
        self.max_model_len = self.runner.max_model_len
        self.seqs: dict[str, Sequence] = {}
        self.streams: dict[str, OutputStream] = {}
        self._ids = itertools.count()

    def add_request(self, prompt_token_ids: Seq[int], params: SamplingParams, request_id: str | None = None) -> str:
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self._validate(request_id, prompt_token_ids)
        seq = Sequence.new(request_id, prompt_token_ids, params)
        self.seqs[request_id] = seq
        self.streams[request_id] = OutputStream(self.tokenizer, params)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.get(request_id)
        return self._finish(seq, "abort", [], "") if seq else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        chunks = [self._chunk(s) for s in scheduled]
        out = self.runner.forward(chunks)
        sampling = [s.seq for s in scheduled if s.samples]
        tokens = sample(out.logits, [s.params for s in sampling], [s.generator for s in sampling])
        for s, chunk in zip(scheduled, chunks):
            self.blocks.commit(s.seq.seq_id, chunk.token_ids)
            s.seq.num_computed += len(chunk.token_ids)
        return [self._append(seq, [token]) for seq, token in zip(sampling, tokens)]

    def generate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Run one request to completion, yielding its outputs as they come."""
        request_id = self.add_request(prompt_token_ids, params)
        while True:
            for out in self.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return

    def _chunk(self, s: ScheduledSeq) -> SeqChunk:
        start = s.seq.num_computed
        return SeqChunk(s.seq.token_ids[start : start + s.num_tokens], start,
                        self.blocks.block_table(s.seq.seq_id), 1 if s.samples else 0)

    def _append(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        room = min(seq.params.max_tokens - seq.num_generated, self.max_model_len - len(seq.token_ids))
        new_tokens = new_tokens[:room]
        seq.token_ids.extend(new_tokens)
        ids, text, reason = self.streams[seq.seq_id].push(new_tokens)
        if reason is None and len(new_tokens) == room:
            reason = "length"
        if reason is not None:
            return self._finish(seq, reason, ids, text)
        return RequestOutput(seq.seq_id, ids, text)

    def _finish(self, seq: Sequence, reason: str, ids: list[int], text: str) -> RequestOutput:
        self.scheduler.remove(seq)
        seq.finish_reason = reason
        stream = self.streams.pop(seq.seq_id)
        if reason != "stop":
            text += stream.finish()
        del self.seqs[seq.seq_id]
        return RequestOutput(seq.seq_id, ids, text, finished=True, finish_reason=reason)

    def _validate(self, request_id: str, prompt: Seq[int]) -> None:
        if request_id in self.seqs:
            raise InvalidRequest("request_id", f"{request_id!r} is already running")
        if not prompt:
            raise InvalidRequest("prompt", "must contain at least one token")
        vocab = self.runner.model_config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest("token_ids", f"token id {bad} outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequest("prompt", f"{len(prompt)} tokens leave no room to generate within the context limit of {self.max_model_len} tokens")
        blocks = -(-(len(prompt) + 1) // self.config.block_size)
        if blocks > self.config.num_kv_blocks:
            raise CapacityExceeded(f"prompt needs {blocks} KV blocks; this worker's pool has {self.config.num_kv_blocks}")
