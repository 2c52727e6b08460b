/* SIMD body of pi_top_about_k's pass (select.c), compiled twice through simd_variants.h; only the AVX-512 variant
 * has one (select_above_avx512), the AVX2 level runs the scalar pass. */

#define SIMD_CAT_(a, b) a##_##b
#define SIMD_CAT(a, b) SIMD_CAT_(a, b)
#define FN(name) SIMD_CAT(name, SIMD_SUFFIX)
#define TARGET __attribute__((target(SIMD_TARGET)))

#if SIMD_AVX512
/* select_above over all of s with AVX-512, 16 keys at a time (key_of's mapping on vectors: NaN 0, -0 as +0), the
 * selected lanes listed in order; the same count, indices and largest key left out. A scalar pass took ~60 us of
 * the sparse head's ~1.3 ms a token on SmolLM2's 49152 logits. */
TARGET static int64_t FN(select_above)(const float *s, int64_t n, uint32_t lo, int64_t cap, int64_t *idx,
                                       uint32_t *left, int *any_left) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u), magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512i inf = _mm512_set1_epi32(0x7F800000), ones = _mm512_set1_epi32(-1), zero = _mm512_setzero_si512();
    const __m512i vlo = _mm512_set1_epi32((int)lo);
    __m512i vleft = zero;
    __mmask16 any = 0;
    int64_t count = 0, i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i b = _mm512_loadu_si512((const void *)(s + i));
        const __m512i a = _mm512_and_si512(b, magnitude);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, inf);
        const __mmask16 neg = _mm512_test_epi32_mask(b, sign) & (__mmask16)~_mm512_cmpeq_epi32_mask(a, zero);
        __m512i key = _mm512_mask_xor_epi32(_mm512_or_si512(b, sign), neg, b, ones); /* -0: b | sign, +0's key */
        key = _mm512_mask_mov_epi32(key, nan, zero);
        const __mmask16 sel = _mm512_cmpge_epu32_mask(key, vlo), rest = (__mmask16)~sel;
        vleft = _mm512_mask_max_epu32(vleft, rest, vleft, key);
        any |= rest;
        for (unsigned bits = sel; bits != 0; bits &= bits - 1) {
            if (count < cap) idx[count] = i + __builtin_ctz(bits);
            count++;
        }
    }
    uint32_t l = _mm512_reduce_max_epu32(vleft);
    int any_l = any != 0;
    count = select_above(s, i, n, lo, cap, count, idx, &l, &any_l);
    *left = l;
    *any_left = any_l;
    return count;
}
#endif

#undef TARGET
#undef FN
#undef SIMD_CAT
#undef SIMD_CAT_
