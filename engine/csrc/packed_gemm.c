/* Small-M GEMM over prepacked weights (fp32 activations), for CPU decode and verification.
 *
 * Why: decode and speculative verification multiply a handful of rows (1..16) by every weight
 * matrix of the model. That is memory-bound: the weights stream from DRAM once per step, so a
 * forward over 6 tokens should cost about what one token costs. MKL's sgemm falls off a cliff
 * for 2..16 rows on this class of CPU; this kernel reads each weight once per row tile, keeps
 * the tile's accumulators in registers and stays flat from 1 row to a tile's height.
 *
 * Layout: a weight W[N][K] (torch Linear layout, y = x @ W^T) is packed as
 *   P[N_pad / PACK][K][PACK]   (N padded with zero rows to a multiple of PACK)
 * so the inner loop reads PACK consecutive output columns for one k as GEMM_VECS vectors.
 * PACK and the tile height follow the vector width (vector_isa.h), so a packed weight belongs
 * to the library build that packed it.
 * Weights are fp32, or bf16 (half the DRAM traffic; widened to fp32 in registers, all
 * arithmetic in fp32).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"


/* A tile's pieces, shared by the fp32/bf16 tiles and the exact quantized ones: MM rows x PACK
 * columns of accumulators started from the bias, one k step (PACK weights at `row`, read with
 * LOAD, times x[m][k]), and the store of ncols columns. */
#define TILE_BEGIN(MM)                                                                         \
    float init[PACK] = {0};                                                                     \
    if (bias) memcpy(init, bias, sizeof(float) * ncols);                                        \
    vfloat acc[MM][GEMM_VECS];                                                                  \
    for (int m = 0; m < MM; m++)                                                                \
        for (int v = 0; v < GEMM_VECS; v++) acc[m][v] = load_f32(init + v * LANES);
#define TILE_STEP(MM, row, LOAD, k)                                                            \
    {                                                                                           \
        vfloat w[GEMM_VECS];                                                                    \
        for (int v = 0; v < GEMM_VECS; v++) w[v] = LOAD((row) + v * LANES);                     \
        for (int m = 0; m < MM; m++) {                                                          \
            float xv = x[(size_t)m * K + (k)];                                                  \
            for (int v = 0; v < GEMM_VECS; v++) acc[m][v] += xv * w[v];                         \
        }                                                                                       \
    }
#define TILE_END(MM)                                                                           \
    for (int m = 0; m < MM; m++) {                                                              \
        float out[PACK];                                                                        \
        memcpy(out, acc[m], sizeof out);                                                        \
        memcpy(y + (size_t)m * ldy, out, sizeof(float) * ncols);                                \
    }

/* y[m][0:ncols] = bias[0:ncols] + x[m] . P_panel for m < MM, for one panel of weights of
 * element type T, read with LOAD. */
#define DEFINE_TILE(NAME, T, LOAD, MM)                                                         \
    static void NAME##_##MM(const float *x, int K, const T *panel, const float *bias,           \
                            float *y, int ldy, int ncols) {                                     \
        TILE_BEGIN(MM)                                                                          \
        for (int k = 0; k < K; k++) {                                                           \
            const T *row = panel + (size_t)k * PACK;                                            \
            if (GEMM_PREFETCH) __builtin_prefetch((const char *)row + GEMM_PREFETCH);           \
            TILE_STEP(MM, row, LOAD, k)                                                         \
        }                                                                                       \
        TILE_END(MM)                                                                            \
    }

