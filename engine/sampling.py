"""The distribution a request samples from, and its random generator.

Each request owns a `torch.Generator` seeded from its `seed` (or from fresh entropy when none
is given), so a seeded request draws the same tokens whatever else shares its batch.
`probabilities` is the single definition of the (temperature, top-k, top-p) distribution; the
draws themselves happen in `engine.spec.rejection.verify`, for which plain sampling is the
zero-draft case -- so speculative and plain decoding sample from exactly the same p.
"""

import secrets

import torch

from engine.params import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator:
    """The request's own generator: seeded from `params.seed`, else from fresh entropy."""
    generator = torch.Generator()
    generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return generator


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution to sample from for non-greedy params: softmax(logits / T), then top-k, top-p.

    logits: [..., vocab] fp32. Filtering keeps ties at the k-th value and the smallest prefix of
    the sorted distribution whose mass reaches top_p (always at least the top token).
    """
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs

