"""The real router over workers with faults injected on purpose (fake workers on free ports):
retries, the KV hand-off's blame, health probes, call limits, deadlines and what clients read."""

import contextlib
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto.pdspec.v1 import kv_pb2, kv_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from proto.rpc import FAILED_KV_SOURCE_METADATA_KEY, RETRY_AFTER_METADATA_KEY, channel
from router.config import RouterConfig
from router.main import run_router
from tests.test_router_server import HELLO, TOKEN, registration, rpc_error
from tests.waiting import wait_until


class _FullDecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """An injected fault: a worker whose KV pool is full (and that serves no health checks)."""

    def Decode(self, request, context):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode worker KV pool stayed full for 15s; retry later")


class _SlowDecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """An injected fault: a worker that sends `first` responses, then nothing until the call ends."""

    def __init__(self, first: int):
        self.first, self.calls = first, 0

    def Decode(self, request, context):
        self.calls += 1
        for _ in range(self.first):
            yield worker_pb2.DecodeResponse(token_ids=[42], text="x")
        while context.is_active():
            time.sleep(0.05)


class _PrefillWorker(worker_pb2_grpc.PrefillWorkerServicer, kv_pb2_grpc.KVTransferServicer):
    """A prefill worker that only hands out handles naming itself (what it is asked is counted)."""

    def __init__(self, worker_id: str):
        self.worker_id, self.prefills = worker_id, 0

    def Prefill(self, request, context):
        self.prefills += 1
        return kv_pb2.KVHandle(request_id=request.request_id, source_worker_id=self.worker_id, seed=7,
                               num_prompt_tokens=len(request.prompt_token_ids))

    def Release(self, request, context):
        return kv_pb2.ReleaseResponse(found=True)


