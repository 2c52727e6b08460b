/* e^x for x <= 0 in plain float arithmetic that vectorizes, for the SIMD bodies (attention_body.h, head_body.h):
 * included after the body has defined FN (its variant's suffix) and TARGET_INLINE. Cephes' polynomial, ~1e-7
 * relative. */

/* e^x for -87 <= x <= 0 */
TARGET_INLINE float FN(exp_core)(float x) {
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

/* e^x for x <= 0 (scores minus their maximum); below -87 the result is a tiny normal number instead of 0. fmaxf is a
 * libm call without -ffast-math, so a loop over it stays scalar (the attention's generic body relies on that: the
 * same sums in every variant); head_body.h clamps with a comparison and vectorizes. */
TARGET_INLINE float FN(exp_nonpositive)(float x) { return FN(exp_core)(fmaxf(x, -87.0f)); }
