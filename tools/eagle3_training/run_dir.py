"""A distillation's or a training run's directory, held by one process at a time: two runs on one
directory (two sessions resuming the same recipe) would write the same shard numbers, overwrite
each other's done.json and checkpoints."""

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def held(directory: Path) -> Iterator[None]:
    """Holds `directory`'s lock file while the block runs; raises RuntimeError if another process holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another process is distilling or training in {directory}; wait for it to end "
                               "(or stop it) before running this one there") from None
        yield