#define TILE_ARGS(T) const float *, int, const T *, const float *, float *, int, int
#if GEMM_ROWS == 8
#define DEFINE_TILES(NAME, T, LOAD)                                                            \
    DEFINE_TILE(NAME, T, LOAD, 1) DEFINE_TILE(NAME, T, LOAD, 2) DEFINE_TILE(NAME, T, LOAD, 3)   \
    DEFINE_TILE(NAME, T, LOAD, 4) DEFINE_TILE(NAME, T, LOAD, 5) DEFINE_TILE(NAME, T, LOAD, 6)   \
    DEFINE_TILE(NAME, T, LOAD, 7) DEFINE_TILE(NAME, T, LOAD, 8)                                \
    static void (*const NAME##_tiles[])(TILE_ARGS(T)) = {                                          \
        0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7, NAME##_8};
#elif GEMM_ROWS == 6
#define DEFINE_TILES(NAME, T, LOAD)                                                            \
    DEFINE_TILE(NAME, T, LOAD, 1) DEFINE_TILE(NAME, T, LOAD, 2) DEFINE_TILE(NAME, T, LOAD, 3)   \
    DEFINE_TILE(NAME, T, LOAD, 4) DEFINE_TILE(NAME, T, LOAD, 5) DEFINE_TILE(NAME, T, LOAD, 6)   \
    static void (*const NAME##_tiles[])(TILE_ARGS(T)) = {                                          \
        0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6};
#else
#error "GEMM_ROWS must be 6 or 8"
#endif

/* The tile sizes and the panel loop, for one weight type. */
#define DEFINE_GEMM(NAME, T, LOAD)                                                             \
    DEFINE_TILES(NAME, T, LOAD)                                                                \
    /* y[M][N] = x[M][K] @ W^T (+ bias[N]); x rows have stride K, y rows stride N. */           \
    void NAME(const float *x, const T *packed, const float *bias, float *y, int M, int K,       \
              int N, int num_threads) {                                                         \
        int panels = (N + PACK - 1) / PACK;                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                   \
        for (int p = 0; p < panels; p++) {                                                      \
            const T *panel = packed + (size_t)p * K * PACK;                                     \
            int col = p * PACK;                                                                 \
            int ncols = N - col < PACK ? N - col : PACK;                                        \
            const float *b = bias ? bias + col : 0;                                             \
            /* All row tiles of a panel run back to back: DRAM once, then cache. */             \
            for (int m0 = 0; m0 < M; m0 += GEMM_ROWS) {                                         \
                int rows = M - m0 < GEMM_ROWS ? M - m0 : GEMM_ROWS;                             \
                NAME##_tiles[rows](x + (size_t)m0 * K, K, panel, b, y + (size_t)m0 * N + col, N, \
                                   ncols);                                                      \
            }                                                                                   \
        }                                                                                       \
    }

DEFINE_GEMM(pd_packed_gemm, float, load_f32)
DEFINE_GEMM(pd_packed_gemm_bf16, uint16_t, load_bf16)

int pd_pack_width(void) { return PACK; }
int pd_vector_lanes(void) { return LANES; }

/* ---- Quantized panels: GGUF Q8_0 / Q4_0 / Q4_1 weights, dequantized in registers ----
 *
 * Why: decode streams every weight once per step, so the bytes per weight set its speed. A GGUF
 * stores 4.5-8.5 bits per weight; we keep them at that size and widen them in registers.
 *
 * Exactness: each weight is widened to the very fp32 value the GGUF's dequantization gives
 * (q * d for Q8_0; fma(q, d, m) for Q4_1, and Q4_0 as Q4_1 with m = -8d: the products are exact
 * in fp32, so one rounding of an exact value), and the sums run in the same k order as the
 * fp32 tiles above. The output is bit-identical to packed_gemm over the dequantized weights.
 *
 * Layout, per panel of PACK output columns and per block of 32 k (QBLOCK), PACK columns side by
 * side so one load feeds a whole vector of outputs:
 *   Q8:  d[PACK] fp16 | q[32][PACK] int8                                   (34 * PACK bytes)
 *   Q4:  d[PACK] fp16 | m[PACK] fp16 | q[16][PACK] bytes, byte j of a column holding k = j in
 *        its low nibble and k = j + 16 in its high one, as GGUF stores them (20 * PACK bytes)
 * One row widens the weights in registers; row tiles up to GEMM_ROWS widen each block once into
 * an L1 buffer; taller batches widen the whole panel once into a per-thread fp32 buffer
 * (L2-resident) and run the fp32 tiles over it.
 */


