/* Choosing tokens from rows of logits, the few hundred microseconds torch ops took per step:
 * verification's greedy argmax, the draft's likeliest tokens with their probabilities, and the
 * distribution a sampled request draws from (engine/sampling.py's definition) with its draw.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

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

/* Each whole SPAN's maximum of x's n floats divided by `divisor` into span_max[n / SPAN] (NULL: not
 * wanted); returns the row's maximum (the tail included) and sets *has_nan when it holds a NaN.
 * out: where the divided values go, in the same pass (NULL: nowhere, and divisor 1: x as it is). */
static float span_maxima(const float *x, int n, float divisor, float *out, float *span_max, int *has_nan) {
    int spans = n / SPAN;
    vfloat most = splat(-INFINITY);
    vint nan = splat_i(0);
    for (int s = 0; s < spans; s++) {
        const float *q = x + (size_t)s * SPAN;
        vfloat a = load_f32(q), b = load_f32(q + LANES), c = load_f32(q + 2 * LANES), d = load_f32(q + 3 * LANES);
        if (out) {
            float *o = out + (size_t)s * SPAN;
            a /= divisor, b /= divisor, c /= divisor, d /= divisor;
            store_f32(o, a), store_f32(o + LANES, b), store_f32(o + 2 * LANES, c), store_f32(o + 3 * LANES, d);
        }
        nan |= (a != a) | (b != b) | (c != c) | (d != d);
        a = select_lanes(b > a, b, a);
        c = select_lanes(d > c, d, c);
        a = select_lanes(c > a, c, a);
        most = select_lanes(a > most, a, most);
        if (span_max) span_max[s] = hmax(a);
    }
    float top = hmax(most);
    *has_nan = hsum_i(nan) != 0;  /* a set lane is -1 */
    for (int i = spans * SPAN; i < n; i++) {
        float v = out ? (out[i] = x[i] / divisor) : x[i];
        *has_nan |= v != v;
        top = v > top ? v : top;
    }
    return top;
}

/* The k largest of p's n floats (k <= PD_TOP_K_MAX, no NaN), largest first (the first of equal
 * values first), into best[k] and ids[k]: only the spans whose maximum beats the current k-th
 * are read element by element (a few, once it has risen). */
static void k_largest(const float *p, int n, int k, const float *span_max, float *best, long *ids) {
    int spans = n / SPAN;
    for (int j = 0; j < k; j++) best[j] = -INFINITY, ids[j] = j;
    for (int i = 0; i < n; i++) {
        if (i % SPAN == 0 && i / SPAN < spans && !(span_max[i / SPAN] > best[k - 1])) {
            i += SPAN - 1;
            continue;
        }
        if (!(p[i] > best[k - 1])) continue;
        int j = k - 1;
        for (; j > 0 && p[i] > best[j - 1]; j--) best[j] = best[j - 1], ids[j] = ids[j - 1];
        best[j] = p[i], ids[j] = i;
    }
    for (int j = 0, next = 0; j < k; j++) {  /* slots no value above -inf filled: the first ids not picked */
        if (best[j] > -INFINITY) continue;
        for (int taken = 1; taken; next++) {
            taken = 0;
            for (int t = 0; t < j; t++) taken |= ids[t] == next;
            if (!taken) break;
        }
        ids[j] = next++;
    }
}

/* Row p's k largest logits (k <= n), largest first (the first of equal values first), and their
 * softmax probabilities over all n, into ids[k] and probs[k]: span maxima, the sum of exps (vexp:
 * a relative error of ~2e-7 against torch.softmax's), then k_largest. A row with a NaN gets NaN
 * probabilities (ids 0..k-1): no draft path passes a threshold through it. */
static void top_probs_row(const float *p, int n, int k, long *ids, float *probs) {
    float span_max[n / SPAN > 0 ? n / SPAN : 1], best[PD_TOP_K_MAX];
    int has_nan;
    float top = span_maxima(p, n, 1.0f, NULL, span_max, &has_nan);
    if (has_nan) {
        for (int j = 0; j < k; j++) ids[j] = j, probs[j] = NAN;
        return;
    }
    vfloat sums = splat(0.0f);
    int i = 0;
    for (; i + LANES <= n; i += LANES) sums += vexp(load_f32(p + i) - top);
    float sum = hsum(sums);
    for (; i < n; i++) sum += expf(p[i] - top);
    k_largest(p, n, k, span_max, best, ids);
    for (int j = 0; j < k; j++) probs[j] = expf(best[j] - top) / sum;
}

