/* Paged decode attention for CPU: one query token per sequence, keys/values read in
 * place from the paged KV cache through the block table (no gather copy, no padding to
 * the longest sequence). Built and loaded by worker_svc/engine/cpu_attention.py with
 * `cc -O3 -march=native` plus the flags listed there (not -ffast-math: see
 * cpu_attention._FLAGS) and `-fopenmp -shared`; called through ctypes with raw pointers from
 * the engine's compute thread. Its sequences are spread over that thread's OpenMP team:
 * PyTorch's own (the same libgomp.so.1 once torch is loaded), so the kernel uses the threads
 * the forward does, and each sequence is computed as by one thread alone (same result).
 *
 * Layout: cache [2, num_blocks, block_size, Hkv, D] contiguous (0 = K, 1 = V); q and out
 * [T, H, D] with d contiguous and the given token/head strides (elements). Query head h
 * reads KV head h / (H / Hkv) (GQA). Math in float32 (online softmax per block), the
 * output is rounded to the cache dtype: like SDPA's CPU kernels for bf16. Scores are
 * finite (masking is by length, never by -inf).
 *
 * Per-layer attention (see worker_svc/engine/attention.py): window > 0 reads only the
 * last `window` tokens (a query at position p sees keys p - window < k <= p, the sliding
 * mask of transformers); softcap > 0 caps every scaled score to softcap * tanh(s / softcap);
 * sinks (NULL = none) adds one logit per query head to the softmax denominator only
 * (gpt-oss attention sinks). 0 / 0 / NULL is plain causal attention.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                     /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* Converts n elements at p (dtype dt) to float32 in dst. */
static inline void load_row(float *dst, const void *p, int64_t n, int dt) {
    if (dt == DT_BF16) {
        const uint16_t *s = (const uint16_t *)p;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, p, (size_t)n * sizeof(float));
    }
}

static inline void store_row(void *p, const float *src, int64_t n, int dt) {
    if (dt == DT_BF16) {
        uint16_t *d = (uint16_t *)p;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy(p, src, (size_t)n * sizeof(float));
    }
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
}

/* Tokens per online-softmax update: SDPA's CPU flash kernel splits keys by 512 too, so
 * up to 512 cached tokens the softmax is over one block with the global max. */
enum { CHUNK = 512 };

/* Largest head size of the exact bf16 path (stack buffers); larger heads use decode_seq. */
enum { EXACT_MAX_D = 256 };


/* ---- bf16, plain causal layers: bit-identical to PyTorch's CPU flash attention ----------
 * transformers' sdpa attention at a decode step calls SDPA with one query over exactly the
 * sequence's keys; on CPU (torch 2.13, bf16) that is the flash kernel
 * (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp). Its rounding, reproduced step by step
 * below and checked against it for head sizes 32/64/128 and 1..512 keys
 * (tests/worker_engine/test_cpu_attention_exact.py), is:
 *  - q.k: oneDNN's bf16 gemv; products are exact in float32, summed in 4 lanes (d mod 4)
 *    in order, then (l0 + l2) + (l1 + l3); times the scale;
 *  - exp(s - max): the first 16 * floor(n / 16) keys through ATen's fexp_u20 (a degree-3
 *    polynomial, exp(0) = 0.99994659), the rest through expf;
 *  - the sum: 16 lanes (key mod 16) in order, folded i+8, i+4, i+2, i+1, then the tail keys;
 *  - the weights rounded to bf16 (the sum is not); P.V: oneDNN's gemv again, keys in groups
 *    of 4 summed (w0v0 + w2v2) + (w1v1 + w3v3) and added group by group, then the keys past
 *    the last full group one by one from the last; times 1 / sum; rounded to bf16.
 * Keys are split into blocks of 512 like the flash kernel (online softmax between blocks).
 * The file is built with -ffp-contract=off and without reassociation flags: every float
 * operation here happens as written (fmaf where the kernel fuses). */

