"""The prefill worker's service in-process: a real PrefillServicer on 127.0.0.1 over a real engine
and KV source, its timing forced on purpose (an engine step held at a gate)."""

import threading

import grpc

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loop import EngineLoop
from kvtransfer.source import KVSource
from prefill_worker.service import PrefillServicer
from proto.pdspec.v1 import worker_pb2, worker_pb2_grpc
from proto.rpc import serve
from serving.worker_process import kv_caches, layout_message


def test_a_cancelled_attempts_late_cleanup_leaves_a_retry_of_its_id_handed_off(chat_prompts, monkeypatch):
    """A client cancels a prefill and sends its id again at once. The first attempt's handler wakes
    to its abort after the retry was prefilled and handed off: it freed the blocks by id then, the
    retry's, which the retry's handle still named (a decode worker would read blocks reused since)."""
    engine = Engine(EngineConfig(num_kv_blocks=64, speculative={"method": "none"}))
    step, gate, at_gate = engine.step, threading.Event(), threading.Event()

    def held_once() -> list:  # the first attempt's prefill step: held, then skipped
        if not at_gate.is_set():
            at_gate.set()
            gate.wait(60)
            return []
        return step()

    monkeypatch.setattr(engine, "step", held_once)
    loop = EngineLoop(engine)
    source = KVSource(engine.runner.layout, kv_caches(loop), 600, nixl=False)
    servicer = PrefillServicer(loop, source, "prefill-test", "", layout_message(loop))
    retried, first_ended, abort_posted = threading.Event(), threading.Event(), threading.Event()
    free, prefill, abort_later = servicer._free, servicer._prefill, loop.abort_later
    calls = []

    def free_after_the_retry(rid: str) -> None:  # the first handler's wake-up, late
        retried.wait(60)
        free(rid)

    def tracked_prefill(request, context):
        calls.append(request.request_id)
        is_first = len(calls) == 1
        try:
            return prefill(request, context)
        finally:
            if is_first:
                first_ended.set()

    def noted_abort_later(rid: str) -> None:
        abort_later(rid)
        abort_posted.set()

    servicer._free, servicer._prefill, loop.abort_later = free_after_the_retry, tracked_prefill, noted_abort_later
    server, port = serve([(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, servicer, "pdspec.v1.PrefillWorker")],
                         "127.0.0.1:0")
    try:
        request = worker_pb2.PrefillRequest(request_id="x", prompt_token_ids=chat_prompts[0])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            first = stub.Prefill.future(request, timeout=60)
            assert at_gate.wait(60)
            first.cancel()
            assert abort_posted.wait(60)  # the retry's submit queues behind the first attempt's abort
            retry = stub.Prefill.future(request, timeout=60)
            gate.set()
            handle = retry.result()
            retried.set()
        assert first_ended.wait(60)
        loop.call(lambda: None)  # whatever the first handler posted has run
        assert loop.call(lambda: "x" in engine.handed_off)
        assert loop.call(lambda: engine.blocks.num_used_blocks) >= len(handle.block_ids)
        assert source.pinned("x", handle.pin_id) == frozenset(handle.block_ids)
    finally:
        gate.set()
        retried.set()
        server.stop(None)
        source.close()
        loop.stop()
