/* Small-M GEMM over prepacked weights (fp32 activations), for CPU decode and verification.
 *
 * Why: decode and speculative verification multiply a handful of rows (1..16) by every weight
 * matrix of the model. That is memory-bound: the weights stream from DRAM once per step, so a
 * forward over 6 tokens should cost about what one token costs. MKL's sgemm falls off a cliff
 * for 2..16 rows on this class of CPU; this kernel reads each weight once per 8-row tile, keeps
 * 8x32 accumulators in registers and stays flat from 1 to 8 rows.
 *
 * Layout: a weight W[N][K] (torch Linear layout, y = x @ W^T) is packed as
 *   P[N_pad / 32][K][32]   (N padded with zero rows to a multiple of 32)
 * so the inner loop reads 32 consecutive output columns for one k as two 16-float vectors.
 * Weights are fp32, or bf16 (half the DRAM traffic; widened to fp32 in registers, all
 * arithmetic in fp32) -- the EAGLE3 draft uses bf16, the target keeps fp32 for exactness.
 * The code uses GCC vector extensions and is compiled with -march=native on the machine that
 * runs it (AVX-512 where available, narrower vectors elsewhere).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

#define PACK 32      /* output columns per packed panel: two 16-float vectors */
#define ROWS 8       /* rows of x per register tile: 8 x 2 accumulators + 2 weights */

static inline v16 load_f32(const float *p) { v16 v; memcpy(&v, p, 64); return v; }

/* bf16 -> fp32 is a 16-bit left shift of the bit pattern. */
static inline v16 load_bf16(const uint16_t *p) {
    u16x16 h;
    memcpy(&h, p, 32);
    u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    v16 f;
    memcpy(&f, &w, 64);
    return f;
}

/* y[m][0:ncols] = bias[0:ncols] + x[m] . P_panel for m < MM, for one 32-column panel of
 * weights of element type T, read with LOAD. */
#define DEFINE_TILE(NAME, T, LOAD, MM)                                                      \
    static void NAME##_##MM(const float *x, int K, const T *panel, const float *bias,        \
                            float *y, int ldy, int ncols) {                                  \
        v16 acc[MM][2];                                                                      \
        v16 b0 = {0}, b1 = {0};                                                              \
        if (bias) {                                                                          \
            float tmp[PACK] = {0};                                                           \
            memcpy(tmp, bias, sizeof(float) * ncols);                                        \
            b0 = load_f32(tmp);                                                              \
            b1 = load_f32(tmp + 16);                                                         \
        }                                                                                    \
        for (int m = 0; m < MM; m++) { acc[m][0] = b0; acc[m][1] = b1; }                     \
        for (int k = 0; k < K; k++) {                                                        \
            v16 w0 = LOAD(panel + (size_t)k * PACK), w1 = LOAD(panel + (size_t)k * PACK + 16); \
            for (int m = 0; m < MM; m++) {                                                   \
                float xv = x[(size_t)m * K + k];                                             \
                acc[m][0] += xv * w0;                                                        \
                acc[m][1] += xv * w1;                                                        \
            }                                                                                \
        }                                                                                    \
        for (int m = 0; m < MM; m++) {                                                       \
            float tmp[PACK];                                                                 \
            memcpy(tmp, &acc[m][0], 64);                                                     \
            memcpy(tmp + 16, &acc[m][1], 64);                                                \
            memcpy(y + (size_t)m * ldy, tmp, sizeof(float) * ncols);                         \
        }                                                                                    \
    }

/* The 8 tile sizes and the panel loop, for one weight type. */
#define DEFINE_GEMM(NAME, T, LOAD)                                                          \
    DEFINE_TILE(NAME, T, LOAD, 1) DEFINE_TILE(NAME, T, LOAD, 2) DEFINE_TILE(NAME, T, LOAD, 3) \
    DEFINE_TILE(NAME, T, LOAD, 4) DEFINE_TILE(NAME, T, LOAD, 5) DEFINE_TILE(NAME, T, LOAD, 6) \
    DEFINE_TILE(NAME, T, LOAD, 7) DEFINE_TILE(NAME, T, LOAD, 8)                              \
    static void (*const NAME##_tiles[ROWS + 1])(const float *, int, const T *, const float *, \
                                                float *, int, int) = {                       \
        0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7, NAME##_8};  \
    /* y[M][N] = x[M][K] @ W^T (+ bias[N]); x rows have stride K, y rows stride N. */        \
    void NAME(const float *x, const T *packed, const float *bias, float *y, int M, int K,    \
              int N, int num_threads) {                                                      \
        int panels = (N + PACK - 1) / PACK;                                                  \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                \
        for (int p = 0; p < panels; p++) {                                                   \
            const T *panel = packed + (size_t)p * K * PACK;                                  \
            int col = p * PACK;                                                              \
            int ncols = N - col < PACK ? N - col : PACK;                                     \
            const float *b = bias ? bias + col : 0;                                          \
            /* All row tiles of a panel run back to back: DRAM once, then cache. */          \
            for (int m0 = 0; m0 < M; m0 += ROWS) {                                           \
                int rows = M - m0 < ROWS ? M - m0 : ROWS;                                    \
                NAME##_tiles[rows](x + (size_t)m0 * K, K, panel, b, y + (size_t)m0 * N + col, N, \
                                   ncols);                                                   \
            }                                                                                \
        }                                                                                    \
    }

DEFINE_GEMM(pd_packed_gemm, float, load_f32)
DEFINE_GEMM(pd_packed_gemm_bf16, uint16_t, load_bf16)

int pd_pack_width(void) { return PACK; }
