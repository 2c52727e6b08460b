/* SIMD body of the sparse head's probability check (head.c), compiled three times like attention_body.h: baseline
 * x86-64 (SIMD_SUFFIX scalar), then AVX2 and AVX-512 through simd_variants.h. Plain C loops with `omp simd`; each
 * variant is what the compiler makes of them for its target. */

#include "simd_fn.h"

#include "exp_body.h"

/* the largest of s[0..n) (-inf for none; NaN is passed over) */
TARGET static float FN(head_max)(const float *s, int64_t n) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
    return m;
}

/* sum of e^(s_i - shift) over s[0..n), every s_i <= shift (vectorized: the order of the sum is the variant's) */
TARGET static float FN(head_exp_sum)(const float *s, int64_t n, float shift) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) {
        const float x = s[i] - shift;
        sum += FN(exp_core)(x < -87.0f ? -87.0f : x); /* below -87: a tiny normal number, as exp_nonpositive */
    }
    return sum;
}

#include "simd_fn_end.h"
