"""The decode worker's failures: a real DecodeServicer on 127.0.0.1 over a real engine, with
faults injected on purpose (a KV transfer that fails: the real backends' failures are
tests/test_kvtransfer.py's; an engine step that raises)."""

import contextlib
import math
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from decode_worker.service import DecodeServicer
from engine.config import EngineConfig
from engine.engine import Engine
from engine.loop import EngineLoop
from kvtransfer.connector import KVTransferError
from kvtransfer.layout import layout_to_proto
from proto.pdspec.v1 import common_pb2, kv_pb2, worker_pb2, worker_pb2_grpc
from proto.rpc import FAILED_KV_SOURCE_METADATA_KEY, serve
from serving.metrics import HandoffMetrics
from tests.waiting import wait_until

NUM_BLOCKS = 64


class FailingConnector:
    def __init__(self, may_still_write: bool, retryable: bool = True):
        self.may_still_write, self.retryable = may_still_write, retryable

    def pull(self, handle, remote_block_ids, local_block_ids, timeout_s, cancel=None) -> None:
        raise KVTransferError("injected: the READ failed", retryable=self.retryable, may_still_write=self.may_still_write)

    def close(self) -> None:
        pass


def _serve(servicer) -> tuple[grpc.Server, str]:
    server, port = serve([(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, servicer, "pdspec.v1.DecodeWorker")],
                         "127.0.0.1:0")
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("may_still_write, retryable", [(False, True), (True, True), (False, False)])
def test_a_failed_transfer_frees_its_blocks_unless_it_may_still_write_into_them(may_still_write, retryable,
                                                                                 chat_prompts):
    """And it names its source, retryable or not (a checksum that does not match, a source of
    another version): the router then avoids both sides, where it used to blame this worker alone."""
    loop = EngineLoop(Engine(EngineConfig(num_kv_blocks=NUM_BLOCKS, speculative={"method": "none"})))
    servicer = DecodeServicer(loop, FailingConnector(may_still_write, retryable), HandoffMetrics("decode-test"))
    server, address = _serve(servicer)
    try:
        prompt = chat_prompts[0]
        engine = loop.engine
        blocks = math.ceil(len(prompt) / engine.config.block_size)
        handle = kv_pb2.KVHandle(request_id="r", num_prompt_tokens=len(prompt), block_ids=list(range(blocks)),
                                 layout=layout_to_proto(engine.runner.layout), source_worker_id="prefill-test",
                                 source_address="127.0.0.1:1", seed=7)
        request = worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=prompt, prefilled=handle,
                                           sampling=common_pb2.SamplingOptions(max_tokens=4))
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as failed:
                list(worker_pb2_grpc.DecodeWorkerStub(channel).Decode(request, timeout=60))
        error = failed.value
        code = grpc.StatusCode.UNAVAILABLE if retryable else grpc.StatusCode.FAILED_PRECONDITION
        assert error.code() == code and "injected" in error.details()
        assert (FAILED_KV_SOURCE_METADATA_KEY, "prefill-test") in error.trailing_metadata()
        retired = blocks if may_still_write else 0
        assert loop.call(lambda: (engine.blocks.num_free_blocks, engine.blocks.num_retired_blocks, engine.incoming)) \
            == (NUM_BLOCKS - retired, retired, {})
        assert loop.stats().counters["kv_blocks_retired"] == retired  # exported as pdspec_kv_blocks_retired_total
    finally:
        server.stop(None)
        loop.stop()


def test_a_failed_engine_step_is_an_error_not_an_answer(chat_prompts, monkeypatch):
    """The loop ends the step's requests; their calls end INTERNAL (the router retries them on
    another worker, or reports the failure), never as an answer that merely stopped."""
    engine = Engine(EngineConfig(num_kv_blocks=NUM_BLOCKS, speculative={"method": "none"}))
    step = engine.step

    def fail_after_the_first_token():
        outputs = step()
        if any(seq.num_generated for seq in engine.seqs.values()):
            raise RuntimeError("injected: a step failed")
        return outputs

    monkeypatch.setattr(engine, "step", fail_after_the_first_token)
    loop = EngineLoop(engine)
    server, address = _serve(DecodeServicer(loop, None, HandoffMetrics("decode-test")))
    try:
        request = worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=chat_prompts[0],
                                           sampling=common_pb2.SamplingOptions(max_tokens=16))
        received = []
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as failed:
                for response in worker_pb2_grpc.DecodeWorkerStub(channel).Decode(request, timeout=60):
                    received.append(response)
        assert failed.value.code() == grpc.StatusCode.INTERNAL and "failed a step" in failed.value.details()
        assert all(not r.finish_reason for r in received)
        assert loop.call(lambda: (engine.has_unfinished(), engine.blocks.num_used_blocks)) == (False, 0)
        assert engine.counters["finished_error"] == 1 and not engine.counters["finished_abort"]
    finally:
        server.stop(None)
        loop.stop()


