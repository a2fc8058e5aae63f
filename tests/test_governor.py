"""engine/spec/governor.py: the governor that picks drafting or plain decoding per batch size, the
draft confidence threshold priced from the verification rows' cost (RowPrice), and an engine that
drafts by it."""

import itertools

import pytest
from pydantic import ValidationError

from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from engine.spec.governor import PROBE_EVERY, PROBE_STEPS, ROW_PRICE_BOUNDS, ROW_PRICE_PRIOR, RowPrice, SpeculationGovernor
from tools.evaluate import run_batch


def _steps(price: RowPrice, fixed: float, per_row: float, count: int) -> None:
    for i in range(count):
        rows = 1 + i % 5
        price.observe(rows, fixed + per_row * rows)


def test_the_price_is_a_rows_time_over_a_one_row_forwards():
    price = RowPrice()
    _steps(price, 2.0e-3, 0.3e-3, 40)
    assert price.threshold() == pytest.approx(0.3 / 2.3)


def test_the_prior_stands_until_the_rows_have_varied_and_the_last_price_after():
    price = RowPrice()
    for _ in range(40):
        price.observe(1, 2.5e-3)
    assert price.threshold() == ROW_PRICE_PRIOR  # one row only: no price yet
    _steps(price, 2.0e-3, 0.6e-3, 200)
    fitted = price.threshold()
    assert fitted > 2 * ROW_PRICE_PRIOR
    for _ in range(2000):  # drafting off for long: the rows stop varying, the price stays
        price.observe(1, 2.6e-3)
    assert price.threshold() == fitted


def test_old_steps_fade_and_the_price_stays_in_bounds():
    price = RowPrice()
    _steps(price, 2.0e-3, 0.2e-3, 200)
    _steps(price, 2.0e-3, 0.8e-3, 3000)
    assert price.threshold() == pytest.approx(0.8 / 2.8, rel=0.02)
    fitted = price.threshold()
    _steps(price, 3.0e-3, -0.1e-3, 3000)  # more rows faster: a busy host's noise, not a price
    assert price.threshold() == fitted
    _steps(price, 3.0e-3, 0.001e-3, 3000)
    assert price.threshold() == ROW_PRICE_BOUNDS[0]
    _steps(price, 1.0e-3, 5e-3, 3000)
    assert price.threshold() == ROW_PRICE_BOUNDS[1]


def test_a_priced_threshold_is_refused_on_cuda_with_the_fix():
    with pytest.raises(ValidationError, match="draft_confidence_threshold.*on cuda set a number"):
        EngineConfig(device="cuda", speculative={"method": "eagle3", "draft_confidence_threshold": None})
    assert EngineConfig(device="cuda", speculative={"method": "eagle3"}).speculative.draft_confidence_threshold == 0.0


@pytest.mark.parametrize("lookup_branch", [False, True])
def test_an_engine_left_unset_drafts_by_the_price_losslessly(engine, lookup_branch):
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}])
               for q in ("Name three primary colors.", "Count from 1 to 10.")]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    priced = Engine(EngineConfig(num_kv_blocks=128, speculative={
        "method": "eagle3", "adaptive": False, "prompt_lookup_branch": lookup_branch}))
    assert priced.config.speculative.draft_confidence_threshold is None
    for prompt in prompts:
        assert run_batch(priced, [prompt], params)[0] == run_batch(engine, [prompt], params)[0]
    assert priced.counters["draft_tokens"] > 0
    assert ROW_PRICE_BOUNDS[0] <= priced.draft_confidence_threshold <= ROW_PRICE_BOUNDS[1]
    assert priced.draft_confidence_threshold == priced.row_price.threshold()  # the proposer drafts by the price


def test_the_governor_takes_the_cheaper_way_and_re_measures_the_other():
    """Per batch size: draft first, then measure plain decoding; afterwards the cheaper way, the
    other re-measured for PROBE_STEPS steps PROBE_EVERY steps later, then twice as long after
    each probe that kept the choice; the first step after a switch is not counted (it pays for
    the switch); a change in costs flips the choice."""
    g = SpeculationGovernor()
    cost = {True: (0.030, 2), False: (0.010, 1)}  # 15 ms per token drafting, 10 ms plain
    choices = []
    for _ in range(4 + 3 * PROBE_EVERY + 2 * PROBE_STEPS):
        choices.append(g.should_draft(1))
        g.record(1, choices[-1], *cost[choices[-1]])
    assert choices[:4] == [True, True, False, False]  # each way measured once past its switch
    first_probe = 4 + PROBE_EVERY
    probes = [first_probe + j for j in range(PROBE_STEPS)]
    assert [i for i, c in enumerate(choices) if c and i >= 4] == probes + [p + 2 * PROBE_EVERY + PROBE_STEPS for p in probes]
    assert g.should_draft(4)  # another batch size is measured on its own
    for _ in range(PROBE_EVERY):  # drafting gets cheap: 5 ms per token, and wins
        g.record(1, True, 0.010, 2)
    assert g.should_draft(1) and g.figures()[1]["draft"] < g.figures()[1]["plain"]


