/* SIMD K-quant super-block decoders, included by the SIMD bodies (matmul_x86.h, sparse_x86.h) after they define
 * FN / TARGET_INLINE, so they are compiled once per variant (no include guard on purpose).
 *
 * Each decodes one super-block of 256 elements into y[0..256) with the float operations of the scalar decoders in
 * kquants.h (d * q - m as one FMA where d * q is exact, see kq_store_dm): the floats are bit-equal to theirs and to
 * the reference dequantiser's. Quants are widened 8 at a time to int32 lanes (exact in float32); the
 * per-sub-block factors (d * scale, dmin * min) are computed in scalar code as kquants.h does. 256-bit vectors in
 * both variants (the decode is a small part of the work; the FMA loops of the callers use the wide vectors).
 */

/* 8 bytes at p as 8 int32 lanes */
TARGET_INLINE __m256i FN(kq_u8x8)(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

/* y[0..8) = d * q - m. The reference rounds d * q, then the difference; here one FMA rounds the difference once,
 * which is the same float because d * q is exact: d = fp16 super-scale (11 significant bits) times a sub-scale of
 * at most 6 bits is exact in float32, and times q (at most 5 bits) still fits the 24-bit significand. The special
 * values agree too (inf * 0 and inf - inf are NaN either way; zero signs: x - m = x + (-m) in both). */
TARGET_INLINE void FN(kq_store_dm)(float *y, __m256i q, __m256 d, __m256 m) {
    _mm256_storeu_ps(y, _mm256_fmsub_ps(d, _mm256_cvtepi32_ps(q), m));
}

TARGET_INLINE void FN(kq_simd_q2_k)(const uint8_t *blk, float *y) {
    const block_q2_k *b = (const block_q2_k *)blk;
    const float d = fp16_to_fp32(b->d), dmin = fp16_to_fp32(b->dmin);
    const __m256i three = _mm256_set1_epi32(3);
    int is = 0;
    for (int n = 0; n < QK_K; n += 128) {
        const uint8_t *q = b->qs + n / 4;
        for (int shift = 0; shift < 8; shift += 2) {
            const __m128i count = _mm_cvtsi32_si128(shift);
            for (int half = 0; half < 2; half++, is++, y += 16) {
                const __m256 dl = _mm256_set1_ps(d * (float)(b->scales[is] & 0x0F));
                const __m256 ml = _mm256_set1_ps(dmin * (float)(b->scales[is] >> 4));
                for (int l = 0; l < 16; l += 8) {
                    const __m256i v = _mm256_and_si256(_mm256_srl_epi32(FN(kq_u8x8)(q + 16 * half + l), count), three);
                    FN(kq_store_dm)(y + l, v, dl, ml);
                }
            }
        }
    }
}

TARGET_INLINE void FN(kq_simd_q3_k)(const uint8_t *blk, float *y) {
    const block_q3_k *b = (const block_q3_k *)blk;
    const float d = fp16_to_fp32(b->d);
    int8_t sc[16];
    kq3_scales(b->scales, sc);
    const __m256i three = _mm256_set1_epi32(3), four = _mm256_set1_epi32(4), zero = _mm256_setzero_si256();
    int is = 0, bit = 0;
    for (int n = 0; n < QK_K; n += 128) {
        const uint8_t *q = b->qs + n / 4;
        for (int shift = 0; shift < 8; shift += 2, bit++) {
            const __m128i count = _mm_cvtsi32_si128(shift);
            const __m256i m = _mm256_set1_epi32(1 << bit);
            for (int half = 0; half < 2; half++, is++, y += 16) {
                const __m256 dl = _mm256_set1_ps(d * (float)(sc[is] - 32));
                for (int l = 0; l < 16; l += 8) {
                    const int at = 16 * half + l;
                    const __m256i v = _mm256_and_si256(_mm256_srl_epi32(FN(kq_u8x8)(q + at), count), three);
                    /* the high bit clear: minus 4 */
                    const __m256i clear = _mm256_cmpeq_epi32(_mm256_and_si256(FN(kq_u8x8)(b->hmask + at), m), zero);
                    const __m256i s = _mm256_sub_epi32(v, _mm256_and_si256(clear, four));
                    _mm256_storeu_ps(y + l, _mm256_mul_ps(dl, _mm256_cvtepi32_ps(s)));
                }
            }
        }
    }
}

TARGET_INLINE void FN(kq_simd_q4_k)(const uint8_t *blk, float *y) {
    const block_q4_k *b = (const block_q4_k *)blk;
    const float d = fp16_to_fp32(b->d), dmin = fp16_to_fp32(b->dmin);
    const __m256i low = _mm256_set1_epi32(0x0F);
    const uint8_t *q = b->qs;
    for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
        float d1, m1, d2, m2;
        kq_pair_factors(j, b->scales, d, dmin, &d1, &m1, &d2, &m2);
        const __m256 vd1 = _mm256_set1_ps(d1), vm1 = _mm256_set1_ps(m1);
        const __m256 vd2 = _mm256_set1_ps(d2), vm2 = _mm256_set1_ps(m2);
        for (int l = 0; l < 32; l += 8) {
            const __m256i v = FN(kq_u8x8)(q + l);
            FN(kq_store_dm)(y + l, _mm256_and_si256(v, low), vd1, vm1);
            FN(kq_store_dm)(y + 32 + l, _mm256_srli_epi32(v, 4), vd2, vm2);
        }
    }
}

