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
TARGET static void FN(attend_kv_head_generic)(const float *q, const float *kc, const float *vc, int64_t row, int64_t kvh,
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


#ifdef SIMD_TARGET
#include "simd_shuffle.h"

/* 256-bit bodies (the same in the AVX2 and AVX-512 variants, so both give the same bits) for D % 8 == 0. */

/* the 8 horizontal sums of a[0..7] as one vector: lane j = sum of a[j]'s lanes */
TARGET_INLINE __m256 FN(hsum8x8)(const __m256 *a) {
    const __m256 s01 = FN(hadd_ps)(a[0], a[1]), s23 = FN(hadd_ps)(a[2], a[3]);
    const __m256 s45 = FN(hadd_ps)(a[4], a[5]), s67 = FN(hadd_ps)(a[6], a[7]);
    const __m256 s0123 = FN(hadd_ps)(s01, s23), s4567 = FN(hadd_ps)(s45, s67);
    /* s0123 = {a0 lo, a1 lo, a2 lo, a3 lo | a0 hi, a1 hi, a2 hi, a3 hi}, likewise s4567 for a4..a7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

TARGET_INLINE float FN(hsum256_att)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x lane by lane for x <= 0, the polynomial of exp_nonpositive */
TARGET_INLINE __m256 FN(exp_nonpositive8)(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* The G query heads of KV head kvh over L = pos + 1 positions; s: G * L scratch. Scores: 8 positions at a time,
 * for every query head while those 8 key rows are in L1 (each a dot product of D / 8 FMAs, the 8 sums reduced
 * together); softmax with the vector exp; then out = sum_t p_t V[t], ATT_V_BLOCK value rows at a time for every
 * query head (the head's partial sums, 64 elements at a time, in registers within a block).
 * In parts, so that several threads can share one KV head with the same bits (attn_decode_team): scores of the
 * 8-position groups in [t0, t1) (multiples of 8 below L & ~7) and of the tail positions; the softmax of one query
 * head's row; the values for the output lanes [d0, d1) (multiples of 8: every lane sums over t in order). */
#define ATT_V_BLOCK 64
#define ATT_PF 16 /* positions prefetched ahead */
TARGET_INLINE void FN(att_scores)(const float *q, const float *kc, int64_t row, int64_t kvh, int64_t G, int64_t L,
                                  int64_t D, float scale, float *s, int64_t t0, int64_t t1) {
    const float *kbase = kc + kvh * D;
    const float *qh = q + kvh * G * D;
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t t = t0; t < t1; t += 8) {
        /* the key rows ATT_PF positions ahead: a head's rows are `row` floats apart, too sparse for the hardware
         * prefetcher to run ahead of this loop */
        for (int64_t u = t + ATT_PF; u < t + ATT_PF + 8 && u < L; u++)
            for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(kbase + u * row + d, 0, 3);
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qh + g * D;
            __m256 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qd = _mm256_loadu_ps(qg + d);
                for (int j = 0; j < 8; j++)
                    acc[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kbase + (t + j) * row + d), acc[j]);
            }
            _mm256_storeu_ps(s + g * L + t, _mm256_mul_ps(FN(hsum8x8)(acc), vscale));
        }
    }
}

TARGET_INLINE void FN(att_scores_tail)(const float *q, const float *kc, int64_t row, int64_t kvh, int64_t G,
                                       int64_t L, int64_t D, float scale, float *s) {
    const float *kbase = kc + kvh * D;
    const float *qh = q + kvh * G * D;
    for (int64_t t = L & ~(int64_t)7; t < L; t++) {
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qh + g * D;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(kbase + t * row + d), acc);
            s[g * L + t] = FN(hsum256_att)(acc) * scale;
        }
    }
}

/* sg (L scores of one query head) -> the softmax numerators in place; returns 1 / their sum */
TARGET_INLINE float FN(att_softmax)(float *sg, int64_t L) {
    int64_t t;
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (t = 0; t + 8 <= L; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sg + t));
    float m = -INFINITY;
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    for (int64_t u = t; u < L; u++) m = sg[u] > m ? sg[u] : m;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (t = 0; t + 8 <= L; t += 8) {
        const __m256 e = FN(exp_nonpositive8)(_mm256_sub_ps(_mm256_loadu_ps(sg + t), vm));
        _mm256_storeu_ps(sg + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = FN(hsum256_att)(vsum);
    for (; t < L; t++) {
        sg[t] = FN(exp_nonpositive)(sg[t] - m);
        sum += sg[t];
    }
    return 1.0f / sum;
}

/* nv * 8 output lanes (nv <= 8) at o over positions [t0, t1): called with a constant nv where it can be, which keeps
 * acc in registers (a variable count spilled it: ~1/3 of the attention time at 2048 positions) */
TARGET_INLINE void FN(att_values_block)(const float *vbase, int64_t row, const float *sg, int64_t t0, int64_t t1,
                                        float inv, int64_t L, float *o, const int nv) {
    __m256 acc[8];
    for (int j = 0; j < nv; j++) acc[j] = t0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o + 8 * j);
    for (int64_t u = t0; u < t1; u++) {
        const __m256 p = _mm256_broadcast_ss(sg + u);
        const float *vrow = vbase + u * row;
        if (u + ATT_PF < L)
            for (int d = 0; d < 8 * nv; d += 16) __builtin_prefetch(vrow + ATT_PF * row + d, 0, 3);
        for (int j = 0; j < nv; j++) acc[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vrow + 8 * j), acc[j]);
    }
    if (t1 == L) {
        const __m256 vinv = _mm256_set1_ps(inv);
        for (int j = 0; j < nv; j++) _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(acc[j], vinv));
    } else {
        for (int j = 0; j < nv; j++) _mm256_storeu_ps(o + 8 * j, acc[j]);
    }
}

