"""The CPU C kernels against torch: packed GEMM, and paged attention against the torch path.

Every kernel test runs once per ISA level this CPU supports (an AVX-512 machine tests its own,
the AVX2 and the portable builds), so any machine tests the paths of the machines below it."""

import dataclasses
import random

import pytest
import torch

from engine import cpu_kernels
from engine.attention import SHORT_QUERY, AttentionMetadata, native_paged_attention, paged_attention
from engine.batch import tree_layout
from engine.kv_layout import encode_rows
from engine.layers import Linear

ISAS = cpu_kernels.supported_isas()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 3, 6, 7, 8, 9, 13, 17, 40])
@pytest.mark.parametrize("n, k", [(200, 77), (96, 64), (33, 5)])
def test_packed_gemm_matches_torch(isa, m, n, k):
    kernels = cpu_kernels.kernels(isa)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(m, k)
    packed = kernels.pack_weight(w)
    assert torch.allclose(kernels.packed_gemm(x, packed, n, b), x @ w.T + b, atol=1e-4)
    assert torch.allclose(kernels.packed_gemm(x, packed, n), x @ w.T, atol=1e-4)
    rows = torch.tensor([0, n - 1, n // 2])
    assert torch.equal(cpu_kernels.unpack_rows(packed, rows), w[rows])


def _case(query_lens, context_lens, heads, kv_heads, dim, block_size, seed, span_masks=None):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 3
    cache = torch.randn(num_blocks, 4, 2, block_size, kv_heads, dim)  # 4 layers; we use layer 2
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, slots = [], []
    for q, c in zip(query_lens, context_lens):
        n = -(-c // block_size)
        tables.append([ids.pop() for _ in range(n)])
        slots += [tables[-1][p // block_size] * block_size + p % block_size for p in range(c - q, c)]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, slots, block_size,
                                   torch.device("cpu"), span_masks)
    q = torch.randn(sum(query_lens), heads, dim)
    return q, cache[:, 2], meta


def _explicit_attention(q, layer_cache, meta, scale, visible):
    """Row by row: softmax over the keys at the cache positions visible(seq, row, context) lists."""
    query_lens, context_lens, tables, block_size = meta.lists
    kv_heads = layer_cache.shape[3]
    out, row = [], 0
    for b, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        for i in range(n):
            pos = torch.tensor(visible(b, i, ctx - n))
            slots = torch.tensor(tables[b])[pos // block_size], pos % block_size
            k, v = layer_cache[slots[0], 0, slots[1]], layer_cache[slots[0], 1, slots[1]]  # [P, kvh, D]
            qh = q[row].view(kv_heads, -1, q.shape[-1])  # [kvh, group, D]
            probs = torch.softmax(torch.einsum("hgd,phd->hgp", qh, k) * scale, -1)
            out.append(torch.einsum("hgp,phd->hgd", probs, v).reshape(-1))
            row += 1
    return torch.stack(out)


@pytest.mark.parametrize("isa", ISAS)
# 48: an odd number of vectors a head with AVX-512 (a bf16 cache's last one unpaired); blocks of 24:
# partitions of 64 keys start mid-block
@pytest.mark.parametrize("heads, kv_heads, dim, block_size", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 128, 16),
                                                              (6, 2, 48, 16), (9, 3, 64, 24)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_native_attention_matches_torch_path(isa, heads, kv_heads, dim, block_size, cache_dtype):
    # decodes, verification spans crossing blocks, a 16-token span, and two long prefill chunks
    query_lens = [1, 6, 1, 16, 5, 40, 20]
    context_lens = [1, 37, 300, 50, 18, 40, 61]
    q, layer_cache, meta = _case(query_lens, context_lens, heads, kv_heads, dim, block_size, seed=dim)
    layer_cache = encode_rows(layer_cache, cache_dtype)  # engine.kv_cache_dtype: both paths widen it to fp32
    ours = native_paged_attention(q, layer_cache, meta, dim**-0.5, isa)
    ref = paged_attention(q, layer_cache, meta, dim**-0.5)
    assert (ours - ref).abs().max() < 1e-4



def test_the_kernel_reads_a_block_table_as_its_rows_are_laid_out_and_refuses_wrong_dtypes():
    """A column slice of a wider table was read with its width as the rows' stride: wrong keys."""
    q, layer_cache, meta = _case([1, 6], [40, 50], 9, 3, 64, 16, seed=3)
    want = native_paged_attention(q, layer_cache, meta, 0.125)
    wide = torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables)], dim=1)
    sliced = dataclasses.replace(meta, block_tables=wide[:, : meta.block_tables.shape[1]])
    assert not sliced.block_tables.is_contiguous()
    assert torch.equal(native_paged_attention(q, layer_cache, sliced, 0.125), want)
    with pytest.raises(ValueError, match="int32"):
        native_paged_attention(q, layer_cache, dataclasses.replace(meta, context_lens=meta.context_lens.long()), 0.125)


def test_a_tree_span_longer_than_a_short_query_is_refused():
    """A mask's bits name 32 span tokens at most in the C kernel (16 in a short query): past them its
    shifts wrapped and a row read the wrong keys (and wrote past a stack array)."""
    n = SHORT_QUERY + 4
    with pytest.raises(ValueError, match="tree span of more than"):
        AttentionMetadata.build([n], [100], [list(range(7))], list(range(100 - n, 100)), 16, torch.device("cpu"),
                                [-1] * (n - 1) + [0b101])

@pytest.mark.parametrize("isa", ISAS)
def test_an_int8_cache_quantizes_and_multiplies_as_the_torch_path_does(isa):
    """With an int8 cache the C kernel quantizes the queries as encode_rows does: rows of exact
    rounding ties (s = 1, so x / s = k + 0.5) round half to even in both (half away from zero
    would move the scores ~1e-2). And rows at the extremes (every query and key value +-127, the
    integer dots' largest pair sums) multiply exactly."""
    q, layer_cache, meta = _case([1, 6, 1], [40, 37, 300], 9, 3, 64, 16, seed=7)
    g = torch.Generator().manual_seed(7)
    ties = torch.randint(-126, 126, q.shape, generator=g).float() + 0.5
    ties[..., 0] = 127.0
    for queries, keys, scale in ((ties, layer_cache, 1 / 512), (q.sign(), layer_cache.sign(), 0.125)):
        cache = encode_rows(keys, torch.int8)
        ref = paged_attention(queries, cache, meta, scale)
        assert (native_paged_attention(queries, cache, meta, scale, isa) - ref).abs().max() < 1e-4


@pytest.mark.parametrize("isa", ISAS)
def test_an_int8_cache_keeps_nan_as_the_torch_path_does(isa):
    """A key row or a query holding a NaN or an infinity is stored (or quantized) with a NaN scale
    and zero values in C as encode_rows does, so what reads it is NaN, not finite noise."""
    q, layer_cache, meta = _case([1, 6, 1], [40, 37, 300], 9, 3, 64, 16, seed=5)
    q[0, 2, 7] = float("nan")  # sequence 0's query, head 2
    q[3, 4, 1] = float("inf")  # sequence 1's fourth query, head 4
    rows = encode_rows(torch.tensor([[1.0, float("nan")], [float("inf"), 2.0], [3.0, -3.0]]), torch.int8)
    scales = rows[:, -4:].contiguous().view(torch.float32).flatten()
    assert scales[:2].isnan().all() and (rows[:2, :2] == 0).all() and scales[2] == 3 / 127
    cache = encode_rows(layer_cache, torch.int8)
    ours, ref = native_paged_attention(q, cache, meta, 0.125, isa), paged_attention(q, cache, meta, 0.125)
    heads_nan = ours.view(*q.shape).isnan().any(-1)
    assert torch.equal(ours.isnan(), ref.isnan()) and heads_nan.sum() == 2 and heads_nan[0, 2] and heads_nan[3, 4]
    assert (ours.nan_to_num() - ref.nan_to_num()).abs().max() < 1e-4


@pytest.mark.parametrize("isa", ISAS)
def test_a_bf16_cache_rounds_the_queries_half_to_even(isa):
    """On a bf16 cache the queries are rounded to bf16 too (to nearest, ties to even, as torch rounds)
    before their products with the keys, in C as in the torch path: here every query element sits at
    an exact tie between two bf16 values (rounded away from even, or truncated, the outputs would move
    by ~1e-2), and the unrounded queries give other outputs."""
    q, layer_cache, meta = _case([1, 6, 1], [40, 37, 300], 9, 3, 64, 16, seed=11)
    g = torch.Generator().manual_seed(11)
    signs = torch.randint(0, 2, q.shape, generator=g) * 2 - 1
    ties = (torch.randint(128, 256, q.shape, generator=g) + 0.5) / 32 * signs  # halfway between bf16 steps of 1/32
    cache = encode_rows(layer_cache, torch.bfloat16)
    ref = paged_attention(ties, cache, meta, 0.125)
    assert (native_paged_attention(ties, cache, meta, 0.125, isa) - ref).abs().max() < 1e-4
    assert (paged_attention(ties, cache.float(), meta, 0.125) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("isa", ISAS)
def test_native_attention_dense_decode_batch(isa):
    q, layer_cache, meta = _case([1] * 8, [5 + 13 * i for i in range(8)], 9, 3, 64, 16, seed=1)
    ours = native_paged_attention(q, layer_cache, meta, 0.125, isa)
    assert (ours - paged_attention(q, layer_cache, meta, 0.125)).abs().max() < 1e-4


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("query_lens, context_lens", [
    ([6, 1], [200, 700]),  # 6 tiles: whole on 1 thread, each partition a task on 2 and 3
    ([1] * 3 + [16] + [1] * 6, [90, 700, 5, 80] + [64 * i + 1 for i in range(6)]),  # 30 tiles, run whole
])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_threads_share_the_partitions_without_changing_a_bit(isa, query_lens, context_lens, cache_dtype):
    """Each thread takes a contiguous share of the partitions, balanced by their rows (so that it
    knows the next one to request ahead): tiles of 3 to 48 rows and contexts of 1 to 11 partitions,
    on 1, 2 and 3 threads, compute the same bits."""
    q, layer_cache, meta = _case(query_lens, context_lens, 9, 3, 64, 16, seed=5)
    layer_cache = encode_rows(layer_cache, cache_dtype)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(native_paged_attention(q, layer_cache, meta, 0.125, isa))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert (outs[0] - paged_attention(q, layer_cache, meta, 0.125)).abs().max() < 1e-4


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_row_computes_the_same_bits_alone_and_in_a_batch(isa, cache_dtype):
    """A sequence alone has few tiles, so its key partitions run as separate tasks folded after;
    in a batch of many, each tile runs its partitions in turn. Either way (and for a verification
    span as for a decode step, with contexts of several partitions) each row gets the same bits."""
    query_lens, context_lens = [1, 6, 1, 1, 6, 1, 1, 1], [300, 200, 65, 64, 130, 1, 257, 90]
    q, layer_cache, meta = _case(query_lens, context_lens, 9, 3, 64, 16, seed=3)
    layer_cache = encode_rows(layer_cache, cache_dtype)
    batched = native_paged_attention(q, layer_cache, meta, 0.125, isa)
    query_lens_, context_lens_, tables, block_size = meta.lists
    row = 0
    for n, ctx, table in zip(query_lens, context_lens, tables):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx - n, ctx)]
        alone = AttentionMetadata.build([n], [ctx], [table], slots, block_size, torch.device("cpu"))
        assert torch.equal(native_paged_attention(q[row : row + n], layer_cache, alone, 0.125, isa),
                           batched[row : row + n]), (n, ctx)
        row += n


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads, kv_heads, dim, block_size", [(9, 3, 64, 16), (4, 4, 32, 8)])
def test_tree_spans_see_the_prefix_and_their_ancestors_only(isa, heads, kv_heads, dim, block_size):
    """Span masks: tree rows see their ancestors in the span, other rows stay causal (torch path
    against an explicit per-row computation, the C kernel against the torch path)."""
    trees = {1: [-1, 0, 0, 1, -1, 4], 3: [-1, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, -1, 11, 0, 6]}  # seq -> parents
    query_lens = [1, 7, 1, 16, 5, 40]
    context_lens = [9, 37, 300, 50, 18, 61]
    masks, ancestors = [], {}
    for b, n in enumerate(query_lens):
        if b in trees:
            _, tree_masks = tree_layout(trees[b])
            masks += tree_masks
            ancestors[b] = [[j for j in range(n) if m >> j & 1] for m in tree_masks]
        else:
            masks += [-1] * n

    def visible(b, i, first):
        return list(range(first)) + [first + j for j in ancestors[b][i]] if b in ancestors else list(range(first + i + 1))

    q, layer_cache, meta = _case(query_lens, context_lens, heads, kv_heads, dim, block_size, seed=dim, span_masks=masks)
    ref = paged_attention(q, layer_cache, meta, dim**-0.5)
    assert (ref - _explicit_attention(q, layer_cache, meta, dim**-0.5, visible)).abs().max() < 1e-4
    assert (native_paged_attention(q, layer_cache, meta, dim**-0.5, isa) - ref).abs().max() < 1e-4
    slots = (meta.slot_blocks * block_size + meta.slot_offsets).tolist()
    causal = AttentionMetadata.build(*meta.lists[:3], slots, block_size, torch.device("cpu"))
    assert (paged_attention(q, layer_cache, causal, dim**-0.5) - ref).abs().max() > 1e-2  # the masks matter


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 5, 8, 19])
def test_bf16_packed_gemm_widens_weights_exactly(isa, m):
    """bf16 weights, fp32 math: equal to fp32 math on the bf16-rounded weights."""
    kernels = cpu_kernels.kernels(isa)
    w, b, x = torch.randn(100, 64).to(torch.bfloat16), torch.randn(100), torch.randn(m, 64)
    packed = kernels.pack_weight(w)
    assert packed.dtype == torch.bfloat16
    assert torch.allclose(kernels.packed_gemm(x, packed, 100, b), x @ w.float().T + b, atol=1e-4)


