/* The vector width and register tiles each instruction set gets, chosen at compile time.
 *
 * engine/cpu_kernels.py compiles the kernels once per ISA level (PDSPEC_CPU_ISA: avx512, avx2,
 * portable); the predefined macros of that build pick the block below. A tile's accumulators
 * plus the weight vectors it loads must fit the register file, or the compiler spills them to
 * the stack on every k step and the GEMM becomes bound by instructions instead of memory:
 *   AVX-512: 32 registers of 16 floats -> 8 rows x 2 vectors = 16 accumulators + 2 weights;
 *   AVX2:    16 registers of 8 floats  -> 6 rows x 2 vectors = 12 accumulators + 2 weights + 1
 *            broadcast (8 rows would need 16 accumulators alone);
 *   portable (SSE2, NEON): 4-float vectors, the same 6 x 2 tile (16 or 32 registers).
 * GEMM_PREFETCH: bytes ahead of the current k step to prefetch the panel. On AVX2 the tile's
 * arithmetic between loads is long enough that the hardware prefetcher alone falls behind at
 * 4-8 rows (measured in BENCHMARKS.md); the AVX-512 tile kept its measured behaviour without.
 */
#ifndef PDSPEC_VECTOR_ISA_H
#define PDSPEC_VECTOR_ISA_H

#if defined(__AVX512F__)
#define LANES 16
#define GEMM_ROWS 8
#define GEMM_PREFETCH 0
#elif defined(__AVX2__)
#define LANES 8
#define GEMM_ROWS 6
#define GEMM_PREFETCH 1024
#else
#define LANES 4
#define GEMM_ROWS 6
#define GEMM_PREFETCH 1024
#endif

#define GEMM_VECS 2                    /* vectors of output columns per panel row */
#define PACK (LANES * GEMM_VECS)       /* output columns per packed panel */

typedef float vfloat __attribute__((vector_size(LANES * 4)));

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static inline vfloat load_f32(const float *p) { vfloat v; memcpy(&v, p, sizeof v); return v; }
static inline void store_f32(float *p, vfloat v) { memcpy(p, &v, sizeof v); }

/* bf16 -> fp32 is a 16-bit left shift of the bit pattern. */
typedef uint16_t vhalf __attribute__((vector_size(LANES * 2)));
typedef uint32_t vword __attribute__((vector_size(LANES * 4)));
static inline vfloat load_bf16(const uint16_t *p) {
    vhalf h;
    memcpy(&h, p, sizeof h);
    vword w = __builtin_convertvector(h, vword) << 16;
    vfloat f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* fp32 -> bf16, rounded to nearest even (torch's rounding; NaN stays NaN). */
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* to_bf16 of each lane, as the bf16 bits in the upper half of its 32-bit word and zeros below
 * (read as fp32: the rounded value). */
static inline vword round_bf16_words(vfloat x) {
    vword u;
    memcpy(&u, &x, sizeof u);
    vword nan = (vword)((u & 0x7fffffffu) > 0x7f800000u);  /* all ones where NaN */
    vword rounded = (u + 0x7fffu + ((u >> 16) & 1)) & 0xffff0000u;
    return (nan & ((u | 0x400000u) & 0xffff0000u)) | (~nan & rounded);
}

/* LANES fp16 values (GGUF block scales) as fp32: F16C on x86-64-v3 and up, else one by one. */
static inline vfloat load_f16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__)  /* x86-64-v3: F16C too */
    return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    _Float16 h[LANES];
    float f[LANES];
    memcpy(h, p, sizeof h);
    for (int i = 0; i < LANES; i++) f[i] = (float)h[i];
    return load_f32(f);
#endif
}

/* LANES int8 values as fp32 (an int8 KV cache's rows): sign-extended and converted in two
 * instructions on x86 (GCC 12 converts an int8 vector to floats one element at a time). */
static inline vfloat load_i8(const int8_t *p) {
#if defined(__AVX512F__)
    return (vfloat)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vfloat)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    float f[LANES];
    for (int i = 0; i < LANES; i++) f[i] = (float)p[i];
    return load_f32(f);
#endif
}

/* Lane helpers and exp, shared by the attention kernel and the decoder step. */
typedef int vint __attribute__((vector_size(LANES * 4)));

/* acc + the products of I8_CHUNK signed bytes k[] and q[] (|k|, |q| <= 127), summed by fours into
 * acc's int32 lanes (lane l: bytes 4l .. 4l + 3), exactly: an int8 KV cache's scores. The signed
 * products take |q| as the unsigned operand and k with q's sign: one vpdpbusd with VNNI, else
 * maddubs (pairs stay below 2 x 127 x 127 < 2^15) then madd. Inlined in a loop over keys, q's
 * loads and sign are hoisted out of it. */
#if defined(__AVX512BW__)
#define I8_CHUNK 64
static inline vint dot_i8(vint acc, const int8_t *k, const int8_t *q) {
    __m512i kv = _mm512_loadu_si512((const void *)k), qv = _mm512_loadu_si512((const void *)q);
    __m512i signed_k = _mm512_mask_sub_epi8(kv, _mm512_movepi8_mask(qv), _mm512_setzero_si512(), kv);
#if defined(__AVX512VNNI__)
    return (vint)_mm512_dpbusd_epi32((__m512i)acc, _mm512_abs_epi8(qv), signed_k);
#else
    __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(qv), signed_k);
    return (vint)_mm512_add_epi32((__m512i)acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}
#elif defined(__AVX2__) && !defined(__AVX512F__)
#define I8_CHUNK 32
static inline vint dot_i8(vint acc, const int8_t *k, const int8_t *q) {
    __m256i kv = _mm256_loadu_si256((const __m256i *)k), qv = _mm256_loadu_si256((const __m256i *)q);
    __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(qv, qv), _mm256_sign_epi8(kv, qv));
    return (vint)_mm256_add_epi32((__m256i)acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#else
#define I8_CHUNK (4 * LANES)
static inline vint dot_i8(vint acc, const int8_t *k, const int8_t *q) {
    int s[LANES];
    memcpy(s, &acc, sizeof s);
    for (int i = 0; i < I8_CHUNK; i++) s[i / 4] += k[i] * q[i];
    memcpy(&acc, s, sizeof s);
    return acc;
}
#endif

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

/* A vector's lanes folded by COMBINE as a tree: a plain loop over the lanes is a LANES-step
 * dependency chain. hsum, hmax (fp32) and hsum_i (int32). */
#define LANE_TREE(NAME, T, V, COMBINE)                                         \
    static inline T NAME(V v) {                                                \
        T s[LANES];                                                            \
        memcpy(s, &v, sizeof v);                                               \
        for (int width = LANES / 2; width > 0; width /= 2)                     \
            for (int i = 0; i < width; i++) s[i] = COMBINE(s[i], s[i + width]); \
        return s[0];                                                           \
    }
#define LANE_ADD(a, b) ((a) + (b))
#define LANE_MAX(a, b) ((b) > (a) ? (b) : (a))
LANE_TREE(hsum, float, vfloat, LANE_ADD)
LANE_TREE(hmax, float, vfloat, LANE_MAX)
LANE_TREE(hsum_i, int, vint, LANE_ADD)
#undef LANE_TREE
#undef LANE_ADD
#undef LANE_MAX

/* exp(x) for x <= 0 (attention's scores minus their max, SiLU's -|x|): Cody-Waite range
 * reduction and a degree-6 polynomial, relative error ~2e-7; inputs below -87 flush to 0. */
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

#endif
