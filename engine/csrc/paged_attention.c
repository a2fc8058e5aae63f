/* Paged attention for short queries (decode steps and speculative verification spans) on CPU.
 *
 * Why: with a few query tokens per sequence, attention is a few KFLOPs per head, and the torch
 * formulation (gather the context through the block tables, pad, mask, softmax, two matmuls)
 * spends its time in ~10 framework ops and two copies of the whole context per layer. This
 * kernel reads K/V straight from the paged cache through the block table, once per
 * (sequence, kv head), for all query tokens and all query heads sharing that kv head.
 *
 * Cache addressing (one layer of the block-major cache, any strides):
 *   key(block, offset, kv_head)   = cache + block*s_block + offset*s_offset + kv_head*D
 *   value(block, offset, kv_head) = the same + s_kv
 * Query token i of sequence b sits at position ctx_b - qlen_b + i and sees keys 0..position; with
 * span_masks (a tree-shaped verification span), of the sequence's own query tokens only those
 * whose bit is set in the row's mask (bit j: query token j; -1 = all, the causal rule alone).
 * Softmax is computed online, 16 keys at a time (flash-attention style), with a vectorised exp.
 */
#include <math.h>
#include <stddef.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int i16 __attribute__((vector_size(64)));

#define MAX_ROWS 64      /* query tokens x grouped heads handled together */
#define MAX_DIM 256
#define KEYS 16          /* keys per online-softmax step: one vector of scores */

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, 64); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, 64); }
static inline v16 splat(float x) { return (v16){0} + x; }
static inline i16 splat_i(int x) { return (i16){0} + x; }

/* Lane-wise mask ? a : b (GCC's C front end has no vector ternary). */
static inline v16 select(i16 mask, v16 a, v16 b) {
    i16 ia, ib;
    memcpy(&ia, &a, 64);
    memcpy(&ib, &b, 64);
    i16 r = (mask & ia) | (~mask & ib);
    v16 out;
    memcpy(&out, &r, 64);
    return out;
}

/* Tree reductions: a plain loop over the 16 lanes is a 16-step dependency chain. */
static inline float hsum(v16 v) {
    v8 lo, hi;
    memcpy(&lo, &v, 32);
    memcpy(&hi, (const char *)&v + 32, 32);
    v8 s8 = lo + hi;
    v4 a, b;
    memcpy(&a, &s8, 16);
    memcpy(&b, (const char *)&s8 + 16, 16);
    v4 s4 = a + b;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* exp(x) for x <= 0 (scores minus their running max): Cody-Waite range reduction and a
 * degree-6 polynomial, relative error ~2e-7; inputs below -87 flush to 0. */
static inline v16 vexp(v16 x) {
    const v16 lo = splat(-87.0f);
    i16 under = x < lo;
    x = select(x < lo, lo, x);
    v16 n = x * 1.44269504088896341f;
    /* round to nearest: add and subtract 1.5 * 2^23 */
    n = (n + 12582912.0f) - 12582912.0f;
    v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = splat(1.3981999507e-3f);
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
    v16 scale;
    memcpy(&scale, &bits, 64);
    v16 y = p * scale;
    return select(under, splat(0.0f), y);
}

/* Lane o of the result = sum of the lanes of d[o], for 16 vectors: a transpose-and-add tree
 * (15 shuffle pairs) instead of 16 separate horizontal sums. At each level, pairs (a, b) are
 * folded within chunks of 2h lanes: the chunk's first h lanes hold a's folded sums, the rest b's. */
#define FOLD_MASKS(h)                                                                              \
    static const i16 lo_##h = {                                                                    \
        M(0, h), M(1, h), M(2, h), M(3, h), M(4, h), M(5, h), M(6, h), M(7, h),                     \
        M(8, h), M(9, h), M(10, h), M(11, h), M(12, h), M(13, h), M(14, h), M(15, h)};             \
    static const i16 hi_##h = lo_##h + h;
#define M(i, h) ((((i) % (2 * (h))) < (h)) ? ((i) / (2 * (h))) * 2 * (h) + (i) % (2 * (h))         \
                                           : 16 + ((i) / (2 * (h))) * 2 * (h) + (i) % (2 * (h)) - (h))

static inline v16 sum16(v16 *d) {
    FOLD_MASKS(8) FOLD_MASKS(4) FOLD_MASKS(2) FOLD_MASKS(1)
    for (int o = 0; o < 8; o++) d[o] = __builtin_shuffle(d[o], d[o + 8], lo_8) + __builtin_shuffle(d[o], d[o + 8], hi_8);
    for (int o = 0; o < 4; o++) d[o] = __builtin_shuffle(d[o], d[o + 4], lo_4) + __builtin_shuffle(d[o], d[o + 4], hi_4);
    for (int o = 0; o < 2; o++) d[o] = __builtin_shuffle(d[o], d[o + 2], lo_2) + __builtin_shuffle(d[o], d[o + 2], hi_2);
    return __builtin_shuffle(d[0], d[1], lo_1) + __builtin_shuffle(d[0], d[1], hi_1);
}

