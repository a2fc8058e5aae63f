"""The OpenAI API's request bodies and response objects, and their translation to and from the
Router's messages.

Requests: unknown fields are ignored; fields pdspec knows but cannot honour (n > 1, logprobs,
tools, response formats, penalties, ...) are refused naming the field, never silently dropped.
Omitted fields take OpenAI's defaults: temperature 1, and a chat answer as long as the context
allows, a text completion 16 tokens (the gRPC API's own defaults are greedy and 256 tokens). Value ranges (temperature, top_p, token
ids, context length) are the Router's own checks, so both fronts refuse the same requests;
`api_field` renames the Router's field paths to OpenAI's.
"""

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from proto.pdspec.v1 import common_pb2, router_pb2

Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]  # the proto's field types, so a request always encodes
Seed = Annotated[int, Field(ge=0, lt=2**63)]  # what the engine's generator takes (the proto's uint64 allows more)


class OpenAIError(Exception):
    """An error answer in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", "invalid_request_error", param)


def _lone_surrogate(value: Any, path: str) -> OpenAIError | None:
    """The first string under `value` that no UTF-8 encodes, refused naming it. JSON's \\uXXXX
    escapes can name half of a surrogate pair (a client that cut a string inside an emoji sends
    one); it failed the proto's encoding, a 500."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return None
        except UnicodeEncodeError as e:
            return OpenAIError(400, f"{path}: not valid Unicode: a lone surrogate (U+{ord(value[e.start]):04X}) at "
                               f"character {e.start}", "invalid_request_error", path.split("[")[0].split(".")[0])
    if isinstance(value, list) and value and isinstance(value[0], int):  # token ids (strict types: all ints)
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if found := _lone_surrogate(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key):
            return found
    return None


class _Body(BaseModel):
    # strict: JSON's types as they are (lax mode took true for 1, "0.7" for 0.7, "yes" for true)
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False  # vLLM's usage in every chunk: not implemented


# Known OpenAI (and vLLM) fields pdspec does not implement, and the values that mean "not used".
_UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
                "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "tools": (None, []),
                "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
                "response_format": (None, {"type": "text"}), "echo": (None, False), "best_of": (None, 1),
                "suffix": (None, ""), "min_p": (None, 0), "repetition_penalty": (None, 1), "min_tokens": (None, 0),
                "prompt_logprobs": (None, 0), "structured_outputs": (None,), "guided_json": (None,),
                "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
                "include_stop_str_in_output": (None, False), "chat_template_kwargs": (None, {}),
                "chat_template": (None,), "add_generation_prompt": (None, True),
                "continue_final_message": (None, False), "allowed_token_ids": (None,), "bad_words": (None, []),
                "truncate_prompt_tokens": (None,), "skip_special_tokens": (None, True),
                "spaces_between_special_tokens": (None, True), "use_beam_search": (None, False),
                "length_penalty": (None, 1), "modalities": (None, ["text"]), "audio": (None,),
                "reasoning_effort": (None,), "prediction": (None,), "web_search_options": (None,),
                "documents": (None, []), "logits_processors": (None, [])}
OPENAI_TEMPERATURE = 1.0  # OpenAI's default
UNTIL_CONTEXT_LIMIT = 2**31 - 1  # a chat's max_tokens when omitted: the engine stops at the context limit ("length")
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _is_unused(value: Any, unused: tuple) -> bool:
    """Whether value is one of `unused`, booleans apart (0 is not False, 1 is not True; 0.0 is 0)."""
    return any(value is u or (isinstance(value, bool) == isinstance(u, bool) and value == u) for u in unused)


class _Sampling(BaseModel):
    # extra: kept in model_extra, to refuse the unsupported ones by name; strict: as _Body
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None  # OpenAI's newer name for max_tokens; wins if both are set
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None  # not OpenAI's; vLLM and SGLang take it too (-1 there: no top-k, as 0 here)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int32] = []  # vLLM's name for stopping on token ids
    ignore_eos: bool = False
    n: int | None = 1  # null: the default, as OpenAI takes it
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Seconds the whole request may take (a pdspec extension; gRPC clients set a deadline): past
    # it the request ends with 504 and its blocks are freed on every worker.
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)

    def check_supported(self) -> None:
        if error := _lone_surrogate(self.model_dump(exclude=set(self.model_extra or ())), ""):
            raise error
        if self.n not in (None, 1):
            raise invalid("n", f"only 1 choice per request is supported, got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "only allowed with stream: true")
        for name, unused in _UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name)
            if not _is_unused(value, unused):
                raise invalid(name, f"not supported by pdspec (got {value!r}); leave it out")

    def sampling(self, default_max_tokens: int) -> common_pb2.SamplingOptions:
        """The Router's sampling options; `default_max_tokens` where neither max_tokens nor
        max_completion_tokens is given."""
        for name in ("max_tokens", "max_completion_tokens"):  # both: the one overridden is checked too
            if (value := getattr(self, name)) is not None and value < 1:
                raise invalid(name, f"must be >= 1, got {value}")
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        if self.max_completion_tokens is not None:
            max_tokens = self.max_completion_tokens
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        options = common_pb2.SamplingOptions(stop=stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)
        temperature = OPENAI_TEMPERATURE if self.temperature is None else self.temperature
        top_k = 0 if self.top_k == -1 else self.top_k
        for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", self.top_p),
                            ("top_k", top_k), ("seed", self.seed)):
            if value is not None:
                setattr(options, name, value)
        return options


