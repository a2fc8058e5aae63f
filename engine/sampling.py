"""Sampling parameters and the distribution a request samples from.

Each request owns a `torch.Generator` seeded from its `seed` (or from fresh entropy when none
is given), so a seeded request draws the same tokens whatever else shares its batch.
`probabilities` is the single definition of the (temperature, top-k, top-p) distribution; the
draws themselves happen in `engine.spec.rejection.verify`, for which plain sampling is the
zero-draft case -- so speculative and plain decoding sample from exactly the same p.
"""

import secrets
import torch
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(256, ge=1, description="new tokens to generate at most")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="0 = no top-k filtering")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: tuple[str, ...] = Field((), description="strings that end generation (not included in the text)")
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    num_speculative_tokens: int | None = Field(None, ge=0, le=16, description="per-request override of K; 0 = no speculation")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> torch.Generator:
        generator = torch.Generator()
        generator.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
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

