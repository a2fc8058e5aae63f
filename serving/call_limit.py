"""How many request calls a worker serves at once. Each holds a server thread until it ends (a
stream, or a prefill waiting in the engine's queue); unbounded, they would take every thread of
the pool, and health checks, Release and KV pulls would queue behind them (the router's probe
then evicts a healthy, busy worker). Past the limit a call is refused at once with
RESOURCE_EXHAUSTED, which the router takes for a full worker and tries another."""

import contextlib
import threading
import time
from collections.abc import Iterator

import grpc


class CallLimit:
    def __init__(self, limit: int, what: str, then: str = "retry on another") -> None:
        """`then`: what the refused caller should do, in the refusal's message."""
        self.limit, self._what, self._then = limit, what, then
        self._lock = threading.Lock()
        self.active = 0  # calls being served now
        self.changed = time.monotonic()  # when one last arrived or ended (a drain waits for quiet)

    @contextlib.contextmanager
    def held(self, context: grpc.ServicerContext) -> Iterator[None]:
        with self._lock:
            full = self.active >= self.limit
            if not full:
                self.active, self.changed = self.active + 1, time.monotonic()
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"this worker serves {self.limit} {self._what} calls already; {self._then}")
        try:
            yield
        finally:
            with self._lock:
                self.active, self.changed = self.active - 1, time.monotonic()


def kv_pull_limit(limit: int) -> CallLimit:
    """PullBlocks streams a KV source serves at once (kvtransfer/source.py's pull_slots: its
    `held`); a refused puller waits its turn on the same source."""
    return CallLimit(limit, "KV pull", "wait for one to end")


def request_call_limit(max_num_seqs: int) -> int:
    """Calls a worker takes at once: a running batch, and as many waiting for room."""
    return 2 * max_num_seqs
