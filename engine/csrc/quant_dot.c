/* Small-M GEMM over quantized panels with int8 activations: llama.cpp's arithmetic, laid out
 * so that one activation block feeds a whole vector of output columns.
 *
 * Why: widening 4-bit weights to fp32 costs ~5 instructions per 8 weights, so the exact kernel
 * (packed_gemm.c) is bound by instructions, not memory, once a batch has more than a row or two.
 * Integer dot products do 32 multiply-adds per instruction pair (maddubs + madd on AVX2, one
 * vpdpbusd with AVX-512 VNNI): each activation row is quantized per 32-block to int8 with a
 * scale (d_x = max|x| / 127, q_x = round-half-even(x / d_x)), and per block and column
 *   y += d_w d_x dot(q_w, q_x)  (+ m_w d_x sum(q_x) for Q4's min; Q4_0 is Q4_1 with m = -8 d).
 * The integer dots are exact; each row's result depends on that row alone, so a row computes
 * the same in any batch (speculative verification stays lossless against decoding).
 *
 * Layout, per panel of PACK columns and block of 32 k: the scales as in packed_gemm.c, then
 * the quants in groups of 4 bytes per column, PACK columns side by side, so one 32-bit lane of
 * a vector is one column's next 4 k values:
 *   Q8: d[PACK] fp16 | 8 groups x [PACK][4] int8 (k = 4g .. 4g+3)
 *   Q4: d[PACK] fp16 | m[PACK] fp16 | 4 groups x [PACK][4] bytes, low nibbles k = 4g .. 4g+3,
 *       high nibbles k = 16+4g .. 16+4g+3
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#pragma GCC optimize("fp-contract=off")

/* The tiles prefetch the panel this many blocks ahead (~5-10 KB): at 4 rows and more their
 * arithmetic per cache line is long enough that the hardware prefetcher alone falls behind and
 * the weights' DRAM time adds to the arithmetic instead of hiding under it (6 rows: 5.1 -> 3.5 ms
 * over a step's layer GEMMs with AVX-512 VNNI, 8.1 -> 3.7 ms with AVX2, on Machine C). Into L2
 * (prefetcht1), as paged attention's requests: into L1 they held a few of the core's ~24 L1
 * misses each block; the layer GEMMs and lm_head at 1-2 rows took 0.89-0.98x the time, 6-16 rows
 * with the lm_head 0.94-0.96x (Machine D; 32 blocks ahead: no better). */
#define QPREFETCH 16

/* The activation rows, quantized. Without VNNI every 4 bytes of q_x are repeated across a
 * vector: the tiles read a row's next 4 activations for all LANES columns with one plain load
 * (which the multiply takes as its memory operand) instead of a broadcast, which costs a
 * vector-ALU slot on AMD Zen where the multiplies and adds already fill those ports. With VNNI,
 * vpdpbusd takes a 4-byte group broadcast from memory ({1to16}) as its operand at no cost, so the
 * rows stay compact (K bytes each, in L1 instead of LANES times that in L2). */
#if defined(__AVX512VNNI__)
#define XREP 1
#else
#define XREP LANES
#endif
#define VBYTES (XREP * 4)
typedef struct {
    const uint8_t *xb;  /* [M][K/4][VBYTES] */
    const float *d;     /* [M][K/32]: d_x */
    const float *ds;    /* [M][K/32]: d_x * sum(q_x) */
    const int32_t *s;   /* [M][K/32]: sum(q_x) */
    const int32_t *s16; /* [M][K/16]: sum(q_x) per 16 (Q8H's halves), or NULL for other panels */
    int K;
} qrows;

/* One row, per 32-block: d_x = max|x| / 127, q_x = round-half-even(x / d_x) (the magic-number
 * rounding is nearbyintf's in the default rounding mode, |x / d_x| <= 127). A block holding a NaN
 * or an infinity gets d_x = NaN and q_x = 0, so its row's outputs are NaN as the exact kernel's
 * are; one so small that 127 / max|x| overflows (subnormal) is a zero block. */
