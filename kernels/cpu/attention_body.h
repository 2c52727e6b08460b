/* SIMD body of the decode attention, compiled three times by attention.c: baseline x86-64 (SIMD_SUFFIX scalar, no
 * SIMD_TARGET), then AVX2 and AVX-512 through simd_variants.h. The loops are plain C with `omp simd`; each variant
 * is what the compiler makes of them for its target, with the helpers inlined (none is called per row or element).
 */

#include "simd_fn.h"

#include "exp_body.h"

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

/* ---- typed rows: f16, bf16, q8_0 and q4_0 caches decoded a tile at a time ------------------------------------------
 * Every element decodes as the reference dequantiser gives it (an exact conversion, or one product q * d), the
 * SIMD variants with the same operations lane by lane: a typed cache attends with the bits an f32 cache holding
 * its decoded values gives. Tiles live on the stack (a few rows, in L1); no copy of the cache is made. */

/* n elements of an f16 / bf16 row */
TARGET_INLINE void FN(kv_f16)(const uint8_t *src, int64_t n, float *dst) {
    int64_t i = 0;
#ifdef SIMD_TARGET
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
#endif
    for (; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, sizeof h);
        dst[i] = fp16_to_fp32(h);
    }
}

TARGET_INLINE void FN(kv_bf16)(const uint8_t *src, int64_t n, float *dst) {
    int64_t i = 0;
#ifdef SIMD_TARGET
    for (; i + 8 <= n; i += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 2 * i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
#endif
    for (; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, sizeof h);
        dst[i] = bf16_to_fp32(h);
    }
}

/* nb whole blocks: q8_0 x = q * d; q4_0 x = (nibble - 8) * d, element j < 16 the low nibble of qs[j] */
TARGET_INLINE void FN(kv_q8_0)(const uint8_t *src, int64_t nb, float *dst) {
    for (int64_t b = 0; b < nb; b++, dst += QK) {
        const block_q8_0 *blk = (const block_q8_0 *)src + b;
        const float d = fp16_to_fp32(blk->d);
#ifdef SIMD_TARGET
        const __m256 vd = _mm256_set1_ps(d);
        for (int j = 0; j < QK; j += 8) {
            const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk->qs + j)));
            _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_cvtepi32_ps(w), vd));
        }
#else
        for (int j = 0; j < QK; j++) dst[j] = (float)blk->qs[j] * d;
#endif
    }
}

TARGET_INLINE void FN(kv_q4_0)(const uint8_t *src, int64_t nb, float *dst) {
    for (int64_t b = 0; b < nb; b++, dst += QK) {
        const block_q4_0 *blk = (const block_q4_0 *)src + b;
        const float d = fp16_to_fp32(blk->d);
#ifdef SIMD_TARGET
        const __m256 vd = _mm256_set1_ps(d);
        const __m128i raw = _mm_loadu_si128((const __m128i *)blk->qs), low = _mm_set1_epi8(0x0F);
        const __m128i halves[2] = {_mm_and_si128(raw, low), _mm_and_si128(_mm_srli_epi16(raw, 4), low)};
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 2; j++) {
                const __m128i bytes = j ? _mm_srli_si128(halves[h], 8) : halves[h];
                const __m256i w = _mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), _mm256_set1_epi32(8));
                _mm256_storeu_ps(dst + 16 * h + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(w), vd));
            }
#else
        for (int j = 0; j < QK / 2; j++) {
            dst[j] = (float)((blk->qs[j] & 0x0F) - 8) * d;
            dst[j + QK / 2] = (float)((blk->qs[j] >> 4) - 8) * d;
        }
#endif
    }
}

#define ATT_PF 16 /* positions prefetched ahead */

/* rows [t0, t1) of head kvh, lanes [d0, d1) (multiples of 32 for the block types), as floats: row t at
 * tile + (t - t0) * (d1 - d0) */