static inline float f16_to_f32(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

/* Rows `ids` of a quantized [N][cols] matrix packed in either layout (quant bytes in groups of
 * `group`: 1 as above, 4 as quant_dot.c's), as the exact fp32 values above: the embedding lookup
 * through a tied lm_head. out: [n][cols]. Returns 0, or -1 (nothing read) if an id is not in
 * [0, rows). */
/* Scale field `field` (0, 1) of column `lane` of a block: fp32 in Q4F and Q8H, fp16 otherwise. */
static inline float scale_field(int qtype, const uint8_t *blk, int field, int lane) {
    if (qtype == 4 || qtype == 8) return f16_to_f32(blk + 2 * (field * PACK + lane));
    float f;
    memcpy(&f, blk + 4 * (field * PACK + lane), sizeof f);
    return f;
}

int pd_panel_rows(int qtype, int group, const uint8_t *panels, int cols, long rows, const long *ids, int n,
                  float *out) {
    int int8 = qtype == 8 || qtype == 10, nb = cols / QBLOCK, quants = int8 ? QBLOCK : QBLOCK / 2;
    size_t block_bytes = pd_qblock_bytes(qtype);
    for (int r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= rows) return -1;
    for (int r = 0; r < n; r++) {
        int lane = (int)(ids[r] % PACK);
        const uint8_t *panel = panels + (size_t)(ids[r] / PACK) * nb * block_bytes;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = panel + b * block_bytes, *q = blk + pd_qscale_bytes(qtype) * PACK;
            float d = scale_field(qtype, blk, 0, lane), m = qtype == 8 ? 0.0f : scale_field(qtype, blk, 1, lane);
            float *o = out + (size_t)r * cols + b * QBLOCK;
            for (int j = 0; j < quants; j++) {
                uint8_t byte = q[((size_t)(j / group) * PACK + lane) * group + j % group];
                if (int8) {
                    o[j] = (float)(int8_t)byte * (qtype == 10 && j >= QBLOCK / 2 ? m : d);  /* Q8H: m is k 16-31's scale */
                } else {
                    o[j] = (float)(byte & 15) * d + m;
                    o[j + QBLOCK / 2] = (float)(byte >> 4) * d + m;
                }
            }
        }
    }
    return 0;
}

/* LANES bytes widened to fp32, signed (Q8) or as two nibbles (Q4). Intrinsics on x86: GCC's
 * generic vector conversions of sub-register vectors come out scalarized in the unrolled tiles. */
#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
#define LOAD_BYTES(p) _mm_loadu_si128((const __m128i *)(p))
#define I8_TO_I32 _mm512_cvtepi8_epi32
#define U8_TO_I32 _mm512_cvtepu8_epi32
#define I32_TO_F32 _mm512_cvtepi32_ps
#define LOW_NIBBLES(i) _mm512_and_si512(i, _mm512_set1_epi32(15))
#define HIGH_NIBBLES(i) _mm512_srli_epi32(i, 4)
typedef __m512i vwide;
#else
#define LOAD_BYTES(p) _mm_loadl_epi64((const __m128i *)(p))
#define I8_TO_I32 _mm256_cvtepi8_epi32
#define U8_TO_I32 _mm256_cvtepu8_epi32
#define I32_TO_F32 _mm256_cvtepi32_ps
#define LOW_NIBBLES(i) _mm256_and_si256(i, _mm256_set1_epi32(15))
#define HIGH_NIBBLES(i) _mm256_srli_epi32(i, 4)
typedef __m256i vwide;
#endif
static inline vfloat widen_i8(const uint8_t *p) { return (vfloat)I32_TO_F32(I8_TO_I32(LOAD_BYTES(p))); }
static inline vfloat widen_nibbles(const uint8_t *p, int high) {
    vwide i = U8_TO_I32(LOAD_BYTES(p));
    return (vfloat)I32_TO_F32(high ? HIGH_NIBBLES(i) : LOW_NIBBLES(i));
}
#else
static inline vfloat widen_i8(const uint8_t *p) {
    float f[LANES];
    vfloat v;
    for (int i = 0; i < LANES; i++) f[i] = (float)(int8_t)p[i];
    memcpy(&v, f, sizeof v);
    return v;
}
static inline vfloat widen_nibbles(const uint8_t *p, int high) {
    float f[LANES];
    vfloat v;
    for (int i = 0; i < LANES; i++) f[i] = (float)(high ? p[i] >> 4 : p[i] & 15);
    memcpy(&v, f, sizeof v);
    return v;
}
#endif

/* Column vector v of k = j (+ 16 for the high half) of a Q8, Q4 (Q4F) or Q8H block, as fp32
 * weights; d (and mn: Q4's min, Q8H's second scale) as the block's header loaded them. */
#define Q8_WEIGHT(q, j, half, v) (widen_i8((q) + (size_t)(j) * PACK + (v) * LANES) * d[v])
#define Q4_WEIGHT(q, j, half, v) (widen_nibbles((q) + (size_t)(j) * PACK + (v) * LANES, half) * d[v] + mn[v])
#define Q8H_WEIGHT(q, j, half, v) (widen_i8((q) + (size_t)((half) * 16 + (j)) * PACK + (v) * LANES) * ((half) ? mn[v] : d[v]))
#define SCALES(LOAD, T, FIELDS)                                                                \
    vfloat d[GEMM_VECS], mn[GEMM_VECS];                                                        \
    for (int v = 0; v < GEMM_VECS; v++) {                                                      \
        d[v] = LOAD((const T *)blk + v * LANES);                                               \
        mn[v] = FIELDS == 2 ? LOAD((const T *)blk + PACK + v * LANES) : d[v];                   \
    }                                                                                          \
    const uint8_t *q = blk + FIELDS * sizeof(T) * PACK;
