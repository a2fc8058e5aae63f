"""The disaggregated cluster end to end: router, prefill and decode workers as separate
processes on loopback, driven through the public gRPC API the way a user drives it.

Reference answers come from the in-process engine (what `pdspec generate` runs) with the same
EAGLE3 head: greedy output must be token-identical whichever way the KV travelled.
"""

import concurrent.futures
import threading
import time

import grpc
import pytest

from deploy.config import parse_config
from tools.loadgen import make_workload, run_load, summarize
from deploy.local import LocalCluster
from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from proto.pdspec.v1 import common_pb2, kv_pb2, kv_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from proto.rpc import FAILED_KV_SOURCE_METADATA_KEY, channel, free_port
from tests.waiting import wait_until
from tools.scrape import metric

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about rain.",
             "What is 12 times 12?", "List the days of the week.", "Explain photosynthesis in one sentence.",
             "Say hello in Spanish.", "Count from 1 to 5."]
MAX_TOKENS = 24
ENGINE = {"num_kv_blocks": 256, "max_num_seqs": 8, "speculative": {"method": "eagle3", "num_speculative_tokens": 4}}
DOCUMENT = " ".join(f"Section {i}: the committee reviewed budget line {i * 7} and approved it." for i in range(24))


def _start(engine: dict = ENGINE, **roles) -> LocalCluster:
    # Internal calls get a deadline no test reaches on a slow machine: a test waits on events.
    router = {"port": 0, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0, "request_timeout_s": 900.0}
    config = parse_config({"engine": engine, "cluster_token": "pdspec-tests", "router": router, **roles})
    return LocalCluster(config, 0).start()


def _answers(engine_config: dict, questions: list[str]) -> dict[str, list[int]]:
    """The in-process engine's greedy answers (what `pdspec generate` runs)."""
    engine = Engine(EngineConfig(**engine_config))
    out = {}
    for q in questions:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": q}])
        out[q] = [t for o in engine.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS)) for t in o.token_ids]
    engine.close()
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return _answers(ENGINE, QUESTIONS)


@pytest.fixture(scope="module")
def nixl_cluster():
    cluster = _start(prefill={"replicas": 2, "kv_transfer": "nixl"}, decode={"replicas": 2, "kv_transfer": "nixl"})
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def grpc_cluster():
    cluster = _start(prefill={"replicas": 2, "kv_transfer": "grpc"}, decode={"replicas": 1, "kv_transfer": "grpc"})
    yield cluster
    cluster.stop()


def _stub(cluster: LocalCluster) -> router_pb2_grpc.RouterStub:
    return router_pb2_grpc.RouterStub(channel(cluster.router_address, tls=cluster.tls))


def _request(question: str, max_tokens: int = MAX_TOKENS, **sampling) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        messages=router_pb2.MessageList(messages=[common_pb2.ChatMessage(role="user", content=question)]),
        sampling=common_pb2.SamplingOptions(max_tokens=max_tokens, **sampling),
    )


def _generate(stub, request) -> tuple[list[int], list[router_pb2.GenerateResponse]]:
    responses = list(stub.Generate(request, timeout=180))
    return [t for r in responses for t in r.token_ids], responses


def _check_answers(cluster: LocalCluster, reference: dict[str, list[int]]) -> list:
    stub = _stub(cluster)
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:  # 8 concurrent requests
        results = list(pool.map(lambda q: _generate(stub, _request(q)), QUESTIONS))
    for q, (tokens, responses) in zip(QUESTIONS, results):
        assert tokens == reference[q], q
        assert responses[-1].finish_reason in ("stop", "length")
        assert responses[-1].usage.completion_tokens == len(tokens)
    return results


