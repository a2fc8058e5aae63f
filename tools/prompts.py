"""Prompt files: JSONL with either `prompt` (a user message) or MT-bench style `turns` (a
conversation's user messages)."""

import json
from pathlib import Path


def read_conversations(path: Path) -> list[str | list[str]]:
    """Each row's `prompt` string, or its `turns` list whole. A row of another shape is refused
    naming the file and line (the CLI says it as an error, not a traceback)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:  # a directory, unreadable, not UTF-8
        raise ValueError(f"cannot read prompts from {path}: {e}") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            rows.append(_row(line, f"{path}:{lineno}"))
    return rows


def _row(line: str, where: str) -> str | list[str]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    prompt, turns = (row.get("prompt"), row.get("turns")) if isinstance(row, dict) else (None, None)
    if isinstance(prompt, str):
        return prompt
    if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns):
        return list(turns)
    raise ValueError(f"{where}: expected an object with a 'prompt' string or a 'turns' list of strings")


def read_prompts(path: Path) -> list[str]:
    """One user message per row: a conversation's first turn."""
    return [row if isinstance(row, str) else row[0] for row in read_conversations(path)]