static void quantize_row(const float *x, int K, uint8_t *xb, float *d, float *ds, int32_t *s, int32_t *s16) {
    typedef int8_t vbyte __attribute__((vector_size(LANES)));
    for (int b = 0; b < K / QBLOCK; b++) {
        const float *xs = x + b * QBLOCK;
        vfloat amax = splat(0.0f), probe = splat(0.0f);
        for (int i = 0; i < QBLOCK; i += LANES) {
            vfloat v = load_f32(xs + i), a = select_lanes(v < 0, -v, v);
            amax = select_lanes(a > amax, a, amax);
            probe += v * 0.0f; /* NaN only where some x is NaN or infinite */
        }
        float m = hmax(amax), scale = m / 127.0f, inv = m > 0.0f ? 127.0f / m : 0.0f;
        float finite = hsum(probe);
        if (finite != finite)
            scale = NAN, inv = 0.0f;
        else if (inv > __FLT_MAX__)
            inv = 0.0f;
        vint sum = splat_i(0);
        int8_t q[QBLOCK];
        for (int i = 0; i < QBLOCK; i += LANES) {
            vint qi = __builtin_convertvector((load_f32(xs + i) * inv + 12582912.0f) - 12582912.0f, vint);
            sum += qi;
            vbyte qb = __builtin_convertvector(qi, vbyte);
            memcpy(q + i, &qb, LANES);
        }
        int total = hsum_i(sum);
        if (s16) {
            s16[2 * b] = s16[2 * b + 1] = 0;
            for (int i = 0; i < QBLOCK; i++) s16[2 * b + i / 16] += q[i];
        }
        if (XREP == 1)
            memcpy(xb + (size_t)b * QBLOCK, q, QBLOCK);
        else
            for (int j = 0; j < QBLOCK / 4; j++) {
                int32_t group;
                memcpy(&group, q + 4 * j, 4);
                vint rep = splat_i(group);
                memcpy(xb + (size_t)(b * QBLOCK / 4 + j) * VBYTES, &rep, VBYTES);
            }
        d[b] = scale;
        ds[b] = scale * (float)total;
        s[b] = total;
    }
}

/* xr's row m, 4-byte group j of block b, repeated across a vector. */
#define XROW(m) (xr->xb + (size_t)(m) * K * XREP + (size_t)b * 8 * VBYTES)
#if XREP == 1
static inline int32_t load_i32(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
#define XV(m, j) _mm512_set1_epi32(load_i32(XROW(m) + (j) * VBYTES))
#else
#define XV(m, j) LOAD(XROW(m) + (j) * VBYTES)
#endif

/* Per block, for each vector v of columns: each row's integer dots with the block's quants, as
 * a vector of int32 (one lane per column), handed to EMIT(m, v, dots) which scales and sums them
 * with the vector's scales dw and mw in scope (SCALES). */
/* Scale field f (0, 1) of the block's vector v of columns: fp16 in Q4 and Q8, fp32 in Q4F and Q8H. */
#define SCALE(f, v) (qtype == 4 || qtype == 8 ? load_f16((const uint16_t *)blk + (f) * PACK + (v) * LANES) \
                                              : load_f32((const float *)blk + (f) * PACK + (v) * LANES))
#define SCALES(v) const vfloat dw = SCALE(0, v), mw = qtype == 8 ? (vfloat){0} : SCALE(1, v)
#if defined(__AVX512BW__) || defined(__AVX2__)
#if defined(__AVX512BW__)
typedef __m512i vi;
#define LOAD(p) _mm512_loadu_si512((const void *)(p))
#define SET1_8(c) _mm512_set1_epi8(c)
#define AND(a, b) _mm512_and_si512(a, b)
#define SRL16(a, n) _mm512_srli_epi16(a, n)
#define ABS8(w) _mm512_abs_epi8(w)
#define ZERO() _mm512_setzero_si512()
#define TO_FLOAT(v) ((vfloat)_mm512_cvtepi32_ps(v))
#define FMA(a, b, c) ((vfloat)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#define SPLAT(s) ((vfloat)_mm512_set1_ps(s))
#define ADD16(a, b) _mm512_add_epi16(a, b)
#define MADDUBS(u, s) _mm512_maddubs_epi16(u, s)
#define WIDEN16(a) _mm512_madd_epi16(a, _mm512_set1_epi16(1))
#if defined(__AVX512VNNI__)
#define DOT4(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#else
#define DOT4(acc, u, s) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)))
#endif
/* x's sign flipped where w is negative (where w = 0 the product is 0 anyway). */
#define SIGN_OF(x, w) _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x)
#else
typedef __m256i vi;
#define LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define SET1_8(c) _mm256_set1_epi8(c)
#define AND(a, b) _mm256_and_si256(a, b)
#define SRL16(a, n) _mm256_srli_epi16(a, n)
#define ABS8(w) _mm256_sign_epi8(w, w)
#define ZERO() _mm256_setzero_si256()
#define TO_FLOAT(v) ((vfloat)_mm256_cvtepi32_ps(v))
#define FMA(a, b, c) ((vfloat)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#define SPLAT(s) ((vfloat)_mm256_set1_ps(s))
#define ADD16(a, b) _mm256_add_epi16(a, b)
#define MADDUBS(u, s) _mm256_maddubs_epi16(u, s)
#define WIDEN16(a) _mm256_madd_epi16(a, _mm256_set1_epi16(1))
#define DOT4(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define SIGN_OF(x, w) _mm256_sign_epi8(x, w)
#endif