def test_isa_levels_and_the_environment_variable(monkeypatch):
    """The best level is the default; PDSPEC_CPU_ISA picks a lower one and refuses what the CPU
    cannot run or does not exist, naming what is allowed; weights packed by one level are refused
    by another whose panels differ."""
    assert ISAS[-1] == "portable" and set(ISAS) <= set(cpu_kernels.ISA_LEVELS)
    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    assert cpu_kernels.selected_isa() == ISAS[0]
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "portable")
    assert cpu_kernels.selected_isa() == "portable"
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="allowed: avx512, avx2, portable"):
        cpu_kernels.selected_isa()
    for isa in set(cpu_kernels.ISA_LEVELS) - set(ISAS):
        monkeypatch.setenv(cpu_kernels.ISA_ENV, isa)
        with pytest.raises(ValueError, match="this CPU runs"):
            cpu_kernels.selected_isa()
    widths = {isa: cpu_kernels.kernels(isa).pack_width for isa in ISAS}
    if len(set(widths.values())) > 1:
        wide, narrow = max(widths, key=widths.get), min(widths, key=widths.get)
        packed = cpu_kernels.kernels(wide).pack_weight(torch.randn(64, 8))
        with pytest.raises(ValueError, match="pack it with the same kernels"):
            cpu_kernels.kernels(narrow).packed_gemm(torch.randn(1, 8), packed, 64)


