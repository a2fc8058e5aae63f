/* Paged attention for short queries (decode steps and speculative verification spans) on CPU.
 *
 * Why: with a few query tokens per sequence, attention is a few KFLOPs per head, and the torch
 * formulation (gather the context through the block tables, pad, mask, softmax, two matmuls)
 * spends its time in ~10 framework ops and two copies of the whole context per layer. This
 * kernel reads K/V straight from the paged cache through the block table, once per
 * (sequence, kv head), for all query tokens and all query heads sharing that kv head.
 *
 * Cache addressing (one layer of the block-major cache, any strides):
 *   key(block, offset, kv_head)   = cache + block*s_block + offset*s_offset + kv_head*row
 * (row: a head's elements, D, or D + 4 in an int8 cache: pd_kv_row)
 * in elements of the cache's type (kv_type, kernels.h): fp32, bf16 or int8, widened to fp32 in
 * registers as they are read (key_chunk); an int8 row's scale (after its D values) multiplies
 * the key's score and the value's weight instead of its elements. With an int8 cache the queries
 * are quantized per row the same way (as llama.cpp's q8_0 cache does), and a score is the exact
 * integer dot product of the two rows (dot_i8) times both scales.
 *   value(block, offset, kv_head) = the same + s_kv
 * Query token i of sequence b sits at position ctx_b - qlen_b + i and sees keys 0..position; with
 * span_masks (a tree-shaped verification span), of the sequence's own query tokens only those
 * whose bit is set in the row's mask (bit j: query token j; -1 = all, the causal rule alone).
 * A row's keys are cut into partitions of PART_KEYS at fixed positions; within one, the scores,
 * their max and exps are computed whole, and partitions are folded in order as one softmax
 * (flash-decoding style), with a vectorised exp; the vector width follows the ISA build
 * (vector_isa.h).
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define MAX_ROWS 64      /* query tokens x grouped heads handled together */
#define MAX_DIM 256
#define KEYS LANES       /* keys per step: one vector of scores */

/* Keys per partition. Each row's keys are cut into partitions at fixed positions, each
 * partition's softmax sums are computed on their own, then folded in order (fold_part). Where
 * the partitions run (one task each when a batch has few tiles, as a decode step of one
 * sequence has; in turn inside the tile's task otherwise) never changes a row's bits. */
#define PART_KEYS 64

/* The addresses of a partition's keys (its values are s_kv further), as the partition before it
 * requests them: see attend_tile's values pass. */
typedef struct {
    const char *keys[PART_KEYS];
    int n;
} part_keys;

/* Key `pos` of kv head `kv_head` in a sequence's blocks (`table`), in bytes from `cache`; `row`:
 * a head's elements (pd_kv_row). */
static inline const char *key_address(const char *cache, const long *table, int block_size, long s_block,
                                      long s_offset, int kv_head, int row, long esize, int pos) {
    long element = table[pos / block_size] * s_block + (long)(pos % block_size) * s_offset + (long)kv_head * row;
    return cache + element * esize;
}

/* The fp32 scale after an int8 row's `dim` values. */
static inline float row_scale(const char *row, int dim) {
    float s;
    memcpy(&s, row + dim, sizeof s);
    return s;
}

/* `bytes` at p towards L2 (prefetcht1; AMD's t2 is the same): requested into L1, a core's few
 * outstanding L1 misses (Zen 4: ~24) capped the cold stream of scattered rows, and a partition's
 * arithmetic and its successor's DRAM time added up instead of overlapping. Into L2, which tracks
 * more misses, cold attention at batch 16 took 0.54-0.70x the time, batch 4 0.57-0.77x (fp32,
 * bf16; int8 0.84-0.94x), batch 1 the same (bench.kernel_ab, Machine D); the rows still reach L1
 * on use, from L2. Always inlined: GCC counts a prefetch as no side effect, so where it chose not
 * to inline this function it found it pure and dropped every call (all 388 prefetches, once the
 * tile function was exported). */
static inline __attribute__((always_inline)) void request_lines(const char *p, int bytes) {
    for (int l = 0; l < bytes; l += 64) __builtin_prefetch(p + l, 0, 2);
}

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