def _wait_idle(cluster: LocalCluster, role: str, timeout_s: float = 10.0) -> dict[str, router_pb2.WorkerStatus]:
    """Heartbeats lag: wait until every `role` worker reports no blocks in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = {k: w for k, w in cluster.workers().items() if w.role == role}
        if all(w.active_blocks == 0 for w in workers.values()) or time.monotonic() > deadline:
            return workers
        time.sleep(0.2)


def _wait_restarted(cluster: LocalCluster, name: str, address: str, timeout_s: float = 120.0) -> str:
    """Wait until the supervisor has restarted `name` and it registered at a new address; returns it."""
    def moved() -> str | None:
        worker = cluster.workers().get(name)
        return worker.address if worker is not None and worker.address != address else None

    wait_until(moved, f"{name} was not restarted within {timeout_s}s", timeout_s, poll_s=0.2)
    return moved()


def test_disaggregated_over_nixl_matches_the_engine(nixl_cluster, reference):
    results = _check_answers(nixl_cluster, reference)
    first = [responses[0] for _, responses in results]
    assert {r.prefill_worker for r in first} <= {"prefill-0", "prefill-1"}
    assert {r.decode_worker for r in first} <= {"decode-0", "decode-1"}
    assert sum(responses[-1].acceptance.steps for _, responses in results) > 0  # the decode side speculated


def test_disaggregated_over_grpc_matches_the_engine(grpc_cluster, reference):
    _check_answers(grpc_cluster, reference)


def test_load_against_a_cluster_accounts_for_every_token(grpc_cluster):
    workload = make_workload(["Say hello.", "Count to three."], 4, num_prefixes=1, prefix_tokens=200)
    records, wall = run_load(grpc_cluster.router_address, workload, rate=20.0, max_tokens=8)
    summary = summarize(records, wall)
    assert summary["requests"] == 4 and summary["errors"] == 0, summary["first_error"]
    assert all(r.completion_tokens == 8 and len(r.token_gaps) == 7 for r in records)  # EOS ignored
    assert all(r.sent < r.first <= r.second <= r.done for r in records)
    assert summary["prefill_tokens_computed"] + summary["cached_prompt_tokens"] == sum(r.prompt_tokens for r in records)
    assert summary["ttft_ms_p50"] <= summary["ttft_ms_p99"] and summary["itl_ms_p50"] > 0
    assert sum(summary["prefill_workers"].values()) == 4


def test_an_int8_kv_cache_travels_whole_and_decodes_as_the_engine_does():
    """engine.kv_cache_dtype int8 on both sides: each row's scale travels inside its block (here
    over NIXL), so decoding continues from exactly the cache the prefill side wrote, drafts
    included: answers token-identical to the in-process engine's on the same cache type."""
    engine = {**ENGINE, "kv_cache_dtype": "int8"}
    questions = QUESTIONS[:3]
    expected = _answers(engine, questions)
    nixl = {"replicas": 1, "kv_transfer": "nixl"}
    cluster = _start(engine, prefill=nixl, decode=nixl)
    try:
        stub = _stub(cluster)
        for q in questions:
            assert _generate(stub, _request(q))[0] == expected[q], q
    finally:
        cluster.stop()


def test_aggregated_matches_the_engine(reference):
    cluster = _start(prefill={"replicas": 0}, decode={"replicas": 0}, aggregated={"replicas": 1})
    try:
        _check_answers(cluster, reference)
    finally:
        cluster.stop()


def test_shared_prefix_goes_to_the_worker_holding_it(nixl_cluster):
    stub = _stub(nixl_cluster)
    for topic in ("budget", "schedule"):
        context = f"{DOCUMENT} (about the {topic})"
        # Heartbeats lag: until a worker reports the previous request's blocks free, that stale load
        # can outweigh what its cache saves. Start each request from settled loads.
        _wait_idle(nixl_cluster, "prefill")
        _, first = _generate(stub, _request(f"{context}\nQuestion: which section came first?", 4))
        _wait_idle(nixl_cluster, "prefill")
        _, second = _generate(stub, _request(f"{context}\nQuestion: how many sections are there?", 4))
        assert second[0].prefill_worker == first[0].prefill_worker
        assert second[-1].usage.cached_prompt_tokens >= 16 * 20  # the shared document came from the cache


def test_decode_side_gets_the_draft_kv_instead_of_recomputing_it(nixl_cluster):
    """The decode worker runs the draft only from the prompt's last position on; the prefill
    worker ran it over the rest of the prompt."""
    workers = _wait_idle(nixl_cluster, "decode")
    counter = "pdspec_draft_positions_with_target_features_total"
    before = {k: metric(f"http://{w.metrics_address}/metrics", counter) for k, w in nixl_cluster.workers().items()}
    tokens, responses = _generate(_stub(nixl_cluster), _request(f"{DOCUMENT}\nSummarize section 3.", 8))
    after = {k: metric(f"http://{w.metrics_address}/metrics", counter) for k, w in nixl_cluster.workers().items()}
    prompt = responses[-1].usage.prompt_tokens
    decode, prefill = responses[0].decode_worker, responses[0].prefill_worker
    assert after[decode] - before[decode] <= len(tokens) + 1 < prompt // 4
    assert after[prefill] - before[prefill] >= prompt - 1 - responses[-1].usage.cached_prompt_tokens
    assert workers  # decode workers were registered and idle before the request


