"""The router's admission queue: how many requests run at once, and who waits or is refused.

At most `capacity()` requests run at once: the running batches of the workers that decode
(Registry.capacity: the decode workers' `max_num_seqs`, or the aggregated workers'; a
disaggregated request counts once, whether it is prefilling or decoding). Others wait here in
arrival order, at most `max_queued` of them, each at most `max_wait_s`. A request that cannot be
admitted is refused at once, not accepted to time out later: when the queue is full, or when the
measured time a request holds its slot says it would wait longer than `max_wait_s`. The refusal
names the limit and when to retry.

With no capacity (no worker registered) requests pass through: routing answers UNAVAILABLE.
"""

import math
import threading
import time
from collections import deque
from collections.abc import Callable

_HOLD_EWMA = 0.2  # weight of the newest request in the mean time a request holds its slot
_POLL_S = 0.05  # how often a waiting request checks for cancellation (and for new workers)


class Overloaded(Exception):
    """Refused: the queue is full or the wait would be too long. `retry_after_s`: when a retry
    would likely be admitted."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueDeadline(Exception):
    """The client's own deadline passed while the request waited."""


class LeftQueue(Exception):
    """The client went away while the request waited."""


class Admission:
    def __init__(self, capacity: Callable[[], int], max_queued: int, max_wait_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._capacity, self._max_queued, self._max_wait_s, self._clock = capacity, max_queued, max_wait_s, clock
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()
        self._running = 0
        self._mean_hold_s: float | None = None

    def enter(self, gone: Callable[[], bool], deadline_s: float | None = None) -> "Slot":
        """Wait for a running slot; `gone`: whether the client left or aborted; `deadline_s`: the
        client's own time budget. Raises Overloaded, QueueDeadline or LeftQueue."""
        waited = self._enter(gone, deadline_s)
        return Slot(self, waited, self._clock())

    def _enter(self, gone: Callable[[], bool], deadline_s: float | None) -> float:
        arrived = self._clock()
        with self._cond:
            if not self._queue and self._has_room():
                self._running += 1
                return 0.0
            self._refuse_if_hopeless(max(self._capacity(), 1))
            ticket = object()
            self._queue.append(ticket)
            try:
                self._wait_turn(ticket, arrived, gone, deadline_s)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
            self._running += 1
            return self._clock() - arrived

    def _refuse_if_hopeless(self, capacity: int) -> None:
        ahead = len(self._queue)
        if ahead >= self._max_queued:
            raise Overloaded(f"the cluster is at capacity: {self._running} requests running, {ahead} queued "
                             f"(router.max_queued_requests={self._max_queued}); retry later",
                             self._retry_after(ahead + 1, capacity))
        if self._mean_hold_s is not None:
            expected = (ahead + 1) * self._mean_hold_s / capacity
            if expected > self._max_wait_s:
                raise Overloaded(f"the cluster is at capacity: {ahead} requests queued ahead of this one would keep "
                                 f"it waiting ~{expected:.1f}s (router.max_queue_seconds={self._max_wait_s:g}); "
                                 "retry later", self._retry_after(ahead + 1, capacity))

    def _wait_turn(self, ticket: object, arrived: float, gone: Callable[[], bool], deadline_s: float | None) -> None:
        budget = self._max_wait_s if deadline_s is None else min(self._max_wait_s, deadline_s)
        while not (self._queue[0] is ticket and self._has_room()):
            if gone():
                raise LeftQueue()
            left = arrived + budget - self._clock()
            if left <= 0:
                if deadline_s is not None and deadline_s <= self._max_wait_s:
                    raise QueueDeadline(f"the request's deadline ({deadline_s:.1f}s) passed while it waited "
                                        "for a running slot")
                position = self._queue.index(ticket) + 1
                raise Overloaded(f"the request waited {budget:g}s for a running slot "
                                 f"(router.max_queue_seconds={self._max_wait_s:g}, {self._running} running); "
                                 "nothing was computed, retry later",
                                 self._retry_after(position, max(self._capacity(), 1)))
            self._cond.wait(min(left, _POLL_S))

    def _has_room(self) -> bool:
        capacity = self._capacity()
        return capacity <= 0 or self._running < capacity

    def _leave(self, started: float) -> None:
        held_s = self._clock() - started
        with self._cond:
            self._running -= 1
            mean = self._mean_hold_s
            self._mean_hold_s = held_s if mean is None else mean + _HOLD_EWMA * (held_s - mean)
            self._cond.notify_all()

    def _retry_after(self, position: int, capacity: int) -> int:
        """Whole seconds until `position` requests ahead would have drained (at least 1)."""
        hold = self._mean_hold_s if self._mean_hold_s is not None else 1.0
        return max(1, math.ceil(position * hold / capacity))

    def snapshot(self) -> tuple[int, int]:
        """(running, queued) now."""
        with self._cond:
            return self._running, len(self._queue)


class Slot:
    """A running slot: `waited_s` in the queue for it; `release()` once the request has ended."""

    def __init__(self, admission: Admission, waited_s: float, started: float) -> None:
        self._admission, self.waited_s, self._started = admission, waited_s, started

    def release(self) -> None:
        self._admission._leave(self._started)
