/* The decoder layers of a Llama-family model as one native call, for every CPU fp32 forward.
 *
 * Why: at batch 1 a layer's arithmetic outside the GEMMs (two RMSNorms, RoPE, the KV write,
 * SiLU, residual adds) is a few thousand flops, but as ~25 torch ops it costs ~300 us a layer
 * in dispatch alone: more than the layer's weights take to stream. Here the layer loop runs in
 * C; the GEMMs (packed_gemm.c, quant_dot.c) and attention (paged_attention.c) are the same
 * kernels the torch path calls, so the two compute the same sums except for the norms' and
 * SiLU's rounding. FMA contraction is off in this file: a row must compute the same bits in any
 * batch, and the compiler may fuse differently in differently vectorized copies of a loop.
 *
 * Per layer, for T rows of the residual stream x (updated in place):
 *   h = rmsnorm(x) * w_in;  [q|k|v] = h W_qkv^T (+ b);  q, k = rope(q, k);  cache[slot] = k, v
 *   a = attention(q, cache);  x += a W_o^T;  h = rmsnorm(x) * w_post
 *   [g|u] = h W_gate_up^T;  x += (silu(g) * u) W_down^T
 * The caller (engine/native_decoder.py) keeps every pointer alive for the call.
 */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include <omp.h>

#include "kernels.h"

#pragma GCC optimize("fp-contract=off")

typedef struct {
    int format;          /* PD_F32, ... (kernels.h) */
    const void *weight;  /* panels as the format's GEMM reads them */
    const float *bias;   /* or NULL */
} pd_matrix;

typedef struct {
    pd_matrix qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
} pd_layer;

typedef struct {
    int hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    void *cache;                       /* layer 0 of [blocks, layers, 2, block_size, kv_heads, row] */
    int cache_type;                    /* the cache's rows: PD_KV_F32, PD_KV_BF16 or PD_KV_INT8 */
    long s_block, s_layer, s_kv, s_offset;
    const float *attn_embed;           /* NULL, or [T][hidden]: layer 0's attention input is then
                                          [rmsnorm(attn_embed) * embed_norm, rmsnorm(x) * w_in], 2 *
                                          hidden wide (EAGLE3's midlayer: the embedding of the token
                                          after each position beside the hidden state) */
    const float *embed_norm;
} pd_model;

typedef struct {  /* one forward's batch: T rows, the sequences' query tokens one after another */
    int tokens, num_seqs, max_blocks;
    const long *positions, *slot_blocks, *slot_offsets;        /* [T] */
    const long *block_tables;                                  /* [B][max_blocks] */
    const int *query_start_loc, *context_lens, *span_masks;    /* [B+1], [B], [T] or NULL */
    const float *cos, *sin;                                    /* [max_positions][D] */
    double *timings;  /* NULL, or seconds added up: [0] GEMMs, [1] attention, [2] the whole call */
} pd_batch;

enum { TIME_GEMM, TIME_ATTENTION, TIME_LAYERS };

static double clock_start(const pd_batch *b) { return b->timings ? omp_get_wtime() : 0.0; }

static void clock_add(const pd_batch *b, int what, double start) {
    if (b->timings) b->timings[what] += omp_get_wtime() - start;
}

static int gemm(const pd_matrix *w, const float *x, float *y, int M, int K, int N, int threads) {
    switch (w->format) {
    case PD_F32: pd_packed_gemm(x, w->weight, w->bias, y, M, K, N, threads); return 0;
    case PD_BF16: pd_packed_gemm_bf16(x, w->weight, w->bias, y, M, K, N, threads); return 0;
    case PD_Q4: case PD_Q4F: case PD_Q8: case PD_Q8H:  /* the format is the panel's qtype */
        return pd_quant_gemm(w->format, x, w->weight, w->bias, y, M, K, N, threads);
    case PD_Q4_I8: case PD_Q4F_I8: case PD_Q8_I8: case PD_Q8H_I8:
        return pd_quant_gemm_i8(w->format - 1, x, w->weight, w->bias, y, M, K, N, threads);
    default: return -1;
    }
}

