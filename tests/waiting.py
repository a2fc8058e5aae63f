"""Waiting in tests for something another thread or process does: polled, with a deadline that
fails the test (never a timing assertion: the deadline is only how long to wait before giving up)."""

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], what: str = "condition not reached", timeout_s: float = 30.0,
               poll_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(poll_s)
