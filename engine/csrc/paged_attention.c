/* Paged attention for short queries (decode steps and speculative verification spans) on CPU.
 *
 * Why: with a few query tokens per sequence, attention is a few KFLOPs per head, and the torch
 * formulation (gather the context through the block tables, pad, mask, softmax, two matmuls)
 * spends its time in ~10 framework ops and two copies of the whole context per layer. This
 * kernel reads K/V straight from the paged cache through the block table, once per
 * (sequence, kv head), for all query tokens and all query heads sharing that kv head.
 *
 * Query token i of sequence b sits at position ctx_b - qlen_b + i and sees keys 0..position; with
 * span_masks (a tree-shaped verification span), of the sequence's own query tokens only those
 * whose bit is set in the row's mask (bit j: query token j; -1 = all, the causal rule alone).
 * A row's keys are cut into partitions of PART_KEYS at fixed positions; within one, the scores,
 * their max and exps are computed whole, and partitions are folded in order as one softmax
 * (flash-decoding style). This file cuts a batch into tiles and partitions and shares them out
 * between the threads; attention_tile.c computes one tile's partition.
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "attention_tile.h"

/* Shapes and pointers of one call. */
typedef struct {
    const float *q;      /* with an int8 cache: the quantized queries' values, as floats */
    const int8_t *q8;    /* with an int8 cache: the queries quantized per row, and their scales */
    const float *qs;
    const char *cache;
    int kv_type;
    long s_block, s_kv, s_offset;
    const long *block_tables;
    const int *query_start_loc, *context_lens, *span_masks;
    int max_blocks, heads, kv_heads, group, dim, block_size;
    float scale;
    float *out;
} attn_call;

/* Query tokens [t0, t1) of one sequence, all heads of one kv head's group: rows that read the
 * same keys. A tree token off the chain (mask != 0) is a tile alone: its visible keys (the
 * prefix, then the span tokens its mask names) are read as one contiguous run, chunked as
 * plain decoding would chunk them, so the row computes the bits of the token decoded at its
 * logical position. (Keys at masked slots in between would shift the partitions and their
 * chunks, and a last-bit difference can change a token downstream.) */
typedef struct {
    int seq, kv_head, t0, t1, mask;
    int keys;        /* the run of keys the tile's rows read: positions 0 .. keys - 1 */
    int first_part;  /* its first partition's index among all tiles' partitions, in order */
} tile;

static int tile_parts(const tile *t) { return (t->keys + PART_KEYS - 1) / PART_KEYS; }

typedef struct {
    const float *q[MAX_ROWS];
    const int8_t *q8[MAX_ROWS];
    float qs[MAX_ROWS];
    float *out[MAX_ROWS];
    int pos[MAX_ROWS], tree[MAX_ROWS], span_map[32], n, pos0;
} tile_rows;

static void rows_of(const attn_call *a, const tile *t, tile_rows *r) {
    int first = a->query_start_loc[t->seq], qlen = a->query_start_loc[t->seq + 1] - first;
    r->pos0 = a->context_lens[t->seq] - qlen;
    int visible = 0;
    if (t->mask)
        for (int k = 0; k <= t->t0; k++)
            if ((t->mask >> k) & 1) r->span_map[visible++] = k;
    r->n = 0;
    for (int i = t->t0; i < t->t1; i++)
        for (int g = 0; g < a->group; g++, r->n++) {
            long row = (long)(first + i) * a->heads + t->kv_head * a->group + g;
            r->q[r->n] = a->q + row * a->dim;
            r->q8[r->n] = a->q8 ? a->q8 + row * a->dim : NULL;
            r->qs[r->n] = a->qs ? a->qs[row] : 1.0f;
            r->out[r->n] = a->out + row * a->dim;
            r->pos[r->n] = t->mask ? r->pos0 + visible - 1 : r->pos0 + i;  /* the last key it sees, in the run it reads */
            r->tree[r->n] = a->span_masks && !t->mask ? a->span_masks[first + i] : -1;
        }
}