/* Scores of n keys starting at position start: s[h][t] = (q_h . k_t) * scale, 4-lane order. */
static inline __attribute__((always_inline)) void exact_scores(const float (*qf)[EXACT_MAX_D], const char *kc,
                                                               const int64_t *slot, int64_t n, int64_t G,
                                                               int64_t Hkv, int64_t D, float scale,
                                                               float (*s)[CHUNK], float *kv) {
    /* Four keys at a time: 16 independent accumulators (key x lane) fill one vector register
     * instead of one 4-lane chain per key; each accumulator's order is unchanged. */
    int64_t t = 0;
    for (; t + 4 <= n; t += 4)
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            for (int64_t k = 0; k < 4; k++) load_row(kv + k * EXACT_MAX_D, kc + (slot[t + k] + kvh * D) * 2, D, DT_BF16);
            for (int64_t g = 0; g < G; g++) {
                const float *qh = qf[kvh * G + g];
                float a[4][4] = {{0.f}};
                for (int64_t d = 0; d < D; d += 4)
                    for (int64_t k = 0; k < 4; k++)
                        for (int64_t l = 0; l < 4; l++) a[k][l] = a[k][l] + qh[d + l] * kv[k * EXACT_MAX_D + d + l];
                for (int64_t k = 0; k < 4; k++)
                    s[kvh * G + g][t + k] = ((a[k][0] + a[k][2]) + (a[k][1] + a[k][3])) * scale;
            }
        }
    for (; t < n; t++)
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            load_row(kv, kc + (slot[t] + kvh * D) * 2, D, DT_BF16);
            for (int64_t g = 0; g < G; g++) {
                const float *qh = qf[kvh * G + g];
                float a[4] = {0.f, 0.f, 0.f, 0.f};
                for (int64_t d = 0; d < D; d += 4)
                    for (int64_t l = 0; l < 4; l++) a[l] = a[l] + qh[d + l] * kv[d + l];
                s[kvh * G + g][t] = ((a[0] + a[2]) + (a[1] + a[3])) * scale;
            }
        }
}

/* One head's block: weights (bf16-rounded, in place) and the float32 sum of the exps. */
static inline float exact_softmax_block(float *s, int64_t n, float mx) {
    const int64_t body = n / 16 * 16;
    float lanes[16] = {0.f};
    for (int64_t t = 0; t < body; t += 16)
        for (int64_t l = 0; l < 16; l++) {
            const float e = fexp_u20(s[t + l] - mx);
            lanes[l] = lanes[l] + e;
            s[t + l] = e;
        }
    for (int64_t h = 8; h >= 1; h /= 2)
        for (int64_t l = 0; l < h; l++) lanes[l] = lanes[l] + lanes[l + h];
    float sum = lanes[0];
    for (int64_t t = body; t < n; t++) {
        s[t] = expf(s[t] - mx);
        sum = sum + s[t];
    }
    for (int64_t t = 0; t < n; t++) s[t] = bf16_to_f32(f32_to_bf16(s[t]));
    return sum;
}

/* acc[d] += sum over the block's keys of w_t * v_t[d] for one head, in oneDNN's gemv order. */
static inline __attribute__((always_inline)) void exact_pv_block(const float *w, const char *vc, const int64_t *slot,
                                                                 int64_t n, int64_t kvh, int64_t D, float *acc,
                                                                 float (*vrow)[EXACT_MAX_D]) {
    const int64_t groups = n / 4 * 4;
    for (int64_t t = 0; t < groups; t += 4) {
        for (int64_t i = 0; i < 4; i++) load_row(vrow[i], vc + (slot[t + i] + kvh * D) * 2, D, DT_BF16);
        for (int64_t d = 0; d < D; d++) {
            const float g = (w[t] * vrow[0][d] + w[t + 2] * vrow[2][d]) + (w[t + 1] * vrow[1][d] + w[t + 3] * vrow[3][d]);
            acc[d] = acc[d] + g;
        }
    }
    for (int64_t t = n - 1; t >= groups; t--) {
        load_row(vrow[0], vc + (slot[t] + kvh * D) * 2, D, DT_BF16);
        for (int64_t d = 0; d < D; d++) acc[d] = acc[d] + w[t] * vrow[0][d];
    }
}

/* One sequence, all heads: for every cached token the K (then V) row of all KV heads is
 * read once, in memory order (a cache block is contiguous), which keeps hardware
 * prefetching effective when the cache is cold. Always inlined into the instances below,
 * so head size D and group size G are compile-time constants there (fully vectorized
 * d loops, no remainder loops). */
