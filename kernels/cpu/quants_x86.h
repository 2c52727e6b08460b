/* SIMD block-32 decoders (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), included by the SIMD bodies (matmul_x86.h, sparse_x86.h)
 * after they define FN / TARGET_INLINE, so they are compiled once per variant (no include guard on purpose).
 *
 * decode_block32 decodes one block of 32 into vectors in element order (AVX-512: 2 x 16 lanes, AVX2: 4 x 8) with
 * the float values of the reference dequantiser (quants.h's scalar decoders): Q4_0 (q - 8) * d, Q5_0 (q - 16) * d
 * and Q8_0 q * d are exact products; Q4_1 / Q5_1 d * q + m, where d * q is exact, so one rounding of the sum is
 * the reference's. The one exception is AVX2 Q4_1 with exact = 0: one FMA where the reference rounds d * q first
 * (within 1 ulp; the exact matmul tiles keep it), while exact != 0 rounds as the reference (rows_axpy). `kind`
 * and `exact` are compile-time constants after inlining.
 */
#if SIMD_AVX512
#define QV __m512
#else
#define QV __m256
#endif

TARGET_INLINE void FN(decode_block32)(const int kind, const int exact, const uint8_t *blk, QV *w) {
#if SIMD_AVX512
    (void)exact;
    if (kind == PI_TYPE_Q8_0) {
        const block_q8_0 *b = (const block_q8_0 *)blk;
        const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)b->d));
        w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b->qs))), d);
        w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b->qs + 16)))), d);
        return;
    }
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if ((kind == PI_TYPE_Q5_0 || kind == PI_TYPE_Q5_1)) {
        /* Q5: 32 possible values as two tables (q < 16, q >= 16), picked with vpermt2ps, which reads the low 5 bits
         * of each index: nibble | (qh bit << 4). Q5_0 (q - 16) * d and Q5_1 d * q + m with d * q exact: one
         * rounding at most, as the reference. */
        __m512 lo_t, hi_t;
        const uint8_t *qs, *qh_bytes;
        if (kind == PI_TYPE_Q5_0) {
            const block_q5_0 *b = (const block_q5_0 *)blk;
            const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)b->d));
            lo_t = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(16.0f)), d);
            hi_t = _mm512_mul_ps(iota, d);
            qs = b->qs;
            qh_bytes = b->qh;
        } else {
            const block_q5_1 *b = (const block_q5_1 *)blk;
            const __m512 d = _mm512_set1_ps(_cvtsh_ss(b->d)), m = _mm512_set1_ps(_cvtsh_ss(b->m));
            lo_t = _mm512_add_ps(_mm512_mul_ps(iota, d), m);
            hi_t = _mm512_add_ps(_mm512_mul_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.0f)), d), m);
            qs = b->qs;
            qh_bytes = b->qh;
        }
        uint32_t qh;
        memcpy(&qh, qh_bytes, sizeof qh);
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
        const __m512i sixteen = _mm512_set1_epi32(16);
        const __m512i lo = _mm512_and_si512(idx, _mm512_set1_epi32(0x0F)), hi = _mm512_srli_epi32(idx, 4);
        w[0] = _mm512_permutex2var_ps(lo_t, _mm512_mask_or_epi32(lo, (__mmask16)(qh & 0xFFFFu), lo, sixteen), hi_t);
        w[1] = _mm512_permutex2var_ps(lo_t, _mm512_mask_or_epi32(hi, (__mmask16)(qh >> 16), hi, sixteen), hi_t);
        return;
    }
    __m512 table;
    const uint8_t *qs;
    if (kind == PI_TYPE_Q4_0) {
        const block_q4_0 *b = (const block_q4_0 *)blk;
        /* the scale broadcast as fp16 and widened in one vector step (fewer shuffles than a scalar convert) */
        table = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.0f)), _mm512_cvtph_ps(_mm256_set1_epi16((short)b->d)));
        qs = b->qs;
    } else {
        const block_q4_1 *b = (const block_q4_1 *)blk;
        uint32_t dm_bits;
        memcpy(&dm_bits, &b->d, sizeof dm_bits);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm_bits));
        table = _mm512_add_ps(_mm512_mul_ps(_mm512_broadcastss_ps(dm), iota),
                              _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
        qs = b->qs;
    }
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs)); /* bytes 0..255 */
    w[0] = _mm512_permutexvar_ps(idx, table);                                          /* low nibbles */
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);                     /* high nibbles */
#else
    if (kind == PI_TYPE_Q8_0) {
        const block_q8_0 *b = (const block_q8_0 *)blk;
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(b->d));
        for (int j = 0; j < 4; j++) {
            const __m128i q8 = _mm_loadl_epi64((const __m128i *)(b->qs + 8 * j));
            w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d);
        }
        return;
    }
    if ((kind == PI_TYPE_Q5_0 || kind == PI_TYPE_Q5_1)) {
        /* Q5: q = nibble | (qh bit << 4); Q5_0 fma(d, q, -16d) = the exact (q - 16) * d, Q5_1 fma(d, q, m) rounds
         * the exact d * q + m once, as the reference */
        __m256 d, m;
        const uint8_t *qs, *qh_bytes;
        if (kind == PI_TYPE_Q5_0) {
            const block_q5_0 *b = (const block_q5_0 *)blk;
            d = _mm256_set1_ps(_cvtsh_ss(b->d));
            m = _mm256_mul_ps(d, _mm256_set1_ps(-16.0f));
            qs = b->qs;
            qh_bytes = b->qh;
        } else {
            const block_q5_1 *b = (const block_q5_1 *)blk;
            d = _mm256_set1_ps(_cvtsh_ss(b->d));
            m = _mm256_set1_ps(_cvtsh_ss(b->m));
            qs = b->qs;
            qh_bytes = b->qh;
        }
        uint32_t qh;
        memcpy(&qh, qh_bytes, sizeof qh);
        const __m256i qh_v = _mm256_set1_epi32((int)qh), one = _mm256_set1_epi32(1);
        const __m256i mask = _mm256_set1_epi32(0x0F);
        for (int h = 0; h < 2; h++) {
            const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * h)));
            const __m256i s_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256i sh_lo = _mm256_add_epi32(s_lo, _mm256_set1_epi32(8 * h));
            const __m256i sh_hi = _mm256_add_epi32(sh_lo, _mm256_set1_epi32(16));
            const __m256i b_lo = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(qh_v, sh_lo), one), 4);
            const __m256i b_hi = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(qh_v, sh_hi), one), 4);
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(idx, mask), b_lo);
            const __m256i hi = _mm256_or_si256(_mm256_srli_epi32(idx, 4), b_hi);
            w[h] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lo), m);
            w[2 + h] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(hi), m);
        }
        return;
    }
    __m256 d, m = _mm256_setzero_ps();
    const uint8_t *qs;
    if (kind == PI_TYPE_Q4_0) {
        const block_q4_0 *b = (const block_q4_0 *)blk;
        d = _mm256_set1_ps(_cvtsh_ss(b->d));
        m = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)); /* exact: a power of two times d */
        qs = b->qs;
    } else {
        const block_q4_1 *b = (const block_q4_1 *)blk;
        uint32_t dm_bits;
        memcpy(&dm_bits, &b->d, sizeof dm_bits);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm_bits));
        d = _mm256_broadcastss_ps(dm);
        m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        qs = b->qs;
    }
    const __m256i mask = _mm256_set1_epi32(0x0F);
    for (int h = 0; h < 2; h++) {
        /* bytes 8h..8h+7: low nibbles are elements 8h.., high nibbles elements 16+8h.. */
        const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * h)));
        const __m256i lo = _mm256_and_si256(idx, mask), hi = _mm256_srli_epi32(idx, 4);
        /* Q4_0: fma(q, d, -8d) rounds the exact (q - 8) * d once: bit-equal to the reference.
         * Q4_1: fma(d, q, m) rounds d * q + m once where the reference rounds twice (within 1 ulp of w);
         * `exact` rounds twice, as the reference. */
        if (kind == PI_TYPE_Q4_1 && exact) {
            w[h] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)), m);
            w[2 + h] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(hi)), m);
        } else {
            w[h] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lo), m);
            w[2 + h] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(hi), m);
        }
    }
#endif
}

#undef QV
