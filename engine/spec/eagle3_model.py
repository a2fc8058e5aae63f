"""The EAGLE3 draft head, in the checkpoint format vLLM and SGLang load.

Checkpoint (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): `config.json` with
`architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, optionally `target_hidden_size`
and `eagle_config.eagle_aux_hidden_state_layer_ids`; weights `fc.weight [H, 3*H_target]`,
`midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read 2H inputs), `midlayer.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight [draft_vocab, H]`, `d2t [draft_vocab]` (target id = draft id +
d2t[draft id]) and `t2d [vocab]`; token embeddings are the target's unless the checkpoint has
its own `embed_tokens.weight`.

One draft step at position p reads the token at p+1 and a hidden state: the target's auxiliary
features at p projected by `fc` (for positions the target has verified), or the draft's own
output hidden state from position p-1 (while drafting ahead). It writes its K/V into the draft
cache (same block tables as the target) and predicts the token at p+2.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig, ModelConfigError
from engine.layers import Linear, Rotary, rms_norm, share_huge_pages
from engine.batch import ForwardBatch
from engine.model import DecoderLayer, attention_for
from engine.native_decoder import NativeDecoder
from engine.quant import quantize_matrices

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # shapes of the single decoder layer (num_layers = 1)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the target's default (2, L//2, L-3)

    @classmethod
    def from_dir(cls, path: Path) -> "Eagle3Config":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ModelConfigError(f"EAGLE3 draft {path}: no config.json found")
        raw = json.loads(file.read_text())
        archs = raw.get("architectures") or []
        if not any(a in EAGLE3_ARCHITECTURES for a in archs):
            raise ModelConfigError(
                f"EAGLE3 draft {path}: architectures {archs or '(missing)'} not supported; "
                f"supported: {', '.join(EAGLE3_ARCHITECTURES)}"
            )
        if raw.get("num_hidden_layers", 1) != 1:
            raise ModelConfigError(f"EAGLE3 draft {path}: num_hidden_layers {raw['num_hidden_layers']}; the engine "
                                   "serves EAGLE3 heads of one layer (the published format)")
        layer = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
        return cls(
            layer=layer,
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size") or raw["hidden_size"],
            aux_layer_ids=head_aux_layer_ids(raw),
        )


def head_aux_layer_ids(config: dict | Path) -> tuple[int, ...] | None:
    """The target layers an EAGLE3 head's config.json (or its parsed dict) names as its features, at the
    top level or under eagle_config (None: the target's default); read for heads of any shape."""
    raw = json.loads((Path(config) / "config.json").read_text()) if not isinstance(config, dict) else config
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return tuple(aux) if aux else None


def draft_vocab_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of each draft id, from a checkpoint's d2t (target id = draft id + d2t[draft id])."""
    return torch.arange(len(d2t), device=d2t.device) + d2t.long()


@dataclass
class DraftOutput:
    hidden: torch.Tensor  # [T, H] pre-norm output hidden states (inputs of the next draft step)
    logits: torch.Tensor  # [n, draft_vocab] at batch.logits_indices


class Eagle3Draft:
    def __init__(self, config: Eagle3Config, weights: dict[str, torch.Tensor], target_embed, max_positions: int,
                 block_size: int, packed_dtype: torch.dtype | None = torch.bfloat16, int8: bool = False):
        c = config.layer
        self.config = config
        w = {k.removeprefix("model."): v for k, v in weights.items()}
        # The draft's weights are read K times per step, and their precision cannot change the
        # output (verification decides): by default bf16 panels halve their memory traffic on CPU;
        # int8 (the quantized target's engines) makes its matrices Q8_0 blocks with int8
        # activations, a quarter of fp32's bytes through the target's own kernels. (A head's own
        # embedding table stays as it is: rows are looked up, never multiplied.)
        if int8:
            table = {k: w.pop(k) for k in ["embed_tokens.weight"] if k in w}
            w = quantize_matrices(w) | table
        packed = packed_dtype
        self.fc = Linear(w["fc.weight"], packed_dtype=packed)
        self.input_norm = w["midlayer.input_layernorm.weight"]
        self.hidden_norm = w["midlayer.hidden_norm.weight"]
        self.norm = w["norm.weight"]
        device, dtype = self.norm.device, self.norm.dtype
        mid = {k.removeprefix("midlayer."): v for k, v in w.items() if k.startswith("midlayer.")}
        self.midlayer = DecoderLayer(c, mid, attention_for(c, device, dtype, block_size), packed_dtype=packed)
        self.lm_head = Linear(w["lm_head.weight"], packed_dtype=packed)
        # Target id of each draft id: one lookup per drafted level.
        self.draft_to_target = draft_vocab_ids(w["d2t"]).tolist() if "d2t" in w else None
        own_embed = w.get("embed_tokens.weight")
        self.embed = (lambda ids: own_embed[ids]) if own_embed is not None else target_embed
        self.rotary = Rotary(c, max_positions, device, dtype)
        share_huge_pages([self.fc, *self.midlayer.linears, self.lm_head])
        self.native = NativeDecoder.bind([self.midlayer], [self.hidden_norm], self.rotary, self.norm, tp_size=1,
                                         embed_norm=self.input_norm)

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Target auxiliary features [T, 3*H_target] -> draft hidden inputs [T, H]."""
        return self.fc(aux_hidden)

    def to_target_ids(self, draft_ids: list[list[int]]) -> list[list[int]]:
        if self.draft_to_target is None:
            return draft_ids
        return [[self.draft_to_target[i] for i in row] for row in draft_ids]

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, kv_cache: torch.Tensor) -> DraftOutput:
        """batch.input_ids hold the token *after* each position; hidden: [T, H] inputs (see project).

        kv_cache: the draft cache [num_blocks, 1, 2, block_size, kv_heads, row] (engine/kv_layout.py)."""
        if self.native is not None:  # the midlayer as one native call, as the target's layers run
            h = hidden.clone(memory_format=torch.contiguous_format)  # updated in place
            self.native.layers(h, batch, kv_cache, [], self.embed(batch.input_ids).contiguous())
            out = self.native.final_norm(h, batch.logits_indices)
        else:
            cos, sin = self.rotary.tables(batch.positions)
            h = self.midlayer(hidden, self._attention_input(batch, hidden), cos, sin, kv_cache[:, 0], batch.attention)
            out = rms_norm(h.index_select(0, batch.logits_indices), self.norm, self.config.layer.rms_norm_eps)
        return DraftOutput(hidden=h, logits=self.lm_head(out).float())

    def write_kv(self, batch: ForwardBatch, hidden: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """What `forward` writes into the draft cache, and nothing else: about a tenth of its work.
        For positions the draft must only remember (their output hidden states are not needed)."""
        if self.native is not None:
            self.native.write_kv(hidden, batch, kv_cache, self.embed(batch.input_ids).contiguous())
            return
        cos, sin = self.rotary.tables(batch.positions)
        self.midlayer.write_kv_only(self._attention_input(batch, hidden), cos, sin, kv_cache[:, 0], batch.attention)

    def _attention_input(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        eps = self.config.layer.rms_norm_eps
        return torch.cat([rms_norm(self.embed(batch.input_ids), self.input_norm, eps),
                          rms_norm(hidden, self.hidden_norm, eps)], dim=-1)