/* An accumulator materialised here: integer adds are associative, and without this GCC
 * regroups a tile's products into one sum tree at the end, spilling every product. */
#define KEEP(v) __asm__("" : "+x"(v))

/* Q4: a vector's 4 weight vectors of the block are unpacked once into 8 registers of nibbles,
 * then each row runs its multiplies against them (row after row, so one row's accumulators are
 * live). */
#define Q4_UNPACK(lo, hi, v)                                                                    \
    for (int g = 0; g < 4; g++) {                                                              \
        vi w = LOAD(q + ((size_t)g * PACK + (v) * LANES) * 4);                                  \
        lo[g] = AND(w, SET1_8(0x0F));                                                          \
        hi[g] = AND(SRL16(w, 4), SET1_8(0x0F));                                                \
    }
#if defined(__AVX512VNNI__)
/* With VNNI a row takes the block's vectors together: each of its activation groups is
 * broadcast once for all of them (a pass per vector broadcast each twice: on Zen 4 the layer
 * GEMMs took 0.92-0.93x the time at 4 rows, 0.97-1.00x at 6-16 rows this way, Machine D). Two chains
 * per vector (low and high nibbles): one chain of 8 dependent vpdpbusd would run at the
 * instruction's latency instead of its throughput. 16 registers of nibbles, 4 chains. */
#define Q4_DOTS(MM, EMIT)                                                                       \
    vi lo[GEMM_VECS][4], hi[GEMM_VECS][4];                                                     \
    for (int v = 0; v < GEMM_VECS; v++) Q4_UNPACK(lo[v], hi[v], v)                             \
    for (int m = 0; m < MM; m++) {                                                             \
        vi acc[GEMM_VECS], acc_hi[GEMM_VECS];                                                  \
        for (int v = 0; v < GEMM_VECS; v++) acc[v] = acc_hi[v] = ZERO();                       \
        for (int g = 0; g < 4; g++) {                                                          \
            vi x_lo = XV(m, g), x_hi = XV(m, 4 + g);                                           \
            for (int v = 0; v < GEMM_VECS; v++) {                                              \
                acc[v] = DOT4(acc[v], lo[v][g], x_lo);                                         \
                acc_hi[v] = DOT4(acc_hi[v], hi[v][g], x_hi);                                   \
                KEEP(acc[v]);                                                                  \
                KEEP(acc_hi[v]);                                                               \
            }                                                                                  \
        }                                                                                      \
        for (int v = 0; v < GEMM_VECS; v++) {                                                  \
            SCALES(v);                                                                         \
            EMIT(m, v, TO_FLOAT(_mm512_add_epi32(acc[v], acc_hi[v])));                         \
        }                                                                                      \
    }
#else
/* Without VNNI the pair sums stay 16-bit through the block (|sum| <= 16 * 15 * 127 = 30480),
 * widened to 32 bits once per block: two instructions per group and row fewer. */
#define Q4_ROW(acc, m)                                                                          \
    do {                                                                                       \
        acc = ZERO();                                                                          \
        for (int g = 0; g < 4; g++) {                                                          \
            acc = ADD16(acc, ADD16(MADDUBS(lo[g], XV(m, g)), MADDUBS(hi[g], XV(m, 4 + g))));   \
            KEEP(acc);                                                                         \
        }                                                                                      \
        acc = WIDEN16(acc);                                                                    \
    } while (0)