static inline __attribute__((always_inline)) void decode_seq(const char *q, int64_t q_sh, const char *kc,
                                                             const char *vc, const int32_t *table,
                                                             int32_t seq_len, char *out, int64_t o_sh,
                                                             int64_t G, int64_t Hkv, int64_t D, int64_t bs,
                                                             float scale, int dt, int64_t esz,
                                                             float (*s)[CHUNK], int64_t *slot, int64_t window,
                                                             float softcap, const float *sinks) {
    const int64_t H = G * Hkv, row = Hkv * D; /* row: elements per token slot */
    float qf[H][D], acc[H][D], m[H], l[H], kv[D];
    for (int64_t h = 0; h < H; h++) {
        load_row(qf[h], q + h * q_sh * esz, D, dt);
        for (int64_t d = 0; d < D; d++) acc[h][d] = 0.f;
        m[h] = -FLT_MAX; /* finite start: expf(m - mx) is then 0, never NaN */
        l[h] = 0.f;
    }
    /* A sliding window starts the walk at its first key: earlier blocks are never read. */
    const int64_t first = window > 0 && seq_len > window ? seq_len - window : 0;
    for (int64_t start = first; start < seq_len; start += CHUNK) {
        const int64_t n = seq_len - start < CHUNK ? seq_len - start : CHUNK;
        for (int64_t t = 0; t < n; t++) {
            const int64_t p = start + t;
            slot[t] = ((int64_t)table[p / bs] * bs + p % bs) * row;
        }
        for (int64_t t = 0; t < n; t++)
            for (int64_t kvh = 0; kvh < Hkv; kvh++) {
                load_row(kv, kc + (slot[t] + kvh * D) * esz, D, dt);
                for (int64_t g = 0; g < G; g++) s[kvh * G + g][t] = dot(qf[kvh * G + g], kv, D) * scale;
            }
        if (softcap > 0.f)
            for (int64_t h = 0; h < H; h++)
                for (int64_t t = 0; t < n; t++) s[h][t] = softcap * tanhf(s[h][t] / softcap);
        for (int64_t h = 0; h < H; h++) {
            float mx = m[h];
            for (int64_t t = 0; t < n; t++) mx = s[h][t] > mx ? s[h][t] : mx;
            const float corr = expf(m[h] - mx);
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                s[h][t] = expf(s[h][t] - mx);
                sum += s[h][t];
            }
            l[h] = l[h] * corr + sum;
            m[h] = mx;
            for (int64_t d = 0; d < D; d++) acc[h][d] *= corr;
            /* Like SDPA for bf16: the weights multiplying V are rounded to bf16 (the sum is not). */
            if (dt == DT_BF16)
                for (int64_t t = 0; t < n; t++) s[h][t] = bf16_to_f32(f32_to_bf16(s[h][t]));
        }
        for (int64_t t = 0; t < n; t++)
            for (int64_t kvh = 0; kvh < Hkv; kvh++) {
                load_row(kv, vc + (slot[t] + kvh * D) * esz, D, dt);
                for (int64_t g = 0; g < G; g++) {
                    const float p = s[kvh * G + g][t];
                    float *a = acc[kvh * G + g];
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) a[d] = fmaf(p, kv[d], a[d]);
                }
            }
    }
    for (int64_t h = 0; h < H; h++) {
        if (sinks) { /* the sink's probability mass goes nowhere: denominator only */
            const float mx = sinks[h] > m[h] ? sinks[h] : m[h];
            const float corr = expf(m[h] - mx);
            l[h] = l[h] * corr + expf(sinks[h] - mx);
            for (int64_t d = 0; d < D; d++) acc[h][d] *= corr;
        }
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        for (int64_t d = 0; d < D; d++) acc[h][d] *= inv;
        store_row(out + h * o_sh * esz, acc[h], D, dt);
    }
}

