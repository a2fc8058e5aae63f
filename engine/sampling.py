"""The distribution a request samples from, and its random generator.

Each request owns a `torch.Generator` seeded from its `seed` (or from fresh entropy when none
is given), so a seeded request draws the same tokens whatever else shares its batch.
`probabilities` is the single definition of the (temperature, top-k, top-p) distribution (its
torch form, `reference_probabilities`, is the definition; CPU fp32 rows take the same steps in one
native pass, csrc/logit_rows.c); the draws themselves happen in `engine.spec.rejection.verify`,
for which plain sampling is the zero-draft case -- so speculative and plain decoding sample from
exactly the same p.
"""

import secrets

import torch

from engine import cpu_kernels
from engine.params import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator:
    """The request's own generator: seeded from `params.seed`, else from fresh entropy."""
    generator = torch.Generator()
    generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return generator


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

