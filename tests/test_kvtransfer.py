"""kvtransfer end to end: a KVSource process serving, a destination process pulling.

The source process holds caches of known random contents behind a real gRPC server (127.0.0.1,
cluster token) and reports over a pipe each pin it made and each on_release that ran. The
destination pulls in a process of its own too, because NIXL must never be loaded into the
pytest process: it crashes any process that also loads grpc_tools' protoc (test_proto does).
"""

import contextlib
import dataclasses
import multiprocessing as mp
import subprocess
import sys
import threading
from unittest import mock

import pytest
import torch

from engine.kv_layout import CacheShape, KVLayout
from kvtransfer.backends import make_connector
from kvtransfer.connector import KVTransferError
from kvtransfer.layout import layout_from_proto, layout_to_proto
from kvtransfer.source import SERVICE_NAME, KVSource, KVTransferServicer
from proto.pdspec.v1 import kv_pb2, kv_pb2_grpc
from proto.rpc import serve

TOKEN = "test-cluster-token"
LAYOUT = KVLayout("test-model", "bfloat16", 4, CacheShape(2, 2, 8), CacheShape(1, 2, 8), "test-head@1")
SOURCE_BLOCKS, SOURCE_SEED, LOCAL_BLOCKS, LOCAL_SEED = 16, 1, 10, 2
PIN = [9, 2, 14, 5, 11]  # the source's block table of the prompt
REMOTE, LOCAL = [14, 2, 11], [7, 0, 4]  # the blocks the destination lacks, and the local blocks it gave them
BACKENDS = ["grpc", "nixl"]
TIMEOUT_S = 30.0
WAIT_S = 120.0  # how long to wait for a helper process: only reached when something is broken


def random_caches(layout: KVLayout, num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn((num_blocks, *layout.block_shape(shape)), generator=g).to(getattr(torch, layout.dtype))
            for name, shape in layout.caches().items()}


class FaultyServicer(KVTransferServicer):
    """Faults on purpose, by request id: "corrupt*" flips a byte after the checksum was taken;
    "stall*" reports that its first chunk went out, then never sends the next."""

    def __init__(self, source: KVSource, report):
        super().__init__(source)
        self.report = report

    def chunk(self, request_id, block_id, cache, context):
        chunk = super().chunk(request_id, block_id, cache, context)
        if request_id.startswith("corrupt"):
            chunk.data = bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]
        if request_id.startswith("stall") and cache == "draft":  # the first block's target chunk was sent
            self.report("streaming", request_id)
            threading.Event().wait()
        return chunk


def _serve_source(conn, pin_timeout_s: float, nixl: bool, faulty: bool) -> None:
    torch.set_num_threads(1)
    lock = threading.Lock()

    def report(*message):
        with lock:
            try:
                conn.send(message)
            except OSError:  # the test process has stopped listening
                pass

    source = KVSource(LAYOUT, random_caches(LAYOUT, SOURCE_BLOCKS, SOURCE_SEED), pin_timeout_s, nixl, TOKEN)
    servicer = FaultyServicer(source, report) if faulty else source.servicer
    server, port = serve([(kv_pb2_grpc.add_KVTransferServicer_to_server, servicer, SERVICE_NAME)], "127.0.0.1:0",
                         TOKEN, internal=[SERVICE_NAME])
    report("ready", port)
    try:
        while True:
            request_id, block_ids = conn.recv()
            source.pin(request_id, block_ids, on_release=lambda rid=request_id: report("released", rid))
            report("pinned", request_id)
    except (EOFError, OSError):  # the test is done with this source
        server.stop(None).wait()
        source.close()


class _Child:
    """A spawned helper process, driven over a pipe."""

    def __init__(self, target, *args):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()
        child.close()

    def _recv(self):
        assert self._conn.poll(WAIT_S), f"{type(self).__name__} did not answer"
        return self._conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join()

    def stop(self) -> None:
        self._conn.close()  # the child sees EOF and shuts down cleanly
        self.process.join(WAIT_S)
        if self.process.is_alive():
            self.kill()


