/* SIMD bodies of rows_axpy, compiled twice by sparse.c through simd_variants.h (SIMD_SUFFIX avx2 / avx512).
 *
 * A unit of 32 weights is decoded to floats in registers (AVX2: 4 x 8 lanes, AVX-512: 2 x 16 lanes) with the
 * reference dequantiser's operations, then y = fma(h, w, y) per element. Lanes are independent, so the result is
 * the same scalar chain per element as in the scalar variant: all variants agree bit for bit.
 *
 * T = 1: the listed rows (h != 0, a chunk of them at a time) are taken AXPY_GROUP at a time; for each unit of the
 * thread's slice, y is loaded once, the group's rows are applied in order, y is stored (rows stream sequentially,
 * y stays in L1). Storing and reloading y between groups or chunks does not change a bit of the chain.
 * T > 1: tokens AXPY_TILE_T at a time; each unit of each row is decoded once and applied to the tile's tokens
 * whose h is non-zero.
 * K-quant kinds: a unit is a super-block of 256, decoded into a small buffer in L1 (kquants_x86.h) and applied 32
 * elements at a time with the same per-element chain.
 */

#define SIMD_CAT_(a, b) a##_##b
#define SIMD_CAT(a, b) SIMD_CAT_(a, b)
#define FN(name) SIMD_CAT(name, SIMD_SUFFIX)
#define TARGET __attribute__((target(SIMD_TARGET)))
#define TARGET_INLINE static inline __attribute__((target(SIMD_TARGET), always_inline))

#if SIMD_AVX512
#define SV __m512
#define SV_N 16
#define SV_LOAD(p) _mm512_loadu_ps(p)
#define SV_STORE(p, v) _mm512_storeu_ps(p, v)
#define SV_SET1(f) _mm512_set1_ps(f)
#define SV_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SV_ZERO() _mm512_setzero_ps()
#else
#define SV __m256
#define SV_N 8
#define SV_LOAD(p) _mm256_loadu_ps(p)
#define SV_STORE(p, v) _mm256_storeu_ps(p, v)
#define SV_SET1(f) _mm256_set1_ps(f)
#define SV_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SV_ZERO() _mm256_setzero_ps()
#endif
#define SV_PER_UNIT (AXPY_UNIT / SV_N)

/* Unit u (32 elements) of a row, decoded into SV_PER_UNIT vectors in element order. */
TARGET_INLINE void FN(axpy_decode)(const int kind, const uint8_t *row, int64_t u, SV *w) {
    if (kind == KIND_F32) {
        const float *p = (const float *)row + u * AXPY_UNIT;
        for (int j = 0; j < SV_PER_UNIT; j++) w[j] = SV_LOAD(p + j * SV_N);
        return;
    }
    if (kind == KIND_F16) {
        const uint16_t *p = (const uint16_t *)row + u * AXPY_UNIT;
#if SIMD_AVX512
        for (int j = 0; j < 2; j++) w[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 16 * j)));
#else
        for (int j = 0; j < 4; j++) w[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8 * j)));
#endif
        return;
    }
    if (kind == KIND_BF16) { /* the top half of a float's bits: exact */
        const uint16_t *p = (const uint16_t *)row + u * AXPY_UNIT;
#if SIMD_AVX512
        for (int j = 0; j < 2; j++)
            w[j] = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 16 * j))), 16));
#else
        for (int j = 0; j < 4; j++)
            w[j] = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8 * j))), 16));
#endif
        return;
    }
    if (kind == KIND_Q5_0 || kind == KIND_Q5_1) {
        /* q = nibble | (qh bit << 4); Q5_0 (q - 16) * d exactly, Q5_1 d * q (exact) + m rounded once */
        const uint8_t *qs, *qh_bytes;
        float df, mf;
        if (kind == KIND_Q5_0) {
            const block_q5_0 *b = (const block_q5_0 *)row + u;
            qs = b->qs;
            qh_bytes = b->qh;
            df = _cvtsh_ss(b->d);
            mf = -16.0f * df;
        } else {
            const block_q5_1 *b = (const block_q5_1 *)row + u;
            qs = b->qs;
            qh_bytes = b->qh;
            df = _cvtsh_ss(b->d);
            mf = _cvtsh_ss(b->m);
        }
        uint32_t qh;
        memcpy(&qh, qh_bytes, sizeof qh);
#if SIMD_AVX512
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
        const __m512i sixteen = _mm512_set1_epi32(16);
        const __m512i lo = _mm512_and_si512(idx, _mm512_set1_epi32(0x0F)), hi = _mm512_srli_epi32(idx, 4);
        const __m512 d = _mm512_set1_ps(df), m = _mm512_set1_ps(mf);
        w[0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_mask_or_epi32(lo, (__mmask16)(qh & 0xFFFFu), lo, sixteen)), m);
        w[1] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_mask_or_epi32(hi, (__mmask16)(qh >> 16), hi, sixteen)), m);
