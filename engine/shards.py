"""Write a model's float tensors as safetensors shards, each written once it fills, so a
conversion holds one shard in memory, not the whole model (a 7B GGUF is 28 GB in fp32).

The output is Hugging Face's layout: one `model.safetensors` when everything fits one shard
(byte for byte what a single save would write), else `model-0000i-of-0000N.safetensors` and a
`model.safetensors.index.json` mapping each tensor to its shard (engine.model_dir.weight_files
reads both)."""

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

SHARD_BYTES = 2 << 30  # HF's default shard size is 5 GB; 2 GiB keeps a conversion's peak low
INDEX_FILE = "model.safetensors.index.json"
_METADATA = {"format": "pt"}


class ShardWriter:
    def __init__(self, directory: Path, shard_bytes: int = SHARD_BYTES) -> None:
        self._directory, self._shard_bytes = Path(directory), shard_bytes
        self._pending: dict[str, np.ndarray] = {}
        self._pending_bytes = 0
        self._written: list[list[str]] = []  # the tensor names of each shard written so far
        self.total_bytes = 0

    def add(self, name: str, tensor: np.ndarray) -> None:
        if self._pending and self._pending_bytes + tensor.nbytes > self._shard_bytes:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += tensor.nbytes
        self.total_bytes += tensor.nbytes

    def finish(self) -> list[Path]:
        """Writes what is pending and names the shards once their number is known; the files."""
        if len(self._written) == 0:
            path = self._directory / "model.safetensors"
            save_file(self._pending, path, metadata=_METADATA)
            self._pending = {}
            return [path]
        if self._pending:
            self._flush()
        count = len(self._written)
        weight_map, paths = {}, []
        for i, names in enumerate(self._written):
            path = self._directory / f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            self._part(i).rename(path)
            weight_map |= dict.fromkeys(names, path.name)
            paths.append(path)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self._directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return paths

    def _flush(self) -> None:
        save_file(self._pending, self._part(len(self._written)), metadata=_METADATA)
        self._written.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def _part(self, i: int) -> Path:
        return self._directory / f".shard-{i:05d}.safetensors"
