"""Sampler: greedy, temperature, top-k, top-p, per-request seeds and their position-keyed draws."""

import pytest
import torch
from pydantic import ValidationError

from engine import cpu_kernels
from engine.params import SamplingParams
from engine.sampling import make_seed, position_uniforms, probabilities
from engine.spec.rejection import make_verify_input, verify


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           positions: list[int] | None = None) -> list[int]:
    """One token per row (at `positions`, default 0): verification with no drafts is the engine's
    sampling path."""
    positions = positions if positions is not None else [0] * len(params)
    out = verify(make_verify_input(params, seeds, positions, [[] for _ in params], logits))
    return [t[0] for t in out.tokens]


def _draw(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n tokens sampled from the same logits at positions 0 .. n - 1."""
    seed = make_seed(params)
    return torch.tensor([sample(logits[None], [params], [seed], [t])[0] for t in range(n)])


def test_greedy_is_argmax():
    logits = torch.randn(5, 100)
    assert sample(logits, [SamplingParams()] * 5, [0] * 5) == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy():
    logits = torch.randn(100)
    draws = _draw(logits, SamplingParams(temperature=1.5, top_k=1, seed=3), 50)
    assert (draws == logits.argmax()).all()


def test_same_seed_same_tokens_whatever_the_batch():
    logits = torch.randn(3, 1000)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = sample(logits[1:2], [p], [make_seed(p)], [17])
    others = SamplingParams(temperature=0.7, seed=99)
    batched = sample(logits, [others, p, others], [make_seed(others), make_seed(p), make_seed(others)], [3, 17, 40])
    assert batched[1] == alone[0]
    assert (_draw(logits[0], p, 20) == _draw(logits[0], p, 20)).all()
    assert len(set(_draw(logits[0], SamplingParams(temperature=1.0), 20).tolist())) > 1  # no seed: fresh entropy


def test_a_positions_uniform_depends_on_the_seed_and_the_position_alone():
    """The draw of a position is its own, whatever was drawn before it (how many rows a
    speculative step verified): uniform in [0, 1), fp32-exact, different across seeds."""
    u = position_uniforms(7, list(range(20000)))
    assert all(0.0 <= x < 1.0 and x == float(torch.tensor(x)) for x in u)
    assert position_uniforms(7, [5, 19999]) == [u[5], u[19999]] and position_uniforms(8, [5]) != [u[5]]
    counts = torch.histc(torch.tensor(u), bins=10, min=0.0, max=1.0)
    assert counts.min() > 1800 and counts.max() < 2200  # ~15 standard deviations of 2000 draws a bin: no bias


def test_temperature_sampling_follows_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temperature=0.8, seed=0)
    expected = torch.softmax(logits / 0.8, dim=0)
    counts = torch.bincount(_draw(logits, params, 4000), minlength=4).float() / 4000
    assert (counts - expected).abs().max() < 0.03


def test_top_p_keeps_the_nucleus_only():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    draws = _draw(logits, SamplingParams(temperature=1.0, top_p=0.75, seed=5), 500)
    assert set(draws.tolist()) == {0, 1}


@pytest.mark.parametrize("scale, top_p, top_k", [(3.0, 0.9, 0), (0.05, 0.9, 0), (0.05, 0.999, 0), (1.0, 0.5, 0),
                                                 ([[3.0], [0.05], [1.0]], 0.9, 0), (0.05, 0.9, 300)])
def test_the_nucleus_is_the_sorted_distributions_prefix(scale, top_p, top_k):
    """Top-p searches its nucleus among the likeliest tokens first, widening while a row's nucleus
    fills them (here up to the whole vocabulary, for flat rows; one case mixes a peaked and flat
    rows, one filters by top-k first): the nucleus of the definition's full sort, and its
    probabilities (normalised by another summation order)."""
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(3)) * torch.tensor(scale)
    got = probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k))
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    kept = sorted_probs.masked_fill(sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p, 0.0)
    expected = torch.zeros_like(probs).scatter_(-1, order, kept)
    assert torch.equal(got > 0, expected > 0)  # the same nucleus, token for token
    assert torch.allclose(got, expected / expected.sum(dim=-1, keepdim=True), rtol=1e-5, atol=0)


def test_a_rows_distribution_is_the_same_alone_and_among_rows_that_sample_alike():
    """The rows of requests that sample alike are computed together; each row gets the bits it gets
    alone (so a seeded request's draws do not depend on its batch), at the real vocabulary's size,
    where torch's sum splits a lone row between threads."""
    logits = torch.randn(16, 49152, generator=torch.Generator().manual_seed(4)) * 3
    logits[5] *= 0.01  # a flat row: its nucleus is searched wider than the others'
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the tests run on one thread (conftest), where torch's sum does not split
    try:
        for params in (SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0, top_k=40)):
            together = probabilities(logits, params)
            assert all(torch.equal(probabilities(logits[i : i + 1], params), together[i : i + 1]) for i in range(16))
    finally:
        torch.set_num_threads(threads)


def test_the_nucleus_keeps_every_token_tied_with_its_last():
    p = probabilities(torch.tensor([0.4, 0.2, 0.2, 0.15, 0.05]).log(), SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.allclose(p, torch.tensor([0.4, 0.2, 0.2, 0.0, 0.0]) / 0.8)


def test_a_row_of_nan_logits_samples_without_stopping_the_batch():
    """A NaN logit (a model fault) leaves its row's distribution NaN, as the full sort did; the
    other rows, and the step, go on."""
    logits = torch.randn(2, 1000)
    logits[0, 3] = float("nan")
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=1)
    p = probabilities(logits, params)
    assert p[0].isnan().all() and torch.isclose(p[1].sum(), torch.tensor(1.0))
    assert len(sample(logits, [params, params], [make_seed(params), make_seed(params)])) == 2


def test_a_temperature_below_1e_5_is_greedy():
    """Logits divided by a temperature far smaller overflow; that sharp a distribution is the argmax."""
    logits = torch.randn(3, 1000)
    assert SamplingParams(temperature=1e-40, top_p=0.9).greedy
    assert sample(logits, [SamplingParams(temperature=1e-40, top_p=0.9)] * 3, [0] * 3) == \
        logits.argmax(-1).tolist()


def test_top_k_keeps_k_tokens():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5),
                                          ("top_k", -1), ("max_tokens", 0), ("max_tokens", -3)])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**{field: value})
    assert e.value.errors()[0]["loc"] == (field,)


