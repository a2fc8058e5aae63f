"""The workers the router knows: role, address, KV layout, load and prefix cache (from heartbeats),
and the internal Registry servicer they register and heartbeat with.

Thread-safe: Register/Heartbeat RPCs, Generate's routing and the eviction thread share it.
"""

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import Message
from google.protobuf.text_format import MessageToString

from engine.hashing import hash_blocks
from proto.pdspec.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from router.kv_index import KVIndex
from serving.call_limit import request_call_limit
from serving.roles import WORKER_ROLES

log = logging.getLogger(__name__)


class RegistrationError(ValueError):
    """A RegisterRequest the router refuses; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class WorkerView:
    """A worker as routing and ListWorkers see it (field names match pdspec.v1.WorkerStatus)."""

    worker_id: str
    role: str
    address: str
    active_blocks: int  # last heartbeat's (used, and what queued requests fill), plus routed requests' it does not count
    total_blocks: int
    running: int  # likewise plus those requests
    waiting: int
    cached_blocks: int
    seconds_since_heartbeat: float
    metrics_address: str
    registration_id: str  # which registration routing saw: a probe's eviction spares a newer one

    @property
    def requests(self) -> int:
        """The requests it holds: running, or waiting (queued, or taken over with their KV still
        arriving, which a decode worker's heartbeats report as waiting)."""
        return self.running + self.waiting


@dataclass
class _Worker:
    registration: worker_pb2.RegisterRequest
    last_seen: float
    load: worker_pb2.Load
    # Requests routed here that its load does not count yet (request id -> the prompt's blocks):
    # each until a heartbeat names it among its arrivals, or its attempt fails, or at the latest
    # until it ends (a worker that never names any, of an older version, is counted no longer).
    # A decode request waits here for as long as its prompt's prefill runs elsewhere.
    pending: dict[str, int] = field(default_factory=dict)
    # Requests whose failed attempt reached this worker before its heartbeats named them (request id
    # -> heartbeats left to wait): the one that names such a request is late, and must not take a
    # retry's pending entry of the same id with it (the retry's own arrival is named separately).
    late: dict[str, int] = field(default_factory=dict)


class Registry:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[], None] = lambda: None) -> None:
        """on_change: called (without the lock held) after a worker joins or leaves; one call at a
        time, so one that reads the state (can_serve) and publishes it cannot be overtaken by an
        older one (a stale NOT_SERVING would stay until the next join or leave)."""
        self._clock = clock
        self._on_change = on_change
        self._change_lock = threading.Lock()
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}
        self._index = KVIndex()

    def can_serve(self) -> bool:
        """A request sent now has a route: a prefill and a decode worker, or an aggregated one."""
        with self._lock:
            roles = {w.registration.role for w in self._workers.values()}
        return "aggregated" in roles or {"prefill", "decode"} <= roles

    def register(self, request: worker_pb2.RegisterRequest,
                 unreachable: Callable[[str], str] = lambda address: "") -> None:
        """Add (or replace, after a worker restart) a worker; raises RegistrationError.
        `unreachable(address)`: why the router cannot call a worker there, or ""."""
        _check_fields(request)
        # Routed to, a worker the router cannot dial failed each call, was dropped, and registered
        # again at its next heartbeat: refused here, its log tells its operator.
        why = unreachable(request.address)
        if why:
            raise RegistrationError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"address: the router cannot reach this worker at {request.address} ({why}); "
                                    "start it with --advertise-host set to a host the router can dial")
        with self._lock:
            others = [w.registration for wid, w in self._workers.items() if wid != request.worker_id]
            if others:
                _check_layout(request.layout, others[0])
            load = worker_pb2.Load(total_blocks=request.total_blocks)
            worker = _Worker(request, self._clock(), load)
            earlier = self._workers.get(request.worker_id)
            if earlier is not None and earlier.registration.address == request.address:
                # Registered again (e.g. after a lost heartbeat): requests still on their way to it
                # count as before; any that reached a process restarted here end, and are dropped then.
                worker.pending, worker.late = earlier.pending, earlier.late
            self._workers[request.worker_id] = worker
            self._index.clear(request.worker_id)  # the snapshot replaces whatever we knew
            self._index.store(request.worker_id, request.cached_block_hashes)
        self._changed()

    def heartbeat(self, request: worker_pb2.HeartbeatRequest) -> bool:
        """Record load and apply KV events in order; False if the worker is unknown (register again)."""
        with self._lock:
            worker = self._workers.get(request.worker_id)
            if worker is None or request.registration_id != worker.registration.registration_id:
                return False  # unknown, or a heartbeat of an earlier registration (its events predate the snapshot)
            worker.last_seen = self._clock()
            worker.load.CopyFrom(request.load)
            if not request.load.total_blocks:
                worker.load.total_blocks = worker.registration.total_blocks
            for request_id in request.arrived_request_ids:  # the new load counts them
                if worker.late.pop(request_id, None) is None:
                    worker.pending.pop(request_id, None)
            # Two heartbeats: one drained before the late arrival may reach us after the attempt failed.
            worker.late = {rid: left - 1 for rid, left in worker.late.items() if left > 1}
            for event in request.events:
                self._index.apply(request.worker_id, event)
            return True

    def evict_stale(self, timeout_s: float) -> list[str]:
        """Forget workers silent for more than `timeout_s`, index entries included; returns their ids."""
        with self._lock:
            cutoff = self._clock() - timeout_s
            stale = self._drop([wid for wid, w in self._workers.items() if w.last_seen < cutoff])
        if stale:
            self._changed()
        return stale

    def evict(self, worker_id: str, address: str, registration_id: str | None = None) -> bool:
        """Forget the worker `worker_id` if it is still the one at `address` (and of
        `registration_id`, when given: it deregistered, or a call to it failed; a restarted one
        that registered since is kept). A live worker that did not deregister registers again at
        its next heartbeat."""
        with self._lock:
            worker = self._workers.get(worker_id)
            same = worker is not None and worker.registration.address == address and (
                registration_id is None or worker.registration.registration_id == registration_id)
            dropped = self._drop([worker_id] if same else [])
        if dropped:
            self._changed()
        return bool(dropped)

    def _drop(self, worker_ids: list[str]) -> list[str]:
        """(Lock held.) Remove the workers and their index entries."""
        for wid in worker_ids:
            del self._workers[wid]
            self._index.clear(wid)
        return worker_ids

    def workers(self) -> list[WorkerView]:
        with self._lock:
            now = self._clock()
            return [self._view(wid, w, now) for wid, w in sorted(self._workers.items())]

    def prefix_overlaps(self, token_ids: Sequence[int]) -> tuple[dict[str, int], int]:
        """(worker id -> leading blocks of `token_ids` it has cached and would reuse, number of blocks
        `token_ids` spans)."""
        with self._lock:
            block_size = next((w.registration.layout.block_size for w in self._workers.values()), None)
        if block_size is None:
            return {}, 0
        # The blocks before the last token: that one is computed however much is cached (for its
        # logits), so a worker reuses no block holding it (engine/block_manager.py's _match_prefix).
        # Outside the lock: heartbeats need not wait for it.
        chain = hash_blocks(token_ids[: len(token_ids) - 1], block_size)
        with self._lock:
            return self._index.overlaps(chain), math.ceil(len(token_ids) / block_size)

    def note_routed(self, worker_ids: Iterable[str], request_id: str, blocks: int) -> None:
        """Count a request of `blocks` routed to these workers into their load, each until its
        heartbeat names the request (sent before the worker had it, a heartbeat would not count it)."""
        with self._lock:
            for worker_id in worker_ids:
                if (worker := self._workers.get(worker_id)) is not None:
                    worker.pending[request_id] = blocks

    def forget_routed(self, worker_ids: Iterable[str], request_id: str, reached: Iterable[str] = ()) -> None:
        """Stop counting the request here: its attempt failed (what these workers may still hold
        of it, their loads count), or it ended. `reached`: those of them the failed attempt is known
        to have reached, whose next heartbeat names it."""
        reached = set(reached)
        with self._lock:
            for worker_id in worker_ids:
                if (worker := self._workers.get(worker_id)) is not None:
                    if worker.pending.pop(request_id, None) is not None and worker_id in reached:
                        worker.late[request_id] = 2

    def capacity(self) -> int:
        """Requests the cluster runs at once: the decode workers' batches when a prefill and a
        decode worker are registered (the route then; a prefill holds its slot briefly, a decode
        for the whole answer), else the aggregated workers'."""
        with self._lock:
            seqs = {role: sum(w.registration.max_num_seqs for w in self._workers.values() if w.registration.role == role)
                    for role in WORKER_ROLES}
        return seqs["decode"] if seqs["prefill"] and seqs["decode"] else seqs["aggregated"]

    def call_limit(self, worker_id: str) -> int | None:
        """Calls `worker_id` takes at once (serving/call_limit.py), or None if it is not registered."""
        with self._lock:
            worker = self._workers.get(worker_id)
            return request_call_limit(worker.registration.max_num_seqs) if worker is not None else None

    def _changed(self) -> None:
        with self._change_lock:
            self._on_change()

    def max_model_len(self) -> int | None:
        """The smallest context limit among registered workers: any of them may serve a request."""
        with self._lock:
            return min((w.registration.max_model_len for w in self._workers.values()), default=None)

    def _view(self, worker_id: str, worker: _Worker, now: float) -> WorkerView:
        r, load = worker.registration, worker.load
        return WorkerView(
            worker_id=worker_id, role=r.role, address=r.address,
            # Queued requests are work too: without them a worker's backlog vanished from its cost
            # at each heartbeat (its blocks not yet allocated), and it went on taking bursts.
            active_blocks=load.active_blocks + load.waiting_blocks + sum(worker.pending.values()),
            total_blocks=load.total_blocks,
            running=load.running + len(worker.pending), waiting=load.waiting,
            cached_blocks=self._index.num_blocks(worker_id), seconds_since_heartbeat=now - worker.last_seen,
            metrics_address=r.metrics_address, registration_id=r.registration_id,
        )