/* Chunk c of the `dim` elements at p (a key or a value), of `chunks`, as floats (an int8 row's
 * unscaled: its scale is applied per key, see attend_tile). A bf16 cache's elements are
 * widened in registers, two chunks per vector of 32-bit words and split by parity: chunk 2j holds
 * elements 2(jL + l), the words' low halves, chunk 2j + 1 the high halves 2(jL + l) + 1 (L =
 * LANES), a shift or a mask each, no shuffle; an odd last chunk is widened in order. The queries
 * are permuted the same way (permute_query), the weighted values put back in order
 * (store_chunks). A widening pass through memory cost more than the attention's arithmetic at
 * batch 16 (AVX-512: 3.6 against 2.2 ms over 30 layers, keys in cache). */
static inline vfloat key_chunk(const char *p, int c, int chunks, int kv_type) {
    if (kv_type == PD_KV_F32) return load_f32((const float *)p + LANES * c);
    if (kv_type == PD_KV_INT8) return load_i8((const int8_t *)p + LANES * c);
    if (c == chunks - 1 && chunks % 2) return load_bf16((const uint16_t *)p + LANES * c);
    vword w;
    memcpy(&w, p + (size_t)(c / 2) * LANES * 4, sizeof w);
    w = c % 2 ? w & 0xFFFF0000u : w << 16;
    vfloat f;
    memcpy(&f, &w, sizeof f);
    return f;
}

#define EVEN_INDEX(i, h) (2 * (i) + (h))                               /* h = 0: even elements, 1: odd */
#define INTERLEAVE_INDEX(i, h) ((h) * LANES / 2 + (i) / 2 + ((i) % 2) * LANES)  /* h: which half */

/* The query's `dim` floats in key_chunk's order for a bf16 cache. */
static inline void permute_query(const float *q, float *out, int chunks) {
    static const vint even = {LANE_LIST(EVEN_INDEX, 0)}, odd = {LANE_LIST(EVEN_INDEX, 1)};
    for (int c = 0; c + 1 < chunks; c += 2) {
        vfloat a = load_f32(q + LANES * c), b = load_f32(q + LANES * (c + 1));
        store_f32(out + LANES * c, __builtin_shuffle(a, b, even));
        store_f32(out + LANES * (c + 1), __builtin_shuffle(a, b, odd));
    }
    if (chunks % 2) store_f32(out + LANES * (chunks - 1), load_f32(q + LANES * (chunks - 1)));
}

/* Sums a[chunks] (in key_chunk's order) to row[dim] in element order. */
static inline void store_chunks(float *row, const vfloat *a, int chunks, int bf16) {
    static const vint lo = {LANE_LIST(INTERLEAVE_INDEX, 0)}, hi = {LANE_LIST(INTERLEAVE_INDEX, 1)};
    for (int c = 0; c < chunks; c++) {
        if (!bf16 || (c == chunks - 1 && chunks % 2)) {
            store_f32(row + LANES * c, a[c]);
            continue;
        }
        store_f32(row + LANES * c, __builtin_shuffle(a[c], a[c + 1], lo));
        store_f32(row + LANES * (c + 1), __builtin_shuffle(a[c], a[c + 1], hi));
        c++;
    }
}

/* Keys per step of the values pass: one FMA chain per chunk; with fewer than 8 chunks (wide
 * vectors, small heads) a second set of sums takes every other key, so 8 chains keep the FMAs busy. */
static inline int key_stride(int chunks) { return chunks >= 8 ? 1 : 2; }

/* Sums that two rows' values passes may keep in registers at once (vector_isa.h: AVX-512 has 32,
 * the others 16): where a row needs more than half of them, rows go one at a time. */
#define PAIRED_SUMS (LANES == 16 ? 16 : 8)

/* Rows r .. r + rows - 1 (rows: 1 or 2) of a partition: the exps-weighted sum of the values of keys
 * 0 .. visible - 1 (in an int8 cache, each exp times its value's scale, vscale), into part's
 * rows, key_stride keys a step. Two rows share each value chunk's load (and widening), half the
 * loads per FMA of one row alone (a verification span's tiles have 18 rows). The sums stay in
 * registers over the whole partition (summed through `part` step by step, each step paid a load
 * and a store per chunk).
 *
 * The next partition's lines are requested here, a key at a time, so DRAM streams them while this
 * partition computes: row 0 requests its keys, row 1 its values (a tile's only row both).
 * Requested in one burst before their partition (as a partition's own lines still are, at its
 * start: by then they are mostly on their way), memory and arithmetic took turns: cold attention
 * at batch 16 took its arithmetic's time plus its bytes' (BENCHMARKS.md, fourth and sixth passes).
 * (Spread over all rows instead, a 4 x 6-token batch gained 10-15 % and bf16 decoding on AVX2
 * lost 2-5 %.) */