/* Partition p of the tile's keys: [n rows][dim + 2] = unnormalised sums, running max, sum of exps. */
static void attend_part(const attn_call *a, const tile *t, const tile_rows *r, int p, const part_keys *next,
                        float *part) {
    int k0 = p * PART_KEYS, k1 = k0 + PART_KEYS < t->keys ? k0 + PART_KEYS : t->keys;
    pd_attend_tile(r->q, r->q8, r->qs, r->pos, r->tree, r->pos0, t->mask ? r->span_map : 0, r->n, a->cache, a->s_block, a->s_kv,
                    a->s_offset, a->block_tables + (long)t->seq * a->max_blocks, a->block_size, t->kv_head, a->dim,
                    a->kv_type, a->scale, k0, k1, next, part);
}

/* state (same layout as a partition, empty: l = 0) += the next partition, as one softmax. */
static __attribute__((noinline)) void fold_part(float *state, const float *part, int n, int dim) {
    for (int r = 0; r < n; r++) {
        float *s = state + (size_t)r * (dim + 2);
        const float *p = part + (size_t)r * (dim + 2);
        if (p[dim + 1] == 0.0f) continue;  /* no key of this partition visible to the row */
        if (s[dim + 1] == 0.0f) {
            memcpy(s, p, sizeof(float) * (dim + 2));
            continue;
        }
        float m = s[dim] > p[dim] ? s[dim] : p[dim], cs = expf(s[dim] - m), cp = expf(p[dim] - m);
        for (int d = 0; d < dim; d++) s[d] = s[d] * cs + p[d] * cp;
        s[dim] = m;
        s[dim + 1] = s[dim + 1] * cs + p[dim + 1] * cp;
    }
}

static void write_rows(const tile_rows *r, const float *state, int dim) {
    for (int i = 0; i < r->n; i++) {
        const float *s = state + (size_t)i * (dim + 2);
        float inv = 1.0f / s[dim + 1];
        for (int d = 0; d < dim; d++) r->out[i][d] = s[d] * inv;
    }
}

/* Partition p's key addresses: none past the tile's last partition, without a tile, or for a
 * tree token's run (rare and short). */
static void keys_of_part(const attn_call *a, const tile *t, int p, part_keys *out) {
    out->n = 0;
    if (!t || t->mask || p >= tile_parts(t)) return;
    const long *table = a->block_tables + (long)t->seq * a->max_blocks;
    long esize = pd_kv_esize(a->kv_type);
    int k1 = (p + 1) * PART_KEYS < t->keys ? (p + 1) * PART_KEYS : t->keys;
    for (int k = p * PART_KEYS; k < k1; k++)
        out->keys[out->n++] = key_address(a->cache, table, a->block_size, a->s_block, a->s_offset, t->kv_head,
                                          pd_kv_row(a->kv_type, a->dim), esize, k);
}

/* A tile start to end in one task: its partitions in turn, each requesting the next one's memory
 * (after the last, the first of `next`, the task's next tile, if any) while it computes. */
static void attend_whole_tile(const attn_call *a, const tile *t, const tile *next, float *state, float *part) {
    tile_rows r;
    rows_of(a, t, &r);
    for (int i = 0; i < r.n; i++) state[(size_t)i * (a->dim + 2) + a->dim + 1] = 0.0f;
    part_keys ahead;
    for (int p = 0; p < tile_parts(t); p++) {
        if (p + 1 < tile_parts(t)) keys_of_part(a, t, p + 1, &ahead);
        else keys_of_part(a, next, 0, &ahead);
        attend_part(a, t, &r, p, &ahead, part);
        fold_part(state, part, r.n, a->dim);
    }
    write_rows(&r, state, a->dim);
}

/* Partition p's cost: its keys times its tile's rows, plus its read, about 8 rows' worth (a decode
 * tile's three rows wait on memory more than they compute). */
static long part_cost(const attn_call *a, const tile *t, int p) {
    int keys = t->keys - p * PART_KEYS < PART_KEYS ? t->keys - p * PART_KEYS : PART_KEYS;
    return (long)keys * ((t->t1 - t->t0) * a->group + 8);
}

/* This thread's share [*lo, *hi) of all partitions, in order: contiguous, so that each one's next
 * partition is known and requested ahead (taken from a shared queue, the next one was often the
 * other thread's), and balanced by cost (a verification span's or a prefill chunk's tile has up to
 * 64 rows, a decode step's 3). */
