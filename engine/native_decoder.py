"""Decoder layers as one native call (engine/csrc/decoder_step.c), for every CPU fp32 forward:
the target's prefill chunks, decode steps and speculative verification alike, and the EAGLE3
draft's midlayer (its attention input [norm(embedding), norm(hidden)], 2H wide, normed in C too).

The torch layer loop in model.py stays the readable reference (and runs CUDA, bf16, tensor
parallelism and Qwen3's q/k norms); this path runs the same GEMM and attention kernels with the
norms, RoPE, KV writes, SiLU and residual adds in C, so Python runs once per forward instead of
~25 ops per layer. One path for every batch also means each row is computed the same whether it
is decoded alone, verified in a span or prefilled in a chunk: with int8 activations a last-bit
difference between two paths could otherwise change a token. Tests hold the two paths to the
same logits.
"""

import ctypes

import torch

from engine.attention import native_paged_attention
from engine.batch import ForwardBatch
from engine.cpu_kernels import CpuKernels, kv_type
from engine.quant import KERNEL_FORMAT

_FORMATS = {torch.float32: 0, torch.bfloat16: 1}  # csrc/kernels.h; quantized: KERNEL_FORMAT (4, 8), +1 for int8 dots


class _Matrix(ctypes.Structure):
    _fields_ = [("format", ctypes.c_int), ("weight", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Matrix), ("o", _Matrix), ("gate_up", _Matrix), ("down", _Matrix),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                                  "block_size")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cache", ctypes.c_void_p), ("cache_type", ctypes.c_int),
        ("s_block", ctypes.c_long), ("s_layer", ctypes.c_long), ("s_kv", ctypes.c_long), ("s_offset", ctypes.c_long),
        ("attn_embed", ctypes.c_void_p), ("embed_norm", ctypes.c_void_p)]


class _Batch(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("tokens", "num_seqs", "max_blocks")] + [
        (name, ctypes.c_void_p) for name in ("positions", "slot_blocks", "slot_offsets", "block_tables",
                                             "query_start_loc", "context_lens", "span_masks", "cos", "sin",
                                             "timings")]


def _matrix(linear, first_panel: int = 0) -> _Matrix:
    """linear's packed weights from panel `first_panel` on (the output features from that panel's first)."""
    if linear.qtype is None:
        fmt = _FORMATS[linear.weight.dtype]
    else:  # csrc/kernels.h: PD_Q4 = 4, PD_Q4_I8 = 5, PD_Q8 = 8, PD_Q8_I8 = 9
        fmt = KERNEL_FORMAT[linear.qtype] + (1 if linear.int8_dot else 0)
    first = first_panel * linear.kernels.pack_width
    bias = linear.bias[first:].data_ptr() if linear.bias is not None else None
    return _Matrix(fmt, linear.weight[first_panel:].data_ptr(), bias)