static inline __attribute__((always_inline)) void weigh_values(
    const char *const *keys, long value_offset, const float *exps, const float *vscale, float *part, int r,
    const int rows, const int *pos, int nrows, int k0, int k1, const int dim, const int kv_type,
    const part_keys *next) {
    const int chunks = dim / LANES, stride = key_stride(chunks), bytes = pd_kv_row(kv_type, dim) * pd_kv_esize(kv_type);
    const int row_exps = PART_KEYS / KEYS * KEYS;  /* floats from one row's exps to the next's */
    vfloat a[2][2][MAX_DIM / LANES];              /* [row][key parity][chunk] */
    int visible = 0;
    for (int i = 0; i < rows; i++) {
        float *row = part + (size_t)(r + i) * (dim + 2);
        int v = row[dim] == -INFINITY ? 0 : pos[r + i] + 1 - k0 < k1 - k0 ? pos[r + i] + 1 - k0 : k1 - k0;
        visible = v > visible ? v : visible;
        for (int c = 0; c < chunks; c++) a[i][0][c] = a[i][1][c] = splat(0.0f);
    }
    const int ask_keys = r == 0, ask_values = (r <= 1 && r + rows > 1) || nrows == 1;
    const int requests = ask_keys || ask_values ? next->n : 0;
    for (int o = 0; o < visible; o += stride) {
        for (int k = 0; k < stride && o + k < requests; k++) {
            if (ask_keys) request_lines(next->keys[o + k], bytes);
            if (ask_values) request_lines(next->keys[o + k] + value_offset, bytes);
        }
        /* key o into the even sums, o + 1 into the odd (k a constant: indexed by a variable, the
         * sums lived in memory) */
#define WEIGHT(i, k) (kv_type == PD_KV_INT8 ? exps[(size_t)(i) * row_exps + o + (k)] * vscale[o + (k)] \
                                               : exps[(size_t)(i) * row_exps + o + (k)])
#define WEIGH(k)                                                                              \
        for (int c = 0; c < chunks; c++) {                                                    \
            vfloat v = key_chunk(keys[o + (k)] + value_offset, c, chunks, kv_type);           \
            for (int i = 0; i < rows; i++) a[i][k][c] += WEIGHT(i, k) * v;                    \
        }
        WEIGH(0)
        if (stride == 2 && o + 1 < visible) WEIGH(1)
#undef WEIGH
#undef WEIGHT
    }
    for (int o = visible + (visible % stride); o < requests; o++) {
        if (ask_keys) request_lines(next->keys[o], bytes);
        if (ask_values) request_lines(next->keys[o] + value_offset, bytes);
    }
    for (int i = 0; i < rows; i++) {
        for (int c = 0; c < chunks; c++) a[i][0][c] += a[i][1][c];
        store_chunks(part + (size_t)(r + i) * (dim + 2), a[i][0], chunks, kv_type == PD_KV_BF16);
    }
}

/* One tile of rows (query token, head) of one sequence against keys [k0, k1) of one kv head
 * (one partition, at most PART_KEYS): per row the unnormalised softmax-weighted sum of values,
 * the scores' max and the sum of exps, into part [rows][dim + 2]. Three passes, the keys in
 * vectors of KEYS shared by all rows while they are in L1: scores, then each row's exps, then
 * values. `dim` is a compile-time constant in each inlined copy (see attend_tile_dim), so the
 * loops over it unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_tile(
    const float *const *qrows, const int8_t *const *q8rows, const float *qscales, const int *pos, const int *tree,
    int span0, const int *span_map, int nrows,
    const char *cache, long s_block, long s_kv, long s_offset, const long *table, int block_size, int kv_head,
    const int dim, const int kv_type, float scale, int k0, int k1, const part_keys *next, float *part) {
    const long esize = pd_kv_esize(kv_type), value_offset = s_kv * esize;  /* bytes from a key to its value */
    const int chunks = dim / LANES, steps = (k1 - k0 + KEYS - 1) / KEYS, row = pd_kv_row(kv_type, dim);
    const int bf16 = kv_type == PD_KV_BF16, int8 = kv_type == PD_KV_INT8;