class _SourceBlamingDecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """An injected fault: the first `refusals` calls fail with `code`, naming the handle's source as
    the decode worker does for a failed pull (UNAVAILABLE) or an unfit handle (INVALID_ARGUMENT, as
    an older prefill worker's would be); the others are served (one token)."""

    def __init__(self, refusals: int, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        self.refusals, self.code, self.sources = refusals, code, []

    def Decode(self, request, context):
        self.sources.append(request.prefilled.source_worker_id)
        if len(self.sources) <= self.refusals:
            context.set_trailing_metadata([(FAILED_KV_SOURCE_METADATA_KEY, request.prefilled.source_worker_id)])
            context.abort(self.code, "prefilled.seed: missing: run prefill and decode workers of the same pdspec "
                          "version" if self.code == grpc.StatusCode.INVALID_ARGUMENT else
                          f"KV transfer from {request.prefilled.source_worker_id} failed: NIXL_ERR_BACKEND")
        yield worker_pb2.DecodeResponse(token_ids=[42], text="x", finish_reason="length")


@contextlib.contextmanager
def _router_over_fakes(model_dir, fakes: dict, max_num_seqs: dict[str, int] | None = None):
    """A real router (max_retries 1) over fake workers (id -> servicer, each on its own server and
    registered in its role; `max_num_seqs` overrides the registration's 4 by id): yields its stub."""
    servers, addresses = [], {}
    for worker_id, servicer in fakes.items():
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        if isinstance(servicer, worker_pb2_grpc.DecodeWorkerServicer):
            worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        else:
            worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
            kv_pb2_grpc.add_KVTransferServicer_to_server(servicer, server)
        if hasattr(servicer, "health"):
            health_pb2_grpc.add_HealthServicer_to_server(servicer.health, server)
        addresses[worker_id] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
        servers.append(server)
    config = RouterConfig(heartbeat_interval_s=30.0, heartbeat_timeout_s=60.0, max_retries=1)
    router = run_router(config, TOKEN, model_dir, "smollm2", port=0, internal_port=0)
    try:
        with channel(f"127.0.0.1:{router.port}", TOKEN) as internal, \
                channel(f"127.0.0.1:{router.internal_port}", TOKEN) as registry:
            for worker_id, servicer in fakes.items():
                role = "decode" if isinstance(servicer, worker_pb2_grpc.DecodeWorkerServicer) else "prefill"
                request = registration(worker_id, addresses[worker_id], role=role)
                request.max_num_seqs = (max_num_seqs or {}).get(worker_id, request.max_num_seqs)
                worker_pb2_grpc.RegistryStub(registry).Register(request, timeout=10)
                if hasattr(servicer, "registry"):  # a fake that heartbeats
                    servicer.registry = worker_pb2_grpc.RegistryStub(registry)
            yield router_pb2_grpc.RouterStub(internal)
    finally:
        router.stop(0)
        for server in servers:
            server.stop(0)


def test_a_handle_its_decode_worker_refuses_is_prefilled_again_on_another_prefill_worker(model_dir):
    """INVALID_ARGUMENT from a decode worker that names the KV source is the prefill worker's fault
    (its handle), not the client's request: retried on the other prefill worker, not refused."""
    prefills = [_PrefillWorker("prefill-a"), _PrefillWorker("prefill-b")]
    decode = _SourceBlamingDecodeWorker(refusals=1)
    with _router_over_fakes(model_dir, {p.worker_id: p for p in prefills} | {"decode": decode}) as router:
        answer = list(router.Generate(HELLO, timeout=30))
    assert [r.text for r in answer] == ["x"] and answer[-1].finish_reason == "length"
    assert sorted(decode.sources) == ["prefill-a", "prefill-b"]  # the second attempt on the other one
    assert [p.prefills for p in prefills] == [1, 1]


def test_a_decode_worker_that_blames_its_kv_source_is_not_retried_first(model_dir):
    """A decode worker whose own KV path is broken blames each source: the retry prefers the other
    decode worker (it would otherwise, idle, be the least loaded again), and keeps the only prefill
    worker, which may be healthy (blamed, it was written off and the request failed)."""
    prefill = _PrefillWorker("prefill-a")
    broken = _SourceBlamingDecodeWorker(refusals=10, code=grpc.StatusCode.UNAVAILABLE)
    healthy = _SourceBlamingDecodeWorker(refusals=0)
    with _router_over_fakes(model_dir, {"prefill-a": prefill, "decode-a": broken, "decode-b": healthy}) as router:
        answer = list(router.Generate(HELLO, timeout=30))
    assert [r.text for r in answer] == ["x"]
    assert (broken.sources, healthy.sources, prefill.prefills) == (["prefill-a"], ["prefill-a"], 2)


class _SlowReleasePrefillWorker(_PrefillWorker):
    """Its Release answers once the test's client has its answer, or when the router gives up on it
    (5 s): whether the client had it well before then is recorded. The first `prompt_releases`
    answer at once."""

    def __init__(self, worker_id: str, prompt_releases: int = 0):
        super().__init__(worker_id)
        self.answered, self.in_time, self.prompt_releases = threading.Event(), [], prompt_releases

    def Release(self, request, context):
        if len(self.in_time) < self.prompt_releases:
            self.in_time.append(True)
            return kv_pb2.ReleaseResponse(found=True)
        while not self.answered.wait(0.05) and context.is_active():
            pass
        self.in_time.append(self.answered.is_set() and context.time_remaining() > 1.0)
        return kv_pb2.ReleaseResponse(found=True)


class _RefusingDecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    def Decode(self, request, context):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling: refused by this worker (an injected fault)")


def test_a_refused_request_does_not_wait_on_its_prefills_release(model_dir):
    """No retry follows a request its decode worker refused: its client's error waited on the
    prefill worker's Release (up to 5 s for one that is slow to answer)."""
    prefill = _SlowReleasePrefillWorker("prefill-a")
    with _router_over_fakes(model_dir, {"prefill-a": prefill, "decode-a": _RefusingDecodeWorker()}) as router:
        assert rpc_error(lambda: list(router.Generate(HELLO, timeout=30))).code() == grpc.StatusCode.INVALID_ARGUMENT
        prefill.answered.set()
        wait_until(lambda: prefill.in_time, "the prefill worker got no Release", 30)
    assert prefill.in_time == [True]


class _TroubledDecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """A decode worker whose engine is in trouble: its calls fail, its health checks answer
    NOT_SERVING (serving/engine_health.py)."""

    def __init__(self, message: str = "injected: the engine's last 3 steps failed"):
        self.health, self.calls, self.message = health.HealthServicer(), 0, message
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)

    def Decode(self, request, context):
        self.calls += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, self.message)
        yield