/* A vector at a time (AVX-512 without VNNI too): two vectors' nibbles would take all of AVX2's 16
 * registers. The rows stay a loop (ROW_LOOP): unrolled, GCC 12 copies every row's activations of
 * the block to the stack first (~80 more loads and stores a block at 5 rows), and the AVX2 tiles of
 * 4 and 5 rows took up to 1.3x the time of the 6-row one. */
#if LANES == 8
#define ROW_LOOP _Pragma("GCC unroll 1")
#else
#define ROW_LOOP
#endif
#define Q4_DOTS(MM, EMIT)                                                                       \
    for (int v = 0; v < GEMM_VECS; v++) {                                                      \
        SCALES(v);                                                                             \
        vi lo[4], hi[4];                                                                       \
        Q4_UNPACK(lo, hi, v)                                                                   \
        ROW_LOOP                                                                               \
        for (int m = 0; m < MM; m++) {                                                         \
            vi acc;                                                                            \
            Q4_ROW(acc, m);                                                                    \
            EMIT(m, v, TO_FLOAT(acc));                                                         \
        }                                                                                      \
    }
#endif
/* Q8: 8 weight vectors would need 16 registers, so the groups are the outer loop and every
 * row's accumulator stays live. Multiplies take an unsigned and a signed operand. With VNNI the
 * weights are made unsigned (w + 128: one xor per weight vector, for all rows) so that x, the
 * signed operand, comes broadcast from memory, and each accumulator starts at -128 sum(q_x):
 * the dot stays exact. Without it |w| and x with w's sign. */
#if defined(__AVX512VNNI__)
#define Q8_START(m) _mm512_set1_epi32(-128 * xr->s[(size_t)(m) * nb + b])
#define Q8_DOT(acc, w, m, g) DOT4(acc, _mm512_xor_si512(w, SET1_8((char)0x80)), XV(m, g))
#else
#define Q8_START(m) ZERO()
#define Q8_DOT(acc, w, m, g) DOT4(acc, ABS8(w), SIGN_OF(XV(m, g), w))
#endif
#define Q8_DOTS(MM, EMIT)                                                                       \
    for (int v = 0; v < GEMM_VECS; v++) {                                                      \
        SCALES(v);                                                                             \
        vi acc[MM];                                                                            \
        for (int m = 0; m < MM; m++) acc[m] = Q8_START(m);                                     \
        for (int g = 0; g < 8; g++) {                                                          \
            vi w = LOAD(q + ((size_t)g * PACK + v * LANES) * 4);                                \
            for (int m = 0; m < MM; m++) {                                                     \
                acc[m] = Q8_DOT(acc[m], w, m, g);                                              \
                KEEP(acc[m]);                                                                  \
            }                                                                                  \
        }                                                                                      \
        for (int m = 0; m < MM; m++) EMIT(m, v, TO_FLOAT(acc[m]));                             \
    }
/* Q8H: as Q8, one accumulator per half (groups 0-3: k 0-15, 4-7: k 16-31), each with its scale. */
#if defined(__AVX512VNNI__)
#define Q8H_START(m, h) _mm512_set1_epi32(-128 * xr->s16[(size_t)(m) * 2 * nb + 2 * b + (h)])
#else
#define Q8H_START(m, h) ZERO()
#endif
#define Q8H_DOTS(MM, EMIT)                                                                      \
    for (int v = 0; v < GEMM_VECS; v++) {                                                      \
        SCALES(v);                                                                             \
        vi acc[MM][2];                                                                         \
        for (int m = 0; m < MM; m++) {                                                         \
            acc[m][0] = Q8H_START(m, 0);                                                       \
            acc[m][1] = Q8H_START(m, 1);                                                       \
        }                                                                                      \
        for (int g = 0; g < 8; g++) {                                                          \
            vi w = LOAD(q + ((size_t)g * PACK + v * LANES) * 4);                                \
            for (int m = 0; m < MM; m++) {                                                     \
                acc[m][g / 4] = Q8_DOT(acc[m][g / 4], w, m, g);                                \
                KEEP(acc[m][g / 4]);                                                           \
            }                                                                                  \
        }                                                                                      \
        for (int m = 0; m < MM; m++) EMIT(m, v, TO_FLOAT(acc[m][0]), TO_FLOAT(acc[m][1]));     \
    }
