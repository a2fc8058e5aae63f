"""Prompt files: JSONL with either `prompt` (a user message) or MT-bench style `turns` (a
conversation's user messages)."""

import json
from pathlib import Path


def read_conversations(path: Path) -> list[str | list[str]]:
    """Each row's `prompt` string, or its `turns` list whole."""
    rows = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "prompt" in row:
            rows.append(row["prompt"])
        elif row.get("turns"):
            rows.append(list(row["turns"]))
        else:
            raise ValueError(f"{path}:{lineno}: expected a 'prompt' string or a 'turns' list")
    return rows


def read_prompts(path: Path) -> list[str]:
    """One user message per row: a conversation's first turn."""
    return [row if isinstance(row, str) else row[0] for row in read_conversations(path)]
