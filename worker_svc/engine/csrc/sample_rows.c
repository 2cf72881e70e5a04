/* Random sampling of one column per row of a logits matrix, for CPU: the softmax, the
 * floor and the inverse-CDF draw of worker_svc/engine/sampling.py in two passes over a row
 * (the torch ops take about ten passes over the whole [rows, vocab] matrix, each reading it
 * from memory: ~6 ms a step for 32 rows of a 32k vocabulary, ~0.5 ms here). Built with
 * paged_decode.c (same flags, see worker_svc/engine/native.py), called through ctypes from
 * the engine's compute thread; rows are spread over its OpenMP team (torch's own).
 *
 * Row b of logits [rows, cols] (row stride `stride` elements, float32 or bfloat16, columns
 * contiguous): with x = scale[b] * logits[b, c] and m the row's largest x, column c weighs
 * exp(x - m) if x >= m - floor[b], else 0 (a -inf logit weighs 0). The drawn column is the
 * first whose running weight exceeds u[b] * (the row's total weight): inverse CDF, as
 * torch.searchsorted(cumsum(w), u * sum(w), right=True). A row with no weight at all (every
 * logit -inf or NaN) gets the column of its first largest x, -1 if it has none.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

/* Weights are summed per block of BLOCK columns (vectorized), the draw then walks blocks and
 * one block's columns only: no sequential pass over the whole row. */
enum { BLOCK = 64 };

/* x = scale * logits into w; returns the largest x (-inf for an empty or all-NaN row). */
static float scaled_row(float *w, const void *p, int64_t n, int dt, float scale) {
    float mx = -INFINITY;
    if (dt == DT_BF16) {
        const uint16_t *s = (const uint16_t *)p;
#pragma omp simd reduction(max : mx)
        for (int64_t i = 0; i < n; i++) {
            w[i] = scale * bf16_to_f32(s[i]);
            mx = w[i] > mx ? w[i] : mx;
        }
    } else {
        const float *s = (const float *)p;
#pragma omp simd reduction(max : mx)
        for (int64_t i = 0; i < n; i++) {
            w[i] = scale * s[i];
            mx = w[i] > mx ? w[i] : mx;
        }
    }
    return mx;
}

/* w[i] <- exp(w[i] - mx) above the floor, 0 below (and for NaN); block sums into sums. */
static void weigh_row(float *w, int64_t n, float mx, float floor_, double *sums) {
    const float lo = mx - floor_;
    for (int64_t b0 = 0, k = 0; b0 < n; b0 += BLOCK, k++) {
        const int64_t b1 = b0 + BLOCK < n ? b0 + BLOCK : n;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = b0; i < b1; i++) {
            const float e = fexp_u20(w[i] - mx);
            w[i] = w[i] >= lo ? e : 0.f;
            s += w[i];
        }
        sums[k] = s;
    }
}

/* The column of the first running weight above u * total (the last weighted column when
 * rounding leaves none above it); -1 when the row has no weight. */
static int64_t draw_row(const float *w, int64_t n, const double *sums, double u) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    double total = 0.0;
    for (int64_t k = 0; k < blocks; k++) total += sums[k];
    if (!(total > 0.0)) return -1;
    double target = u * total, run = 0.0;
    int64_t last = -1;
    for (int64_t k = 0; k < blocks; k++) {
        if (sums[k] > 0.0) last = k;
        if (run + sums[k] <= target) {
            run += sums[k];
            continue;
        }
        const int64_t b1 = (k + 1) * BLOCK < n ? (k + 1) * BLOCK : n;
        for (int64_t i = k * BLOCK; i < b1; i++) {
            run += w[i];
            if (run > target && w[i] > 0.f) return i;
        }
        last = k;  /* the block's float sum exceeded its column-by-column double sum */
        break;
    }
    const int64_t b1 = (last + 1) * BLOCK < n ? (last + 1) * BLOCK : n;
    for (int64_t i = b1 - 1; i >= last * BLOCK; i--)
        if (w[i] > 0.f) return i;
    return -1;
}

static int64_t first_max(const void *p, int64_t n, int dt) {
    int64_t best = -1;
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        const float x = dt == DT_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
        if (x > mx || (best < 0 && x == mx)) {
            mx = x;
            best = i;
        }
    }
    return best;
}

/* Entry point: out[b] for b in [0, rows) as the header says. Returns 0, or -1 when the
 * per-thread buffers cannot be allocated (out is then unwritten). */
int meshserve_sample_rows(const void *logits, int dt, int64_t rows, int64_t cols, int64_t stride,
                          const float *scale, const float *floor_, const float *u, int64_t *out) {
    const int64_t esz = dt == DT_BF16 ? 2 : 4;
    const int64_t blocks = (cols + BLOCK - 1) / BLOCK;
    int failed = 0;
#pragma omp parallel if (rows > 1)
    {
        float *w = malloc((size_t)cols * sizeof(float));
        double *sums = malloc((size_t)blocks * sizeof(double));
        if (!w || !sums) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < rows; b++) {
            if (!w || !sums) continue;
            const char *row = (const char *)logits + b * stride * esz;
            const float mx = scaled_row(w, row, cols, dt, scale[b]);
            if (!(mx > -INFINITY && mx < INFINITY)) { /* no finite logit to weigh against */
                out[b] = first_max(row, cols, dt);
                continue;
            }
            weigh_row(w, cols, mx, floor_[b], sums);
            const int64_t i = draw_row(w, cols, sums, (double)u[b]);
            out[b] = i >= 0 ? i : first_max(row, cols, dt);
        }
        free(w);
        free(sums);
    }
    return failed ? -1 : 0;
}
