/* The vector rates the kernels' threads get and the OpenMP costs they pay, for bench/floors.py.
 * Built with the kernels' compiler and ISA flags; prints one JSON object.
 *
 * int8_macs_per_ns: int8 multiply-adds `threads` threads retire per ns together (each in
 *   independent chains; *_one_thread: one thread alone), with the
 *   instructions the quantized GEMM tiles are made of (quant_dot.c): vpdpbusd (64 a zmm
 *   instruction) with AVX-512 VNNI, vpmaddubsw + vpaddw (64 a zmm pair) with AVX-512BW, the same
 *   on ymm (32) with AVX2, scalar int32 multiply-adds in the portable build;
 * fma_lanes_per_ns: fp32 multiply-adds per ns at the build's vector width (4 lanes in the portable
 *   build, as its kernels use; attention, packed_gemm.c);
 * region_us / barrier_us: an empty `omp parallel` region and one barrier, on `threads` threads.
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* A value pinned to a register (an empty asm that "changes" it), so the compiler neither merges
 * the chains nor moves them through memory. */
#if defined(__x86_64__)
#define PIN(v) __asm__ volatile("" : "+v"(v))
#elif defined(__aarch64__)
#define PIN(v) __asm__ volatile("" : "+w"(v))
#else
#define PIN(v) __asm__ volatile("" : "+m"(v))
#endif

/* Twelve independent chains as twelve variables (an array of them lives in memory), each round
 * stepping every chain once: STEP(v) updates v in place. */
#define CHAINS 12
#define ROUNDS 50000000L
#define EACH(F) F(a0) F(a1) F(a2) F(a3) F(a4) F(a5) F(a6) F(a7) F(a8) F(a9) F(a10) F(a11)
#define RETURN_RATE(TYPE, FIRST, STEP, PER_STEP)                                          \
    do {                                                                                 \
        TYPE a0 = FIRST, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0,  \
             a8 = a0, a9 = a0, a10 = a0, a11 = a0;                                       \
        double start = now();                                                            \
        for (long i = 0; i < ROUNDS; i++) { EACH(STEP) }                                 \
        double rate = (double)(PER_STEP) * CHAINS * ROUNDS / (now() - start) / 1e9;     \
        EACH(SINK)                                                                       \
        return rate;                                                                     \
    } while (0)
#define SINK(v) PIN(v);  /* the results used: the chains are not dead code */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double int8_macs_per_ns(void) {
#if defined(__AVX512VNNI__)
    __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(5);
#define STEP8(v) v = _mm512_dpbusd_epi32(v, u, s); PIN(v);
    RETURN_RATE(__m512i, _mm512_set1_epi32(1), STEP8, 64);
#elif defined(__AVX512BW__)
    __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(5);
#define STEP8(v) v = _mm512_add_epi16(v, _mm512_maddubs_epi16(u, s)); PIN(v); PIN(u);
    RETURN_RATE(__m512i, _mm512_set1_epi16(1), STEP8, 64);  /* PIN(u): else the product is computed once, outside the loop */
#elif defined(__AVX2__)
    __m256i u = _mm256_set1_epi8(3), s = _mm256_set1_epi8(5);
#define STEP8(v) v = _mm256_add_epi16(v, _mm256_maddubs_epi16(u, s)); PIN(v); PIN(u);
    RETURN_RATE(__m256i, _mm256_set1_epi16(1), STEP8, 32);
#else
    int u = 3, s = 5;
#define STEP8(v) v += u * s; __asm__ volatile("" : "+r"(v), "+r"(u));  /* in general registers */
    RETURN_RATE(int, 1, STEP8, 1);
#endif
}

static double fma_lanes_per_ns(void) {
#if defined(__AVX512F__)
    __m512 m = _mm512_set1_ps(1.0001f);
#define STEPF(v) v = _mm512_fmadd_ps(v, m, m); PIN(v);
    RETURN_RATE(__m512, _mm512_set1_ps(1.0f), STEPF, 16);
#elif defined(__AVX2__)
    __m256 m = _mm256_set1_ps(1.0001f);
#define STEPF(v) v = _mm256_fmadd_ps(v, m, m); PIN(v);
    RETURN_RATE(__m256, _mm256_set1_ps(1.0f), STEPF, 8);
#else
    typedef float v4 __attribute__((vector_size(16)));
    v4 m = {1.0001f, 1.0001f, 1.0001f, 1.0001f};
#define STEPF(v) v = v * m + m; PIN(v);
    RETURN_RATE(v4, m, STEPF, 4);
#endif
}

/* rate() on `threads` threads at once, summed: the vector units the kernels' threads actually
 * get. Two vCPUs can share one core's vector units (hyperthreads, or a host that runs both on one
 * core for a while: on Machine E, once, an FMA loop ran at 1.94 per cycle alone and 1.01 per thread
 * on two; minutes later at 1.97 and 1.98), so one thread's rate times the threads can overstate them. */
static double together(double (*rate)(void), int threads) {
    double sum = 0.0;
    #pragma omp parallel num_threads(threads) reduction(+: sum)
    sum = rate();
    return sum;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2, reps = 20000;
    double int8_one = int8_macs_per_ns(), fma_one = fma_lanes_per_ns();
    double int8 = together(int8_macs_per_ns, threads), fma = together(fma_lanes_per_ns, threads);
    for (int i = 0; i < 1000; i++) {
        #pragma omp parallel num_threads(threads)
        __asm__ volatile("");
    }
    double start = now();
    for (int i = 0; i < reps; i++) {
        #pragma omp parallel num_threads(threads)
        __asm__ volatile("");
    }
    double region = (now() - start) / reps * 1e6;
    start = now();
    #pragma omp parallel num_threads(threads)
    for (int i = 0; i < reps; i++) {
        #pragma omp barrier
    }
    double barrier = (now() - start) / reps * 1e6;
    printf("{\"int8_macs_per_ns\": %.2f, \"fma_lanes_per_ns\": %.2f, \"int8_macs_per_ns_one_thread\": %.2f, "
           "\"fma_lanes_per_ns_one_thread\": %.2f, \"region_us\": %.2f, \"barrier_us\": %.2f}\n",
           int8, fma, int8_one, fma_one, region, barrier);
    return 0;
}
