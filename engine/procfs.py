"""Processes as Linux tells them: a build directory's owner (engine/conversions.py), the children a
failed Ray start left (deploy/ray_launch.py), a child that is to die with its parent
(deploy/supervisor.py, engine/runner.py). Torch-free: the CLI's light commands import it."""

import ctypes
import os
import signal
import sys
from pathlib import Path


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the process's name (which may hold spaces and
    parentheses): [0] state, [1] ppid, ... [19] start time in clock ticks since boot. None if the
    process is gone or /proc does not tell."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def child_pids() -> set[int]:
    """This process's children."""
    me = str(os.getpid())
    return {int(entry.name) for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and (fields := stat_fields(entry.name)) is not None and fields[1] == me}


def exit_with_parent(parent_pid: int) -> None:
    """The kernel is to send this process SIGTERM when its parent dies, however it dies (SIGKILL,
    a crash); if the parent `parent_pid` is gone already, exit now. Linux only (elsewhere a no-op)."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        sys.exit("pdspec: the process that started this one is gone")


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