TARGET_INLINE void FN(kv_tile)(const kv_rows *c, int64_t kvh, int64_t t0, int64_t t1, int64_t d0, int64_t d1,
                               float *tile) {
    const int64_t W = d1 - d0;
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *src = c->data + t * c->row_bytes + kvh * c->head_bytes;
        float *dst = tile + (t - t0) * W;
        /* the head's bytes ATT_PF rows on (a prefetch never faults, past the cache's end too) */
        for (int64_t b = 0; b < c->head_bytes; b += 64) __builtin_prefetch(src + ATT_PF * c->row_bytes + b, 0, 3);
        switch (c->type) {
            case PI_TYPE_F16: FN(kv_f16)(src + 2 * d0, W, dst); break;
            case PI_TYPE_BF16: FN(kv_bf16)(src + 2 * d0, W, dst); break;
            case PI_TYPE_Q8_0: FN(kv_q8_0)(src + d0 / QK * (int64_t)sizeof(block_q8_0), W / QK, dst); break;
            case PI_TYPE_Q4_0: FN(kv_q4_0)(src + d0 / QK * (int64_t)sizeof(block_q4_0), W / QK, dst); break;
            default: memcpy(dst, (const float *)src + d0, (size_t)W * sizeof(float)); break;
        }
    }
}

/* row t of head kvh as D floats: the cache's own (f32) or decoded into tmp (PI_KV_MAX_D floats) */
TARGET_INLINE const float *FN(kv_row)(const kv_rows *c, int64_t t, int64_t kvh, int64_t D, float *tmp) {
    if (c->type == PI_TYPE_F32) return (const float *)(c->data + t * c->row_bytes + kvh * c->head_bytes);
    FN(kv_tile)(c, kvh, t, t + 1, 0, D, tmp);
    return tmp;
}

/* the G query heads of KV head kvh over L = pos + 1 positions; s: G * L scratch */
TARGET static void FN(attend_kv_head_generic)(const float *q, const kv_rows *kc, const kv_rows *vc, int64_t kvh,
                                              int64_t G, int64_t L, int64_t D, float scale, float *s, float *out) {
    float tmp[PI_KV_MAX_D];
    for (int64_t t = 0; t < L; t++) {
        const float *krow = FN(kv_row)(kc, t, kvh, D, tmp);
        for (int64_t g = 0; g < G; g++) s[g * L + t] = FN(attn_dot)(q + (kvh * G + g) * D, krow, D) * scale;
    }
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * L;
        float m = sg[0];
        for (int64_t t = 1; t < L; t++) m = sg[t] > m ? sg[t] : m;
        const float inv = 1.0f / FN(exp_shifted_sum)(sg, L, m);
        float *o = out + (kvh * G + g) * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t t = 0; t < L; t++) FN(attn_axpy)(o, sg[t], FN(kv_row)(vc, t, kvh, D, tmp), D);
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

/* the scores of the 8 key rows at k0, k0 + row, ... (positions t..t+7) for every query head */
TARGET_INLINE void FN(att_scores8)(const float *qh, const float *k0, int64_t row, int64_t G, int64_t L, int64_t D,
                                   float scale, float *s, int64_t t) {
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t g = 0; g < G; g++) {
        const float *qg = qh + g * D;
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 qd = _mm256_loadu_ps(qg + d);
            for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + j * row + d), acc[j]);
        }
        _mm256_storeu_ps(s + g * L + t, _mm256_mul_ps(FN(hsum8x8)(acc), vscale));
    }
}

