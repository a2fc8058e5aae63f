"""TLS on the public port and mutual TLS on every internal one, with a throwaway CA made here:
a TLS cluster answers token-identically, plaintext to its ports fails, and a peer holding a
certificate of another CA can neither register, nor pull KV, nor hand a destination its NIXL
metadata (the blob never leaves the peer, so it is never deserialized)."""

import datetime
import ipaddress
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from deploy.config import parse_config
from deploy.local import LocalCluster
from kvtransfer.grpc_backend import GrpcConnector
from proto.pdspec.v1 import kv_pb2, kv_pb2_grpc, worker_pb2_grpc
from proto.rpc import channel
from proto.tls import Tls
from router.calls import Peers
from router.http_server import TLS_CHECK_S
from serving.registry_client import RegistryClient
from tests import test_cluster
from tests.kv_peers import LAYOUT, random_caches
from tests.test_router_server import registration

TOKEN = "pdspec-tests"
reference = test_cluster.reference  # the engine's greedy answers (a fixture)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, issuer: str, key, issuer_key, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:  # one identity for every process: server and client alike, valid for loopback
        builder = (builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False))
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(obj) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_pki(directory: Path, name: str) -> dict[str, Path]:
    """A CA and one certificate it signed, as PEM files: {cert_file, key_file, ca_file}."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _certificate(f"{name} CA", f"{name} CA", ca_key, ca_key, ca=True)
    files = {"cert_file": _pem(_certificate(f"{name} node", f"{name} CA", key, ca_key, ca=False)),
             "key_file": _pem(key), "ca_file": _pem(ca)}
    paths = {field: directory / f"{name}-{field}.pem" for field in files}
    for field, path in paths.items():
        path.write_bytes(files[field])
    return paths


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, dict[str, Path]]:
    directory = tmp_path_factory.mktemp("pki")
    return {"cluster": make_pki(directory, "cluster"), "rogue": make_pki(directory, "rogue")}


@pytest.fixture(scope="module")
def tls_cluster(pki):
    tls = {field: str(path) for field, path in pki["cluster"].items()}
    config = parse_config({"engine": test_cluster.ENGINE, "cluster_token": TOKEN, "tls": tls,
                           "router": {"port": 0, "http_port": 0, "heartbeat_interval_s": 0.2,
                                      "request_timeout_s": 900.0},
                           "prefill": {"replicas": 1, "kv_transfer": "nixl"},
                           "decode": {"replicas": 1, "kv_transfer": "nixl"}})
    cluster = LocalCluster(config, 0).start()
    yield cluster
    cluster.stop()


def _rogue(pki) -> Tls:
    """A peer with the cluster's token and a certificate of another CA (it trusts the cluster's
    CA, so the refusal is the cluster's, not its own)."""
    rogue = pki["rogue"]
    return Tls(rogue["cert_file"].read_bytes(), rogue["key_file"].read_bytes(), pki["cluster"]["ca_file"].read_bytes())


def test_a_tls_cluster_answers_token_identically(tls_cluster, reference):
    test_cluster._check_answers(tls_cluster, reference)


def test_the_http_api_of_a_tls_cluster_is_https(tls_cluster, pki):
    """The public HTTP API is as private as the public gRPC port: TLS with the router's identity."""
    url = tls_cluster.http_url
    assert url.startswith("https://")
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    trust = ssl.create_default_context(cafile=str(pki["cluster"]["ca_file"]))
    answer = httpx.post(f"{url}/chat/completions", json=body, verify=trust, timeout=120)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
    with pytest.raises(httpx.HTTPError):  # plaintext to it
        httpx.post(f"{url.replace('https://', 'http://')}/chat/completions", json=body, timeout=30)