class SourceProcess(_Child):
    def __init__(self, pin_timeout_s: float = 600.0, nixl: bool = True, faulty: bool = False):
        super().__init__(_serve_source, pin_timeout_s, nixl, faulty)
        self.released: set[str] = set()
        self.address = f"127.0.0.1:{self.expect('ready')}"

    def expect(self, kind: str):
        """The value of the source's next `kind` message; "released" ones are collected meanwhile."""
        while True:
            got, value = self._recv()
            if got == kind:
                return value
            assert got == "released", (got, value)
            self.released.add(value)

    def pin(self, request_id: str, block_ids: list[int] = PIN) -> kv_pb2.KVHandle:
        self._conn.send((request_id, block_ids))
        assert self.expect("pinned") == request_id
        return kv_pb2.KVHandle(request_id=request_id, source_worker_id="prefill-test", source_address=self.address,
                               layout=layout_to_proto(LAYOUT), block_ids=block_ids)

    def wait_released(self, request_id: str) -> None:
        while request_id not in self.released:
            self.released.add(self.expect("released"))


@contextlib.contextmanager
def _unstoppable_reads():
    """Faults on purpose: NIXL starts each READ, then reports an error and refuses to cancel it.
    Afterwards the READs are really released."""
    from nixl_cu12._api import nixl_agent, nixl_xfer_handle
    from kvtransfer.nixl_backend import nixl_bindings
    started, transfer, release = [], nixl_agent.transfer, nixl_xfer_handle.release

    def failing_transfer(agent, xfer, *args, **kwargs):
        transfer(agent, xfer, *args, **kwargs)
        started.append(xfer)
        raise nixl_bindings.nixlBackendError("injected: the READ stalled")

    def refusing_release(xfer):
        raise nixl_bindings.nixlBackendError("injected: it cannot be cancelled")

    with mock.patch.object(nixl_agent, "transfer", failing_transfer), \
            mock.patch.object(nixl_xfer_handle, "release", refusing_release):
        yield
    for xfer in started:
        release(xfer)


def _serve_destination(conn) -> None:
    """Pull on command into caches of known contents, one set per layout; report the outcome."""
    torch.set_num_threads(1)
    caches: dict[KVLayout, dict[str, torch.Tensor]] = {}
    connectors = {}

    def local(layout: KVLayout) -> dict[str, torch.Tensor]:
        return caches.setdefault(layout, random_caches(layout, LOCAL_BLOCKS, LOCAL_SEED))

    try:
        while True:
            command, *args = conn.recv()
            if command == "pull":
                backend, layout, token, handle, remote, local_ids, unstoppable = args
                key = (backend, layout, token)
                if key not in connectors:
                    connectors[key] = make_connector(backend, layout, local(layout), token)
                try:
                    with _unstoppable_reads() if unstoppable else contextlib.nullcontext():
                        connectors[key].pull(kv_pb2.KVHandle.FromString(handle), remote, local_ids, TIMEOUT_S)
                    conn.send(None)
                except KVTransferError as e:
                    conn.send((str(e), e.retryable, e.may_still_write))
            elif command == "caches":
                conn.send({name: t.view(torch.uint8).numpy().copy() for name, t in local(args[0]).items()})
            elif command == "reset":  # in place: the NIXL connectors registered these tensors
                for layout, tensors in caches.items():
                    for name, initial in random_caches(layout, LOCAL_BLOCKS, LOCAL_SEED).items():
                        tensors[name].copy_(initial)
                conn.send(None)
    except (EOFError, OSError):  # the test is done with this destination
        for connector in connectors.values():
            connector.close()


