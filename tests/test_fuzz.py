"""Fuzzing the public request against a real local cluster (router + one aggregated worker),
over gRPC and the OpenAI HTTP API: random values, huge strings, out-of-range token ids, negative
and NaN sampling values, empty and unknown-role messages. Every request gets an answer or a
status a client can act on (never INTERNAL or a 500), the server stays up, no block leaks.
Examples are derandomized, so a CI run is reproducible."""

import math
import time

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy.config import parse_config
from deploy.local import LocalCluster
from proto.pdspec.v1 import common_pb2, router_pb2, router_pb2_grpc
from tools.scrape import metric

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
ACTIONABLE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}


@pytest.fixture(scope="module")
def cluster():
    config = parse_config({
        "engine": {"num_kv_blocks": 64, "max_num_seqs": 4, "max_model_len": 512, "speculative": {"method": "none"}},
        "cluster_token": "pdspec-tests",
        "router": {"port": 0, "http_port": 0},
        "prefill": {"replicas": 0}, "decode": {"replicas": 0}, "aggregated": {"replicas": 1},
    })
    cluster = LocalCluster(config, 0).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def stub(cluster):
    with grpc.insecure_channel(cluster.router_address) as channel:
        yield router_pb2_grpc.RouterStub(channel)


texts = st.one_of(st.text(max_size=40), st.just(""), st.text(min_size=2000, max_size=4000))
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
small_ints = st.integers(min_value=-(2**31), max_value=8)  # short answers: a valid request stays cheap
messages = st.lists(st.builds(common_pb2.ChatMessage, role=st.sampled_from(["user", "system", "assistant", "bot", ""]),
                              content=texts), max_size=4)
sampling = st.builds(
    common_pb2.SamplingOptions,
    max_tokens=small_ints, temperature=floats, top_p=floats, top_k=st.integers(-5, 2**31 - 1),
    seed=st.integers(0, 2**64 - 1), stop=st.lists(texts, max_size=3), ignore_eos=st.booleans(),
    stop_token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3))
inputs = st.one_of(
    st.builds(lambda m: {"messages": router_pb2.MessageList(messages=m)}, messages),
    st.builds(lambda p: {"prompt": p}, texts),
    st.builds(lambda ids: {"token_ids": router_pb2.TokenIds(ids=ids)},
              st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20)))
requests = st.builds(lambda rid, input_, s: router_pb2.GenerateRequest(request_id=rid, sampling=s, **input_),
                     st.text(max_size=200), inputs, sampling)


@FUZZ
@given(request=requests)
def test_any_grpc_request_gets_an_answer_or_an_actionable_status(stub, request):
    try:
        responses = list(stub.Generate(request, timeout=120))
    except grpc.RpcError as e:
        assert e.code() in ACTIONABLE, (e.code(), e.details(), request)
        assert e.details()
        return
    assert responses and responses[-1].finish_reason in ("stop", "length"), request


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30)),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner,
                                                                                      max_size=3), max_leaves=8)
http_bodies = st.fixed_dictionaries(
    {}, optional={"messages": st.one_of(json_values, st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer", "tool", 7]), "content": json_values}), max_size=3)),
        "prompt": st.one_of(json_values, st.text(max_size=50), st.lists(st.integers(-5, 60000), max_size=8)),
        "max_tokens": st.one_of(json_values, st.integers(-3, 6)), "temperature": json_values,
        "top_p": json_values, "n": json_values, "stop": json_values, "stream": st.booleans(),
        "seed": json_values, "logprobs": json_values, "model": json_values})


@FUZZ
@given(body=http_bodies, chat=st.booleans())
def test_any_http_body_gets_an_answer_or_a_4xx(cluster, body, chat):
    url = f"{cluster.http_url}/{'chat/completions' if chat else 'completions'}"
    response = httpx.post(url, json=body, timeout=120)
    assert response.status_code in (200, 400, 404, 429, 503), (response.status_code, response.text, body)
    if response.status_code != 200:
        assert response.json()["error"]["message"]


def test_a_one_megabyte_prompt_is_refused_naming_the_limit(stub):
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(router_pb2.GenerateRequest(prompt="word " * 200_000), timeout=300))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len (512)" in refused.value.details()


def test_a_prompt_past_the_context_is_refused_over_http_as_openai_refuses_it(cluster):
    """With OpenAI's code and words, which its clients (LiteLLM, LangChain) look for to tell a
    prompt too long from other refusals (the code was always null)."""
    response = httpx.post(f"{cluster.http_url}/completions", json={"prompt": "word " * 2000}, timeout=300)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded", response.text
    assert "maximum context length" in error["message"] and error["param"] == "prompt"


def test_after_the_fuzz_the_server_is_up_and_holds_no_blocks(cluster, stub):
    answer = list(stub.Generate(router_pb2.GenerateRequest(prompt="Hello", sampling=common_pb2.SamplingOptions(
        max_tokens=4)), timeout=60))
    assert answer[-1].finish_reason in ("stop", "length")
    (worker,) = cluster.workers().values()
    deadline = time.monotonic() + 30
    while True:
        used = metric(f"http://{worker.metrics_address}/metrics", "pdspec_kv_blocks_used")
        if used == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert used == 0 and not math.isnan(used)
