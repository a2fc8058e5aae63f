"""A GGUF file given as engine.model (converted once, cached), typed as llama.cpp's Q4_K_M of this
model (tests/kquant_gguf.py: Q4_K and Q6_K ffn_down, Q5_0 and Q8_0 elsewhere), runs its blocks
as they are stored (Q5_0 as the Q8_0 blocks of the same values): exactly (token-identical to the same weights dequantized to fp32) and with int8
activations (agreeing with the exact engine as the 32-block formats do), through the native
decoder step."""

import shutil

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.gguf_convert import embedded_gguf_path
from engine.home import pdspec_home
from engine.model_dir import model_name, resolve_model_dir
from engine.params import SamplingParams
from tests.kquant_gguf import write_k_quant_gguf
from tests.test_quant import INT8_TOP1_AGREEMENT, top1_agreement


@pytest.fixture(scope="module")
def k_model(tmp_path_factory) -> str:
    """The GGUF file itself as engine.model: converted on first use, then found in the cache."""
    gguf = write_k_quant_gguf(embedded_gguf_path(), tmp_path_factory.mktemp("kquants") / "smollm2-k.gguf")
    converted = resolve_model_dir(str(gguf))
    assert converted.parent == pdspec_home() / "models" and converted.name.startswith("smollm2-k-")
    assert resolve_model_dir(str(gguf)) == converted and model_name(str(gguf)) == "smollm2-k"
    yield str(gguf)
    shutil.rmtree(converted)  # a test file's conversion: no use to anyone after


def _engine(model: str, quantization: str) -> Engine:
    return Engine(EngineConfig(model=model, quantization=quantization, num_kv_blocks=128))


def test_k_quant_blocks_run_exactly_as_their_dequantized_weights(k_model, chat_prompts):
    exact, plain = _engine(k_model, "exact"), _engine(k_model, "none")
    layers = exact.runner.model.layers
    assert [layers[i].down.qtype for i in (0, 1)] == ["Q4_K", "Q6_K"]
    # Q5_0 q/k beside a Q8_0 v (layer 1) fuse as Q8_0: no projection falls back to fp32
    assert all(layer.qkv.qtype == layer.gate_up.qtype == layer.o.qtype == "Q8_0" for layer in layers)
    assert exact.runner.model.native is not None  # the native decoder step runs the K formats
    params = SamplingParams(max_tokens=32)
    for prompt in chat_prompts:
        answers = [[t for out in e.generate(prompt, params) for t in out.token_ids] for e in (exact, plain)]
        assert answers[0] == answers[1]
    for e in (exact, plain):
        e.close()


def test_k_quant_blocks_run_with_int8_activations(k_model, chat_prompts):
    default, exact = _engine(k_model, "auto"), _engine(k_model, "exact")
    assert default.runner.model.layers[1].down.qtype == "Q6_K" and default.runner.model.layers[1].down.int8_dot
    agree, total = top1_agreement(default, exact, chat_prompts[:2], 32)
    assert agree / total >= INT8_TOP1_AGREEMENT, f"int8 top-1 agrees with exact on {agree}/{total} positions"
    for e in (default, exact):
        e.close()


def test_a_model_file_that_is_not_a_gguf_is_refused_naming_what_is_expected(tmp_path):
    from engine.config import ModelConfigError

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ModelConfigError, match="is a file; expected a .gguf file or an HF model directory"):
        resolve_model_dir(str(weights))
