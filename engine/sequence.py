"""A request's state inside one engine."""

import enum
import time
from dataclasses import dataclass, field

from engine.params import SamplingParams
from engine.stats import AcceptanceStats
from engine.sampling import make_seed


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
    seed: int  # its draws: engine.sampling.position_uniforms
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV is in the cache (committed in the block manager)
    num_cached_prompt: int = 0  # prompt tokens served by the prefix cache at admission
    arrived: float = field(default_factory=time.monotonic)
    queue_seconds: float = 0.0  # from arrival until its prompt's computation was first scheduled
    admitted: bool = False  # once: a sequence preempted and admitted again keeps its first figures
    finish_reason: str | None = None
    prefill_only: bool = False  # stop after the first token and hand the KV off (disaggregated prefill)
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)

    @classmethod
    def new(cls, seq_id: str, prompt_token_ids: list[int], params: SamplingParams) -> "Sequence":
        return cls(seq_id, list(prompt_token_ids), len(prompt_token_ids), params, make_seed(params))

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
