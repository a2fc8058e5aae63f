"""The Llama-family forward pass (Llama, Mistral, Qwen2, Qwen3) over a flat, paged batch.

One forward handles any mix of prefill chunks, single-token decodes and multi-token
speculative verification spans: tokens of all sequences are concatenated into one [T, H]
activation, every projection runs once over all T rows, and only attention looks at sequence
boundaries (through `AttentionMetadata`). Logits are computed only at the requested rows,
and on request the residual stream entering the EAGLE3 auxiliary layers is returned.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import cpu_kernels
from engine.attention import AttentionMetadata, native_paged_attention, paged_attention, write_kv
from engine.batch import ForwardBatch
from engine.config import ModelConfig, ModelConfigError
from engine.layers import Linear, Rotary, rms_norm, share_huge_pages
from engine.native_decoder import NativeDecoder
from engine.parallel import TensorParallel
from engine.quant import QuantizedTensor, cat_rows


AttentionFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


def attention_for(config: ModelConfig, device: torch.device, dtype: torch.dtype, block_size: int) -> AttentionFn:
    """The Triton kernel on CUDA; on CPU the C kernel for short queries where it applies (fp32,
    head_dim a multiple of 16), else the torch path."""
    if device.type == "cuda":
        from engine.triton_attention import HEAD_DIMS, triton_paged_attention

        if config.head_dim not in HEAD_DIMS:  # refused at load, not at every step's forward
            raise ModelConfigError(f"head_dim {config.head_dim}: the CUDA attention kernel takes "
                                   f"{', '.join(map(str, HEAD_DIMS))}; run this model on cpu")
        return triton_paged_attention
    if dtype == torch.float32 and cpu_kernels.attention_supported(
        config.num_heads, config.num_kv_heads, config.head_dim, block_size
    ):
        return native_paged_attention
    return paged_attention


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [n, vocab] fp32
    aux_hidden: torch.Tensor | None  # [T, len(aux_layer_ids) * hidden]: inputs of those layers, concatenated


class DecoderLayer:
    """Attention + SwiGLU MLP with residuals. The caller normalises the attention input: the
    target feeds rms_norm(x); the EAGLE3 midlayer feeds its 2H-wide [embedding, hidden] input."""

    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], attend: AttentionFn,
                 tp: TensorParallel = TensorParallel(), packed_dtype: torch.dtype | None = None):
        """config: the shapes this rank computes (heads and MLP already divided by the TP size);
        packed_dtype: see Linear."""
        self.config = config
        self.attend = attend
        self.tp = tp
        q, k, v = w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"], w["self_attn.v_proj.weight"]
        bias = None
        if config.attention_bias:
            bias = torch.cat([w["self_attn.q_proj.bias"], w["self_attn.k_proj.bias"], w["self_attn.v_proj.bias"]])
        # Fused projections: one GEMM reads all of q/k/v (and gate/up) weights in one pass.
        self.qkv = Linear(cat_rows([q, k, v]), bias, packed_dtype)
        # Llama's attention_bias covers o_proj too (Qwen2's q/k/v only); mlp_bias all three MLP matrices.
        self.o = Linear(w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias"), packed_dtype)
        gate_up_bias = torch.cat([w["mlp.gate_proj.bias"], w["mlp.up_proj.bias"]]) if "mlp.gate_proj.bias" in w else None
        self.gate_up = Linear(cat_rows([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]), gate_up_bias, packed_dtype)
        self.down = Linear(w["mlp.down_proj.weight"], w.get("mlp.down_proj.bias"), packed_dtype)
        self.post_norm = w["post_attention_layernorm.weight"]
        self.q_norm = w.get("self_attn.q_norm.weight")
        self.k_norm = w.get("self_attn.k_norm.weight")
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5

    @property
    def linears(self) -> tuple[Linear, ...]:
        """The layer's matrices in the order a forward runs them."""
        return self.qkv, self.o, self.gate_up, self.down

    def __call__(self, residual, attn_input, cos, sin, layer_cache, meta: AttentionMetadata) -> torch.Tensor:
        c = self.config
        t = residual.shape[0]
        q, k, v = self.qkv(attn_input).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, c.num_heads, c.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, c.rms_norm_eps)
        self._store_kv(k, v, cos, sin, layer_cache, meta)
        q = Rotary.apply(q, cos, sin)
        x = residual + self.tp.all_reduce(self.o(self.attend(q, layer_cache, meta, self.scale)))
        gate, up = self.gate_up(rms_norm(x, self.post_norm, c.rms_norm_eps)).chunk(2, dim=-1)
        return x + self.tp.all_reduce(self.down(torch.nn.functional.silu(gate) * up))

    def write_kv_only(self, attn_input, cos, sin, layer_cache, meta: AttentionMetadata) -> None:
        """Only the cache's keys and values at the batch's slots: the same values a full call
        writes, without the queries, attention and MLP (for positions whose output is not needed)."""
        k, v = self.qkv(attn_input, first_output=self.q_size).split([self.kv_size, self.kv_size], dim=-1)
        self._store_kv(k, v, cos, sin, layer_cache, meta)

    def _store_kv(self, k, v, cos, sin, layer_cache, meta: AttentionMetadata) -> None:
        c = self.config
        t = k.shape[0]
        k = k.view(t, c.num_kv_heads, c.head_dim)
        if self.k_norm is not None:
            k = rms_norm(k, self.k_norm, c.rms_norm_eps)
        write_kv(layer_cache, meta, Rotary.apply(k, cos, sin), v.view(t, c.num_kv_heads, c.head_dim))