#else
        const __m256i qh_v = _mm256_set1_epi32((int)qh), one = _mm256_set1_epi32(1), mask = _mm256_set1_epi32(0x0F);
        const __m256 d = _mm256_set1_ps(df), m = _mm256_set1_ps(mf);
        for (int h = 0; h < 2; h++) {
            const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * h)));
            const __m256i sh_lo = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * h));
            const __m256i sh_hi = _mm256_add_epi32(sh_lo, _mm256_set1_epi32(16));
            const __m256i lo = _mm256_or_si256(
                _mm256_and_si256(idx, mask), _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(qh_v, sh_lo), one), 4));
            const __m256i hi = _mm256_or_si256(
                _mm256_srli_epi32(idx, 4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(qh_v, sh_hi), one), 4));
            w[h] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lo), m);
            w[2 + h] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(hi), m);
        }
#endif
        return;
    }
    if (kind == KIND_Q8_0) {
        const block_q8_0 *b = (const block_q8_0 *)row + u;
#if SIMD_AVX512
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(b->d));
        for (int j = 0; j < 2; j++)
            w[j] = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b->qs + 16 * j)))), d);
#else
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(b->d));
        for (int j = 0; j < 4; j++)
            w[j] = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b->qs + 8 * j)))), d);
#endif
        return;
    }
    /* Q4_0: (q - 8) * d (q - 8 exact in float, one rounding); Q4_1: d * q rounded, then + m rounded */
    const uint8_t *qs;
    float df, mf = 0.0f;
    if (kind == KIND_Q4_0) {
        const block_q4_0 *b = (const block_q4_0 *)row + u;
        qs = b->qs;
        df = _cvtsh_ss(b->d);
    } else {
        const block_q4_1 *b = (const block_q4_1 *)row + u;
        qs = b->qs;
        df = _cvtsh_ss(b->d);
        mf = _cvtsh_ss(b->m);
    }
    const SV d = SV_SET1(df), m = SV_SET1(mf), eight = SV_SET1(8.0f);
#if SIMD_AVX512
    /* the 16 possible values of the block, same operations as the reference, picked by nibble with vpermps
     * (which reads only the low 4 bits of each index) */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = kind == KIND_Q4_0 ? _mm512_mul_ps(_mm512_sub_ps(iota, eight), d)
                                           : _mm512_add_ps(_mm512_mul_ps(d, iota), m);
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    w[0] = _mm512_permutexvar_ps(q, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
#else
    const __m256i mask = _mm256_set1_epi32(0x0F);
    for (int h = 0; h < 2; h++) {
        /* bytes 8h..8h+7: low nibbles are elements 8h.., high nibbles elements 16 + 8h.. */
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * h)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(q, mask));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
        if (kind == KIND_Q4_0) {
            w[h] = _mm256_mul_ps(_mm256_sub_ps(lo, eight), d);
            w[2 + h] = _mm256_mul_ps(_mm256_sub_ps(hi, eight), d);
        } else {
            w[h] = _mm256_add_ps(_mm256_mul_ps(d, lo), m);
            w[2 + h] = _mm256_add_ps(_mm256_mul_ps(d, hi), m);
        }
    }
#endif
    (void)m;
    (void)eight;
}

