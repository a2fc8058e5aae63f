/* quant_dot.c's tiles without x86 vector integer dot products (the portable build: SSE2 on
 * x86, NEON on arm64): each row's dot per column of a vector, one column at a time, in plain C
 * the compiler vectorises as it can. Included by quant_dot.c, whose definitions (XROW, VBYTES, PACK,
 * SCALES, ...) and tile locals (q, b, xr, K, qtype) these macros use. */
#define FMA(a, b, c) ((a) * (b) + (c))
#define SPLAT(s) ((s) - (vfloat){0})
/* Byte i of row m's 4-byte group j (every lane holds the same 4). */
#define XS(m, j, i) ((int8_t)XROW(m)[(j) * VBYTES + (i)])
/* Each row's int32 dot per column of the vector, one column at a time (COLUMN(m, c) adds its
 * products into s). */
#define SCALAR_DOTS(MM, EMIT, COLUMN)                                                           \
    for (int v = 0; v < GEMM_VECS; v++) {                                                      \
        SCALES(v);                                                                             \
        for (int m = 0; m < MM; m++) {                                                         \
            float f[LANES];                                                                    \
            for (int c = 0; c < LANES; c++) {                                                  \
                int32_t s = 0;                                                                 \
                COLUMN(m, c)                                                                   \
                f[c] = (float)s;                                                               \
            }                                                                                  \
            EMIT(m, v, load_f32(f));                                                           \
        }                                                                                      \
    }
#define Q4_COLUMN(m, c)                                                                         \
    for (int g = 0; g < 4; g++)                                                                \
        for (int i = 0; i < 4; i++) {                                                          \
            uint8_t b8 = q[((size_t)g * PACK + v * LANES + c) * 4 + i];                        \
            s += (b8 & 15) * XS(m, g, i) + (b8 >> 4) * XS(m, 4 + g, i);                        \
        }
#define Q8_GROUPS(m, c, g0, g1)                                                                 \
    for (int g = g0; g < g1; g++)                                                              \
        for (int i = 0; i < 4; i++) s += (int8_t)q[((size_t)g * PACK + v * LANES + c) * 4 + i] * XS(m, g, i);
#define Q8_COLUMN(m, c) Q8_GROUPS(m, c, 0, 8)
#define Q4_DOTS(MM, EMIT) SCALAR_DOTS(MM, EMIT, Q4_COLUMN)
#define Q8_DOTS(MM, EMIT) SCALAR_DOTS(MM, EMIT, Q8_COLUMN)
#define Q8H_DOTS(MM, EMIT)                                                                      \
    for (int v = 0; v < GEMM_VECS; v++) {                                                      \
        SCALES(v);                                                                             \
        for (int m = 0; m < MM; m++) {                                                         \
            float f[2][LANES];                                                                 \
            for (int c = 0; c < LANES; c++)                                                    \
                for (int h = 0; h < 2; h++) {                                                  \
                    int32_t s = 0;                                                             \
                    Q8_GROUPS(m, c, 4 * h, 4 * h + 4)                                          \
                    f[h][c] = (float)s;                                                        \
                }                                                                              \
            EMIT(m, v, load_f32(f[0]), load_f32(f[1]));                                        \
        }                                                                                      \
    }
