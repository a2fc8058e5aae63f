"""Paged attention over the block-major KV cache: the torch implementation (the reference the C
and Triton kernels are tested against, and the path of CPU dtypes the C kernel does not take),
and the C kernel's entry (`native_paged_attention`, CPU fp32).

A forward's sequences fall in two groups:
- *short* queries (decode steps and speculative verification spans, <= SHORT_QUERY tokens):
  padded into one [B, Q] batch, so a whole running batch costs a handful of torch ops per layer
  instead of a Python loop over sequences;
- *long* queries (prefill chunks): one SDPA call each, with their cached prefix gathered by
  their block table.
Keys and values of the new tokens are written into the cache first, then read back through
the block tables, so a sequence attends to its cached prefix and to itself the same way.

A verification span may be a tree (several candidates for one position, see
spec/proposer.py): its tokens sit in consecutive cache slots in proposal order, and each sees
the cached prefix plus its own ancestors in the span. `span_masks` says which: bit j of a
row's mask is set when the row may see its sequence's j-th query token. Rows that are not part
of a tree carry -1 (every bit), so the causal rule alone applies to them.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.kv_layout import decode_rows, encode_rows

# Query spans up to this length go through the padded batch; longer ones through SDPA alone.
SHORT_QUERY = 16


@dataclass
class ShortGroup:
    rows: torch.Tensor | None  # [B*Q] flat token rows gathered into the padded batch; None = dense
    valid: torch.Tensor | None  # [n] positions in the padded batch that are real tokens; None = all
    out_rows: torch.Tensor | None  # [n] flat token rows the valid outputs go back to
    block_tables: torch.Tensor  # [B, max_blocks]
    mask: torch.Tensor  # [B, 1, 1, Q, S] additive (0 / -inf)
    batch: int
    query_len: int


@dataclass
class LongQuery:
    start: int
    end: int
    block_table: torch.Tensor  # [blocks]
    mask: torch.Tensor | None  # [Lq, S] bool, None when the query is the whole context (plain causal)


@dataclass
class AttentionMetadata:
    """Everything attention needs about one flat batch, built once and shared by all layers."""

    slot_blocks: torch.Tensor  # [T] cache block of each new token
    slot_offsets: torch.Tensor  # [T] offset inside that block
    query_start_loc: torch.Tensor  # [B+1] int32: rows of sequence b are [qsl[b], qsl[b+1])
    context_lens: torch.Tensor  # [B] int32: KV length per sequence after this forward's writes
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    lists: tuple[list[int], list[int], list[list[int]], int]  # query lens, context lens, tables, block size
    span_masks: torch.Tensor | None = None  # [T] int32 tree masks (see the module doc); None = all causal

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        block_size: int,
        device: torch.device,
        span_masks: list[int] | None = None,
    ) -> "AttentionMetadata":
        """slot_mapping: each new token's cache slot (block * block_size + offset); span_masks: one
        per query row (trees must be short queries), None when no span is a tree."""
        t, b = len(slot_mapping), len(query_lens)
        width = max((len(table) for table in block_tables), default=0) or 1
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        if span_masks and any(n > SHORT_QUERY and any(m != -1 for m in span_masks[s : s + n])
                              for s, n in zip(starts, query_lens)):  # a mask's bits name SHORT_QUERY tokens at most
            raise ValueError(f"a tree span of more than {SHORT_QUERY} tokens (trees are short queries)")
        # Two tensors, sliced into the fields: making a tensor from a list costs ~4 us whatever
        # its size (seven took ~40 us of a decode step's Python, the draft's levels' too).
        longs = torch.tensor([s // block_size for s in slot_mapping] + [s % block_size for s in slot_mapping]
                             + [i for table in block_tables for i in table + [0] * (width - len(table))],
                             dtype=torch.long, device=device)
        ints = torch.tensor(starts + list(context_lens) + list(span_masks or []), dtype=torch.int32, device=device)
        return cls(
            slot_blocks=longs[:t],
            slot_offsets=longs[t : 2 * t],
            query_start_loc=ints[: b + 1],
            context_lens=ints[b + 1 : 2 * b + 1],
            block_tables=longs[2 * t :].view(b, width),
            lists=(query_lens, context_lens, block_tables, block_size),
            span_masks=ints[2 * b + 1 :] if span_masks else None,
        )

    @functools.cached_property
    def long(self) -> list[LongQuery]:
        """The sequences with more than SHORT_QUERY query tokens, for the torch path."""
        query_lens, context_lens, tables, block_size = self.lists
        starts, device = self.query_start_loc.tolist(), self.block_tables.device
        return [LongQuery(starts[i], starts[i + 1], _table(tables[i], context_lens[i], block_size, device),
                          _causal_mask(n, context_lens[i], device))
                for i, n in enumerate(query_lens) if n > SHORT_QUERY]

    @functools.cached_property
    def short(self) -> "ShortGroup | None":
        """The padded batch of short queries, for the torch path (built on first use only)."""
        query_lens, context_lens, tables, block_size = self.lists
        ids = [i for i, n in enumerate(query_lens) if n <= SHORT_QUERY]
        if not ids:
            return None
        starts = self.query_start_loc.tolist()
        return _short_group(ids, starts, query_lens, context_lens, tables, block_size, self.block_tables.device,
                            self.span_masks)


def _table(table: list[int], context_len: int, block_size: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(table[: -(-context_len // block_size)], dtype=torch.long, device=device)


def _causal_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor | None:
    if query_len == context_len:
        return None
    # Query i sits at position context_len - query_len + i and sees keys up to it.
    first = context_len - query_len
    q_pos = torch.arange(first, context_len, device=device).unsqueeze(1)
    return torch.arange(context_len, device=device).unsqueeze(0) <= q_pos


def _short_group(ids, starts, query_lens, context_lens, block_tables, block_size, device, span_masks) -> ShortGroup:
    q = max(query_lens[i] for i in ids)
    max_ctx = max(context_lens[i] for i in ids)
    blocks = -(-max_ctx // block_size)
    s = blocks * block_size
    tables = [block_tables[i][:blocks] + [0] * (blocks - len(block_tables[i][:blocks])) for i in ids]
    key_pos = torch.arange(s, device=device)
    q_lens = torch.tensor([query_lens[i] for i in ids], device=device)
    ctx = torch.tensor([context_lens[i] for i in ids], device=device)
    # Query j of sequence b is at position ctx_b - q_len_b + j; padded queries (j >= q_len_b) are
    # given position 0 so their softmax row stays finite; their outputs are dropped.
    q_pos = ctx[:, None] - q_lens[:, None] + torch.arange(q, device=device)[None, :]
    q_pos = torch.where(q_pos >= ctx[:, None], torch.zeros_like(q_pos), q_pos)
    allowed = key_pos[None, None, :] <= q_pos[:, :, None]
    dense = all(query_lens[i] == q for i in ids) and ids == list(range(len(query_lens))) and starts[-1] == len(ids) * q
    if dense:
        rows = valid = out_rows = None
    else:
        flat = [starts[i] + min(j, query_lens[i] - 1) for i in ids for j in range(q)]
        keep = [b * q + j for b, i in enumerate(ids) for j in range(query_lens[i])]
        rows = torch.tensor(flat, dtype=torch.long, device=device)
        valid = torch.tensor(keep, dtype=torch.long, device=device)
        out_rows = rows[valid]
    if span_masks is not None:  # padded rows repeat their sequence's last row: every mask sees the root
        row_masks = (span_masks if rows is None else span_masks[rows]).view(len(ids), q, 1)
        span_key = key_pos[None, None, :] - (ctx - q_lens)[:, None, None]  # key's index in the span
        in_tree = (row_masks >> span_key.clamp(0, 31)) & 1 == 1
        allowed &= (span_key < 0) | in_tree
    mask = torch.zeros(allowed.shape, device=device).masked_fill_(~allowed, float("-inf"))
    return ShortGroup(rows, valid, out_rows, torch.tensor(tables, dtype=torch.long, device=device),
                      mask.view(len(ids), 1, 1, q, s), len(ids), q)


def write_kv(layer_cache: torch.Tensor, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
    """layer_cache: [num_blocks, 2, block_size, kv_heads, row] (kv_layout.py); k, v: [T, kv_heads, D]."""
    layer_cache[meta.slot_blocks, 0, meta.slot_offsets] = encode_rows(k, layer_cache.dtype)
    layer_cache[meta.slot_blocks, 1, meta.slot_offsets] = encode_rows(v, layer_cache.dtype)


def paged_attention(q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, D] -> [T, heads * D], attending over each sequence's cached keys/values."""
    if layer_cache.dtype == torch.int8:  # as the C kernel: the queries quantized per row like the keys
        q = decode_rows(encode_rows(q, torch.int8), q.dtype)
    elif layer_cache.dtype == torch.bfloat16 and q.dtype == torch.float32:  # as the C and Triton kernels
        q = q.to(torch.bfloat16).float()  # fp32 queries rounded like the keys
    t, heads, d = q.shape
    out = q.new_empty(t, heads * d)
    if meta.short is not None:
        _short_attention(q, layer_cache, meta.short, scale, out)
    for lq in meta.long:
        _long_attention(q, layer_cache, lq, scale, out)
    return out


