"""A Generate's calls to the workers: the channels they go over, and the handle that cancels the
one in flight when the client leaves or calls Abort."""

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import rpc
from proto.tls import Tls, current


_REACH_TIMEOUT_S = 3.0  # a registering worker's check: within the 5 s its Register waits


def run_key(owner: str, request_id: str) -> str:
    """A request's id as the workers know it: one namespace per API key (`owner`, its digest; ""
    without API keys), since two keys' clients may pick the same id."""
    return f"{owner[:16]}.{request_id}" if owner else request_id


class Run:
    """One running Generate: the internal call to cancel if the client leaves or calls Abort."""

    def __init__(self, key: str) -> None:
        self.key = key  # run_key's: what the workers know the request by
        self._lock = threading.Lock()
        self._call: grpc.Future | None = None
        self._on_cancel: Callable[[], None] = lambda: None
        self.cancelled = self.finished = False
        self._cancelled = threading.Event()  # for pause()
        self.queued_s = 0.0  # waited in the router's admission queue
        self.deadline = float("inf")  # time.monotonic() by which it must be served, retries included

    def time_left(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)

    def pause(self, seconds: float) -> None:
        """Wait `seconds` (no longer than the time left); a cancel ends the wait."""
        self._cancelled.wait(min(seconds, self.time_left()))

    def track(self, call: grpc.Future, on_cancel: Callable[[], None] = lambda: None) -> None:
        """`call` is now the one in flight; cancel it at once if the run was cancelled meanwhile."""
        with self._lock:
            self._call, self._on_cancel = call, on_cancel
            if not self.cancelled:
                return
        call.cancel()
        on_cancel()

    def finish(self) -> None:
        """The answer's last message is out: a cancel now (the client closing its stream after
        reading it) must not abort the worker's request or send a second last message."""
        with self._lock:
            self.finished = True

    def cancel(self) -> None:
        with self._lock:
            if self.cancelled or self.finished:
                return
            self.cancelled = True
            self._cancelled.set()
            call, on_cancel = self._call, self._on_cancel
        if call is not None:
            call.cancel()
            on_cancel()


class Peers:
    """One channel per worker address, shared by all requests (gRPC multiplexes calls on it), and
    a new one once the certificate files change (a channel presents the certificate it was opened
    with) or a worker registers there (see `unreachable`). Each on a connection of its own: gRPC
    otherwise shares one per address, and with it the backoff after a failure.

    Never closed: closing cancels in-flight calls, and a worker evicted for a late heartbeat may
    still be serving some; an idle channel costs little (and one replaced, dropped, closes once
    its last call ends)."""

    def __init__(self, token: str | None, tls: Tls | None) -> None:
        self._token, self._tls = token, tls
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[Tls | None, grpc.Channel]] = {}

    def unreachable(self, address: str) -> str:
        """Why calls to `address` cannot get there, or "": a health check that is answered at all
        (even UNIMPLEMENTED) shows the way is open, and its fresh channel becomes the address's.
        The kept one may still be backing off after a process that served there before died: the
        check would fail, and so would the first calls to a worker restarted there."""
        with self._lock:
            self._tls = current(self._tls)
            tls, fresh = self._tls, self._open(address)
        try:
            health_pb2_grpc.HealthStub(fresh).Check(health_pb2.HealthCheckRequest(), timeout=_REACH_TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                fresh.close()
                return f"its health check: {e.code().name}: {e.details()}"
        with self._lock:
            if self._tls is tls:  # else the identity was renewed meanwhile: channel() opens anew
                self._channels[address] = (tls, fresh)
        return ""

    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            self._tls = current(self._tls)
            opened = self._channels.get(address)
            if opened is None or opened[0] is not self._tls:
                opened = self._channels[address] = (self._tls, self._open(address))
            return opened[1]

    def keep_only(self, addresses: set[str]) -> None:
        """Drop the channels to every other address (their calls in flight run on); a later call
        there opens a new one."""
        with self._lock:
            for address in self._channels.keys() - addresses:
                del self._channels[address]

    def _open(self, address: str) -> grpc.Channel:
        """With the lock held, self._tls current."""
        return rpc.channel(address, self._token, self._tls, own_connection=True)


class CallSlots:
    """The calls this router has open on each worker, held within the worker's own limit
    (serving/call_limit.py): a burst that limit would refuse waits here instead, in its request's
    own time (a decode worker waits for KV room alike). Prefill calls are brief and admission counts
    the decode workers' batches, so with more decode than prefill capacity a burst reaches a prefill
    worker's limit: refused there, each excess request failed at once (RESOURCE_EXHAUSTED)."""

    def __init__(self) -> None:
        self._open: dict[str, int] = {}
        self._freed = threading.Condition()

    @contextmanager
    def held(self, worker_id: str, limit: int | None, run: Run) -> Iterator[None]:
        """A slot on `worker_id` (`limit`: None, a worker gone, waits for nothing) while the block
        runs; waiting ends when one frees, or the run is cancelled or out of time (its call then
        ends at once, as it would anyway)."""
        with self._freed:
            while limit is not None and self._open.get(worker_id, 0) >= limit and not run.cancelled:
                left = run.time_left()
                if left <= 0:
                    break
                self._freed.wait(min(left, 0.1))  # a cancel does not notify: looked at again soon
            self._open[worker_id] = self._open.get(worker_id, 0) + 1
        try:
            yield
        finally:
            with self._freed:
                self._open[worker_id] -= 1
                if not self._open[worker_id]:
                    del self._open[worker_id]
                self._freed.notify_all()
