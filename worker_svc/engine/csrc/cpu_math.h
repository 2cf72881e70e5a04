/* Float helpers shared by the CPU kernels of this directory (paged_decode.c, sample_rows.c). */
#ifndef MESHSERVE_CPU_MATH_H
#define MESHSERVE_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Element dtype codes (worker_svc/engine/native.py DTYPE_CODES). */
enum { DT_F32 = 0, DT_BF16 = 1 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* exp(x) as ATen's vectorized fexp_u20 computes it (see paged_decode.c for why the decode
 * kernel needs ATen's exact rounding); 0 below ln(FLT_MIN), +inf above ln(FLT_MAX). */
static inline float fexp_u20(float x) {
    const float c0 = 0.00010703434948458272f, c1 = 0.30354260500649682f;
    const float c2 = -0.22433836478672356f, c3 = -0.079204240219773236f;
    const float log2e = 1.44269502162933349609375f;  /* 0x3fb8aa3b */
    const float ln_min = -87.3365478515625f, ln_max = 88.7228393554687f;  /* 0xc2aeac50, 0x42b17218 */
    /* In-range inputs compute exactly as ATen does; the clamp only keeps the float->int
     * conversion defined for x = -inf or x < ln_min, whose result the select replaces. */
    const float xc = x < ln_min ? ln_min : x > ln_max ? ln_max : x;
    float src = xc * log2e;
    const float frac = src - floorf(src);
    float res = fmaf(frac, c3, c2);
    res = fmaf(frac, res, c1);
    res = fmaf(frac, res, c0);
    src = src - res;
    int32_t bits = (int32_t)fmaf(8388608.f, src, 1065353216.f); /* 2^23 * (src + 127), truncated */
    bits = x < ln_min ? 0 : bits;
    bits = x > ln_max ? 0x7f800000 : bits; /* selects, not branches: the 16-lane loop vectorizes */
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

#endif