/* T = 1, full units [u0, u1) of y: the listed rows added to y (c->accumulate) or to zero. */
TARGET_INLINE void FN(axpy_t1)(const int kind, const axpy_ctx *c, int64_t u0, int64_t u1) {
    float *y = c->y;
    if (!c->accumulate)
        for (int64_t u = u0; u < u1; u++)
            for (int j = 0; j < SV_PER_UNIT; j++) SV_STORE(y + u * AXPY_UNIT + j * SV_N, SV_ZERO());
    for (int64_t g = 0; g < c->n_act; g += AXPY_GROUP) {
        const int n = (int)min_i64(AXPY_GROUP, c->n_act - g);
        const uint8_t *const *rows = c->act_rows + g;
        SV hv[AXPY_GROUP];
        for (int r = 0; r < n; r++) hv[r] = SV_SET1(c->act_h[g + r]);
        /* the rows AXPY_AHEAD groups ahead, fetched a unit at a time as this group walks its units: a steady
         * stream of prefetches instead of a burst the line fill buffers would drop */
        const int64_t ahead = g + AXPY_AHEAD * AXPY_GROUP;
        const int n_ahead = ahead < c->n_act ? (int)min_i64(AXPY_GROUP, c->n_act - ahead) : 0;
        const uint8_t *const *rows_ahead = c->act_rows + (ahead < c->n_act ? ahead : 0);
        for (int64_t u = u0; u < u1; u++) {
            float *yu = y + u * AXPY_UNIT;
            for (int r = 0; r < n_ahead; r++) __builtin_prefetch(rows_ahead[r] + u * c->unit_bytes, 0, 3);
            SV acc[SV_PER_UNIT];
            for (int j = 0; j < SV_PER_UNIT; j++) acc[j] = SV_LOAD(yu + j * SV_N);
            for (int r = 0; r < n; r++) {
                SV w[SV_PER_UNIT];
                FN(axpy_decode)(kind, rows[r], u, w);
                for (int j = 0; j < SV_PER_UNIT; j++) acc[j] = SV_FMA(hv[r], w[j], acc[j]);
            }
            for (int j = 0; j < SV_PER_UNIT; j++) SV_STORE(yu + j * SV_N, acc[j]);
        }
    }
}

/* T > 1, full units [u0, u1) of y, tokens [t0, t0 + ntok). */
TARGET_INLINE void FN(axpy_tile)(const int kind, const axpy_ctx *c, int64_t u0, int64_t u1, int64_t t0,
                                 const int ntok) {
    float *yt[AXPY_TILE_T];
    const float *ht[AXPY_TILE_T];
    for (int t = 0; t < ntok; t++) {
        yt[t] = c->y + (t0 + t) * c->y_stride;
        ht[t] = c->h + (t0 + t) * c->h_stride;
        for (int64_t u = u0; u < u1; u++)
            for (int j = 0; j < SV_PER_UNIT; j++) SV_STORE(yt[t] + u * AXPY_UNIT + j * SV_N, SV_ZERO());
    }
    for (int64_t m = 0; m < c->M; m++) {
        float hs[AXPY_TILE_T];
        int any = 0;
        for (int t = 0; t < ntok; t++) {
            hs[t] = ht[t][m];
            any |= hs[t] != 0.0f;
        }
        if (!any) continue;
        const uint8_t *row = c->w + row_of(c->idx, m) * c->w_stride;
        if (m + ROWS_PREFETCH_AHEAD < c->M)
            prefetch_bytes(c->w + row_of(c->idx, m + ROWS_PREFETCH_AHEAD) * c->w_stride + u0 * c->unit_bytes,
                           (u1 - u0) * c->unit_bytes);
        for (int64_t u = u0; u < u1; u++) {
            SV w[SV_PER_UNIT];
            FN(axpy_decode)(kind, row, u, w);
            for (int t = 0; t < ntok; t++) {
                if (hs[t] == 0.0f) continue;
                const SV hv = SV_SET1(hs[t]);
                float *yu = yt[t] + u * AXPY_UNIT;
                for (int j = 0; j < SV_PER_UNIT; j++)
                    SV_STORE(yu + j * SV_N, SV_FMA(hv, w[j], SV_LOAD(yu + j * SV_N)));
            }
        }
    }
}

TARGET_INLINE void FN(axpy_units_kind)(const int kind, const axpy_ctx *c, int64_t u0, int64_t u1) {
    if (u1 <= u0) return;
    if (c->T == 1) {
        FN(axpy_t1)(kind, c, u0, u1);
        return;
    }
    for (int64_t t0 = 0; t0 < c->T; t0 += AXPY_TILE_T) {
        switch ((int)min_i64(AXPY_TILE_T, c->T - t0)) {
            case 1: FN(axpy_tile)(kind, c, u0, u1, t0, 1); break;
            case 2: FN(axpy_tile)(kind, c, u0, u1, t0, 2); break;
            case 3: FN(axpy_tile)(kind, c, u0, u1, t0, 3); break;
            default: FN(axpy_tile)(kind, c, u0, u1, t0, AXPY_TILE_T); break;
        }
    }
}

