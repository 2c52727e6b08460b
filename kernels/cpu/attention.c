/* Decode attention: one new token of one sequence, Llama style (RoPE on adjacent pairs, grouped-query heads,
 * causal over positions 0..pos), in one call instead of a dozen tensor ops per layer.
 *
 * pi_attn_decode(q, k, v, rope, kc, vc, pos, H, Hkv, D, scale, out, threads):
 *   q (H * D), k and v (Hkv * D): the token's projections (float32; q and k are rotated here, in place);
 *   rope (D / 2 pairs of cos, sin): the rotation of each pair at position pos;
 *   kc, vc: this sequence's cache of this layer, (n_ctx, Hkv, D) float32 contiguous; k and v go to row pos;
 *   out (H * D): per head h, softmax(q_h . K[0..pos, h / G] * scale) . V[0..pos, h / G], G = H / Hkv.
 *
 * Per KV head, the G query heads that share it read each cached row once. Softmax subtracts the row maximum and
 * uses a polynomial exp (Cephes, ~1e-7 relative); the weighted sum of V is divided by the sum of weights at the
 * end. KV heads are split over threads; each output element is computed by one thread in a fixed order, so the
 * result does not depend on the thread count. attend_kv_head and rope_rotate are compiled for AVX-512, AVX2 and
 * baseline x86-64 (GCC target_clones picks one at load).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "common.h"

#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

/* e^x for x <= 0 (scores minus their maximum); below -87 the result is a tiny normal number instead of 0 */
static inline float exp_nonpositive(float x) {
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

/* x (D) rotated by the pairs of rope: (a, b) -> (a c - b s, a s + b c), as a complex product */
CLONES static void rope_rotate(float *x, const float *rope, int64_t D) {
    for (int64_t i = 0; i < D / 2; i++) {
        const float a = x[2 * i], b = x[2 * i + 1], c = rope[2 * i], s = rope[2 * i + 1];
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static inline float exp_shifted_sum(float *s, int64_t n, float shift) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - shift);
        sum += s[t];
    }
    return sum;
}

/* the G query heads of KV head kvh over L = pos + 1 positions; s: G * L scratch. One clone per ISA, with the
 * helpers above inlined into it (a clone is reached through an indirect call: none per row or element) */
CLONES static void attend_kv_head(const float *q, const float *kc, const float *vc, int64_t row, int64_t kvh, int64_t G,
                           int64_t L, int64_t D, float scale, float *s, float *out) {
    for (int64_t t = 0; t < L; t++) {
        const float *krow = kc + t * row + kvh * D;
        for (int64_t g = 0; g < G; g++) s[g * L + t] = dot(q + (kvh * G + g) * D, krow, D) * scale;
    }
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * L;
        float m = sg[0];
        for (int64_t t = 1; t < L; t++) m = sg[t] > m ? sg[t] : m;
        const float inv = 1.0f / exp_shifted_sum(sg, L, m);
        float *o = out + (kvh * G + g) * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t t = 0; t < L; t++) axpy(o, sg[t], vc + t * row + kvh * D, D);
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
}

PI_EXPORT int32_t pi_attn_decode(float *q, float *k, const float *v, const float *rope, float *kc, float *vc,
                                 int64_t pos, int64_t H, int64_t Hkv, int64_t D, float scale, float *out,
                                 int32_t n_threads) {
    if (pos < 0 || H <= 0 || Hkv <= 0 || H % Hkv != 0 || D <= 0 || D % 2 != 0) return PI_ERR_SHAPE;
    const int64_t G = H / Hkv, L = pos + 1, row = Hkv * D;
    for (int64_t h = 0; h < H; h++) rope_rotate(q + h * D, rope, D);
    for (int64_t h = 0; h < Hkv; h++) rope_rotate(k + h * D, rope, D);
    memcpy(kc + pos * row, k, (size_t)row * sizeof(float));
    memcpy(vc + pos * row, v, (size_t)row * sizeof(float));
    int32_t nt = threads_for_work(n_threads, 2 * H * L * D);
    if (nt > Hkv) nt = (int32_t)Hkv;
    float *scratch = malloc((size_t)nt * (size_t)(G * L) * sizeof(float));
    if (scratch == NULL) return PI_ERR_ALLOC;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
        float *s = scratch + me * G * L;
        for (int64_t kvh = Hkv * me / all; kvh < Hkv * (me + 1) / all; kvh++)
            attend_kv_head(q, kc, vc, row, kvh, G, L, D, scale, s, out);
    }
    free(scratch);
    return PI_OK;
}
