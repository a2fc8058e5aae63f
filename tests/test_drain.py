"""Rolling a worker under load: SIGTERM makes it deregister, finish what it runs and exit; the
supervisor starts it again; no request fails, whether it was streaming from it or not yet sent."""

import concurrent.futures
import threading
import time

import grpc
import pytest

from deploy.config import parse_config
from deploy.local import LocalCluster
from proto.pdspec.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from proto.rpc import channel
from tests.test_cluster import _wait_restarted

TOKENS = 48


@pytest.fixture(scope="module")
def cluster():
    config = parse_config({
        "engine": {"num_kv_blocks": 128, "max_num_seqs": 4, "speculative": {"method": "none"}},
        "cluster_token": "pdspec-tests",
        "router": {"port": 0, "request_timeout_s": 900.0},
        "prefill": {"replicas": 1, "kv_transfer": "grpc"},
        "decode": {"replicas": 2, "kv_transfer": "grpc", "drain_timeout_s": 120.0},
    })
    cluster = LocalCluster(config, 0).start()
    yield cluster
    cluster.stop()


def test_rolling_a_decode_worker_under_load_fails_no_request(cluster):
    address = cluster.workers()["decode-0"].address
    victim_streaming = threading.Event()
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))

    def ask(i: int) -> tuple[str, int]:
        request = router_pb2.GenerateRequest(prompt=f"Count from {i} to {i + 60}.",
                                             sampling=common_pb2.SamplingOptions(max_tokens=TOKENS, ignore_eos=True))
        worker, tokens = "", 0
        for response in stub.Generate(request, timeout=600):
            worker = response.decode_worker or worker
            tokens += len(response.token_ids)
            if worker == "decode-0" and tokens > 4:
                victim_streaming.set()
        return worker, tokens

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        first = [pool.submit(ask, i) for i in range(8)]
        assert victim_streaming.wait(300), "no stream reached decode-0"
        cluster.roll("decode-0")
        later = [pool.submit(ask, i) for i in range(8, 16)]  # sent while decode-0 drains and restarts
        results = [f.result() for f in first + later]
    assert all(tokens == TOKENS for _, tokens in results), results
    assert any(worker == "decode-0" for worker, _ in results[:8])  # it finished the streams it had
    _wait_restarted(cluster, "decode-0", address)
    assert cluster.supervisor.restarts("decode-0") == 1


def test_a_draining_decode_worker_still_serves_a_call_routed_before_it_left(cluster):
    """The router picks a request's decode worker before its prefill runs: the Decode may reach a
    worker that deregistered meanwhile. It is served (the drain waits until no call came for a
    while), not refused by a server already stopped because the engine was idle."""
    workers, token = cluster.workers(), cluster.config.token()
    address = workers["decode-0"].address
    prompt = [1, 2, 3, 4, 5] * 8
    sampling = common_pb2.SamplingOptions(max_tokens=TOKENS, ignore_eos=True)
    prefill = worker_pb2_grpc.PrefillWorkerStub(channel(workers["prefill-0"].address, token))
    handle = prefill.Prefill(worker_pb2.PrefillRequest(request_id="late", prompt_token_ids=prompt, sampling=sampling),
                             timeout=60)
    cluster.roll("decode-0")
    for _ in range(600):  # until it has deregistered (a liveness bound)
        if "decode-0" not in cluster.workers():
            break
        time.sleep(0.05)
    decode = worker_pb2_grpc.DecodeWorkerStub(channel(address, token))
    responses = list(decode.Decode(worker_pb2.DecodeRequest(request_id="late", prompt_token_ids=prompt,
                                                            sampling=sampling, prefilled=handle), timeout=60))
    assert sum(len(r.token_ids) for r in responses) == TOKENS and responses[-1].finish_reason == "length"
    _wait_restarted(cluster, "decode-0", address)


def test_rolling_the_router_lets_its_running_streams_finish(cluster):
    """SIGTERM (a Kubernetes rollout, a node drain): the router refuses new requests and gives the
    running ones router.drain_timeout_s to finish (they were cut 2 s after the signal)."""
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
    request = router_pb2.GenerateRequest(prompt="Count from 1 to 1000.",
                                         sampling=common_pb2.SamplingOptions(max_tokens=1024, ignore_eos=True))
    tokens, reasons = 0, []
    for response in stub.Generate(request, timeout=600):
        tokens += len(response.token_ids)
        reasons.append(response.finish_reason)
        if 4 < tokens <= 4 + len(response.token_ids):
            cluster.roll("router")
    assert tokens == 1024 and reasons[-1] == "length"