def test_calls_past_twice_a_batch_are_refused_at_once(chat_prompts):
    """Each call holds a server thread while it runs or waits for room: past twice the batch
    (here 2 x max_num_seqs 1) a Decode is RESOURCE_EXHAUSTED (the router tries another worker),
    so streams cannot take every thread from health checks, Abort and KV pulls."""
    loop = EngineLoop(Engine(EngineConfig(num_kv_blocks=512, max_num_seqs=1, speculative={"method": "none"})))
    server, address = _serve(DecodeServicer(loop, None, HandoffMetrics("decode-test")))
    try:
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)

            def request(i: int) -> worker_pb2.DecodeRequest:
                return worker_pb2.DecodeRequest(request_id=f"r{i}", prompt_token_ids=chat_prompts[0],
                                                sampling=common_pb2.SamplingOptions(max_tokens=8000, ignore_eos=True))
            running = stub.Decode(request(0), timeout=120)
            next(running)  # it holds the batch's one slot for thousands of tokens
            waiting = stub.Decode(request(1), timeout=120)
            for _ in range(600):  # until it waits in the engine (a liveness bound)
                if "r1" in loop.engine.seqs:
                    break
                time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as refused:
                next(stub.Decode(request(2), timeout=60))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "serves 2 Decode calls already" in refused.value.details()
            running.cancel()
            waiting.cancel()
    finally:
        server.stop(None)
        loop.stop()


@contextlib.contextmanager
def _aggregated_worker() -> Iterator[tuple[EngineLoop, worker_pb2_grpc.DecodeWorkerStub]]:
    loop = EngineLoop(Engine(EngineConfig(num_kv_blocks=NUM_BLOCKS, speculative={"method": "none"})))
    server, address = _serve(DecodeServicer(loop, None, HandoffMetrics("decode-test")))
    try:
        with grpc.insecure_channel(address) as channel:
            yield loop, worker_pb2_grpc.DecodeWorkerStub(channel)
    finally:
        server.stop(None)
        loop.stop()


def _request_of_256_tokens(prompt: list[int]) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=prompt,
                                    sampling=common_pb2.SamplingOptions(max_tokens=256, ignore_eos=True))


def _assert_ran_to_its_length(first: worker_pb2.DecodeResponse, rest: list[worker_pb2.DecodeResponse]) -> None:
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 256


def test_a_call_refused_for_a_taken_id_leaves_that_request_running(chat_prompts):
    """A second Decode of a request id running here is ALREADY_EXISTS; its call's end (its client
    gone, to the worker) aborted the running request of that id, another call's."""
    with _aggregated_worker() as (_, stub):
        request = _request_of_256_tokens(chat_prompts[0])
        running = stub.Decode(request, timeout=60)
        first = next(running)
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.Decode(request, timeout=60))
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        _assert_ran_to_its_length(first, list(running))


def test_a_cancelled_calls_late_cleanup_leaves_a_retry_of_its_id_running(chat_prompts):
    """A call cancelled right after its request joined the engine, its handler thread held up there
    (injected) until the client's retry under the same id runs: the handler's cleanup stops its own
    request, not the retry (it aborted whatever ran under the id)."""
    submitted, resume = threading.Event(), threading.Event()
    with _aggregated_worker() as (loop, stub):
        submit = loop.submit

        def submit_then_stall(*args, **kwargs):
            outputs = submit(*args, **kwargs)
            if not submitted.is_set():  # the first call only
                submitted.set()
                resume.wait(60)
            return outputs

        loop.submit = submit_then_stall
        try:
            request = _request_of_256_tokens(chat_prompts[0])
            first_call = stub.Decode(request, timeout=60)
            assert submitted.wait(30)
            first_call.cancel()  # its callback stops the first request
            wait_until(lambda: "r" not in loop.engine.seqs, "the cancelled call's request was not stopped")
            retry = stub.Decode(request, timeout=60)
            first = next(retry)
            resume.set()  # the first call's handler goes on, finds its call over and cleans up
            _assert_ran_to_its_length(first, list(retry))
        finally:
            resume.set()


