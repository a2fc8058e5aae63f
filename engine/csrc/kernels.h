/* The kernels' entry points, for the native decoder step that strings them together. */
#ifndef PDSPEC_KERNELS_H
#define PDSPEC_KERNELS_H

#include <math.h>

#include "vector_isa.h"

/* Quantized panels (engine/quant.py): 32-weight blocks, PACK columns side by side. */
#define QBLOCK 32
#define Q8_BYTES (34 * PACK)   /* d[PACK] fp16, 32 x PACK int8 */
#define Q4_BYTES (20 * PACK)   /* d[PACK], m[PACK] fp16, 16 x PACK bytes of nibbles */
#define Q4F_BYTES (24 * PACK)  /* d[PACK], m[PACK] fp32, 16 x PACK bytes of nibbles (Q4_K's sub-blocks) */
#define Q8H_BYTES (40 * PACK)  /* d[2][PACK] fp32 (k 0-15, then 16-31), 32 x PACK int8 (Q6_K's sub-blocks) */

/* Weight formats (engine/native_decoder.py): fp32, bf16, and the quantized panels widened to
 * fp32 (Q4, Q4F, Q8, Q8H: the panel's qtype) or multiplied with int8 activations (qtype + 1). */
enum { PD_F32 = 0, PD_BF16 = 1, PD_Q4 = 4, PD_Q4_I8 = 5, PD_Q4F = 6, PD_Q4F_I8 = 7, PD_Q8 = 8, PD_Q8_I8 = 9,
       PD_Q8H = 10, PD_Q8H_I8 = 11 };

/* Bytes per block of a panel of qtype 4, 6, 8 or 10 (0: not a panel qtype); the scale fields
 * before the quants: one for Q8, two for the others, fp16 in Q4 and Q8, fp32 in Q4F and Q8H. */
static inline long pd_qblock_bytes(int qtype) {
    return qtype == 8 ? Q8_BYTES : qtype == 4 ? Q4_BYTES : qtype == 6 ? Q4F_BYTES : qtype == 10 ? Q8H_BYTES : 0;
}
static inline int pd_qscale_bytes(int qtype) { return qtype == 8 ? 2 : qtype == 4 ? 4 : 8; }

/* KV cache element types (engine/kv_layout.py): a row, one head's key or value, is head_dim
 * elements; an int8 row ends with its fp32 scale s (values round-half-even(x / s), s = max|x| / 127). */
enum { PD_KV_F32 = 0, PD_KV_BF16 = 1, PD_KV_INT8 = 2 };
static inline int pd_kv_esize(int kv_type) { return kv_type == PD_KV_F32 ? 4 : kv_type == PD_KV_BF16 ? 2 : 1; }
static inline int pd_kv_row(int kv_type, int dim) { return kv_type == PD_KV_INT8 ? dim + 4 : dim; }

/* x[n] as int8, q = round-half-even(x / s) within +-127, s = max|x| / 127 (an all-zero x: s = 0,
 * q = 0; an x holding a NaN or an infinity: s = NaN, q = 0, so it reads back as NaN); returns s.
 * An int8 cache's rows (engine/kv_layout.py's encode_rows writes the same bytes), and the queries
 * its scores are integer dot products with. The clamp matters only where s is subnormal (x / s
 * may round to 128); dot_i8 relies on |q| <= 127. */
static inline float pd_quantize_i8(const float *x, int n, int8_t *q) {
    float amax = 0.0f, probe = 0.0f;
    for (int i = 0; i < n; i++) {
        amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        probe += x[i] * 0.0f; /* NaN only if some x is NaN or infinite */
    }
    if (probe != probe) {
        memset(q, 0, (size_t)n);
        return NAN;
    }
    float s = amax / 127.0f;
    for (int i = 0; i < n; i++) {
        float v = s > 0.0f ? nearbyintf(x[i] / s) : 0.0f;
        q[i] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
    }
    return s;
}

void pd_packed_gemm(const float *x, const float *packed, const float *bias, float *y, int M, int K, int N,
                    int num_threads);
void pd_packed_gemm_bf16(const float *x, const unsigned short *packed, const float *bias, float *y, int M, int K,
                         int N, int num_threads);
int pd_quant_gemm(int qtype, const float *x, const unsigned char *packed, const float *bias, float *y, int M,
                  int K, int N, int num_threads);
int pd_quant_gemm_i8(int qtype, const float *x, const unsigned char *packed, const float *bias, float *y, int M,
                     int K, int N, int num_threads);
int pd_paged_attention(const float *q, const void *cache, int kv_type, long s_block, long s_kv, long s_offset,
                       const long *block_tables, int max_blocks, const int *query_start_loc,
                       const int *context_lens, int num_seqs, int heads, int kv_heads, int dim,
                       int block_size, float scale, float *out, const int *span_masks, int num_threads);

#endif
