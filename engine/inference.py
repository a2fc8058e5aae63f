"""The engine's calls run in torch's inference mode, entered once per thread, not once per call.

Entering it took ~40-60 us with the caches as a decode step leaves them (the step's weight stream
evicts the Python and C++ it runs through): 1-2 % of a batch-1 step on a 2-vCPU Xeon, paid again
by every decorated call inside the step. The engine loop's thread (engine/loop.py) and `pdspec
generate` hold it for their whole run, so a step enters nothing; any other caller gets it per call.
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