static void thread_share(const attn_call *a, const tile *tiles, int ntiles, int *lo, int *hi) {
    int id = omp_get_thread_num(), threads = omp_get_num_threads(), k = 0;
    long total = 0, before = 0;
    for (int i = 0; i < ntiles; i++)
        for (int p = 0; p < tile_parts(&tiles[i]); p++) total += part_cost(a, &tiles[i], p);
    long from = total * id / threads, to = total * (id + 1) / threads;
    *lo = -1;
    for (int i = 0; i < ntiles; i++)
        for (int p = 0; p < tile_parts(&tiles[i]); p++, k++) {
            long cost = part_cost(a, &tiles[i], p), middle = before + cost / 2;  /* a partition's thread: where its middle falls */
            if (*lo < 0 && middle >= from) *lo = k;
            if (middle >= to) {
                *hi = k;
                if (*lo < 0) *lo = k;
                return;
            }
            before += cost;
        }
    if (*lo < 0) *lo = k;
    *hi = k;  /* the last thread's share runs to the end */
}

/* The tiles of every sequence and kv head into `tiles` (room for kv_heads * (T + num_seqs)), their
 * first_part numbered; returns how many, and their partitions in *parts. */
static int make_tiles(const attn_call *a, int num_seqs, tile *tiles, int *parts) {
    int n = 0, tokens_per_tile = MAX_ROWS / a->group;
    for (int b = 0; b < num_seqs; b++) {
        int first = a->query_start_loc[b], qlen = a->query_start_loc[b + 1] - first;
        int pos0 = a->context_lens[b] - qlen;
        for (int h = 0; h < a->kv_heads; h++) {
            int t0 = 0;  /* the pending tile: tokens t0 .. i-1 */
            for (int i = 0; i <= qlen; i++) {
                int mask = a->span_masks && i < qlen ? a->span_masks[first + i] : -1;
                int off_chain = i < qlen && mask != -1 && mask != (int)((2u << i) - 1);
                if (i > t0 && (i == qlen || off_chain || i - t0 == tokens_per_tile)) {
                    tiles[n++] = (tile){b, h, t0, i, 0, pos0 + i, 0};
                    t0 = i;
                }
                if (off_chain) {
                    tiles[n++] = (tile){b, h, i, i + 1, mask, pos0 + __builtin_popcount(mask), 0};
                    t0 = i + 1;
                }
            }
        }
    }
    *parts = 0;
    for (int i = 0; i < n; i++) {
        tiles[i].first_part = *parts;
        *parts += tile_parts(&tiles[i]);
    }
    return n;
}

/* Enough tiles to share out whole: each thread runs the tiles whose first partitions fall in its
 * share of all partitions, each tile's partitions in turn. */
static int attend_tiles_whole(const attn_call *a, const tile *tiles, int ntiles, int num_threads) {
    size_t row_floats = (size_t)MAX_ROWS * (a->dim + 2);
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|: failed)
    {
        float *state = malloc(2 * row_floats * sizeof(float));
        failed = !state;
        int lo, hi, i = 0;
        thread_share(a, tiles, ntiles, &lo, &hi);
        while (i < ntiles && tiles[i].first_part < lo) i++;
        for (; state && i < ntiles && tiles[i].first_part < hi; i++) {
            int last = i + 1 == ntiles || tiles[i + 1].first_part >= hi;
            attend_whole_tile(a, &tiles[i], last ? 0 : &tiles[i + 1], state, state + row_floats);
        }
        free(state);
    }
    return failed ? -1 : 0;
}

/* Few tiles (a decode step of a few sequences): each partition is a task, then each tile's
 * partitions are folded in order, into its first one's room. A partition holds its tile's rows
 * only (a decode step's 3-4 of MAX_ROWS): at long contexts there are thousands of partitions. */
