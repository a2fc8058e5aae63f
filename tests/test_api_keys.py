"""Public API keys against a real local cluster (router + one aggregated worker on loopback): gRPC
and the OpenAI API refuse callers without a current key, Abort ends only the caller's own
requests, health and metrics stay open, and the key file is re-read when it changes."""

import urllib.request
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.config import parse_config
from deploy.local import LocalCluster
from proto.pdspec.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.api_keys import ApiKeys
from tests.waiting import wait_until

KEYS = ["key-alice", "key-bob"]
QUESTION = router_pb2.GenerateRequest(prompt="Hello", sampling=common_pb2.SamplingOptions(max_tokens=4))


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api_keys"
    path.write_text("# one key per line\n\n" + "\n".join(KEYS) + "\n")
    return path


@pytest.fixture(scope="module")
def cluster(key_file):
    config = parse_config({
        "engine": {"num_kv_blocks": 64, "max_num_seqs": 2, "speculative": {"method": "none"}},
        "cluster_token": "pdspec-tests",
        "router": {"port": 0, "http_port": 0, "api_key_file": str(key_file)},
        "prefill": {"replicas": 0}, "decode": {"replicas": 0}, "aggregated": {"replicas": 1},
    })
    cluster = LocalCluster(config, 0).start()
    yield cluster
    cluster.stop()


def _bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def test_pdspec_chat_sends_its_api_key_and_says_a_refusal_as_an_error(cluster, capsys, monkeypatch):
    from deploy.cli import main

    chat = ["chat", "--router", cluster.router_address, "--prompt", "Hello"]
    monkeypatch.delenv("PDSPEC_API_KEY", raising=False)
    assert main(chat) == 2  # no key: the router's refusal, said in one line (it was a traceback)
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(chat + ["--api-key", "key-bob"]) == 0
    assert "finish_reason=" in capsys.readouterr().out
    monkeypatch.setenv("PDSPEC_API_KEY", "key-alice")
    assert main(chat) == 0


