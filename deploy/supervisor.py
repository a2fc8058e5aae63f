"""The local launcher's process supervisor: starts `pdspec` processes, restarts one that dies
(with a loud log line naming it and how it ended), and stops them all.

Restarts back off exponentially (1 s, 2 s, 4 s ... at most 30 s) while a process keeps dying
within a minute of its start, so a worker that cannot start does not spin. Each process asks
for PR_SET_PDEATHSIG as it starts (`die_with_parent`), so the kernel sends it SIGTERM when the
launcher dies however it dies: no process outlives the launcher.
"""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine.procfs import exit_with_parent

log = logging.getLogger(__name__)
_PARENT_ENV = "PDSPEC_DIE_WITH_PID"  # set for a process the supervisor starts: the launcher's pid
BACKOFF_S, MAX_BACKOFF_S, STABLE_S = 1.0, 30.0, 60.0
PDSPEC = [sys.executable, "-m", "deploy.cli"]  # a member's command, before its args
_POLL_S = 0.2


@dataclass
class _Member:
    args: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen
    started: float
    restarts: int = 0
    failures: int = 0  # deaths in a row, each within STABLE_S of its start
    restart_at: float | None = None  # when a dead member is due to start again


class Supervisor:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}
        self._stopping = threading.Event()
        self._stopped = threading.Event()  # every member terminated: the supervising thread may end
        self._thread: threading.Thread | None = None

    def spawn(self, name: str, args: list[str], env: dict[str, str], log_path: Path) -> None:
        """Start `python -m deploy.cli *args` as `name`, its output appended to `log_path`."""
        with self._lock:
            self._members[name] = _Member(args, env, log_path, _popen(args, env, log_path), time.monotonic())

    def dead(self) -> list[str]:
        """Members not running now (dead, or waiting to be restarted)."""
        with self._lock:
            return [n for n, m in self._members.items() if m.process.poll() is not None]

    def names(self) -> list[str]:
        with self._lock:
            return list(self._members)

    def supervise(self) -> None:
        """From now on, restart members that die."""
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._thread.start()

    def restarts(self, name: str) -> int:
        with self._lock:
            return self._members[name].restarts

    def signal(self, name: str, signum: int, wait: bool = False) -> None:
        """Send `signum` to one member (`wait`: until it has exited); a supervised one that exits
        is restarted."""
        with self._lock:
            process = self._members[name].process
        process.send_signal(signum)
        if wait:
            process.wait()

    def stop(self, first: list[str], grace_s: float) -> None:
        """Stop restarting, then terminate `first`, then the rest (SIGTERM, SIGKILL after grace_s)."""
        self._stopping.set()
        with self._lock:  # waits out a restart in progress; none follows
            members = dict(self._members)
        rest = [n for n in members if n not in first]
        for group in ([n for n in first if n in members], rest):
            processes = [members[n].process for n in group]
            for p in processes:
                if p.poll() is None:
                    p.terminate()
            deadline = time.monotonic() + grace_s
            for p in processes:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:  # its whole session: tensor-parallel ranks too
                    _kill_session(p)
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._stopping.wait(_POLL_S):
            now = time.monotonic()
            with self._lock:
                for name, member in self._members.items():
                    try:
                        self._tend(name, member, now)
                    except Exception:  # e.g. a restart that could not start: tried again next poll
                        log.exception("supervising %s failed", name)
        # The kernel sends PR_SET_PDEATHSIG when the *thread* that started a process ends: the
        # members this thread restarted would get SIGTERM now, before stop()'s turn for them (the
        # router before the workers that drain through it).
        self._stopped.wait()

    def _tend(self, name: str, member: _Member, now: float) -> None:
        status = member.process.poll()
        if status is None:
            return
        if member.restart_at is None:  # just died
            member.failures = member.failures + 1 if now - member.started < STABLE_S else 1
            delay = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (member.failures - 1))
            member.restart_at = now + delay
            log.error("%s exited (%s); restarting it in %.0f s (restart %d); log: %s", name, _how(status), delay,
                      member.restarts + 1, member.log_path)
        elif now >= member.restart_at and not self._stopping.is_set():  # stop() has taken its list
            member.process = _popen(member.args, member.env, member.log_path)
            member.started, member.restart_at = now, None
            member.restarts += 1
            log.warning("%s restarted (pid %d)", name, member.process.pid)


def _kill_session(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # it leads its session (start_new_session)
    except ProcessLookupError:
        pass
    process.wait()


def _how(status: int) -> str:
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:  # a real-time signal has no name
            return f"killed by signal {-status}"
    return f"exit status {status}"


def _popen(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "a") as out:  # appended: a restart keeps its predecessor's last words
        # No preexec_fn: with one, Python forks instead of vforking, and a fork while the launcher's
        # gRPC threads run can abort it (seen twice: "skipping fork() handlers", an epoll error).
        return subprocess.Popen([*PDSPEC, *args], env={**env, _PARENT_ENV: str(os.getpid())},
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def die_with_parent() -> None:
    """First thing in a process the supervisor started (deploy/cli.py): the kernel is to send it
    SIGTERM when the launcher dies, however it dies (SIGKILL, a crash), so no worker outlives it;
    if the launcher died before the request, exit now (Linux; elsewhere stop() is the only way)."""
    parent = os.environ.pop(_PARENT_ENV, None)
    if parent is not None:
        exit_with_parent(int(parent))
