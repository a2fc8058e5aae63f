"""When to draft: speculation pays only if a step's drafting and verification cost less than the
tokens it adds would cost decoded plainly. That depends on the machine, the model, the head's
acceptance on this traffic and the batch size, so it is measured, not assumed.

Per running batch size, the governor keeps averages of the wall time and of the emitted tokens of
steps that drafted and of steps that did not, and each step takes the way whose time per token
(the ratio of the two averages) is lower. Averaging each step's own time per token instead
would overstate drafting: a drafting step emits 1 to K+1 tokens, and the mean of time/tokens
exceeds mean time / mean tokens (a 5 ms step emitting 1, 2 or 3 tokens, 1.8 on average: 3.4 ms
against 2.8 ms per token). The two averages remember differently. A step's time follows the
host (a slow spell of a shared machine raises every step's), so older steps fade with every step
taken at that batch size, either way. Its tokens follow the head and the traffic, which drift
slowly, and vary from step to step by whole tokens, so they are averaged over that way's own
last ~1/TOKENS_DECAY steps: faded like the times, a probe's two drafting steps alone set
drafting's tokens, and a lucky or unlucky pair flipped the choice for a while.

The other way is re-measured for PROBE_STEPS steps (and first tried as soon as one way has a
figure), so a change (a longer context, another mix of prompts) shows up: PROBE_EVERY steps after
the choice last changed, and twice as long after each probe that left it as it was (up to
MAX_PROBE_EVERY), since a probe of the costlier way costs what it loses against the cheaper one.
A way whose figure is older than PROBE_EVERY steps is measured again before it is taken: a slow
spell raises the figure of the way that runs in it, not the other's, and the choice flipped to a
way measured before the spell. `python -m bench.governor_sim` (a simulated noisy host, 40 seeds of
3,000 steps) against time and tokens fading together and switching outright: where drafting costs
16 % more a token, 0.4 and 1.2 % less time a token with no spells and with one every 200 steps,
+0.1 % with one every 50 (120-303 drafting steps against 178-397); where it costs 14 % less, 2.6-3.3 %
less time (2,561-2,675 drafting steps against 1,853-1,924).
The first step after a switch is not counted: the first drafting step after plain ones also
writes the draft cache for the positions decoded meanwhile, a cost paid once per switch, not per
step, which would otherwise keep a probe of drafting from ever winning. Greedy output is the same
either way (verification is lossless) and sampling keeps its distribution; only speed differs.

How much to draft when drafting: a draft token costs a row of the verification forward and adds,
in expectation, its path probability in tokens (the head is calibrated), so it pays when that
probability exceeds the row's time over a one-row forward's. That ratio is the machine's: with
the GGUF's 4-bit weights ~6-18 % on an AVX-512 VNNI CPU and ~25-30 % on an AVX2-only one, and it
moves with the host's memory speed. So with the draft confidence threshold left unset (None,
the CPU default), `RowPrice` learns it from the engine's decode steps and sets the threshold.
"""

from dataclasses import dataclass, field

PROBE_EVERY = 16
MAX_PROBE_EVERY = 256
PROBE_STEPS = 3
DECAY = 0.05  # how much of its weight a step's time loses with each later step (of either way)
TOKENS_DECAY = 0.02  # how much of its weight a step's tokens lose with each later step of its way
ROW_PRICE_PRIOR = 0.1  # the threshold until the steps tell (an AVX-512 VNNI CPU's, BENCHMARKS)
ROW_PRICE_HALF_LIFE = 256  # decode steps after which one weighs half
ROW_PRICE_BOUNDS = (0.01, 0.5)  # below: every draft pays; above: hardly any would


@dataclass
class _Figures:
    # drafted? -> (seconds, steps) and (emitted tokens, steps), summed with older steps fading (see record)
    times: dict[bool, tuple[float, float]] = field(default_factory=dict)
    yields: dict[bool, tuple[float, float]] = field(default_factory=dict)
    clock: int = 0  # steps recorded at this batch size, either way
    updated: dict[bool, int] = field(default_factory=dict)  # drafted? -> clock at its last step
    best: bool | None = None  # the way chosen outside probes: draft?
    steps_since_probe: int = 0
    probe_every: int = PROBE_EVERY
    probe_steps_left: int = 0

    @property
    def seconds_per_token(self) -> dict[bool, float]:
        return {k: (seconds / steps) / (self.yields[k][0] / self.yields[k][1])
                for k, (seconds, steps) in self.times.items()}


