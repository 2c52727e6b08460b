/* SIMD body of the decode attention, compiled three times by attention.c: baseline x86-64 (SIMD_SUFFIX scalar, no
 * SIMD_TARGET), then AVX2 and AVX-512 through simd_variants.h. The loops are plain C with `omp simd`; each variant
 * is what the compiler makes of them for its target, with the helpers inlined (none is called per row or element).
 */

#define SIMD_CAT_(a, b) a##_##b
#define SIMD_CAT(a, b) SIMD_CAT_(a, b)
#define FN(name) SIMD_CAT(name, SIMD_SUFFIX)
#ifdef SIMD_TARGET
#define TARGET __attribute__((target(SIMD_TARGET)))
#define TARGET_INLINE static inline __attribute__((target(SIMD_TARGET), always_inline))
#else
#define TARGET
#define TARGET_INLINE static inline __attribute__((always_inline))
#endif

/* e^x for x <= 0 (scores minus their maximum); below -87 the result is a tiny normal number instead of 0 */
TARGET_INLINE float FN(exp_nonpositive)(float x) {
    x = fmaxf(x, -87.0f);
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick (|x / ln 2| < 2^22): plain arithmetic, so the loop vectorizes */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

TARGET_INLINE float FN(attn_dot)(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

TARGET_INLINE void FN(attn_axpy)(float *y, float a, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

TARGET_INLINE float FN(exp_shifted_sum)(float *s, int64_t n, float shift) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        s[t] = FN(exp_nonpositive)(s[t] - shift);
        sum += s[t];
    }
    return sum;
}

/* x (D) rotated by the pairs of rope: (a, b) -> (a c - b s, a s + b c), as a complex product */
TARGET static void FN(rope_rotate)(float *x, const float *rope, int64_t D) {
    for (int64_t i = 0; i < D / 2; i++) {
        const float a = x[2 * i], b = x[2 * i + 1], c = rope[2 * i], s = rope[2 * i + 1];
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

/* the G query heads of KV head kvh over L = pos + 1 positions; s: G * L scratch */
TARGET static void FN(attend_kv_head)(const float *q, const float *kc, const float *vc, int64_t row, int64_t kvh,
                                      int64_t G, int64_t L, int64_t D, float scale, float *s, float *out) {
    for (int64_t t = 0; t < L; t++) {
        const float *krow = kc + t * row + kvh * D;
        for (int64_t g = 0; g < G; g++) s[g * L + t] = FN(attn_dot)(q + (kvh * G + g) * D, krow, D) * scale;
    }
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * L;
        float m = sg[0];
        for (int64_t t = 1; t < L; t++) m = sg[t] > m ? sg[t] : m;
        const float inv = 1.0f / FN(exp_shifted_sum)(sg, L, m);
        float *o = out + (kvh * G + g) * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t t = 0; t < L; t++) FN(attn_axpy)(o, sg[t], vc + t * row + kvh * D, D);
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
}

#undef TARGET
#undef TARGET_INLINE
#undef FN
#undef SIMD_CAT
#undef SIMD_CAT_
