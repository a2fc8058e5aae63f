"""The EAGLE3 draft as a trainable torch module, with training-time-test (TTT) unrolling.

Same math and the same checkpoint keys as the inference head (engine/spec/eagle3_model.py), in a dense
[batch, time] layout with autograd. TTT (EAGLE-3, Li et al. 2025) trains the head on its own
outputs: unroll step k feeds each position the hidden state the head produced at step k-1 and
the token k places further on, and its attention sees the step-0 keys causally plus, for every
earlier unroll step j >= 1, the key that step wrote at the same index -- exactly the cache the
head has at inference after drafting k tokens from that position.
"""

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from engine.config import ModelConfig
from engine.conversions import replace_durably, write_text_durably
from engine.layers import rope_inv_freq
from engine.spec.eagle3_model import draft_vocab_ids


def _add_block(module: nn.Module, c: ModelConfig, in_features: int, intermediate_size: int) -> None:
    """A decoder layer's projections and post-attention norm, as `module`'s attributes."""
    h = c.hidden_size
    module.post_attention_layernorm = nn.Parameter(torch.ones(h))
    module.q_proj = nn.Linear(in_features, c.num_heads * c.head_dim, bias=False)
    module.k_proj = nn.Linear(in_features, c.num_kv_heads * c.head_dim, bias=False)
    module.v_proj = nn.Linear(in_features, c.num_kv_heads * c.head_dim, bias=False)
    module.o_proj = nn.Linear(c.num_heads * c.head_dim, h, bias=False)
    module.gate_proj = nn.Linear(h, intermediate_size, bias=False)
    module.up_proj = nn.Linear(h, intermediate_size, bias=False)
    module.down_proj = nn.Linear(intermediate_size, h, bias=False)


