"""The OpenAI-compatible HTTP API end to end: the official `openai` client and raw HTTP against a
local disaggregated cluster (router, prefill and decode workers as processes on loopback), and
the router's request metrics it moves."""

import asyncio
import json
import socket
import time

import grpc
import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from deploy.config import parse_config
from deploy.local import LocalCluster
from engine.tokenizer import Tokenizer
from tools.loadgen import make_workload, run_load, summarize
from tools.scrape import metric
from proto.pdspec.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.openai_api import create_app
from tests.waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "Name three primary colors."}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster():
    config = parse_config({
        "engine": {"num_kv_blocks": 256, "max_num_seqs": 8,
                   # Drafting at every batch size (the CPU default stops above 2 sequences): the load
                   # test's tau needs a verification step however its 4 requests happen to overlap.
                   "speculative": {"method": "eagle3", "num_speculative_tokens": 4, "adaptive": False,
                                   "disable_by_batch_size": None}},
        "cluster_token": "pdspec-tests",
        "router": {"port": 0, "http_port": 0, "request_timeout_s": 900.0},
        "prefill": {"replicas": 1, "kv_transfer": "grpc"}, "decode": {"replicas": 1, "kv_transfer": "grpc"},
    })
    cluster = LocalCluster(config, 0).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0)


def _root(cluster: LocalCluster) -> str:
    return cluster.http_url.removesuffix("/v1")


def _grpc_answer(cluster: LocalCluster, **input_) -> tuple[str, list[int]]:
    with grpc.insecure_channel(cluster.router_address) as channel:
        request = router_pb2.GenerateRequest(sampling=common_pb2.SamplingOptions(max_tokens=MAX_TOKENS), **input_)
        responses = list(router_pb2_grpc.RouterStub(channel).Generate(request))
    return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids]


def test_chat_answers_as_the_grpc_api_does(cluster, client):
    messages = router_pb2.MessageList(messages=[common_pb2.ChatMessage(**m) for m in QUESTION])
    text, ids = _grpc_answer(cluster, messages=messages)
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0)
    assert answer.object == "chat.completion" and answer.model == MODEL
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == text
    assert answer.choices[0].finish_reason == ("length" if len(ids) == MAX_TOKENS else "stop")
    assert answer.usage.completion_tokens == len(ids)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + len(ids)
    acceptance = answer.model_extra["pdspec"]["acceptance"]
    assert acceptance["steps"] > 0 and acceptance["accepted"] <= acceptance["drafted"]


def test_a_streamed_chat_is_the_whole_answer_in_deltas(client):
    # Sampled at OpenAI's default temperature: the same seed draws the same answer, streamed or not.
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=MAX_TOKENS, seed=11)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=MAX_TOKENS,
                                                 seed=11, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_take_text_or_token_ids(cluster, client, model_dir):
    text, ids = _grpc_answer(cluster, prompt="The three primary colors are")
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0}  # the gRPC API's default, as _grpc_answer asks
    by_text = client.completions.create(model=MODEL, prompt="The three primary colors are", **greedy)
    assert by_text.object == "text_completion" and by_text.choices[0].text == text
    prompt_ids = Tokenizer.from_dir(model_dir).encode("The three primary colors are")
    by_ids = client.completions.create(model=MODEL, prompt=prompt_ids, **greedy)
    assert by_ids.choices[0].text == text and by_ids.usage.prompt_tokens == len(prompt_ids)
    streamed = client.completions.create(model=MODEL, prompt="The three primary colors are", **greedy, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text


def test_stop_strings_and_token_ids_end_the_answer_without_leaking(cluster, client):
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0}
    whole = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", **greedy).choices[0].text
    stop = whole[len(whole) // 2: len(whole) // 2 + 2]
    cut = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", **greedy, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == whole[: whole.index(stop)]
    chunks = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", **greedy, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == whole[: whole.index(stop)]
    _, ids = _grpc_answer(cluster, prompt="Count: 1, 2, 3,")
    by_id = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", **greedy,
                                      extra_body={"stop_token_ids": [ids[2]]})
    assert by_id.choices[0].finish_reason == "stop" and by_id.usage.completion_tokens == ids.index(ids[2]) + 1