class SpeculationGovernor:
    def __init__(self) -> None:
        self._by_batch: dict[int, _Figures] = {}
        self._last_drafted: bool | None = None  # the previous recorded step's way, any batch size

    def should_draft(self, batch: int) -> bool:
        f = self._by_batch.setdefault(batch, _Figures())
        per_token = f.seconds_per_token
        if len(per_token) < 2:
            return True not in per_token  # draft first, then measure plain decoding
        best = per_token[True] < per_token[False]
        if f.probe_steps_left:
            f.probe_steps_left -= 1
            return not f.best
        if best != f.best and f.best is not None and f.clock - f.updated[best] > PROBE_EVERY:
            # The way that now looks cheaper was measured long ago: a slow spell of the host raises
            # the figure of the way it runs, not the other's. Measured again first, in the same
            # spell, it is taken only if it still wins.
            f.steps_since_probe, f.probe_steps_left = 0, PROBE_STEPS - 1
            return best
        if best != f.best:  # the choice changed (a probe's figures or a drift): probe again soon
            f.best, f.probe_every, f.steps_since_probe = best, PROBE_EVERY, 0
        elif f.steps_since_probe >= f.probe_every:
            # doubled now, back to PROBE_EVERY above if this probe changes the choice
            f.steps_since_probe, f.probe_steps_left = 0, PROBE_STEPS - 1
            f.probe_every = min(2 * f.probe_every, MAX_PROBE_EVERY)
            return not best
        f.steps_since_probe += 1
        return best

    def interrupt(self) -> None:
        """A step it did not choose ran (nothing may draft at that batch size): the next recorded
        step starts a new run, as after a switch (its cost may hold the draft cache's catch-up)."""
        self._last_drafted = None

    def record(self, batch: int, drafted: bool, seconds: float, tokens: int) -> None:
        """One decode step of `batch` sequences (no prefill in it) that emitted `tokens` tokens."""
        switched, self._last_drafted = drafted != self._last_drafted, drafted
        f = self._by_batch.setdefault(batch, _Figures())
        f.clock += 1
        if tokens <= 0 or switched:
            return
        # Each way's step times fade by (1 - DECAY) a step at this batch size, whichever way that step
        # took: the way not chosen, measured by probes alone, keeps little of times taken long
        # before. (Faded by its own steps only, a figure that one slow spell of the host had raised
        # outlived the spell: a probe's two steps moved it a tenth, and the engine went on drafting
        # at a loss for thousands of steps; bench.peer's EAGLE3 engine ran 1.2x plain's time so.)
        fade = (1 - DECAY) ** (f.clock - f.updated.get(drafted, f.clock))
        old_seconds, old_steps = f.times.get(drafted, (0.0, 0.0))
        f.times[drafted] = (fade * old_seconds + seconds, fade * old_steps + 1)
        old_tokens, old_steps = f.yields.get(drafted, (0.0, 0.0))
        f.yields[drafted] = ((1 - TOKENS_DECAY) * old_tokens + tokens, (1 - TOKENS_DECAY) * old_steps + 1)
        f.updated[drafted] = f.clock

    def figures(self) -> dict[int, dict[str, float]]:
        """ms per token by batch size, for stats and benchmarks."""
        return {b: {("draft" if k else "plain"): v * 1e3 for k, v in f.seconds_per_token.items()}
                for b, f in sorted(self._by_batch.items())}


class RowPrice:
    """A verification row's time over a one-row forward's, from the decode steps' own target
    forwards: their times against their rows (the batch's sequences plus their drafts), fit as
    t = a + c * rows by least squares, older steps fading. Until the rows have varied enough to
    price one (and while a fit says more rows cost nothing), the last price (first
    ROW_PRICE_PRIOR) stands. The proposer scales the threshold by the sequences drafting, b c /
    (a + c), where a row's break-even at batch b is b c / (a + b c): a little stricter at batch 2,
    the largest batch that drafts on CPU."""

    def __init__(self) -> None:
        self._keep = 0.5 ** (1 / ROW_PRICE_HALF_LIFE)
        self._sums = (0.0, 0.0, 0.0, 0.0, 0.0)  # faded count, sum of rows, of seconds, of rows^2, of rows * seconds
        self._price = ROW_PRICE_PRIOR

    def observe(self, rows: int, seconds: float) -> None:
        k, (n, sx, sy, sxx, sxy) = self._keep, self._sums
        self._sums = (k * n + 1, k * sx + rows, k * sy + seconds, k * sxx + rows * rows, k * sxy + rows * seconds)

    def threshold(self) -> float:
        n, sx, sy, sxx, sxy = self._sums
        if n >= 32:
            mean_rows, mean_seconds = sx / n, sy / n
            spread = sxx / n - mean_rows**2
            if spread >= 0.25:  # rows with a standard deviation of half a row at least
                per_row = (sxy / n - mean_rows * mean_seconds) / spread
                one_row = mean_seconds + per_row * (1 - mean_rows)
                if per_row > 0 and one_row > 0:  # more rows no slower: the host's noise, not a price
                    self._price = min(max(per_row / one_row, ROW_PRICE_BOUNDS[0]), ROW_PRICE_BOUNDS[1])
        return self._price