/* ---- K-quant kinds: work units are super-blocks of 256 ----------------------------------------------------- */

/* A super-block of a row is decoded once into 256 floats in L1 (kquants_x86.h: the reference dequantiser's float
 * operations, bit-equal to it), then applied to y AXPY_UNIT elements (SV_PER_UNIT vectors) at a time with the
 * same y = fma(h, w, y) per element, rows in order: the chain of every other kind and of the scalar variant. */

#include "kquants_x86.h"

/* one super-block of a K kind decoded to 256 floats (SIMD, bit-equal to the scalar decoders of kquants.h) */
TARGET_INLINE void FN(axpy_kq_decode)(const int kind, const uint8_t *blk, float *w) {
    switch (kind) {
        case KIND_Q2_K: FN(kq_simd_q2_k)(blk, w); break;
        case KIND_Q3_K: FN(kq_simd_q3_k)(blk, w); break;
        case KIND_Q4_K: FN(kq_simd_q4_k)(blk, w); break;
        case KIND_Q5_K: FN(kq_simd_q5_k)(blk, w); break;
        default: FN(kq_simd_q6_k)(blk, w); break;
    }
}

/* T = 1, super-blocks [u0, u1) of y: the listed rows, AXPY_GROUP at a time (their super-blocks decoded side by
 * side, then each 32-element slice of y loaded once per group), the rows AXPY_AHEAD groups ahead prefetched a
 * super-block at a time as in FN(axpy_t1). */
TARGET_INLINE void FN(axpy_kq_t1)(const int kind, const axpy_ctx *c, int64_t u0, int64_t u1) {
    float *y = c->y;
    const size_t bytes = c->unit_bytes;
    if (!c->accumulate)
        for (int64_t e = u0 * QK_K; e < u1 * QK_K; e += SV_N) SV_STORE(y + e, SV_ZERO());
    float wbuf[AXPY_GROUP][QK_K] __attribute__((aligned(64)));
    for (int64_t g = 0; g < c->n_act; g += AXPY_GROUP) {
        const int n = (int)min_i64(AXPY_GROUP, c->n_act - g);
        const uint8_t *const *rows = c->act_rows + g;
        SV hv[AXPY_GROUP];
        for (int r = 0; r < n; r++) hv[r] = SV_SET1(c->act_h[g + r]);
        const int64_t ahead = g + AXPY_AHEAD * AXPY_GROUP;
        const int n_ahead = ahead < c->n_act ? (int)min_i64(AXPY_GROUP, c->n_act - ahead) : 0;
        const uint8_t *const *rows_ahead = c->act_rows + (ahead < c->n_act ? ahead : 0);
        for (int64_t u = u0; u < u1; u++) {
            for (int r = 0; r < n_ahead; r++) prefetch_bytes(rows_ahead[r] + u * bytes, (int64_t)bytes);
            for (int r = 0; r < n; r++) FN(axpy_kq_decode)(kind, rows[r] + u * bytes, wbuf[r]);
            float *yu = y + u * QK_K;
            for (int e = 0; e < QK_K; e += AXPY_UNIT) {
                SV acc[SV_PER_UNIT];
                for (int j = 0; j < SV_PER_UNIT; j++) acc[j] = SV_LOAD(yu + e + j * SV_N);
                for (int r = 0; r < n; r++)
                    for (int j = 0; j < SV_PER_UNIT; j++) acc[j] = SV_FMA(hv[r], SV_LOAD(wbuf[r] + e + j * SV_N), acc[j]);
                for (int j = 0; j < SV_PER_UNIT; j++) SV_STORE(yu + e + j * SV_N, acc[j]);
            }
        }
    }
}

/* T > 1, super-blocks [u0, u1) of y, tokens [t0, t0 + ntok): each super-block of a row with some h != 0 decoded
 * once for the tile's tokens. */
