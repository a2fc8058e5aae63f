"""The router's admission queue: its rules on their own (threads, an injected clock where a
request's hold time matters), then a burst against a real local cluster over gRPC and HTTP."""

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from deploy.config import parse_config
from deploy.local import LocalCluster
from proto import rpc
from proto.pdspec.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.admission import Admission, LeftQueue, Overloaded, QueueDeadline
from tests.waiting import wait_until
from tools.scrape import metric


def _enter_in_thread(admission: Admission, order: list, name: str, gone=lambda: False) -> threading.Thread:
    """Start a request's wait in a thread; returns once it is queued. `order` gets (name, its
    slot or what it raised) when the wait ends."""
    def run() -> None:
        try:
            slot = admission.enter(gone)
        except Exception as e:  # noqa: BLE001 - the test inspects what was raised
            order.append((name, e))
            return
        order.append((name, slot))

    queued = admission.snapshot()[1]
    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: admission.snapshot()[1] > queued or order)  # queued (or already answered)
    return thread


def test_requests_beyond_the_queue_are_refused_at_once_and_the_queue_is_fifo():
    admission = Admission(lambda: 1, max_queued=2, max_wait_s=60.0)
    first = admission.enter(lambda: False)
    order: list = []
    threads = [_enter_in_thread(admission, order, name) for name in ("b", "c")]
    assert admission.snapshot() == (1, 2)
    with pytest.raises(Overloaded, match=r"router.max_queued_requests=2") as refused:
        admission.enter(lambda: False)
    assert refused.value.retry_after_s >= 1
    first.release()
    wait_until(lambda: len(order) == 1)
    assert order[0][0] == "b" and order[0][1].waited_s > 0
    order[0][1].release()
    threads[1].join(10)
    assert [name for name, _ in order] == ["b", "c"]
    order[1][1].release()
    assert admission.snapshot() == (0, 0)


def test_a_wait_ends_at_max_queue_seconds_or_the_clients_deadline_or_when_it_leaves():
    admission = Admission(lambda: 1, max_queued=8, max_wait_s=0.2)
    held = admission.enter(lambda: False)
    with pytest.raises(Overloaded, match=r"waited 0.2s .*router.max_queue_seconds=0.2.*nothing was computed"):
        admission.enter(lambda: False)
    with pytest.raises(QueueDeadline, match="deadline"):
        admission.enter(lambda: False, deadline_s=0.05)
    gone = threading.Event()
    order: list = []
    leaver = _enter_in_thread(admission, order, "left", gone=gone.is_set)
    gone.set()
    leaver.join(10)
    assert [(name, type(e)) for name, e in order] == [("left", LeftQueue)] and admission.snapshot() == (1, 0)
    held.release()


def test_a_request_expected_to_wait_too_long_is_refused_at_once():
    now = [0.0]
    admission = Admission(lambda: 1, max_queued=8, max_wait_s=5.0, clock=lambda: now[0])
    slot = admission.enter(lambda: False)
    now[0] = 10.0  # it held its slot 10 s: the next request in line would wait ~10 s
    slot.release()
    running = admission.enter(lambda: False)
    with pytest.raises(Overloaded, match=r"waiting ~10.0s \(router.max_queue_seconds=5\)") as refused:
        admission.enter(lambda: False)
    assert refused.value.retry_after_s == 10
    running.release()


def test_without_capacity_requests_pass_through_to_routing():
    admission = Admission(lambda: 0, max_queued=0, max_wait_s=1.0)
    slots = [admission.enter(lambda: False) for _ in range(3)]
    assert admission.snapshot() == (3, 0)
    for slot in slots:
        slot.release()


# --- a burst against a real cluster: 1 prefill + 1 decode worker, each running one request ---

BURST = 20  # 20x what the cluster runs at once (the decode worker's batch: max_num_seqs 1)


@pytest.fixture(scope="module")
def cluster():
    config = parse_config({
        "engine": {"num_kv_blocks": 320, "max_num_seqs": 1, "max_num_batched_tokens": 512,
                   "speculative": {"method": "none"}},
        "cluster_token": "pdspec-tests",
        "router": {"port": 0, "http_port": 0, "max_queued_requests": 2, "request_timeout_s": 900.0},
        "prefill": {"replicas": 1, "kv_transfer": "grpc"}, "decode": {"replicas": 1, "kv_transfer": "grpc"},
    })
    cluster = LocalCluster(config, 0).start()
    yield cluster
    cluster.stop()


def _grpc_request(cluster: LocalCluster, i: int):
    request = router_pb2.GenerateRequest(
        prompt=f"Count from {i} to {i + 40}.",
        sampling=common_pb2.SamplingOptions(max_tokens=48, ignore_eos=True))
    with grpc.insecure_channel(cluster.router_address) as channel:
        try:
            responses = list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=600))
        except grpc.RpcError as e:
            return e.code(), dict(e.trailing_metadata() or ()).get(rpc.RETRY_AFTER_METADATA_KEY), e.details()
    return "served", responses[-1].finish_reason, sum(len(r.token_ids) for r in responses)


