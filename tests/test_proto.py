"""The committed protobuf stubs are exactly what regenerating them produces; proto.rpc's servers."""

import subprocess
import sys

import grpc

from proto.generate import PROTOS, ROOT, generate


def test_regenerating_stubs_changes_nothing(tmp_path):
    generate(tmp_path)
    out = tmp_path / "proto" / "pdspec" / "v1"
    produced = sorted(p.name for p in out.iterdir())
    assert produced == sorted(f"{p.stem}{suffix}" for p in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))
    for name in produced:
        committed = ROOT / "proto" / "pdspec" / "v1" / name
        assert committed.read_bytes() == (out / name).read_bytes(), f"{name} is stale: run python -m proto.generate"


def test_a_taken_port_fails_the_second_server_loudly():
    """gRPC's default SO_REUSEPORT let two servers share a port and split its connections."""
    import pytest

    from proto.rpc import serve

    first, port = serve([], "127.0.0.1:0")
    try:
        with pytest.raises(RuntimeError, match=f"could not bind gRPC server to 127.0.0.1:{port}"):
            serve([], f"127.0.0.1:{port}")
    finally:
        first.stop(None)


# A server of one internal service (cluster token "t") in a process of its own: it prints its port and
# peak memory (KB), then its peak memory again once told to.
_GATED_SERVER = """
import resource, sys
from proto.rpc import serve
from proto.pdspec.v1 import kv_pb2_grpc
servicer = (kv_pb2_grpc.add_KVTransferServicer_to_server, kv_pb2_grpc.KVTransferServicer(), "pdspec.v1.KVTransfer")
server, port = serve([servicer], "127.0.0.1:0", token="t", internal=["pdspec.v1.KVTransfer"])
print(port, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
sys.stdin.readline()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
"""


def test_an_internal_call_without_the_token_is_refused_before_its_message_is_read():
    """Read first (a unary handler takes in the whole message), four unauthenticated calls of 64 MB
    made the server hold 256 MB more: a message may be 256 MB, and anyone reaching an internal port
    could exhaust a router's memory."""
    server = subprocess.Popen([sys.executable, "-c", _GATED_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=ROOT)
    try:
        port, before_kb = map(int, server.stdout.readline().split())
        payload = b"x" * (64 << 20)
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 65 << 20)]) as ch:
            release = ch.unary_unary("/pdspec.v1.KVTransfer/Release")
            calls = [release.future(payload, timeout=60) for _ in range(4)]
            assert [c.exception().code() for c in calls] == [grpc.StatusCode.UNAUTHENTICATED] * 4
        grown_mb = (int(server.communicate("\n", timeout=60)[0]) - before_kb) / 1024
        assert grown_mb < 64, f"the server's peak memory grew by {grown_mb:.0f} MB"
    finally:
        server.kill()
