"""The EAGLE3 head: published checkpoint layout round trip, and training (TTT) == inference."""

import json
from dataclasses import replace

import pytest
import torch

from engine.config import ModelConfig
from engine.spec.eagle3_model import Eagle3Config, Eagle3Draft, head_aux_layer_ids
from engine.kv_layout import CacheShape, KVLayout, allocate_cache
from engine.batch import SeqChunk, build_batch
from engine.loader import load_weights
from tools.eagle3_training.model import TrainableEagle3

# Llama-3.1-8B's shapes scaled down (hidden 4096 -> 256, 32/8 heads -> 8/2, head_dim 128 -> 32,
# vocab 128256 -> 2000, draft vocab 32000 -> 500), with its llama3 RoPE scaling.
TARGET = ModelConfig.from_dict({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 2000, "hidden_size": 256, "intermediate_size": 896,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 4096,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 512},
})
BLOCK = 8


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    torch.manual_seed(0)
    vocab = torch.randperm(TARGET.vocab_size)[:500].sort().values
    model = TrainableEagle3(TARGET, vocab, torch.randn(TARGET.vocab_size, TARGET.hidden_size))
    with torch.no_grad():  # non-trivial norms, so a swapped key would show
        for p in (model.input_layernorm, model.hidden_norm, model.post_attention_layernorm, model.norm):
            p.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("eagle3")
    model.export(path, dtype=torch.float32)
    return model, path


def _inference_head(model, path) -> Eagle3Draft:
    weights = load_weights(path, torch.float32, torch.device("cpu"))
    return Eagle3Draft(Eagle3Config.from_dir(path), weights, lambda ids: model.embed[ids], 4096, BLOCK, packed_dtype=None)