def native_paged_attention(q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                           isa: str | None = None) -> torch.Tensor:
    """`paged_attention` by the C kernel (CPU, fp32), for every query, short or long: it reads K/V
    straight from the cache instead of ~10 torch ops and two context copies, and computes each
    row the same whatever else is in the batch or how a prompt was chunked (with int8 activations
    downstream, even a last-bit difference could change a token).
    isa: the kernels' ISA level (default: cpu_kernels.selected_isa())."""
    t, heads, d = q.shape
    out = q.new_empty(t, heads * d)
    cpu_kernels.kernels(isa).paged_attention(q, layer_cache, meta.block_tables, meta.query_start_loc,
                                             meta.context_lens, scale, out, meta.span_masks)
    return out


def _gather_kv(layer_cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., blocks] tables -> keys, values [..., kv_heads, blocks*block_size, D] as dtype (the queries')."""
    kv = decode_rows(layer_cache[tables], dtype)  # [..., blocks, 2, bs, kv_heads, D]
    *lead, blocks, _, bs, kv_heads, d = kv.shape
    kv = kv.movedim(-4, 0).reshape(2, *lead, blocks * bs, kv_heads, d).transpose(-3, -2)
    return kv[0], kv[1]


def _short_attention(q, layer_cache, group: ShortGroup, scale, out) -> None:
    heads, d = q.shape[1:]
    b, ql = group.batch, group.query_len
    keys, values = _gather_kv(layer_cache, group.block_tables, q.dtype)  # [B, kvh, S, D]
    kv_heads = keys.shape[1]
    rep = heads // kv_heads
    qb = q if group.rows is None else q.index_select(0, group.rows)
    # [B*Q, heads, D] -> [B, kvh, rep*Q, D]: each kv head's query heads batched together (GQA
    # without repeating K/V).
    qb = qb.view(b, ql, kv_heads, rep, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, rep * ql, d)
    scores = torch.matmul(qb * scale, keys.transpose(-1, -2)).view(b, kv_heads, rep, ql, -1)
    # Softmax in fp32 whatever the activations' dtype; the fp32 mask then adds exactly.
    probs = torch.softmax(scores.float() + group.mask, dim=-1).to(values.dtype).view(b, kv_heads, rep * ql, -1)
    o = torch.matmul(probs, values).view(b, kv_heads, rep, ql, d).permute(0, 3, 1, 2, 4).reshape(b * ql, heads * d)
    if group.rows is None:
        out.copy_(o)
    else:
        out.index_copy_(0, group.out_rows, o.index_select(0, group.valid))


def _long_attention(q, layer_cache, lq: LongQuery, scale, out) -> None:
    keys, values = _gather_kv(layer_cache, lq.block_table, q.dtype)  # [kvh, S_pad, D]
    context = lq.mask.shape[1] if lq.mask is not None else lq.end - lq.start
    keys, values = keys[:, :context], values[:, :context]
    qs = q[lq.start : lq.end].transpose(0, 1).unsqueeze(0)  # [1, heads, Lq, D]
    o = F.scaled_dot_product_attention(
        qs, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=lq.mask, is_causal=lq.mask is None,
        scale=scale, enable_gqa=True,
    )
    out[lq.start : lq.end] = o[0].transpose(0, 1).reshape(lq.end - lq.start, -1)