/* Each of x's rows [rows][n]: top_probs_row into ids[rows][k] and probs[rows][k]. */
void pd_top_probs(const float *x, int rows, int n, int k, long *ids, float *probs) {
    for (int r = 0; r < rows; r++) top_probs_row(x + (size_t)r * n, n, k, ids + (size_t)r * k, probs + (size_t)r * k);
}

/* The k-th largest of v's n floats (1 <= k <= n, no NaN), reordering v: Hoare's selection. */
static float kth_largest(float *v, int n, int k) {
    int lo = 0, hi = n - 1, want = k - 1;  /* v[want] once v[lo..hi] is ordered descending around it */
    while (lo < hi) {
        float pivot = v[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                float t = v[i];
                v[i++] = v[j], v[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return v[want];
    }
    return v[want];
}

static int descending(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* Whether any of the `len` floats at p is >= c (len: a whole number of vectors). */
static inline int any_at_least(const float *p, int len, float c) {
    vfloat m = load_f32(p);
    for (int i = LANES; i < len; i += LANES) m = select_lanes(load_f32(p + i) > m, load_f32(p + i), m);
    return hmax(m) >= c;
}

/* p's floats >= c, in index order, into out; returns how many (spans with none are skipped whole). */
static int gather_at_least(const float *p, int n, float c, float *out) {
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (i % SPAN == 0 && i + SPAN <= n && !any_at_least(p + i, SPAN, c)) {
            i += SPAN - 1;
            continue;
        }
        if (p[i] >= c) out[m++] = p[i];
    }
    return m;
}

/* The least probability a top-p nucleus keeps: sorted descending, the nucleus is the shortest
 * prefix whose mass reaches top_p (at least one token), token i kept while fp32(its running sum)
 * minus it is below top_p (the running sum in fp64: torch's CPU cumsum, as engine/sampling.py
 * compares). Only the tokens at or above a cut are sorted: largest / 2^10, then / 2^20, then all,
 * the first cut whose tokens hold the nucleus. A row with an infinite logit is NaN (the caller
 * returns it as such). scratch: n floats. */
static float nucleus_threshold(const float *p, int n, float largest, float top_p, float *scratch) {
    for (float cut = largest * 0x1p-10f;; cut = cut > largest * 0x1p-15f ? largest * 0x1p-20f : 0.0f) {
        int m = gather_at_least(p, n, cut, scratch), size = 0;
        qsort(scratch, m, sizeof(float), descending);
        double sum = 0.0;
        for (; size < m; size++) {
            sum += scratch[size];
            if (!((float)sum - scratch[size] < top_p)) break;
        }
        if (size < m || cut == 0.0f)  /* else the nucleus may reach below the cut */
            return m ? scratch[(size > 1 ? size : 1) - 1] : NAN;
    }
}

/* engine/sampling.py's `probabilities` for one row x[n] into p[n]: softmax(x / T) after top-k
 * (ties at the k-th kept), then the top-p nucleus (ties with its last kept), renormalised by an
 * fp64 running sum. A row's bits are its own, alone or in a batch; exp by vexp (relative error
 * ~2e-7 against torch's), so a token at the nucleus' very edge may go the other way. A row with a
 * NaN is NaN throughout. scratch: n floats. */
static void probabilities_row(const float *x, int n, float temperature, int top_k, float top_p, float *p,
                              float *scratch) {
    const int whole = n / LANES * LANES;
    int has_nan;
    int small_k = top_k > 0 && top_k < n && top_k <= PD_TOP_K_MAX;  /* then scratch holds the span maxima */
    float top = span_maxima(x, n, temperature, p, small_k ? scratch : NULL, &has_nan);
    if (has_nan) {
        for (int i = 0; i < n; i++) p[i] = NAN;
        return;
    }
    if (top_k > 0 && top_k < n) {  /* the k-th value: by spans for small k (torch's topk's case), else selection */
        float kth, best[PD_TOP_K_MAX];
        long ids[PD_TOP_K_MAX];
        if (small_k) {
            k_largest(p, n, top_k, scratch, best, ids);
            kth = best[top_k - 1];
        } else {
            memcpy(scratch, p, sizeof(float) * n);
            kth = kth_largest(scratch, n, top_k);
        }
        for (int i = 0; i < n; i++) p[i] = p[i] < kth ? -INFINITY : p[i];
    }
    vfloat sums = splat(0.0f);
    for (int i = 0; i < whole; i += LANES) {
        vfloat e = vexp(load_f32(p + i) - top);
        store_f32(p + i, e);
        sums += e;
    }
    float sum = hsum(sums);
    for (int i = whole; i < n; i++) sum += p[i] = expf(p[i] - top);
    for (int i = 0; i < whole; i += LANES) store_f32(p + i, load_f32(p + i) / sum);
    for (int i = whole; i < n; i++) p[i] /= sum;
    if (top_p >= 1.0f) return;
    float least = nucleus_threshold(p, n, 1.0f / sum, top_p, scratch);
    double kept = 0.0;  /* in index order over the kept tokens: adding the zeros would change no bit */
    for (int i = 0, m = gather_at_least(p, n, least, scratch); i < m; i++) kept += scratch[i];
    vfloat scale = splat((float)kept), floor = splat(least);
    for (int i = 0; i < whole; i += LANES) {
        vfloat v = load_f32(p + i);
        store_f32(p + i, select_lanes(v < floor, splat(0.0f), v / scale));
    }
    for (int i = whole; i < n; i++) p[i] = p[i] < least ? 0.0f : p[i] / (float)kept;
}

/* probabilities_row for each of x's rows [rows][n], rows split between threads; scratch: n floats a thread. */
void pd_probabilities(const float *x, int rows, int n, float temperature, int top_k, float top_p, float *p,
                      float *scratch, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int r = 0; r < rows; r++)
        probabilities_row(x + (size_t)r * n, n, temperature, top_k, top_p, p + (size_t)r * n,
                          scratch + (size_t)omp_get_thread_num() * n);
}

/* The sum of w[a, b): in vectors, one order for a row whatever its batch. */
static float span_sum(const float *w, int a, int b) {
    if (b - a == SPAN) {
        vfloat s = load_f32(w + a) + load_f32(w + a + LANES);
        for (int i = a + 2 * LANES; i < b; i += LANES) s += load_f32(w + i);
        return hsum(s);
    }
    float s = 0.0f;
    for (int i = a; i < b; i++) s += w[i];
    return s;
}

/* An inverse-CDF draw from w[n] (>= 0): the first index where the running sum exceeds u times the
 * total. Spans' sums first (vectors; fp64 between spans), then the running sum inside the span
 * where it crosses: ~2 passes of vector adds instead of a sequential fp64 sum over the whole
 * vocabulary (latency-bound: ~100 us a 49K row, twice). */
static long inverse_cdf_row(const float *w, int n, float u, float *spans) {
    int count = (n + SPAN - 1) / SPAN;
    double total = 0.0;
    for (int s = 0; s < count; s++) {
        spans[s] = span_sum(w, s * SPAN, s + 1 < count ? (s + 1) * SPAN : n);
        total += spans[s];
    }
    double target = (double)u * total, sum = 0.0;
    for (int s = 0; s < count; s++) {
        if (sum + spans[s] <= target && s + 1 < count) {
            sum += spans[s];
            continue;
        }
        for (int i = s * SPAN; i < n; i++)  /* past the span only if rounding put the crossing there */
            if ((sum += w[i]) > target && w[i] > 0.0f) return i;
        break;
    }
    for (int i = n - 1; i > 0; i--)  /* u * total at the very top (rounding): the last token with weight */
        if (w[i] > 0.0f) return i;
    return n - 1;  /* no weight at all (torch's inverse CDF clamps to the last index too) */
}

/* out[e] = inverse_cdf_row of row rows[e] of w [*][n] by u[e]. */
void pd_inverse_cdf(const float *w, int n, const long *rows, int num, const float *u, long *out) {
    float spans[(n + SPAN - 1) / SPAN];
    for (int e = 0; e < num; e++) out[e] = inverse_cdf_row(w + (size_t)rows[e] * n, n, u[e], spans);
}
