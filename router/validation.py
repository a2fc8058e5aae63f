"""Check a GenerateRequest and tokenize its input, before any worker sees it.

Every error is an InvalidRequest whose message starts with the offending field's path in the
request (e.g. "sampling.temperature: must be >= 0, got -1"). Sampling fields are checked by the
engine's own pydantic `SamplingParams` (torch-free), so the router and the workers agree.
"""

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import jinja2
from pydantic import ValidationError

from engine.tokenizer import Tokenizer
from serving.convert import sampling_params
from proto.pdspec.v1 import common_pb2, router_pb2

CHAT_ROLES = ("system", "user", "assistant")
_INPUT_FIELD = {"messages": "messages.messages", "prompt": "prompt", "token_ids": "token_ids.ids"}
_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"),
           "less_than_equal": ("le", "<="), "less_than": ("lt", "<")}


class InvalidRequest(ValueError):
    """Answer INVALID_ARGUMENT with this message (it names the field)."""


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingOptions  # forwarded as sent: workers apply the same defaults
    speculation: common_pb2.SpeculationOptions


MAX_REQUEST_ID = 128  # characters: the id comes back in the answer's first message


def validate(request: router_pb2.GenerateRequest, tokenizer: Tokenizer, max_model_len: int | None) -> ValidRequest:
    """`max_model_len`: the registered workers' smallest context limit (None: no workers, no check)."""
    if len(request.request_id) > MAX_REQUEST_ID:
        raise InvalidRequest(f"request_id: at most {MAX_REQUEST_ID} characters, got {len(request.request_id)}")
    check_sampling(request.sampling, request.speculation)
    _check_token_ids(request.sampling.stop_token_ids, tokenizer.vocab_size, "sampling.stop_token_ids")
    prompt = prompt_token_ids(request, tokenizer)
    if max_model_len is not None and len(prompt) >= max_model_len:
        raise InvalidRequest(
            f"{_INPUT_FIELD[request.WhichOneof('input')]}: the prompt has {len(prompt)} tokens; it must be "
            f"shorter than the workers' {CONTEXT_LIMIT}, max_model_len ({max_model_len}), to leave room for the "
            "answer (a worker whose KV pool holds fewer tokens registers that instead)"
        )
    return ValidRequest(request.request_id or uuid.uuid4().hex, prompt, request.sampling, request.speculation)


def check_sampling(options: common_pb2.SamplingOptions, speculation: common_pb2.SpeculationOptions) -> None:
    try:
        sampling_params(options, speculation)
    except ValidationError as e:
        raise InvalidRequest("; ".join(_describe(err) for err in e.errors())) from None


def prompt_token_ids(request: router_pb2.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("input: set one of messages, prompt or token_ids")
    if not {"messages": request.messages.messages, "prompt": request.prompt, "token_ids": request.token_ids.ids}[kind]:
        raise InvalidRequest(f"{_INPUT_FIELD[kind]}: must be non-empty")
    if kind == "messages":
        return _encode_chat(request.messages.messages, tokenizer)
    if kind == "prompt":
        return tokenizer.encode(request.prompt, add_special_tokens=True)  # a BOS if the model's tokenizer adds one
    _check_token_ids(request.token_ids.ids, tokenizer.vocab_size, "token_ids.ids")
    return list(request.token_ids.ids)


def _encode_chat(messages: Sequence[common_pb2.ChatMessage], tokenizer: Tokenizer) -> list[int]:
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(f"messages.messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}")
    try:
        return tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in messages])
    except (ValueError, jinja2.TemplateError) as e:  # no template, or the template rejects the conversation
        raise InvalidRequest(f"messages.messages: {e}") from None


def _check_token_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"{field}[{i}]: must be in [0, {vocab_size}), got {token}")


def _describe(err: dict) -> str:
    name = err["loc"][0]
    field = f"speculation.{name}" if name == "num_speculative_tokens" else f"sampling.{name}"
    bound = _BOUNDS.get(err["type"])
    rule = f"must be {bound[1]} {shown(err['ctx'][bound[0]])}" if bound else err["msg"]
    return f"{field}: {rule}, got {shown(err['input'])}"


# The words of a prompt-too-long refusal that OpenAI's clients look for (LiteLLM, LangChain): the
# HTTP front marks such a refusal with OpenAI's code too.
CONTEXT_LIMIT = "maximum context length"
SHOWN_INPUT = 80  # characters of a refused value repeated in the message (a stop list can be ~17 KB)


def shown(value: object) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return text if len(text) <= SHOWN_INPUT else f"{text[: SHOWN_INPUT - 3]}..."
