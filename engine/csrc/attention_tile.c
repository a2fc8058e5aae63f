/* One tile's attention over one partition of keys (paged_attention.c cuts a batch into tiles
 * and partitions): a tile is the rows (query token, head) of one sequence that share a kv head.
 *
 * Cache addressing (one layer of the block-major cache, any strides):
 *   key(block, offset, kv_head)   = cache + block*s_block + offset*s_offset + kv_head*row
 * (row: a head's elements, D, or D + 4 in an int8 cache: pd_kv_row)
 * in elements of the cache's type (kv_type, kernels.h): fp32, bf16 or int8, widened to fp32 in
 * registers as they are read (key_chunk); an int8 row's scale (after its D values) multiplies
 * the key's score and the value's weight instead of its elements. With an int8 cache the queries
 * are quantized per row the same way (as llama.cpp's q8_0 cache does), and a score is the exact
 * integer dot product of the two rows (dot_i8) times both scales. With a bf16 cache the queries
 * are rounded to bf16, and with AVX-512 BF16 (head sizes a multiple of 32) a score's products
 * come from vdpbf16ps on the cache's keys as stored (dot_bf16).
 *   value(block, offset, kv_head) = the same + s_kv
 * Within a partition the scores, their max and exps are computed whole, with a vectorised exp;
 * the vector width follows the ISA build (vector_isa.h).
 */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "attention_tile.h"

#define KEYS LANES       /* keys per step: one vector of scores */

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

/* A bf16 cache's queries are rounded to bf16 as well (to nearest even, as torch rounds; llama.cpp
 * rounds its queries to its f16 cache's type alike): every product of a query and a key element
 * is then exact in fp32, and with AVX-512 BF16 one vdpbf16ps multiplies 32 of them straight from
 * the cache, without widening the key, where the fp32 path took a load, a shift or mask and an
 * FMA per 16 (dot_bf16). Scores move by ~1e-3 (the queries' rounding); a 6-token span's attention
 * took 0.81x the time, decode 0.88-0.94x (Machine D, bench.kernel_ab). Other builds round the queries
 * the same way and multiply in fp32 (permute_query), the torch and Triton paths too. */
static inline vfloat round_to_bf16(vfloat x) {
    vword w = round_bf16_words(x);
    vfloat r;
    memcpy(&r, &w, sizeof r);
    return r;
}

#if defined(__AVX512BF16__) && LANES == 16
#define HAVE_BF16_DOTS 1
#define BF16_DOTS(dim) ((dim) % 32 == 0)  /* the head sizes dot_bf16 takes */
/* The query's `dim` floats as bf16, in order. */
static inline void query_bf16(const float *q, uint16_t *out, int dim) {
    for (int c = 0; c < dim; c += 32)  /* the second operand's floats go to the lower half */
        _mm512_storeu_si512(out + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + c + 16), _mm512_loadu_ps(q + c)));
}

/* Per lane l, the sum over 32-element chunks c of key[32c + 2l] q[32c + 2l] + key[32c + 2l + 1] q[32c + 2l + 1]. */
static inline vfloat dot_bf16(const char *key, const uint16_t *q, int dim) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < dim / 32; c++)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(key + 64 * c), (__m512bh)_mm512_loadu_si512(q + 32 * c));
    return (vfloat)acc;
}
#else
#define HAVE_BF16_DOTS 0
#define BF16_DOTS(dim) 0
#endif