class NativeDecoder:
    """Bound to decoder layers (their packed weights stay owned by the layers), with each one's
    input norm (the EAGLE3 midlayer's: its hidden norm), the rotary tables, the final norm, and for
    the EAGLE3 midlayer the norm of the embeddings beside its hidden input."""

    @classmethod
    def bind(cls, layers: list, input_norms: list, rotary, norm: torch.Tensor, tp_size: int,
             embed_norm: torch.Tensor | None = None) -> "NativeDecoder | None":
        """A NativeDecoder for `layers`, or None unless they have CPU fp32 activations, one rank,
        no q/k norms, every projection on the packed kernels of one build, and the C attention kernel."""
        linears = [lin for layer in layers for lin in layer.linears]
        supported = (norm.dtype == torch.float32 and tp_size == 1 and norm.device.type == "cpu"
                     and all(layer.q_norm is None and layer.attend is native_paged_attention for layer in layers)
                     and all(lin.packed for lin in linears) and len({id(lin.kernels) for lin in linears}) == 1)
        return cls(layers, input_norms, rotary, norm, embed_norm) if supported else None

    def __init__(self, layers: list, input_norms: list, rotary, norm: torch.Tensor,
                 embed_norm: torch.Tensor | None = None):
        self.rotary, self.norm, self.embed_norm = rotary, norm, embed_norm
        self.num_layers = len(layers)
        first = layers[0]
        self.kernels: CpuKernels = first.qkv.kernels
        c = first.config  # the rank-local shapes (one rank here)
        self.config = c
        self._layers = (_Layer * len(layers))(*[
            _Layer(_matrix(layer.qkv), _matrix(layer.o), _matrix(layer.gate_up), _matrix(layer.down),
                   norm.data_ptr(), layer.post_norm.data_ptr())
            for layer, norm in zip(layers, input_norms)])
        q_size, width = c.num_heads * c.head_dim, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self._scratch_per_row = (max(q_size, 2 * c.hidden_size, c.intermediate_size)
                                 + max(width, 2 * c.intermediate_size) + q_size + c.hidden_size)
        self._first_qkv = first.qkv  # write_kv reads its key and value features
        # Set to float64 zeros(3) to add up seconds spent in the layers' GEMMs, their attention
        # and the whole layer loop (benchmarks read it; None costs nothing).
        self.timings: torch.Tensor | None = None

    def layers(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, aux_ids: list[int],
               embed: torch.Tensor | None = None) -> torch.Tensor:
        """Runs every layer over x [T, hidden] in place; returns the residual stream entering
        the layers `aux_ids` (sorted, < number of layers) as [T, len(aux_ids) * hidden].
        embed: EAGLE3's midlayer (bound with an embed_norm): embeddings [T, hidden] fp32,
        contiguous; the first layer's attention input is then [rmsnorm(embed) * embed_norm,
        rmsnorm(x) * its input norm]."""
        model, run = self._structs(x, batch, kv_cache, embed)
        c, t = self.config, x.shape[0]
        aux = torch.empty(t, len(aux_ids) * c.hidden_size)
        ids = (ctypes.c_int * len(aux_ids))(*aux_ids)
        scratch = torch.empty(t * self._scratch_per_row)
        self.kernels.decoder_layers(ctypes.byref(model), self._layers, self.num_layers, ctypes.byref(run),
                                    x, aux, ids, len(aux_ids), scratch)
        return aux

    def write_kv(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                 embed: torch.Tensor | None = None) -> None:
        """What `layers` writes into the first layer's cache for x [T, hidden] (embed as there), and
        nothing else: the same bits, without queries, attention, MLP or the layers after it."""
        x = x.contiguous()
        model, run = self._structs(x, batch, kv_cache, embed)
        c, t = self.config, x.shape[0]
        # The qkv GEMM from the panel holding the first key feature; `skip` features before it.
        panel, skip = self._first_qkv.panel_of(c.num_heads * c.head_dim)
        scratch = torch.empty(t * (2 * c.hidden_size + skip + 2 * c.num_kv_heads * c.head_dim))
        self.kernels.write_kv(ctypes.byref(model), self._layers, ctypes.byref(_matrix(self._first_qkv, panel)), skip,
                              ctypes.byref(run), x, scratch)

    def _structs(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                 embed: torch.Tensor | None) -> tuple[_Model, _Batch]:
        """The C structures describing the model, its cache and the batch of x's rows. They point
        into the caller's tensors (alive for the call) and into copies they keep themselves."""
        if embed is not None and self.embed_norm is None:
            raise ValueError("NativeDecoder: embeddings given, but no embed_norm was bound")
        t = batch.positions.shape[0]
        bad_embed = embed is not None and (embed.shape[0] != t or embed.dtype != torch.float32 or not embed.is_contiguous())
        bad_x = x.shape != (t, self.config.hidden_size) or x.dtype != torch.float32 or not x.is_contiguous()
        if bad_x or bad_embed:  # the C loops would run past x's, or the embeddings', rows (x is written in place)
            raise ValueError(f"NativeDecoder: x is {tuple(x.shape)} {x.dtype} (fp32, contiguous), the embeddings "
                             f"{None if embed is None else tuple(embed.shape)} (fp32, contiguous), for {t} positions")
        c, meta = self.config, batch.attention
        cache_type = kv_type(kv_cache, c.head_dim, c.num_kv_heads)  # checks the rows C writes into
        s_block, s_layer, s_kv, s_offset = kv_cache.stride()[:4]
        model = _Model(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                       kv_cache.shape[3], c.rms_norm_eps, c.head_dim**-0.5, kv_cache.data_ptr(),
                       cache_type,
                       s_block, s_layer, s_kv, s_offset,
                       embed.data_ptr() if embed is not None else None,
                       self.embed_norm.data_ptr() if embed is not None else None)
        rotary = self.rotary
        positions = batch.positions.contiguous()
        tables = meta.block_tables.contiguous()
        run = _Batch(t, meta.context_lens.shape[0], tables.shape[1],
                     positions.data_ptr(), meta.slot_blocks.data_ptr(), meta.slot_offsets.data_ptr(),
                     tables.data_ptr(), meta.query_start_loc.data_ptr(), meta.context_lens.data_ptr(),
                     meta.span_masks.data_ptr() if meta.span_masks is not None else None,
                     rotary.cos.data_ptr(), rotary.sin.data_ptr(),
                     self.timings.data_ptr() if self.timings is not None else None)
        run.keep = (positions, tables)  # alive as long as the structure (copies if they were not contiguous)
        return model, run

    def final_norm(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of x's `rows` (the positions whose logits are wanted)."""
        return self.kernels.norm_rows(x, rows, self.norm, self.config.rms_norm_eps)