#define KV(p, c) key_chunk(p, c, chunks, kv_type)
    static __thread float permuted[MAX_ROWS * MAX_DIM];  /* the queries in key_chunk's order (bf16) */
    const float *q[MAX_ROWS];
    for (int r = 0; r < nrows; r++) {
        q[r] = bf16 ? permuted + (size_t)r * dim : qrows[r];
        if (bf16) permute_query(qrows[r], permuted + (size_t)r * dim, chunks);
    }
    vfloat scores[MAX_ROWS][PART_KEYS / KEYS];
    const vint lane = {LANE_LIST(LANE_INDEX, 0)};
    const char *keys[PART_KEYS];
    for (int o = 0; o < steps * KEYS; o++) {
        int p = k0 + o < k1 ? k0 + o : k0;  /* past k1: valid memory, masked out below */
        if (span_map && p >= span0) p = span0 + span_map[p - span0];
        keys[o] = key_address(cache, table, block_size, s_block, s_offset, kv_head, row, esize, p);
        /* Every line of the partition's keys and values requested at once: the keys sit in
         * blocks scattered over the pool, in strided pieces (one head of each token), a pattern
         * the hardware prefetcher does not follow; read on demand, each line waited its turn. */
        request_lines(keys[o], row * esize);
        request_lines(keys[o] + s_kv * esize, row * esize);
    }
#define VISIBLE(r, st) (pos[r] + 1 - (k0 + (st) * KEYS) < KEYS ? pos[r] + 1 - (k0 + (st) * KEYS) : KEYS)
    float kscale[PART_KEYS], vscale[PART_KEYS];  /* an int8 cache's row scales */
    if (int8)
        for (int o = 0; o < steps * KEYS; o++) {
            kscale[o] = row_scale(keys[o], dim) * scale;
            vscale[o] = row_scale(keys[o] + value_offset, dim);
        }
    for (int st = 0; st < steps; st++) {
        const char *const *kv = keys + st * KEYS;
        const vfloat key_scale = int8 ? load_f32(kscale + st * KEYS) : splat(scale);
        for (int r = 0; r < nrows; r++) {
            int visible = VISIBLE(r, st);
            if (visible <= 0) {
                scores[r][st] = splat(-INFINITY);
                continue;
            }
            vfloat d[KEYS];
            if (int8 && dim % I8_CHUNK == 0) {  /* integer dot products, converted exactly */
                for (int o = 0; o < KEYS; o++) {
                    vint acc = splat_i(0);
                    for (int c = 0; c < dim / I8_CHUNK; c++)
                        acc = dot_i8(acc, (const int8_t *)kv[o] + I8_CHUNK * c, q8rows[r] + I8_CHUNK * c);
                    d[o] = __builtin_convertvector(acc, vfloat);
                }
            } else {  /* each chunk of the query loaded once, against that chunk of every key (an int8
                       * cache's here too, for other head sizes: its integer products sum exactly) */
                vfloat qc = load_f32(q[r]);
                for (int o = 0; o < KEYS; o++) d[o] = qc * KV(kv[o], 0);
                for (int c = 1; c < chunks; c++) {
                    qc = load_f32(q[r] + LANES * c);
                    for (int o = 0; o < KEYS; o++) d[o] += qc * KV(kv[o], c);
                }
            }
            vint valid = lane < visible;
            if (tree[r] != -1) {  /* keys in the span: only the row's ancestors (and itself) */
                vint span_key = lane + (k0 + st * KEYS - span0);
                valid &= (span_key < 0) | (((splat_i(tree[r]) >> (span_key & 31)) & 1) != 0);
            }
            vfloat score_scale = int8 ? key_scale * qscales[r] : key_scale;
            scores[r][st] = select_lanes(valid, sum_lanes(d) * score_scale, splat(-INFINITY));
        }
    }
    for (int r = 0; r < nrows; r++) {  /* scores -> exps (below -87 after the max: 0) */
        vfloat mv = scores[r][0];
        for (int st = 1; st < steps; st++) mv = select_lanes(scores[r][st] > mv, scores[r][st], mv);
        float m = hmax(mv), *row = part + (size_t)r * (dim + 2);
        row[dim] = m;
        if (m == -INFINITY) {  /* no key of the partition visible to the row: all exps 0 */
            row[dim + 1] = 0.0f;
            for (int st = 0; st < steps; st++) scores[r][st] = splat(0.0f);
            continue;
        }
        vfloat sum = splat(0.0f);
        for (int st = 0; st < steps; st++) sum += scores[r][st] = vexp(scores[r][st] - m);
        row[dim + 1] = hsum(sum);
    }
    /* Values. A row's keys from 0 to its last visible one, in order (one with exp 0 adds nothing):
     * its bits are its own whichever rows share its loop. Rows in pairs where a tile has more than
     * one token's heads (a span's or a prefill chunk's): a decode tile's three rows, memory-bound,
     * ran 1-3 % slower in pairs at batch 16 (bench.kernel_ab). */
    const int pair = 2 * key_stride(chunks) * chunks <= PAIRED_SUMS && nrows >= 4;
    int r = 0;
    for (; pair && r + 1 < nrows; r += 2)
        weigh_values(keys, value_offset, (const float *)scores[r], vscale, part, r, 2, pos, nrows, k0, k1, dim, kv_type,
                     next);
    for (; r < nrows; r++)
        weigh_values(keys, value_offset, (const float *)scores[r], vscale, part, r, 1, pos, nrows, k0, k1, dim, kv_type,
                     next);
