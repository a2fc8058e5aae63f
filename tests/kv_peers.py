"""The two processes of the kvtransfer tests: a KVSource serving caches of known random contents
behind a real gRPC server (127.0.0.1, cluster token), reporting over a pipe each pin it made and
each on_release that ran, and a destination pulling from it. The destination is a process of its
own because NIXL must never be loaded into the pytest process: it crashes any process that also
loads grpc_tools' protoc (test_proto does)."""

import multiprocessing as mp
import threading
import time

import torch

from engine.kv_layout import CacheShape, KVLayout
from kvtransfer.backends import make_connector
from kvtransfer.connector import Cancellation, KVTransferError
from kvtransfer.layout import block_checksums, layout_to_proto
from kvtransfer.source import SERVICE_NAME, KVSource, KVTransferServicer
from proto.pdspec.v1 import kv_pb2, kv_pb2_grpc
from proto.rpc import serve
from serving.call_limit import kv_pull_limit
from tests.nixl_faults import FAULTS, REFUSED_REMOVALS, late_writes

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
    """Faults on purpose, by request id: "corrupt*" flips a byte after the checksum was taken
    ("changed*", in _serve_source: a pinned block changes after the handle's checksums were taken);
    "stall*" reports that its first chunk went out, then sends no other, and its Release reports
    the seconds its caller gave it, then waits until the caller gives up; "slow*" takes 0.3 s
    before its first chunk; "lapsed*" ends its pin at Release but answers that it had lapsed
    already (found=False); "queued-release*" Releases report that they were sent, then wait 0.5 s
    (queued behind busy server threads) and unpin only if their caller still waits. Once
    "hang-metadata*" is pinned, GetNixlMetadata reports that it was asked, then waits until its
    caller gives up."""

    def __init__(self, source: KVSource, report):
        super().__init__(source, source.servicer.pulls)
        self.report = report
        self.hang_metadata = threading.Event()

    def GetNixlMetadata(self, request, context):
        if self.hang_metadata.is_set():
            self.report("metadata-asked", None)
            while context.is_active():
                time.sleep(0.05)
        return super().GetNixlMetadata(request, context)

    def chunk(self, request_id, pin_id, block_id, cache, context):
        if request_id.startswith("slow") and block_id == REMOTE[0] and cache == "target":
            time.sleep(0.3)
        chunk = super().chunk(request_id, pin_id, block_id, cache, context)
        if request_id.startswith("corrupt"):
            chunk.data = bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]
        if request_id.startswith("stall") and cache == "draft":  # the first block's target chunk was sent
            self.report("streaming", request_id)
            while context.is_active():  # until the puller gives up (or this process is killed)
                time.sleep(0.05)
        return chunk

    def Release(self, request, context):
        if request.request_id.startswith("queued-release"):
            self.report("release-sent", request.request_id)
            time.sleep(0.5)
            if not context.is_active():  # cancelled before a thread took it up: never handled
                return kv_pb2.ReleaseResponse()
        if request.request_id.startswith("stall"):
            self.report("release-timeout", context.time_remaining())
            while context.is_active():
                time.sleep(0.05)
        response = super().Release(request, context)
        if request.request_id.startswith("lapsed"):
            response.found = False
        return response


def _serve_source(conn, pin_timeout_s: float, nixl: bool, faulty: bool, max_pulls: int | None,
                  layout: KVLayout) -> None:
    torch.set_num_threads(1)
    lock = threading.Lock()

    def report(*message):
        with lock:
            try:
                conn.send(message)
            except OSError:  # the test process has stopped listening
                pass

    source = KVSource(layout, random_caches(layout, SOURCE_BLOCKS, SOURCE_SEED), pin_timeout_s, nixl, TOKEN,
                      kv_pull_limit(max_pulls).held if max_pulls is not None else None)
    servicer = FaultyServicer(source, report) if faulty else source.servicer
    server, port = serve([(kv_pb2_grpc.add_KVTransferServicer_to_server, servicer, SERVICE_NAME)], "127.0.0.1:0",
                         TOKEN, internal=[SERVICE_NAME])
    report("ready", (port, source.nixl.agent.name if source.nixl is not None else "",
                     source.nixl.metadata_sha256 if source.nixl is not None else b""))
    try:
        while True:
            request_id, block_ids = conn.recv()
            pin_id = source.pin(request_id, block_ids, on_release=lambda rid=request_id: report("released", rid))
            checksums = block_checksums(source.caches, list(layout.caches()), block_ids)  # as a prefill worker's handle
            if faulty and request_id.startswith("changed"):  # a pinned block changes after its checksum was taken
                source.caches["draft"][block_ids[-1]].view(-1)[-1] += 1
            if faulty and request_id.startswith("hang-metadata"):
                servicer.hang_metadata.set()
            report("pinned", (request_id, pin_id, checksums))
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
    def __init__(self, pin_timeout_s: float = 600.0, nixl: bool = True, faulty: bool = False,
                 max_pulls: int | None = None, layout: KVLayout = LAYOUT):
        super().__init__(_serve_source, pin_timeout_s, nixl, faulty, max_pulls, layout)
        self.layout = layout
        self.released: set[str] = set()
        port, self.nixl_agent, self.nixl_metadata_sha256 = self.expect("ready")
        self.address = f"127.0.0.1:{port}"

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
        pinned, pin_id, checksums = self.expect("pinned")
        assert pinned == request_id
        return kv_pb2.KVHandle(request_id=request_id, source_worker_id="prefill-test", source_address=self.address,
                               layout=layout_to_proto(self.layout), block_ids=block_ids, pin_id=pin_id,
                               nixl_agent=self.nixl_agent, nixl_metadata_sha256=self.nixl_metadata_sha256,
                               block_checksums=checksums)

    def wait_released(self, request_id: str) -> None:
        while request_id not in self.released:
            self.released.add(self.expect("released"))