/* The query's `dim` floats in key_chunk's order for a bf16 cache, rounded to bf16. */
static inline void permute_query(const float *q, float *out, int chunks) {
    static const vint even = {LANE_LIST(EVEN_INDEX, 0)}, odd = {LANE_LIST(EVEN_INDEX, 1)};
    for (int c = 0; c + 1 < chunks; c += 2) {
        vfloat a = round_to_bf16(load_f32(q + LANES * c)), b = round_to_bf16(load_f32(q + LANES * (c + 1)));
        store_f32(out + LANES * c, __builtin_shuffle(a, b, even));
        store_f32(out + LANES * (c + 1), __builtin_shuffle(a, b, odd));
    }
    if (chunks % 2) store_f32(out + LANES * (chunks - 1), round_to_bf16(load_f32(q + LANES * (chunks - 1))));
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

/* A bf16 partition's keys (or values: `offset` bytes further) widened once for all of a tile's rows,
 * `n` rows of `dim` floats in key_chunk's order, so each row's arithmetic reads the same floats in
 * the same order as widening in registers would give it (its bits do not change). Widened per row
 * instead, an 18-row tile (a 6-token verification span) widened every key 18 times: the scores
 * and values took 1.35x the time (AVX2, keys in cache). Tiles of fewer than WIDEN_ROWS rows (a
 * decode step's) widen in registers: a pass ahead of the arithmetic waits for the partition's
 * lines from DRAM all at once, and cold attention at batch 16 took 1.03-1.10x the time. */
#define WIDEN_ROWS 6
static inline void widen_rows(const char *const *rows, long offset, int n, int dim, float *out) {
    const int chunks = dim / LANES;
    for (int o = 0; o < n; o++)
        for (int c = 0; c < chunks; c++)
            store_f32(out + (size_t)o * dim + LANES * c, key_chunk(rows[o] + offset, c, chunks, PD_KV_BF16));
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
    const part_keys *next, const float *widened) {
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
            vfloat v = widened ? load_f32(widened + (size_t)(o + (k)) * dim + LANES * c)       \
                               : key_chunk(keys[o + (k)] + value_offset, c, chunks, kv_type);  \
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
 * values. `dim` is a compile-time constant in each inlined copy (see pd_attend_tile), so the
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
#if HAVE_BF16_DOTS
    static __thread uint16_t qb[MAX_ROWS * MAX_DIM];  /* the queries as bf16 (dot_bf16) */
#endif
    for (int r = 0; r < nrows; r++) {
        q[r] = bf16 ? permuted + (size_t)r * dim : qrows[r];
#if HAVE_BF16_DOTS
        if (bf16 && BF16_DOTS(dim)) {
            query_bf16(qrows[r], qb + (size_t)r * dim, dim);
            continue;
        }
#endif
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
    /* A bf16 cache without dot_bf16: keys, then values, widened once (widen_rows). */
    static __thread float widened[PART_KEYS * MAX_DIM];
    const int widen = bf16 && !BF16_DOTS(dim) && nrows >= WIDEN_ROWS;
    if (widen) widen_rows(keys, 0, steps * KEYS, dim, widened);
#define SCORE_KV(o, c) (widen ? load_f32(widened + (size_t)(st * KEYS + (o)) * dim + LANES * (c)) : KV(kv[o], c))
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
            }
#if HAVE_BF16_DOTS
            else if (bf16 && BF16_DOTS(dim)) {
                for (int o = 0; o < KEYS; o++) d[o] = dot_bf16(kv[o], qb + (size_t)r * dim, dim);
            }
#endif
            else {  /* each chunk of the query loaded once, against that chunk of every key (an int8
                       * cache's here too, for other head sizes: its integer products sum exactly) */
                vfloat qc = load_f32(q[r]);
                for (int o = 0; o < KEYS; o++) d[o] = qc * SCORE_KV(o, 0);
                for (int c = 1; c < chunks; c++) {
                    qc = load_f32(q[r] + LANES * c);
                    for (int o = 0; o < KEYS; o++) d[o] += qc * SCORE_KV(o, c);
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
    if (widen) widen_rows(keys, value_offset, steps * KEYS, dim, widened);
    const float *values = widen ? widened : NULL;
    const int pair = 2 * key_stride(chunks) * chunks <= PAIRED_SUMS && nrows >= 4;
    int r = 0;
    for (; pair && r + 1 < nrows; r += 2)
        weigh_values(keys, value_offset, (const float *)scores[r], vscale, part, r, 2, pos, nrows, k0, k1, dim, kv_type,
                     next, values);
    for (; r < nrows; r++)
        weigh_values(keys, value_offset, (const float *)scores[r], vscale, part, r, 1, pos, nrows, k0, k1, dim, kv_type,
                     next, values);
#undef VISIBLE
#undef SCORE_KV
#undef KV
}

void pd_attend_tile(const float *const *qrows, const int8_t *const *q8rows, const float *qscales, const int *pos,
                    const int *tree, int span0, const int *span_map, int nrows, const char *cache, long s_block,
                    long s_kv, long s_offset, const long *table, int block_size, int kv_head, int dim, int kv_type,
                    float scale, int k0, int k1, const part_keys *next, float *part) {
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
