/* SIMD bodies of rows_axpy, compiled twice by sparse.c through simd_variants.h (SIMD_SUFFIX avx2 / avx512).
 *
 * A unit of 32 weights is decoded to floats in registers (AVX2: 4 x 8 lanes, AVX-512: 2 x 16 lanes) with the
 * reference dequantiser's values (block types: quants_x86.h), then y = fma(h, w, y) per element. Lanes are independent, so the result is
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

#include "quants_x86.h"

/* Unit u (32 elements) of a row, decoded into SV_PER_UNIT vectors in element order. */
TARGET_INLINE void FN(axpy_decode)(const int kind, const uint8_t *row, int64_t u, SV *w) {
    if (kind == PI_TYPE_F32) {
        const float *p = (const float *)row + u * AXPY_UNIT;
        for (int j = 0; j < SV_PER_UNIT; j++) w[j] = SV_LOAD(p + j * SV_N);
        return;
    }
    if (kind == PI_TYPE_F16) {
        const uint16_t *p = (const uint16_t *)row + u * AXPY_UNIT;
#if SIMD_AVX512
        for (int j = 0; j < 2; j++) w[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 16 * j)));
#else
        for (int j = 0; j < 4; j++) w[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8 * j)));
#endif
        return;
    }
    if (kind == PI_TYPE_BF16) { /* the top half of a float's bits: exact */
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
    /* the block types: quants_x86.h, with the reference's roundings (exact) */
    FN(decode_block32)(kind, 1, row + u * TYPE_TRAITS[kind].block_bytes, w);
}

/* ---- coef_bf16 kinds in the q8 precision: bfloat16 coefficients (sparse.h, axpy_coef_bf16) ------------------- */

/* q - int8_offset of the 32 elements of a unit of a coef_bf16 kind (its 16 bytes of 4-bit values, block_coef4 in
 * quants.h) as floats (exact), in element order */
TARGET_INLINE void FN(coef_ints)(const int kind, const uint8_t *qs, SV *w) {
    const float offset = (float)TYPE_TRAITS[kind].int8_offset;
#if SIMD_AVX512
    const __m512 iota = _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                      _mm512_set1_ps(offset));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    w[0] = _mm512_permutexvar_ps(q, iota);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), iota);
#else
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const __m256 off = _mm256_set1_ps(offset);
    for (int h = 0; h < 2; h++) {
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * h)));
        w[h] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, mask)), off);
        w[2 + h] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), off);
    }
#endif
}

/* axpy_coef_bf16 with the F16C conversion (exact, as fp16_to_fp32) of unit u's scale */
TARGET_INLINE float FN(coef_f32)(float h, const uint8_t *row, int64_t u) {
    return bf16_to_fp32(bf16_round(h * _cvtsh_ss(((const block_coef4 *)row + u)->d)));
}

/* T = 1, full units [u0, u1) of y: the listed rows added to y (c->accumulate) or to zero. */
/* coef (a coef_bf16 kind in the q8 precision, sparse.h): the integers q - offset times each row's bfloat16
 * coefficient of the unit instead of the decoded weights times h */
TARGET_INLINE void FN(axpy_t1)(const int kind, const int coef, const axpy_ctx *c, int64_t u0, int64_t u1) {
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
            for (int r = 0; r < n_ahead; r++) __builtin_prefetch(rows_ahead[r] + u * c->unit_bytes, 0, 2);
            SV acc[SV_PER_UNIT];
            for (int j = 0; j < SV_PER_UNIT; j++) acc[j] = SV_LOAD(yu + j * SV_N);
            for (int r = 0; r < n; r++) {
                SV w[SV_PER_UNIT];
                if (coef)
                    FN(coef_ints)(kind, ((const block_coef4 *)rows[r] + u)->qs, w);
                else
                    FN(axpy_decode)(kind, rows[r], u, w);
                const SV h = coef ? SV_SET1(FN(coef_f32)(c->act_h[g + r], rows[r], u)) : hv[r];
                for (int j = 0; j < SV_PER_UNIT; j++) acc[j] = SV_FMA(h, w[j], acc[j]);
            }
            for (int j = 0; j < SV_PER_UNIT; j++) SV_STORE(yu + j * SV_N, acc[j]);
        }
    }
}

