"""A worker's side of the Registry protocol: register with the router, then heartbeat load and
KV events; register again whenever the router does not know us (it restarted or evicted us)."""

import logging
import threading
import uuid
from collections.abc import Callable

import grpc

from engine.loop import EngineLoop
from serving.convert import kv_event
from proto.pdspec.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from proto.rpc import channel
from proto.tls import Tls, current

log = logging.getLogger(__name__)


class RegistryClient:
    def __init__(self, router_address: str, token: str | None, registration: worker_pb2.RegisterRequest,
                 loop: EngineLoop, interval_s: float = 0.5, tls: Tls | None = None,
                 on_registered: Callable[[bool], None] = lambda known: None):
        """`on_registered(known)`: called whenever the router comes to know the worker or stops."""
        self._token, self._tls = token, tls
        self._channel: grpc.Channel | None = None
        self._channel_lock = threading.Lock()  # heartbeats and stop()'s Deregister may overlap
        self.registration, self.loop, self.interval_s = registration, loop, interval_s
        self.on_registered = on_registered
        self.router_address = router_address
        self._registration_id = ""  # the registration the router last accepted (heartbeats name it)
        self._asked_id = ""  # the last one asked for: a Register that failed may still have landed
        self._unsent_arrivals: list[str] = []  # drained, not yet in a heartbeat the router took
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registry-heartbeat", daemon=True)

    @property
    def stub(self) -> worker_pb2_grpc.RegistryStub:
        """The router's stub, on a channel opened again once the certificate files change (a
        channel presents the certificate it was opened with, until that expires)."""
        with self._channel_lock:
            tls = current(self._tls)
            if self._channel is None or tls is not self._tls:
                # The one it replaces is not closed: closing would cancel a call the other thread
                # may still have on it; unused, it goes with its last reference.
                self._tls, self._channel = tls, channel(self.router_address, self._token, tls)
            return worker_pb2_grpc.RegistryStub(self._channel)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop heartbeating and tell the router to route nothing new here."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.on_registered(False)
        self._deregister()

    def _deregister(self) -> None:
        """The registration the router accepted last, and the one asked for since if its Register
        failed (it may have landed late): the router knows one of them, and routes here until it
        forgets it."""
        for registration_id in dict.fromkeys(filter(None, (self._registration_id, self._asked_id))):
            request = worker_pb2.DeregisterRequest(worker_id=self.registration.worker_id,
                                                   address=self.registration.address, registration_id=registration_id)
            try:
                self.stub.Deregister(request, timeout=5)
            except grpc.RpcError as e:  # the router is gone or restarting: it forgets us by our silence
                log.warning("deregistering from router %s failed (%s)", self.router_address, e.code())

    def _run(self) -> None:
        registered = False
        refusal = ""  # the failure last logged: the same again (a refusal repeats every interval) is debug only
        while not self._stop.is_set():
            was = registered
            try:
                trouble = self.loop.trouble()
                if trouble:  # silent: the router evicts us, and routes elsewhere
                    if registered:
                        log.error("%s: heartbeats stop until the engine serves again", trouble)
                    registered = False
                else:
                    if not registered:
                        self._register()
                        registered = True
                        if self._stop.is_set():  # stop() came meanwhile: _register deregistered it
                            break
                    registered = self._heartbeat()
            except grpc.RpcError as e:
                said = f"router {self.router_address}: {e.code()} ({e.details()})"
                log.log(logging.DEBUG if said == refusal else logging.WARNING, "%s; retrying", said)
                registered, refusal = False, said
            except Exception:  # the thread must outlive it: without heartbeats the worker is evicted for good
                log.exception("heartbeat to router %s failed; retrying", self.router_address)
                registered = False
            if registered:
                refusal = ""
            if registered != was and not self._stop.is_set():
                self.on_registered(registered)
            self._stop.wait(self.interval_s)

    def _register(self) -> None:
        request = worker_pb2.RegisterRequest()
        request.CopyFrom(self.registration)
        # The router rebuilds its view of our prefix cache from this snapshot, taken atomically
        # with dropping the events it already reflects.
        request.cached_block_hashes.extend(self.loop.cache_snapshot())
        # A Register or Heartbeat that timed out here may still reach the router late: the id tells
        # it which heartbeats follow this snapshot (and a late, older Register is found out at our
        # next heartbeat, which it then refuses: we register again).
        request.registration_id = self._asked_id = uuid.uuid4().hex
        response = self.stub.Register(request, timeout=5)
        self._registration_id = request.registration_id
        if self._stop.is_set():  # stop() gave up waiting and may have deregistered the last id: this one too
            self._deregister()
            return
        if response.heartbeat_interval_ms:
            self.interval_s = response.heartbeat_interval_ms / 1000
        log.info("registered %s (%s) with router %s", request.worker_id, request.role, self.router_address)

    def _heartbeat(self) -> bool:
        # Arrivals first: each one drained is in the stats read after it (the reverse order could
        # name a request these stats miss, and the router would count it nowhere until the next).
        # (Those of a heartbeat that failed or was refused go again: lost, the router counted each of
        # them in its own pending list too, and steered requests away from us while they ran.)
        self._unsent_arrivals += self.loop.drain_arrivals()
        stats = self.loop.stats()
        load = worker_pb2.Load(active_blocks=stats.kv_blocks_used, total_blocks=stats.kv_blocks_total,
                               running=stats.running, waiting=stats.waiting, waiting_blocks=stats.kv_blocks_waiting)
        events = [kv_event(e) for e in self.loop.drain_events()]
        response = self.stub.Heartbeat(
            worker_pb2.HeartbeatRequest(worker_id=self.registration.worker_id, load=load, events=events,
                                        registration_id=self._registration_id,
                                        arrived_request_ids=self._unsent_arrivals),
            timeout=5,
        )
        if response.registered:
            self._unsent_arrivals = []
        return response.registered


def registration(worker_id: str, role: str, address: str, layout: kv_pb2.KVLayout, total_blocks: int,
                 max_model_len: int, max_num_seqs: int) -> worker_pb2.RegisterRequest:
    return worker_pb2.RegisterRequest(worker_id=worker_id, role=role, address=address, layout=layout,
                                      total_blocks=total_blocks, max_model_len=max_model_len,
                                      max_num_seqs=max_num_seqs)