class CausalLM:
    """Weights are given HF-named (`model.layers.0.self_attn.q_proj.weight`, ...), already
    sharded for `tp` (see engine.parallel); `config` is the whole model's."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int, block_size: int,
                 tp: TensorParallel = TensorParallel()):
        self.config, self.tp = config, tp
        local = tp.local_config(config)
        embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"]
        self.dtype = self.norm.dtype  # the activations' (weights may be quantized)
        attend = attention_for(local, self.norm.device, self.dtype, block_size)
        layer_weights = [{k.removeprefix(f"model.layers.{i}."): v for k, v in weights.items()
                          if k.startswith(f"model.layers.{i}.")} for i in range(config.num_layers)]
        self.layers = [DecoderLayer(local, w, attend, tp) for w in layer_weights]
        self.input_norms = [w["input_layernorm.weight"] for w in layer_weights]
        tied = config.tie_word_embeddings
        if not tied and "lm_head.weight" not in weights:
            raise ModelConfigError("tie_word_embeddings is false but the weights hold no lm_head.weight (a shard or "
                                   "the index missing?); set tie_word_embeddings: true only if the head is the embedding")
        self.lm_head = Linear((embed if tied else weights["lm_head.weight"])[tp.vocab_slice(config.vocab_size)])
        # A tied, unsharded head is also the embedding table (read through the head's layout,
        # stored once); a sharded head holds a vocabulary slice, so the table stays whole.
        self.embed = None if tied and tp.size == 1 else embed
        self.rotary = Rotary(config, max_positions, self.norm.device, self.dtype)
        self.aux_layer_ids = config.aux_layer_ids
        share_huge_pages([lin for layer in self.layers for lin in layer.linears] + [self.lm_head])
        self.native = NativeDecoder.bind(self.layers, self.input_norms, self.rotary, self.norm, tp.size)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed is None:
            return self.lm_head.rows(ids).to(self.dtype)
        if isinstance(self.embed, QuantizedTensor):
            return self.embed[ids].dequantize(self.dtype)
        return self.embed[ids]

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> ForwardOutput:
        """kv_cache: [num_blocks, num_layers, 2, block_size, kv_heads, row] (engine/kv_layout.py)."""
        x = self.embed_tokens(batch.input_ids)
        wanted = sorted(i for i in self.aux_layer_ids if i < len(self.layers)) if batch.return_aux else []
        if self.native is not None:
            aux = self.native.layers(x, batch, kv_cache, wanted)  # x updated in place
            aux = [aux] if wanted else []
        else:
            x, aux = self._layers(x, batch, kv_cache, wanted)
        if batch.return_aux:  # "entering layer L" is the last layer's output (self-distillation reads it,
            aux += [x] * self.aux_layer_ids.count(len(self.layers))  # after a head's own features)
        if self.native is not None:
            h = self.native.final_norm(x, batch.logits_indices)
        else:
            h = rms_norm(x.index_select(0, batch.logits_indices), self.norm, self.config.rms_norm_eps)
        logits = self.tp.all_gather_last(self.lm_head(h).float())
        return ForwardOutput(logits, torch.cat(aux, dim=-1) if aux else None)

    def _layers(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                wanted: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The torch layer loop (the reference): the last layer's output, and the residual
        stream entering the layers `wanted`."""
        cos, sin = self.rotary.tables(batch.positions)
        aux = []
        for i, layer in enumerate(self.layers):
            if i in wanted:
                aux.append(x)
            attn_input = rms_norm(x, self.input_norms[i], self.config.rms_norm_eps)
            x = layer(x, attn_input, cos, sin, kv_cache[:, i], batch.attention)
        return x, aux
