/* Choosing tokens from rows of logits, the few hundred microseconds torch ops took per step:
 * verification's greedy argmax, and the draft's likeliest tokens with their probabilities.
 */
#include <math.h>
#include <stddef.h>

#include <omp.h>

#include "kernels.h"

#define PD_TOP_K_MAX 64  /* the most candidates a row's top_probs keeps (cpu_kernels.top_probs checks) */

/* The index of the largest of p's n floats as torch.argmax picks it: the first of equal maxima,
 * or the first NaN if there is one. LANES running maxima (each lane keeps its first), then the
 * smallest index among the lanes holding the largest. */
static long argmax_row(const float *p, int n) {
    int i = 0;
    long at = 0;
    float best = p[0];
    if (best != best) return 0;
    if (n >= 2 * LANES) {
        vint lane, index, nan = splat_i(0);
        for (int k = 0; k < LANES; k++) lane[k] = k;
        vfloat m = load_f32(p);
        index = lane;
        nan |= m != m;
        for (i = LANES; i + LANES <= n; i += LANES) {
            vfloat v = load_f32(p + i);
            vint greater = v > m;  /* false for NaN: found below, after the loop */
            nan |= v != v;
            m = select_lanes(greater, v, m);
            index = (greater & (lane + i)) | (~greater & index);
        }
        for (int k = 0; k < LANES; k++)
            if (nan[k])
                for (int j = 0; j < i; j++)
                    if (p[j] != p[j]) return j;
        best = hmax(m);
        at = n;
        for (int k = 0; k < LANES; k++)
            if (m[k] == best && index[k] < at) at = index[k];
    } else {
        i = 1;
    }
    for (; i < n; i++) {
        if (p[i] != p[i]) return i;
        if (p[i] > best) best = p[i], at = i;
    }
    return at;
}

/* out[r] = the index of row r's largest logit (greedy sampling), rows [rows][n] split between threads. */
void pd_argmax_rows(const float *x, int rows, int n, long *out, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (size_t)r * n, n);
}

#define SPAN (4 * LANES)  /* logits per span whose maximum the search for the k largest skips by */

/* Row p's k largest logits (k <= n), largest first (the first of equal values first), and their
 * softmax probabilities over all n, into ids[k] and probs[k]. Three passes: each span's maximum
 * (and the row's), the sum of exps (vexp: a relative error of ~2e-7 against torch.softmax's), then
 * the k largest from the spans whose maximum beats the current k-th (a few, once it has risen).
 * A row with a NaN gets NaN probabilities (ids 0..k-1): no draft path passes a threshold through it. */
static void top_probs_row(const float *p, int n, int k, long *ids, float *probs) {
    int spans = n / SPAN;
    float span_max[spans > 0 ? spans : 1], best[PD_TOP_K_MAX], top = -INFINITY;
    int has_nan = 0;
    for (int s = 0; s < spans; s++) {
        const float *q = p + (size_t)s * SPAN;
        vfloat a = load_f32(q), b = load_f32(q + LANES), c = load_f32(q + 2 * LANES), d = load_f32(q + 3 * LANES);
        vint nan = (a != a) | (b != b) | (c != c) | (d != d);
        a = select_lanes(b > a, b, a);
        c = select_lanes(d > c, d, c);
        span_max[s] = hmax(select_lanes(c > a, c, a));
        top = span_max[s] > top ? span_max[s] : top;
        has_nan |= hmax(__builtin_convertvector(nan, vfloat)) != 0.0f;
    }
    for (int i = spans * SPAN; i < n; i++) {
        has_nan |= p[i] != p[i];
        top = p[i] > top ? p[i] : top;
    }
    for (int j = 0; j < k; j++) best[j] = -INFINITY, ids[j] = j;
    if (has_nan) {
        for (int j = 0; j < k; j++) probs[j] = NAN;
        return;
    }
    vfloat sums = splat(0.0f);
    int i = 0;
    for (; i + LANES <= n; i += LANES) sums += vexp(load_f32(p + i) - top);
    float sum = hsum(sums);
    for (; i < n; i++) sum += expf(p[i] - top);
    for (i = 0; i < n; i++) {
        if (i % SPAN == 0 && i / SPAN < spans && !(span_max[i / SPAN] > best[k - 1])) {
            i += SPAN - 1;
            continue;
        }
        if (!(p[i] > best[k - 1])) continue;
        int j = k - 1;
        for (; j > 0 && p[i] > best[j - 1]; j--) best[j] = best[j - 1], ids[j] = ids[j - 1];
        best[j] = p[i], ids[j] = i;
    }
    for (int j = 0; j < k; j++) probs[j] = expf(best[j] - top) / sum;
}

/* Each of x's rows [rows][n]: top_probs_row into ids[rows][k] and probs[rows][k]. */
void pd_top_probs(const float *x, int rows, int n, int k, long *ids, float *probs) {
    for (int r = 0; r < rows; r++) top_probs_row(x + (size_t)r * n, n, k, ids + (size_t)r * k, probs + (size_t)r * k);
}