def test_the_last_attempt_does_not_wait_on_its_prefills_release(model_dir):
    """No retry follows the last attempt (max_retries 1: the second): its client's error waited on
    the prefill worker's Release, as if a retry could reuse the worker."""
    prefill = _SlowReleasePrefillWorker("prefill-a", prompt_releases=1)
    fakes = {"prefill-a": prefill, "decode-a": _TroubledDecodeWorker(), "decode-b": _TroubledDecodeWorker()}
    with _router_over_fakes(model_dir, fakes) as router:
        assert rpc_error(lambda: list(router.Generate(HELLO, timeout=30))).code() == grpc.StatusCode.UNAVAILABLE
        prefill.answered.set()
        wait_until(lambda: len(prefill.in_time) == 2, "the prefill worker got no second Release", 30)
    assert prefill.in_time == [True, True]


def test_a_worker_answering_not_serving_is_dropped_after_a_failed_call(model_dir):
    """The router's probe after a failed call drops a worker whose health check answers NOT_SERVING
    at once, not when its heartbeats are missed (it only dropped one whose check failed)."""
    prefill, troubled, healthy = _PrefillWorker("prefill-a"), _TroubledDecodeWorker(), _SourceBlamingDecodeWorker(0)
    with _router_over_fakes(model_dir, {"prefill-a": prefill, "decode-a": troubled, "decode-b": healthy}) as router:
        for _ in range(4):  # until one lands on decode-a (and is retried on decode-b)
            assert [r.text for r in router.Generate(HELLO, timeout=30)] == ["x"]
            if troubled.calls:
                break
        wait_until(lambda: "decode-a" not in _listed(router), "the failing decode worker is still listed", 10,
                   poll_s=0.1)
        assert troubled.calls == 1


def _listed(router) -> set[str]:
    return {w.worker_id for w in router.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers}


def test_a_client_reads_a_failed_workers_id_not_its_network_address(model_dir):
    """Giving up, the router names the worker that failed by id; its address is internal (the
    router's log has it)."""
    prefill, decode = _PrefillWorker("prefill-a"), _SourceBlamingDecodeWorker(refusals=10, code=grpc.StatusCode.UNAVAILABLE)
    with _router_over_fakes(model_dir, {"prefill-a": prefill, "decode-a": decode}) as router:
        with pytest.raises(grpc.RpcError) as failed:
            list(router.Generate(HELLO, timeout=30))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "on prefill worker prefill-a failed" in failed.value.details()
    assert "127.0.0.1" not in failed.value.details(), failed.value.details()


def test_addresses_in_a_workers_report_do_not_reach_the_client(model_dir):
    troubled = _TroubledDecodeWorker("injected: pull failed: UNKNOWN: ipv4:10.9.8.7:50051: Connection refused")
    with _router_over_fakes(model_dir, {"prefill-a": _PrefillWorker("prefill-a"), "decode-a": troubled}) as router:
        with pytest.raises(grpc.RpcError) as failed:
            list(router.Generate(HELLO, timeout=30))
    assert "pull failed: UNKNOWN: <address>: Connection refused" in failed.value.details(), failed.value.details()


class _BusyPrefillWorker(_PrefillWorker):
    """A prefill worker that takes 0.3 s a prompt and, as serving/call_limit.py does, refuses calls
    beyond 2 x its max_num_seqs of 4 (the most it saw at once is recorded)."""

    def __init__(self, worker_id: str):
        super().__init__(worker_id)
        self.open = self.most_open = 0
        self.lock = threading.Lock()

    def Prefill(self, request, context):
        with self.lock:
            full = self.open >= 8
            if not full:
                self.open += 1
                self.most_open = max(self.most_open, self.open)
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "this worker serves 8 prefill calls already")
        try:
            time.sleep(0.3)
            return super().Prefill(request, context)
        finally:
            with self.lock:
                self.open -= 1


def test_a_burst_beyond_a_prefill_workers_call_limit_waits_for_it(model_dir):
    """Admission counts the decode workers' batches (16 here); the one prefill worker takes 8 calls
    at once. A burst of 12 requests waits at the router for its prefill calls instead of having 4
    refused there."""
    prefill = _BusyPrefillWorker("prefill-a")
    fakes = {"prefill-a": prefill, "decode": _SourceBlamingDecodeWorker(refusals=0)}
    with _router_over_fakes(model_dir, fakes, max_num_seqs={"decode": 16}) as router, \
            futures.ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(lambda i: list(router.Generate(router_pb2.GenerateRequest(prompt=f"Hello {i}"),
                                                               timeout=30)), range(12)))
    assert all([r.text for r in answer] == ["x"] for answer in answers)
    assert prefill.prefills == 12 and prefill.most_open == 8