/* Instances with compile-time head size N and group size GG (query heads per KV head). */
#define DECODE_DG(N, GG)                                                                                   \
    static void decode_d##N##_g##GG(const char *q, int64_t q_sh, const char *kc, const char *vc,          \
                                    const int32_t *table, int32_t seq_len, char *out, int64_t o_sh,       \
                                    int64_t Hkv, int64_t bs, float scale, int dt, int64_t esz,            \
                                    float (*s)[CHUNK], int64_t *slot, int64_t window, float softcap,      \
                                    const float *sinks) {                                                 \
        decode_seq(q, q_sh, kc, vc, table, seq_len, out, o_sh, GG, Hkv, N, bs, scale, dt, esz, s, slot,  \
                   window, softcap, sinks);                                                               \
    }
#define DECODE_D(N) DECODE_DG(N, 1) DECODE_DG(N, 2) DECODE_DG(N, 4) DECODE_DG(N, 8)
DECODE_D(32)
DECODE_D(64)
DECODE_D(128)


/* One sequence, all heads, bf16 plain causal attention with the flash kernel's rounding. */
static inline __attribute__((always_inline)) void decode_seq_exact(const char *q, int64_t q_sh, const char *kc,
                                                                   const char *vc, const int32_t *table,
                                                                   int32_t seq_len, char *out, int64_t o_sh,
                                                                   int64_t G, int64_t Hkv, int64_t D, int64_t bs,
                                                                   float scale, float (*s)[CHUNK], int64_t *slot) {
    const int64_t H = G * Hkv, row = Hkv * D;
    float qf[H][EXACT_MAX_D], dst[H][EXACT_MAX_D], m[H], l[H];
    float kv[4 * EXACT_MAX_D], vrow[4][EXACT_MAX_D];
    for (int64_t h = 0; h < H; h++) {
        load_row(qf[h], q + h * q_sh * 2, D, DT_BF16);
        m[h] = -INFINITY;
        l[h] = 0.f;
    }
    for (int64_t start = 0; start < seq_len; start += CHUNK) {
        const int64_t n = seq_len - start < CHUNK ? seq_len - start : CHUNK;
        for (int64_t t = 0; t < n; t++) {
            const int64_t p = start + t;
            slot[t] = ((int64_t)table[p / bs] * bs + p % bs) * row;
        }
        exact_scores((const float (*)[EXACT_MAX_D])qf, kc, slot, n, G, Hkv, D, scale, s, kv);
        for (int64_t h = 0; h < H; h++) {
            float bm = -INFINITY;
            for (int64_t t = 0; t < n; t++) bm = s[h][t] > bm ? s[h][t] : bm;
            const float mx = m[h] > bm ? m[h] : bm;
            const float sum = exact_softmax_block(s[h], n, mx);
            const float corr = expf(m[h] - mx); /* 0 for the first block (m = -inf) */
            l[h] = sum + corr * l[h];
            m[h] = mx;
            /* The first block's gemv starts from 0 (beta 0); later ones accumulate onto the
             * rescaled output (beta 1). */
            for (int64_t d = 0; d < D; d++) dst[h][d] = start == 0 ? 0.f : dst[h][d] * corr;
            exact_pv_block(s[h], vc, slot, n, h / G, D, dst[h], vrow);
        }
    }
    for (int64_t h = 0; h < H; h++) {
        const float inv = 1.f / l[h];
        for (int64_t d = 0; d < D; d++) dst[h][d] = dst[h][d] * inv;
        store_row(out + h * o_sh * 2, dst[h], D, DT_BF16);
    }
}

/* Instances with compile-time head size and group size (see DECODE_DG below). */
#define EXACT_DG(N, GG)                                                                                    \
    static void exact_d##N##_g##GG(const char *q, int64_t q_sh, const char *kc, const char *vc,           \
                                   const int32_t *table, int32_t seq_len, char *out, int64_t o_sh,        \
                                   int64_t Hkv, int64_t bs, float scale, float (*s)[CHUNK], int64_t *slot) { \
        decode_seq_exact(q, q_sh, kc, vc, table, seq_len, out, o_sh, GG, Hkv, N, bs, scale, s, slot);     \
    }
#define EXACT_D(N) EXACT_DG(N, 1) EXACT_DG(N, 2) EXACT_DG(N, 4) EXACT_DG(N, 8)
EXACT_D(32)
EXACT_D(64)
EXACT_D(128)

typedef void (*exact_fn)(const char *, int64_t, const char *, const char *, const int32_t *, int32_t, char *,
                         int64_t, int64_t, int64_t, float, float (*)[CHUNK], int64_t *);