class DestinationProcess(_Child):
    def __init__(self):
        super().__init__(_serve_destination)

    def start_pull(self, backend: str, handle: kv_pb2.KVHandle, remote: list[int] = REMOTE,
                   local: list[int] = LOCAL, layout: KVLayout = LAYOUT, token: str = TOKEN,
                   unstoppable: bool = False) -> None:
        self._conn.send(("pull", backend, layout, token, handle.SerializeToString(), remote, local, unstoppable))

    def result(self) -> KVTransferError | None:
        """How the started pull ended: None when it succeeded."""
        outcome = self._recv()
        return KVTransferError(*outcome) if outcome else None

    def pull(self, *args, **kwargs) -> KVTransferError | None:
        self.start_pull(*args, **kwargs)
        return self.result()

    def pull_error(self, *args, **kwargs) -> KVTransferError:
        error = self.pull(*args, **kwargs)
        assert error is not None, "the pull succeeded"
        return error

    def caches(self, layout: KVLayout = LAYOUT) -> dict[str, torch.Tensor]:
        self._conn.send(("caches", layout))
        return {name: torch.from_numpy(raw) for name, raw in self._recv().items()}

    def reset(self) -> None:
        self._conn.send(("reset",))
        self._recv()


def assert_local(dest: DestinationProcess, pulled: dict[int, int], undefined: list[int] = (),
                 layout: KVLayout = LAYOUT) -> None:
    """The destination's blocks hold their initial bytes, except `pulled` (local id -> source id),
    which hold the source's, and `undefined` ones (given to a failed pull), which are not checked."""
    caches = dest.caches(layout)
    expected = random_caches(layout, LOCAL_BLOCKS, LOCAL_SEED)
    source = random_caches(layout, SOURCE_BLOCKS, SOURCE_SEED)
    for name, want in expected.items():
        want = want.view(torch.uint8)
        for local_id, source_id in pulled.items():
            want[local_id] = source[name][source_id].view(torch.uint8)
        for b in undefined:
            want[b] = caches[name][b]
        assert torch.equal(caches[name], want), name


@pytest.fixture(scope="module")
def source():
    process = SourceProcess()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def short_pin_source():
    process = SourceProcess(pin_timeout_s=0.2)
    yield process
    process.stop()


@pytest.fixture
def doomed_source():
    """A source with test-only faults, for one test that may kill it."""
    process = SourceProcess(faulty=True)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def destination_process():
    process = DestinationProcess()
    yield process
    process.stop()


@pytest.fixture
def dest(destination_process) -> DestinationProcess:
    """The destination, its caches at their initial contents."""
    destination_process.reset()
    return destination_process


