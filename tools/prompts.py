"""Prompt files: JSONL with either `prompt` (a user message) or MT-bench style `turns` (the
first turn is used)."""

import json
from pathlib import Path


def read_prompts(path: Path) -> list[str]:
    prompts = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "prompt" in row:
            prompts.append(row["prompt"])
        elif row.get("turns"):
            prompts.append(row["turns"][0])
        else:
            raise ValueError(f"{path}:{lineno}: expected a 'prompt' string or a 'turns' list")
    return prompts
