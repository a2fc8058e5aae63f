"""How many request calls a worker serves at once. Each holds a server thread until it ends (a
stream, or a prefill waiting in the engine's queue); unbounded, they would take every thread of
the pool, and health checks, Release and KV pulls would queue behind them (the router's probe
then evicts a healthy, busy worker). Past the limit a call is refused at once with
RESOURCE_EXHAUSTED, which the router takes for a full worker and tries another."""

import contextlib
import threading
from collections.abc import Iterator

import grpc


class CallLimit:
    def __init__(self, limit: int, what: str) -> None:
        self.limit, self._what = limit, what
        self._slots = threading.BoundedSemaphore(limit)

    @contextlib.contextmanager
    def held(self, context: grpc.ServicerContext) -> Iterator[None]:
        if not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"this worker serves {self.limit} {self._what} calls already; retry on another")
        try:
            yield
        finally:
            self._slots.release()


def request_call_limit(max_num_seqs: int) -> int:
    """Calls a worker takes at once: a running batch, and as many waiting for room."""
    return 2 * max_num_seqs