/* T > 1, full units [u0, u1) of y, tokens [t0, t0 + ntok). */
TARGET_INLINE void FN(axpy_tile)(const int kind, const int coef, const axpy_ctx *c, int64_t u0, int64_t u1,
                                 int64_t t0, const int ntok) {
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
            if (coef)
                FN(coef_ints)(kind, ((const block_coef4 *)row + u)->qs, w);
            else
                FN(axpy_decode)(kind, row, u, w);
            for (int t = 0; t < ntok; t++) {
                if (hs[t] == 0.0f) continue;
                const SV hv = SV_SET1(coef ? FN(coef_f32)(hs[t], row, u) : hs[t]);
                float *yu = yt[t] + u * AXPY_UNIT;
                for (int j = 0; j < SV_PER_UNIT; j++)
                    SV_STORE(yu + j * SV_N, SV_FMA(hv, w[j], SV_LOAD(yu + j * SV_N)));
            }
        }
    }
}

TARGET_INLINE void FN(axpy_units_kind)(const int kind, const int coef, const axpy_ctx *c, int64_t u0, int64_t u1) {
    if (u1 <= u0) return;
    if (c->T == 1) {
        FN(axpy_t1)(kind, coef, c, u0, u1);
        return;
    }
    for (int64_t t0 = 0; t0 < c->T; t0 += AXPY_TILE_T) {
        switch ((int)min_i64(AXPY_TILE_T, c->T - t0)) {
            case 1: FN(axpy_tile)(kind, coef, c, u0, u1, t0, 1); break;
            case 2: FN(axpy_tile)(kind, coef, c, u0, u1, t0, 2); break;
            case 3: FN(axpy_tile)(kind, coef, c, u0, u1, t0, 3); break;
            default: FN(axpy_tile)(kind, coef, c, u0, u1, t0, AXPY_TILE_T); break;
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
#define KQ_DECODE_CASE(name, type)                                                                                 \
    case type: FN(kq_simd_##name)(blk, w); break;
    switch (kind) {
        PI_KQUANT_TYPES(KQ_DECODE_CASE)
        default: break;
    }
#undef KQ_DECODE_CASE
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

#if SIMD_AVX512
#define TARGET_BF __attribute__((target(SIMD_TARGET ",avx512bf16,avx512vbmi")))

/* The scales of 16 consecutive block_coef4 units from p (288 bytes): units 0-7 lie in bytes 0-127 and units 8-15
 * in bytes 144-271, so each half is one two-table byte permute (pick: the scale bytes of units 0-7, repeated for
 * words 8-15) */
TARGET_BF static inline __m256i FN(coef4_scales16)(const uint8_t *p, const __m512i pick) {
    const __m512i lo = _mm512_maskz_permutex2var_epi8(0x00000000FFFFull, _mm512_loadu_si512(p), pick,
                                                      _mm512_loadu_si512(p + 64));
    const __m512i hi = _mm512_maskz_permutex2var_epi8(0x0000FFFF0000ull, _mm512_loadu_si512(p + 144), pick,
                                                      _mm512_loadu_si512(p + 208));
    return _mm512_castsi512_si256(_mm512_or_si512(lo, hi));
}

/* The coefficients of rows r0, r1 with h0, h1 for units [ub, ue), as pair dwords (first row high) */
TARGET_BF static inline void FN(axpy_coef_pair)(const uint8_t *r0, const uint8_t *r1, float h0, float h1, int64_t ub,
                                                  int64_t ue, const __m512i scale_pick, const __m512i pair_words,
                                                  uint32_t *coef) {
    /* 16 at a time: a full 16's scales picked by two two-table byte permutes from its 288 bytes, a shorter run's
     * read one by one */
    for (int64_t uc = ub; uc < ue; uc += 16) {
        const int nu = (int)min_i64(16, ue - uc);
        __m256i s0, s1;
        if (nu == 16) {
            s0 = FN(coef4_scales16)((const uint8_t *)((const block_coef4 *)r0 + uc), scale_pick);
            s1 = FN(coef4_scales16)((const uint8_t *)((const block_coef4 *)r1 + uc), scale_pick);
        } else {
            uint16_t d0[16] = {0}, d1[16] = {0};
            for (int k = 0; k < nu; k++) {
                d0[k] = ((const block_coef4 *)r0 + uc + k)->d;
                d1[k] = ((const block_coef4 *)r1 + uc + k)->d;
            }
            s0 = _mm256_loadu_si256((const __m256i *)d0);
            s1 = _mm256_loadu_si256((const __m256i *)d1);
        }
        const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_set1_ps(h0), _mm512_cvtph_ps(s0)),
                                                  _mm512_mul_ps(_mm512_set1_ps(h1), _mm512_cvtph_ps(s1)));
        _mm512_storeu_si512(coef + (uc - ub), _mm512_permutexvar_epi16(pair_words, (__m512i)both));
    }
}

/* Unit u of two rows spread to words by one two-table byte permute: word 2i + 1 = byte i of r0, word 2i = byte i
 * of r1 (perm: i and 64 + i) */
TARGET_BF static inline __m512i FN(axpy_pair_bytes)(const uint8_t *r0, const uint8_t *r1, int64_t u,
                                                    const __m512i perm) {
    return _mm512_permutex2var_epi8(
        _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)((const block_coef4 *)r0 + u)->qs)), perm,
        _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)((const block_coef4 *)r1 + u)->qs)));
}