TARGET_INLINE void FN(axpy_kq_tile)(const int kind, const axpy_ctx *c, int64_t u0, int64_t u1, int64_t t0,
                                    const int ntok) {
    const size_t bytes = c->unit_bytes;
    float *yt[AXPY_TILE_T];
    const float *ht[AXPY_TILE_T];
    for (int t = 0; t < ntok; t++) {
        yt[t] = c->y + (t0 + t) * c->y_stride;
        ht[t] = c->h + (t0 + t) * c->h_stride;
        for (int64_t e = u0 * QK_K; e < u1 * QK_K; e += SV_N) SV_STORE(yt[t] + e, SV_ZERO());
    }
    float w[QK_K] __attribute__((aligned(64)));
    for (int64_t m = 0; m < c->M; m++) {
        float hs[AXPY_TILE_T];
        int any = 0;
        for (int t = 0; t < ntok; t++) {
            hs[t] = ht[t][m];
            any |= hs[t] != 0.0f;
        }
        if (!any) continue;
        const uint8_t *row = c->w + row_of(c->idx, m) * c->w_stride;
        if (m + ROWS_PREFETCH_AHEAD < c->M)
            prefetch_bytes(c->w + row_of(c->idx, m + ROWS_PREFETCH_AHEAD) * c->w_stride + u0 * bytes,
                           (u1 - u0) * (int64_t)bytes);
        for (int64_t u = u0; u < u1; u++) {
            FN(axpy_kq_decode)(kind, row + u * bytes, w);
            for (int t = 0; t < ntok; t++) {
                if (hs[t] == 0.0f) continue;
                const SV hv = SV_SET1(hs[t]);
                float *yu = yt[t] + u * QK_K;
                for (int e = 0; e < QK_K; e += SV_N) SV_STORE(yu + e, SV_FMA(hv, SV_LOAD(w + e), SV_LOAD(yu + e)));
            }
        }
    }
}

TARGET_INLINE void FN(axpy_kq_units)(const int kind, const axpy_ctx *c, int64_t u0, int64_t u1) {
    if (u1 <= u0) return;
    if (c->T == 1) {
        FN(axpy_kq_t1)(kind, c, u0, u1);
        return;
    }
    for (int64_t t0 = 0; t0 < c->T; t0 += AXPY_TILE_T)
        FN(axpy_kq_tile)(kind, c, u0, u1, t0, (int)min_i64(AXPY_TILE_T, c->T - t0));
}

/* one specialised body per weight kind */
TARGET static void FN(axpy_units)(int kind, const axpy_ctx *c, int64_t u0, int64_t u1) {
    switch (kind) {
        case KIND_Q2_K: FN(axpy_kq_units)(KIND_Q2_K, c, u0, u1); break;
        case KIND_Q3_K: FN(axpy_kq_units)(KIND_Q3_K, c, u0, u1); break;
        case KIND_Q4_K: FN(axpy_kq_units)(KIND_Q4_K, c, u0, u1); break;
        case KIND_Q5_K: FN(axpy_kq_units)(KIND_Q5_K, c, u0, u1); break;
        case KIND_Q6_K: FN(axpy_kq_units)(KIND_Q6_K, c, u0, u1); break;
        case KIND_Q4_0: FN(axpy_units_kind)(KIND_Q4_0, c, u0, u1); break;
        case KIND_Q4_1: FN(axpy_units_kind)(KIND_Q4_1, c, u0, u1); break;
        case KIND_Q8_0: FN(axpy_units_kind)(KIND_Q8_0, c, u0, u1); break;
        case KIND_F32: FN(axpy_units_kind)(KIND_F32, c, u0, u1); break;
        case KIND_BF16: FN(axpy_units_kind)(KIND_BF16, c, u0, u1); break;
        case KIND_Q5_0: FN(axpy_units_kind)(KIND_Q5_0, c, u0, u1); break;
        case KIND_Q5_1: FN(axpy_units_kind)(KIND_Q5_1, c, u0, u1); break;
        default: FN(axpy_units_kind)(KIND_F16, c, u0, u1); break;
    }
}

#undef SV
#undef SV_N
#undef SV_LOAD
#undef SV_STORE
#undef SV_SET1
#undef SV_FMA
#undef SV_ZERO
#undef SV_PER_UNIT
#undef TARGET
#undef TARGET_INLINE
#undef FN
#undef SIMD_CAT
#undef SIMD_CAT_