def test_importing_kvtransfer_leaves_nixl_unloaded():
    code = ("import sys, kvtransfer.source, kvtransfer.connector, kvtransfer.grpc_backend; "
            "assert 'nixl_cu12' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("draft", [CacheShape(1, 2, 8), None])
def test_layout_proto_round_trip(draft):
    layout = dataclasses.replace(LAYOUT, draft=draft)
    assert layout_from_proto(layout_to_proto(layout)) == layout


def test_on_release_runs_once_on_release_or_close():
    calls = []
    source = KVSource(LAYOUT, random_caches(LAYOUT, 4, 0), pin_timeout_s=3600, nixl=False)
    source.pin("a", [0, 1], lambda: calls.append("a"))
    with pytest.raises(ValueError, match="already pinned"):
        source.pin("a", [2], lambda: calls.append("a again"))
    assert source.release("a") and not source.release("a")
    source.pin("b", [2], lambda: calls.append("b"))
    source.close()
    assert not source.release("b")
    assert calls == ["a", "b"]


def test_pin_timeout_runs_on_release_once():
    calls, ended = [], threading.Event()
    source = KVSource(LAYOUT, random_caches(LAYOUT, 4, 0), pin_timeout_s=0.05, nixl=False)
    source.pin("a", [0], lambda: (calls.append("a"), ended.set()))
    assert ended.wait(WAIT_S)
    assert not source.release("a")
    source.close()
    assert calls == ["a"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_pull_copies_exactly_the_requested_blocks(backend, source, dest):
    handle = source.pin(f"pull-{backend}")
    assert dest.pull(backend, handle) is None
    assert_local(dest, dict(zip(LOCAL, REMOTE)))
    source.wait_released(handle.request_id)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pull_of_no_blocks_still_releases(backend, source, dest):
    handle = source.pin(f"cached-{backend}")
    assert dest.pull(backend, handle, [], []) is None
    assert_local(dest, {})
    source.wait_released(handle.request_id)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_token_is_unauthenticated(backend, source, dest):
    error = dest.pull_error(backend, source.pin(f"token-{backend}"), token="wrong-token")
    assert "UNAUTHENTICATED" in str(error) and not error.retryable
    assert_local(dest, {})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("field, value", [("block_size", 8), ("dtype", "float32"), ("dtype", "int8"),
                                          ("draft_model", "other-head@2")])
def test_layout_mismatch_names_the_field_and_moves_nothing(backend, source, dest, field, value):
    """A KV cache dtype (engine.kv_cache_dtype), block size or EAGLE3 head differing between the
    sides: refused, naming the field and both values."""
    other = dataclasses.replace(LAYOUT, **{field: value})
    honest = source.pin(f"layout-{backend}-{field}")  # caught here, from the handle
    forged = source.pin(f"forged-layout-{backend}-{field}")  # the handle claims our layout: the source must catch it
    forged.layout.CopyFrom(layout_to_proto(other))
    for handle in (honest, forged):
        error = dest.pull_error(backend, handle, layout=other)
        assert f"'{field}'" in str(error) and str(value) in str(error) and str(getattr(LAYOUT, field)) in str(error)
        assert not error.retryable
        source.wait_released(handle.request_id)
    assert_local(dest, {}, layout=other)


def test_source_refuses_blocks_outside_the_pin(source, dest):
    handle = source.pin("foreign-blocks")
    handle.block_ids.append(3)  # not pinned for this request
    error = dest.pull_error("grpc", handle, [3], [0])
    assert "PERMISSION_DENIED" in str(error) and not error.retryable
    assert_local(dest, {})


@pytest.mark.parametrize("backend,reason", [("grpc", "NOT_FOUND"), ("nixl", "no longer pinned")])
def test_pin_timeout_releases_and_later_pull_fails(backend, reason, short_pin_source, dest):
    handle = short_pin_source.pin(f"expired-{backend}")
    short_pin_source.wait_released(handle.request_id)  # the reaper ran on_release
    error = dest.pull_error(backend, handle)
    assert reason in str(error) and error.retryable
    assert_local(dest, {}, undefined=LOCAL)


def test_corrupted_chunk_fails_its_checksum(doomed_source, dest):
    error = dest.pull_error("grpc", doomed_source.pin("corrupt"))
    assert "checksum" in str(error) and error.retryable
    assert_local(dest, {}, undefined=LOCAL)


def test_source_killed_mid_stream_is_retryable(doomed_source, dest):
    dest.start_pull("grpc", doomed_source.pin("stall"))
    doomed_source.expect("streaming")
    doomed_source.kill()
    error = dest.result()
    assert error is not None and error.retryable
    assert_local(dest, {}, undefined=LOCAL)


def test_source_killed_before_nixl_read_is_retryable(doomed_source, dest):
    # After this pull the destination holds the source's NIXL metadata: the next READ goes straight to it.
    assert dest.pull("nixl", doomed_source.pin("warm")) is None
    handle = doomed_source.pin("doomed")
    doomed_source.kill()
    error = dest.pull_error("nixl", handle, [9, 5], [1, 3])
    assert error.retryable and not error.may_still_write
    assert_local(dest, dict(zip(LOCAL, REMOTE)), undefined=[1, 3])


def test_a_nixl_read_that_cannot_be_cancelled_says_its_blocks_may_still_be_written(source, dest):
    """Its caller must then never reuse the local blocks (the decode worker retires them)."""
    handle = source.pin("unstoppable")
    error = dest.pull_error("nixl", handle, unstoppable=True)
    assert error.may_still_write and error.retryable, error
    assert "could not be cancelled" in str(error) and "injected: the READ stalled" in str(error)
    source.wait_released(handle.request_id)  # the pin still went back


def test_nixl_needs_a_cluster_token():
    code = ("import torch; from kvtransfer.source import KVSource; from tests.test_kvtransfer import LAYOUT, random_caches\n"
            "try:\n    KVSource(LAYOUT, random_caches(LAYOUT, 4, 0), pin_timeout_s=60, nixl=True)\n"
            "except ValueError as e:\n    assert 'cluster token' in str(e), e\nelse:\n    raise SystemExit('started')")
    subprocess.run([sys.executable, "-c", code], check=True)