#else
#include "quant_dot_portable.h"
#endif

/* MM rows of y = bias + the sum over blocks of d_w d_x dot (+ m_w d_x sum(q_x)), in one pass over
 * the panel's blocks: each block is read once, for both vectors of columns, and each row's running
 * sums stay in registers. (Summed through memory, out[m] loaded, updated and stored every block,
 * each block's update waited for the previous one's store: a chain of ~15 cycles per block that no
 * row count could hide, AVX-512 6 / 16 rows 3.6 / 7.8 -> 2.4-2.8 / 4.5 ms on Machine C. A pass per
 * vector of columns, the second finding the panel in L2, cost 10-28 % more on Machine D, AVX-512
 * and AVX2 builds alike, at 1 to 16 rows.) With AVX2's 16 registers GCC keeps the sums in memory.
 * Fused multiply-adds only where written (FMA; contraction is off in this file): a row must
 * compute the same bits in any batch, whatever the compiler would fuse in each tile height's
 * copy. */
#define DEFINE_QI_TILE(NAME, QTYPE, DOTS, EMIT, BLOCK_BYTES, MM)                                \
    static void NAME##_##MM(const qrows *xr, const uint8_t *panel, const float *bias, float *y, \
                            int ldy, int ncols) {                                              \
        const int K = xr->K, nb = K / QBLOCK, qtype = QTYPE, has_min = QTYPE == 4 || QTYPE == 6; \
        vfloat sums[GEMM_VECS][MM];                                                            \
        for (int v = 0; v < GEMM_VECS; v++) {                                                  \
            float init[LANES];                                                                 \
            for (int c = 0; c < LANES; c++) init[c] = bias && v * LANES + c < ncols ? bias[v * LANES + c] : 0.0f; \
            for (int m = 0; m < MM; m++) sums[v][m] = load_f32(init);                          \
        }                                                                                      \
        for (int b = 0; b < nb; b++) {                                                         \
            const uint8_t *blk = panel + (size_t)b * BLOCK_BYTES;                              \
            for (int l = 0; l < BLOCK_BYTES; l += 64) __builtin_prefetch(blk + QPREFETCH * BLOCK_BYTES + l, 0, 2); \
            const uint8_t *q = blk + pd_qscale_bytes(QTYPE) * PACK;                            \
            DOTS(MM, EMIT)                                                                     \
        }                                                                                      \
        float out[MM][PACK];                                                                   \
        for (int v = 0; v < GEMM_VECS; v++)                                                    \
            for (int m = 0; m < MM; m++) store_f32(out[m] + v * LANES, sums[v][m]);           \
        for (int m = 0; m < MM; m++) memcpy(y + (size_t)m * ldy, out[m], sizeof(float) * ncols); \
    }
#define EMIT_BLOCK(m, v, dots)                                                                  \
    do {                                                                                       \
        sums[v][m] = FMA(dots, dw * xr->d[(size_t)(m) * nb + b], sums[v][m]);                    \
        if (has_min) sums[v][m] = FMA(mw, SPLAT(xr->ds[(size_t)(m) * nb + b]), sums[v][m]);      \
    } while (0)
/* Q8H: mw is k 16-31's scale. */
#define EMIT_HALVES(m, v, dots0, dots1) \
    sums[v][m] = FMA(FMA(dots1, mw, dots0 * dw), SPLAT(xr->d[(size_t)(m) * nb + b]), sums[v][m])

#define Q8I_TILE(MM) DEFINE_QI_TILE(q8i_tile, 8, Q8_DOTS, EMIT_BLOCK, Q8_BYTES, MM)
#define Q4I_TILE(MM) DEFINE_QI_TILE(q4i_tile, 4, Q4_DOTS, EMIT_BLOCK, Q4_BYTES, MM)
#define Q4FI_TILE(MM) DEFINE_QI_TILE(q4fi_tile, 6, Q4_DOTS, EMIT_BLOCK, Q4F_BYTES, MM)
#define Q8HI_TILE(MM) DEFINE_QI_TILE(q8hi_tile, 10, Q8H_DOTS, EMIT_HALVES, Q8H_BYTES, MM)
typedef void (*qi_tile_fn)(const qrows *, const uint8_t *, const float *, float *, int, int);
#if GEMM_ROWS == 8
#define DEFINE_QI_TILES(TILE, NAME)                                                            \
    TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)                           \
    static const qi_tile_fn NAME##_tiles[] = {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, \
                                             NAME##_6, NAME##_7, NAME##_8};