def test_a_worker_whose_engine_fails_every_step_answers_health_checks_not_serving(chat_prompts):
    """Its heartbeats stop and its health checks (the router's probe after a failed call, Kubernetes'
    liveness) answer NOT_SERVING: they said SERVING whatever the engine did."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from decode_worker.main import start_decode_worker
    from engine.loop import FAILED_STEPS_LIMIT
    from serving.worker_process import WorkerSpec

    spec = WorkerSpec(role="aggregated", engine=EngineConfig(num_kv_blocks=NUM_BLOCKS, speculative={"method": "none"}),
                      router_address="127.0.0.1:9", token=None, heartbeat_interval_s=60.0)  # no router: none needed
    worker = start_decode_worker(spec, None, admission_timeout_s=5.0)
    engine = worker.loop.engine

    def fail():
        raise RuntimeError("injected: the device is gone")

    try:
        with grpc.insecure_channel(worker.address) as channel:
            health_check = health_pb2_grpc.HealthStub(channel).Check

            def statuses() -> set[int]:  # liveness (readiness: NOT_SERVING here, no router knows the worker)
                return {health_check(health_pb2.HealthCheckRequest(service=s), timeout=5).status for s in ("",)}

            assert statuses() == {health_pb2.HealthCheckResponse.SERVING}
            engine.step = fail  # every step from now on
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            for i in range(FAILED_STEPS_LIMIT):
                request = worker_pb2.DecodeRequest(request_id=f"r{i}", prompt_token_ids=chat_prompts[0],
                                                   sampling=common_pb2.SamplingOptions(max_tokens=4))
                with pytest.raises(grpc.RpcError):
                    list(stub.Decode(request, timeout=60))
            assert statuses() == {health_pb2.HealthCheckResponse.NOT_SERVING}  # at once: the probe follows the call
            health_url = f"http://127.0.0.1:{worker.metrics_server.server_port}/health"  # TLS clusters' probe
            assert httpx.get(health_url, timeout=5).status_code == 503
    finally:
        del engine.step
        worker.stop()


def test_a_handle_of_another_kv_layout_is_refused_before_it_waits_for_room(chat_prompts):
    """A pair that cannot hand over is told at once (FAILED_PRECONDITION, naming the source so the
    router avoids both), not after waiting for blocks (with the pool full here, that wait ended
    RESOURCE_EXHAUSTED: retried as if the worker were busy)."""
    loop = EngineLoop(Engine(EngineConfig(num_kv_blocks=NUM_BLOCKS, speculative={"method": "none"})))
    servicer = DecodeServicer(loop, FailingConnector(False), HandoffMetrics("decode-test"), admission_timeout_s=1.0)
    server, address = _serve(servicer)
    try:
        prompt, engine = chat_prompts[0], loop.engine
        layout = layout_to_proto(engine.runner.layout)
        layout.dtype = "float32" if layout.dtype != "float32" else "bfloat16"
        handle = kv_pb2.KVHandle(request_id="r", num_prompt_tokens=len(prompt), layout=layout, seed=7,
                                 block_ids=list(range(math.ceil(len(prompt) / engine.config.block_size))),
                                 source_worker_id="prefill-test", source_address="127.0.0.1:1")
        loop.call(lambda: engine.blocks.allocate("hog", list(range(NUM_BLOCKS * engine.config.block_size - 1))))
        request = worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=prompt, prefilled=handle,
                                           sampling=common_pb2.SamplingOptions(max_tokens=4))
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as failed:
                list(worker_pb2_grpc.DecodeWorkerStub(channel).Decode(request, timeout=60))
        assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "dtype" in failed.value.details()
        assert (FAILED_KV_SOURCE_METADATA_KEY, "prefill-test") in failed.value.trailing_metadata()
    finally:
        server.stop(None)
        loop.stop()


def test_a_worker_is_ready_only_while_its_router_knows_it(model_dir):
    """Readiness (the worker's own service, Kubernetes' readiness probe) waits for the router to
    register the worker: one with another cluster token, or with no router up, answered SERVING and
    counted as ready while serving nothing. Liveness ("") stays SERVING: a restart would not help."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from decode_worker.main import start_decode_worker
    from deploy.config import DeploymentConfig
    from proto.rpc import free_port
    from router.main import run_router
    from serving.worker_process import WorkerSpec

    registry_port = free_port()
    spec = WorkerSpec(role="aggregated", engine=EngineConfig(num_kv_blocks=NUM_BLOCKS, speculative={"method": "none"}),
                      router_address=f"127.0.0.1:{registry_port}", token="ours", heartbeat_interval_s=0.1)
    worker = start_decode_worker(spec, None, admission_timeout_s=5.0)
    config = DeploymentConfig(router={"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0})

    def router(token: str):
        return run_router(config.router, token, model_dir, "smollm2", port=0, internal_port=registry_port)

    try:
        with grpc.insecure_channel(worker.address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check

            def status(service: str) -> int:
                return check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

            def settles_at(expected: int, what: str) -> None:
                wait_until(lambda: status("pdspec.v1.DecodeWorker") == expected, what, 10, poll_s=0.05)

            def http(path: str) -> int:  # the same on the plain-HTTP metrics port (TLS clusters' probes)
                return httpx.get(f"http://127.0.0.1:{worker.metrics_server.server_port}{path}", timeout=5).status_code

            serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
            assert status("pdspec.v1.DecodeWorker") == not_serving and status("") == serving  # no router yet
            assert (http("/ready"), http("/health")) == (503, 200)
            stranger = router("theirs")  # refuses the worker's registrations
            time.sleep(1.0)
            assert status("pdspec.v1.DecodeWorker") == not_serving
            stranger.stop(0)
            ours = router("ours")
            settles_at(serving, "registered, still not ready")
            assert (http("/ready"), http("/health"), http("/metrics")) == (200, 200, 200)
            ours.stop(0)
            settles_at(not_serving, "its router gone, still ready")
            assert status("") == serving and (http("/ready"), http("/health")) == (503, 200)
    finally:
        worker.stop()
