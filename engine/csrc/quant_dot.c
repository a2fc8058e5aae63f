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

typedef struct {  /* the activation rows, quantized */
    const int8_t *q;   /* [M][K] */
    const float *d;    /* [M][K/32]: d_x */
    const float *ds;   /* [M][K/32]: d_x * sum(q_x) */
    int K;
} qrows;

static void quantize_rows(const float *x, int M, int K, int8_t *q, float *d, float *ds) {
    for (int m = 0; m < M; m++)
        for (int b = 0; b < K / QBLOCK; b++) {
            const float *xb = x + (size_t)m * K + b * QBLOCK;
            int8_t *qb = q + (size_t)m * K + b * QBLOCK;
            float amax = 0.0f;
            for (int i = 0; i < QBLOCK; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;  /* fmaxf is a libm call here */
            float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int sum = 0;
            for (int i = 0; i < QBLOCK; i++) {
                qb[i] = (int8_t)nearbyintf(xb[i] * inv);
                sum += qb[i];
            }
            d[(size_t)m * (K / QBLOCK) + b] = scale;
            ds[(size_t)m * (K / QBLOCK) + b] = scale * (float)sum;
        }
}

/* Per block and vector v of columns: the integer dots of MM rows with the block's quants, each
 * row's as a vector of int32 (one lane per column), which the tile below scales and sums. */
#if defined(__AVX512BW__) || defined(__AVX2__)
#if defined(__AVX512BW__)
typedef __m512i vi;
#define BCAST_ASM "vpbroadcastd %1, %0" : "=v"
#define LOAD(p) _mm512_loadu_si512((const void *)(p))
#define BCAST(p) bcast32(p)
#define SET1_8(c) _mm512_set1_epi8(c)
#define AND(a, b) _mm512_and_si512(a, b)
#define SRL16(a, n) _mm512_srli_epi16(a, n)
#define ABS8(w) _mm512_abs_epi8(w)
#define ZERO() _mm512_setzero_si512()
#define TO_FLOAT(v) ((vfloat)_mm512_cvtepi32_ps(v))
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
#define BCAST_ASM "vpbroadcastd %1, %0" : "=x"
#define LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define BCAST(p) bcast32(p)
#define SET1_8(c) _mm256_set1_epi8(c)
#define AND(a, b) _mm256_and_si256(a, b)
#define SRL16(a, n) _mm256_srli_epi16(a, n)
#define ABS8(w) _mm256_sign_epi8(w, w)
#define ZERO() _mm256_setzero_si256()
#define TO_FLOAT(v) ((vfloat)_mm256_cvtepi32_ps(v))
#define ADD16(a, b) _mm256_add_epi16(a, b)
#define MADDUBS(u, s) _mm256_maddubs_epi16(u, s)
#define WIDEN16(a) _mm256_madd_epi16(a, _mm256_set1_epi16(1))
#define DOT4(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define SIGN_OF(x, w) _mm256_sign_epi8(x, w)
#endif

/* A row's next 4 activation bytes in every 32-bit lane, straight from memory (one load uop).
 * As asm volatile so the compiler neither hoists the tile's 8 x rows broadcasts out of the loop
 * over column vectors (it did, and spilled them all) nor merges them. */
static inline vi bcast32(const int8_t *p) {
    vi r;
    __asm__ volatile(BCAST_ASM(r) : "m"(*(const int32_t *)p));
    return r;
}

#if defined(__AVX512VNNI__)
#define Q4_PAIR(acc, lo, hi, xl, xh) DOT4(DOT4(acc, lo, xl), hi, xh)
#define Q4_FINISH(acc) (acc)
#else
/* Without VNNI the pair sums stay 16-bit through the block (|sum| <= 16 * 15 * 127 = 30480),
 * widened to 32 bits once per block: two instructions per group and row fewer. */
#define Q4_PAIR(acc, lo, hi, xl, xh) ADD16(acc, ADD16(MADDUBS(lo, xl), MADDUBS(hi, xh)))
#define Q4_FINISH(acc) WIDEN16(acc)
#endif
#define Q4_DOTS(MM)                                                                             \
    vi acc[MM];                                                                                 \
    for (int m = 0; m < MM; m++) acc[m] = ZERO();                                              \
    for (int g = 0; g < 4; g++) {                                                              \
        vi w = LOAD(q + ((size_t)g * PACK + v * LANES) * 4);                                    \
        vi lo = AND(w, SET1_8(0x0F)), hi = AND(SRL16(w, 4), SET1_8(0x0F));                     \
        for (int m = 0; m < MM; m++)                                                           \
            acc[m] = Q4_PAIR(acc[m], lo, hi, BCAST(x + (size_t)m * K + 4 * g),                  \
                             BCAST(x + (size_t)m * K + 16 + 4 * g));                            \
    }                                                                                          \
    for (int m = 0; m < MM; m++) acc[m] = Q4_FINISH(acc[m]);
#define Q8_DOTS(MM)                                                                             \
    vi acc[MM];                                                                                 \
    for (int m = 0; m < MM; m++) acc[m] = ZERO();                                              \
    for (int g = 0; g < 8; g++) {                                                              \
        vi w = LOAD(q + ((size_t)g * PACK + v * LANES) * 4), aw = ABS8(w);                      \
        for (int m = 0; m < MM; m++)                                                           \
            acc[m] = DOT4(acc[m], aw, SIGN_OF(BCAST(x + (size_t)m * K + 4 * g), w));            \
    }
#define DOT_VECTOR(m) TO_FLOAT(acc[m])
#else
#define Q4_DOTS(MM)                                                                             \
    int32_t acc[MM][LANES];                                                                     \
    for (int m = 0; m < MM; m++)                                                               \
        for (int c = 0; c < LANES; c++) {                                                      \
            int32_t s = 0;                                                                     \
            for (int g = 0; g < 4; g++)                                                        \
                for (int i = 0; i < 4; i++) {                                                  \
                    uint8_t b = q[((size_t)g * PACK + v * LANES + c) * 4 + i];                 \
                    s += (b & 15) * x[(size_t)m * K + 4 * g + i] + (b >> 4) * x[(size_t)m * K + 16 + 4 * g + i]; \
                }                                                                              \
            acc[m][c] = s;                                                                     \
        }
#define Q8_DOTS(MM)                                                                             \
    int32_t acc[MM][LANES];                                                                     \
    for (int m = 0; m < MM; m++)                                                               \
        for (int c = 0; c < LANES; c++) {                                                      \
            int32_t s = 0;                                                                     \
            for (int g = 0; g < 8; g++)                                                        \
                for (int i = 0; i < 4; i++)                                                    \
                    s += (int8_t)q[((size_t)g * PACK + v * LANES + c) * 4 + i] * x[(size_t)m * K + 4 * g + i]; \
            acc[m][c] = s;                                                                     \
        }
static inline vfloat ints_to_float(const int32_t *a) {
    float f[LANES];
    for (int c = 0; c < LANES; c++) f[c] = (float)a[c];
    return load_f32(f);
}
#define DOT_VECTOR(m) ints_to_float(acc[m])
#endif

/* MM rows of y = bias + the sum over blocks of d_w d_x dot (+ m_w d_x sum(q_x)). The running
 * sums live in out[MM][PACK] (L1); no FMA contraction in this file: fused or not could differ
 * between row counts as the compiler schedules them, and a row must compute the same in any
 * batch. */
#define DEFINE_QI_TILE(NAME, QTYPE, DOTS, BLOCK_BYTES, MM)                                      \
    static void NAME##_##MM(const qrows *xr, const uint8_t *panel, const float *bias, float *y, \
                            int ldy, int ncols) {                                              \
        int K = xr->K, nb = K / QBLOCK;                                                        \
        float out[MM][PACK];                                                                   \
        for (int m = 0; m < MM; m++)                                                           \
            for (int c = 0; c < PACK; c++) out[m][c] = bias && c < ncols ? bias[c] : 0.0f;     \
        for (int b = 0; b < nb; b++) {                                                         \
            const uint8_t *blk = panel + (size_t)b * BLOCK_BYTES;                              \
            const uint8_t *q = blk + (QTYPE == 8 ? 2 : 4) * PACK;                              \
            const int8_t *x = xr->q + b * QBLOCK;                                              \
            for (int v = 0; v < GEMM_VECS; v++) {                                              \
                DOTS(MM)                                                                       \
                vfloat dw = load_f16((const uint16_t *)blk + v * LANES);                       \
                vfloat mw = QTYPE == 8 ? (vfloat){0} : load_f16((const uint16_t *)blk + PACK + v * LANES); \
                for (int m = 0; m < MM; m++) {                                                 \
                    float dx = xr->d[(size_t)m * nb + b], dsx = xr->ds[(size_t)m * nb + b];    \
                    vfloat sum = load_f32(out[m] + v * LANES) + DOT_VECTOR(m) * (dw * dx);     \
                    if (QTYPE == 4) sum = sum + mw * dsx;                                      \
                    store_f32(out[m] + v * LANES, sum);                                        \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int m = 0; m < MM; m++) memcpy(y + (size_t)m * ldy, out[m], sizeof(float) * ncols); \
    }

#define Q8I_TILE(MM) DEFINE_QI_TILE(q8i_tile, 8, Q8_DOTS, Q8_BYTES, MM)
#define Q4I_TILE(MM) DEFINE_QI_TILE(q4i_tile, 4, Q4_DOTS, Q4_BYTES, MM)
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

/* y[M][N] = x[M][K] @ W^T (+ bias) for W of qtype 8 (Q8) or 4 (Q4) packed as above, x quantized
 * to int8 per row and 32-block first. Returns 0, or -1 for a bad qtype or K, or no memory. */
int pd_quant_gemm_i8(int qtype, const float *x, const uint8_t *packed, const float *bias, float *y, int M, int K,
                     int N, int num_threads) {
    if ((qtype != 8 && qtype != 4) || K % QBLOCK) return -1;
    int nb = K / QBLOCK;
    char *mem = malloc((size_t)M * K + 2 * sizeof(float) * (size_t)M * nb);
    if (!mem) return -1;
    float *dx = (float *)mem, *dsx = dx + (size_t)M * nb;
    int8_t *qx = (int8_t *)(dsx + (size_t)M * nb);
    quantize_rows(x, M, K, qx, dx, dsx);
    size_t panel_bytes = (size_t)nb * (qtype == 8 ? Q8_BYTES : Q4_BYTES);
    int panels = (N + PACK - 1) / PACK;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int p = 0; p < panels; p++) {
        int col = p * PACK, ncols = N - col < PACK ? N - col : PACK;
        for (int m0 = 0; m0 < M; m0 += GEMM_ROWS) {
            qrows rows = {qx + (size_t)m0 * K, dx + (size_t)m0 * nb, dsx + (size_t)m0 * nb, K};
            (qtype == 8 ? q8i_tile_tiles : q4i_tile_tiles)[M - m0 < GEMM_ROWS ? M - m0 : GEMM_ROWS](
                &rows, packed + p * panel_bytes, bias ? bias + col : 0, y + (size_t)m0 * N + col, N, ncols);
        }
    }
    free(mem);
    return 0;
}
