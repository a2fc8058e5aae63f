"""The decode worker's gRPC service: take over prefilled requests (pull their KV, join the
running batch) or, on an aggregated worker, prefill locally; stream the tokens back.

Back-pressure: a prefilled request waits (up to `admission_timeout_s`) until the KV pool has
room for its prompt and the batch a free slot; the prefill side keeps its blocks pinned
meanwhile. Nothing is dropped silently: every failure ends the stream with a status code.
"""

import dataclasses
import logging
import math
import queue
import time
from collections.abc import Iterator

import grpc
import numpy as np
import torch
from pydantic import ValidationError

from engine.errors import CapacityExceeded, InvalidRequest, RequestIdInUse
from engine.loop import EngineLoop
from engine.output import KVHandle, RequestOutput
from kvtransfer.connector import Cancellation, KVConnector, KVTransferError, check_layout
from serving.call_limit import CallLimit, request_call_limit
from serving.convert import acceptance, sampling_params
from serving.metrics import HandoffMetrics
from proto.pdspec.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from proto.rpc import FAILED_KV_SOURCE_METADATA_KEY, time_left

log = logging.getLogger(__name__)


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, loop: EngineLoop, connector: KVConnector | None, handoffs: HandoffMetrics,
                 transfer_timeout_s: float = 30.0, admission_timeout_s: float = 60.0):
        self.loop, self.connector, self.handoffs = loop, connector, handoffs
        self.transfer_timeout_s, self.admission_timeout_s = transfer_timeout_s, admission_timeout_s
        self.calls = CallLimit(request_call_limit(loop.engine.config.max_num_seqs), "Decode")

    def Decode(self, request, context: grpc.ServicerContext) -> Iterator[worker_pb2.DecodeResponse]:
        with self.calls.held(context):
            yield from self._decode(request, context)

    def _decode(self, request, context: grpc.ServicerContext) -> Iterator[worker_pb2.DecodeResponse]:
        rid = request.request_id
        try:
            params = sampling_params(request.sampling, request.speculation)
        except ValidationError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # This call's attempt, named by its output queue from the start: every abort below stops it,
        # never a later call's request of the same id (a retry admitted before this call's cleanup ran).
        outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        context.add_callback(lambda: self.loop.abort_attempt_later(rid, outputs))  # client gone: stop it
        try:
            if request.HasField("prefilled"):
                self._take_over(request, params, context, outputs)
            elif self.connector is None:  # aggregated worker: prefill here
                self.loop.submit(rid, list(request.prompt_token_ids), params, outputs=outputs)
            else:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this decode worker only takes prefilled requests")
        except InvalidRequest as e:
            if e.field.partition(".")[0] == "prefilled":  # the prefill worker's handle, not the client's request:
                # named, so the router retries on another prefill worker (e.g. one of the same version)
                context.set_trailing_metadata([(FAILED_KV_SOURCE_METADATA_KEY, request.prefilled.source_worker_id)])
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except CapacityExceeded as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except RequestIdInUse as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        if not context.is_active():  # it ended before the request existed here, so its callback found nothing
            self.loop.abort_attempt(rid, outputs)
        finished = False
        try:
            while not finished:
                out: RequestOutput = outputs.get()
                finished = out.finished
                if out.finish_reason == "error":  # a failure, not an answer: the router retries or reports it
                    context.abort(grpc.StatusCode.INTERNAL, "the decode worker's engine failed a step (its log has "
                                  "the cause); the request was ended")
                yield _response(out)
        finally:  # the stream closed before the request finished (its client left): stop it
            if not finished:
                self.loop.abort_attempt_later(rid, outputs)

    def Abort(self, request, context) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(found=self.loop.abort(request.request_id))

    def _take_over(self, request, params, context, outputs: queue.SimpleQueue[RequestOutput]) -> None:
        """Pull a prefilled request's KV into blocks reserved here and admit it, its outputs to `outputs`."""
        rid, handle = request.request_id, request.prefilled
        prompt = list(request.prompt_token_ids)
        block_size = self.loop.engine.config.block_size
        if self.connector is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this aggregated worker prefills prompts itself: "
                          "send it no prefilled handle")
        _check_handle(handle, rid, prompt, self.loop.engine)
        try:  # before waiting for room: a pair that cannot hand over would wait, then fail anyway
            check_layout(self.loop.engine.runner.layout, handle.layout, handle.source_worker_id)
        except KVTransferError as e:  # the pair's: the router retries on others (both sides avoided)
            context.set_trailing_metadata([(FAILED_KV_SOURCE_METADATA_KEY, handle.source_worker_id)])
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV transfer from {handle.source_worker_id} refused: {e}")
        cached, table = self._reserve(rid, prompt, params, context)
        first, end = cached // block_size, math.ceil(len(prompt) / block_size)
        started, admitted = time.perf_counter(), False
        cancel = Cancellation()
        if not context.add_callback(cancel.set):  # the call ended (its client cancelled it): the pull stops too
            cancel.set()
        try:
            self.connector.pull(handle, list(handle.block_ids[first:end]), table[first:end],
                                min(self.transfer_timeout_s, context.time_remaining()), cancel)
            self.handoffs.observe(time.perf_counter() - started,
                                  (end - first) * self.loop.engine.runner.layout.bytes_per_block())
            self.loop.admit_prefilled(rid, _engine_handle(handle, table), outputs)
            admitted = True
        except KVTransferError as e:
            if e.may_still_write:  # never reuse blocks a transfer may still write into
                self.loop.call(self.loop.engine.retire_incoming, rid)
            if context.time_remaining() <= 0:  # the request's own deadline cut the pull: no source to blame
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the request's deadline passed while its KV "
                              f"arrived from {handle.source_worker_id}")
            code = grpc.StatusCode.UNAVAILABLE if e.retryable else grpc.StatusCode.FAILED_PRECONDITION
            # Named whatever the code: a pull fails at its source or between the pair (a checksum that
            # does not match, a source of another version), and the router then avoids both. Unnamed,
            # it blamed this worker alone and retried without it: with one decode worker, no retry.
            context.set_trailing_metadata([(FAILED_KV_SOURCE_METADATA_KEY, handle.source_worker_id)])
            context.abort(code, f"KV transfer from {handle.source_worker_id} failed: {e}")
        finally:  # not admitted, however it ended: the transfer is over, the blocks go
            if not admitted:
                self.loop.call(self.loop.engine.drop_incoming, rid)

    def _reserve(self, rid, prompt, params, context) -> tuple[int, list[int]]:
        """Allocate the prompt's blocks, waiting while the pool or the batch is full."""
        left = time_left(context)
        deadline_first = left is not None and left < self.admission_timeout_s  # then the request's deadline ends it
        waited_from = time.monotonic()
        deadline = waited_from + (left if deadline_first else self.admission_timeout_s)
        while time.monotonic() < deadline and context.is_active():
            reserved = self.loop.take_over(rid, prompt, params)
            if reserved is not None:
                return reserved
            self.loop.wait_step(0.2)
        if deadline_first:  # not a full worker (retried elsewhere): a request out of time
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the request's deadline passed after "
                          f"{time.monotonic() - waited_from:.1f}s waiting for room in the decode worker's KV pool")
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"decode worker KV pool stayed full for {self.admission_timeout_s:.0f}s; retry later")