@pytest.mark.parametrize("request_, field", [
    (router_pb2.GenerateRequest(prompt=""), "prompt"),
    (router_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingOptions(max_tokens=-1)), "max_tokens"),
    (router_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingOptions(temperature=-0.5)), "temperature"),
    (router_pb2.GenerateRequest(messages=router_pb2.MessageList(messages=[common_pb2.ChatMessage(role="wizard",
                                                                                                 content="hi")])), "role"),
    (router_pb2.GenerateRequest(prompt="word " * 9000), "max_model_len"),
    (router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1] * 5000)), "KV pool"),  # 256 blocks of 16
    (router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, 10**7])), "token_ids"),
])
def test_malformed_requests_are_invalid_argument_naming_the_field(nixl_cluster, request_, field):
    with pytest.raises(grpc.RpcError) as e:
        list(_stub(nixl_cluster).Generate(request_, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


def test_a_decode_whose_kv_source_is_gone_names_the_source(grpc_cluster):
    """A prefill worker that dies after prefilling fails the decode worker's pull: the decode worker
    names the source in its status so the router retries on another prefill worker instead of
    writing off the (healthy) decode worker."""
    workers, token = grpc_cluster.workers(), grpc_cluster.config.token()
    prefill_channel = channel(workers["prefill-1"].address, token)
    prefill = worker_pb2_grpc.PrefillWorkerStub(prefill_channel)
    prompt = [1, 2, 3, 4, 5] * 8
    handle = prefill.Prefill(worker_pb2.PrefillRequest(request_id="gone-source", prompt_token_ids=prompt,
                                                       sampling=common_pb2.SamplingOptions(max_tokens=4)), timeout=60)
    kv_pb2_grpc.KVTransferStub(prefill_channel).Release(
        kv_pb2.ReleaseRequest(request_id="gone-source"), timeout=10)
    handle.source_worker_id, handle.source_address = "prefill-gone", f"127.0.0.1:{free_port()}"
    decode = worker_pb2_grpc.DecodeWorkerStub(channel(workers["decode-0"].address, token))
    with pytest.raises(grpc.RpcError) as e:
        list(decode.Decode(worker_pb2.DecodeRequest(request_id="gone-source", prompt_token_ids=prompt,
                                                    sampling=common_pb2.SamplingOptions(max_tokens=4),
                                                    prefilled=handle), timeout=60))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(e.value.trailing_metadata())[FAILED_KV_SOURCE_METADATA_KEY] == "prefill-gone"
    assert _wait_idle(grpc_cluster, "decode")["decode-0"].active_blocks == 0


def test_a_prefill_retried_while_its_first_pin_holds_is_served(grpc_cluster):
    """The router retries a request on the same prefill worker without waiting for the first
    attempt's Release when it blames that worker: the retry ends the stale pin and is served (it met
    ALREADY_EXISTS, and with one prefill worker the request failed)."""
    workers, token = grpc_cluster.workers(), grpc_cluster.config.token()
    prefill_channel = channel(workers["prefill-1"].address, token)
    prefill = worker_pb2_grpc.PrefillWorkerStub(prefill_channel)
    request = worker_pb2.PrefillRequest(request_id="retried", prompt_token_ids=[1, 2, 3, 4, 5] * 8,
                                        sampling=common_pb2.SamplingOptions(max_tokens=4))
    first = prefill.Prefill(request, timeout=60)
    second = prefill.Prefill(request, timeout=60)
    assert second.pin_id != first.pin_id
    release = kv_pb2_grpc.KVTransferStub(prefill_channel).Release
    assert not release(kv_pb2.ReleaseRequest(request_id="retried", pin_id=first.pin_id), timeout=10).found
    assert release(kv_pb2.ReleaseRequest(request_id="retried", pin_id=second.pin_id), timeout=10).found
    assert _wait_idle(grpc_cluster, "prefill")["prefill-1"].active_blocks == 0  # the first attempt's freed too


def test_a_prefill_without_a_deadline_is_served(grpc_cluster):
    """gRPC reports no deadline as ~2**63 ns remaining: waited on as such, the prefill failed
    (UNKNOWN) after its request was queued, and its blocks stayed handed off with no pin."""
    workers, token = grpc_cluster.workers(), grpc_cluster.config.token()
    prefill_channel = channel(workers["prefill-1"].address, token)
    handle = worker_pb2_grpc.PrefillWorkerStub(prefill_channel).Prefill(worker_pb2.PrefillRequest(
        request_id="no-deadline", prompt_token_ids=[1, 2, 3, 4, 5] * 8, sampling=common_pb2.SamplingOptions(max_tokens=4)))
    assert handle.request_id == "no-deadline" and len(handle.block_ids) == 3
    assert kv_pb2_grpc.KVTransferStub(prefill_channel).Release(kv_pb2.ReleaseRequest(request_id="no-deadline"),
                                                               timeout=10).found
    assert _wait_idle(grpc_cluster, "prefill")["prefill-1"].active_blocks == 0


@pytest.mark.parametrize("forge, field", [
    (lambda h: setattr(h, "request_id", "someone-else"), "prefilled.request_id"),
    (lambda h: setattr(h, "num_prompt_tokens", h.num_prompt_tokens - 1), "prefilled.num_prompt_tokens"),
    (lambda h: h.block_ids.__setitem__(0, -3), "prefilled.block_ids"),
    (lambda h: h.ClearField("seed"), "prefilled.seed: missing"),  # an older prefill worker's
    (lambda h: setattr(h, "draft_hidden", bytes(6)), "prefilled.draft_hidden: 6 bytes"),
    (lambda h: setattr(h, "first_token", 10**6), "prefilled.first_token: 1000000 is outside the vocabulary"),
    (lambda h: setattr(h, "draft_hidden", bytes(400)), "draft hidden state does not fit"),  # refused after the pull,
])  # its blocks freed all the same
def test_a_decode_refuses_a_handle_that_is_not_its_requests(grpc_cluster, forge, field):
    workers, token = grpc_cluster.workers(), grpc_cluster.config.token()
    prefill_channel = channel(workers["prefill-1"].address, token)
    prompt, rid = [1, 2, 3, 4, 5] * 8, f"forged-{field}"
    handle = worker_pb2_grpc.PrefillWorkerStub(prefill_channel).Prefill(worker_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=common_pb2.SamplingOptions(max_tokens=4)), timeout=60)
    forge(handle)
    decode = worker_pb2_grpc.DecodeWorkerStub(channel(workers["decode-0"].address, token))
    with pytest.raises(grpc.RpcError) as e:
        list(decode.Decode(worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, prefilled=handle,
                                                    sampling=common_pb2.SamplingOptions(max_tokens=4)), timeout=60))
    kv_pb2_grpc.KVTransferStub(prefill_channel).Release(kv_pb2.ReleaseRequest(request_id=rid), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    # the handle's author named: the router retries on another prefill worker rather than refuse the request
    assert dict(e.value.trailing_metadata())[FAILED_KV_SOURCE_METADATA_KEY] == "prefill-1"
    assert _wait_idle(grpc_cluster, "decode")["decode-0"].active_blocks == 0


def test_killing_a_prefill_worker_retries_its_requests_elsewhere_and_restarts_it(grpc_cluster, reference, caplog):
    stub = _stub(grpc_cluster)
    address = grpc_cluster.workers()["prefill-0"].address
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        futures = [pool.submit(_generate, stub, _request(q)) for q in QUESTIONS]
        time.sleep(0.3)
        grpc_cluster.kill("prefill-0")
        results = [f.result() for f in futures]
    for q, (tokens, _) in zip(QUESTIONS, results):
        assert tokens == reference[q], q
    assert _wait_idle(grpc_cluster, "prefill")["prefill-1"].active_blocks == 0
    _wait_restarted(grpc_cluster, "prefill-0", address)  # the supervisor brought it back; it registered anew
    assert grpc_cluster.supervisor.restarts("prefill-0") == 1
    assert any("prefill-0 exited (killed by SIGKILL); restarting it" in r.getMessage() for r in caplog.records)
    for q in QUESTIONS:  # and the cluster serves as before
        assert _generate(stub, _request(q))[0] == reference[q], q


def test_killing_a_decode_worker_ends_only_its_streams(nixl_cluster):
    """Decode-0 is killed once one of its streams is under way (an event, not a wait of fixed
    length); its streams end with UNAVAILABLE naming it, the others finish. The streams are long
    enough that decode-0's cannot end before the kill: the kill follows the 11th token the client
    reads, and each stream wants 1,200. (With 160, a loaded machine once let the server finish a
    stream while its client was still reading the first tokens of it.)"""
    stub = _stub(nixl_cluster)
    outcomes: dict[int, object] = {}
    victim_streaming = threading.Event()

    def run(i: int) -> None:
        tokens = []
        try:
            for r in stub.Generate(_request(QUESTIONS[i], 1200, ignore_eos=True), timeout=600):
                tokens.extend(r.token_ids)
                worker = r.decode_worker or outcomes[i][0]
                outcomes[i] = (worker, len(tokens))
                if worker == "decode-0" and len(tokens) > 10:
                    victim_streaming.set()
            outcomes[i] = "done"
        except grpc.RpcError as e:
            outcomes[i] = e
        finally:
            victim_streaming.set()  # a stream that ends before any reached decode-0 fails the check below

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    victim_streaming.wait()
    on_victim = {i for i, o in outcomes.items() if isinstance(o, tuple) and o[0] == "decode-0"}
    assert on_victim, outcomes
    nixl_cluster.kill("decode-0")
    for t in threads:
        t.join()
    for i in on_victim:
        assert isinstance(outcomes[i], grpc.RpcError) and outcomes[i].code() == grpc.StatusCode.UNAVAILABLE
        assert "decode-0" in outcomes[i].details()
    assert any(o == "done" for o in outcomes.values()), outcomes  # the others continued
    survivors = _wait_idle(nixl_cluster, "prefill")
    assert survivors and all(w.active_blocks == 0 for w in survivors.values())