#undef VISIBLE
#undef KV
}

static __attribute__((noinline)) void attend_tile_dim(
    const float *const *qrows, const int8_t *const *q8rows, const float *qscales, const int *pos, const int *tree,
    int span0, const int *span_map, int nrows,
    const char *cache, long s_block, long s_kv, long s_offset, const long *table, int block_size, int kv_head,
    int dim, int kv_type, float scale, int k0, int k1, const part_keys *next, float *part) {
#define ATTEND(D, T) attend_tile(qrows, q8rows, qscales, pos, tree, span0, span_map, nrows, cache, s_block, s_kv,    \
                                 s_offset, table, block_size, kv_head, D, T, scale, k0, k1, next, part)
    switch (4 * dim + kv_type) {  /* the common head sizes get fully unrolled copies, per cache type */
        case 4 * 64 + PD_KV_F32: ATTEND(64, PD_KV_F32); break;
        case 4 * 64 + PD_KV_BF16: ATTEND(64, PD_KV_BF16); break;
        case 4 * 64 + PD_KV_INT8: ATTEND(64, PD_KV_INT8); break;
        case 4 * 128 + PD_KV_F32: ATTEND(128, PD_KV_F32); break;
        case 4 * 128 + PD_KV_BF16: ATTEND(128, PD_KV_BF16); break;
        case 4 * 128 + PD_KV_INT8: ATTEND(128, PD_KV_INT8); break;
        default: ATTEND(dim, kv_type);
    }
#undef ATTEND
}

/* Shapes and pointers of one call. */
typedef struct {
    const float *q;      /* with an int8 cache: the quantized queries' values, as floats */
    const int8_t *q8;    /* with an int8 cache: the queries quantized per row, and their scales */
    const float *qs;
    const char *cache;
    int kv_type;
    long s_block, s_kv, s_offset;
    const long *block_tables;
    const int *query_start_loc, *context_lens, *span_masks;
    int max_blocks, heads, kv_heads, group, dim, block_size;
    float scale;
    float *out;
} attn_call;

/* Query tokens [t0, t1) of one sequence, all heads of one kv head's group: rows that read the
 * same keys. A tree token off the chain (mask != 0) is a tile alone: its visible keys (the
 * prefix, then the span tokens its mask names) are read as one contiguous run, chunked as
 * plain decoding would chunk them, so the row computes the bits of the token decoded at its
 * logical position. (Keys at masked slots in between would shift the partitions and their
 * chunks, and a last-bit difference can change a token downstream.) */
typedef struct {
    int seq, kv_head, t0, t1, mask;
    int keys;        /* the run of keys the tile's rows read: positions 0 .. keys - 1 */
    int first_part;  /* its first partition's index among all tiles' partitions, in order */
} tile;

static int tile_parts(const tile *t) { return (t->keys + PART_KEYS - 1) / PART_KEYS; }

typedef struct {
    const float *q[MAX_ROWS];
    const int8_t *q8[MAX_ROWS];
    float qs[MAX_ROWS];
    float *out[MAX_ROWS];
    int pos[MAX_ROWS], tree[MAX_ROWS], span_map[32], n, pos0;
} tile_rows;