class _FullOncePrefillWorker(_PrefillWorker):
    """An injected fault: the first call is refused as serving/call_limit.py refuses one past its
    limit (a cancelled request's call may still hold its place there for a moment)."""

    refused = False

    def Prefill(self, request, context):
        if not self.refused:
            self.refused = True
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "this worker serves 8 prefill calls already")
        return super().Prefill(request, context)


def test_the_only_prefill_worker_refusing_as_full_is_tried_again(model_dir):
    """A full worker is a healthy one: when no other worker has its role, the retry goes back to it
    after a pause (written off as failed, it left no prefill worker and the request failed)."""
    prefill = _FullOncePrefillWorker("prefill-a")
    with _router_over_fakes(model_dir, {"prefill-a": prefill, "decode": _SourceBlamingDecodeWorker(0)}) as router:
        answer = list(router.Generate(HELLO, timeout=30))
    assert [r.text for r in answer] == ["x"] and (prefill.refused, prefill.prefills) == (True, 1)


@pytest.mark.parametrize("first", [0, 1])
def test_the_routers_own_timeout_is_named_when_it_ends_a_request(model_dir, first):
    """router.request_timeout_s bounds a whole request, its retries and stream included: the
    attempt it ends is not retried on the other worker, and the error names the setting (before or
    after the first token), rather than only blaming the worker."""
    servicers = [_SlowDecodeWorker(first) for _ in range(2)]
    workers = [grpc.server(futures.ThreadPoolExecutor(max_workers=2)) for _ in servicers]
    addresses = []
    for servicer, worker in zip(servicers, workers):
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, worker)
        addresses.append(f"127.0.0.1:{worker.add_insecure_port('127.0.0.1:0')}")
        worker.start()
    config = RouterConfig(heartbeat_interval_s=30.0, heartbeat_timeout_s=60.0, max_retries=1, request_timeout_s=1.0)
    router = run_router(config, TOKEN, model_dir, "smollm2", port=0, internal_port=0)
    try:
        with channel(f"127.0.0.1:{router.port}", TOKEN) as internal, \
                channel(f"127.0.0.1:{router.internal_port}", TOKEN) as registry:
            for i, address in enumerate(addresses):
                worker_pb2_grpc.RegistryStub(registry).Register(registration(f"agg-{i}", address), timeout=10)
            stub = router_pb2_grpc.RouterStub(internal)
            e = rpc_error(lambda: list(stub.Generate(HELLO, timeout=60)))
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
            assert "router.request_timeout_s (1 s) bounds a whole request" in e.details(), e.details()
            assert sum(s.calls for s in servicers) == 1
    finally:
        router.stop(0)
        for worker in workers:
            worker.stop(0)


def test_a_full_worker_is_resource_exhausted_for_the_client_and_stays_routed(model_dir):
    """A full worker is healthy: the client hears RESOURCE_EXHAUSTED (it may retry later), not
    UNAVAILABLE, and the worker is not health-probed out of routing."""
    worker = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_FullDecodeWorker(), worker)
    worker_address = f"127.0.0.1:{worker.add_insecure_port('127.0.0.1:0')}"
    worker.start()
    config = RouterConfig(heartbeat_interval_s=30.0, heartbeat_timeout_s=60.0, max_retries=1)
    router = run_router(config, TOKEN, model_dir, "smollm2", port=0, internal_port=0)
    try:
        with channel(f"127.0.0.1:{router.port}", TOKEN) as internal, \
                channel(f"127.0.0.1:{router.internal_port}", TOKEN) as registry:
            worker_pb2_grpc.RegistryStub(registry).Register(registration("agg", worker_address), timeout=10)
            stub = router_pb2_grpc.RouterStub(internal)
            e = rpc_error(lambda: list(stub.Generate(HELLO, timeout=10)))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV pool stayed full" in e.details()
            assert dict(e.trailing_metadata())[RETRY_AFTER_METADATA_KEY] == "1"  # HTTP's Retry-After, as admission's
            time.sleep(2 * 1.0)  # a health probe (1 s timeout) would have dropped it by now
            assert [w.worker_id for w in stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers] == ["agg"]
    finally:
        router.stop(0)
        worker.stop(0)
