"""The real router server on a free port: health, reflection, errors, registry, eviction, retries
(with workers that fail on purpose: tests/test_router_faults.py)."""

import contextlib
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from deploy.config import DeploymentConfig
from router.calls import Peers
from router.config import RouterConfig
from proto.pdspec.v1 import common_pb2, kv_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from proto.rpc import channel
from router.main import run_router
from tests.waiting import wait_until

TOKEN = "s3cret"
HELLO = router_pb2.GenerateRequest(prompt="Hello")


@pytest.fixture
def router(model_dir):
    config = DeploymentConfig(cluster_token=TOKEN, router=RouterConfig(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, max_retries=1))
    router = run_router(config.router, config.token(), model_dir, "smollm2", port=0, internal_port=0)
    address = f"127.0.0.1:{router.port}"
    with (channel(address) as public, channel(address, TOKEN) as internal,
          channel(f"127.0.0.1:{router.internal_port}", TOKEN) as registry):
        yield router_pb2_grpc.RouterStub(public), worker_pb2_grpc.RegistryStub(registry), public, internal
    router.stop(0)


def registration(worker_id: str, address: str, role: str = "aggregated") -> worker_pb2.RegisterRequest:
    layout = kv_pb2.KVLayout(model="smollm2", dtype="float32", block_size=16)
    return worker_pb2.RegisterRequest(worker_id=worker_id, role=role, address=address, layout=layout,
                                      total_blocks=64, max_model_len=256, max_num_seqs=4,
                                      metrics_address="127.0.0.1:9100")


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def listening(count: int = 1) -> Iterator[list[str]]:
    """The addresses of `count` bare gRPC servers (every call UNIMPLEMENTED): workers the router can
    reach when they register; stopped on exit, workers that died."""
    servers = [grpc.server(futures.ThreadPoolExecutor(max_workers=1)) for _ in range(count)]
    addresses = [f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}" for server in servers]
    for server in servers:
        server.start()
    try:
        yield addresses
    finally:
        for server in servers:
            server.stop(0)


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_health_and_reflection(router):
    _, registry, public, _ = router
    health = health_pb2_grpc.HealthStub(public)

    def status(service: str = "pdspec.v1.Router") -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    # Readiness: a request sent now would be served. Liveness ("") holds throughout.
    assert (status(), status("")) == (not_serving, serving)
    with listening(3) as (prefill, decode, aggregated):
        registry.Register(registration("p", prefill, role="prefill"), timeout=10)
        assert status() == not_serving  # a prefill worker alone is no route
        registry.Register(registration("d", decode, role="decode"), timeout=10)
        assert status() == serving
        wait_until(lambda: status() != serving, "still serving without heartbeats", 10, poll_s=0.1)  # evicted after 0.5 s
        assert (status(), status("")) == (not_serving, serving)
        registry.Register(registration("agg", aggregated), timeout=10)
        assert status() == serving
    reflection = reflection_pb2_grpc.ServerReflectionStub(public)
    answer = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    services = {s.name for s in answer.list_services_response.service}
    assert "pdspec.v1.Router" in services and "pdspec.v1.Registry" not in services  # workers register elsewhere