class ChatCompletionRequest(_Sampling):
    messages: list[Message]

    def generate_request(self, request_id: str) -> router_pb2.GenerateRequest:
        self.check_supported()
        roles = {"developer": "system"}  # OpenAI's newer name for the system role
        messages = [common_pb2.ChatMessage(role=roles.get(m.role, m.role), content=m.text()) for m in self.messages]
        return router_pb2.GenerateRequest(request_id=request_id, messages=router_pb2.MessageList(messages=messages),
                                          sampling=self.sampling(UNTIL_CONTEXT_LIMIT))


class CompletionRequest(_Sampling):
    prompt: str | list[Int32] | list[str] | list[list[Int32]]

    def generate_request(self, request_id: str) -> router_pb2.GenerateRequest:
        self.check_supported()
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise invalid("prompt", f"one prompt per request is supported, got a batch of {len(prompt)}")
            prompt = prompt[0]
        request = router_pb2.GenerateRequest(request_id=request_id, sampling=self.sampling(COMPLETION_MAX_TOKENS))
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.token_ids.ids.extend(prompt)
        return request


# The Router's field paths (router/validation.py) as OpenAI names them.
_API_FIELDS = {"messages.messages": "messages", "token_ids.ids": "prompt", "sampling.max_tokens": "max_tokens",
               "sampling.": "", "speculation.": "", "input": "messages"}


def api_field(message: str) -> tuple[str, str | None]:
    """A Router INVALID_ARGUMENT message with the field path of each of its problems ("; " apart)
    renamed; and the first problem's field (None: it names none)."""
    parts = [_renamed(part) for part in message.split("; ")]
    return "; ".join(text for text, _ in parts), parts[0][1]


def _renamed(problem: str) -> tuple[str, str | None]:
    path, sep, rest = problem.partition(": ")
    if not sep or " " in path:
        return problem, None
    for ours, theirs in _API_FIELDS.items():
        if path.startswith(ours):
            path = theirs + path[len(ours):]
            break
    return f"{path}: {rest}", path.split("[")[0].split(".")[0]


def usage(final: router_pb2.GenerateResponse) -> dict[str, Any]:
    u = final.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


def extension(final: router_pb2.GenerateResponse) -> dict[str, Any]:
    """pdspec's own fields in a response: the speculation outcome, when it ran."""
    if not final.HasField("acceptance"):
        return {}
    a = final.acceptance
    return {"pdspec": {"acceptance": {
        "drafted": a.drafted, "accepted": a.accepted, "steps": a.steps,
        "mean_acceptance_length": round(a.mean_acceptance_length, 4),
        "per_position_acceptance_rate": [round(r, 4) for r in a.per_position_acceptance_rate]}}}


class Shape:
    """The objects of one endpoint's answers: chat.completion(.chunk) or text_completion."""

    def __init__(self, chat: bool, request_id: str, model: str) -> None:
        self.chat = chat
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", "created": int(time.time()), "model": model}

    def choice(self, text: str, finish_reason: str | None, delta: bool, first: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if not self.chat:
            choice["text"] = text
        elif delta:
            choice["delta"] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        else:
            choice["message"] = {"role": "assistant", "content": text}
        return choice | {"logprobs": None, "finish_reason": finish_reason or None}

    def whole(self, text: str, final: router_pb2.GenerateResponse) -> dict[str, Any]:
        return {**self.head, "object": "chat.completion" if self.chat else "text_completion",
                "choices": [self.choice(text, final.finish_reason, delta=False)], "usage": usage(final),
                **extension(final)}

    def chunk(self, choices: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "choices": choices, **fields}