static void rows_of(const attn_call *a, const tile *t, tile_rows *r) {
    int first = a->query_start_loc[t->seq], qlen = a->query_start_loc[t->seq + 1] - first;
    r->pos0 = a->context_lens[t->seq] - qlen;
    int visible = 0;
    if (t->mask)
        for (int k = 0; k <= t->t0; k++)
            if ((t->mask >> k) & 1) r->span_map[visible++] = k;
    r->n = 0;
    for (int i = t->t0; i < t->t1; i++)
        for (int g = 0; g < a->group; g++, r->n++) {
            long row = (long)(first + i) * a->heads + t->kv_head * a->group + g;
            r->q[r->n] = a->q + row * a->dim;
            r->q8[r->n] = a->q8 ? a->q8 + row * a->dim : NULL;
            r->qs[r->n] = a->qs ? a->qs[row] : 1.0f;
            r->out[r->n] = a->out + row * a->dim;
            r->pos[r->n] = t->mask ? r->pos0 + visible - 1 : r->pos0 + i;  /* the last key it sees, in the run it reads */
            r->tree[r->n] = a->span_masks && !t->mask ? a->span_masks[first + i] : -1;
        }
}

/* Partition p of the tile's keys: [n rows][dim + 2] = unnormalised sums, running max, sum of exps. */
static void attend_part(const attn_call *a, const tile *t, const tile_rows *r, int p, const part_keys *next,
                        float *part) {
    int k0 = p * PART_KEYS, k1 = k0 + PART_KEYS < t->keys ? k0 + PART_KEYS : t->keys;
    attend_tile_dim(r->q, r->q8, r->qs, r->pos, r->tree, r->pos0, t->mask ? r->span_map : 0, r->n, a->cache, a->s_block, a->s_kv,
                    a->s_offset, a->block_tables + (long)t->seq * a->max_blocks, a->block_size, t->kv_head, a->dim,
                    a->kv_type, a->scale, k0, k1, next, part);
}

/* state (same layout as a partition, empty: l = 0) += the next partition, as one softmax. */
static __attribute__((noinline)) void fold_part(float *state, const float *part, int n, int dim) {
    for (int r = 0; r < n; r++) {
        float *s = state + (size_t)r * (dim + 2);
        const float *p = part + (size_t)r * (dim + 2);
        if (p[dim + 1] == 0.0f) continue;  /* no key of this partition visible to the row */
        if (s[dim + 1] == 0.0f) {
            memcpy(s, p, sizeof(float) * (dim + 2));
            continue;
        }
        float m = s[dim] > p[dim] ? s[dim] : p[dim], cs = expf(s[dim] - m), cp = expf(p[dim] - m);
        for (int d = 0; d < dim; d++) s[d] = s[d] * cs + p[d] * cp;
        s[dim] = m;
        s[dim + 1] = s[dim + 1] * cs + p[dim + 1] * cp;
    }
}

static void write_rows(const tile_rows *r, const float *state, int dim) {
    for (int i = 0; i < r->n; i++) {
        const float *s = state + (size_t)i * (dim + 2);
        float inv = 1.0f / s[dim + 1];
        for (int d = 0; d < dim; d++) r->out[i][d] = s[d] * inv;
    }
}

/* Partition p's key addresses: none past the tile's last partition, without a tile, or for a
 * tree token's run (rare and short). */
static void keys_of_part(const attn_call *a, const tile *t, int p, part_keys *out) {
    out->n = 0;
    if (!t || t->mask || p >= tile_parts(t)) return;
    const long *table = a->block_tables + (long)t->seq * a->max_blocks;
    long esize = pd_kv_esize(a->kv_type);
    int k1 = (p + 1) * PART_KEYS < t->keys ? (p + 1) * PART_KEYS : t->keys;
    for (int k = p * PART_KEYS; k < k1; k++)
        out->keys[out->n++] = key_address(a->cache, table, a->block_size, a->s_block, a->s_offset, t->kv_head,
                                          pd_kv_row(a->kv_type, a->dim), esize, k);
}

/* A tile start to end in one task: its partitions in turn, each requesting the next one's memory
 * (after the last, the first of `next`, the task's next tile, if any) while it computes. */
static void attend_whole_tile(const attn_call *a, const tile *t, const tile *next, float *state, float *part) {
    tile_rows r;
    rows_of(a, t, &r);
    for (int i = 0; i < r.n; i++) state[(size_t)i * (a->dim + 2) + a->dim + 1] = 0.0f;
    part_keys ahead;
    for (int p = 0; p < tile_parts(t); p++) {
        if (p + 1 < tile_parts(t)) keys_of_part(a, t, p + 1, &ahead);
        else keys_of_part(a, next, 0, &ahead);
        attend_part(a, t, &r, p, &ahead, part);
        fold_part(state, part, r.n, a->dim);
    }
    write_rows(&r, state, a->dim);
}