def test_the_governor_compares_time_per_token_over_steps_not_per_step():
    """Drafting steps of 5 ms emitting 1, 2 or 3 tokens (2 on average: 2.5 ms a token) beat plain
    steps of 3 ms a token, though the mean of their own times per token (3.06 ms) does not."""
    g = SpeculationGovernor()
    for tokens in [3, 2, 1] * 6:
        g.record(1, True, 0.005, tokens)
    for _ in range(4):
        g.record(1, False, 0.003, 1)
    assert g.should_draft(1)
    assert g.figures()[1]["draft"] < g.figures()[1]["plain"]


def test_a_step_it_did_not_choose_starts_a_new_run():
    """Above disable_by_batch_size the engine runs plain steps the governor neither chose nor
    records; the first drafting step after them (the draft cache's catch-up in it) is not averaged."""
    g = SpeculationGovernor()
    for _ in range(3):
        g.record(1, True, 0.004, 2)
    g.interrupt()
    g.record(1, True, 0.050, 2)  # the catch-up: skipped
    g.record(1, True, 0.004, 2)
    assert g.figures()[1]["draft"] == pytest.approx(2.0)


def test_a_slow_spell_does_not_leave_the_governor_on_the_costlier_way():
    """A shared host slows every step for a while. The way not chosen is measured by probes alone,
    so what the spell left in its figure must fade with the steps taken meanwhile, either way:
    faded by its own steps only, one 30-step spell here left the governor drafting, at 4 ms a
    token against plain decoding's 3.5, for the 1,200 steps after it."""
    g = SpeculationGovernor()
    tokens = itertools.cycle([1, 2, 2, 2, 2])  # drafting steps of 7.2 ms, 1.8 tokens on average
    choices = []
    for step in range(1300):
        drafted = g.should_draft(1)
        slow = 2.0 if 100 <= step < 130 else 1.0
        g.record(1, drafted, slow * (0.0072 if drafted else 0.0035), next(tokens) if drafted else 1)
        choices.append(drafted)
    assert sum(choices[300:]) <= 0.05 * len(choices[300:])  # its probes alone
    assert g.figures()[1]["plain"] == pytest.approx(3.5)


def test_a_probes_lucky_drafting_steps_do_not_flip_the_choice():
    """Tokens per drafting step are averaged over that way's own recent steps: two lucky probe steps
    (3 tokens each, where the head's mean is 1.6) after a long run of plain steps leave drafting's
    figure near its mean. Faded with every step as the times are, they alone set it (6 ms for 3
    tokens: 2 ms a token against plain's 3.35) and the governor switched to drafting."""
    g = SpeculationGovernor()
    for tokens in [1, 2, 1, 2, 2] * 8:  # drafting measured: 6 ms steps, 1.6 tokens (3.75 ms a token)
        g.record(1, True, 0.006, tokens)
    for _ in range(300):  # plain decoding taken since: drafting's times fade away
        g.record(1, False, 0.00335, 1)
    g.record(1, True, 0.006, 3)  # the probe's first step: a switch, not counted
    for _ in range(2):
        g.record(1, True, 0.006, 3)
    g.record(1, False, 0.00335, 1)  # back: a switch, not counted
    assert g.figures()[1]["draft"] > g.figures()[1]["plain"]
    assert not g.should_draft(1)


def test_a_way_measured_before_a_slow_spell_is_measured_again_before_it_is_taken():
    """A spell slows every step, but only the way that runs in it is measured: once plain decoding's
    figure rises past drafting's, measured before the spell, drafting is probed first (in the spell,
    as slow) and not taken. Switching outright, the governor drafted 8 of the spell's 60 steps."""
    g = SpeculationGovernor()
    cost = {True: (0.0064, 2), False: (0.0030, 1)}  # 3.2 ms a token drafting, 3.0 plain
    choices = []
    for step in range(200):
        drafted = g.should_draft(1)
        slow = 1.5 if 100 <= step < 160 else 1.0
        seconds, tokens = cost[drafted]
        g.record(1, drafted, seconds * slow, tokens)
        choices.append(drafted)
    assert sum(choices[100:160]) <= PROBE_STEPS