/* One tile of rows (query token, head) of one sequence against one kv head's keys. `dim` is a
 * compile-time constant in each inlined copy (see attend_tile_dim), so the loops over it unroll
 * and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_tile(
    const float **qrows, const int *pos, const int *tree, int span0, int nrows, const float *cache,
    long s_block, long s_kv, long s_offset, const long *table, int block_size, int kv_head, const int dim,
    float scale, float **outs) {
    const int chunks = dim / 16;
    float m[MAX_ROWS], l[MAX_ROWS];
    v16 acc[MAX_ROWS][MAX_DIM / 16];
    const i16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    int last = 0;
    for (int r = 0; r < nrows; r++) {
        m[r] = -INFINITY;
        l[r] = 0;
        for (int c = 0; c < chunks; c++) acc[r][c] = splat(0.0f);
        if (pos[r] > last) last = pos[r];
    }
    const float *keys[KEYS];
    for (int start = 0; start <= last; start += KEYS) {
        int n = last + 1 - start < KEYS ? last + 1 - start : KEYS;
        for (int o = 0; o < n; o++) {
            int p = start + o;
            keys[o] = cache + table[p / block_size] * s_block + (long)(p % block_size) * s_offset
                      + (long)kv_head * dim;
        }
        for (int o = n; o < KEYS; o++) keys[o] = keys[0];  /* valid memory; masked out below */
        for (int r = 0; r < nrows; r++) {
            int visible = pos[r] + 1 - start < n ? pos[r] + 1 - start : n;
            if (visible <= 0) continue;
            v16 d[KEYS];
            for (int o = 0; o < KEYS; o++) {
                d[o] = load16(qrows[r]) * load16(keys[o]);
                for (int c = 1; c < chunks; c++) d[o] += load16(qrows[r] + 16 * c) * load16(keys[o] + 16 * c);
            }
            i16 valid = lane < visible;
            if (tree[r] != -1) {  /* keys in the span: only the row's ancestors (and itself) */
                i16 span_key = lane + (start - span0);
                valid &= (span_key < 0) | (((splat_i(tree[r]) >> (span_key & 31)) & 1) != 0);
            }
            v16 s = select(valid, sum16(d) * scale, splat(-INFINITY));
            float mnew = s[0];
            for (int o = 1; o < visible; o++) mnew = s[o] > mnew ? s[o] : mnew;
            mnew = mnew > m[r] ? mnew : m[r];
            float correction = expf(m[r] - mnew);
            v16 e = select(valid, vexp(s - mnew), splat(0.0f));
            l[r] = l[r] * correction + hsum(e);
            m[r] = mnew;
            /* Two accumulators per chunk halve the FMA dependency chain over the 16 keys. */
            v16 a0[MAX_DIM / 16], a1[MAX_DIM / 16];
            for (int c = 0; c < chunks; c++) { a0[c] = acc[r][c] * correction; a1[c] = splat(0.0f); }
            for (int o = 0; o < visible; o += 2) {
                for (int c = 0; c < chunks; c++) a0[c] += e[o] * load16(keys[o] + s_kv + 16 * c);
                if (o + 1 < visible)
                    for (int c = 0; c < chunks; c++) a1[c] += e[o + 1] * load16(keys[o + 1] + s_kv + 16 * c);
            }
            for (int c = 0; c < chunks; c++) acc[r][c] = a0[c] + a1[c];
        }
    }
    for (int r = 0; r < nrows; r++) {
        float inv = 1.0f / l[r];
        for (int c = 0; c < chunks; c++) store16(outs[r] + 16 * c, acc[r][c] * inv);
    }
}

static void attend_tile_dim(const float **qrows, const int *pos, const int *tree, int span0, int nrows,
                            const float *cache, long s_block, long s_kv, long s_offset, const long *table,
                            int block_size, int kv_head, int dim, float scale, float **outs) {
#define ATTEND(D) attend_tile(qrows, pos, tree, span0, nrows, cache, s_block, s_kv, s_offset, table, \
                              block_size, kv_head, D, scale, outs)
    switch (dim) {  /* the common head sizes get fully unrolled copies */
        case 64: ATTEND(64); break;
        case 128: ATTEND(128); break;
        default: ATTEND(dim);
    }
#undef ATTEND
}

/* q: [T, heads, dim]; out: [T, heads*dim]; block_tables: [num_seqs, max_blocks]; span_masks:
 * [T] tree masks, or NULL (all causal). Sequences with
 * more than max_query_len query tokens are skipped (prefill chunks go to a GEMM-based path).
 * Returns 0, or -1 if a shape is outside the kernel's limits (the caller checks these first). */
int pd_paged_attention(const float *q, const float *cache, long s_block, long s_kv, long s_offset,
                       const long *block_tables, int max_blocks, const int *query_start_loc,
                       const int *context_lens, int num_seqs, int max_query_len, int heads,
                       int kv_heads, int dim, int block_size, float scale, float *out,
                       const int *span_masks, int num_threads) {
    int group = heads / kv_heads;
    if (dim % 16 || dim > MAX_DIM || group > MAX_ROWS) return -1;
    int tokens_per_tile = MAX_ROWS / group;
    #pragma omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads)
    for (int b = 0; b < num_seqs; b++) {
        for (int h = 0; h < kv_heads; h++) {
            int first = query_start_loc[b], qlen = query_start_loc[b + 1] - first;
            int pos0 = context_lens[b] - qlen;
            if (qlen > max_query_len) continue;
            for (int t0 = 0; t0 < qlen; t0 += tokens_per_tile) {
                const float *qrows[MAX_ROWS];
                float *outs[MAX_ROWS];
                int pos[MAX_ROWS], tree[MAX_ROWS], nrows = 0;
                for (int i = t0; i < qlen && i < t0 + tokens_per_tile; i++) {
                    for (int g = 0; g < group; g++, nrows++) {
                        long row = (long)(first + i) * heads + h * group + g;
                        qrows[nrows] = q + row * dim;
                        outs[nrows] = out + row * dim;
                        pos[nrows] = pos0 + i;
                        tree[nrows] = span_masks ? span_masks[first + i] : -1;
                    }
                }
                attend_tile_dim(qrows, pos, tree, pos0, nrows, cache, s_block, s_kv, s_offset,
                                block_tables + (long)b * max_blocks, block_size, h, dim, scale, outs);
            }
        }
    }
    return 0;
}
