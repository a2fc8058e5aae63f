"""Converted models on disk (pdspec_home()/models): a conversion builds in a hidden directory named
for its process, records the GGUF it came from, and is renamed into place whole; a later one
prunes the conversions whose GGUF is gone or changed, and the build directories of crashed ones."""

import errno
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from engine.procfs import stat_fields

SOURCE_FILE = "source.json"  # the GGUF a conversion came from (path, size, mtime)


def build_dir(out_dir: Path) -> Path:
    """A new build directory for `out_dir`, beside it: .<out>.<pid>-<process start>.<random>.partial
    (the start time tells a crashed process's directory from one of a later process given the same
    pid, as a container's pid 1 is after every restart)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    owner = f"{os.getpid()}-{_start_time(os.getpid())}"
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{owner}.", suffix=".partial", dir=out_dir.parent))


def _start_time(pid: int) -> str:
    """When process `pid` started, in clock ticks since boot ("" where /proc does not tell)."""
    fields = stat_fields(pid)
    return fields[19] if fields is not None and len(fields) > 19 else ""


PARTIAL_AGE_S = 3600.0  # a build directory this old, whose process is gone, is a crashed conversion's


def prune_stale_conversions(models: Path, name: str, keep: Path) -> list[Path]:
    """Remove the conversions `models/<name>-<key>` (but `keep`) whose GGUF is gone or changed
    since: each reinstall of a package shipping a GGUF (a new virtualenv, a clean CI clone) gets a
    conversion of its own, ~600 MB for the embedded model, and nothing else ever reads the old one;
    and the build directories of crashed conversions. Conversions without a source record (older
    converters) are left alone, and so are other keys of a GGUF that is still there (another
    pdspec version on this host may be loading one). Returns the removed."""
    removed = [d for d in models.glob(f".{name}-*.partial") if _crashed(d)]
    for directory in models.glob(f"{name}-*"):
        record = directory / SOURCE_FILE
        if directory == keep or not record.is_file():
            continue
        try:
            source = json.loads(record.read_text())
            stat = Path(source["gguf"]).stat()
            current = (stat.st_size, stat.st_mtime_ns) == (source["size"], source["mtime_ns"])
        except (OSError, ValueError, KeyError):
            current = False
        if not current:
            removed.append(directory)
    for directory in removed:
        shutil.rmtree(directory, ignore_errors=True)
    return removed


def _crashed(build_dir: Path) -> bool:
    """Whether a conversion's build directory (named .<out>.<pid>-<start>.<random>.partial) is left
    over: old, and its process gone (a live conversion may write one file for many minutes)."""
    try:
        pid, _, started = build_dir.name.rsplit(".", 3)[1].partition("-")
        os.kill(int(pid), 0)
        if started and started != _start_time(int(pid)):  # the pid is another, later process's
            raise ProcessLookupError
        return False  # its process still runs
    except (ValueError, IndexError, ProcessLookupError):
        return time.time() - build_dir.stat().st_mtime > PARTIAL_AGE_S
    except PermissionError:  # another user's live process
        return False


def record_source(directory: Path, gguf_path: Path) -> None:
    """SOURCE_FILE in `directory`: the GGUF it was converted from, as prune_stale_conversions reads it
    (written beside and renamed into place, so a reader never sees half of it)."""
    stat = gguf_path.stat()
    partial = directory / f".{SOURCE_FILE}.{os.getpid()}"
    source = {"gguf": str(gguf_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    partial.write_text(json.dumps(source, indent=2) + "\n")
    os.replace(partial, directory / SOURCE_FILE)


def fsync_tree(directory: Path) -> None:
    """Flush the files to disk so that after a power loss the renamed directory is not left truncated."""
    for path in directory.rglob("*"):
        if path.is_dir():
            continue
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def replace_durably(tmp: Path, path: Path) -> None:
    """`tmp` (a file written in full) into `path`, flushed, renamed and the rename flushed: after a
    power loss `path` is the old file or the new one, never an empty or a truncated one (ext4
    flushes a file renamed onto an existing one early, but not one renamed to a new name)."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_text_durably(path: Path, text: str) -> None:
    """`text` into `path` whole, through a `.tmp` beside it (replace_durably): an interrupt leaves the
    old file or none, never a cut one that a later run would take for finished."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    replace_durably(tmp, path)


def _fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def rename_into_place(tmp_dir: Path, out_dir: Path) -> None:
    try:
        os.rename(tmp_dir, out_dir)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(f"{out_dir} appeared while converting into it") from e
        raise
    _fsync_dir(out_dir.parent)