def test_request_errors(router):
    stub, _, _, _ = router
    e = rpc_error(lambda: list(stub.Generate(HELLO, timeout=10)))
    assert e.code() == grpc.StatusCode.UNAVAILABLE and "no prefill/decode workers registered" in e.details()
    bad = router_pb2.GenerateRequest(prompt="Hello", sampling=common_pb2.SamplingOptions(temperature=-1))
    e = rpc_error(lambda: list(stub.Generate(bad, timeout=10)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details() == "sampling.temperature: must be >= 0, got -1"
    assert not stub.Abort(common_pb2.AbortRequest(request_id="nobody"), timeout=10).found


def test_a_request_that_does_not_parse_is_invalid_argument(router):
    """A prompt with invalid UTF-8 (what a client without protobuf's checks can send)."""
    _, _, public, _ = router
    raw = router_pb2.GenerateRequest(prompt="Hello X").SerializeToString().replace(b"X", b"\xff")
    generate = public.unary_stream("/pdspec.v1.Router/Generate", request_serializer=None,
                                   response_deserializer=router_pb2.GenerateResponse.FromString)
    e = rpc_error(lambda: list(generate(raw, timeout=10)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "string fields must be UTF-8" in e.details()


def test_registry_needs_the_cluster_token_and_is_not_on_the_public_port(model_dir):
    router = run_router(RouterConfig(), TOKEN, model_dir, "smollm2", port=0, internal_port=0)
    try:
        for port, code in ((router.internal_port, grpc.StatusCode.UNAUTHENTICATED),
                           (router.port, grpc.StatusCode.UNIMPLEMENTED)):
            with channel(f"127.0.0.1:{port}") as ch:
                e = rpc_error(lambda: worker_pb2_grpc.RegistryStub(ch).Register(registration("w", "x:1"), timeout=10))
            assert e.code() == code
    finally:
        router.stop(0)


def test_registered_workers_are_listed_until_their_heartbeats_stop(router):
    stub, registry, _, internal = router
    with listening() as [address]:
        assert registry.Register(registration("agg-1", address), timeout=10).heartbeat_interval_ms == 100
    beat = worker_pb2.HeartbeatRequest(worker_id="agg-1", load=worker_pb2.Load(active_blocks=7, total_blocks=64))
    assert registry.Heartbeat(beat, timeout=10).registered
    with pytest.raises(grpc.RpcError) as refused:  # it hands out internal addresses: the cluster token only
        stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    stub = router_pb2_grpc.RouterStub(internal)
    [status] = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers
    assert (status.worker_id, status.role, status.active_blocks, status.metrics_address) == (
        "agg-1", "aggregated", 7, "127.0.0.1:9100")
    wait_until(lambda: not stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers,
               "a worker without heartbeats is still listed", 5, poll_s=0.1)
    assert not registry.Heartbeat(beat, timeout=10).registered


def test_a_worker_the_router_cannot_reach_is_refused_at_registration(router):
    """A worker advertising an address the router cannot dial (a wrong --advertise-host) was
    registered, dropped by the failed call's probe, and registered again at its next heartbeat,
    forever: every request sent its way failed first. Refused at registration, its log says why."""
    stub, registry, _, internal = router
    address = dead_address()
    e = rpc_error(lambda: registry.Register(registration("far", address), timeout=10))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
    assert f"cannot reach this worker at {address}" in e.details() and "--advertise-host" in e.details(), e.details()
    assert not router_pb2_grpc.RouterStub(internal).ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers


class _OneTokenWorker(worker_pb2_grpc.DecodeWorkerServicer):
    def Decode(self, request, context):
        yield worker_pb2.DecodeResponse(token_ids=[42], text="x", finish_reason="length")


def test_a_worker_restarted_at_its_address_registers_and_serves_at_once(router):
    """The router's kept channel to a worker that died backs off before it dials again: neither the
    check of a worker restarted at that address nor its first request may take the backoff for
    unreachability (the request failed, and the worker was evicted)."""
    stub, registry, _, _ = router
    with listening() as [address]:
        registry.Register(registration("agg", address), timeout=10)
    rpc_error(lambda: list(stub.Generate(HELLO, timeout=10)))  # the calls to the dead worker fail
    restarted = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_OneTokenWorker(), restarted)
    restarted.add_insecure_port(address)
    restarted.start()
    try:
        registry.Register(registration("agg", address), timeout=10)
        assert [r.text for r in stub.Generate(HELLO, timeout=10)] == ["x"]
    finally:
        restarted.stop(0)



def test_a_workers_latency_series_go_when_it_leaves(model_dir):
    """TTFT and ITL are labelled by worker id, and on Kubernetes a worker's id is its pod's name,
    new at every rollout: the series of workers that left stayed in the router for good."""
    rc = RouterConfig(http_port=0, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5)
    router = run_router(rc, TOKEN, model_dir, "smollm2", port=0, internal_port=0)
    worker = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_OneTokenWorker(), worker)
    address = f"127.0.0.1:{worker.add_insecure_port('127.0.0.1:0')}"
    worker.start()
    try:
        with channel(f"127.0.0.1:{router.internal_port}", TOKEN) as registry, \
                channel(f"127.0.0.1:{router.port}") as public:
            worker_pb2_grpc.RegistryStub(registry).Register(registration("pod-7f9c", address), timeout=10)
            assert [r.text for r in router_pb2_grpc.RouterStub(public).Generate(HELLO, timeout=10)] == ["x"]
        metrics = f"http://127.0.0.1:{router.http_port}/metrics"
        assert 'prefill_worker="pod-7f9c"' in httpx.get(metrics).text
        wait_until(lambda: "pod-7f9c" not in httpx.get(metrics).text, "the evicted worker's series are still there",
                   10, poll_s=0.1)  # no heartbeats: evicted after 0.5 s
    finally:
        worker.stop(0)
        router.stop(0)


def test_a_stopped_router_leaves_no_thread_behind(model_dir):
    """A router run in a process that goes on (tests, an embedding program) left its watchdog's
    thread, and its channels to workers, at every stop."""
    def watchdogs() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "router-watchdog"}

    before = watchdogs()
    router = run_router(RouterConfig(), TOKEN, model_dir, "smollm2", port=0, internal_port=0)
    try:
        (mine,) = watchdogs() - before
    finally:
        router.stop(0)
    wait_until(lambda: not mine.is_alive(), "the stopped router's watchdog thread still runs", 10)

def test_the_router_keeps_channels_to_registered_addresses_only():
    """Each worker's channel holds its own connection, and pods come back at new addresses: the
    channels to addresses no worker holds are let go (the eviction loop asks once an interval)."""
    peers = Peers(None, None)
    with listening(2) as (registered, gone):
        assert peers.unreachable(registered) == ""
        checked, dropped = peers.channel(registered), peers.channel(gone)
        peers.keep_only({registered})
        assert peers.channel(registered) is checked and peers.channel(gone) is not dropped


def test_failed_workers_are_retried_elsewhere_then_named(router):
    stub, registry, _, _ = router
    with listening(2) as addresses:
        for worker_id, address in zip(("agg-1", "agg-2"), addresses):
            registry.Register(registration(worker_id, address), timeout=10)
    e = rpc_error(lambda: list(stub.Generate(HELLO, timeout=10)))
    assert e.code() == grpc.StatusCode.UNAVAILABLE
    assert "Decode on aggregated worker agg-2" in e.details() and "gave up after 2 failed attempt(s)" in e.details()


def test_a_worker_whose_call_and_health_check_fail_is_dropped_at_once(model_dir):
    """Heartbeats would take a minute to notice here; the failed call's health probe does not wait."""
    config = RouterConfig(heartbeat_interval_s=30.0, heartbeat_timeout_s=60.0, max_retries=0)
    router = run_router(config, TOKEN, model_dir, "smollm2", port=0, internal_port=0)
    address = f"127.0.0.1:{router.port}"
    try:
        with channel(address, TOKEN) as internal, channel(f"127.0.0.1:{router.internal_port}", TOKEN) as registry, \
                listening() as [worker_address]:
            worker_pb2_grpc.RegistryStub(registry).Register(registration("agg", worker_address), timeout=10)
            stub = router_pb2_grpc.RouterStub(internal)
            assert rpc_error(lambda: list(stub.Generate(HELLO, timeout=10))).code() == grpc.StatusCode.UNAVAILABLE
            wait_until(lambda: not stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers,
                       "the dead worker is still routed to", 10, poll_s=0.05)
    finally:
        router.stop(0)


def test_the_router_does_not_import_torch():
    code = "import sys, router.main; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent).returncode == 0


def test_the_http_api_follows_readiness_and_answers_errors_in_openai_shape(model_dir):
    rc = RouterConfig(http_port=0, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5)
    router = run_router(rc, TOKEN, model_dir, "smollm2", port=0, internal_port=0)
    root = f"http://127.0.0.1:{router.http_port}"
    try:
        assert httpx.get(f"{root}/health").status_code == 200
        assert httpx.get(f"{root}/ready").status_code == 503
        answer = httpx.post(f"{root}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "service_unavailable"
        assert "no prefill/decode workers registered" in answer.json()["error"]["message"]
        with channel(f"127.0.0.1:{router.internal_port}", TOKEN) as registry, listening() as [address]:
            worker_pb2_grpc.RegistryStub(registry).Register(registration("agg", address), timeout=10)
        assert httpx.get(f"{root}/ready").status_code == 200
        wait_until(lambda: httpx.get(f"{root}/ready").status_code == 503, "still ready without heartbeats", 10,
                   poll_s=0.1)  # evicted: no heartbeats
    finally:
        router.stop(0)


def test_a_taken_http_port_fails_the_start_loudly(model_dir):
    """...and leaves no thread behind (the watchdog's outlived a failed start)."""
    before = set(threading.enumerate())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        rc = RouterConfig(http_port=taken.getsockname()[1])
        with pytest.raises(RuntimeError, match="router.http_port: cannot listen on 127.0.0.1"):
            run_router(rc, TOKEN, model_dir, "smollm2", port=0, internal_port=0)
    wait_until(lambda: not [t for t in threading.enumerate() if t not in before and t.name == "router-watchdog"],
               "the failed router's watchdog thread is still running", 10)
