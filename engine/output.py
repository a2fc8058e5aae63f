"""Per-request output: new token ids become text deltas; stop tokens and stop strings end it.

Text that might be the start of a stop string is held back until it is clear it is not, so a
client never sees part of a stop string; the stop string itself is never emitted.
"""

from dataclasses import dataclass

import torch

from engine.params import SamplingParams
from engine.stats import AcceptanceStats
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class KVHandle:
    """What a prefill-only request leaves for the engine that decodes it."""

    block_table: list[int]  # this engine's blocks holding the prompt's KV (target and draft)
    first_token: int
    seed: int  # the request's sampling seed (engine.sampling), which drew the first token
    draft_hidden: torch.Tensor | None  # EAGLE3 draft input hidden state of the last prompt position
    cached_prompt_tokens: int
    queue_seconds: float  # waited in this engine's queue before the prompt was computed


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # served from a prefix cache
    queue_seconds: float  # waited in this engine's queue before the prompt was computed


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new token ids since the previous output
    text: str  # new text since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"; "error": an engine step failed (EngineLoop)
    acceptance: AcceptanceStats | None = None  # on the final output, when speculation is on
    handle: KVHandle | None = None  # finish_reason "prefilled" only
    usage: Usage | None = None  # on the final output


class OutputStream:
    """Tracks one request's text; `push` returns what the client may see and whether to stop."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.params = params
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else tokenizer.stop_token_ids)
        self.held = ""  # decoded text not yet released (a possible stop-string prefix)
        self.hold_back = max((len(s) for s in params.stop), default=1) - 1

    def push(self, token_ids: list[int]) -> tuple[list[int], str, str | None]:
        """Feed newly generated tokens: (token ids to report, text delta, finish reason or None).

        Tokens after a stop token, or after the token that completes a stop string, are dropped (an
        accepted speculative run ends where decoding token by token would); a stop token itself is
        reported but not detokenized.
        """
        text = ""
        for i, token in enumerate(token_ids):
            if token in self.stop_ids:
                released, _ = self._release(self.detokenizer.flush(), final=True)
                return token_ids[: i + 1], text + released, "stop"
            released, stopped = self._release(self.detokenizer.add([token]), final=False)
            text += released
            if stopped:
                return token_ids[: i + 1], text, "stop"
        return token_ids, text, None

    def finish(self) -> str:
        """Release everything held back when generation ends for another reason (length, abort)."""
        text, _ = self._release(self.detokenizer.flush(), final=True)
        return text

    def _release(self, delta: str, final: bool) -> tuple[str, bool]:
        self.held += delta
        hits = [at for stop in self.params.stop if (at := self.held.find(stop)) >= 0]
        if hits:
            text, self.held = self.held[: min(hits)], ""
            return text, True
        keep = 0 if final else min(self.hold_back, len(self.held))
        cut = len(self.held) - keep
        text, self.held = self.held[:cut], self.held[cut:]
        return text, False
