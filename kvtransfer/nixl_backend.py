"""KV transfer by NIXL: the destination READs the pinned blocks straight out of the source's
registered cache memory (UCX picks the path: CMA on one host, RDMA or TCP across hosts).

The source's agent metadata is a pickle, so it is only ever taken from the token-checked
GetNixlMetadata RPC, never from a NIXL listener or a metadata server; so NIXL needs a cluster
token (without one, anyone could send a decode worker a handle naming their own "source"). The
token is a bearer secret: only TLS (mutual, `tls` in the config) proves who answers at a source's
address before it is sent. So the handle, which comes from the router, carries the SHA-256 of
the source's whole GetNixlMetadata answer (agent metadata, registered regions, layout), and a
destination uses only an answer that hashes to it: whatever answers at the address without TLS
(a pod that took over a gone worker's address) can hand it neither a pickle nor READ addresses
of its own. A READ is one-sided: the source cannot refuse blocks outside a pin, so
the token is the trust boundary, and only the final Release (found=True) proves the blocks were
still pinned, unchanged, while we read them.
"""

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import torch
from nixl_cu12 import _bindings as nixl_bindings
from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_xfer_handle

from engine.kv_layout import KVLayout
from kvtransfer.connector import (SOURCE_IDLE_S, BaseConnector, Cancellation, KVTransferError, check_layout, idle,
                                  remaining, rpc_failure)
from kvtransfer.layout import layout_to_proto
from proto.pdspec.v1 import kv_pb2, kv_pb2_grpc
from proto.tls import Tls

log = logging.getLogger(__name__)

POLL_S = 0.0005  # between transfer state checks: sleeps, so a long READ costs no CPU here
# UCX cannot cancel a READ under way (it cancels receives, not RMA gets): a release only detaches
# it, and it goes on writing into the local blocks. A READ a pull leaves running (cancelled, timed
# out) is waited for this long before its blocks are given up for good.
READ_DRAIN_S = 2.0
LOCK_POLL_S = 0.05  # between checks of a pull's cancel while another pull fetches its source's metadata
PROGRESS_POLL_US = 10_000  # NIXL progress thread poll timeout; UCX events wake it sooner
# The bindings raise one exception class per NIXL status, with no common base but Exception.
NIXL_ERRORS = tuple(v for k, v in vars(nixl_bindings).items()
                    if k.startswith("nixl") and isinstance(v, type) and issubclass(v, Exception))


def new_agent(role: str) -> nixl_agent:
    """A UCX NIXL agent, safe to use from several threads, whose progress thread sleeps when idle.

    nixl_agent() gives the progress thread a zero poll timeout, so it spins a whole core even with
    nothing to do; we build it without backends and swap in a native agent with a sleeping
    progress thread before UCX is created."""
    name = f"pdspec-{role}-{uuid.uuid4().hex[:12]}"
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    config = nixl_bindings.nixlAgentConfig()
    config.useProgThread = True  # answers the peer's connection setup; our READs progress in check_xfer_state
    config.pthrDelay = PROGRESS_POLL_US
    config.syncMode = nixl_bindings.NIXL_THREAD_SYNC_STRICT
    agent.agent = nixl_bindings.nixlAgent(name, config)
    agent.create_backend("UCX")
    return agent


def _region(cache: str, tensor: torch.Tensor, block_bytes: int) -> kv_pb2.NixlRegion:
    return kv_pb2.NixlRegion(cache=cache, base_address=tensor.data_ptr(), length=tensor.numel() * tensor.element_size(),
                             block_bytes=block_bytes, device_id=max(tensor.get_device(), 0),
                             memory_type="VRAM" if tensor.is_cuda else "DRAM")


def metadata_sha256(meta: kv_pb2.NixlMetadataResponse) -> bytes:
    """What KVHandle.nixl_metadata_sha256 vouches for: the whole answer, serialized the same way on
    both sides (deterministic: map fields in key order)."""
    return hashlib.sha256(meta.SerializeToString(deterministic=True)).digest()


def block_descs(region: kv_pb2.NixlRegion, block_ids: list[int]) -> np.ndarray:
    """NIXL transfer descriptors (address, length, device) of the blocks, in order."""
    descs = np.empty((len(block_ids), 3), dtype=np.uint64)
    descs[:, 0] = region.base_address + np.asarray(block_ids, dtype=np.uint64) * region.block_bytes
    descs[:, 1] = region.block_bytes
    descs[:, 2] = region.device_id
    return descs


