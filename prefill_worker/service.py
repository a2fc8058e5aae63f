"""The prefill worker's gRPC service: compute a prompt's KV (target and EAGLE3 draft) and its
first token, pin the blocks for the decode side, and return a KVHandle saying where they are."""

import logging
import queue
import threading

import grpc

from engine.errors import CapacityExceeded, InvalidRequest, RequestIdInUse
from engine.loop import EngineLoop
from kvtransfer.layout import block_checksums
from kvtransfer.source import KVSource
from serving.call_limit import CallLimit, request_call_limit
from serving.convert import sampling_params
from proto.pdspec.v1 import kv_pb2, worker_pb2_grpc
from proto.rpc import time_left
from pydantic import ValidationError

log = logging.getLogger(__name__)
_STALE_PIN_WAIT_S = 5.0  # for a block copy from a retried request's stale pin (a device cache's is slowest)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, loop: EngineLoop, source: KVSource, worker_id: str, address: str, layout: kv_pb2.KVLayout):
        self.loop, self.source = loop, source
        self.worker_id, self.address, self.layout = worker_id, address, layout
        self.calls = CallLimit(request_call_limit(loop.engine.config.max_num_seqs), "Prefill")

    def _free(self, rid: str) -> None:
        """The pin ended (or none will be made): the engine frees the blocks at its next step
        boundary, a no-op unless the request was handed off. Nothing waits for that (a Release
        would otherwise wait out the step under way, and the decode side's first token with it);
        any later command to the loop runs after it."""
        self.loop.post_logged(f"freeing the blocks of {rid}", self.loop.engine.release, rid)

    def Prefill(self, request, context: grpc.ServicerContext) -> kv_pb2.KVHandle:
        with self.calls.held(context):
            return self._prefill(request, context)

    def _prefill(self, request, context: grpc.ServicerContext) -> kv_pb2.KVHandle:
        rid = request.request_id
        # A prefill of an id still pinned here is the router's retry of that request (it gave up on
        # the attempt, and its Release may not have landed: the pull timed out, the router does not
        # wait on a worker it blames). The stale pin ends first, its blocks freed ahead of this
        # submit (the loop runs commands in order; a block copy from it under way, a gRPC pull's,
        # is waited for); kept, the retry met ALREADY_EXISTS.
        if self.source.release(rid, wait_s=_STALE_PIN_WAIT_S):
            log.info("prefill of %s again: its earlier attempt's pin ended", rid)
        try:
            outputs = self.loop.submit(rid, list(request.prompt_token_ids), sampling_params(request.sampling),
                                       prefill_only=True)
        except (InvalidRequest, ValidationError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except CapacityExceeded as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except RequestIdInUse as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        computed = threading.Event()

        def stop_if_abandoned() -> None:  # the RPC ended: cancelled mid-prefill, stop at the next chunk
            if not computed.is_set():
                self.loop.abort_later(rid)

        if not context.add_callback(stop_if_abandoned):  # it had ended already
            stop_if_abandoned()
        try:
            out = outputs.get(timeout=time_left(context))  # an abort always ends the queue too
            computed.set()
        except queue.Empty:
            # The request's last output is in `outputs` unless it still runs. Handed off meanwhile,
            # its blocks are freed here (nothing will pin them; and no other attempt of its id runs
            # until they are). Aborted already by the callback above, a retry of its id may run
            # now: it is left alone.
            if not self.loop.abort_attempt(rid, outputs):
                last = None if outputs.empty() else outputs.get_nowait()
                if last is not None and last.finish_reason == "prefilled":
                    self._free(rid)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {rid} did not finish before the deadline")
        if out.finish_reason != "prefilled":
            # Its blocks are free already (a failed step's hand-offs the loop releases), and freeing
            # by id now could free those of a retry under the same id, handed off since.
            why = "the engine failed a step (its log has the cause)" if out.finish_reason == "error" else out.finish_reason
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill of {rid} ended: {why}")
        h = out.handle
        try:
            pin_id = self.source.pin(rid, h.block_table, on_release=lambda: self._free(rid))
        except RuntimeError as e:  # shutting down: no new pins
            self._free(rid)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill of {rid}: its blocks could not be pinned: {e}")
        if not context.is_active():  # the router gave up meanwhile: nobody will fetch these blocks
            self.source.release(rid, pin_id)  # this pin only: a retry's may have replaced it
        return kv_pb2.KVHandle(
            request_id=rid, source_worker_id=self.worker_id, source_address=self.address, layout=self.layout,
            block_ids=h.block_table, num_prompt_tokens=len(request.prompt_token_ids), first_token=h.first_token,
            seed=h.seed,
            draft_hidden=h.draft_hidden.float().cpu().numpy().tobytes() if h.draft_hidden is not None else b"",
            cached_prompt_tokens=h.cached_prompt_tokens, queue_seconds=h.queue_seconds,
            nixl_agent=self.source.nixl.agent.name if self.source.nixl is not None else "", pin_id=pin_id,
            nixl_metadata_sha256=self.source.nixl.metadata_sha256 if self.source.nixl is not None else b"",
            block_checksums=block_checksums(self.source.caches, list(self.source.layout.caches()), h.block_table),
        )