def test_plaintext_to_a_tls_port_fails(tls_cluster):
    for address in (tls_cluster.router_address, tls_cluster.registry_address):
        with channel(address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                worker_pb2_grpc.RegistryStub(ch).Register(registration("plain", "127.0.0.1:1"), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_of_another_ca_can_neither_register_nor_pull_kv(tls_cluster, pki):
    prefill = next(w for w in tls_cluster.workers().values() if w.role == "prefill")
    calls = [(tls_cluster.registry_address,
              lambda ch: worker_pb2_grpc.RegistryStub(ch).Register(registration("rogue", "127.0.0.1:1"), timeout=10)),
             (prefill.address,
              lambda ch: kv_pb2_grpc.KVTransferStub(ch).GetNixlMetadata(kv_pb2.NixlMetadataRequest(), timeout=10))]
    ca_only = Tls(None, None, pki["cluster"]["ca_file"].read_bytes())  # no certificate at all
    for tls in (_rogue(pki), ca_only):
        for address, call in calls:
            with channel(address, TOKEN, tls) as ch:
                with pytest.raises(grpc.RpcError) as e:
                    call(ch)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (address, e.value)
    assert "rogue" not in tls_cluster.workers()
    with channel(prefill.address, TOKEN, tls_cluster.tls) as ch:  # the cluster's own certificate is let in
        assert kv_pb2_grpc.KVTransferStub(ch).GetNixlMetadata(kv_pb2.NixlMetadataRequest(), timeout=10).agent_metadata


class _RogueSource(kv_pb2_grpc.KVTransferServicer):
    """A KV source with another CA's certificate, offering NIXL metadata to whoever asks."""

    def __init__(self) -> None:
        self.asked = threading.Event()

    def GetNixlMetadata(self, request, context):
        self.asked.set()
        return kv_pb2.NixlMetadataResponse(agent_metadata=b"a pickle nobody may load")


def test_a_destination_never_takes_nixl_metadata_from_a_peer_of_another_ca(pki, tmp_path):
    rogue = _RogueSource()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    kv_pb2_grpc.add_KVTransferServicer_to_server(rogue, server)
    port = server.add_secure_port("127.0.0.1:0", _rogue(pki).server_credentials(client_auth=False))
    server.start()
    cluster = {field: str(path) for field, path in pki["cluster"].items()}
    # NIXL runs in its own process (its bundled protobuf must not meet grpc_tools' in pytest's).
    script = textwrap.dedent(f"""
        from kvtransfer.backends import make_connector
        from kvtransfer.connector import KVTransferError
        from kvtransfer.layout import layout_to_proto
        from proto.pdspec.v1 import kv_pb2
        from proto.tls import Tls
        from tests.test_kvtransfer import LAYOUT, random_caches
        tls = Tls.load({cluster['cert_file']!r}, {cluster['key_file']!r}, {cluster['ca_file']!r})
        connector = make_connector("nixl", LAYOUT, random_caches(LAYOUT, 4, 0), {TOKEN!r}, tls)
        handle = kv_pb2.KVHandle(request_id="r", source_address="127.0.0.1:{port}", layout=layout_to_proto(LAYOUT),
                                 block_ids=[1], nixl_agent="pdspec-kvsource-0", nixl_metadata_sha256=bytes(32))
        try:
            connector.pull(handle, [1], [2], timeout_s=10)
        except KVTransferError as e:
            print("refused:", e)
        connector.close()
    """)
    try:
        done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent, capture_output=True,
                              text=True, timeout=120)
    finally:
        server.stop(0)
    assert "refused:" in done.stdout and "GetNixlMetadata" in done.stdout, done.stdout + done.stderr
    assert not rogue.asked.is_set()  # the handshake failed first: the blob never left the rogue peer


def test_an_identity_follows_its_files_once_they_pair(tmp_path, monkeypatch):
    """A renewal seen halfway (the new certificate beside the old key) keeps the identity read
    before, and is read once, not on every call; once the files pair again they are the identity,
    the same one for every holder of an older one."""
    old, new = make_pki(tmp_path, "old"), make_pki(tmp_path, "new")
    tls = Tls.load(old["cert_file"], old["key_file"], old["ca_file"])
    other_holder = Tls.load(old["cert_file"], old["key_file"], old["ca_file"])
    assert tls.reloaded() is tls
    old["cert_file"].write_bytes(new["cert_file"].read_bytes())
    loads = []
    monkeypatch.setattr(Tls, "load", lambda *a, load=Tls.load, **k: loads.append(a) or load(*a, **k))
    assert tls.reloaded() is tls and tls.reloaded() is tls and len(loads) == 1
    with pytest.raises(ValueError, match="tls.cert_file, tls.key_file"):
        Tls.load(old["cert_file"], old["key_file"], old["ca_file"])
    old["key_file"].write_bytes(new["key_file"].read_bytes())
    renewed = tls.reloaded()
    assert (renewed.cert, renewed.key, renewed.ca) == (new["cert_file"].read_bytes(), new["key_file"].read_bytes(),
                                                      old["ca_file"].read_bytes())
    assert renewed.reloaded() is renewed and other_holder.reloaded() is renewed
    given = Tls(renewed.cert, renewed.key, renewed.ca)  # given as bytes: nothing to re-read
    assert given.reloaded() is given


def test_a_ca_file_cut_short_is_refused(tmp_path):
    files = make_pki(tmp_path, "cut")
    pem = files["ca_file"].read_bytes()
    files["ca_file"].write_bytes(pem[: len(pem) // 2])
    with pytest.raises(ValueError, match="tls.ca_file"):
        Tls.load(files["cert_file"], files["key_file"], files["ca_file"])


def test_kept_channels_are_opened_again_once_the_certificate_is_renewed(tmp_path):
    """The router's channels to workers, a decode worker's to its KV sources and a worker's to the
    router's registry each present the certificate they were opened with: after a renewal, new ones."""
    old, new = make_pki(tmp_path, "old"), make_pki(tmp_path, "new")
    tls = Tls.load(old["cert_file"], old["key_file"], old["ca_file"])
    peers = Peers(TOKEN, tls)
    connector = GrpcConnector(LAYOUT, random_caches(LAYOUT, 4, 0), TOKEN, tls)
    registry = RegistryClient("127.0.0.1:1", TOKEN, registration("w", "127.0.0.1:2"), loop=None, tls=tls)
    opened = {"router": lambda: peers.channel("127.0.0.1:1"),
              "connector": lambda: connector._use_channel("127.0.0.1:1").channel,
              "registry": lambda: (registry.stub, registry._channel)[1]}
    first = {name: open_one() for name, open_one in opened.items()}
    assert all(open_one() is first[name] for name, open_one in opened.items())
    for field, path in old.items():
        path.write_bytes(new[field].read_bytes())
    assert [name for name, open_one in opened.items() if open_one() is first[name]] == []
    connector.close()


def _presented_serial(address: str, identity: dict[str, Path]) -> int:
    """The serial number of the certificate a TLS port presents to a new connection, which must
    chain to identity's CA (the connection presents identity's own certificate: internal ports ask for one)."""
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(identity["ca_file"]))
    context.load_cert_chain(identity["cert_file"], identity["key_file"])
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname=host) as connection:
            return x509.load_der_x509_certificate(connection.getpeercert(binary_form=True)).serial_number


def test_a_renewed_certificate_reaches_every_port_and_the_cluster_answers_on(tls_cluster, pki, tmp_path, reference):
    """The files change in place, as a renewed Secret's do, here to a new CA's (the old one no
    longer trusted anywhere): every port presents the new certificate to new connections, without
    a restart, and the cluster answers through channels opened with it. Last in this module: the
    cluster keeps the new identity."""
    renewed = make_pki(tmp_path, "renewed")
    for field, path in pki["cluster"].items():
        path.write_bytes(renewed[field].read_bytes())
    serial = x509.load_pem_x509_certificate(renewed["cert_file"].read_bytes()).serial_number
    workers = tls_cluster.workers()  # the router's port, asked by a channel opened with the new files
    for address in [tls_cluster.router_address, tls_cluster.registry_address, *(w.address for w in workers.values())]:
        assert _presented_serial(address, renewed) == serial, address
    http = tls_cluster.http_url.removeprefix("https://").split("/")[0]
    deadline = time.monotonic() + 4 * TLS_CHECK_S
    while True:  # the HTTP API looks for new files every TLS_CHECK_S
        try:
            if _presented_serial(http, renewed) == serial:
                break
        except ssl.SSLError:  # still the old CA's certificate
            pass
        assert time.monotonic() < deadline, "the HTTP API still presents the old certificate"
        time.sleep(0.5)
    test_cluster._check_answers(tls_cluster, reference)
    assert set(tls_cluster.workers()) == set(workers)  # every worker still registered (its heartbeats go on)
