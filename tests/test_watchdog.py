"""The router's watchdog: a call still open past its deadline (plus a grace) is ended from outside,
unless its handler withdrew the watch on the way out."""

import threading
import time

from router.watchdog import Watchdog


def test_a_call_past_its_deadline_is_ended_unless_withdrawn():
    dog = Watchdog(grace_s=0.05)
    fired: list[str] = []
    done = threading.Event()
    now = time.monotonic()
    later = dog.watch(now + 0.1, lambda: (fired.append("later"), done.set()))
    dog.watch(now, lambda: fired.append("first"))
    dog.watch(now, lambda: fired.append("withdrawn"))()
    assert done.wait(10)
    assert fired == ["first", "later"]
    later()  # withdrawing a call already ended: nothing
    assert dog.pending() == 0


def test_withdrawn_watches_do_not_pile_up():
    """A busy router withdraws almost every watch long before its deadline."""
    dog = Watchdog(grace_s=0.0)
    far = time.monotonic() + 3600
    withdraws = [dog.watch(far, lambda: None) for _ in range(1000)]
    for withdraw in withdraws[:900]:
        withdraw()
    assert dog.pending() == 100
    assert len(dog._heap) <= 200  # compacted once more than half was withdrawn