#define Q8_HEADER SCALES(load_f16, uint16_t, 1)
#define Q4_HEADER SCALES(load_f16, uint16_t, 2)
#define F32_HEADER SCALES(load_f32, float, 2)  /* Q4F, Q8H */

/* One block as fp32 [32][PACK], k in order (the fp32 tiles' panel layout). */
#define DEFINE_BLOCK(NAME, HEADER, HALVES, HALF_K, WEIGHT)                                      \
    static void NAME(const uint8_t *blk, float *out) {                                          \
        HEADER                                                                                  \
        for (int half = 0; half < HALVES; half++)                                               \
            for (int j = 0; j < HALF_K; j++)                                                    \
                for (int v = 0; v < GEMM_VECS; v++) {                                           \
                    vfloat w = WEIGHT(q, j, half, v);                                           \
                    memcpy(out + (size_t)(half * HALF_K + j) * PACK + v * LANES, &w, sizeof w); \
                }                                                                               \
    }
DEFINE_BLOCK(q8_block, Q8_HEADER, 1, 32, Q8_WEIGHT)
DEFINE_BLOCK(q4_block, Q4_HEADER, 2, 16, Q4_WEIGHT)
DEFINE_BLOCK(q4f_block, F32_HEADER, 2, 16, Q4_WEIGHT)
DEFINE_BLOCK(q8h_block, F32_HEADER, 2, 16, Q8H_WEIGHT)

/* One row: weights widened in registers straight into the accumulators (a 2-row tile would
 * need the scales, the widened weights and 4 accumulators live at once; the tiles below go
 * through an L1 buffer instead). */
#define DEFINE_QROW(NAME, HEADER, HALVES, HALF_K, BLOCK_BYTES, WEIGHT)                          \
    static void NAME(const float *x, int K, const uint8_t *panel, const float *bias, float *y,  \
                     int ldy, int ncols) {                                                      \
        (void)ldy;                                                                              \
        float init[PACK] = {0};                                                                 \
        if (bias) memcpy(init, bias, sizeof(float) * ncols);                                    \
        vfloat acc[GEMM_VECS];                                                                  \
        for (int v = 0; v < GEMM_VECS; v++) acc[v] = load_f32(init + v * LANES);                \
        for (int b = 0; b < K / QBLOCK; b++) {                                                  \
            const uint8_t *blk = panel + (size_t)b * BLOCK_BYTES;                               \
            if (GEMM_PREFETCH) __builtin_prefetch(blk + BLOCK_BYTES);                           \
            HEADER                                                                              \
            for (int half = 0; half < HALVES; half++)                                           \
                for (int j = 0; j < HALF_K; j++) {                                              \
                    float xv = x[b * QBLOCK + half * HALF_K + j];                               \
                    for (int v = 0; v < GEMM_VECS; v++) acc[v] += xv * WEIGHT(q, j, half, v);   \
                }                                                                               \
        }                                                                                       \
        float out[PACK];                                                                        \
        memcpy(out, acc, sizeof out);                                                           \
        memcpy(y, out, sizeof(float) * ncols);                                                  \
    }
DEFINE_QROW(q8_row, Q8_HEADER, 1, 32, Q8_BYTES, Q8_WEIGHT)
DEFINE_QROW(q4_row, Q4_HEADER, 2, 16, Q4_BYTES, Q4_WEIGHT)
DEFINE_QROW(q4f_row, F32_HEADER, 2, 16, Q4F_BYTES, Q4_WEIGHT)
DEFINE_QROW(q8h_row, F32_HEADER, 2, 16, Q8H_BYTES, Q8H_WEIGHT)