def test_models_lists_the_served_model_and_unknown_ones_are_404(client):
    assert [m.id for m in client.models.list()] == [MODEL] and client.models.retrieve(MODEL).id == MODEL
    for unknown in (lambda: client.chat.completions.create(model="gpt-4o", messages=QUESTION),
                    lambda: client.models.retrieve("gpt-4o")):
        with pytest.raises(openai.NotFoundError) as e:
            unknown()
        assert e.value.body["param"] == "model" and MODEL in e.value.body["message"]


def test_unknown_paths_and_methods_answer_in_openais_error_shape(cluster):
    for method, path, status in (("POST", "/embeddings", 404), ("GET", "/chat/completions", 405)):
        response = httpx.request(method, f"{cluster.http_url}{path}", timeout=60)
        assert response.status_code == status and path in response.json()["error"]["message"], response.text


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 3}, "temperature"),
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": 0}, "logprobs"),  # 0 is not False
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"min_p": 0.1}, "min_p"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"stop": ["s%d" % i for i in range(33)]}, "stop"),  # each is searched for in every token's text
    ({"messages": [{"role": "user", "content": "cut \ud83d"}]}, "messages"),  # half an emoji: no UTF-8 has it
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}, "messages"),
    ({"stop": "\ud800"}, "stop"),
    # JSON's own types only (lax parsing took true for 1, "0.7" for 0.7 and "yes" for true)
    ({"max_tokens": True}, "max_tokens"), ({"temperature": "0.7"}, "temperature"), ({"stream": "yes"}, "stream"),
    # fields that would change the answer, refused, not dropped
    ({"modalities": ["text", "audio"]}, "modalities"), ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"max_tokens": -5, "max_completion_tokens": 10}, "max_tokens"),  # overridden, still checked
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
])
def test_bad_fields_are_400_naming_the_field(cluster, fields, param):
    body = {"model": MODEL, "messages": QUESTION, **fields}
    # json.dumps escapes a lone surrogate as JSON may (httpx's own encoding fails on one)
    response = httpx.post(f"{cluster.http_url}/chat/completions", content=json.dumps(body), timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and param in error["message"]


def test_a_malformed_body_is_told_what_is_wrong_with_it(cluster):
    """The failure named is the one in the type the client sent (a part that is not text, not
    "should be a string"), and a JSON body sent without its Content-Type is told to send it."""
    def error(body: str, **headers) -> str:
        response = httpx.post(f"{cluster.http_url}/chat/completions", content=body, timeout=60, headers=headers)
        assert response.status_code == 400, response.text
        return response.json()["error"]["message"]

    image = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert "got 'image_url' (at messages.0.content.0.type)" in error(json.dumps(image), **{"content-type": "application/json"})
    stop = {"model": MODEL, "messages": QUESTION, "stop": ["a", 1]}
    assert "valid string, got 1 (at stop.1)" in error(json.dumps(stop), **{"content-type": "application/json"})
    prompt = {"model": MODEL, "prompt": ["a", 5]}  # the 5 is wrong, in a list of strings
    response = httpx.post(f"{cluster.http_url}/completions", json=prompt, timeout=60)
    assert "valid string, got 5 (at prompt.1)" in response.json()["error"]["message"], response.text
    long = error(json.dumps({"model": MODEL, "messages": "x" * 400}), **{"content-type": "application/json"})
    assert "x" * 70 in long and "x" * 100 not in long  # a refused value is shown cut, as the router shows it
    form = error(json.dumps({"model": MODEL, "messages": QUESTION}), **{"content-type": "application/x-www-form-urlencoded"})
    assert "Content-Type: application/json" in form and "x-www-form-urlencoded" in form


def test_raw_sse_framing(cluster):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{cluster.http_url}/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        assert json.loads(event.removeprefix("data: "))["object"] == "chat.completion.chunk"


def test_health_ready_and_metrics_endpoints(cluster):
    root = _root(cluster)
    assert httpx.get(f"{root}/health").json() == {"status": "ok"}
    assert httpx.get(f"{root}/ready").status_code == 200
    assert "pdspec_requests_total" in httpx.get(f"{root}/metrics").text


def _decode_metrics_url(cluster: LocalCluster) -> str:
    (decode,) = [w for w in cluster.workers().values() if w.role == "decode"]
    return f"http://{decode.metrics_address}/metrics"


def test_a_request_moves_the_metrics_by_its_own_counts(cluster, client):
    router, decode = f"{_root(cluster)}/metrics", _decode_metrics_url(cluster)
    names = ["pdspec_requests_total", "pdspec_generation_tokens_total", "pdspec_prompt_tokens_total",
             "pdspec_time_to_first_token_seconds_count", "pdspec_e2e_request_latency_seconds_count",
             "pdspec_request_queue_seconds_count", "pdspec_inter_token_latency_seconds_count",
             "pdspec_spec_draft_tokens_total", "pdspec_spec_accepted_tokens_total",
             "pdspec_spec_accepted_tokens_per_position_total"]
    before = {n: metric(router, n) for n in names}
    ok_before = metric(router, "pdspec_requests_total", status="OK")
    handoffs_before = metric(decode, "pdspec_kv_transfer_seconds_count")
    bytes_before = metric(decode, "pdspec_kv_transfer_bytes_total")
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS)
    # The router counts a request when its Generate stream ends, just after the last message left.
    wait_until(lambda: metric(router, "pdspec_requests_total") != before["pdspec_requests_total"],
               "the router did not count the request", 10)
    after = {n: metric(router, n) for n in names}
    moved = {n: after[n] - before[n] for n in names}
    a, usage = answer.model_extra["pdspec"]["acceptance"], answer.usage
    assert moved["pdspec_requests_total"] == 1
    assert metric(router, "pdspec_requests_total", status="OK") - ok_before == 1
    assert moved["pdspec_generation_tokens_total"] == usage.completion_tokens
    assert moved["pdspec_prompt_tokens_total"] == usage.prompt_tokens
    for one in ("pdspec_time_to_first_token_seconds_count", "pdspec_e2e_request_latency_seconds_count",
                "pdspec_request_queue_seconds_count"):
        assert moved[one] == 1, one
    assert moved["pdspec_inter_token_latency_seconds_count"] == usage.completion_tokens - 1
    assert moved["pdspec_spec_draft_tokens_total"] == a["drafted"]
    assert moved["pdspec_spec_accepted_tokens_total"] == moved["pdspec_spec_accepted_tokens_per_position_total"] \
        == a["accepted"]
    assert metric(decode, "pdspec_kv_transfer_seconds_count") - handoffs_before == 1
    assert metric(decode, "pdspec_kv_transfer_bytes_total") > bytes_before