/* Partition p's cost: its keys times its tile's rows, plus its read, about 8 rows' worth (a decode
 * tile's three rows wait on memory more than they compute). */
static long part_cost(const attn_call *a, const tile *t, int p) {
    int keys = t->keys - p * PART_KEYS < PART_KEYS ? t->keys - p * PART_KEYS : PART_KEYS;
    return (long)keys * ((t->t1 - t->t0) * a->group + 8);
}

/* This thread's share [*lo, *hi) of all partitions, in order: contiguous, so that each one's next
 * partition is known and requested ahead (taken from a shared queue, the next one was often the
 * other thread's), and balanced by cost (a verification span's or a prefill chunk's tile has up to
 * 64 rows, a decode step's 3). */
static void thread_share(const attn_call *a, const tile *tiles, int ntiles, int *lo, int *hi) {
    int id = omp_get_thread_num(), threads = omp_get_num_threads(), k = 0;
    long total = 0, before = 0;
    for (int i = 0; i < ntiles; i++)
        for (int p = 0; p < tile_parts(&tiles[i]); p++) total += part_cost(a, &tiles[i], p);
    long from = total * id / threads, to = total * (id + 1) / threads;
    *lo = -1;
    for (int i = 0; i < ntiles; i++)
        for (int p = 0; p < tile_parts(&tiles[i]); p++, k++) {
            long cost = part_cost(a, &tiles[i], p), middle = before + cost / 2;  /* a partition's thread: where its middle falls */
            if (*lo < 0 && middle >= from) *lo = k;
            if (middle >= to) {
                *hi = k;
                if (*lo < 0) *lo = k;
                return;
            }
            before += cost;
        }
    if (*lo < 0) *lo = k;
    *hi = k;  /* the last thread's share runs to the end */
}

/* The tiles of every sequence and kv head into `tiles` (room for kv_heads * (T + num_seqs)), their
 * first_part numbered; returns how many, and their partitions in *parts. */
static int make_tiles(const attn_call *a, int num_seqs, tile *tiles, int *parts) {
    int n = 0, tokens_per_tile = MAX_ROWS / a->group;
    for (int b = 0; b < num_seqs; b++) {
        int first = a->query_start_loc[b], qlen = a->query_start_loc[b + 1] - first;
        int pos0 = a->context_lens[b] - qlen;
        for (int h = 0; h < a->kv_heads; h++) {
            int t0 = 0;  /* the pending tile: tokens t0 .. i-1 */
            for (int i = 0; i <= qlen; i++) {
                int mask = a->span_masks && i < qlen ? a->span_masks[first + i] : -1;
                int off_chain = i < qlen && mask != -1 && mask != (int)((2u << i) - 1);
                if (i > t0 && (i == qlen || off_chain || i - t0 == tokens_per_tile)) {
                    tiles[n++] = (tile){b, h, t0, i, 0, pos0 + i, 0};
                    t0 = i;
                }
                if (off_chain) {
                    tiles[n++] = (tile){b, h, i, i + 1, mask, pos0 + __builtin_popcount(mask), 0};
                    t0 = i + 1;
                }
            }
        }
    }
    *parts = 0;
    for (int i = 0; i < n; i++) {
        tiles[i].first_part = *parts;
        *parts += tile_parts(&tiles[i]);
    }
    return n;
}

/* Enough tiles to share out whole: each thread runs the tiles whose first partitions fall in its
 * share of all partitions, each tile's partitions in turn. */
static int attend_tiles_whole(const attn_call *a, const tile *tiles, int ntiles, int num_threads) {
    size_t row_floats = (size_t)MAX_ROWS * (a->dim + 2);
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|: failed)
    {
        float *state = malloc(2 * row_floats * sizeof(float));
        failed = !state;
        int lo, hi, i = 0;
        thread_share(a, tiles, ntiles, &lo, &hi);
        while (i < ntiles && tiles[i].first_part < lo) i++;
        for (; state && i < ntiles && tiles[i].first_part < hi; i++) {
            int last = i + 1 == ntiles || tiles[i + 1].first_part >= hi;
            attend_whole_tile(a, &tiles[i], last ? 0 : &tiles[i + 1], state, state + row_floats);
        }
        free(state);
    }
    return failed ? -1 : 0;
}

/* Few tiles (a decode step of a few sequences): each partition is a task, then each tile's
 * partitions are folded in order, into its first one's room. */
