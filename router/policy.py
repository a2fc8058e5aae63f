"""Which worker serves a request.

Prefill workers are picked by a policy: `kv` (NVIDIA Dynamo's KV router cost, prefix-cache aware),
or `round_robin` / `random` as baselines. Decode and aggregated workers are picked by load.
"""

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from typing import Protocol

from router.config import RouterConfig
from router.registry import WorkerView


class PrefillPolicy(Protocol):
    def choose(self, workers: Sequence[WorkerView], overlaps: Mapping[str, int], request_blocks: int) -> WorkerView:
        """`workers` is non-empty; `overlaps` maps worker id -> leading prompt blocks it has cached."""
        ...


class KVPolicy:
    """cost(w) = overlap_weight * blocks w must prefill + w's active blocks; the cheapest wins (at
    equal cost, the one holding fewer requests, running or queued).

    With temperature > 0, sample from softmax(-normalized cost / temperature) instead, so equal-ish
    workers share the traffic rather than one of them taking every burst.
    """

    def __init__(self, overlap_weight: float, temperature: float, rng: random.Random | None = None) -> None:
        self.overlap_weight = overlap_weight
        self.temperature = temperature
        self._rng = rng or random.Random()

    def cost(self, worker: WorkerView, overlaps: Mapping[str, int], request_blocks: int) -> float:
        to_prefill = request_blocks - overlaps.get(worker.worker_id, 0)
        return self.overlap_weight * to_prefill + worker.active_blocks

    def choose(self, workers: Sequence[WorkerView], overlaps: Mapping[str, int], request_blocks: int) -> WorkerView:
        costs = [self.cost(w, overlaps, request_blocks) for w in workers]
        if self.temperature == 0:
            return min(zip(costs, workers), key=lambda cw: (cw[0], cw[1].requests, cw[1].worker_id))[1]
        # Min-max normalization (as Dynamo does) makes the temperature independent of request size.
        low, span = min(costs), max(costs) - min(costs)
        weights = [math.exp(-(c - low) / span / self.temperature) if span else 1.0 for c in costs]
        return self._rng.choices(workers, weights)[0]


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._turn = itertools.count()  # next() on a count is atomic under the GIL

    def choose(self, workers: Sequence[WorkerView], overlaps: Mapping[str, int], request_blocks: int) -> WorkerView:
        return workers[next(self._turn) % len(workers)]


class RandomPolicy:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, workers: Sequence[WorkerView], overlaps: Mapping[str, int], request_blocks: int) -> WorkerView:
        return self._rng.choice(workers)


def make_policy(config: RouterConfig, rng: random.Random | None = None) -> PrefillPolicy:
    if config.policy == "kv":
        return KVPolicy(config.overlap_weight, config.temperature, rng)
    if config.policy == "round_robin":
        return RoundRobinPolicy()
    return RandomPolicy(rng)


def least_loaded(workers: Sequence[WorkerView]) -> WorkerView:
    """The decode (or aggregated) worker with the emptiest KV pool, then the fewest requests it holds."""
    return min(workers, key=lambda w: (w.active_blocks / max(w.total_blocks, 1), w.requests, w.worker_id))