TARGET_INLINE void FN(kq_simd_q5_k)(const uint8_t *blk, float *y) {
    const block_q5_k *b = (const block_q5_k *)blk;
    const float d = fp16_to_fp32(b->d), dmin = fp16_to_fp32(b->dmin);
    const __m256i low = _mm256_set1_epi32(0x0F), one = _mm256_set1_epi32(1);
    const uint8_t *q = b->qs;
    for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
        float d1, m1, d2, m2;
        kq_pair_factors(j, b->scales, d, dmin, &d1, &m1, &d2, &m2);
        const __m256 vd1 = _mm256_set1_ps(d1), vm1 = _mm256_set1_ps(m1);
        const __m256 vd2 = _mm256_set1_ps(d2), vm2 = _mm256_set1_ps(m2);
        const __m128i c1 = _mm_cvtsi32_si128(j), c2 = _mm_cvtsi32_si128(j + 1);
        for (int l = 0; l < 32; l += 8) {
            const __m256i v = FN(kq_u8x8)(q + l), h = FN(kq_u8x8)(b->qh + l);
            /* the fifth bit: bit j (low nibbles) and j + 1 (high nibbles) of qh[l], worth 16 */
            const __m256i h1 = _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, c1), one), 4);
            const __m256i h2 = _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, c2), one), 4);
            FN(kq_store_dm)(y + l, _mm256_or_si256(_mm256_and_si256(v, low), h1), vd1, vm1);
            FN(kq_store_dm)(y + 32 + l, _mm256_or_si256(_mm256_srli_epi32(v, 4), h2), vd2, vm2);
        }
    }
}

TARGET_INLINE void FN(kq_simd_q6_k)(const uint8_t *blk, float *y) {
    const block_q6_k *b = (const block_q6_k *)blk;
    const float d = fp16_to_fp32(b->d);
    const __m256i low = _mm256_set1_epi32(0x0F), three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
    const uint8_t *ql = b->ql, *qh = b->qh;
    const int8_t *sc = b->scales;
    for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
        for (int l = 0; l < 32; l += 8) {
            const int is = l / 16;
            const __m256i a = FN(kq_u8x8)(ql + l), c = FN(kq_u8x8)(ql + l + 32), h = FN(kq_u8x8)(qh + l);
            /* the four quarters of 32: low / high nibbles of ql[l] and ql[l + 32], 2 high bits each from qh[l] */
            const __m256i q1 = _mm256_or_si256(_mm256_and_si256(a, low), _mm256_slli_epi32(_mm256_and_si256(h, three), 4));
            const __m256i q2 = _mm256_or_si256(_mm256_and_si256(c, low),
                                               _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2), three), 4));
            const __m256i q3 = _mm256_or_si256(_mm256_srli_epi32(a, 4),
                                               _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 4), three), 4));
            const __m256i q4 = _mm256_or_si256(_mm256_srli_epi32(c, 4), _mm256_slli_epi32(_mm256_srli_epi32(h, 6), 4));
            /* (d * scale) * q, the reference's left-to-right product */
            _mm256_storeu_ps(y + l, _mm256_mul_ps(_mm256_set1_ps(d * (float)sc[is]),
                                                  _mm256_cvtepi32_ps(_mm256_sub_epi32(q1, bias))));
            _mm256_storeu_ps(y + l + 32, _mm256_mul_ps(_mm256_set1_ps(d * (float)sc[is + 2]),
                                                       _mm256_cvtepi32_ps(_mm256_sub_epi32(q2, bias))));
            _mm256_storeu_ps(y + l + 64, _mm256_mul_ps(_mm256_set1_ps(d * (float)sc[is + 4]),
                                                       _mm256_cvtepi32_ps(_mm256_sub_epi32(q3, bias))));
            _mm256_storeu_ps(y + l + 96, _mm256_mul_ps(_mm256_set1_ps(d * (float)sc[is + 6]),
                                                       _mm256_cvtepi32_ps(_mm256_sub_epi32(q4, bias))));
        }
    }
}