static int attend_tiles_split(const attn_call *a, const tile *tiles, int ntiles, int parts, int num_threads) {
    size_t row_floats = (size_t)MAX_ROWS * (a->dim + 2);
    int *task_tile = malloc(sizeof(int) * (size_t)parts);
    float *partials = malloc(sizeof(float) * row_floats * (size_t)parts);
    if (!task_tile || !partials) {
        free(task_tile);
        free(partials);
        return -1;
    }
    for (int i = 0; i < ntiles; i++)
        for (int p = 0; p < tile_parts(&tiles[i]); p++) task_tile[tiles[i].first_part + p] = i;
    #pragma omp parallel num_threads(num_threads)
    {
        int lo, hi;
        thread_share(a, tiles, ntiles, &lo, &hi);
        for (int k = lo; k < hi; k++) {
            const tile *t = &tiles[task_tile[k]], *next = k + 1 < hi ? &tiles[task_tile[k + 1]] : 0;
            tile_rows r;
            part_keys ahead;
            rows_of(a, t, &r);
            keys_of_part(a, next, next ? k + 1 - next->first_part : 0, &ahead);
            attend_part(a, t, &r, k - t->first_part, &ahead, partials + row_floats * k);
        }
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int i = 0; i < ntiles; i++) {
            tile_rows r;
            rows_of(a, &tiles[i], &r);
            float *state = partials + row_floats * tiles[i].first_part;
            for (int p = 1; p < tile_parts(&tiles[i]); p++) fold_part(state, state + row_floats * p, r.n, a->dim);
            write_rows(&r, state, a->dim);
        }
    }
    free(task_tile);
    free(partials);
    return 0;
}

/* q: [T, heads, dim]; out: [T, heads*dim]; block_tables: [num_seqs, max_blocks]; span_masks:
 * [T] tree masks (bit j: the row sees the span's token j; -1 = all, the causal rule alone), or
 * NULL; cache: rows of kv_type (kernels.h; strides in elements). Every sequence, prefill chunks
 * as much as decode steps: a row computes the same bits however long its sequence's query is
 * and whatever else is in the batch.
 * Returns 0, or -1 if a shape is outside the kernel's limits (the caller checks these first)
 * or memory runs out. */
int pd_paged_attention(const float *q, const void *cache, int kv_type, long s_block, long s_kv, long s_offset,
                       const long *block_tables, int max_blocks, const int *query_start_loc,
                       const int *context_lens, int num_seqs, int heads, int kv_heads, int dim,
                       int block_size, float scale, float *out, const int *span_masks, int num_threads) {
    int group = heads / kv_heads;
    if (dim % 16 || dim > MAX_DIM || group > MAX_ROWS || kv_type < PD_KV_F32 || kv_type > PD_KV_INT8) return -1;
    attn_call a = {q, NULL, NULL, cache, kv_type, s_block, s_kv, s_offset, block_tables, query_start_loc, context_lens,
                   span_masks, max_blocks, heads, kv_heads, group, dim, block_size, scale, out};
    long rows = (long)query_start_loc[num_seqs] * heads;
    tile *tiles = malloc(sizeof(tile) * (size_t)kv_heads * (query_start_loc[num_seqs] + num_seqs));
    /* an int8 cache's queries, quantized once for every tile and partition: bytes, scales, and
     * for head sizes the integer dots do not take, their values as floats */
    int float_copy = dim % I8_CHUNK != 0;
    char *quantized = kv_type == PD_KV_INT8 ? malloc((size_t)rows * (dim + 4 + (float_copy ? 4 * dim : 0))) : NULL;
    if (!tiles || (kv_type == PD_KV_INT8 && !quantized)) {
        free(tiles);
        free(quantized);
        return -1;
    }
    if (quantized) {
        int8_t *q8 = (int8_t *)quantized;
        float *qs = (float *)(quantized + rows * dim), *values = qs + rows;
        for (long i = 0; i < rows * dim; i += dim) qs[i / dim] = pd_quantize_i8(q + i, dim, q8 + i);
        for (long i = 0; float_copy && i < rows * dim; i++) values[i] = q8[i];
        a.q = float_copy ? values : q;  /* (the integer dots read q8) */
        a.q8 = q8;
        a.qs = qs;
    }
    int parts, ntiles = make_tiles(&a, num_seqs, tiles, &parts);
    int rc = ntiles >= 4 * num_threads ? attend_tiles_whole(&a, tiles, ntiles, num_threads)
                                       : attend_tiles_split(&a, tiles, ntiles, parts, num_threads);
    free(tiles);
    free(quantized);
    return rc;
}