def test_checkpoint_uses_the_published_key_layout(head):
    _, path = head
    names = set(load_weights(path, torch.float32, torch.device("cpu")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= names
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 500
    loaded = Eagle3Config.from_dir(path)
    assert loaded.aux_layer_ids == TARGET.aux_layer_ids and loaded.target_hidden_size == 256


def test_inference_head_reproduces_training_unroll(head):
    """Step 0 over a whole sequence, then one drafting step, equal the TTT unroll's steps 0 and 1."""
    model, path = head
    draft = _inference_head(model, path)
    t = 21
    tokens = torch.randint(0, TARGET.vocab_size, (1, t + 2))
    features = torch.randn(1, t + 2, 3 * TARGET.hidden_size)
    with torch.no_grad():
        ref = model.unroll(features, tokens, torch.ones(1, t + 2, dtype=torch.bool), steps=2)
    layout = KVLayout("m", "float32", BLOCK, CacheShape(8, 2, 32), CacheShape(1, 2, 32))
    cache = allocate_cache(layout, layout.draft, 16, torch.device("cpu"))
    table = [5, 2, 9, 0, 7]
    seq = tokens[0].tolist()
    # Catch-up over positions 0..t-1: position p reads token p+1 and the features at p.
    batch = build_batch([SeqChunk(seq[1 : t + 1], 0, table, num_logits=t)], BLOCK, torch.device("cpu"))
    out = draft.forward(batch, draft.project(features[0, :t]), cache)
    assert torch.allclose(out.logits, ref[0][0, :t], atol=2e-4)
    # Drafting step at position t: reads token t+1 and its own last hidden state -> TTT step 1 at t-1.
    batch = build_batch([SeqChunk([seq[t + 1]], t, table, num_logits=1)], BLOCK, torch.device("cpu"))
    step = draft.forward(batch, out.hidden[t - 1 :], cache)
    assert torch.allclose(step.logits[0], ref[1][0, t - 1], atol=2e-4)


def test_a_head_with_its_own_embeddings_drafts_with_int8_weights(head):
    """Heads that ship their own embed_tokens (vLLM loads them too) drafted nothing on CPU's
    defaults: the int8 weights' quantization made the table Q8_0 blocks, which a lookup cannot use."""
    model, path = head
    weights = load_weights(path, torch.float32, torch.device("cpu")) | {"embed_tokens.weight": model.embed.clone()}
    config = Eagle3Config.from_dir(path)

    def target_embed(ids):
        raise AssertionError("the head has its own embeddings")

    int8 = Eagle3Draft(config, weights, target_embed, 4096, BLOCK, int8=True)
    exact = _inference_head(model, path)  # the target's embeddings: the same table
    layout = KVLayout("m", "float32", BLOCK, CacheShape(8, 2, 32), CacheShape(1, 2, 32))
    tokens = torch.randint(0, TARGET.vocab_size, (12,)).tolist()
    features = torch.randn(11, 3 * TARGET.hidden_size)
    logits = []
    for draft in (int8, exact):
        cache = allocate_cache(layout, layout.draft, 4, torch.device("cpu"))
        batch = build_batch([SeqChunk(tokens[1:], 0, [0, 1], num_logits=11)], BLOCK, torch.device("cpu"))
        logits.append(draft.forward(batch, draft.project(features), cache).logits)
    assert torch.corrcoef(torch.stack([logits[0].flatten(), logits[1].flatten()]))[0, 1] > 0.99


def test_d2t_maps_draft_ids_to_target_ids(head):
    model, path = head
    draft = _inference_head(model, path)
    ids = torch.arange(500)
    assert draft.to_target_ids([ids.tolist()]) == [model.draft_vocab.tolist()]


def test_training_can_continue_from_an_exported_head(head):
    model, path = head
    weights = load_weights(path, torch.float32, torch.device("cpu"))
    from tools.eagle3_training.model import exported_vocab

    assert torch.equal(exported_vocab(weights), model.draft_vocab)
    again = TrainableEagle3(TARGET, exported_vocab(weights), model.embed)
    again.load_exported(weights)
    for (name, a), b in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(a, b), name


def test_a_wider_head_round_trips_and_refuses_a_narrower_continuation(tmp_path):
    """A head trained with a wider MLP than the target's exports its width; the inference head
    loads it and computes what training computed; continuing it at another width is refused."""
    torch.manual_seed(1)
    vocab = torch.randperm(TARGET.vocab_size)[:500].sort().values
    model = TrainableEagle3(TARGET, vocab, torch.randn(TARGET.vocab_size, TARGET.hidden_size), intermediate_size=1280)
    model.export(tmp_path, dtype=torch.float32)
    assert json.loads((tmp_path / "config.json").read_text())["intermediate_size"] == 1280
    t = 12
    tokens = torch.randint(0, TARGET.vocab_size, (1, t + 1))
    features = torch.randn(1, t + 1, 3 * TARGET.hidden_size)
    with torch.no_grad():
        ref = model.unroll(features, tokens, torch.ones(1, t + 1, dtype=torch.bool), steps=1)
    draft = _inference_head(model, tmp_path)
    layout = KVLayout("m", "float32", BLOCK, CacheShape(8, 2, 32), CacheShape(1, 2, 32))
    cache = allocate_cache(layout, layout.draft, 4, torch.device("cpu"))
    batch = build_batch([SeqChunk(tokens[0, 1:].tolist(), 0, [1, 3], num_logits=t)], BLOCK, torch.device("cpu"))
    out = draft.forward(batch, draft.project(features[0, :t]), cache)
    assert torch.allclose(out.logits, ref[0][0, :t], atol=2e-4)
    narrower = TrainableEagle3(TARGET, vocab, model.embed)
    with pytest.raises(ValueError, match="--draft-intermediate-size 1280"):
        narrower.load_exported(load_weights(tmp_path, torch.float32, torch.device("cpu")))


def test_the_kv_only_write_matches_a_forward_from_mid_panel(tmp_path):
    """The native KV-only write starts its GEMM at the panel holding the first key feature. With 3
    heads of 48 the keys start 16 features into a panel of 32 (the AVX-512 build's; narrower builds
    start on a boundary): the entries must still be the bits a whole forward writes."""
    target = replace(TARGET, hidden_size=96, intermediate_size=128, num_heads=3, num_kv_heads=1, head_dim=48)
    torch.manual_seed(2)
    vocab = torch.randperm(target.vocab_size)[:300].sort().values
    TrainableEagle3(target, vocab, torch.randn(target.vocab_size, 96)).export(tmp_path, dtype=torch.float32)
    draft = _inference_head(TrainableEagle3(target, vocab, torch.randn(target.vocab_size, 96)), tmp_path)
    assert draft.native is not None
    layout = KVLayout("m", "float32", BLOCK, CacheShape(2, 1, 48), CacheShape(1, 1, 48))
    batch = build_batch([SeqChunk(list(range(5, 19)), 0, [2, 0], num_logits=1)], BLOCK, torch.device("cpu"))
    hidden = torch.randn(14, 96)
    caches = []
    for write in (lambda c: draft.forward(batch, hidden, c), lambda c: draft.write_kv(batch, hidden, c)):
        cache = allocate_cache(layout, layout.draft, 4, torch.device("cpu"))
        write(cache)
        caches.append(cache)
    assert caches[0].abs().sum() > 0 and torch.equal(caches[0], caches[1])


def test_a_deeper_head_round_trips_for_experiments_and_the_engine_refuses_it(tmp_path):
    """A head of two layers (a capacity experiment outside the published format) exports its
    extra layer and reloads to the same unroll; the engine names the layer count it serves."""
    from engine.config import ModelConfigError
    from tools.eagle3_training.model import exported_depth, exported_vocab

    torch.manual_seed(3)
    vocab = torch.randperm(TARGET.vocab_size)[:500].sort().values
    model = TrainableEagle3(TARGET, vocab, torch.randn(TARGET.vocab_size, TARGET.hidden_size), num_layers=2)
    with torch.no_grad():
        model.deeper[0].input_layernorm.uniform_(0.5, 1.5)
    model.export(tmp_path, dtype=torch.float32)
    weights = load_weights(tmp_path, torch.float32, torch.device("cpu"))
    assert exported_depth(weights) == 2 and "layers.1.self_attn.q_proj.weight" in weights
    again = TrainableEagle3(TARGET, exported_vocab(weights), model.embed, num_layers=2)
    again.load_exported(weights)
    tokens = torch.randint(0, TARGET.vocab_size, (1, 9))
    features = torch.randn(1, 9, 3 * TARGET.hidden_size)
    valid = torch.ones(1, 9, dtype=torch.bool)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model.unroll(features, tokens, valid, 2),
                                                     again.unroll(features, tokens, valid, 2)))
    with pytest.raises(ValueError, match="--draft-layers 2"):
        TrainableEagle3(TARGET, vocab, model.embed).load_exported(weights)
    with pytest.raises(ModelConfigError, match="num_hidden_layers 2"):
        Eagle3Config.from_dir(tmp_path)
    assert head_aux_layer_ids(tmp_path) == TARGET.aux_layer_ids  # measured and continued all the same