/* MM rows: each block widened once into an L1 buffer, then the fp32 tile's loop over it. */
#define DEFINE_QTILE(NAME, BLOCK, BLOCK_BYTES, MM)                                              \
    static void NAME##_##MM(const float *x, int K, const uint8_t *panel, const float *bias,     \
                            float *y, int ldy, int ncols) {                                     \
        float wbuf[QBLOCK * PACK] __attribute__((aligned(64)));                                 \
        TILE_BEGIN(MM)                                                                          \
        for (int b = 0; b < K / QBLOCK; b++) {                                                  \
            if (GEMM_PREFETCH) __builtin_prefetch(panel + (size_t)(b + 1) * BLOCK_BYTES);       \
            BLOCK(panel + (size_t)b * BLOCK_BYTES, wbuf);                                       \
            for (int k = 0; k < QBLOCK; k++) TILE_STEP(MM, wbuf + k * PACK, load_f32, b * QBLOCK + k) \
        }                                                                                       \
        TILE_END(MM)                                                                            \
    }

#define Q8_TILE(MM) DEFINE_QTILE(q8_tile, q8_block, Q8_BYTES, MM)
#define Q4_TILE(MM) DEFINE_QTILE(q4_tile, q4_block, Q4_BYTES, MM)
#define Q4F_TILE(MM) DEFINE_QTILE(q4f_tile, q4f_block, Q4F_BYTES, MM)
#define Q8H_TILE(MM) DEFINE_QTILE(q8h_tile, q8h_block, Q8H_BYTES, MM)
#define QTILE_TABLE(NAME) static void (*const NAME##_tiles[])(TILE_ARGS(uint8_t))
#if GEMM_ROWS == 8
#define DEFINE_QTILES(TILE, NAME, ROW)                                                          \
    TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)                                    \
    QTILE_TABLE(NAME) = {0, ROW, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7, NAME##_8};
#else
#define DEFINE_QTILES(TILE, NAME, ROW)                                                          \
    TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)                                                    \
    QTILE_TABLE(NAME) = {0, ROW, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6};
#endif
DEFINE_QTILES(Q8_TILE, q8_tile, q8_row)
DEFINE_QTILES(Q4_TILE, q4_tile, q4_row)
DEFINE_QTILES(Q4F_TILE, q4f_tile, q4f_row)
DEFINE_QTILES(Q8H_TILE, q8h_tile, q8h_row)

typedef void (*block_fn)(const uint8_t *, float *);

/* The whole panel as fp32 [K][PACK] (the layout the fp32 tiles read). */
static void dequantize_panel(block_fn widen, long block_bytes, const uint8_t *panel, int K, float *out) {
    for (int b = 0; b < K / QBLOCK; b++) widen(panel + (size_t)b * block_bytes, out + (size_t)b * QBLOCK * PACK);
}

/* y[M][N] = x[M][K] @ W^T (+ bias[N]) for W packed as above; qtype 8 (Q8), 4 (Q4), 6 (Q4F) or 10
 * (Q8H). K is a multiple of QBLOCK. Returns 0, or -1 for an unknown qtype or K, or no memory. */
int pd_quant_gemm(int qtype, const float *x, const uint8_t *packed, const float *bias, float *y, int M,
                  int K, int N, int num_threads) {
    long block_bytes = pd_qblock_bytes(qtype);
    if (!block_bytes || K % QBLOCK) return -1;
    size_t panel_bytes = (size_t)(K / QBLOCK) * block_bytes;
    void (*const *tiles)(TILE_ARGS(uint8_t)) = qtype == 8 ? q8_tile_tiles : qtype == 4 ? q4_tile_tiles
                                               : qtype == 6 ? q4f_tile_tiles : q8h_tile_tiles;
    block_fn widen = qtype == 8 ? q8_block : qtype == 4 ? q4_block : qtype == 6 ? q4f_block : q8h_block;
    int panels = (N + PACK - 1) / PACK, failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|: failed)
    {
        float *scratch = M > GEMM_ROWS ? malloc(sizeof(float) * K * PACK) : 0;
        failed = M > GEMM_ROWS && !scratch;
        #pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            if (failed) continue;
            const uint8_t *panel = packed + (size_t)p * panel_bytes;
            int col = p * PACK;
            int ncols = N - col < PACK ? N - col : PACK;
            const float *b = bias ? bias + col : 0;
            if (scratch) dequantize_panel(widen, block_bytes, panel, K, scratch);
            for (int m0 = 0; m0 < M; m0 += GEMM_ROWS) {
                int rows = M - m0 < GEMM_ROWS ? M - m0 : GEMM_ROWS;
                if (scratch)
                    pd_packed_gemm_tiles[rows](x + (size_t)m0 * K, K, scratch, b, y + (size_t)m0 * N + col, N, ncols);
                else
                    tiles[rows](x + (size_t)m0 * K, K, panel, b, y + (size_t)m0 * N + col, N, ncols);
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
