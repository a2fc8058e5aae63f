"""Tensor parallelism on CPU: 2 ranks over gloo give the same greedy tokens as 1 rank."""

import json

import pytest
import torch
from safetensors.torch import save_file

from engine.config import EngineConfig, ModelConfigError, check_divisible
from engine.engine import Engine
from engine.params import SamplingParams


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, model_dir):
    """A small random Llama (8 heads, 4 kv heads: divisible by 2) with the embedded model's tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    h, inter, layers, vocab = 128, 256, 4, 49152
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": inter,
              "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
              "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024,
              "tie_word_embeddings": False, "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    w = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g), "lm_head.weight": torch.randn(vocab, h, generator=g) * 0.2,
         "model.norm.weight": torch.ones(h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (128, h)), ("self_attn.k_proj", (64, h)), ("self_attn.v_proj", (64, h)),
                            ("self_attn.o_proj", (h, 128)), ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)),
                            ("mlp.down_proj", (h, inter))):
            w[p + name + ".weight"] = torch.randn(shape, generator=g) * shape[1] ** -0.5
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    save_file(w, str(path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((model_dir / name).read_bytes())
    return str(path)


def _greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [[t for o in engine.generate(p, SamplingParams(max_tokens=24, ignore_eos=True)) for t in o.token_ids]
            for p in prompts]


def _after_a_kv_move(engine: Engine, prompt: list[int]) -> list[int]:
    """Greedy tokens when, after the prefill, position 1's KV is overwritten with the last prompt
    token's (the move a tree's accepted leaf makes), on every rank."""
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    tokens = [t for o in engine.step() for t in o.token_ids]  # the prefill and the first token
    engine.runner.move_kv(engine.blocks.block_table(request_id), [len(prompt) - 1], [1])
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.token_ids]
    return tokens


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "int8"])
def test_two_ranks_match_one(tiny_llama, kv_cache_dtype):
    """Each rank holds its kv heads' cache (an int8 cache's rows with their scales: written by the
    torch path, read by the C kernel) and the same greedy tokens come out."""
    config = {"model": tiny_llama, "num_kv_blocks": 64, "enable_prefix_caching": False, "kv_cache_dtype": kv_cache_dtype}
    one = Engine(EngineConfig(**config))
    prompts = [one.tokenizer.encode(t) for t in ("The weather today is", "Once upon a time", "1, 2, 3,")]
    expected = _greedy(one, prompts)
    moved = _after_a_kv_move(one, prompts[1])
    assert moved != expected[1]  # the move matters
    two = Engine(EngineConfig(**config, tensor_parallel_size=2))
    try:
        assert _greedy(two, prompts) == expected
        assert two.runner.layout.target.num_kv_heads == 2  # each rank caches its own kv heads
        assert two.runner.layout.dtype == kv_cache_dtype
        assert _after_a_kv_move(two, prompts[1]) == moved  # KV moves reach every rank
    finally:
        two.runner.close()


def test_tp_must_divide_the_heads(engine):
    with pytest.raises(ModelConfigError, match="tensor_parallel_size: 2 does not divide the model's num_attention_heads"):
        check_divisible(engine.runner.model_config, 2)
