"""Find a model directory and its weight files (no torch: the router resolves models too)."""

import json
from pathlib import Path

import xxhash

from engine.config import EMBEDDED_NAME, ModelConfigError


def model_name(model: str | None) -> str:
    """What to call a model (`engine.model`) in an API: the embedded model's name, else its
    directory's (a GGUF file's: its name without .gguf)."""
    if model is None:
        return EMBEDDED_NAME
    path = Path(model).expanduser()  # a link's own name: a hub cache's file links to a blob named by its hash
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def resolve_model_dir(model: str | None, tokenizer_only: bool = False) -> Path:
    """`None` = the embedded default; a `.gguf` file (llama architecture) is converted on first
    use (cached under pdspec_home()/models; `tokenizer_only`: its tokenizer and config files, for a
    process that loads no weights, unless the whole conversion is there); else an HF directory."""
    if model is None:
        from engine.gguf_convert import default_model_dir

        return default_model_dir(tokenizer_only)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelConfigError(f"model path {path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        from engine.gguf_convert import converted_model_dir

        try:
            return converted_model_dir(path, path.stem, tokenizer_only)
        except ValueError as e:  # an architecture or tokenizer the converter does not take
            raise ModelConfigError(f"model {path}: {e}") from None
    if not path.is_dir():
        raise ModelConfigError(f"model path {path} is a file; expected a .gguf file or an HF model directory "
                               "(config.json + *.safetensors)")
    if not (path / "config.json").is_file():
        raise ModelConfigError(f"model directory {path} has no config.json; expected an HF model directory")
    return path


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"model directory {model_dir} has no *.safetensors weights")
    return files


def model_fingerprint(model_dir: Path, name: str) -> str:
    """Identity of the weights (`name` + XXH3 of the weight files), equal across processes loading the
    same files; KV blocks may only move between workers whose fingerprints match. `name` must not
    depend on the host: a GGUF's conversion directory is named by the file's path, inode and ctime."""
    digest = xxhash.xxh3_64()
    for f in weight_files(model_dir):
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
    return f"{name}@{digest.hexdigest()}"
