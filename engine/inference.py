"""The engine's calls run in torch's inference mode, entered once per thread, not once per call.

With the caches as a decode step leaves them (its weight stream evicts the Python and C++ it runs
through), a call through torch's decorator cost ~45 us more than the call itself, through this one
with the mode on already ~35 us (a proposer call that drafts nothing: 64 / 55 / 18 us), paid by
every decorated call inside a step, and an EAGLE3 step that drafts makes several. Held once, EAGLE3
took 0.96-0.98x the time per token against entering it per step; plain decoding, one call a step,
within noise (BENCHMARKS). The engine loop's thread (engine/loop.py) and `pdspec generate` hold it
for their whole run; any other caller gets it once per call it makes, the calls inside it
entering nothing.
"""

import functools
from typing import Callable, ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def inference(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` under torch.inference_mode(), entered only when the calling thread is not in it already.
    Not for generator functions (their bodies run after the call returns, outside it)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run