@pytest.mark.parametrize("packed_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first", [0, 5, 32, 64, 70, 99])
def test_linear_first_output_computes_a_tail_of_the_outputs(packed_dtype, first):
    """Linear(x, first_output=f) is Linear(x)[:, f:], on the packed path (panel-aligned or not)
    and on torch's."""
    w, b, x = torch.randn(100, 64), torch.randn(100), torch.randn(3, 64)
    packed = Linear(w, b, packed_dtype)
    assert packed.packed
    assert torch.allclose(packed(x, first_output=first), packed(x)[:, first:], atol=1e-5)
    plain = Linear(w.double(), b.double())
    assert not plain.packed
    assert torch.allclose(plain(x.double(), first_output=first), plain(x.double())[:, first:])


@pytest.mark.parametrize("isa", ISAS)
# The span inside one key partition, or across two (125: the chain tile's rows pair across the
# boundary, one of a pair seeing no key of the last partition); head size 16 pairs rows on 8-lane
# builds too.
@pytest.mark.parametrize("prefix, dim", [(37, 64), (125, 64), (125, 16)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_tree_row_computes_the_bits_of_its_path_decoded_plainly(isa, prefix, dim, cache_dtype):
    """Each row of a tree span (chain rows and leaves off it) gets exactly the output the same
    query gets as a plain one-token decode over the prefix plus its ancestors laid out
    contiguously: lossless verification must not hinge on rounding (nor on which rows share a
    pass over the keys: a span's rows see different numbers of them)."""
    heads, kv_heads, bs = 9, 3, 16
    parents = [-1, 0, 1, 0, 2, 4, 1]  # the chain 0-1-2-4-5, leaves 3 (under the root) and 6
    depth, masks = tree_layout(parents)
    n = len(parents) + 1
    torch.manual_seed(0)
    cache = encode_rows(torch.randn(24, 2, bs, kv_heads, dim), cache_dtype)
    tree_table = [3, 7, 1, 9, 17, 12, 20, 15, 22]
    q = torch.randn(n, heads, dim)
    slots = [tree_table[p // bs] * bs + p % bs for p in range(prefix, prefix + n)]
    meta = AttentionMetadata.build([n], [prefix + n], [tree_table], slots, bs, torch.device("cpu"), masks)
    tree_out = native_paged_attention(q, cache, meta, dim**-0.5, isa)
    plain_table = [11, 5, 14, 2, 16, 23, 0, 19, 18]
    for i in range(n):
        visible = list(range(prefix)) + [prefix + j for j in range(n) if masks[i] >> j & 1]
        plain = cache.clone()
        for dst, src in enumerate(visible):  # the visible keys and values, contiguous in other blocks
            plain[plain_table[dst // bs], :, dst % bs] = cache[tree_table[src // bs], :, src % bs]
        last = len(visible) - 1
        one = AttentionMetadata.build([1], [len(visible)], [plain_table], [plain_table[last // bs] * bs + last % bs],
                                      bs, torch.device("cpu"))
        assert len(visible) == prefix + depth[i] + 1
        assert torch.equal(native_paged_attention(q[i : i + 1], plain, one, dim**-0.5, isa)[0], tree_out[i]), i


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [1, 7, 31, 32, 33, 49152 + 5])
def test_argmax_rows_picks_what_torch_picks(isa, n):
    """Greedy sampling's choice, natively: the first of equal maxima, the first NaN, index 0 of a
    row of -inf, on rows shorter than two vectors and with a tail past the last one."""
    torch.manual_seed(n)
    rows = torch.randn(9, n)
    rows[1] = float("-inf")
    rows[2, n // 3] = rows[2, n - 1] = 1e4  # a tie, the later one in another lane or the tail
    rows[3, n // 2] = float("nan")
    rows[3, n - 1] = float("nan")
    rows[4, n - 1] = float("inf")
    rows[5] = rows[5].round()  # many ties
    rows[6, 0] = float("nan")
    rows[7, :] = 3.0
    if n > 34:
        rows[8, 21] = rows[8, 34] = 1e4  # the later one in a lower lane
        rows[0, 1] = float("nan")  # a NaN in the first vector, past its first lane
    assert cpu_kernels.kernels(isa).argmax_rows(rows) == rows.argmax(dim=-1).tolist()
    tail_nan = torch.randn(1, n)
    tail_nan[0, n - 1] = float("nan")
    assert cpu_kernels.kernels(isa).argmax_rows(tail_nan) == [n - 1]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n,k", [(1, 1), (7, 4), (33, 8), (8192, 4), (8192 + 5, 16)])
def test_top_probs_are_torchs_topk_of_the_softmax(isa, n, k):
    """The draft's candidates, natively: the k largest (the first of equal values first, as a
    stable sort orders them), their softmax probabilities to fp32 rounding; NaN probabilities for a
    row holding a NaN."""
    torch.manual_seed(n)
    rows = torch.randn(5, n) * 4
    rows[1] = rows[1].round()  # many ties
    rows[2, n - 1] = 50.0  # the largest in the tail past the last vector
    rows[3, :] = float("-inf")
    rows[3, n // 2] = 0.0  # one finite logit: probability 1
    ids, probs = cpu_kernels.kernels(isa).top_probs(rows, k)
    assert all(len(set(row)) == k for row in ids)  # distinct, also where fewer than k are above -inf (row 3)
    for r in (0, 1, 2, 3):
        order = torch.sort(rows[r], descending=True, stable=True).indices[:k]
        expected = torch.softmax(rows[r], -1)[order]
        assert ids[r][: 1 if r == 3 else k] == order.tolist()[: 1 if r == 3 else k], r
        assert torch.allclose(torch.tensor(probs[r]), expected, rtol=1e-5, atol=1e-7), r
    nan_row = torch.randn(1, n)
    nan_row[0, n // 2] = float("nan")
    nan_ids, nan_probs = cpu_kernels.kernels(isa).top_probs(nan_row, k)
    assert nan_ids == [list(range(k))] and all(p != p for p in nan_probs[0])
    with pytest.raises(ValueError, match="k must be in 1"):
        cpu_kernels.kernels(isa).top_probs(rows, n + 1 if n < 64 else 65)
