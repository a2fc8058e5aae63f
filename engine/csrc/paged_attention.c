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
 * Softmax is computed online, one vector of keys at a time (flash-attention style), with a
 * vectorised exp; the vector width follows the ISA build (vector_isa.h).
 */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "vector_isa.h"

typedef int vint __attribute__((vector_size(LANES * 4)));

#define MAX_ROWS 64      /* query tokens x grouped heads handled together */
#define MAX_DIM 256
#define KEYS LANES       /* keys per online-softmax step: one vector of scores */

/* F(0, h), ..., F(LANES - 1, h): the lanes of a vector constant. */
#if LANES == 16
#define LANE_LIST(F, h) F(0, h), F(1, h), F(2, h), F(3, h), F(4, h), F(5, h), F(6, h), F(7, h), \
                        F(8, h), F(9, h), F(10, h), F(11, h), F(12, h), F(13, h), F(14, h), F(15, h)
#elif LANES == 8
#define LANE_LIST(F, h) F(0, h), F(1, h), F(2, h), F(3, h), F(4, h), F(5, h), F(6, h), F(7, h)
#else
#define LANE_LIST(F, h) F(0, h), F(1, h), F(2, h), F(3, h)
#endif
#define LANE_INDEX(i, h) (i)

static inline vfloat loadv(const float *p) { vfloat v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vfloat v) { memcpy(p, &v, sizeof v); }
static inline vfloat splat(float x) { return (vfloat){0} + x; }
static inline vint splat_i(int x) { return (vint){0} + x; }

/* Lane-wise mask ? a : b (GCC's C front end has no vector ternary). */
static inline vfloat select_lanes(vint mask, vfloat a, vfloat b) {
    vint ia, ib;
    memcpy(&ia, &a, sizeof a);
    memcpy(&ib, &b, sizeof b);
    vint r = (mask & ia) | (~mask & ib);
    vfloat out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* Tree reduction: a plain loop over the lanes is a LANES-step dependency chain. */
static inline float hsum(vfloat v) {
    float s[LANES];
    memcpy(s, &v, sizeof v);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int i = 0; i < width; i++) s[i] += s[i + width];
    return s[0];
}

/* exp(x) for x <= 0 (scores minus their running max): Cody-Waite range reduction and a
 * degree-6 polynomial, relative error ~2e-7; inputs below -87 flush to 0. */
static inline vfloat vexp(vfloat x) {
    const vfloat lo = splat(-87.0f);
    vint under = x < lo;
    x = select_lanes(x < lo, lo, x);
    vfloat n = x * 1.44269504088896341f;
    /* round to nearest: add and subtract 1.5 * 2^23 */
    n = (n + 12582912.0f) - 12582912.0f;
    vfloat r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vfloat p = splat(1.3981999507e-3f);
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
    vfloat scale;
    memcpy(&scale, &bits, sizeof scale);
    vfloat y = p * scale;
    return select_lanes(under, splat(0.0f), y);
}

/* Lane o of the result = sum of the lanes of d[o], for LANES vectors: a transpose-and-add tree
 * (LANES - 1 shuffle pairs) instead of LANES separate horizontal sums. At each level, pairs
 * (a, b) = (d[o], d[o + h]) are folded within chunks of 2h lanes: the chunk's first h lanes hold
 * a's folded sums, the rest b's (shuffle indices from LANES on name b's lanes). */
#define FOLD_INDEX(i, h) ((((i) % (2 * (h))) < (h)) ? ((i) / (2 * (h))) * 2 * (h) + (i) % (2 * (h))      \
                                                   : LANES + ((i) / (2 * (h))) * 2 * (h) + (i) % (2 * (h)) - (h))
#define FOLD(h)                                                                                     \
    {                                                                                               \
        static const vint lo = {LANE_LIST(FOLD_INDEX, h)};                                          \
        static const vint hi = lo + (h);                                                            \
        for (int o = 0; o < (h); o++)                                                               \
            d[o] = __builtin_shuffle(d[o], d[o + (h)], lo) + __builtin_shuffle(d[o], d[o + (h)], hi); \
    }

static inline vfloat sum_lanes(vfloat *d) {
#if LANES >= 16
    FOLD(8)
#endif
#if LANES >= 8
    FOLD(4)
#endif
    FOLD(2)
    FOLD(1)
    return d[0];
}