def _block_params(prefix: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """What `_add_block` made, under a decoder layer's checkpoint names after `prefix`."""
    w = {f"{prefix}.post_attention_layernorm.weight": module.post_attention_layernorm}
    for name in ("q", "k", "v", "o"):
        w[f"{prefix}.self_attn.{name}_proj.weight"] = getattr(module, f"{name}_proj").weight
    for name in ("gate", "up", "down"):
        w[f"{prefix}.mlp.{name}_proj.weight"] = getattr(module, f"{name}_proj").weight
    return w


class _DeeperLayer(nn.Module):
    """A layer after the midlayer (a head deeper than EAGLE3's one): it reads the hidden state alone."""

    def __init__(self, c: ModelConfig, intermediate_size: int):
        super().__init__()
        self.input_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        _add_block(self, c, c.hidden_size, intermediate_size)


class TrainableEagle3(nn.Module):
    def __init__(self, target: ModelConfig, draft_vocab: torch.Tensor, target_embed: torch.Tensor,
                 intermediate_size: int | None = None, num_layers: int = 1,
                 aux_layer_ids: tuple[int, ...] | None = None):
        """draft_vocab: [N] target token ids the head predicts (sorted); target_embed: [V, H], frozen;
        intermediate_size: the MLP width (default: the target's; wider is more capacity at a few
        more multiply-adds a draft row); num_layers: the midlayer, then plain decoder layers (more
        than one is outside the published format: for capacity experiments, not served);
        aux_layer_ids: the target layers whose inputs are the features (None: EAGLE3's default)."""
        super().__init__()
        h, c = target.hidden_size, target
        self.target = target
        if intermediate_size is not None and intermediate_size < 1 or num_layers < 1:
            raise ValueError(f"the head's MLP width and layers must be positive (got {intermediate_size}, {num_layers})")
        self.intermediate_size = c.intermediate_size if intermediate_size is None else intermediate_size
        self.aux_layer_ids = target.check_aux_layer_ids(tuple(aux_layer_ids)) if aux_layer_ids else target.aux_layer_ids
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        _add_block(self, c, 2 * h, self.intermediate_size)
        self.deeper = nn.ModuleList(_DeeperLayer(c, self.intermediate_size) for _ in range(num_layers - 1))
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, draft_vocab.numel(), bias=False)
        self.register_buffer("embed", target_embed, persistent=False)
        self.register_buffer("draft_vocab", draft_vocab)
        t2d_index = torch.full((target.vocab_size,), -1, dtype=torch.long)
        t2d_index[draft_vocab] = torch.arange(draft_vocab.numel())
        self.register_buffer("t2d_index", t2d_index, persistent=False)  # target id -> draft id (-1: none)
        self.register_buffer("inv_freq", rope_inv_freq(target), persistent=False)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # In fp32, as at inference: under bf16 autocast the activations arrive in bf16.
        return F.rms_norm(x.float(), (x.shape[-1],), w, self.target.rms_norm_eps).to(x.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, heads, T, D]; positions: [T]."""
        angles = torch.outer(positions.float(), self.inv_freq)
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def unroll(self, features: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Draft logits [B, T, N] for each of `steps` unroll steps (see unroll_normed)."""
        return [self.lm_head(normed) for normed in self.unroll_normed(features, tokens, valid, steps)]

    def unroll_normed(self, features: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
                      steps: int) -> list[torch.Tensor]:
        """The head's final-normed output [B, T, H] (what its lm_head reads) for each of `steps`
        unroll steps.

        features: [B, T, 3H] target features at each position; tokens: [B, T]; valid: [B, T] bool,
        positions holding real tokens. Step k at index t reads token t+1+k and predicts t+2+k.
        """
        b, t, _ = features.shape
        hidden = self.fc(features)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=features.device))
        key_ok = causal[None, None] & valid[:, None, None, :]  # [B, 1, T, T]
        caches = [([], []) for _ in range(1 + len(self.deeper))]  # each layer's keys and values per step
        normed = []
        for k in range(steps):
            ids = F.pad(tokens[:, 1 + k :], (0, 1 + k))  # token t+1+k (0 past the end; masked by labels)
            x = torch.cat([self._rms(self.embed[ids], self.input_layernorm), self._rms(hidden, self.hidden_norm)], -1)
            positions = torch.arange(k, t + k, device=features.device)
            hidden = self._block(self, x, hidden, positions, *caches[0], key_ok)
            for layer, cache in zip(self.deeper, caches[1:]):
                hidden = self._block(layer, self._rms(hidden, layer.input_layernorm), hidden, positions, *cache, key_ok)
            normed.append(self._rms(hidden, self.norm))
        return normed

    def _block(self, layer: nn.Module, x: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
               keys: list, values: list, key_ok: torch.Tensor) -> torch.Tensor:
        """hidden after `layer`'s attention (input x) and MLP; this step's keys and values join the
        layer's TTT cache (keys, values)."""
        c = self.target
        b, t = x.shape[:2]
        q = layer.q_proj(x).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        kk = layer.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = layer.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, kk = self._rope(q, positions), self._rope(kk, positions)
        rep = c.num_heads // c.num_kv_heads
        keys.append(kk.repeat_interleave(rep, 1))
        values.append(v.repeat_interleave(rep, 1))
        attn = self._attend(q, keys, values, key_ok)
        hidden = hidden + layer.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        mlp_in = self._rms(hidden, layer.post_attention_layernorm)
        return hidden + layer.down_proj(F.silu(layer.gate_proj(mlp_in)) * layer.up_proj(mlp_in))

    @staticmethod
    def _attend(q, keys, values, key_ok) -> torch.Tensor:
        """Step-0 keys causally, later steps' keys only at the query's own index (the TTT cache).

        The [B, heads, T, T] scores are the step's largest tensors: they are scaled through q,
        split (not sliced: a slice's backward zero-fills a whole copy) and, under autocast,
        kept in bf16 through the softmax (which accumulates in fp32; the matmul after it reads
        bf16 anyway)."""
        t = q.shape[2]
        q = q * (1.0 / math.sqrt(q.shape[-1]))
        causal = (q @ keys[0].transpose(-1, -2)).masked_fill(~key_ok, float("-inf"))
        own = [(q * kj).sum(-1, keepdim=True).to(causal.dtype) for kj in keys[1:]]
        with torch.autocast("cpu", enabled=False):
            probs = torch.softmax(torch.cat([causal, *own], -1), dim=-1)
        to_causal, to_own = probs.split([t, len(own)], -1)
        out = to_causal @ values[0]
        for j, vj in enumerate(values[1:]):
            out = out + to_own[..., j : j + 1] * vj
        return out

    def labels(self, tokens: torch.Tensor, loss_mask: torch.Tensor, step: int) -> torch.Tensor:
        """Draft-vocabulary ids of token t+2+step, or -100 where not trained on."""
        target = F.pad(tokens[:, 2 + step :], (0, 2 + step))
        mask = F.pad(loss_mask[:, 2 + step :], (0, 2 + step), value=False)
        ids = self.t2d_index[target]
        return torch.where(mask & (ids >= 0), ids, torch.full_like(ids, -100))

    def _checkpoint_params(self) -> dict[str, torch.Tensor]:
        """Trained tensors under their published checkpoint names."""
        w = {
            "fc.weight": self.fc.weight,
            "midlayer.input_layernorm.weight": self.input_layernorm,
            "midlayer.hidden_norm.weight": self.hidden_norm,
            "norm.weight": self.norm,
            "lm_head.weight": self.lm_head.weight,
        } | _block_params("midlayer", self)
        for i, layer in enumerate(self.deeper, start=1):  # outside the published format (see __init__)
            w |= {f"layers.{i}.input_layernorm.weight": layer.input_layernorm} | _block_params(f"layers.{i}", layer)
        return w

    def export(self, out_dir: Path, dtype: torch.dtype = torch.float16) -> None:
        """config.json + model.safetensors in the published EAGLE3 checkpoint layout."""
        c, n = self.target, self.draft_vocab.numel()
        tensors = {k: v.detach().to(dtype).contiguous() for k, v in self._checkpoint_params().items()}
        tensors["d2t"] = (self.draft_vocab - torch.arange(n)).contiguous()
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[self.draft_vocab] = True
        tensors["t2d"] = t2d
        out_dir.mkdir(parents=True, exist_ok=True)
        # Each file whole or the old one (a run exports into its directory at every session's end).
        save_file(tensors, str(out_dir / "model.safetensors.tmp"))
        replace_durably(out_dir / "model.safetensors.tmp", out_dir / "model.safetensors")
        config = eagle3_config(c, n, self.intermediate_size, 1 + len(self.deeper), self.aux_layer_ids)
        write_text_durably(out_dir / "config.json", json.dumps(config, indent=2) + "\n")

    def load_exported(self, weights: dict[str, torch.Tensor]) -> None:
        """Start from an exported head (same target and draft vocabulary), e.g. to train it further."""
        for flag, have, mine in (("--draft-intermediate-size", exported_mlp_width(weights), self.intermediate_size),
                                 ("--draft-layers", exported_depth(weights), 1 + len(self.deeper))):
            if have != mine:
                raise ValueError(f"the head to continue from has {flag} {have}, this one {mine}: give {flag} {have} "
                                 f"(or train from scratch)")
        with torch.no_grad():
            for name, param in self._checkpoint_params().items():
                param.copy_(weights[name].float())


def exported_vocab(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The draft vocabulary (target ids, sorted) of an exported head."""
    return draft_vocab_ids(weights["d2t"])


def exported_mlp_width(weights: dict[str, torch.Tensor]) -> int:
    """The MLP width of an exported head."""
    return weights["midlayer.mlp.up_proj.weight"].shape[0]


def exported_depth(weights: dict[str, torch.Tensor]) -> int:
    """The layers of an exported head: the midlayer and any after it."""
    return 1 + sum(name.startswith("layers.") and name.endswith(".input_layernorm.weight") for name in weights)


def eagle3_config(c: ModelConfig, draft_vocab_size: int, intermediate_size: int, num_layers: int,
                  aux_layer_ids: tuple[int, ...]) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": c.hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)},
    }
