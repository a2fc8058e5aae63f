"""Per-request sampling parameters: pydantic, no torch, so the router validates requests with
the same rules the engine applies (field names in the errors match the API's)."""

import struct

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Temperatures below 1e-5 decode greedily (vLLM's threshold): logits divided by one far smaller
# overflow to inf, and a distribution that sharp is the argmax anyway. The bound is 1e-5 as fp32,
# the type the gRPC API carries it in, so a temperature means the same through every entry point.
GREEDY_BELOW = struct.unpack("f", struct.pack("f", 1e-5))[0]
MAX_STOP_STRINGS, MAX_STOP_CHARS = 32, 512  # OpenAI takes 4 stop strings


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(256, ge=1, description="new tokens to generate at most")
    temperature: float = Field(0.0, ge=0.0, le=2.0, allow_inf_nan=False, description="0 (or below 1e-5) = greedy; at most 2")
    top_k: int = Field(0, ge=0, description="0 = no top-k filtering")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: tuple[str, ...] = Field((), description="strings that end generation (not included in the text)")
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    num_speculative_tokens: int | None = Field(None, ge=0, le=16, description="per-request override of K; 0 = no speculation")

    @field_validator("stop")
    @classmethod
    def _checked_stop(cls, stop: tuple[str, ...]) -> tuple[str, ...]:
        # Every new token's text is searched for every stop string on the engine's loop, in the step
        # that serves the whole batch: unbounded, one request's 200k strings cost ~40 ms a token.
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        if any(s == "" for s in stop):
            raise ValueError("an empty stop string would end every answer at once")
        if longest := max((len(s) for s in stop if len(s) > MAX_STOP_CHARS), default=0):
            raise ValueError(f"stop strings of at most {MAX_STOP_CHARS} characters, got one of {longest}")
        return stop

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
