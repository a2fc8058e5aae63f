"""HF safetensors directories of each supported architecture load and compute transformers'
logits: tiny random models made by transformers' own classes (biases drawn non-zero, as trained
ones are), with the config fields that change the math; fields we cannot honour are refused by
name, never ignored."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.batch import SeqChunk
from engine.config import EngineConfig, ModelConfigError
from engine.engine import Engine

SHAPE = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
PROMPT = [1, 504, 3458, 314, 260, 3575, 282, 4649, 47, 1111, 2, 30, 77, 9000, 12, 5]


def _tiny(tmp_path, model_dir, config_class: str, **fields):
    """A random model of `config_class` saved with the embedded model's tokenizer; and the model."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**SHAPE, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)  # transformers starts them at zero, where a forward that drops one still matches
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    return tmp_path, model


def _engine(path) -> Engine:
    return Engine(EngineConfig(model=str(path), num_kv_blocks=64, speculative={"method": "none"}))


@pytest.mark.parametrize("config_class, fields", [
    ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),  # o_proj and MLP biases too
    ("LlamaConfig", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("Qwen2Config", {}),  # q/k/v biases, no o_proj bias
    ("Qwen3Config", {"head_dim": 32}),  # q/k norms, a head size of its own
    ("MistralConfig", {"sliding_window": 12}),  # the context held to the window
])
def test_a_tiny_model_of_each_architecture_computes_transformers_logits(tmp_path, model_dir, config_class, fields):
    path, model = _tiny(tmp_path, model_dir, config_class, **fields)
    engine = _engine(path)
    prompt = PROMPT[: engine.max_model_len - 1]
    engine.blocks.allocate("p", prompt)
    ours = engine.runner.forward([SeqChunk(prompt, 0, engine.blocks.block_table("p"), num_logits=len(prompt))]).logits
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    if "sliding_window" in fields:
        assert engine.max_model_len == fields["sliding_window"]


@pytest.mark.parametrize("fields, message", [
    ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "rope_scaling type 'linear' not supported"),  # older key
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' not supported"),
    # fp8 weights loaded without their scales served garbage; GPTQ/AWQ failed on a missing weight's name
    ({"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8'.* not supported"),
    ({"tie_word_embeddings": False, "drop": "lm_head.weight"}, "no lm_head.weight"),  # not tied silently
])
def test_config_fields_we_cannot_honour_are_refused_by_name(tmp_path, model_dir, fields, message):
    """As config.json holds them (transformers rewrites some fields on saving: written here as is)."""
    path, _ = _tiny(tmp_path, model_dir, "LlamaConfig")
    fields = dict(fields)
    if (dropped := fields.pop("drop", None)) is not None:
        weights = load_file(path / "model.safetensors")
        save_file({k: v for k, v in weights.items() if k != dropped}, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | fields))
    with pytest.raises(ModelConfigError, match=message):
        _engine(path)


@pytest.mark.parametrize("rope_scaling, message", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, "type 'yarn' not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, "lacks low_freq_factor, high_freq_factor, original_max_position"),
])
def test_a_rope_scaling_we_cannot_apply_is_refused_with_the_config(model_dir, rope_scaling, message):
    """Refused as the config is read, so the launch check sees it: it was refused only as each
    worker built its model, after loading every weight."""
    from engine.config import ModelConfig

    config = json.loads((model_dir / "config.json").read_text()) | {"rope_scaling": rope_scaling}
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict(config)


@pytest.mark.parametrize("config_class, key", [("Qwen2Config", False), ("MistralConfig", True)])
def test_attention_bias_follows_the_architecture_as_transformers_reads_it(tmp_path, model_dir, config_class, key):
    """Qwen2 always has q/k/v biases and Mistral never, whatever an exported config.json's
    attention_bias says (the biases were dropped, or looked for and not found)."""
    path, model = _tiny(tmp_path, model_dir, config_class)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"attention_bias": key}))
    engine = _engine(path)
    engine.blocks.allocate("p", PROMPT)
    ours = engine.runner.forward([SeqChunk(PROMPT, 0, engine.blocks.block_table("p"), num_logits=len(PROMPT))]).logits
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-4