#else
#define DEFINE_QI_TILES(TILE, NAME)                                                            \
    TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)                                           \
    static const qi_tile_fn NAME##_tiles[] = {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6};
#endif
DEFINE_QI_TILES(Q8I_TILE, q8i_tile)
DEFINE_QI_TILES(Q4I_TILE, q4i_tile)
DEFINE_QI_TILES(Q4FI_TILE, q4fi_tile)
DEFINE_QI_TILES(Q8HI_TILE, q8hi_tile)

/* Rows per pass over the panels: the repeated activations of a pass (rows x K x LANES bytes)
 * stay in a core's L2 while every panel streams past them; longer batches (prefill) take
 * several passes, each reading the weights again. */
static int rows_per_pass(int K) {
    int rows = (256 * 1024) / (K * XREP) / GEMM_ROWS * GEMM_ROWS;
    return rows > GEMM_ROWS ? rows : GEMM_ROWS;
}

/* y[M][N] = x[M][K] @ W^T (+ bias) for W of qtype 8 (Q8), 4 (Q4), 6 (Q4F) or 10 (Q8H) packed as
 * above, x quantized to int8 per row and 32-block first. Returns 0, or -1 for a bad qtype or K,
 * or no memory. */
int pd_quant_gemm_i8(int qtype, const float *x, const uint8_t *packed, const float *bias, float *y, int M, int K,
                     int N, int num_threads) {
    long block_bytes = pd_qblock_bytes(qtype);
    if (!block_bytes || K % QBLOCK) return -1;
    int nb = K / QBLOCK;
    char *mem = malloc((size_t)M * K * XREP + 5 * sizeof(float) * (size_t)M * nb);
    if (!mem) return -1;
    float *dx = (float *)mem, *dsx = dx + (size_t)M * nb;
    int32_t *sx = (int32_t *)(dsx + (size_t)M * nb), *s16 = qtype == 10 ? sx + (size_t)M * nb : NULL;
    uint8_t *xb = (uint8_t *)(sx + (size_t)M * 3 * nb);
    size_t panel_bytes = (size_t)nb * block_bytes;
    int panels = (N + PACK - 1) / PACK, pass_rows = rows_per_pass(K), passes = (M + pass_rows - 1) / pass_rows;
    const qi_tile_fn *tiles = qtype == 8 ? q8i_tile_tiles : qtype == 4 ? q4i_tile_tiles
                              : qtype == 6 ? q4fi_tile_tiles : q8hi_tile_tiles;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int m = 0; m < M; m++)
            quantize_row(x + (size_t)m * K, K, xb + (size_t)m * K * XREP, dx + (size_t)m * nb, dsx + (size_t)m * nb,
                         sx + (size_t)m * nb, s16 ? s16 + (size_t)m * 2 * nb : NULL);
        #pragma omp for schedule(static) collapse(2)
        for (int pass = 0; pass < passes; pass++)
            for (int p = 0; p < panels; p++) {
                int col = p * PACK, ncols = N - col < PACK ? N - col : PACK;
                int end = (pass + 1) * pass_rows < M ? (pass + 1) * pass_rows : M;
                for (int m0 = pass * pass_rows; m0 < end; m0 += GEMM_ROWS) {
                    qrows rows = {xb + (size_t)m0 * K * XREP, dx + (size_t)m0 * nb, dsx + (size_t)m0 * nb,
                                   sx + (size_t)m0 * nb, s16 ? s16 + (size_t)m0 * 2 * nb : NULL, K};
                    tiles[end - m0 < GEMM_ROWS ? end - m0 : GEMM_ROWS](
                        &rows, packed + p * panel_bytes, bias ? bias + col : 0, y + (size_t)m0 * N + col, N, ncols);
                }
            }
    }
    free(mem);
    return 0;
}