static int attend_tiles_split(const attn_call *a, const tile *tiles, int ntiles, int parts, int num_threads) {
    int *task_tile = malloc(sizeof(int) * (size_t)parts);
    size_t *offset = malloc(sizeof(size_t) * (size_t)parts), total = 0;
    for (int i = 0; task_tile && offset && i < ntiles; i++)
        for (int p = 0; p < tile_parts(&tiles[i]); p++) {
            task_tile[tiles[i].first_part + p] = i;
            offset[tiles[i].first_part + p] = total;
            total += (size_t)(tiles[i].t1 - tiles[i].t0) * a->group * (a->dim + 2);
        }
    float *partials = task_tile && offset ? malloc(sizeof(float) * total) : NULL;
    if (!partials) {
        free(task_tile);
        free(offset);
        return -1;
    }
    #pragma omp parallel num_threads(num_threads)
    {
        int lo, hi;
        thread_share(a, tiles, ntiles, &lo, &hi);
        for (int k = lo; k < hi; k++) {
            const tile *t = &tiles[task_tile[k]], *next = k + 1 < hi ? &tiles[task_tile[k + 1]] : 0;
            tile_rows r;
            part_keys ahead;
            rows_of(a, t, &r);
            keys_of_part(a, next, next ? k + 1 - next->first_part : 0, &ahead);
            attend_part(a, t, &r, k - t->first_part, &ahead, partials + offset[k]);
        }
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int i = 0; i < ntiles; i++) {
            tile_rows r;
            rows_of(a, &tiles[i], &r);
            float *state = partials + offset[tiles[i].first_part];
            for (int p = 1; p < tile_parts(&tiles[i]); p++)
                fold_part(state, partials + offset[tiles[i].first_part + p], r.n, a->dim);
            write_rows(&r, state, a->dim);
        }
    }
    free(task_tile);
    free(offset);
    free(partials);
    return 0;
}

/* q: [T, heads, dim]; out: [T, heads*dim]; block_tables: [num_seqs, max_blocks]; span_masks:
 * [T] tree masks (bit j: the row sees the span's token j; -1 = all, the causal rule alone), or
 * NULL; cache: rows of kv_type (kernels.h; strides in elements). Every sequence, prefill chunks
 * as much as decode steps: a row computes the same bits however long its sequence's query is
 * and whatever else is in the batch.
 * Returns 0, or -1 if a shape is outside the kernel's limits (the caller checks these first)
 * or memory runs out. */
int pd_paged_attention(const float *q, const void *cache, int kv_type, long s_block, long s_kv, long s_offset,
                       const long *block_tables, int max_blocks, const int *query_start_loc,
                       const int *context_lens, int num_seqs, int heads, int kv_heads, int dim,
                       int block_size, float scale, float *out, const int *span_masks, int num_threads) {
    int group = heads / kv_heads;
    if (dim % 16 || dim > MAX_DIM || group > MAX_ROWS || kv_type < PD_KV_F32 || kv_type > PD_KV_INT8) return -1;
    attn_call a = {q, NULL, NULL, cache, kv_type, s_block, s_kv, s_offset, block_tables, query_start_loc, context_lens,
                   span_masks, max_blocks, heads, kv_heads, group, dim, block_size, scale, out};
    long rows = (long)query_start_loc[num_seqs] * heads;
    tile *tiles = malloc(sizeof(tile) * (size_t)kv_heads * (query_start_loc[num_seqs] + num_seqs));
    /* an int8 cache's queries, quantized once for every tile and partition: bytes, scales, and
     * for head sizes the integer dots do not take, their values as floats */
    int float_copy = dim % I8_CHUNK != 0;
    char *quantized = kv_type == PD_KV_INT8 ? malloc((size_t)rows * (dim + 4 + (float_copy ? 4 * dim : 0))) : NULL;
    if (!tiles || (kv_type == PD_KV_INT8 && !quantized)) {
        free(tiles);
        free(quantized);
        return -1;
    }
    if (quantized) {
        int8_t *q8 = (int8_t *)quantized;
        float *qs = (float *)(quantized + rows * dim), *values = qs + rows;
        for (long i = 0; i < rows * dim; i += dim) qs[i / dim] = pd_quantize_i8(q + i, dim, q8 + i);
        for (long i = 0; float_copy && i < rows * dim; i++) values[i] = q8[i];
        a.q = float_copy ? values : q;  /* (the integer dots read q8) */
        a.q8 = q8;
        a.qs = qs;
    }
    int parts, ntiles = make_tiles(&a, num_seqs, tiles, &parts);
    int rc = ntiles >= 4 * num_threads ? attend_tiles_whole(&a, tiles, ntiles, num_threads)
                                       : attend_tiles_split(&a, tiles, ntiles, parts, num_threads);
    free(tiles);
    free(quantized);
    return rc;
}