class NixlMemory:
    """A NIXL agent with a worker's KV cache tensors registered, once, for the agent's lifetime."""

    def __init__(self, role: str, layout: KVLayout, caches: dict[str, torch.Tensor], token: str | None):
        if not token:
            raise ValueError("kv_transfer nixl needs a cluster token (cluster_token or $PDSPEC_CLUSTER_TOKEN): "
                             "NIXL's agent metadata is a pickle, exchanged only between peers holding it")
        self.layout = layout
        self.agent = new_agent(role)
        self.regions = {name: _region(name, caches[name], layout.block_bytes(shape))
                        for name, shape in layout.caches().items()}
        self._registered = [self.agent.register_memory([(r.base_address, r.length, r.device_id, "")], r.memory_type)
                            for r in self.regions.values()]
        # Taken once, with every region registered (the agent's metadata does not change as peers
        # read), so that the answer served is the one the handles' digest vouches for.
        self._metadata = kv_pb2.NixlMetadataResponse(
            agent_name=self.agent.name, agent_metadata=self.agent.get_agent_metadata(),
            regions=list(self.regions.values()), layout=layout_to_proto(self.layout))
        self.metadata_sha256 = metadata_sha256(self._metadata)

    def metadata(self) -> kv_pb2.NixlMetadataResponse:
        return self._metadata

    def close(self) -> None:
        for registered in self._registered:
            self.agent.deregister_memory(registered)
        self._registered.clear()


@dataclass
class _Source:
    """A source's NIXL agent as loaded here, and the pulls reading through it now. NIXL knows a
    remote agent by its name alone, so one name is loaded once: a forgotten agent (a READ from it
    failed) is removed only when its last pull has ended (removal under a READ in flight may free
    that READ's request), and taken up again meanwhile if its source still answers with it; one
    with a READ that could not be cancelled is never removed (that READ may still run)."""
    name: str
    address: str  # where its metadata came from last
    nixl_name: str | bytes  # as NIXL's add_remote_agent returned it, for its calls
    sha256: bytes  # of the metadata it was loaded from
    regions: dict[str, kv_pb2.NixlRegion]
    users: int = 0
    forgotten: bool = False
    last_used: float = 0.0
    uncancelled_read: bool = False
    removal_refused: bool = False  # NIXL refused to drop it: left loaded, asked again once idle anew