/* y += the np (1 or 2) pairs of listed rows from p, the pairs in order, over units [u0, u1) */
TARGET_BF static inline void FN(axpy_coef_dp_pairs)(const axpy_ctx *c, int64_t p, const int np, int64_t u0,
                                                      int64_t u1, const __m512i tab, const __m512i perm,
                                                      const __m512i scale_pick, const __m512i pair_words) {
    float *y = c->y;
    const int64_t pa = p + 2 * AXPY_PAIRS_AHEAD;
    /* the rows and their h (a row past the list: the one before it, with h = 0, so its lane adds +0) */
    const uint8_t *rows[4];
    float h[4];
    for (int r = 0; r < 2 * np; r++) {
        const int live = p + r < c->n_act;
        rows[r] = c->act_rows[live ? p + r : p + r - 1];
        h[r] = live ? c->act_h[p + r] : 0.0f;
    }
    /* the rows to prefetch (past the list: the last one, already read) */
    const uint8_t *ahead[4];
    for (int r = 0; r < 2 * np; r++) ahead[r] = c->act_rows[pa + r < c->n_act ? pa + r : c->n_act - 1];
    for (int64_t ub = u0; ub < u1; ub += AXPY_COEF_BLOCK) {
        const int64_t ue = min_i64(u1, ub + AXPY_COEF_BLOCK);
        /* the block's coefficients first, so that the unit loop reads stores long retired */
        uint32_t coef[2][AXPY_COEF_BLOCK];
        for (int q = 0; q < np; q++)
            FN(axpy_coef_pair)(rows[2 * q], rows[2 * q + 1], h[2 * q], h[2 * q + 1], ub, ue, scale_pick, pair_words,
                               coef[q]);
        for (int64_t u = ub; u < ue; u++) {
            /* the rows AXPY_PAIRS_AHEAD pairs ahead, every third unit (a cache line holds 3.5 units) */
            if ((u - ub) % 3 == 0)
                for (int r = 0; r < 2 * np; r++) __builtin_prefetch(ahead[r] + u * (int64_t)c->unit_bytes, 0, 2);
            float *yu = y + u * AXPY_UNIT;
            __m512 lo = _mm512_loadu_ps(yu), hi = _mm512_loadu_ps(yu + 16);
            for (int q = 0; q < np; q++) {
                const __m512i x = FN(axpy_pair_bytes)(rows[2 * q], rows[2 * q + 1], u, perm);
                const __m512i cv = _mm512_set1_epi32((int)coef[q][u - ub]);
                lo = _mm512_dpbf16_ps(lo, (__m512bh)_mm512_permutexvar_epi16(x, tab), (__m512bh)cv);
                hi = _mm512_dpbf16_ps(hi, (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(x, 4), tab),
                                      (__m512bh)cv);
            }
            _mm512_storeu_ps(yu, lo);
            _mm512_storeu_ps(yu + 16, hi);
        }
    }
}

/* T = 1 with vdpbf16ps, a coef_bf16 kind: the listed rows two pairs at a time (then a pair) over the whole slice,
 * y loaded and stored once per pass (FN(axpy_coef_dp_pairs)). A pair's units are spread to words by one two-table
 * byte permute: word 2i + 1 = byte i of the first row (odd lane, added first), word 2i = byte i of the second; vpermw
 * picks bf16(q - offset) from a table by the low 5 bits (the table repeats, so bit 4, the other nibble's, is
 * ignored), the high nibbles after a shift by 4. An odd row out is paired with a zero coefficient (its lane adds
 * +0). */