def _check_fields(r: worker_pb2.RegisterRequest) -> None:
    problems = [
        (not r.worker_id, f"worker_id: must be non-empty, got {r.worker_id!r}"),
        (r.role not in WORKER_ROLES, f"role: must be one of {', '.join(WORKER_ROLES)}, got {r.role!r}"),
        (not r.address, f"address: must be the worker's host:port, got {r.address!r}"),
        (r.layout.block_size < 1, f"layout.block_size: must be >= 1, got {r.layout.block_size}"),
        (r.total_blocks < 1, f"total_blocks: must be >= 1, got {r.total_blocks}"),
        (r.max_model_len < 1, f"max_model_len: must be >= 1, got {r.max_model_len}"),
        (r.max_num_seqs < 1, f"max_num_seqs: must be >= 1, got {r.max_num_seqs}"),
    ]
    for bad, message in problems:
        if bad:
            raise RegistrationError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _check_layout(layout: kv_pb2.KVLayout, registered: worker_pb2.RegisterRequest) -> None:
    """Every worker must share one layout: any prefill worker may hand its KV to any decode worker,
    and one block size keeps the hash chains comparable across the index."""
    for descriptor in kv_pb2.KVLayout.DESCRIPTOR.fields:
        theirs, ours = _field(layout, descriptor.name), _field(registered.layout, descriptor.name)
        if theirs != ours:
            raise RegistrationError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"layout.{descriptor.name}: {_show(theirs)} differs from {_show(ours)} of registered worker "
                f"{registered.worker_id!r}; all workers must share one KV layout",
            )


