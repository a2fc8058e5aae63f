"""A request's state inside one engine."""

import enum
from dataclasses import dataclass, field

import torch

from engine.params import SamplingParams
from engine.sampling import make_generator


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV is in the cache (committed in the block manager)
    num_cached_prompt: int = 0  # prompt tokens served by the prefix cache at admission
    finish_reason: str | None = None
    prefill_only: bool = False  # stop after the first token and hand the KV off (disaggregated prefill)
    acceptance: "AcceptanceStats" = field(default_factory=lambda: AcceptanceStats())

    @classmethod
    def new(cls, seq_id: str, prompt_token_ids: list[int], params: SamplingParams) -> "Sequence":
        return cls(seq_id, list(prompt_token_ids), len(prompt_token_ids), params, make_generator(params))

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return len(self.token_ids) - self.num_computed

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]



@dataclass
class AcceptanceStats:
    """Speculation outcome of one request, over the steps that drafted."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position: times drafted
    accepted_at: list[int] = field(default_factory=list)  # per draft position: times accepted

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.steps += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        for counts, n in ((self.drafted_at, num_drafted), (self.accepted_at, num_accepted)):
            counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    def merge(self, other: "AcceptanceStats") -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        for mine, theirs in ((self.drafted_at, other.drafted_at), (self.accepted_at, other.accepted_at)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the target's own token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def to_dict(self) -> dict:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "steps": self.steps,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "per_position_acceptance_rate": [round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
        }