static int matmul(const pd_batch *b, const pd_matrix *w, const float *x, float *y, int M, int K, int N, int threads) {
    double start = clock_start(b);
    int rc = gemm(w, x, y, M, K, N, threads);
    clock_add(b, TIME_GEMM, start);
    return rc;
}

/* Sum of squares as 16 interleaved partial sums (sum j takes elements j, j + 16, ...), folded by
 * a fixed tree: one running sum was a chain of n dependent adds (~1 us a row at 576, most of a
 * 6-token span's work outside the GEMMs and attention); these vectorise at any width to the same bits. */
static float sum_squares(const float *r, int n) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += r[i + j] * r[i + j];
    for (int j = 0; i + j < n; j++) acc[j] += r[i + j] * r[i + j];
    for (int width = 8; width > 0; width /= 2)
        for (int j = 0; j < width; j++) acc[j] += acc[j + width];
    return acc[0];
}

static void rms_norm(const float *x, const float *w, float *out, int T, int n, float eps) {
    for (int t = 0; t < T; t++) {
        const float *r = x + (size_t)t * n;
        float sum = sum_squares(r, n);
        float inv = 1.0f / sqrtf(sum / n + eps);
        for (int i = 0; i < n; i++) out[(size_t)t * n + i] = r[i] * inv * w[i];
    }
}

