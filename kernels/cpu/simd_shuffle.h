/* Shared by the SIMD bodies (matmul_x86.h, matmul_q8k_x86.h, attention_body.h): included inside each variant's pass, so no include
 * guard; FN() gives each variant its own copy. */

/* v[j] lane i = 32-bit element j of r[i]: an 8 x 8 transpose of 32-bit elements */
TARGET_INLINE void FN(transpose8_epi32)(const __m256i *r, __m256i *v) {
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    _mm256_store_si256(v + 0, _mm256_permute2x128_si256(u0, u4, 0x20));
    _mm256_store_si256(v + 1, _mm256_permute2x128_si256(u1, u5, 0x20));
    _mm256_store_si256(v + 2, _mm256_permute2x128_si256(u2, u6, 0x20));
    _mm256_store_si256(v + 3, _mm256_permute2x128_si256(u3, u7, 0x20));
    _mm256_store_si256(v + 4, _mm256_permute2x128_si256(u0, u4, 0x31));
    _mm256_store_si256(v + 5, _mm256_permute2x128_si256(u1, u5, 0x31));
    _mm256_store_si256(v + 6, _mm256_permute2x128_si256(u2, u6, 0x31));
    _mm256_store_si256(v + 7, _mm256_permute2x128_si256(u3, u7, 0x31));
}

/* _mm256_hadd_ps / _mm256_hadd_epi32: {a0+a1, a2+a3, b0+b1, b2+b3} in each 128-bit lane, the same additions (so the
 * same bits). The AVX-512 variant computes them with two shuffles and an add: vphadd has no EVEX form, so where the
 * compiler keeps values in ymm16-31 it copies them to ymm0-15 around each one, and that measured slow (a Xeon with
 * AVX-512, one-token rows of the 8-bit block type in L2: 2.8 ns a block with vphaddd, 0.96 with the shuffles; 1.15
 * for the AVX2 variant, whose code never sees ymm16-31). */
TARGET_INLINE __m256 FN(hadd_ps)(__m256 a, __m256 b) {
#if SIMD_AVX512
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
#else
    return _mm256_hadd_ps(a, b);
#endif
}
TARGET_INLINE __m256i FN(hadd_epi32)(__m256i a, __m256i b) {
#if SIMD_AVX512
    const __m256 fa = _mm256_castsi256_ps(a), fb = _mm256_castsi256_ps(b);
    return _mm256_add_epi32(_mm256_castps_si256(_mm256_shuffle_ps(fa, fb, 0x88)),
                            _mm256_castps_si256(_mm256_shuffle_ps(fa, fb, 0xDD)));
#else
    return _mm256_hadd_epi32(a, b);
#endif
}
