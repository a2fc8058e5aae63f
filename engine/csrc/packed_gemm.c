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
#include <string.h>

#include "vector_isa.h"

typedef uint16_t vhalf __attribute__((vector_size(LANES * 2)));
typedef uint32_t vword __attribute__((vector_size(LANES * 4)));

static inline vfloat load_f32(const float *p) { vfloat v; memcpy(&v, p, sizeof v); return v; }

/* bf16 -> fp32 is a 16-bit left shift of the bit pattern. */
static inline vfloat load_bf16(const uint16_t *p) {
    vhalf h;
    memcpy(&h, p, sizeof h);
    vword w = __builtin_convertvector(h, vword) << 16;
    vfloat f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* y[m][0:ncols] = bias[0:ncols] + x[m] . P_panel for m < MM, for one panel of weights of
 * element type T, read with LOAD. */
#define DEFINE_TILE(NAME, T, LOAD, MM)                                                         \
    static void NAME##_##MM(const float *x, int K, const T *panel, const float *bias,           \
                            float *y, int ldy, int ncols) {                                     \
        float init[PACK] = {0};                                                                 \
        if (bias) memcpy(init, bias, sizeof(float) * ncols);                                    \
        vfloat acc[MM][GEMM_VECS];                                                              \
        for (int m = 0; m < MM; m++)                                                            \
            for (int v = 0; v < GEMM_VECS; v++) acc[m][v] = load_f32(init + v * LANES);         \
        for (int k = 0; k < K; k++) {                                                           \
            const T *row = panel + (size_t)k * PACK;                                            \
            if (GEMM_PREFETCH) __builtin_prefetch((const char *)row + GEMM_PREFETCH);           \
            vfloat w[GEMM_VECS];                                                                \
            for (int v = 0; v < GEMM_VECS; v++) w[v] = LOAD(row + v * LANES);                   \
            for (int m = 0; m < MM; m++) {                                                      \
                float xv = x[(size_t)m * K + k];                                                \
                for (int v = 0; v < GEMM_VECS; v++) acc[m][v] += xv * w[v];                     \
            }                                                                                   \
        }                                                                                       \
        for (int m = 0; m < MM; m++) {                                                          \
            float out[PACK];                                                                    \
            memcpy(out, acc[m], sizeof out);                                                    \
            memcpy(y + (size_t)m * ldy, out, sizeof(float) * ncols);                            \
        }                                                                                       \
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