TARGET_INLINE void FN(att_scores)(const float *q, const kv_rows *c, int64_t kvh, int64_t G, int64_t L, int64_t D,
                                  float scale, float *s, int64_t t0, int64_t t1) {
    const float *qh = q + kvh * G * D;
    if (c->type != PI_TYPE_F32) {
        float tile[8 * PI_KV_MAX_D];
        for (int64_t t = t0; t < t1; t += 8) {
            FN(kv_tile)(c, kvh, t, t + 8, 0, D, tile);
            FN(att_scores8)(qh, tile, D, G, L, D, scale, s, t);
        }
        return;
    }
    const int64_t row = c->row_bytes / (int64_t)sizeof(float);
    const float *kbase = (const float *)c->data + kvh * D;
    for (int64_t t = t0; t < t1; t += 8) {
        /* the key rows ATT_PF positions ahead: a head's rows are `row` floats apart, too sparse for the hardware
         * prefetcher to run ahead of this loop */
        for (int64_t u = t + ATT_PF; u < t + ATT_PF + 8 && u < L; u++)
            for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(kbase + u * row + d, 0, 3);
        FN(att_scores8)(qh, kbase + t * row, row, G, L, D, scale, s, t);
    }
}

TARGET_INLINE void FN(att_scores_tail)(const float *q, const kv_rows *c, int64_t kvh, int64_t G, int64_t L,
                                       int64_t D, float scale, float *s) {
    const float *qh = q + kvh * G * D;
    float tmp[PI_KV_MAX_D];
    for (int64_t t = L & ~(int64_t)7; t < L; t++) {
        const float *krow = FN(kv_row)(c, t, kvh, D, tmp);
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qh + g * D;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(krow + d), acc);
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

/* nv * 8 output lanes (nv <= 8) at o over positions [t0, t1), value row u at v0 + (u - t0) * row: called with a
 * constant nv where it can be, which keeps acc in registers (a variable count spilled it: ~1/3 of the attention time
 * at 2048 positions); prefetch: the rows ATT_PF on (f32 caches; a decoded tile is in L1 already) */
TARGET_INLINE void FN(att_values_block)(const float *v0, int64_t row, const float *sg, int64_t t0, int64_t t1,
                                        float inv, int64_t L, float *o, const int nv, const int prefetch) {
    __m256 acc[8];
    for (int j = 0; j < nv; j++) acc[j] = t0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o + 8 * j);
    for (int64_t u = t0; u < t1; u++) {
        const __m256 p = _mm256_broadcast_ss(sg + u);
        const float *vrow = v0 + (u - t0) * row;
        if (prefetch && u + ATT_PF < L)
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

/* out lanes [d0, d1) of the G heads of kvh = sum_t p_t V[t] * inv[g] (typed caches: each tile of ATT_V_BLOCK rows
 * and 64 lanes decoded once for the G heads; every lane sums over t in the same order either way) */
TARGET_INLINE void FN(att_values)(const kv_rows *c, int64_t kvh, int64_t G, int64_t L, int64_t D, const float *s,
                                  const float *inv, float *out, int64_t d_begin, int64_t d_end) {
    if (c->type != PI_TYPE_F32) {
        float tile[ATT_V_BLOCK * 64];
        for (int64_t t0 = 0; t0 < L; t0 += ATT_V_BLOCK) {
            const int64_t t1 = t0 + ATT_V_BLOCK < L ? t0 + ATT_V_BLOCK : L;
            for (int64_t d0 = d_begin; d0 < d_end; d0 += 64) {
                const int64_t w = d_end - d0 < 64 ? d_end - d0 : 64;
                FN(kv_tile)(c, kvh, t0, t1, d0, d0 + w, tile);
                for (int64_t g = 0; g < G; g++) {
                    float *o = out + (kvh * G + g) * D + d0;
                    if (w == 64)
                        FN(att_values_block)(tile, w, s + g * L, t0, t1, inv[g], L, o, 8, 0);
                    else
                        FN(att_values_block)(tile, w, s + g * L, t0, t1, inv[g], L, o, (int)(w / 8), 0);
                }
            }
        }
        return;
    }
    const int64_t row = c->row_bytes / (int64_t)sizeof(float);
    const float *vbase = (const float *)c->data + kvh * D;
    for (int64_t t0 = 0; t0 < L; t0 += ATT_V_BLOCK) {
        const int64_t t1 = t0 + ATT_V_BLOCK < L ? t0 + ATT_V_BLOCK : L;
        for (int64_t g = 0; g < G; g++) {
            const float *sg = s + g * L;
            float *o = out + (kvh * G + g) * D;
            for (int64_t d0 = d_begin; d0 < d_end; d0 += 64) {
                const int nv = (int)((d_end - d0 < 64 ? d_end - d0 : 64) / 8);
                const float *v0 = vbase + t0 * row + d0;
                if (nv == 8)
                    FN(att_values_block)(v0, row, sg, t0, t1, inv[g], L, o + d0, 8, 1);
                else
                    FN(att_values_block)(v0, row, sg, t0, t1, inv[g], L, o + d0, nv, 1);
            }
        }
    }
}

TARGET static void FN(attend_kv_head)(const float *q, const kv_rows *kc, const kv_rows *vc, int64_t kvh, int64_t G,
                                      int64_t L, int64_t D, float scale, float *s, float *out) {
    if (D % 8 != 0 || G > 64) {
        FN(attend_kv_head_generic)(q, kc, vc, kvh, G, L, D, scale, s, out);
        return;
    }
    FN(att_scores)(q, kc, kvh, G, L, D, scale, s, 0, L & ~(int64_t)7);
    FN(att_scores_tail)(q, kc, kvh, G, L, D, scale, s);
    float inv[64]; /* 1 / sum per query head; G <= 64 here, else the generic body above */
    for (int64_t g = 0; g < G; g++) inv[g] = FN(att_softmax)(s + g * L, L);
    FN(att_values)(vc, kvh, G, L, D, s, inv, out, 0, D);
}

/* Thread `me` of `all` in a team sharing every KV head (attn_decode_team): the parts of attend_kv_head split over
 * the team, with barriers between them; scores of KV head kvh at s + kvh * G * L, inv: H floats. The same bits
 * as attend_kv_head per head. Needs D % 8 == 0 and G <= 64. */
TARGET static void FN(attend_team)(const float *q, const kv_rows *kc, const kv_rows *vc, int64_t Hkv, int64_t G,
                                   int64_t L, int64_t D, float scale, float *s, float *inv, float *out, int64_t me,
                                   int64_t all) {
    const int64_t n8 = L / 8, groups = Hkv * n8;
    for (int64_t i = groups * me / all, i1 = groups * (me + 1) / all; i < i1;) {
        const int64_t kvh = i / n8, g0 = i % n8, g1 = kvh == (i1 - 1) / n8 ? (i1 - 1) % n8 + 1 : n8;
        FN(att_scores)(q, kc, kvh, G, L, D, scale, s + kvh * G * L, 8 * g0, 8 * g1);
        i += g1 - g0;
    }
    for (int64_t kvh = me; kvh < Hkv; kvh += all) FN(att_scores_tail)(q, kc, kvh, G, L, D, scale, s + kvh * G * L);
#pragma omp barrier
    for (int64_t h = Hkv * G * me / all; h < Hkv * G * (me + 1) / all; h++) inv[h] = FN(att_softmax)(s + h * L, L);
#pragma omp barrier
    const int64_t chunk = D % 32 == 0 ? 32 : D, n_chunks = D / chunk, items = Hkv * n_chunks;
    for (int64_t i = items * me / all; i < items * (me + 1) / all; i++) {
        const int64_t kvh = i / n_chunks, d0 = (i % n_chunks) * chunk;
        FN(att_values)(vc, kvh, G, L, D, s + kvh * G * L, inv + kvh * G, out, d0, d0 + chunk);
    }
}
#else
#define attend_kv_head_scalar attend_kv_head_generic_scalar
#endif

#undef ATT_PF
#undef ATT_V_BLOCK
#include "simd_fn_end.h"
