"""Calls that outlive their deadline, ended from outside.

A Generate stream whose client stops reading (a hung process, or one advertising a tiny HTTP/2
window) blocks the gRPC server's thread in its send once flow control is exhausted, and gRPC
waits there with no timeout of its own. The request's deadline ends its internal calls, but the
blocked send never returns to notice: the thread and the admission slot stay held for as long as
the connection stays open. Cancelling the RPC wakes the send, and the handler's cleanup runs.
"""

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Watchdog:
    """One thread for every watched call: `watch` schedules a callback, the returned function
    withdraws it. Withdrawn entries are dropped when more than half the heap is withdrawn (a busy
    router withdraws almost every entry long before its time)."""

    def __init__(self, grace_s: float) -> None:
        self._grace_s = grace_s
        self._cond = threading.Condition()
        self._heap: list[list] = []  # [when, sequence number, callback or None once withdrawn]
        self._withdrawn = 0
        self._order = itertools.count()
        self._stopped = False
        threading.Thread(target=self._run, name="router-watchdog", daemon=True).start()

    def watch(self, deadline: float, on_expiry: Callable[[], None]) -> Callable[[], None]:
        """Call `on_expiry` at `deadline` (time.monotonic()) plus the grace, unless the returned
        function was called first."""
        entry = [deadline + self._grace_s, next(self._order), on_expiry]
        with self._cond:
            heapq.heappush(self._heap, entry)
            self._cond.notify()

        def withdraw() -> None:
            with self._cond:
                if entry[2] is not None:
                    entry[2] = None
                    self._withdrawn += 1
                    if self._withdrawn > len(self._heap) // 2:
                        self._heap = [e for e in self._heap if e[2] is not None]
                        heapq.heapify(self._heap)
                        self._withdrawn = 0

        return withdraw

    def pending(self) -> int:
        with self._cond:
            return len(self._heap) - self._withdrawn

    def stop(self) -> None:
        """End the thread; nothing watched is called any more."""
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._stopped:
                    return
                entry = heapq.heappop(self._heap)
                callback, entry[2] = entry[2], None
                if callback is None:
                    self._withdrawn -= 1
                    continue
            try:
                callback()
            except Exception:  # one call's failure must not stop the watch over the others
                log.exception("ending a call past its deadline failed")