/* In a picker of (D, G): return the instance PREFIX_d<D>_g<G> when it is one of those compiled
 * above (DECODE_D, EXACT_D: head sizes 32, 64, 128; group sizes 1, 2, 4, 8). */
#define PICK_D(PREFIX, N)                                                                                  \
    if (D == N)                                                                                            \
        return G == 1 ? PREFIX##_d##N##_g1 : G == 2 ? PREFIX##_d##N##_g2                                   \
             : G == 4 ? PREFIX##_d##N##_g4 : G == 8 ? PREFIX##_d##N##_g8 : NULL;
#define PICK_INSTANCE(PREFIX) PICK_D(PREFIX, 32) PICK_D(PREFIX, 64) PICK_D(PREFIX, 128)

static exact_fn pick_exact(int64_t D, int64_t G) {
    PICK_INSTANCE(exact)
    return NULL;
}

typedef void (*decode_fn)(const char *, int64_t, const char *, const char *, const int32_t *, int32_t, char *,
                          int64_t, int64_t, int64_t, float, int, int64_t, float (*)[CHUNK], int64_t *, int64_t,
                          float, const float *);

/* The specialized instance for (D, G), or NULL (then the generic decode_seq runs). */
static decode_fn pick(int64_t D, int64_t G) {
    PICK_INSTANCE(decode)
    return NULL;
}

/* Entry point: decode rows[b] of q for b in [0, B) into the same rows of out.
 * Returns 0, or -1 when the score buffer cannot be allocated (out is then unwritten). */
int meshserve_paged_decode(const void *q, int64_t q_st, int64_t q_sh, const void *cache, int64_t num_blocks,
                            const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                            const int64_t *rows, void *out, int64_t o_st, int64_t o_sh, int64_t B, int64_t H,
                            int64_t Hkv, int64_t D, int64_t bs, float scale, int dt, int64_t window,
                            float softcap, const float *sinks) {
    const int64_t esz = dt == DT_BF16 ? 2 : 4;
    const char *kc = (const char *)cache;
    const char *vc = kc + num_blocks * bs * Hkv * D * esz;
    const int64_t G = H / Hkv;
    const decode_fn fn = pick(D, G);
    /* Scores of one chunk for every head, and the chunk's slots, per thread: heap, too big for a stack. */
    const int64_t threads = B > 1 ? omp_get_max_threads() : 1;
    float(*scores)[CHUNK] = malloc((size_t)threads * H * CHUNK * sizeof(float));
    int64_t *slots = malloc((size_t)threads * CHUNK * sizeof(int64_t));
    if (!scores || !slots) {
        free(scores);
        free(slots);
        return -1;
    }
    /* bf16 plain causal layers take the flash kernel's exact rounding (see decode_seq_exact). */
    const int exact = dt == DT_BF16 && window == 0 && softcap == 0.f && !sinks && D % 4 == 0 && D <= EXACT_MAX_D;
    const exact_fn efn = exact ? pick_exact(D, G) : NULL;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < B; b++) {
        float(*s)[CHUNK] = scores + (int64_t)omp_get_thread_num() * H;
        int64_t *slot = slots + (int64_t)omp_get_thread_num() * CHUNK;
        const char *qb = (const char *)q + rows[b] * q_st * esz;
        char *ob = (char *)out + rows[b] * o_st * esz;
        const int32_t *table = block_tables + b * max_blocks;
        if (efn)
            efn(qb, q_sh, kc, vc, table, seq_lens[b], ob, o_sh, Hkv, bs, scale, s, slot);
        else if (exact)
            decode_seq_exact(qb, q_sh, kc, vc, table, seq_lens[b], ob, o_sh, G, Hkv, D, bs, scale, s, slot);
        else if (fn)
            fn(qb, q_sh, kc, vc, table, seq_lens[b], ob, o_sh, Hkv, bs, scale, dt, esz, s, slot, window, softcap,
               sinks);
        else
            decode_seq(qb, q_sh, kc, vc, table, seq_lens[b], ob, o_sh, G, Hkv, D, bs, scale, dt, esz, s, slot,
                       window, softcap, sinks);
    }
    free(scores);
    free(slots);
    return 0;
}