TARGET_BF static void FN(axpy_t1_coef_dp)(const int kind, const axpy_ctx *c, int64_t u0, int64_t u1) {
    float *y = c->y;
    if (!c->accumulate)
        for (int64_t u = u0; u < u1; u++)
            for (int j = 0; j < 2; j++) _mm512_storeu_ps(y + u * AXPY_UNIT + 16 * j, _mm512_setzero_ps());
    uint16_t tab_words[32];
    uint8_t spread[64];
    for (int i = 0; i < 32; i++)
        tab_words[i] = axpy_coef_bf16((float)((i & 15) - TYPE_TRAITS[kind].int8_offset), 0x3C00 /* 1.0 */);
    for (int j = 0; j < 32; j++) spread[2 * j] = spread[2 * j + 1] = (uint8_t)((j & 1 ? 0 : 64) + j / 2);
    const __m512i tab = _mm512_loadu_si512(tab_words), perm = _mm512_loadu_si512(spread);
    uint8_t pick[64] = {0};
    for (int k = 0; k < 8; k++)
        for (int b = 0; b < 2; b++) pick[2 * k + b] = pick[16 + 2 * k + b] = (uint8_t)(k * sizeof(block_coef4) + b);
    const __m512i scale_pick = _mm512_loadu_si512(pick);
    uint16_t pair_idx[32];
    for (int k = 0; k < 16; k++) pair_idx[2 * k] = (uint16_t)k, pair_idx[2 * k + 1] = (uint16_t)(16 + k);
    const __m512i pair_words = _mm512_loadu_si512(pair_idx);
    /* four sequential streams (rows stay in DRAM order), y in L1 */
    int64_t p = 0;
    for (; p + 4 <= c->n_act; p += 4) FN(axpy_coef_dp_pairs)(c, p, 2, u0, u1, tab, perm, scale_pick, pair_words);
    for (; p < c->n_act; p += 2) FN(axpy_coef_dp_pairs)(c, p, 1, u0, u1, tab, perm, scale_pick, pair_words);
}

/* 1 when vdpbf16ps adds a pair as sparse.h says: exact products, odd lane first, one rounding each (cases where
 * the order decides the last bit, and where one fused sum would differ) */
TARGET_BF static int FN(bf16_dot_selftest)(void) {
    static const float acc[4] = {1.0f, 1.0f, 0x1p24f, -1.0f};
    static const uint16_t odd[4] = {0x3380 /* 2^-24 */, 0x3400 /* 2^-23 */, 0x3F80 /* 1 */, 0x3F80};
    static const uint16_t even[4] = {0x3380, 0xB380 /* -2^-24 */, 0xCB80 /* -2^24 */, 0x3380};
    for (int i = 0; i < 4; i++) {
        const uint32_t pair = (uint32_t)odd[i] << 16 | even[i];
        const __m128 r = _mm_dpbf16_ps(_mm_set1_ps(acc[i]), (__m128bh)_mm_set1_epi32((int)pair),
                                       (__m128bh)_mm_set1_epi32(0x3F803F80)); /* times 1 */
        volatile float e = acc[i] + bf16_to_fp32(odd[i]);
        e = e + bf16_to_fp32(even[i]);
        if (_mm_cvtss_f32(r) != e) return 0;
    }
    return 1;
}
#undef TARGET_BF
#endif

TARGET_INLINE void FN(axpy_units_coef)(const int kind, const axpy_ctx *c, int64_t u0, int64_t u1) {
    if (u1 <= u0) return;
    if (c->T == 1) {
#if SIMD_AVX512
        if (axpy_bf16_dot_ok()) {
            FN(axpy_t1_coef_dp)(kind, c, u0, u1);
            return;
        }
#endif
    }
    FN(axpy_units_kind)(kind, 1, c, u0, u1);
}

/* a block-32 or float kind; a coef_bf16 kind (TYPE_TRAITS) in the q8 precision with its bfloat16 coefficients
 * (sparse.h) */
TARGET_INLINE void FN(axpy_units_plain)(const int kind, const axpy_ctx *c, int64_t u0, int64_t u1) {
    if (TYPE_TRAITS[kind].coef_bf16 && c->coef_bf16)
        FN(axpy_units_coef)(kind, c, u0, u1);
    else
        FN(axpy_units_kind)(kind, 0, c, u0, u1);
}

/* one specialised body per weight kind */
TARGET static void FN(axpy_units)(int kind, const axpy_ctx *c, int64_t u0, int64_t u1) {
#define KQ_UNITS_CASE(name, type)                                                                                  \
    case type: FN(axpy_kq_units)(type, c, u0, u1); break;
#define UNITS_CASE(name, type)                                                                                     \
    case type: FN(axpy_units_plain)(type, c, u0, u1); break;
    switch (kind) {
        PI_KQUANT_TYPES(KQ_UNITS_CASE)
        PI_BLOCK32_TYPES(UNITS_CASE)
        PI_FLOAT_TYPES(UNITS_CASE)
        default: break; /* not a kind of these kernels: refused before */
    }
#undef KQ_UNITS_CASE
#undef UNITS_CASE
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
