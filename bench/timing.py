"""Timing calls against each other on a machine whose speed drifts (other tenants, clocks)."""

import statistics
import time
from typing import Callable


def alternated_median_ms(calls: dict[str, Callable[[], object]], reps: int, warmup: int = 1) -> dict[str, float]:
    """Median ms of each call over `reps` rounds after `warmup`, the calls taking turns in every
    round (in alternating order), so the drift hits all alike."""
    times = {name: [] for name in calls}
    for rnd in range(warmup + reps):
        for name in list(calls)[:: 1 if rnd % 2 else -1]:
            start = time.perf_counter()
            calls[name]()
            if rnd >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}
