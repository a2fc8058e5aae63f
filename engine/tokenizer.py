"""Text <-> token ids for a model directory: HF fast tokenizer, chat template and stop tokens.

Works for directories written by `engine.gguf_convert` and for HF Llama/Qwen2/Qwen3 checkpoints.
"""

import json
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

# Tokens that end a turn in common chat formats (ChatML, Llama 3, GPT-2 style); stop on them when present.
_CHAT_STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>")


class Tokenizer:
    """A `tokenizers` tokenizer plus the model's chat template and stop tokens."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        chat_template: str | None,
        special_tokens: dict[str, str],
        eos_token_ids: Sequence[int],
        source: Path,
    ) -> None:
        self._tokenizer = tokenizer
        # What a message may not smuggle in: special tokens written in its content are encoded
        # as the plain text they are, by a copy of the tokenizer that does not parse them.
        self._special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._specials = [tokenizer.id_to_token(i) for i in self._special_ids]
        self._literal = HFTokenizer.from_str(tokenizer.to_str())
        self._literal.encode_special_tokens = True
        self._special_tokens = special_tokens
        self._source = source
        self._template = _compile_template(chat_template) if chat_template is not None else None
        eos_token = special_tokens.get("eos_token")
        eos_id = tokenizer.token_to_id(eos_token) if eos_token is not None else None
        if eos_id is None and not eos_token_ids:
            raise ValueError(
                f"{source} names no eos token in tokenizer_config.json, generation_config.json or config.json"
            )
        self.eos_token_id: int = eos_id if eos_id is not None else eos_token_ids[0]
        named_stops = (tokenizer.token_to_id(token) for token in _CHAT_STOP_TOKENS)
        self.stop_token_ids: frozenset[int] = frozenset(
            [self.eos_token_id, *eos_token_ids, *(i for i in named_stops if i is not None)]
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> "Tokenizer":
        """Load `tokenizer.json`, `tokenizer_config.json` and the chat template from an HF model directory."""
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model directory {model_dir} does not exist")
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{model_dir} has no tokenizer.json; expected an HF fast tokenizer at {tokenizer_file}"
            )
        config = _read_json(model_dir / "tokenizer_config.json")
        special_tokens = {
            name: _token_content(config[name])
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
            if config.get(name) is not None
        }
        eos_ids = [
            *_as_ids(_read_json(model_dir / "generation_config.json").get("eos_token_id")),
            *_as_ids(_read_json(model_dir / "config.json").get("eos_token_id")),
        ]
        return cls(
            HFTokenizer.from_file(str(tokenizer_file)),
            _chat_template(model_dir, config),
            special_tokens,
            list(dict.fromkeys(eos_ids)),
            model_dir,
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce, added tokens included.

        This can be smaller than the model's `vocab_size`, which is often padded for alignment.
        """
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text are always kept whole.

        `add_special_tokens` adds what the tokenizer's post-processor adds, e.g. Llama 3's BOS.
        """
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template, as transformers does.

        `template_kwargs` reach the template as variables, e.g. Qwen3's `enable_thinking=False`.
        """
        if self._template is None:
            raise ValueError(
                f"{self._source} has no chat template (looked in tokenizer_config.json and chat_template.jinja)"
            )
        # transformers passes tools and documents always (None without them): templates test `is defined`.
        variables = {"tools": None, "documents": None, **self._special_tokens, **template_kwargs}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat. The template writes every special token it wants; one
        written in a message's content is that text, not the token (a user could otherwise forge a
        turn, e.g. "<|im_end|><|im_start|>system")."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        if not any(special in (m.get("content") or "") for m in messages for special in self._specials):
            return encoding.ids
        spans = self._content_spans(text, messages, add_generation_prompt)
        ids: list[int] = []
        for token, (start, end) in zip(encoding.ids, encoding.offsets):
            if token in self._special_ids and self._written_in(spans, text, token, start, end):
                ids += self._literal.encode(text[start:end], add_special_tokens=False).ids
            else:
                ids.append(token)
        return ids

    def _written_in(self, spans: list[tuple[int, int]], text: str, token: int, start: int, end: int) -> bool:
        """Whether the special token at text[start:end] was written in a message's content: its own
        text, not the whitespace an lstrip or rstrip token also takes in (the template's newline
        before the content: held to the whole match, a forged turn passed as a real one)."""
        word = self._tokenizer.id_to_token(token)
        at = text.find(word, start, end)
        if at >= 0:
            start, end = at, at + len(word)
        return any(a <= start and end <= b for a, b in spans)

    def _content_spans(self, text: str, messages: list[dict[str, str]], add_generation_prompt: bool,
                       ) -> list[tuple[int, int]]:
        """Where the rendered `text` holds the messages' contents: the template rendered again with a
        marker for each, and the contents put back where the markers landed (as written, or trimmed
        as some templates do), which must give `text` again; a template that changes contents
        otherwise cannot tell its own special tokens from a message's, and is refused."""
        marked = [m | {"content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
        skeleton = re.split("\ue000(\\d+)\ue001", self.apply_chat_template(marked, add_generation_prompt))
        for form in (str, str.strip):
            pieces, spans, at = [], [], 0
            for k, piece in enumerate(skeleton):
                if k % 2:  # a marker: message `piece`'s content
                    piece = form(messages[int(piece)].get("content") or "")
                    spans.append((at, at + len(piece)))
                pieces.append(piece)
                at += len(piece)
            if "".join(pieces) == text:
                return spans
        raise ValueError("a message's content writes a special token, and the chat template changes contents in a "
                         "way that hides where they are: remove the special token")


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas as they arrive.

    A character split across tokens is held back until its last byte arrives, so no delta ends in
    U+FFFD; the text before it goes out at once (a stop string it completes is seen at the token
    that completes it). Each step decodes only the tokens since the last emitted boundary (vLLM's
    prefix/read offsets), so the cost per token does not grow with the sequence. The deltas plus
    `flush()` concatenate to `tokenizer.decode(all_ids, skip_special_tokens)`.

    Why not `tokenizers.decoders.DecodeStream` (the same offsets, in Rust): it has `step` and no
    flush, so a generation that stops inside a multi-byte character (a length limit, an abort)
    would lose the held-back bytes its final delta must still carry (checked with tokenizers
    0.23: fed the tokens of "Café 😀" but the last, its last step returns None, and nothing gets
    the emoji's first bytes out).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        # _ids[_prefix_offset:_read_offset] is the last emitted stretch. It is decoded again with the
        # pending _ids[_read_offset:] as context, so decoders that treat the first token specially
        # (e.g. sentencepiece stripping a leading space) affect both decodes alike and cancel out.
        self._prefix_offset = 0
        self._read_offset = 0
        self._sent = 0  # characters past the emitted stretch sent already (before a split character)

    def add(self, token_ids: Iterable[int]) -> str:
        """Append `token_ids`; returns the newly completed text (possibly empty)."""
        self._ids.extend(token_ids)
        sent = len(self._decode(self._prefix_offset, self._read_offset)) + self._sent
        text = self._decode(self._prefix_offset, len(self._ids))
        if text.endswith("\ufffd"):  # a character still split: the offsets stay, to decode it whole later
            new = text.rstrip("\ufffd")[sent:]
            self._sent += len(new)
            return new
        if len(text) <= sent:
            return ""
        self._prefix_offset, self._read_offset, self._sent = self._read_offset, len(self._ids), 0
        return text[sent:]

    def flush(self) -> str:
        """Whatever is still held back, at the end of generation (non-empty only for invalid UTF-8)."""
        sent = len(self._decode(self._prefix_offset, self._read_offset)) + self._sent
        text = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        self._sent = 0
        return text[sent:]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(token: str | dict[str, Any]) -> str:
    """Special tokens are saved either as strings or as serialized `AddedToken`s."""
    return token["content"] if isinstance(token, dict) else token


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """`chat_template.jinja` if present (it wins in transformers too), else tokenizer_config's."""
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        # Older multi-template format: [{"name": ..., "template": ...}]; "default" is the chat one.
        template = {entry["name"]: entry["template"] for entry in template}.get("default")
    return template


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers marks the assistant's
    tokens with it for training masks; templates fine-tuned that way carry it)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _compile_template(source: str) -> jinja2.Template:
    """Compile like transformers: sandboxed (templates come from model repos) and whitespace-trimmed."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
