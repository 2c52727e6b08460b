/* Shared by the SIMD bodies (matmul_x86.h, matmul_q8k_x86.h): included inside each variant's pass, so no include
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