def _http_request(cluster: LocalCluster, i: int):
    body = {"prompt": f"Count from {i} to {i + 40}.", "max_tokens": 48, "ignore_eos": True}
    response = httpx.post(f"{cluster.http_url}/completions", json=body, timeout=600)
    if response.status_code != 200:
        return response.status_code, response.headers.get("retry-after"), response.json()["error"]
    return "served", response.json()["choices"][0]["finish_reason"], response.json()["usage"]["completion_tokens"]


def test_a_burst_is_served_or_refused_at_once_and_nothing_is_lost(cluster):
    with ThreadPoolExecutor(BURST) as pool:
        futures = [pool.submit(_http_request if i % 2 else _grpc_request, cluster, i) for i in range(BURST)]
        results = [f.result() for f in futures]
    served = [r for r in results if r[0] == "served"]
    refused = [r for r in results if r[0] != "served"]
    assert len(served) + len(refused) == BURST
    assert len(served) >= 2 and refused, results  # 2 run and 2 wait at a time; the rest cannot all fit
    assert all(r[1] == "length" and r[2] == 48 for r in served), results
    for code, retry_after, detail in refused:
        assert code in (grpc.StatusCode.RESOURCE_EXHAUSTED, 429)
        assert int(retry_after) >= 1
        message = detail if isinstance(detail, str) else detail["message"]
        assert "router.max_queued_requests=2" in message or "router.max_queue_seconds" in message
        if code == 429:
            assert detail["type"] == "rate_limit_error"
    metrics = f"{cluster.http_url.removesuffix('/v1')}/metrics"
    # A slot is released just after the answer's last message has gone out.
    wait_until(lambda: metric(metrics, "pdspec_num_requests_running") == 0)
    assert metric(metrics, "pdspec_num_requests_waiting") == 0
    assert _grpc_request(cluster, 99)[0] == "served"  # healthy after


def _blocks_used(cluster: LocalCluster) -> float:
    workers = cluster.workers().values()
    return sum(metric(f"http://{w.metrics_address}/metrics", "pdspec_kv_blocks_used") for w in workers)


def _wait_blocks_free(cluster: LocalCluster) -> None:
    wait_until(lambda: _blocks_used(cluster) == 0, timeout_s=60)


LONG = common_pb2.SamplingOptions(max_tokens=4000, ignore_eos=True)


def test_a_deadline_or_timeout_ends_the_request_and_frees_its_blocks(cluster):
    request = router_pb2.GenerateRequest(prompt="Tell me a long story.", sampling=LONG)
    with grpc.insecure_channel(cluster.router_address) as channel:
        with pytest.raises(grpc.RpcError) as ended:
            for _ in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=2.0):
                pass
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_blocks_free(cluster)
    body = {"prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": True, "timeout": 2.0}
    response = httpx.post(f"{cluster.http_url}/completions", json=body, timeout=600)
    assert response.status_code == 504 and response.json()["error"]["type"] == "timeout"
    _wait_blocks_free(cluster)


def test_abort_takes_a_request_out_of_the_queue(cluster):
    metrics = f"{cluster.http_url.removesuffix('/v1')}/metrics"
    with grpc.insecure_channel(cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        long_calls = [stub.Generate(router_pb2.GenerateRequest(prompt="Story 1.", sampling=LONG))]
        wait_until(lambda: metric(metrics, "pdspec_num_requests_running") == 1)  # the decode worker's one slot
        queued = stub.Generate(router_pb2.GenerateRequest(request_id="queued", prompt="Hi", sampling=LONG))
        wait_until(lambda: metric(metrics, "pdspec_num_requests_waiting") == 1)
        assert stub.Abort(common_pb2.AbortRequest(request_id="queued")).found
        (answer,) = list(queued)
        assert answer.finish_reason == "abort" and not answer.token_ids
        for call in long_calls:
            call.cancel()
    wait_until(lambda: metric(metrics, "pdspec_num_requests_running") == 0)
    _wait_blocks_free(cluster)


def test_the_request_id_comes_back_once(cluster):
    request = router_pb2.GenerateRequest(request_id="mine", prompt="Hello", sampling=common_pb2.SamplingOptions(
        max_tokens=8, ignore_eos=True))
    with grpc.insecure_channel(cluster.router_address) as channel:
        responses = list(router_pb2_grpc.RouterStub(channel).Generate(request))
    assert len(responses) > 1
    assert [r.request_id for r in responses] == ["mine"] + [""] * (len(responses) - 1)


def test_cancelling_a_long_prefill_stops_it_at_the_next_chunk(cluster):
    """A 3000-token prompt prefills in chunks of 512; the client leaves during the first ones: the
    prefill worker aborts it (it would otherwise compute the rest, then release) and frees its blocks."""
    (prefill,) = [f"http://{w.metrics_address}/metrics" for w in cluster.workers().values() if w.role == "prefill"]
    aborted = metric(prefill, "pdspec_finished_abort_total")
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[(7 * i) % 5000 + 100 for i in range(3000)]),
                                         sampling=common_pb2.SamplingOptions(max_tokens=1))
    with grpc.insecure_channel(cluster.router_address) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(request)
        wait_until(lambda: metric(prefill, "pdspec_kv_blocks_used") > 0)  # under way
        call.cancel()
    wait_until(lambda: metric(prefill, "pdspec_finished_abort_total") == aborted + 1)
    _wait_blocks_free(cluster)
