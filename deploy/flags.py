"""Command-line flags made from the config schema's fields: the flag's name, type, choices,
default and help come from the pydantic field, so a new field needs no second definition."""

import argparse
import ast
import types
import typing

from pydantic import BaseModel


def add_field_flags(parser: argparse.ArgumentParser, model: type[BaseModel], flags: dict[str, str],
                    defaults: dict[str, str] | None = None) -> None:
    """One flag per field: `flags` maps a field name to its flag ('method' -> '--speculative');
    the value lands in the namespace under the flag's own name (see `field_values`), and only when
    given: a field left out takes the schema's default, which may depend on other fields
    (`defaults`: what the help says of those, by field name)."""
    for name, flag in flags.items():
        field = model.model_fields[name]
        kind, choices = _kind(field.annotation)
        help_text = f"{field.description or name} (default: {(defaults or {}).get(name, field.default)})"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, type=kind, choices=choices, default=argparse.SUPPRESS, help=help_text)


def field_values(args: argparse.Namespace, flags: dict[str, str]) -> dict:
    """{field name: the flag's value} for the flags `add_field_flags` added that were given."""
    given = vars(args)
    dests = {name: flag.removeprefix("--").replace("-", "_") for name, flag in flags.items()}
    return {name: given[dest] for name, dest in dests.items() if dest in given}


def flags_for(model: type[BaseModel], renamed: dict[str, str] | None = None) -> dict[str, str]:
    """Every field of `model` -> '--field-name', except those `renamed` gives a flag of their own."""
    renamed = renamed or {}
    return {name: renamed.get(name, "--" + name.replace("_", "-")) for name in model.model_fields}


def _kind(annotation) -> tuple[type, list | None]:
    """The argparse type and choices of a field's annotation (X | None is X, or 'none' for None)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        kind, choices = _kind(args[0])
        return _or_none(kind), None if choices is None else [*choices, None]
    if typing.get_origin(annotation) is typing.Literal:
        return type(args[0]), list(args)
    if annotation in (bool, int, float, str):
        return annotation, None
    if typing.get_origin(annotation) is list:
        return literal, None
    raise TypeError(f"no command-line flag for a field of type {annotation}")


def _or_none(kind):
    """`kind`'s parser that also reads 'none' (or 'null') as None: a field whose None means
    something (no limit, the device's default) can be set to it from the command line."""
    def parse(text: str):
        return None if text.strip().lower() in ("none", "null") else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


def literal(text: str):
    """A list flag's value as Python or JSON writes it: '[[0], [1], [0, 0]]', or vLLM's '[(0,), (1,), (0, 0)]'
    (the config schema then checks its items)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = None
    if not isinstance(value, (list, tuple)):
        raise argparse.ArgumentTypeError(f"expected a list such as [[0], [1], [0, 0]], got {text!r}")
    return [list(v) if isinstance(v, tuple) else v for v in value]


def seconds(text: str) -> float:
    """A duration flag's value: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds above 0, got {text!r}")
    return value
