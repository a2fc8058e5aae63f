"""The local launcher's supervisor over stand-in processes (no model: they only ask to die with
the launcher, as every pdspec process does, and sleep): the order in which stop() ends them."""

import signal
import sys
import threading
import time
from pathlib import Path

from deploy import supervisor
from deploy.supervisor import Supervisor
from tests.waiting import wait_until

# A member: asks for SIGTERM when its launcher goes (and says so), then sleeps; "draining" takes 3 s to
# exit on SIGTERM.
STAND_IN = """
import signal, sys, time
from deploy.supervisor import die_with_parent
die_with_parent()
print("asked", flush=True)
if sys.argv[1:] == ["draining"]:
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(3), sys.exit(0)))
time.sleep(600)
"""


def test_a_restarted_member_is_stopped_in_its_turn(monkeypatch, tmp_path):
    """A member the supervising thread restarted asked for SIGTERM when the *thread* that started it
    ends: it went down as soon as stop() began, not after the members stopped first (the router,
    restarted once, cut the streams of workers still draining through it)."""
    monkeypatch.setattr(supervisor, "PDSPEC", [sys.executable, "-c", STAND_IN])
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    members = Supervisor()
    members.spawn("worker", ["draining"], env, tmp_path / "worker.log")
    members.spawn("router", [], env, tmp_path / "router.log")
    members.supervise()
    stopping = threading.Thread(target=members.stop, args=(["worker"], 10.0))

    def asked(name: str) -> int:  # how many of its processes have asked to die with the launcher
        return (tmp_path / f"{name}.log").read_text().count("asked")

    try:
        wait_until(lambda: asked("worker") == asked("router") == 1, "the stand-ins did not start", 30)
        members.signal("router", signal.SIGKILL, wait=True)
        wait_until(lambda: asked("router") == 2, "the router was not restarted", 30)
        stopping.start()
        time.sleep(1.5)  # the worker drains for 3 s
        assert members.dead() == [], "the restarted router went down while the worker still drained"
        stopping.join(30)
        assert not stopping.is_alive() and sorted(members.dead()) == ["router", "worker"]
    finally:
        if stopping.ident is None:  # failed before stopping them: the stand-ins still go
            members.stop([], 1.0)
        stopping.join(30)