def test_grpc_needs_a_current_key_and_health_stays_open(cluster):
    with grpc.insecure_channel(cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for metadata in ((), _bearer("not-a-key"), (("authorization", "key-alice"),)):
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(QUESTION, metadata=metadata))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "router.api_key_file" in refused.value.details()
        answer = list(stub.Generate(QUESTION, metadata=_bearer("key-alice")))
        assert answer[-1].finish_reason in ("stop", "length")
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_http_needs_a_current_key_and_health_and_metrics_stay_open(cluster):
    refused = openai.OpenAI(base_url=cluster.http_url, api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        refused.models.list()
    with pytest.raises(openai.AuthenticationError):
        refused.completions.create(model=None, prompt="Hello", max_tokens=4)
    client = openai.OpenAI(base_url=cluster.http_url, api_key="key-bob", max_retries=0)
    assert client.completions.create(model=None, prompt="Hello", max_tokens=4).usage.completion_tokens > 0
    root = cluster.http_url.removesuffix("/v1")
    assert httpx.post(f"{cluster.http_url}/completions", json={"prompt": "Hi"}).status_code == 401
    # Two keys: the check read the last, the request's owner (for Abort) was taken from the first.
    two = [("Authorization", "Bearer bogus"), ("Authorization", "Bearer key-bob")]
    assert httpx.post(f"{cluster.http_url}/completions", json={"prompt": "Hi"}, headers=two).status_code == 400
    for path in ("/health", "/ready", "/metrics"):
        assert urllib.request.urlopen(root + path, timeout=10).status == 200


def test_http_refuses_from_the_headers_before_it_reads_a_body(cluster):
    """No key: 401 whatever the body (it was parsed first: a keyless client could make the router
    hold and parse a body of any size); a key: a body over the limit is refused by its declared
    size (413), one of undeclared size too (411). gRPC caps a request message the same."""
    from router.http_guard import MAX_REQUEST_BYTES

    url = f"{cluster.http_url}/chat/completions"
    huge = b'{"messages": [{"role": "user", "content": "' + b"x" * (MAX_REQUEST_BYTES + 1) + b'"}]}'
    keyed = {"authorization": "Bearer key-alice", "content-type": "application/json"}
    with httpx.Client(timeout=60) as http:
        refused = http.post(url, content=huge, headers={"content-type": "application/json"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        too_large = http.post(url, content=huge, headers=keyed)
        assert too_large.status_code == 413 and f"at most {MAX_REQUEST_BYTES}" in too_large.json()["error"]["message"]
        unsized = http.post(url, content=iter([b'{"messages": []}']), headers=keyed)  # chunked
        assert unsized.status_code == 411
        fine = http.post(url, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, headers=keyed)
        assert fine.status_code == 200 and fine.json()["choices"][0]["message"]["content"]
    with grpc.insecure_channel(cluster.router_address) as channel:
        request = router_pb2.GenerateRequest(prompt="x" * (MAX_REQUEST_BYTES + 1))
        with pytest.raises(grpc.RpcError) as refused:
            list(router_pb2_grpc.RouterStub(channel).Generate(request, metadata=_bearer("key-alice")))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_refused_requests_are_counted(cluster):
    """Refused before the router's Generate (no current key, a body too large), a request was in no
    metric: an operator saw neither a client with a revoked key nor one sending too much."""
    def refused(front: str, status: str) -> float:
        text = httpx.get(f"{cluster.http_url.removesuffix('/v1')}/metrics", timeout=10).text
        line = f'pdspec_requests_refused_total{{front="{front}",model="{cluster.config.served_model_name()}",' \
               f'status="{status}"}} '
        return next((float(row.removeprefix(line)) for row in text.splitlines() if row.startswith(line)), 0.0)

    before = {key: refused(*key) for key in (("http", "401"), ("http", "411"), ("grpc", "UNAUTHENTICATED"))}
    assert httpx.post(f"{cluster.http_url}/completions", json={"prompt": "Hi"}).status_code == 401
    assert httpx.post(f"{cluster.http_url}/completions", content=iter([b"{}"]),
                      headers={"authorization": "Bearer key-bob"}).status_code == 411
    with grpc.insecure_channel(cluster.router_address) as channel, pytest.raises(grpc.RpcError):
        list(router_pb2_grpc.RouterStub(channel).Generate(QUESTION))
    assert {key: refused(*key) - count for key, count in before.items()} == {
        ("http", "401"): 1, ("http", "411"): 1, ("grpc", "UNAUTHENTICATED"): 1}


def test_abort_ends_only_requests_made_with_the_same_key(cluster):
    long = router_pb2.GenerateRequest(request_id="alice-1", prompt="Tell me a long story.",
                                      sampling=common_pb2.SamplingOptions(max_tokens=4000, ignore_eos=True))
    with grpc.insecure_channel(cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        call = stub.Generate(long, metadata=_bearer("key-alice"))
        next(call)  # running
        with pytest.raises(grpc.RpcError) as twice:  # well formed: a retry under the id while it runs
            list(stub.Generate(long, metadata=_bearer("key-alice")))
        assert twice.value.code() == grpc.StatusCode.ALREADY_EXISTS and "already running" in twice.value.details()
        bob = stub.Abort(common_pb2.AbortRequest(request_id="alice-1"), metadata=_bearer("key-bob"))
        assert not bob.found
        # Each key has its own request ids: bob's "alice-1" runs beside alice's (it was refused).
        same_id = router_pb2.GenerateRequest(request_id="alice-1", prompt="Hi", sampling=common_pb2.SamplingOptions(
            max_tokens=2))
        answer = list(stub.Generate(same_id, metadata=_bearer("key-bob")))
        assert answer[0].request_id == "alice-1" and answer[-1].finish_reason in ("stop", "length")
        alice = stub.Abort(common_pb2.AbortRequest(request_id="alice-1"), metadata=_bearer("key-alice"))
        assert alice.found
        assert list(call)[-1].finish_reason == "abort"


def test_the_key_file_is_re_read_when_it_changes(tmp_path):
    path = tmp_path / "keys"
    path.write_text("old-key\n")
    keys = ApiKeys(path)
    assert keys.owner("Bearer old-key") is not None
    path.write_text("new-key\n")
    wait_until(lambda: keys.owner("Bearer old-key") is None, "the revoked key still works")
    assert keys.owner("Bearer new-key") is not None


def test_a_key_no_client_can_send_added_later_is_ignored_and_said(tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text("old-key\n")
    keys = ApiKeys(path)
    path.write_text("old-key\nnew-key\ncl\u00e9\n")
    wait_until(lambda: keys.owner("Bearer new-key") is not None, "the added key is not taken")
    assert keys.owner("Bearer old-key") is not None
    assert any("line 3: a key must be printable ASCII" in r.getMessage() and "cl\u00e9" not in r.getMessage()
               for r in caplog.records)


def test_without_a_cluster_token_list_workers_needs_an_api_key(key_file, model_dir):
    """ListWorkers names every worker's internal address: the cluster token guards it, and in a
    cluster without one the API keys do (it was open to anyone on the public port)."""
    from router.config import RouterConfig
    from router.main import run_router

    router = run_router(RouterConfig(api_key_file=key_file), None, model_dir, "smollm2", port=0, internal_port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert list(stub.ListWorkers(router_pb2.ListWorkersRequest(), metadata=_bearer("key-bob"),
                                         timeout=10).workers) == []
    finally:
        router.stop(0)


def test_an_emptied_or_removed_key_file_accepts_no_key(tmp_path):
    """Revoking the last key by emptying the file, or removing it, shuts the API: the old keys
    were kept working before (the file was refused as holding no key)."""
    path = tmp_path / "keys"
    path.write_text("leaked-key\n")
    keys = ApiKeys(path)
    path.write_text("# revoked\n")
    wait_until(lambda: keys.owner("Bearer leaked-key") is None, "the emptied file's key still works")
    path.write_text("new-key\n")
    wait_until(lambda: keys.owner("Bearer new-key") is not None, "a key added again is not taken")
    path.write_bytes(b"new-key\n# caf\xe9, not UTF-8\n")
    wait_until(lambda: keys.owner("Bearer new-key") is None, "an undecodable file's key still works")
    path.write_text("new-key\n")
    wait_until(lambda: keys.owner("Bearer new-key") is not None, "the file mended is not taken")
    path.unlink()
    wait_until(lambda: keys.owner("Bearer new-key") is None, "the removed file's key still works")
    path.write_text("new-key\n")
    wait_until(lambda: keys.owner("Bearer new-key") is not None, "the file written again is not taken")


@pytest.mark.parametrize("content, error", [(None, "cannot read"), (b"# only a comment\n", "holds no key"),
                                            (b"# caf\xe9\nkey\n", r"is not UTF-8 text \(byte 5\)"),
                                            # held, and never sendable (gRPC metadata and HTTP headers)
                                            ("key\ncl\u00e9-secr\u00e8te\n".encode(), "line 2: a key must be printable ASCII")])
def test_a_bad_key_file_is_refused_naming_the_field(tmp_path, content, error):
    path = tmp_path / "keys"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=f"router.api_key_file: .*{error}"):
        ApiKeys(path)