class NixlConnector(BaseConnector):
    def __init__(self, layout: KVLayout, caches: dict[str, torch.Tensor], token: str | None, tls: Tls | None = None):
        super().__init__(layout, caches, token, tls)
        self._memory = NixlMemory("kvdest", layout, caches, token)
        self._sources: dict[str, _Source] = {}  # by address: metadata is fetched once per source agent
        self._agents: dict[str, _Source] = {}  # every agent loaded in NIXL, by name, forgotten ones too
        self._lock = threading.Lock()  # the maps and the sources' counts
        # One lock per source address, held while its agent is fetched, loaded or dropped: concurrent
        # first pulls from a source load it once, and a slow source holds up no other's pulls.
        self._address_locks: dict[str, threading.Lock] = {}

    def close(self) -> None:
        drained = self._stop_pulls()
        self._close_channels()
        with self._lock:  # a READ that could not be cancelled may still write, its pull long ended
            uncancelled = [s.name for s in self._agents.values() if s.uncancelled_read]
        if drained and not uncancelled:
            self._memory.close()
        else:  # the process is ending: better its registration outlive it than a READ write freed memory
            log.error("NIXL memory left registered: %s", "KV pulls still run" if not drained else
                      f"READs from {', '.join(uncancelled)} could not be cancelled")

    def _move(self, stub: kv_pb2_grpc.KVTransferStub, handle: kv_pb2.KVHandle, remote_block_ids: list[int],
              local_block_ids: list[int], deadline: float, cancel: Cancellation) -> None:
        address = handle.source_address
        self._forget_idle()
        source = self._use(stub, handle, deadline, cancel)
        forget = False
        try:
            self._read(source, handle, remote_block_ids, local_block_ids, deadline, cancel)
        except KVTransferError as e:
            # A restarted source has a new agent: fetch its metadata again next time (not for a pull
            # cancelled here, which says nothing of the source).
            forget = e.retryable and not cancel.is_set()
            source.uncancelled_read |= e.may_still_write
            raise
        finally:
            with self._lock:  # not under the address's lock: another pull may hold it, fetching metadata
                source.users -= 1
                source.last_used = time.monotonic()
                source.forgotten |= forget
            if source.forgotten:
                self._forget_unless_busy(address, source)

    # Locks: an address's lock, then self._lock, never the other way round. An agent is loaded and
    # removed under its address's lock (NIXL knows it by name: never both at once).
    def _address_lock(self, address: str) -> threading.Lock:
        with self._lock:
            return self._address_locks.setdefault(address, threading.Lock())

    def _use(self, stub: kv_pb2_grpc.KVTransferStub, handle: kv_pb2.KVHandle, deadline: float,
             cancel: Cancellation) -> _Source:
        """The source's agent, loaded if new or if the handle names another (restarted at the
        address); counted as in use until the pull ends."""
        address, agent_name = handle.source_address, handle.nixl_agent
        lock = self._address_lock(address)
        # Another pull may hold the lock while it fetches the source's metadata: wait for it only
        # until this pull's deadline or cancel (a stalled source held every pull from it that long).
        while not lock.acquire(timeout=min(LOCK_POLL_S, remaining(deadline))):
            if cancel.is_set() or not remaining(deadline):
                raise KVTransferError(f"pull of {handle.request_id} {'cancelled' if cancel.is_set() else 'timed out'} "
                                      f"while another pull fetched the NIXL metadata of {address}", retryable=True)
        try:
            with self._lock:
                source = self._sources.get(address)
                if (source is not None and not source.forgotten and source.name == agent_name
                        and source.sha256 == handle.nixl_metadata_sha256):
                    source.users += 1
                    return source
            return self._connect(stub, handle, deadline, cancel)
        finally:
            lock.release()

    def _connect(self, stub: kv_pb2_grpc.KVTransferStub, handle: kv_pb2.KVHandle, deadline: float,
                 cancel: Cancellation) -> _Source:
        """Under the address's lock: the source's current agent (loaded unless NIXL holds it
        still, and only from metadata the handle vouches for), made the address's and counted as
        in use; an earlier agent of the address is forgotten. A handle of an agent the source no
        longer runs changes nothing."""
        address, agent_name = handle.source_address, handle.nixl_agent
        if not agent_name or len(handle.nixl_metadata_sha256) != hashlib.sha256().digest_size:
            raise KVTransferError(f"the handle from {handle.source_worker_id} names no NIXL agent and digest of its "
                                  "metadata (a prefill worker without NIXL, or of an older pdspec): its blocks are not "
                                  "read over NIXL; run prefill and decode workers of one version with kv_transfer nixl",
                                  retryable=True)
        call = stub.GetNixlMetadata.future(kv_pb2.NixlMetadataRequest(), timeout=remaining(deadline))
        cancel.on_set(call.cancel)
        try:
            meta = call.result()
        except grpc.FutureCancelledError:
            raise KVTransferError(f"pull of {handle.request_id} cancelled while it fetched the NIXL metadata of "
                                  f"{address}", retryable=True) from None
        except grpc.RpcError as e:
            raise rpc_failure(e, "GetNixlMetadata", address) from None
        if meta.agent_name != agent_name:  # its pins went with the process that made them
            raise KVTransferError(f"{address} restarted after prefilling (NIXL agent {meta.agent_name}, the "
                                  f"handle's {agent_name}): prefill again", retryable=True)
        sha256 = metadata_sha256(meta)
        if sha256 != handle.nixl_metadata_sha256:
            raise KVTransferError(f"{address} served NIXL metadata whose SHA-256 is not the one "
                                  f"{handle.source_worker_id} put in the handle: not loaded (it is a pickle); whoever "
                                  "answers there is not the worker that prefilled", retryable=True)
        check_layout(self.layout, meta.layout, address)
        regions = {r.cache: r for r in meta.regions}
        for name, block_bytes in self.block_bytes.items():
            if name not in regions or regions[name].block_bytes != block_bytes:
                raise KVTransferError(f"{address} registered no {name} cache of {block_bytes}-byte blocks with NIXL",
                                      retryable=False)
        with self._lock:
            source = self._agents.get(meta.agent_name)
        if source is None:
            try:
                source = _Source(meta.agent_name, address, self._memory.agent.add_remote_agent(meta.agent_metadata),
                                 sha256, regions)
            except NIXL_ERRORS as e:
                raise KVTransferError(f"NIXL could not load the agent of {address}: {e}", retryable=True) from None
        with self._lock:
            # a forgotten one still loaded: taken up again
            source.forgotten, source.removal_refused, source.regions, source.address = False, False, regions, address
            self._agents[source.name] = source
            old = self._sources.get(address)
            if old is not None and old is not source:  # the address's earlier agent (its source restarted)
                self._forget(address, old)
            self._sources[address] = source
            source.users += 1
            return source

    def _forget(self, address: str, source: _Source) -> None:
        """Under the address's lock and self._lock: no new pull uses `source`; NIXL drops it once
        none does (kept loaded if NIXL refuses, to be taken up again)."""
        if self._sources.get(address) is source:
            del self._sources[address]
        source.forgotten = True
        if source.users == 0 and self._agents.get(source.name) is source and not source.uncancelled_read:
            try:
                self._memory.agent.remove_remote_agent(source.nixl_name)
                del self._agents[source.name]
            except NIXL_ERRORS as e:
                source.removal_refused, source.last_used = True, time.monotonic()
                log.warning("NIXL could not drop the agent of %s (left loaded, asked again in %.0f s): %s",
                            address, SOURCE_IDLE_S, e)

    def _forget_unless_busy(self, address: str, source: _Source, still: Callable[[], bool] = lambda: True) -> None:
        """_forget (if `still()`, asked under the locks), unless another pull holds the address's
        lock (fetching metadata, which may take until its deadline: a pull's end must not wait that
        long; or it takes the source up, or replaces it): `source` stays marked forgotten then,
        unused by new pulls, and _forget_idle drops it later."""
        lock = self._address_lock(address)
        if not lock.acquire(blocking=False):
            return
        try:
            with self._lock:
                if still():
                    self._forget(address, source)
        finally:
            lock.release()

    def _forget_idle(self) -> None:
        """Sources no pull used for a while (`idle`: gone, or no longer routed here), and forgotten
        agents no pull uses now, checked as pulls start: their agents and UCX endpoints would
        otherwise stay loaded for good."""
        now = time.monotonic()
        with self._lock:
            unused = [s for s in self._sources.values() if idle(s, now)]
            unused += [s for s in self._agents.values() if s.forgotten and not s.users and not s.uncancelled_read
                       and (not s.removal_refused or idle(s, now))]
        for source in unused:
            self._forget_unless_busy(source.address, source,
                                     lambda s=source: not s.users and (s.forgotten or idle(s, now)))

    def _read(self, source: _Source, handle: kv_pb2.KVHandle, remote_block_ids: list[int],
              local_block_ids: list[int], deadline: float, cancel: Cancellation) -> None:
        what = f"NIXL READ of {handle.request_id} from {handle.source_address}"
        for region in source.regions.values():
            if max(remote_block_ids) >= region.length // region.block_bytes:
                raise KVTransferError(f"{what}: block {max(remote_block_ids)} is outside the source's registered "
                                      f"{region.cache} cache", retryable=False)
        # One request for every (cache, block): UCX can pipeline them all.
        remote = np.concatenate([block_descs(source.regions[name], remote_block_ids) for name in self.caches])
        local = np.concatenate([block_descs(self._memory.regions[name], local_block_ids) for name in self.caches])
        agent = self._memory.agent
        try:  # check_caches keeps each side's caches on one device: one memory type per side
            xfer = agent.initialize_xfer(
                "READ", agent.get_xfer_descs(local, self._memory.regions["target"].memory_type),
                agent.get_xfer_descs(remote, source.regions["target"].memory_type), source.nixl_name)
        except NIXL_ERRORS as e:
            raise KVTransferError(f"{what} could not start: {e}", retryable=True) from None
        posted, state = False, "not posted"
        try:
            state = agent.transfer(xfer)  # raises if NIXL could not post the READ
            posted = True
            while state == "PROC" and time.monotonic() < deadline and not cancel.is_set():
                time.sleep(POLL_S)
                state = agent.check_xfer_state(xfer)
        except NIXL_ERRORS as e:
            state = f"{type(e).__name__}: {e}"
        finally:  # a READ posted and not seen to end (cancelled, timed out, its state unreadable) is waited for
            ended = not posted or state in ("DONE", "ERR") or _drained(agent, xfer)
            stopped = _release_xfer(xfer, what) and ended
        if state != "DONE":
            why = ("cancelled" if cancel.is_set() else "timed out") if state == "PROC" else state
            failure = f"{what} failed: {why}"
            if not stopped:
                failure += (f"; the READ was still running {READ_DRAIN_S:g} s later" if not ended else
                            "; NIXL refused to release it") + ": its local blocks are retired"
            raise KVTransferError(failure, retryable=True, may_still_write=not stopped)


def _drained(agent, xfer: nixl_xfer_handle) -> bool:
    """Whether the READ has ended (done or failed) within READ_DRAIN_S; False if NIXL cannot say."""
    give_up = time.monotonic() + READ_DRAIN_S
    try:
        while (state := agent.check_xfer_state(xfer)) == "PROC" and time.monotonic() < give_up:
            time.sleep(POLL_S)
    except NIXL_ERRORS:
        return False
    return state in ("DONE", "ERR")


def _release_xfer(xfer: nixl_xfer_handle, what: str) -> bool:
    """Release the transfer; False if NIXL refused (then it may still write into its local blocks)."""
    try:
        xfer.release()
        return True
    except NIXL_ERRORS as e:
        log.error("%s could not be released (%s): NIXL may still write into its local blocks", what, e)
        return False
