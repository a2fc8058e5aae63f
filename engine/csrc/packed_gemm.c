/* Small-M fp32 GEMM over prepacked weights, for CPU decode and verification.
 *
 * Why: decode and speculative verification multiply a handful of rows (1..16) by every weight
 * matrix of the model. That is memory-bound: the weights stream from DRAM once per step, so a
 * forward over 6 tokens should cost about what one token costs. MKL's sgemm falls off a cliff
 * for 2..16 rows on this class of CPU; this kernel reads each weight once per 8-row tile, keeps
 * 8x32 accumulators in registers and stays flat from 1 to 8 rows.
 *
 * Layout: a weight W[N][K] (torch Linear layout, y = x @ W^T) is packed as
 *   P[N_pad / 32][K][32]   (N padded with zero rows to a multiple of 32)
 * so the inner loop reads 32 consecutive output columns for one k as two 64-byte vectors.
 * The code uses GCC vector extensions and is compiled with -march=native on the machine that
 * runs it (AVX-512 where available, narrower vectors elsewhere).
 */
#include <stddef.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

#define PACK 32      /* output columns per packed panel: two 16-float vectors */
#define ROWS 8       /* rows of x per register tile: 8 x 2 accumulators + 2 weights */

/* y[m][0:ncols] = bias[0:ncols] + x[m] . P_panel for m < MM, for one 32-column panel. */
#define DEFINE_TILE(MM)                                                                     \
    static void tile_##MM(const float *x, int K, const float *panel, const float *bias,      \
                          float *y, int ldy, int ncols) {                                    \
        v16 acc[MM][2];                                                                      \
        v16 b0 = {0}, b1 = {0};                                                              \
        if (bias) {                                                                          \
            float tmp[PACK] = {0};                                                           \
            memcpy(tmp, bias, sizeof(float) * ncols);                                        \
            memcpy(&b0, tmp, 64);                                                            \
            memcpy(&b1, tmp + 16, 64);                                                       \
        }                                                                                    \
        for (int m = 0; m < MM; m++) { acc[m][0] = b0; acc[m][1] = b1; }                     \
        for (int k = 0; k < K; k++) {                                                        \
            v16 w0, w1;                                                                      \
            memcpy(&w0, panel + (size_t)k * PACK, 64);                                       \
            memcpy(&w1, panel + (size_t)k * PACK + 16, 64);                                  \
            for (int m = 0; m < MM; m++) {                                                   \
                float xv = x[(size_t)m * K + k];                                             \
                acc[m][0] += xv * w0;                                                        \
                acc[m][1] += xv * w1;                                                        \
            }                                                                                \
        }                                                                                    \
        for (int m = 0; m < MM; m++) {                                                       \
            if (ncols == PACK) {                                                             \
                memcpy(y + (size_t)m * ldy, &acc[m][0], 64);                                 \
                memcpy(y + (size_t)m * ldy + 16, &acc[m][1], 64);                            \
            } else {                                                                         \
                float tmp[PACK];                                                             \
                memcpy(tmp, &acc[m][0], 64);                                                 \
                memcpy(tmp + 16, &acc[m][1], 64);                                            \
                memcpy(y + (size_t)m * ldy, tmp, sizeof(float) * ncols);                     \
            }                                                                                \
        }                                                                                    \
    }

DEFINE_TILE(1) DEFINE_TILE(2) DEFINE_TILE(3) DEFINE_TILE(4)
DEFINE_TILE(5) DEFINE_TILE(6) DEFINE_TILE(7) DEFINE_TILE(8)

typedef void (*tile_fn)(const float *, int, const float *, const float *, float *, int, int);
static const tile_fn TILES[ROWS + 1] = {0, tile_1, tile_2, tile_3, tile_4,
                                        tile_5, tile_6, tile_7, tile_8};

int pd_pack_width(void) { return PACK; }

/* y[M][N] = x[M][K] @ W^T (+ bias[N]); packed is W in the panel layout above.
 * x rows are contiguous with stride K; y rows with stride N. */
void pd_packed_gemm(const float *x, const float *packed, const float *bias, float *y,
                    int M, int K, int N, int num_threads) {
    int panels = (N + PACK - 1) / PACK;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int p = 0; p < panels; p++) {
        const float *panel = packed + (size_t)p * K * PACK;
        int col = p * PACK;
        int ncols = N - col < PACK ? N - col : PACK;
        const float *b = bias ? bias + col : 0;
        /* All row tiles of one panel run back to back: the panel is read from DRAM once and
         * from cache for the following tiles. */
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            int rows = M - m0 < ROWS ? M - m0 : ROWS;
            TILES[rows](x + (size_t)m0 * K, K, panel, b, y + (size_t)m0 * N + col, N, ncols);
        }
    }
}
