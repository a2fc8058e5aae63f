"""The distribution a request samples from, and its random draws.

Each request has a seed (its `seed`, or fresh entropy when none is given), and the token at
position t is drawn with one uniform that is a hash of (seed, t) alone (`position_uniforms`). So a
seeded request draws the same tokens whatever shares its batch, however many tokens were drafted
before, after a preemption's recompute and across a prefill/decode hand-off (the seed travels with
it); and speculative sampling emits exactly the tokens plain sampling does (see
engine.spec.rejection). `probabilities` is the single definition of the (temperature, top-k,
top-p) distribution (its torch form, `reference_probabilities`, is the definition; CPU fp32 rows
take the same steps in one native pass, csrc/logit_rows.c); the draws happen in
`engine.spec.rejection.verify`, for which plain sampling is the zero-draft case.
"""

import secrets

import torch

from engine import cpu_kernels
from engine.params import SamplingParams

_MASK64 = (1 << 64) - 1


def make_seed(params: SamplingParams) -> int:
    """The request's seed: `params.seed`, else fresh entropy."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers whose outputs look independent."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def position_uniforms(seed: int, positions: list[int]) -> list[float]:
    """The uniform in [0, 1) that draws the token at each position (24 bits: exact in fp32)."""
    base = _mix64(seed & _MASK64)
    return [(_mix64(base ^ _mix64(p + 0x9E3779B97F4A7C15 & _MASK64)) >> 40) / (1 << 24) for p in positions]


# Candidates searched for a top-p nucleus first (16x more while a row's nucleus fills them):
# chat nuclei are far smaller, and sorting a whole 49K vocabulary took ~3.5 ms a row on CPU, about
# a decode step (top-p requests decoded at half the speed of greedy ones).
NUCLEUS_CANDIDATES = 256


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution to sample from for non-greedy params, reference_probabilities' definition:
    on CPU fp32 natively (torch's calls took ~0.2-0.3 ms a row, a quarter of a batch-16 step at
    top-p; the native exp rounds differently, so a token at the nucleus' very edge may go the other
    way); a row's bits are its own, alone or among others."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        rows = logits.reshape(-1, logits.shape[-1])
        native = cpu_kernels.kernels().probabilities(rows, params.temperature, params.top_k, params.top_p)
        return native.view(logits.shape)
    return reference_probabilities(logits, params)


def reference_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution to sample from for non-greedy params: softmax(logits / T), then top-k, top-p.

    logits: [..., vocab] fp32. Filtering keeps ties at the k-th value, and the smallest prefix of
    the sorted distribution whose mass reaches top_p (always at least the top token) with any
    token tied with its last.
    """
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
        # Each row's sum by a sequential scan: torch's sum splits a lone row between threads, so a
        # row would sum otherwise alone than in a batch (a seeded request's draws must not depend on it).
        probs = probs / torch.cumsum(probs, dim=-1, dtype=torch.float64)[..., -1:].to(probs.dtype)
    return probs


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs outside each row's nucleus zeroed: found among its most likely tokens, as many as
    needed for every row's nucleus to end inside them. The same nucleus as a full sort's but for
    ties with its last token: on CPU the cumulative sum of a row's first k values is the first k
    of the whole row's (a sequential scan; CUDA's blocked scan may round one boundary token
    differently). A row of NaN (from a NaN logit) stays NaN, as the sort left it."""
    vocab = probs.shape[-1]
    rows = probs.reshape(-1, vocab)
    threshold = torch.empty(rows.shape[0], 1, dtype=probs.dtype, device=probs.device)  # each row's least kept probability
    todo = torch.arange(rows.shape[0], device=probs.device)  # rows whose nucleus may reach past the candidates
    k = min(NUCLEUS_CANDIDATES, vocab)
    while len(todo):
        top = (rows if len(todo) == rows.shape[0] else rows[todo]).topk(k, dim=-1).values  # ties in any order
        size = (top.cumsum(dim=-1) - top < top_p).sum(dim=-1, keepdim=True).clamp_min(1)  # mass before < top_p
        done = (size < k).flatten() | (k == vocab)
        threshold[todo[done]] = top[done].gather(-1, size[done] - 1)
        todo, k = todo[~done], min(16 * k, vocab)
    return probs.masked_fill(probs < threshold.view(*probs.shape[:-1], 1), 0.0)