/* out lanes [d0, d1) of the G heads of kvh = sum_t p_t V[t] * inv[g] */
TARGET_INLINE void FN(att_values)(const float *vc, int64_t row, int64_t kvh, int64_t G, int64_t L, int64_t D,
                                  const float *s, const float *inv, float *out, int64_t d_begin, int64_t d_end) {
    const float *vbase = vc + kvh * D;
    for (int64_t t0 = 0; t0 < L; t0 += ATT_V_BLOCK) {
        const int64_t t1 = t0 + ATT_V_BLOCK < L ? t0 + ATT_V_BLOCK : L;
        for (int64_t g = 0; g < G; g++) {
            const float *sg = s + g * L;
            float *o = out + (kvh * G + g) * D;
            for (int64_t d0 = d_begin; d0 < d_end; d0 += 64) {
                const int nv = (int)((d_end - d0 < 64 ? d_end - d0 : 64) / 8);
                if (nv == 8)
                    FN(att_values_block)(vbase + d0, row, sg, t0, t1, inv[g], L, o + d0, 8);
                else
                    FN(att_values_block)(vbase + d0, row, sg, t0, t1, inv[g], L, o + d0, nv);
            }
        }
    }
}

TARGET static void FN(attend_kv_head)(const float *q, const float *kc, const float *vc, int64_t row, int64_t kvh,
                                      int64_t G, int64_t L, int64_t D, float scale, float *s, float *out) {
    if (D % 8 != 0 || G > 64) {
        FN(attend_kv_head_generic)(q, kc, vc, row, kvh, G, L, D, scale, s, out);
        return;
    }
    FN(att_scores)(q, kc, row, kvh, G, L, D, scale, s, 0, L & ~(int64_t)7);
    FN(att_scores_tail)(q, kc, row, kvh, G, L, D, scale, s);
    float inv[64]; /* 1 / sum per query head; G <= 64 here, else the generic body above */
    for (int64_t g = 0; g < G; g++) inv[g] = FN(att_softmax)(s + g * L, L);
    FN(att_values)(vc, row, kvh, G, L, D, s, inv, out, 0, D);
}

/* Thread `me` of `all` in a team sharing every KV head (attn_decode_team): the parts of attend_kv_head split over
 * the team, with barriers between them; scores of KV head kvh at s + kvh * G * L, inv: H floats. The same bits
 * as attend_kv_head per head. Needs D % 8 == 0 and G <= 64. */
TARGET static void FN(attend_team)(const float *q, const float *kc, const float *vc, int64_t Hkv, int64_t G,
                                   int64_t L, int64_t D, float scale, float *s, float *inv, float *out, int64_t me,
                                   int64_t all) {
    const int64_t row = Hkv * D, n8 = L / 8, groups = Hkv * n8;
    for (int64_t i = groups * me / all, i1 = groups * (me + 1) / all; i < i1;) {
        const int64_t kvh = i / n8, g0 = i % n8, g1 = kvh == (i1 - 1) / n8 ? (i1 - 1) % n8 + 1 : n8;
        FN(att_scores)(q, kc, row, kvh, G, L, D, scale, s + kvh * G * L, 8 * g0, 8 * g1);
        i += g1 - g0;
    }
    for (int64_t kvh = me; kvh < Hkv; kvh += all) FN(att_scores_tail)(q, kc, row, kvh, G, L, D, scale, s + kvh * G * L);
#pragma omp barrier
    for (int64_t h = Hkv * G * me / all; h < Hkv * G * (me + 1) / all; h++) inv[h] = FN(att_softmax)(s + h * L, L);
#pragma omp barrier
    const int64_t chunk = D % 32 == 0 ? 32 : D, n_chunks = D / chunk, items = Hkv * n_chunks;
    for (int64_t i = items * me / all; i < items * (me + 1) / all; i++) {
        const int64_t kvh = i / n_chunks, d0 = (i % n_chunks) * chunk;
        FN(att_values)(vc, row, kvh, G, L, D, s + kvh * G * L, inv + kvh * G, out, d0, d0 + chunk);
    }
}
#else
#define attend_kv_head_scalar attend_kv_head_generic_scalar
#endif

#undef TARGET
#undef TARGET_INLINE
#undef FN
#undef SIMD_CAT
#undef SIMD_CAT_