def test_streamed_answers_count_as_answers_not_cancels(cluster, client):
    """The client closes its stream once it read the last event, often before the router's call saw
    the decode worker's stream end: that is an answer (OK, counted once), not a cancel."""
    root = f"{_root(cluster)}/metrics"
    before = {s: metric(root, "pdspec_requests_total", status=s) for s in ("OK", "CANCELLED")}
    aborts, prompt_before = metric(root, "pdspec_requests_total", finish_reason="abort"), \
        metric(root, "pdspec_prompt_tokens_total")
    prompt_tokens = 0
    for _ in range(4):
        for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, stream=True,
                                                    stream_options={"include_usage": True}):
            prompt_tokens += chunk.usage.prompt_tokens if chunk.usage else 0
    wait_until(lambda: sum(metric(root, "pdspec_requests_total", status=s) - n for s, n in before.items()) >= 4,
               "the router did not count the requests", 10)
    time.sleep(0.2)  # a late cancel would count now
    assert metric(root, "pdspec_requests_total", status="OK") - before["OK"] == 4
    assert metric(root, "pdspec_requests_total", status="CANCELLED") == before["CANCELLED"]
    assert metric(root, "pdspec_requests_total", finish_reason="abort") == aborts
    assert metric(root, "pdspec_prompt_tokens_total") - prompt_before == prompt_tokens