def _field(layout: kv_pb2.KVLayout, name: str) -> object:
    field = layout.DESCRIPTOR.fields_by_name[name]
    return None if field.message_type is not None and not layout.HasField(name) else getattr(layout, name)


def _show(value: object) -> str:
    return f"{{{MessageToString(value, as_one_line=True)}}}" if isinstance(value, Message) else repr(value)


class RegistryServicer(worker_pb2_grpc.RegistryServicer):
    def __init__(self, registry: Registry, heartbeat_interval_s: float,
                 unreachable: Callable[[str], str] = lambda address: "") -> None:
        """`unreachable(address)`: why the router cannot call a worker there, or ""."""
        self._registry = registry
        self._interval_ms = round(heartbeat_interval_s * 1000)
        self._unreachable = unreachable

    def Register(self, request, context) -> worker_pb2.RegisterResponse:
        try:
            self._registry.register(request, self._unreachable)
        except RegistrationError as e:
            context.abort(e.code, str(e))
        log.info("registered %s worker %s at %s", request.role, request.worker_id, request.address)
        return worker_pb2.RegisterResponse(heartbeat_interval_ms=self._interval_ms)

    def Heartbeat(self, request, context) -> worker_pb2.HeartbeatResponse:
        return worker_pb2.HeartbeatResponse(registered=self._registry.heartbeat(request))

    def Deregister(self, request, context) -> worker_pb2.DeregisterResponse:
        found = self._registry.evict(request.worker_id, request.address, request.registration_id)
        if found:
            log.info("worker %s at %s deregistered: it is stopping", request.worker_id, request.address)
        return worker_pb2.DeregisterResponse(found=found)