def _serve_destination(conn) -> None:
    """Pull on command into caches of known contents, one set per layout; report the outcome."""
    torch.set_num_threads(1)
    caches: dict[KVLayout, dict[str, torch.Tensor]] = {}
    connectors = {}
    pullers: list[threading.Thread] = []

    def local(layout: KVLayout) -> dict[str, torch.Tensor]:
        return caches.setdefault(layout, random_caches(layout, LOCAL_BLOCKS, LOCAL_SEED))

    def connector_for(backend: str, layout: KVLayout, token: str):
        key = (backend, layout, token)
        if key not in connectors:
            connectors[key] = make_connector(backend, layout, local(layout), token)
        return connectors[key]

    def pull_one(connector, handle: bytes, remote: list[int], local_ids: list[int], fault: str | None) -> None:
        try:
            with FAULTS[fault]():
                connector.pull(kv_pb2.KVHandle.FromString(handle), remote, local_ids, TIMEOUT_S, cancel)
            conn.send(None)
        except KVTransferError as e:
            conn.send((str(e), e.retryable, e.may_still_write))

    try:
        while True:
            command, *args = conn.recv()
            if command == "pull":  # in a thread: "cancel" and "close" may come while it runs
                backend, layout, token, handle, remote, local_ids, fault = args
                cancel = Cancellation()
                puller = connector_for(backend, layout, token)
                pullers.append(threading.Thread(target=pull_one, args=(puller, handle, remote, local_ids, fault)))
                pullers[-1].start()
            elif command == "cancel":  # the last started pull's
                cancel.set()
            elif command == "close":  # every connector; the running pull's outcome comes first
                for connector in connectors.values():
                    connector.close()
                registered = [bool(c._memory._registered) for c in connectors.values() if hasattr(c, "_memory")]
                connectors.clear()
                for puller in pullers:  # their outcomes sent first
                    puller.join()
                pullers.clear()
                conn.send(("closed", registered))
            elif command == "pulls":  # at once, from threads: [(handle, remote, local)] -> errors or None
                backend, layout, token, pulls = args
                puller = connector_for(backend, layout, token)
                errors = [None] * len(pulls)

                def pull(i: int, handle: bytes, remote: list[int], local_ids: list[int]) -> None:
                    try:
                        puller.pull(kv_pb2.KVHandle.FromString(handle), remote, local_ids, TIMEOUT_S)
                    except KVTransferError as e:
                        errors[i] = str(e)
                threads = [threading.Thread(target=pull, args=(i, *p)) for i, p in enumerate(pulls)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                conn.send(errors)
            elif command == "late-writes":
                conn.send(late_writes(connector_for(*args[:3]), local(args[1]), *args[3:], TIMEOUT_S))
            elif command == "refused-removals":
                conn.send(len(REFUSED_REMOVALS))
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
                   fault: str | None = None) -> None:
        """`fault` (NIXL): "unstoppable" READs fail and cannot be cancelled, "stuck" ones never end,
        under "refused-removal" no agent is dropped (`refused_removals` counts the requests)."""
        self._conn.send(("pull", backend, layout, token, handle.SerializeToString(), remote, local, fault))

    def late_writes(self, handle: kv_pb2.KVHandle, layout: KVLayout) -> tuple[KVTransferError | None, str, bool]:
        """A NIXL pull cancelled as soon as its READ is posted: its error, the READ's state as posted,
        and whether the local blocks changed after the pull ended."""
        self._conn.send(("late-writes", "nixl", layout, TOKEN, handle.SerializeToString(), REMOTE, LOCAL))
        outcome, posted, changed = self._recv()
        return (KVTransferError(*outcome) if outcome else None), posted, changed

    def refused_removals(self) -> int:
        self._conn.send(("refused-removals",))
        return self._recv()

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

    def pull_together(self, backend: str, pulls: list[tuple[kv_pb2.KVHandle, list[int], list[int]]]) -> list:
        """Every pull at once, each from a thread of its own: their errors (None: it succeeded)."""
        self._conn.send(("pulls", backend, LAYOUT, TOKEN, [(h.SerializeToString(), r, l) for h, r, l in pulls]))
        return self._recv()

    def caches(self, layout: KVLayout = LAYOUT) -> dict[str, torch.Tensor]:
        self._conn.send(("caches", layout))
        return {name: torch.from_numpy(raw) for name, raw in self._recv().items()}

    def reset(self) -> None:
        self._conn.send(("reset",))
        self._recv()

    def cancel(self) -> None:
        """Cancel the started pull (its outcome: `result`)."""
        self._conn.send(("cancel",))

    def close(self) -> None:
        """Close the connectors (running pulls cancelled): the started pull's `result` comes first,
        then `wait_closed`."""
        self._conn.send(("close",))

    def wait_closed(self) -> list[bool]:
        """Whether each closed NIXL connector left its memory registered."""
        closed, registered = self._recv()
        assert closed == "closed"
        return registered


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