/* One tile of rows (query token, head) of one sequence against one kv head's keys. `dim` is a
 * compile-time constant in each inlined copy (see attend_tile_dim), so the loops over it unroll
 * and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_tile(
    const float **qrows, const int *pos, const int *tree, int span0, const int *span_map, int nrows, const float *cache,
    long s_block, long s_kv, long s_offset, const long *table, int block_size, int kv_head, const int dim,
    float scale, float **outs) {
    const int chunks = dim / LANES;
    float m[MAX_ROWS], l[MAX_ROWS];
    vfloat acc[MAX_ROWS][MAX_DIM / LANES];
    const vint lane = {LANE_LIST(LANE_INDEX, 0)};
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
            if (span_map && p >= span0) p = span0 + span_map[p - span0];
            keys[o] = cache + table[p / block_size] * s_block + (long)(p % block_size) * s_offset
                      + (long)kv_head * dim;
        }
        for (int o = n; o < KEYS; o++) keys[o] = keys[0];  /* valid memory; masked out below */
        for (int r = 0; r < nrows; r++) {
            int visible = pos[r] + 1 - start < n ? pos[r] + 1 - start : n;
            if (visible <= 0) continue;
            vfloat d[KEYS];
            for (int o = 0; o < KEYS; o++) {
                d[o] = loadv(qrows[r]) * loadv(keys[o]);
                for (int c = 1; c < chunks; c++) d[o] += loadv(qrows[r] + LANES * c) * loadv(keys[o] + LANES * c);
            }
            vint valid = lane < visible;
            if (tree[r] != -1) {  /* keys in the span: only the row's ancestors (and itself) */
                vint span_key = lane + (start - span0);
                valid &= (span_key < 0) | (((splat_i(tree[r]) >> (span_key & 31)) & 1) != 0);
            }
            vfloat s = select_lanes(valid, sum_lanes(d) * scale, splat(-INFINITY));
            float mnew = s[0];
            for (int o = 1; o < visible; o++) mnew = s[o] > mnew ? s[o] : mnew;
            mnew = mnew > m[r] ? mnew : m[r];
            float correction = expf(m[r] - mnew);
            vfloat e = select_lanes(valid, vexp(s - mnew), splat(0.0f));
            l[r] = l[r] * correction + hsum(e);
            m[r] = mnew;
            /* Two accumulators per chunk halve the FMA dependency chain over the keys. */
            vfloat a0[MAX_DIM / LANES], a1[MAX_DIM / LANES];
            for (int c = 0; c < chunks; c++) { a0[c] = acc[r][c] * correction; a1[c] = splat(0.0f); }
            for (int o = 0; o < visible; o += 2) {
                for (int c = 0; c < chunks; c++) a0[c] += e[o] * loadv(keys[o] + s_kv + LANES * c);
                if (o + 1 < visible)
                    for (int c = 0; c < chunks; c++) a1[c] += e[o + 1] * loadv(keys[o + 1] + s_kv + LANES * c);
            }
            for (int c = 0; c < chunks; c++) acc[r][c] = a0[c] + a1[c];
        }
    }
    for (int r = 0; r < nrows; r++) {
        float inv = 1.0f / l[r];
        for (int c = 0; c < chunks; c++) storev(outs[r] + LANES * c, acc[r][c] * inv);
    }
}

static void attend_tile_dim(const float **qrows, const int *pos, const int *tree, int span0, const int *span_map,
                            int nrows, const float *cache, long s_block, long s_kv, long s_offset,
                            const long *table, int block_size, int kv_head, int dim, float scale, float **outs) {
#define ATTEND(D) attend_tile(qrows, pos, tree, span0, span_map, nrows, cache, s_block, s_kv, s_offset, table, \
                              block_size, kv_head, D, scale, outs)
    switch (dim) {  /* the common head sizes get fully unrolled copies */
        case 64: ATTEND(64); break;
        case 128: ATTEND(128); break;
        default: ATTEND(dim);
    }
#undef ATTEND
}

/* One (sequence, kv head): what every tile of its query tokens shares. */
typedef struct {
    const float *q, *cache;
    long s_block, s_kv, s_offset;
    const long *table;
    int first, pos0, heads, group, kv_head, dim, block_size;
    float scale;
    float *out;
    const int *span_masks;
} tile_job;

