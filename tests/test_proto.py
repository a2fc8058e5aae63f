"""The committed protobuf stubs are exactly what regenerating them produces."""

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
