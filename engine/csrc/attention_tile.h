/* What paged_attention.c and attention_tile.c share: a partition's size and key addresses, and
 * the tile kernel's entry. */
#ifndef PD_ATTENTION_TILE_H
#define PD_ATTENTION_TILE_H

#include "kernels.h"

#define MAX_ROWS 64      /* query tokens x grouped heads handled together */
#define MAX_DIM 256

/* Keys per partition. Each row's keys are cut into partitions at fixed positions, each
 * partition's softmax sums are computed on their own, then folded in order (fold_part). Where
 * the partitions run (one task each when a batch has few tiles, as a decode step of one
 * sequence has; in turn inside the tile's task otherwise) never changes a row's bits. */
#define PART_KEYS 64

/* The addresses of a partition's keys (its values are s_kv further), as the partition before it
 * requests them: see attend_tile's values pass. */
typedef struct {
    const char *keys[PART_KEYS];
    int n;
} part_keys;

/* Key `pos` of kv head `kv_head` in a sequence's blocks (`table`), in bytes from `cache`; `row`:
 * a head's elements (pd_kv_row). */
static inline const char *key_address(const char *cache, const long *table, int block_size, long s_block,
                                      long s_offset, int kv_head, int row, long esize, int pos) {
    long element = table[pos / block_size] * s_block + (long)(pos % block_size) * s_offset + (long)kv_head * row;
    return cache + element * esize;
}

/* Rows (query token, head) of one sequence against keys [k0, k1) of one kv head (one partition,
 * at most PART_KEYS): per row the unnormalised softmax-weighted sum of values, the scores' max and
 * the sum of exps, into part [nrows][dim + 2], requesting the next partition's lines (`next`)
 * while it computes. */
void pd_attend_tile(const float *const *qrows, const int8_t *const *q8rows, const float *qscales, const int *pos,
                    const int *tree, int span0, const int *span_map, int nrows, const char *cache, long s_block,
                    long s_kv, long s_offset, const long *table, int block_size, int kv_head, int dim, int kv_type,
                    float scale, int k0, int k1, const part_keys *next, float *part);

#endif