def _check_handle(handle, request_id: str, prompt: list[int], engine) -> None:
    """A prefilled handle that cannot be this request's or this engine's (InvalidRequest naming
    the field), refused before it waits for room or moves a byte. Blocks are counted in the
    source's block size: one unlike ours is the layout's error (FAILED_PRECONDITION, by the pull)."""
    if not handle.HasField("seed"):  # a prefill worker of a version before seeds (each handle would draw alike)
        raise InvalidRequest("prefilled.seed", "missing: run prefill and decode workers of the same pdspec version")
    if len(handle.draft_hidden) % 4:
        raise InvalidRequest("prefilled.draft_hidden", f"{len(handle.draft_hidden)} bytes, not whole float32 values")
    vocab = engine.runner.model_config.vocab_size
    if not 0 <= handle.first_token < vocab:  # the next step's embedding lookup would fail its whole batch
        raise InvalidRequest("prefilled.first_token", f"{handle.first_token} is outside the vocabulary [0, {vocab})")
    if handle.request_id != request_id:
        raise InvalidRequest("prefilled.request_id", f"{handle.request_id!r} is not this request's ({request_id!r})")
    if handle.num_prompt_tokens != len(prompt):
        raise InvalidRequest("prefilled.num_prompt_tokens", f"{handle.num_prompt_tokens}, but the prompt has "
                             f"{len(prompt)} tokens")
    block_size = max(handle.layout.block_size, 1)
    blocks = math.ceil(len(prompt) / block_size)
    if len(handle.block_ids) != blocks or min(handle.block_ids, default=0) < 0:
        raise InvalidRequest("prefilled.block_ids", f"{len(handle.block_ids)} ids (none negative) for a prompt "
                             f"of {blocks} {block_size}-token blocks")


def _engine_handle(handle, table: list[int]) -> KVHandle:
    hidden = np.frombuffer(handle.draft_hidden, dtype=np.float32)
    return KVHandle(
        block_table=table,
        first_token=handle.first_token,
        seed=handle.seed,
        draft_hidden=torch.from_numpy(hidden.copy()).view(1, -1) if hidden.size else None,
        cached_prompt_tokens=handle.cached_prompt_tokens,
        queue_seconds=handle.queue_seconds,
    )


def _response(out: RequestOutput) -> worker_pb2.DecodeResponse:
    response = worker_pb2.DecodeResponse(token_ids=out.token_ids, text=out.text, finish_reason=out.finish_reason or "")
    if out.usage is not None:
        response.usage.CopyFrom(common_pb2.Usage(**dataclasses.asdict(out.usage)))
    if out.acceptance is not None:
        response.acceptance.CopyFrom(acceptance(out.acceptance))
    return response