/* Rotate-half RoPE (HF convention) of `heads` heads of D at row r, with its position's cos/sin. */
static void rope(float *r, int heads, int D, const float *cos, const float *sin) {
    int half = D / 2;
    for (int h = 0; h < heads; h++) {
        float *x = r + (size_t)h * D;
        for (int i = 0; i < half; i++) {
            float a = x[i], b = x[i + half];
            x[i] = a * cos[i] - b * sin[i];
            x[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* The per-row work between the GEMMs (norms, RoPE, cache writes, SiLU, residual adds) split
 * between the threads by rows once a batch has ROWS_PARALLEL of them: alone on one core it was
 * ~7 % of a batch-16 step while the other core waited. Each row computes alone, the same bits on
 * any thread. */
#define ROWS_PARALLEL 4
/* for (t = 0 .. T-1) body, rows split between `threads` (a variable of that name in scope) from
 * ROWS_PARALLEL rows on; below, no OpenMP region at all: even one that its if clause keeps on one
 * thread cost ~1 us, 3-6 % of a forward over 1-2 tokens at 5 a layer. */
#define FOR_ROWS(t, T, ...)                                                                        \
    if ((T) >= ROWS_PARALLEL) {                                                                    \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                          \
        for (int t = 0; t < (T); t++) __VA_ARGS__                                                  \
    } else                                                                                         \
        for (int t = 0; t < (T); t++) __VA_ARGS__

/* The kv heads' rows x[kv_heads * D] into the cache at element `at`, as its rows are stored. */
static void cache_write(const pd_model *m, char *cache, long at, const float *x) {
    int D = m->head_dim, n = m->kv_heads * D;
    if (m->cache_type == PD_KV_F32) {
        memcpy(cache + at * 4, x, sizeof(float) * n);
    } else if (m->cache_type == PD_KV_BF16) {
        uint16_t *dst = (uint16_t *)cache + at;
        for (int i = 0; i < n; i++) dst[i] = to_bf16(x[i]);
    } else {
        for (int h = 0; h < m->kv_heads; h++) {  /* a row: its values, then their scale */
            int8_t *row = (int8_t *)cache + at + (long)h * pd_kv_row(PD_KV_INT8, D);
            float s = pd_quantize_i8(x + (size_t)h * D, D, row);
            memcpy(row + D, &s, sizeof s);
        }
    }
}

/* h = the attention input of x's T rows; returns its width (2 * hidden with embed, else hidden). */
static int attention_input(const pd_model *m, const pd_layer *L, const pd_batch *b, const float *embed,
                           const float *x, float *h, int threads) {
    int H = m->hidden, in = embed ? 2 * H : H;
    FOR_ROWS(t, b->tokens, {
        if (embed) rms_norm(embed + (size_t)t * H, m->embed_norm, h + (size_t)t * in, 1, H, m->eps);
        rms_norm(x + (size_t)t * H, L->input_norm, h + (size_t)t * in + (in - H), 1, H, m->eps);
    })
    return in;
}

/* Row t's key (rotated here, in place) and value into the cache at its slot. */
static void store_kv(const pd_model *m, char *cache, const pd_batch *b, int t, float *k, const float *v) {
    int D = m->head_dim;
    rope(k, m->kv_heads, D, b->cos + (size_t)b->positions[t] * D, b->sin + (size_t)b->positions[t] * D);
    long slot = b->slot_blocks[t] * m->s_block + b->slot_offsets[t] * m->s_offset;
    cache_write(m, cache, slot, k);
    cache_write(m, cache, slot + m->s_kv, v);
}

static int attention_block(const pd_model *m, const pd_layer *L, char *cache, const pd_batch *b, const float *embed,
                            float *x, float *h, float *qkv, float *att, float *tmp, int threads) {
    int T = b->tokens, H = m->hidden, D = m->head_dim;
    int q_size = m->heads * D, kv_size = m->kv_heads * D, width = q_size + 2 * kv_size;
    int in = attention_input(m, L, b, embed, x, h, threads);
    if (matmul(b, &L->qkv, h, qkv, T, in, width, threads)) return -1;
    FOR_ROWS(t, T, {  /* q rows packed [T][heads * D] into h for the attention kernel */
        float *r = qkv + (size_t)t * width;
        rope(r, m->heads, D, b->cos + (size_t)b->positions[t] * D, b->sin + (size_t)b->positions[t] * D);
        store_kv(m, cache, b, t, r + q_size, r + q_size + kv_size);
        memcpy(h + (size_t)t * q_size, r, sizeof(float) * q_size);
    })
    double start = clock_start(b);
    int rc = pd_paged_attention(h, cache, m->cache_type, m->s_block, m->s_kv, m->s_offset, b->block_tables,
                                b->max_blocks, b->query_start_loc, b->context_lens, b->num_seqs, m->heads,
                                m->kv_heads, D, m->block_size, m->scale, att, b->span_masks, threads);
    clock_add(b, TIME_ATTENTION, start);
    if (rc) return -1;
    return matmul(b, &L->o, att, tmp, T, q_size, H, threads);  /* x += tmp in mlp_block */
}

/* out = silu(g) * u, LANES at a time: sigmoid(g) = 1 / (1 + e) for g >= 0, else e / (1 + e),
 * with e = exp(-|g|) (never overflows). A short last vector goes through a padded copy, so each
 * element computes the same whatever its row's length. */
static inline vfloat silu_times(vfloat g, vfloat u) {
    vfloat e = vexp(select_lanes(g < 0, g, -g)), one = splat(1.0f);
    return g * (select_lanes(g < 0, e, one) / (one + e)) * u;
}

static void silu_mul(const float *g, const float *u, float *out, int n) {
    int i = 0;
    for (; i + LANES <= n; i += LANES) store_f32(out + i, silu_times(load_f32(g + i), load_f32(u + i)));
    if (i < n) {
        float gb[LANES] = {0}, ub[LANES] = {0}, ob[LANES];
        memcpy(gb, g + i, sizeof(float) * (n - i));
        memcpy(ub, u + i, sizeof(float) * (n - i));
        store_f32(ob, silu_times(load_f32(gb), load_f32(ub)));
        memcpy(out + i, ob, sizeof(float) * (n - i));
    }
}

/* x += the attention's output (in tmp), then the MLP's residual. */
static int mlp_block(const pd_model *m, const pd_layer *L, const pd_batch *b, float *x, float *h, float *gu,
                      float *tmp, int threads) {
    int T = b->tokens, H = m->hidden, I = m->intermediate;
    FOR_ROWS(t, T, {
        float *r = x + (size_t)t * H;
        for (int i = 0; i < H; i++) r[i] += tmp[(size_t)t * H + i];
        rms_norm(r, L->post_norm, h + (size_t)t * H, 1, H, m->eps);
    })
    if (matmul(b, &L->gate_up, h, gu, T, H, 2 * I, threads)) return -1;
    FOR_ROWS(t, T, {  /* silu(gate) * up, [T][I] in a buffer of its own */
        silu_mul(gu + (size_t)t * 2 * I, gu + (size_t)t * 2 * I + I, h + (size_t)t * I, I);
    })
    if (matmul(b, &L->down, h, tmp, T, I, H, threads)) return -1;
    FOR_ROWS(t, T, {
        for (int i = 0; i < H; i++) x[(size_t)t * H + i] += tmp[(size_t)t * H + i];
    })
    return 0;
}

/* What the first layer writes into the cache for x's T rows, and nothing else (no queries,
 * attention or MLP): EAGLE3's draft catching up on positions whose outputs are not needed. kv:
 * the layer's qkv matrix from the panel holding its first key feature on, `skip` features before
 * that key; each output feature is the same sum as in the full projection, so the entries are the
 * bits a whole layer call writes. scratch: T * (2 * hidden + skip + 2 * kv_heads * D) floats. */
int pd_write_kv(const pd_model *m, const pd_layer *L, const pd_matrix *kv, int skip, const pd_batch *b,
                const float *x, float *scratch, int threads) {
    int T = b->tokens, kv_size = m->kv_heads * m->head_dim, width = skip + 2 * kv_size;
    float *h = scratch, *out = h + (size_t)T * 2 * m->hidden;
    int in = attention_input(m, L, b, m->attn_embed, x, h, threads);
    if (matmul(b, kv, h, out, T, in, width, threads)) return -1;
    for (int t = 0; t < T; t++) {
        float *r = out + (size_t)t * width + skip;
        store_kv(m, (char *)m->cache, b, t, r, r + kv_size);
    }
    return 0;
}

/* out[i] = rmsnorm(x[rows[i]]) * w, i < n: the final norm of the rows whose logits are wanted. */
void pd_norm_rows(const float *x, const long *rows, int n, int hidden, const float *w, float eps, float *out) {
    for (int i = 0; i < n; i++) rms_norm(x + (size_t)rows[i] * hidden, w, out + (size_t)i * hidden, 1, hidden, eps);
}

/* Layers [0, num_layers) over x [T][hidden], in place. aux: NULL, or [T][num_aux * hidden]
 * receiving x as it enters layer aux_layers[j] in column block j. scratch: T * (max(heads * D,
 * 2 * hidden, intermediate) + max(qkv width, 2 * intermediate) + heads * D + hidden) floats. Returns 0, or -1
 * when a GEMM or the attention kernel refuses its shapes (or a GEMM finds no memory). */
int pd_decoder_layers(const pd_model *m, const pd_layer *layers, int num_layers, const pd_batch *b, float *x,
                      float *aux, const int *aux_layers, int num_aux, float *scratch, int threads) {
    int T = b->tokens, H = m->hidden, D = m->head_dim;
    int width = (m->heads + 2 * m->kv_heads) * D;
    if (D % 16 || m->heads % m->kv_heads) return -1;
    int h_width = m->heads * D > 2 * H ? m->heads * D : 2 * H;  /* attention input, queries, SiLU's output */
    h_width = h_width > m->intermediate ? h_width : m->intermediate;
    float *h = scratch, *qkv = h + (size_t)T * h_width;
    float *att = qkv + (size_t)T * (width > 2 * m->intermediate ? width : 2 * m->intermediate);
    float *tmp = att + (size_t)T * m->heads * D;
    double start = clock_start(b);
    for (int l = 0; l < num_layers; l++) {
        for (int j = 0; j < num_aux; j++)
            if (aux_layers[j] == l)
                for (int t = 0; t < T; t++)
                    memcpy(aux + ((size_t)t * num_aux + j) * H, x + (size_t)t * H, sizeof(float) * H);
        char *cache = (char *)m->cache + (size_t)l * m->s_layer * pd_kv_esize(m->cache_type);
        if (attention_block(m, &layers[l], cache, b, l == 0 ? m->attn_embed : NULL, x, h, qkv, att, tmp, threads) ||
            mlp_block(m, &layers[l], b, x, h, qkv, tmp, threads))
            return -1;
    }
    clock_add(b, TIME_LAYERS, start);
    return 0;
}