/* Rows of tokens [t0, t1) of the job's sequence (all heads of the kv head's group) as one tile.
 * span_map NULL: keys in cache order, tree masks applied per row. Else (one token, t1 = t0 + 1):
 * its `visible` keys are the prefix, then the span tokens span_map lists, read as one contiguous
 * run (see attend_tree_token). */
static void attend_tokens(const tile_job *j, int t0, int t1, const int *span_map, int visible) {
    if (t0 >= t1) return;
    const float *qrows[MAX_ROWS];
    float *outs[MAX_ROWS];
    int pos[MAX_ROWS], tree[MAX_ROWS], nrows = 0;
    for (int i = t0; i < t1; i++)
        for (int g = 0; g < j->group; g++, nrows++) {
            long row = (long)(j->first + i) * j->heads + j->kv_head * j->group + g;
            qrows[nrows] = j->q + row * j->dim;
            outs[nrows] = j->out + row * j->dim;
            pos[nrows] = span_map ? visible - 1 : j->pos0 + i;  /* the last key it sees, in the run it reads */
            tree[nrows] = j->span_masks && !span_map ? j->span_masks[j->first + i] : -1;
        }
    attend_tile_dim(qrows, pos, tree, j->pos0, span_map, nrows, j->cache, j->s_block, j->s_kv, j->s_offset, j->table,
                    j->block_size, j->kv_head, j->dim, j->scale, outs);
}

/* Token i of a tree span whose ancestors are not all the span tokens before it (a leaf off the
 * chain): its visible keys (the prefix, then the span tokens in its mask) are read as one
 * contiguous run, chunked as plain decoding would chunk them, so the row computes the same bits
 * as the token decoded at its logical position. (Keys at masked slots in between would shift the
 * online softmax's chunks and pairs, and a last-bit difference can change a token downstream.) */
static void attend_tree_token(const tile_job *j, int i, int mask) {
    int span_map[32], n = 0;
    for (int k = 0; k <= i; k++)
        if ((mask >> k) & 1) span_map[n++] = k;
    attend_tokens(j, i, i + 1, span_map, j->pos0 + n);
}

/* q: [T, heads, dim]; out: [T, heads*dim]; block_tables: [num_seqs, max_blocks]; span_masks:
 * [T] tree masks, or NULL (all causal). Every sequence, prefill chunks as much as decode steps:
 * a row computes the same bits however long its sequence's query is.
 * Returns 0, or -1 if a shape is outside the kernel's limits (the caller checks these first). */
int pd_paged_attention(const float *q, const float *cache, long s_block, long s_kv, long s_offset,
                       const long *block_tables, int max_blocks, const int *query_start_loc,
                       const int *context_lens, int num_seqs, int heads, int kv_heads, int dim,
                       int block_size, float scale, float *out, const int *span_masks, int num_threads) {
    int group = heads / kv_heads;
    if (dim % 16 || dim > MAX_DIM || group > MAX_ROWS) return -1;
    int tokens_per_tile = MAX_ROWS / group;
    #pragma omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads)
    for (int b = 0; b < num_seqs; b++) {
        for (int h = 0; h < kv_heads; h++) {
            int first = query_start_loc[b], qlen = query_start_loc[b + 1] - first;
            tile_job job = {q, cache, s_block, s_kv, s_offset, block_tables + (long)b * max_blocks, first,
                            context_lens[b] - qlen, heads, group, h, dim, block_size, scale, out, span_masks};
            int t0 = 0;  /* the pending tile: tokens t0 .. i-1 */
            for (int i = 0; i < qlen; i++) {
                int mask = span_masks ? span_masks[first + i] : -1;
                int causal = mask == -1 || mask == (int)((2u << i) - 1);  /* sees all span tokens up to i */
                if (!causal) {  /* a tree row off the chain: its visible keys compacted, alone */
                    attend_tokens(&job, t0, i, 0, 0);
                    attend_tree_token(&job, i, mask);
                    t0 = i + 1;
                } else if (i + 1 - t0 == tokens_per_tile) {
                    attend_tokens(&job, t0, i + 1, 0, 0);
                    t0 = i + 1;
                }
            }
            attend_tokens(&job, t0, qlen, 0, 0);
        }
    }
    return 0;
}
