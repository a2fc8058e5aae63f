"""Paged attention for CUDA as one Triton launch: same contract as `attention.paged_attention`.

Design: one program per (query tile, kv head). A query tile is up to BLOCK_Q consecutive tokens
of one sequence, and its rows are those tokens times the kv head's GROUP query heads (padded to
a power of two), so a K/V tile read through the block table is loaded once and reused by every
query head that shares it: GQA without repeating K/V, and decode (1 token x GROUP heads) still
fills the rows of `tl.dot`. Tiles are numbered without a host sync: sequence b owns tiles
[start_b // BLOCK_Q + b, start_{b+1} // BLOCK_Q + b + 1), at least ceil(q_len_b / BLOCK_Q) of
them, so T // BLOCK_Q + B programs cover any mix of prefill chunks, decodes and verification
spans; each program finds its sequence by binary search over query_start_loc and exits if it
owns no tokens. Keys are walked in BLOCK_N-position tiles, each position mapped to its cache
block through the block table, so block_size is independent of the tile width. A tree-shaped
verification span (span_masks, see engine/attention.py) narrows each row's keys inside its
sequence's query to the row's ancestors.
"""

import torch
import triton
import triton.language as tl

from engine.attention import AttentionMetadata

# Key positions per inner-loop tile; 16 is tl.dot's minimum width, larger amortises the loop.
BLOCK_N = 32
# Rows (query tokens x grouped heads) per program for prefill-heavy and decode-heavy batches.
ROWS_PREFILL = 64
ROWS_DECODE = 16
HEAD_DIMS = (16, 32, 64, 128)  # tl.arange needs a power of two, tl.dot at least 16


@triton.jit
def _find_sequence(query_start_loc, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence b whose first tile (start_b // BLOCK_Q + b) is <= tile."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _round_to_bf16(x):
    """fp32 -> the nearest bf16 (ties to even), kept as fp32; by its bits, as `.to(tl.bfloat16)` in
    the interpreter truncates."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    nan = (u & 0x7FFFFFFF) > 0x7F800000  # stays NaN (rounded, one with a full mantissa would carry into zero)
    return tl.where(nan, (u | 0x400000) & 0xFFFF0000, rounded).to(tl.float32, bitcast=True)


@triton.jit
def _paged_attention_kernel(
    q, cache, out, query_start_loc, context_lens, block_tables, span_masks,
    num_seqs, qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_ckv, stride_co, stride_ch, stride_cd,
    stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, HAS_TREE: tl.constexpr,
    ROUND_Q: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = _find_sequence(query_start_loc, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    first_token = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_token >= q_len:
        return
    context_len = tl.load(context_lens + seq)
    prefix = context_len - q_len  # position of the sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    token = first_token + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_valid = (token < q_len) & (head_in_group < GROUP)
    q_pos = prefix + token
    dims = tl.arange(0, HEAD_DIM)

    q_ptrs = q + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    q_tile = tl.load(q_ptrs, mask=row_valid[:, None], other=0.0)
    if ROUND_Q:  # fp32 queries on a bf16 cache: rounded like the keys, as the CPU kernel and the torch path do
        q_tile = _round_to_bf16(q_tile)
    if HAS_TREE:
        row_tree = tl.load(span_masks + q_start + token, mask=row_valid, other=-1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # Causal: no row of this tile sees past its last token's position. Every valid row sees key 0,
    # and padded rows sit at positions >= prefix (masked only by context_len), so m_i is finite
    # after the first tile and the online softmax never computes exp(-inf - -inf).
    kv_end = prefix + tl.minimum(q_len, first_token + BLOCK_Q)
    table = block_tables + seq.to(tl.int64) * stride_bt
    for n_start in range(0, kv_end, BLOCK_N):
        k_pos = n_start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < kv_end
        block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
        base = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_co + kv_head * stride_ch
        kv_ptrs = cache + base[:, None] + dims[None, :] * stride_cd
        k = tl.load(kv_ptrs, mask=k_valid[:, None], other=0.0).to(q_tile.dtype)  # the cache may be narrower
        v = tl.load(kv_ptrs + stride_ckv, mask=k_valid[:, None], other=0.0).to(q_tile.dtype)

        if IEEE:
            s = tl.dot(q_tile, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q_tile, tl.trans(k))
        # Scores in log2 units (qk_scale folds in log2(e)) so the exponentials are exp2.
        s = s * qk_scale
        allowed = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        if HAS_TREE:  # inside the query span, a row sees its ancestors only (the root always)
            span_key = k_pos - prefix
            ancestor = ((row_tree[:, None] >> (span_key & 31)[None, :]) & 1) != 0
            allowed = allowed & ((span_key < 0)[None, :] | ancestor)
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    acc = acc / l_i[:, None]
    # out is a fresh contiguous [T, heads * D] tensor.
    out_ptrs = out + ((q_start + token) * NUM_HEADS + head)[:, None] * HEAD_DIM + dims[None, :]
    tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=row_valid[:, None])


def triton_paged_attention(
    q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q: [T, heads, D] -> [T, heads * D], attending over each sequence's cached keys/values.

    layer_cache: [num_blocks, 2, block_size, kv_heads, D], any strides (a layer slice of the
    block-major cache). Keys/values of the new tokens must already be written.
    """
    t, heads, d = q.shape
    _, two, block_size, kv_heads, cache_d = layer_cache.shape
    assert two == 2 and cache_d == d, f"layer_cache {tuple(layer_cache.shape)} does not match q {tuple(q.shape)}"
    assert d in HEAD_DIMS, f"head_dim must be one of {HEAD_DIMS}, got {d}"  # attention_for refuses others at load
    assert heads % kv_heads == 0, f"{heads} query heads do not divide into {kv_heads} kv heads"
    out = q.new_empty(t, heads * d)
    num_seqs = meta.context_lens.shape[0]
    if t == 0 or num_seqs == 0:
        return out

    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    # Mostly single-token queries: small tiles, or most rows of a decode program are padding.
    rows = ROWS_DECODE if t <= 4 * num_seqs else ROWS_PREFILL
    block_q = max(1, rows // group_pad)
    grid = (t // block_q + num_seqs, kv_heads)
    _paged_attention_kernel[grid](
        q, layer_cache, out, meta.query_start_loc, meta.context_lens, meta.block_tables,
        meta.span_masks if meta.span_masks is not None else meta.context_lens,  # unread without a tree
        num_seqs, scale * 1.4426950408889634,  # log2(e)
        *q.stride(), *layer_cache.stride(), meta.block_tables.stride(0),
        NUM_HEADS=heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32, HAS_TREE=meta.span_masks is not None,
        ROUND_Q=q.dtype == torch.float32 and layer_cache.dtype == torch.bfloat16,
    )
    return out