def _wait_blocks_free(cluster: LocalCluster, timeout_s: float = 60.0) -> None:
    url = _decode_metrics_url(cluster)
    wait_until(lambda: not metric(url, "pdspec_kv_blocks_used"), "the decode worker still holds KV blocks",
               timeout_s, poll_s=0.1)


LONG = {"model": MODEL, "messages": QUESTION, "max_tokens": 4000, "ignore_eos": True}


def test_a_streaming_client_that_leaves_frees_every_block(cluster):
    cancelled = metric(f"{_root(cluster)}/metrics", "pdspec_requests_total", status="CANCELLED")
    with httpx.stream("POST", f"{cluster.http_url}/chat/completions", json=LONG | {"stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert metric(_decode_metrics_url(cluster), "pdspec_kv_blocks_used") > 0
    _wait_blocks_free(cluster)
    assert metric(f"{_root(cluster)}/metrics", "pdspec_requests_total", status="CANCELLED") == cancelled + 1


def _post_raw(cluster: LocalCluster, fields: dict) -> socket.socket:
    """A chat completion request sent on a raw connection, left to the caller to close when it likes."""
    body = json.dumps(fields).encode()
    host, port = cluster.http_url.removeprefix("http://").removesuffix("/v1").split(":")
    conn = socket.create_connection((host, int(port)))
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return conn


def test_a_client_that_leaves_before_a_whole_answer_frees_every_block(cluster):
    """The answer comes only at the end: the client sends, waits until it is being decoded, hangs up."""
    url = _decode_metrics_url(cluster)
    with _post_raw(cluster, LONG):
        wait_until(lambda: metric(url, "pdspec_kv_blocks_used") > 0, "the request was never decoded", 60, poll_s=0.05)
    _wait_blocks_free(cluster)


def test_a_streaming_client_that_leaves_before_its_first_token_stops_the_request(cluster):
    """Gone while its long prompt is still prefilled, before the stream's status line: the
    request is cancelled all the same, not decoded to its end for nobody. (Also with the stream
    opened after it left, its generator never started: the response's own end cancels it.)"""
    root = f"{_root(cluster)}/metrics"
    cancelled = metric(root, "pdspec_requests_total", status="CANCELLED")
    long_prompt = [{"role": "user", "content": "Repeat after me: " + "apple pie and " * 600}]
    _post_raw(cluster, LONG | {"messages": long_prompt, "max_tokens": 1000, "stream": True}).close()
    wait_until(lambda: metric(root, "pdspec_requests_total", status="CANCELLED") != cancelled,
               "the request was not cancelled", 30, poll_s=0.1)  # decoding all 1,000 tokens would take longer
    _wait_blocks_free(cluster)


def test_load_over_http_accounts_for_every_token(cluster):
    workload = make_workload(["Say hello.", "Count to three."], 4, num_prefixes=1, prefix_tokens=200)
    records, wall = run_load(cluster.http_url, workload, rate=20.0, max_tokens=8)
    summary = summarize(records, wall)
    assert summary["requests"] == 4 and summary["errors"] == 0, summary["first_error"]
    assert all(r.completion_tokens == 8 and r.sent < r.first <= r.done for r in records)  # EOS ignored
    assert summary["prefill_tokens_computed"] + summary["cached_prompt_tokens"] == sum(r.prompt_tokens for r in records)
    assert summary["itl_ms_p50"] > 0 and summary["tau"] >= 1
    assert summarize(*run_load(cluster.http_url.replace("/v1", "/v2"), workload[:1], 0, 8))["first_error"] \
        .startswith("HTTP 404")


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_before_its_answer_gets_499_not_a_server_error(stream):
    """The app alone over a Generate that answers nothing until its call ends: the client's hang-up
    cancels the call, whose "the client left" was answered as a 500 internal_error (logged and
    counted as the server's failure)."""
    def generate(request, context):
        while context.is_active():
            time.sleep(0.01)
        yield from ()

    app = create_app(generate, "m", CollectorRegistry(), lambda: True, lambda header: True)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": stream}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}

    async def serve_one() -> list[dict]:
        sent, messages = [], [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        await app(scope, receive, send)
        return sent

    sent = asyncio.run(serve_one())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
