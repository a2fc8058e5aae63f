"""Processes as Linux's /proc tells them: a build directory's owner (engine/conversions.py), the
children a failed Ray start left (deploy/ray_launch.py)."""

import os
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