@pytest.mark.parametrize("isa", cpu_kernels.supported_isas())
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 0.9), (1.0, 0, 1.0), (1.3, 40, 1.0), (0.5, 300, 0.95),
                                                       (1.0, 0, 0.999), (0.9, 2**32 + 5, 0.9)])
def test_the_native_distribution_is_the_reference_definitions(isa, temperature, top_k, top_p):
    """CPU rows take the torch definition's steps natively, on every vector width: the same tokens
    kept, the same probabilities to the exp's rounding, at about the real vocabulary's size (not a
    whole number of vectors; peaked, flat, tied rows; a top-k past the vocabulary is no filter)."""
    from engine.sampling import reference_probabilities

    logits = torch.randn(4, 49157, generator=torch.Generator().manual_seed(5)) * torch.tensor([[4.0], [0.02], [1.0], [1.0]])
    logits[3] = logits[3].round()  # ties everywhere, at the k-th value and the nucleus' last
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    native = cpu_kernels.kernels(isa).probabilities(logits, temperature, top_k, top_p)
    reference = reference_probabilities(logits, params)
    differ = (native > 0) != (reference > 0)
    # Only where the two exps' rounding decides a token at the nucleus' edge (a whole tie group in the tied row).
    assert differ.sum() <= 0.01 * (reference > 0).sum()
    for row, token in differ.nonzero().tolist():
        kept = native[row] if native[row, token] > 0 else reference[row]
        assert kept[token] <= kept[kept > 0].min() * 1.01
    for row in range(len(logits)):  # the tokens both keep, against their mass (an edge token shifts the norm)
        a, b = native[row][~differ[row]], reference[row][~differ[row]]
        assert torch.allclose(a / a.sum(), b / b.sum(), rtol=1e-5, atol=1e-12), row


@pytest.mark.parametrize("isa", cpu_kernels.supported_isas())
def test_the_native_draw_is_the_reference_inverse_cdf(isa):
    """The rows' draws natively, on every vector width: a token with weight whose CDF interval holds
    u times the total (to rounding), on nucleus rows (mostly zeros) and full ones; the torch
    inverse CDF's token wherever u is not at a boundary."""
    from engine.spec.rejection import inverse_cdf

    gen = torch.Generator().manual_seed(6)
    weights = torch.softmax(torch.randn(6, 49157, generator=gen) * 3, -1)
    weights[:3] = probabilities(torch.randn(3, 49157, generator=gen) * 3, SamplingParams(temperature=1.0, top_p=0.8))
    rows, u = [0, 2, 3, 5, 5, 1], torch.rand(6, generator=gen)
    u[5] = 0.0  # the first weight above zero
    weights[2, int(weights[2].argmax())] = 0.0  # zero weights amid the others
    weights[3, [7, 11]] = 0.0
    residual = weights[rows]
    drawn = cpu_kernels.kernels(isa).inverse_cdf(weights, rows, u)
    cdf = residual.double().cumsum(-1)
    for i, token in enumerate(drawn):
        at = float(u[i]) * float(cdf[i, -1])
        before = float(cdf[i, token - 1]) if token else 0.0
        assert residual[i, token] > 0 and float(cdf[i, token]) > at - 1e-9 and before <= at + 1e-9
    assert drawn == inverse_cdf(residual, u)  # no u here lies within rounding of a boundary
