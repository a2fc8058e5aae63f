"""GGUF files the conversion refuses, and the metadata it reads as llama.cpp does."""

import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.gguf_convert import convert_gguf, embedded_gguf_path


def test_convert_missing_gguf(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.gguf does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")


def test_convert_refuses_existing_output(tmp_path: Path) -> None:
    with pytest.raises(FileExistsError, match="already exists"):
        convert_gguf(embedded_gguf_path(), tmp_path)


def test_convert_rejects_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "tiny-mamba.gguf"
    writer = gguf.GGUFWriter(path, "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"architecture 'mamba'; supported architectures: llama"):
        convert_gguf(path, tmp_path / "out")
    assert os.listdir(tmp_path) == ["tiny-mamba.gguf"], "a failed conversion must leave nothing behind"


def _metadata_only_gguf(path: Path, fields: dict[str, int | float]) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("fields, message", [
    ({"split.count": 2, "split.no": 0}, "part 1 of a GGUF split into 2 files; merge them first"),
    # llama.cpp scales linearly by a factor given without a type (and by older files' scale_linear)
    ({"llama.rope.scaling.factor": 4.0}, "RoPE scaling 'none' \\(factor 4.0\\)"),
    ({"llama.rope.scale_linear": 2.0}, "RoPE scaling 'none' \\(factor 2.0\\)"),
])
def test_gguf_files_we_cannot_convert_faithfully_are_refused_by_what_they_hold(tmp_path: Path, fields, message):
    path = _metadata_only_gguf(tmp_path / "model.gguf", fields)
    with pytest.raises(ValueError, match=message):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_gguf_naming_llama_cpps_gpt2_split_gets_it(tmp_path: Path) -> None:
    """llama.cpp names GPT-2's byte-level split "gpt-2" in tokenizer.ggml.pre (such files were
    refused, the error listing a "gpt2" no file holds)."""
    from engine.gguf_convert import _build_tokenizer

    reader = gguf.GGUFReader(embedded_gguf_path())
    meta = {key: field.contents() for key, field in reader.fields.items()} | {"tokenizer.ggml.pre": "gpt-2"}
    split = _build_tokenizer(meta, tmp_path / "model.gguf").pre_tokenizer.pre_tokenize_str("x 123")
    assert [piece for piece, _ in split] == ["x", "Ġ123"]  # SmolLM2's own split has every digit alone
