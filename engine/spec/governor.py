"""When to draft: speculation pays only if a step's drafting and verification cost less than the
tokens it adds would cost decoded plainly. That depends on the machine, the model, the head's
acceptance on this traffic and the batch size, so it is measured, not assumed.

Per running batch size, the governor keeps a moving average of the wall time per emitted token
of steps that drafted and of steps that did not, and each step takes the cheaper way. The other
way is re-measured every PROBE_EVERY steps (and first tried as soon as one way has a figure),
so a change (a longer context, another mix of prompts) shows up. Greedy output is the same
either way (verification is lossless) and sampling keeps its distribution; only speed differs.
"""

from dataclasses import dataclass, field

PROBE_EVERY = 16
DECAY = 0.2  # weight of the newest step in the moving averages


@dataclass
class _Figures:
    seconds_per_token: dict[bool, float] = field(default_factory=dict)  # drafted? -> moving average
    steps_since_probe: int = 0


class SpeculationGovernor:
    def __init__(self) -> None:
        self._by_batch: dict[int, _Figures] = {}

    def should_draft(self, batch: int) -> bool:
        f = self._by_batch.setdefault(batch, _Figures())
        if len(f.seconds_per_token) < 2:
            return True not in f.seconds_per_token  # draft first, then measure plain decoding once
        best = f.seconds_per_token[True] < f.seconds_per_token[False]
        return not best if f.steps_since_probe >= PROBE_EVERY else best

    def record(self, batch: int, drafted: bool, seconds: float, tokens: int) -> None:
        """One decode step of `batch` sequences (no prefill in it) that emitted `tokens` tokens."""
        if tokens <= 0:
            return
        f = self._by_batch.setdefault(batch, _Figures())
        per_token = seconds / tokens
        old = f.seconds_per_token.get(drafted)
        f.seconds_per_token[drafted] = per_token if old is None else (1 - DECAY) * old + DECAY * per_token
        chosen = len(f.seconds_per_token) == 2 and (f.seconds_per_token[True] < f.seconds_per_token[False]) == drafted
        f.steps_since_probe = f.steps_since_probe + 1 if chosen else 0

    def figures(self) -> dict[int, dict[str, float]]:
        """ms per token by batch size, for stats and benchmarks."""
        return {b: {("draft" if k else "plain"): v * 1e3 for k, v in f.seconds_per_token.items()}
                for b, f in sorted(self._by_batch.items())}
