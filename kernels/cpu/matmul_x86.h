/* SIMD bodies of the matmul kernels, compiled twice through simd_variants.h (from matmul.c):
 *   SIMD_SUFFIX avx2,   SIMD_TARGET "avx2,fma,f16c",                 SIMD_AVX512 0
 *   SIMD_SUFFIX avx512, SIMD_TARGET "...,avx512f,avx512bw,avx512vl,avx512vnni", SIMD_AVX512 1
 *
 * The int8 tiles of the block-32 types work on 256-bit vectors in both variants, 8 blocks per step: each block's
 * exact integer dot in one lane, one float product and FMA per lane, one fixed horizontal sum at the end (the
 * AVX-512 variant also runs 16-row prompt panels in 512-bit vectors, lane by lane the same steps). They differ only in the u8 x s8 dot product: AVX2 uses maddubs+madd, AVX-512 uses
 * VNNI dpbusd. The integer results are equal (no int16 saturation is reachable: |u| <= 128, |s| <= 127) and the
 * float accumulation is the same, so both variants give bit-identical output, and a token's result depends neither
 * on T nor on the thread count. F32/F16 use 512-bit vectors in the AVX-512 variant.
 */

#define SIMD_CAT_(a, b) a##_##b
#define SIMD_CAT(a, b) SIMD_CAT_(a, b)
#define FN(name) SIMD_CAT(name, SIMD_SUFFIX)
#define TARGET __attribute__((target(SIMD_TARGET)))
#define TARGET_INLINE static inline __attribute__((target(SIMD_TARGET), always_inline))

#include "simd_shuffle.h"

TARGET_INLINE float FN(hsum256)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* acc + sum over each group of 4 bytes of u (unsigned) * s (signed), as 8 int32 lanes */
TARGET_INLINE __m256i FN(dot_u8s8)(__m256i acc, __m256i u, __m256i s) {
#if SIMD_AVX512
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* ---- activation quantisation: 32 floats -> 32 int8 with scale d = amax / 127 ------------------------ */

TARGET static void FN(quantize_act)(const float *x, int64_t nb, int8_t *qs, float *ds, int32_t *isum) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < nb; i++) {
        const float *xb = x + i * QK;
        const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        const __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 amax = _mm256_max_ps(_mm256_andnot_ps(sign_bit, v0), _mm256_andnot_ps(sign_bit, v1));
        amax = _mm256_max_ps(amax, _mm256_max_ps(_mm256_andnot_ps(sign_bit, v2), _mm256_andnot_ps(sign_bit, v3)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float am = _mm_cvtss_f32(m);
        const __m256 inv = _mm256_set1_ps(am != 0.0f ? 127.0f / am : 0.0f);
        /* cvtps rounds half to even, like rintf in the scalar path */
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv));
        const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
        /* packs interleave 128-bit lanes: 32-bit groups come out as i0a i1a i2a i3a | i0b i1b i2b i3b */
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(qs + i * QK), packed);
        const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
        const int32_t total = _mm_cvtsi128_si32(s4);
        ds[2 * i] = am / 127.0f;
        ds[2 * i + 1] = ds[2 * i] * (float)total;
        isum[i] = total;
    }
}

/* ---- quantised weight x quantised activation tiles ------------------------------------------------------ */

/* 32 weights of a Q4 block as unsigned bytes 0..15 in element order */
TARGET_INLINE __m256i FN(unpack_q4)(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

/* 32 weights of a Q5 block as unsigned bytes 0..31 in element order: the nibbles, and bit j of qh (little endian)
 * as 16 in byte j. qh is spread with one byte shuffle (byte j takes qh byte j / 8), the bit 1 << (j % 8) of
 * each byte kept and compared to itself: 0xFF where set, masked to 0x10. */
TARGET_INLINE __m256i FN(unpack_q5)(const uint8_t *qh_bytes, const uint8_t *qs) {
    uint32_t qh;
    memcpy(&qh, qh_bytes, sizeof qh);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)qh), _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                       0x0303030303030303LL));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_or_si256(FN(unpack_q4)(qs), _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}

/* Lane j of the result: the sum of the 8 lanes of p_j (exact integers, so any order gives the same value). */
TARGET_INLINE __m256i FN(sum8_epi32)(const __m256i *p) {
    const __m256i a = FN(hadd_epi32)(FN(hadd_epi32)(p[0], p[1]), FN(hadd_epi32)(p[2], p[3]));
    const __m256i b = FN(hadd_epi32)(FN(hadd_epi32)(p[4], p[5]), FN(hadd_epi32)(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* The group tiles' block-32 types (Q4_0, Q4_1, Q5_0, Q5_1; Q8_0 for the block size): bytes per block, whether it
 * has a minimum m (after d), whether it is a 5-bit type (qh after d and m). KIND is a constant after inlining. */
#define QX_BSZ(kind)                                                                                              \
    ((kind) == PI_TYPE_Q4_0 ? (int64_t)sizeof(block_q4_0)                                                         \
     : (kind) == PI_TYPE_Q4_1 ? (int64_t)sizeof(block_q4_1)                                                       \
     : (kind) == PI_TYPE_Q5_0 ? (int64_t)sizeof(block_q5_0)                                                       \
     : (kind) == PI_TYPE_Q5_1 ? (int64_t)sizeof(block_q5_1)                                                       \
                              : (int64_t)sizeof(block_q8_0))
#define QX_HAS_MIN(kind) ((kind) == PI_TYPE_Q4_1 || (kind) == PI_TYPE_Q5_1)
#define QX_IS_Q5(kind) ((kind) == PI_TYPE_Q5_0 || (kind) == PI_TYPE_Q5_1)

/* The 32 weights of a Q4_0 / Q4_1 / Q5_0 / Q5_1 block at blk as unsigned bytes (0..15, 0..31) in element order */
TARGET_INLINE __m256i FN(unpack_qx)(const int kind, const uint8_t *blk) {
    const int head = QX_HAS_MIN(kind) ? 4 : 2; /* d (and m) lead the block */
    return QX_IS_Q5(kind) ? FN(unpack_q5)(blk + head, blk + head + 4) : FN(unpack_q4)(blk + head);
}

/* q . x per block less the stored offset times sum(x) (Q4_0: 8, Q5_0: 16; the types with a minimum have none) */
TARGET_INLINE __m256i FN(qx_offset)(const int kind, __m256i q, __m256i isum) {
    if (kind == PI_TYPE_Q4_0) return _mm256_sub_epi32(q, _mm256_slli_epi32(isum, 3));
    if (kind == PI_TYPE_Q5_0) return _mm256_sub_epi32(q, _mm256_slli_epi32(isum, 4));
    return q;
}

/* the halves at p + j * stride, j < 8 (8 blocks' d or m), as floats */
TARGET_INLINE __m256 FN(halves8)(const uint8_t *p, int64_t stride) {
    uint16_t h[8];
    for (int j = 0; j < 8; j++) memcpy(&h[j], p + j * stride, 2);
    return _mm256_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], (short)h[4],
                                          (short)h[5], (short)h[6], (short)h[7]));
}

/* Q4_0 / Q4_1 / Q5_0 / Q5_1 rows, 8 blocks per step: block i + j's exact integer dot q . x (Q4_0: - 8 sum(x),
 * Q5_0: - 16 sum(x)) lands in lane j, is converted once and multiplied by d_w d_x (one float product) into lane j of
 * the token's accumulator, and Q4_1 / Q5_1 add m_w (d_x sum(x)) there (one product, one add); a last partial group
 * fills lanes 0.. and leaves the others at 0 (an exact no-op); hsum256 sums the lanes. The same steps for every
 * ntok, thread count and SIMD variant (dpbusd and maddubs + madd give the same integers: a Q5 pair is at most
 * 2 x 31 x 127), so a token's result does not depend on its batch. The row's 8 blocks are unpacked once per step
 * into `wu` and shared by the ntok tokens. */
TARGET_INLINE __m256 FN(q4_group)(const int kind, const uint8_t *wu, const int8_t *xq, __m256i isum, __m256 scale,
                                  __m256 bias, __m256 acc) {
    __m256i p[8];
#define Q4G_DOT(j)                                                                                            \
    p[j] = FN(dot_u8s8)(_mm256_setzero_si256(), _mm256_load_si256((const __m256i *)(wu + (j) * QK)),          \
                        _mm256_loadu_si256((const __m256i *)(xq + (j) * QK)))
    Q4G_DOT(0); Q4G_DOT(1); Q4G_DOT(2); Q4G_DOT(3); Q4G_DOT(4); Q4G_DOT(5); Q4G_DOT(6); Q4G_DOT(7);
#undef Q4G_DOT
    const __m256i q = FN(qx_offset)(kind, FN(sum8_epi32)(p), isum);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale, acc);
    return QX_HAS_MIN(kind) ? _mm256_add_ps(acc, bias) : acc;
}

/* the even (d_x) or odd (d_x sum(x)) entries of 8 blocks' {d, d sum} pairs, in block order */
TARGET_INLINE __m256 FN(act_pairs)(const float *ds, const int odd) {
    const __m256 e = odd ? _mm256_shuffle_ps(_mm256_loadu_ps(ds), _mm256_loadu_ps(ds + 8), 0xDD)
                         : _mm256_shuffle_ps(_mm256_loadu_ps(ds), _mm256_loadu_ps(ds + 8), 0x88);
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8)); /* {0 1 4 5 | 2 3 6 7} -> order */
}

/* The last n < 8 blocks of a row from block g: lane j < n of the masks, of the weights' d (and m) and of the
 * activations' d_x (and d_x sum(x), isum); 0 in the other lanes. Masked loads and clamped block indices: no
 * scalar stores read back as vectors (a store-forwarding stall each) and nothing read past the row. */
TARGET_INLINE __m256i FN(tail_lanes)(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
/* 8 halves at p + j * stride for j < n (block j's d or m), as floats, 0 from lane n */
TARGET_INLINE __m256 FN(tail_halves)(const uint8_t *p, int64_t stride, int n, __m256i lanes) {
    uint16_t h[8];
    for (int j = 0; j < 8; j++) memcpy(&h[j], p + (j < n ? j : n - 1) * stride, 2);
    const __m128i v = _mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], (short)h[4], (short)h[5],
                                     (short)h[6], (short)h[7]);
    return _mm256_and_ps(_mm256_cvtph_ps(v), _mm256_castsi256_ps(lanes));
}
/* the even (odd) entries of n blocks' {d, d sum} pairs at ds, in block order, 0 from lane n */
TARGET_INLINE __m256 FN(tail_pairs)(const float *ds, int n, const int odd) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 lo = _mm256_maskload_ps(ds, _mm256_cmpgt_epi32(_mm256_set1_epi32(2 * n), idx));
    const __m256 hi = _mm256_maskload_ps(ds + 8, _mm256_cmpgt_epi32(_mm256_set1_epi32(2 * n - 8), idx));
    const __m256 e = odd ? _mm256_shuffle_ps(lo, hi, 0xDD) : _mm256_shuffle_ps(lo, hi, 0x88);
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8));
}

/* The exact integers q . x of 8 consecutive 4-bit blocks (block i's 16 nibble bytes at qs + i * bsz) against the
 * pair-ordered activations (act_pair_order), in block order: blocks 2j and 2j + 1 share one vector of raw nibbles,
 * so one mask and one shift unpack two blocks.
 * - AVX2: maddubs into int16 (exact: a pair is at most 2 * 15 * 127, the two hadd levels sum 16 products, at most
 *   30480), int16 hadd levels, madd to int32.
 * - AVX-512 (VNNI): two dpbusd per pair into int32 ({block 2j: 4 partial sums | block 2j + 1: 4}), two levels of
 *   hadd_epi32 (the shuffle form: vphadd has no EVEX encoding). */
TARGET_INLINE __m256i FN(q4_pairs_dots)(const uint8_t *qs, const int64_t bsz, const int8_t *xp) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i s[4];
    for (int j = 0; j < 4; j++) {
        const __m256i raw =
            _mm256_loadu2_m128i((const __m128i *)(qs + (2 * j + 1) * bsz), (const __m128i *)(qs + 2 * j * bsz));
        const __m256i wl = _mm256_and_si256(raw, m4), wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        const __m256i xl = _mm256_loadu_si256((const __m256i *)(xp + 2 * j * QK));
        const __m256i xh = _mm256_loadu_si256((const __m256i *)(xp + 2 * j * QK + QK));
#if SIMD_AVX512
        s[j] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), wl, xl), wh, xh);
#else
        s[j] = _mm256_add_epi16(_mm256_maddubs_epi16(wl, xl), _mm256_maddubs_epi16(wh, xh));
#endif
    }
#if SIMD_AVX512
    const __m256i sums = FN(hadd_epi32)(FN(hadd_epi32)(s[0], s[1]), FN(hadd_epi32)(s[2], s[3]));
#else
    const __m256i sums = _mm256_madd_epi16(
        _mm256_hadd_epi16(_mm256_hadd_epi16(s[0], s[1]), _mm256_hadd_epi16(s[2], s[3])), _mm256_set1_epi16(1));
#endif
    return _mm256_permutevar8x32_epi32(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* One token's Q4_0 group of 8 blocks from the pair-ordered activations: each block's q . x (q4_pairs_dots), the
 * integers of q4_group, then its float steps, so the row's result is the same bits as without the pair order. The 8
 * scales: AVX2 inserts them one by one, AVX-512 picks them (halves 0, 9, ..., 63 of the group's first 128 bytes) by
 * one two-register word permute. */
TARGET_INLINE __m256 FN(q4_0_pairs_group)(const block_q4_0 *b, const int8_t *xp, const int32_t *isum, const float *ds,
                                          __m256 acc) {
    const __m256i dots = FN(q4_pairs_dots)(b->qs, (int64_t)sizeof(block_q4_0), xp);
#if SIMD_AVX512
    const __m512i scale_idx = _mm512_setr_epi32(0x00090000, 0x001B0012, 0x002D0024, 0x003F0036, 0, 0, 0, 0, 0, 0, 0,
                                                0, 0, 0, 0, 0);
    const __m128i dh = _mm512_castsi512_si128(_mm512_permutex2var_epi16(
        _mm512_loadu_si512((const void *)b), scale_idx, _mm512_loadu_si512((const void *)((const uint8_t *)b + 64))));
#else
    const __m128i dh = _mm_setr_epi16((short)b[0].d, (short)b[1].d, (short)b[2].d, (short)b[3].d, (short)b[4].d,
                                      (short)b[5].d, (short)b[6].d, (short)b[7].d);
#endif
    const __m256i q = _mm256_sub_epi32(dots, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)isum), 3));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(_mm256_cvtph_ps(dh), FN(act_pairs)(ds, 0)), acc);
}

/* The same for Q4_1: q4_group's integers (q . x per block, no offset) and float steps (one FMA with d_w d_x, then
 * m_w (d_x sum(x)) added), from the pair-ordered activations, so one token's Q4_1 row costs what a Q4_0 row does and
 * keeps the bits of the tiles and of the panels (tile8_quant). AVX-512 picks the 8 blocks' {d, m} words (20-byte blocks)
 * from the group's first 128 bytes by one two-register permute, the last block's apart (a gather was slower in decode). */
TARGET_INLINE __m256 FN(q4_1_pairs_group)(const block_q4_1 *b, const int8_t *xp, const float *ds, __m256 acc) {
    const __m256i dots = FN(q4_pairs_dots)(b->qs, (int64_t)sizeof(block_q4_1), xp);
    /* {d, m} of block k: the 32-bit word at byte 20 k (dword 5 k); d its low half, m its high half */
#if SIMD_AVX512
    const __m512i words = _mm512_permutex2var_epi32(
        _mm512_loadu_si512((const void *)b), _mm512_setr_epi32(0, 5, 10, 15, 20, 25, 30, 0, 0, 0, 0, 0, 0, 0, 0, 0),
        _mm512_loadu_si512((const void *)((const uint8_t *)b + 64)));
    int32_t last;
    memcpy(&last, &b[7].d, sizeof last);
    const __m256i dm = _mm256_mask_set1_epi32(_mm512_castsi512_si256(words), 0x80, last);
    const __m256 dw = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(dm));
    const __m256 mw = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(dm, 16)));
#else
    const __m256 dw = _mm256_cvtph_ps(_mm_setr_epi16((short)b[0].d, (short)b[1].d, (short)b[2].d, (short)b[3].d,
                                                     (short)b[4].d, (short)b[5].d, (short)b[6].d, (short)b[7].d));
    const __m256 mw = _mm256_cvtph_ps(_mm_setr_epi16((short)b[0].m, (short)b[1].m, (short)b[2].m, (short)b[3].m,
                                                     (short)b[4].m, (short)b[5].m, (short)b[6].m, (short)b[7].m));
#endif
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(dw, FN(act_pairs)(ds, 0)), acc);
    return _mm256_add_ps(acc, _mm256_mul_ps(mw, FN(act_pairs)(ds, 1)));
}

#if SIMD_AVX512
/* One token's last n < 8 Q4_0 / Q4_1 blocks of a row (at p) as a whole group against the act_tail's zero-padded
 * activations: masked loads (nothing read past the row, no fault) give zero nibbles and zero scales from block n,
 * so every lane holds what the tile's tail computes (the exact dot, d_w d_x, m_w d_x sum(x); 0 past block n) and
 * the float steps are q4_0_pairs_group's / q4_1_pairs_group's: the tile's bits. SmolLM2's 576-wide rows end in a
 * tail of 2 blocks that cost as much as 10 blocks the tile's way. */
TARGET_INLINE __m256 FN(q4x_tail_group)(const int kind, const uint8_t *p, const int n, const act_tail *tl, __m256 acc) {
    const int64_t bsz = QX_BSZ(kind);
    const int64_t bytes = n * bsz; /* < 8 * 20 */
    const __mmask64 m0 = bytes >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << bytes) - 1);
    const __mmask64 m1 = bytes >= 128 ? ~(__mmask64)0 : bytes <= 64 ? 0 : (((__mmask64)1 << (bytes - 64)) - 1);
    const __m512i v0 = _mm512_maskz_loadu_epi8(m0, p), v1 = _mm512_maskz_loadu_epi8(m1, p + 64);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int64_t qs_off = kind == PI_TYPE_Q4_0 ? 2 : 4; /* the nibbles after d (and m) */
    __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int j = 0; 2 * j < n; j++) { /* the pairs holding a block: the others' integers are 0 */
        const __m128i a0 = _mm_loadu_si128((const __m128i *)(p + 2 * j * bsz + qs_off));
        const __m128i a1 = _mm_maskz_loadu_epi8(2 * j + 1 < n ? 0xFFFF : 0, p + (2 * j + 1) * bsz + qs_off);
        const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(a0), a1, 1);
        const __m256i wl = _mm256_and_si256(raw, m4), wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        const __m256i xl = _mm256_loadu_si256((const __m256i *)(tl->qp + 2 * j * QK));
        const __m256i xh = _mm256_loadu_si256((const __m256i *)(tl->qp + 2 * j * QK + QK));
        s[j] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), wl, xl), wh, xh);
    }
    const __m256i sums = FN(hadd_epi32)(FN(hadd_epi32)(s[0], s[1]), FN(hadd_epi32)(s[2], s[3]));
    const __m256i dots = _mm256_permutevar8x32_epi32(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (kind == PI_TYPE_Q4_0) {
        const __m512i scale_idx = _mm512_setr_epi32(0x00090000, 0x001B0012, 0x002D0024, 0x003F0036, 0, 0, 0, 0, 0, 0,
                                                    0, 0, 0, 0, 0, 0);
        const __m128i dh = _mm512_castsi512_si128(_mm512_permutex2var_epi16(v0, scale_idx, v1));
        const __m256i q = _mm256_sub_epi32(dots, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)tl->isum), 3));
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(_mm256_cvtph_ps(dh), FN(act_pairs)(tl->ds, 0)),
                               acc);
    }
    /* Q4_1: {d, m} of block k at dword 5 k; block 7 is past n here (zero) */
    const __m512i words =
        _mm512_permutex2var_epi32(v0, _mm512_setr_epi32(0, 5, 10, 15, 20, 25, 30, 0, 0, 0, 0, 0, 0, 0, 0, 0), v1);
    const __m256i dm = _mm256_mask_set1_epi32(_mm512_castsi512_si256(words), 0x80, 0);
    const __m256 dw = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(dm));
    const __m256 mw = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(dm, 16)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(dw, FN(act_pairs)(tl->ds, 0)), acc);
    return _mm256_add_ps(acc, _mm256_mul_ps(mw, FN(act_pairs)(tl->ds, 1)));
}
#endif

TARGET_INLINE void FN(tile_q4x_n)(const int kind, const uint8_t *row, const act_q8 *a, int64_t t0, const int ntok,
                                  float *out) {
    const block_q4_0 *b0 = (const block_q4_0 *)row;
    const block_q4_1 *b1 = (const block_q4_1 *)row;
    const int64_t nb = a->nb, K = a->K;
    const int64_t bsz = QX_BSZ(kind);
    _Alignas(32) uint8_t wu[8 * QK];
    __m256 acc[TILE_T];
    for (int t = 0; t < ntok; t++) acc[t] = _mm256_setzero_ps();
    int64_t g = 0;
    if (kind == PI_TYPE_Q4_0 && ntok == 1 && t0 == 0 && a->qp != NULL)
        for (; g + 8 <= nb; g += 8) {
            prefetch_act(a, row + g * bsz, 8 * bsz);
            acc[0] = FN(q4_0_pairs_group)(b0 + g, a->qp + g * QK, a->isum + g, a->ds + 2 * g, acc[0]);
        }
    if (kind == PI_TYPE_Q4_1 && ntok == 1 && t0 == 0 && a->qp != NULL)
        for (; g + 8 <= nb; g += 8) {
            prefetch_act(a, row + g * bsz, 8 * bsz);
            acc[0] = FN(q4_1_pairs_group)(b1 + g, a->qp + g * QK, a->ds + 2 * g, acc[0]);
        }
#if SIMD_AVX512
    if ((kind == PI_TYPE_Q4_0 || kind == PI_TYPE_Q4_1) && ntok == 1 && t0 == 0 && a->tail != NULL && g < nb) {
        acc[0] = FN(q4x_tail_group)(kind, row + g * bsz, (int)(nb - g), a->tail, acc[0]);
        g = nb;
    }
#endif
    for (; g + 8 <= nb; g += 8) {
        const uint8_t *first = row + g * bsz;
        prefetch_act(a, first, 8 * bsz);
        for (int j = 0; j < 8; j++) _mm256_store_si256((__m256i *)(wu + j * QK), FN(unpack_qx)(kind, first + j * bsz));
        const __m256 dw = FN(halves8)(first, bsz);
        const __m256 mw = QX_HAS_MIN(kind) ? FN(halves8)(first + 2, bsz) : _mm256_setzero_ps();
        for (int t = 0; t < ntok; t++) {
            const int64_t tt = t0 + t;
            const float *ds = a->ds + (tt * nb + g) * 2;
            const __m256i isum = _mm256_loadu_si256((const __m256i *)(a->isum + tt * nb + g));
            const __m256 bias = QX_HAS_MIN(kind) ? _mm256_mul_ps(mw, FN(act_pairs)(ds, 1)) : _mm256_setzero_ps();
            acc[t] = FN(q4_group)(kind, wu, a->qs + tt * K + g * QK, isum, _mm256_mul_ps(dw, FN(act_pairs)(ds, 0)),
                                  bias, acc[t]);
        }
    }
    if (g < nb) { /* the last n < 8 blocks: zero dots, scales and sums in the unused lanes (exact no-ops) */
        const int n = (int)(nb - g);
        const uint8_t *first = row + g * bsz;
        const __m256i lanes = FN(tail_lanes)(n);
        __m256i w[8];
        for (int j = 0; j < n; j++) w[j] = FN(unpack_qx)(kind, first + j * bsz);
        const __m256 dw = FN(tail_halves)(first, bsz, n, lanes);
        const __m256 mw = QX_HAS_MIN(kind) ? FN(tail_halves)(first + 2, bsz, n, lanes) : _mm256_setzero_ps();
        for (int t = 0; t < ntok; t++) {
            const int64_t tt = t0 + t;
            const int8_t *xq = a->qs + tt * K + g * QK;
            const float *ds = a->ds + (tt * nb + g) * 2;
            __m256i p[8];
            for (int j = 0; j < 8; j++)
                p[j] = j < n ? FN(dot_u8s8)(_mm256_setzero_si256(), w[j], _mm256_loadu_si256((const __m256i *)(xq + j * QK)))
                             : _mm256_setzero_si256();
            const __m256i q = FN(qx_offset)(kind, FN(sum8_epi32)(p), _mm256_maskload_epi32(a->isum + tt * nb + g, lanes));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(dw, FN(tail_pairs)(ds, n, 0)), acc[t]);
            if (QX_HAS_MIN(kind)) acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(mw, FN(tail_pairs)(ds, n, 1)));
        }
    }
    for (int t = 0; t < ntok; t++) out[t] = FN(hsum256)(acc[t]);
}

/* Q8_0 rows like Q4_0 rows: 8 blocks per step, block i + j's exact integer dot |q| . sign(x, q) in lane j, one
 * float product d_w d_x and one FMA per lane, hsum256 at the end; the panels of 8 rows (tile8_q8_0) repeat it. */
TARGET_INLINE __m256 FN(q8_0_group)(const __m256i *w, const int8_t *xq, __m256 scale, __m256 acc) {
    __m256i p[8];
    for (int j = 0; j < 8; j++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + j * QK));
        p[j] = FN(dot_u8s8)(_mm256_setzero_si256(), _mm256_sign_epi8(w[j], w[j]), _mm256_sign_epi8(xv, w[j]));
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(FN(sum8_epi32)(p)), scale, acc);
}

TARGET_INLINE void FN(tile_q8_0_n)(const uint8_t *row, const act_q8 *a, int64_t t0, const int ntok, float *out) {
    const block_q8_0 *b = (const block_q8_0 *)row;
    const int64_t nb = a->nb, K = a->K;
    __m256i w[8];
    __m256 acc[TILE_T];
    for (int t = 0; t < ntok; t++) acc[t] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= nb; g += 8) {
        prefetch_act(a, (const uint8_t *)(b + g), 8 * (int64_t)sizeof(block_q8_0));
        for (int j = 0; j < 8; j++) w[j] = _mm256_loadu_si256((const __m256i *)b[g + j].qs);
        const __m128i dh = _mm_setr_epi16((short)b[g].d, (short)b[g + 1].d, (short)b[g + 2].d, (short)b[g + 3].d,
                                          (short)b[g + 4].d, (short)b[g + 5].d, (short)b[g + 6].d, (short)b[g + 7].d);
        const __m256 dw = _mm256_cvtph_ps(dh);
        for (int t = 0; t < ntok; t++) {
            const int64_t tt = t0 + t;
            const float *ds = a->ds + (tt * nb + g) * 2;
            const __m256 e = _mm256_shuffle_ps(_mm256_loadu_ps(ds), _mm256_loadu_ps(ds + 8), 0x88);
            const __m256 dx = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8));
            acc[t] = FN(q8_0_group)(w, a->qs + tt * K + g * QK, _mm256_mul_ps(dw, dx), acc[t]);
        }
    }
#if SIMD_AVX512
    if (g < nb && ntok == 1 && t0 == 0 && a->tail != NULL) {
        /* one token's last n < 8 blocks against the act_tail: the dots of those blocks only, summed to the same
         * exact integers in lanes 0..n-1 (0 after) and the same float steps as below: the same bits, ~half the work */
        const int n = (int)(nb - g);
        const act_tail *tl = a->tail;
        for (int j = 0; j < 8; j++) w[j] = _mm256_setzero_si256();
        for (int j = 0; j < n; j++) {
            const __m256i wj = _mm256_loadu_si256((const __m256i *)b[g + j].qs);
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(tl->qs + j * QK));
            w[j] = FN(dot_u8s8)(_mm256_setzero_si256(), _mm256_sign_epi8(wj, wj), _mm256_sign_epi8(xv, wj));
        }
        __m256i q;
        if (n <= 4) {
            const __m256i s4 = FN(hadd_epi32)(FN(hadd_epi32)(w[0], w[1]), FN(hadd_epi32)(w[2], w[3]));
            q = _mm256_zextsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1)));
        } else {
            q = FN(sum8_epi32)(w);
        }
        const __m256 dw = FN(tail_halves)((const uint8_t *)(b + g), (int64_t)sizeof(block_q8_0), n, FN(tail_lanes)(n));
        acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(dw, FN(act_pairs)(tl->ds, 0)), acc[0]);
        g = nb;
    }
#endif
    if (g < nb) { /* the last n < 8 blocks: zero dots and scales in the unused lanes (exact no-ops) */
        const int n = (int)(nb - g);
        const __m256i lanes = FN(tail_lanes)(n);
        for (int j = 0; j < n; j++) w[j] = _mm256_loadu_si256((const __m256i *)b[g + j].qs);
        const __m256 dw = FN(tail_halves)((const uint8_t *)(b + g), (int64_t)sizeof(block_q8_0), n, lanes);
        for (int t = 0; t < ntok; t++) {
            const int64_t tt = t0 + t;
            const int8_t *xq = a->qs + tt * K + g * QK;
            __m256i p[8];
            for (int j = 0; j < 8; j++) {
                p[j] = _mm256_setzero_si256();
                if (j < n) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + j * QK));
                    p[j] = FN(dot_u8s8)(p[j], _mm256_sign_epi8(w[j], w[j]), _mm256_sign_epi8(xv, w[j]));
                }
            }
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(FN(sum8_epi32)(p)),
                                     _mm256_mul_ps(dw, FN(tail_pairs)(a->ds + (tt * nb + g) * 2, n, 0)), acc[t]);
        }
    }
    for (int t = 0; t < ntok; t++) out[t] = FN(hsum256)(acc[t]);
}

TARGET static void FN(tile_q8_0_g)(const uint8_t *row, const act_q8 *a, int64_t t0, int ntok, float *out) {
    switch (ntok) {
        case 1: FN(tile_q8_0_n)(row, a, t0, 1, out); break;
        case 2: FN(tile_q8_0_n)(row, a, t0, 2, out); break;
        case 3: FN(tile_q8_0_n)(row, a, t0, 3, out); break;
        default: FN(tile_q8_0_n)(row, a, t0, 4, out); break;
    }
}

/* tile_<type>: the ntok-specialised bodies of `body` (tile_q4x_n) for weight kind `kind` */
#define DEFINE_TILE_QUANT_BODY(type, body, kind)                                                            \
    TARGET static void FN(tile_##type)(const uint8_t *row, const act_q8 *a, int64_t t0, int ntok, float *out) { \
        switch (ntok) {                                                                                   \
            case 1: FN(body)(kind, row, a, t0, 1, out); break;                                            \
            case 2: FN(body)(kind, row, a, t0, 2, out); break;                                            \
            case 3: FN(body)(kind, row, a, t0, 3, out); break;                                            \
            default: FN(body)(kind, row, a, t0, 4, out); break;                                           \
        }                                                                                                 \
    }
DEFINE_TILE_QUANT_BODY(q4_0, tile_q4x_n, PI_TYPE_Q4_0)
DEFINE_TILE_QUANT_BODY(q4_1, tile_q4x_n, PI_TYPE_Q4_1)

#if SIMD_AVX512
/* ---- one token over consecutive Q4_0 / Q4_1 rows (the decode's matrices and a MoE token's expert rows) ------- */

/* two matrices (w2): rows of each read in turns of this many (measured, the MoE experts' gate and up rows of the
 * Qwen3-MoE-shaped bench file, -t 1, 170 MB a token: one matrix after the other 13.1-13.5 ms, turns of 8 rows
 * 12.3-12.8, of 1 row 11.8-12.2) */
#define ROWS_Q4_0_PAIR_RUN 1
/* one matrix of at least this many rows: its two halves read in turns (measured, one token, 1 thread, 20 matrices
 * cycled: 5632 x 2048 0.48-0.52 -> 0.41-0.42 ms, 2048 x 5632 0.46-0.51 -> 0.46-0.49; the Qwen3-MoE-shaped bench
 * file's decode 17.6-18.1 -> 16.6-17.6 ms CPU a token, its attention projections and head) */
#define ROWS_Q4_0_SPLIT_MIN 64
#define ROWS_Q4_0_MAX_K 16384 /* the activations rearranged on the stack: longer rows go row by row (tile_q4_0) */

/* One input's activations as the rows kernel reads them: elements 0-15 (xl) and 16-31 (xh) of blocks 4i .. 4i + 3 in
 * vector i, and per group of 8 blocks their d_x (dx) and the term of the block's offset: Q4_0's 8 sum(x) (off),
 * Q4_1's d_x sum(x) (dsx); a last partial group (tail_n blocks) is one more group, from the act_tail (zero past
 * its blocks) */
typedef struct {
    __m512i xl[ROWS_Q4_0_MAX_K / 128], xh[ROWS_Q4_0_MAX_K / 128];
    __m256 dx[ROWS_Q4_0_MAX_K / 256];
    __m256i off[ROWS_Q4_0_MAX_K / 256];
    __m256 dsx[ROWS_Q4_0_MAX_K / 256];
    int tail_n; /* the blocks of the last partial group (0: none) */
} FN(rows_q4x_input);

/* One group of 8 blocks of a row at p (its last partial group: the first n blocks, zero after, read with masked
 * loads: nothing past the row) against the rearranged activations of the group (xl, xh: 2 vectors each; dx, and off
 * (Q4_0) or dsx (Q4_1)): blocks 0-3 and 4-7 as one 512-bit vector each (4 x 16 nibble bytes), two dpbusd per vector
 * (low nibbles with elements 0-15 of each block, high nibbles with 16-31), the 16 lanes' partial sums folded to one
 * exact integer per block in block order, then tile_q4x_n's float steps (Q4_0: q - 8 sum(x), one product d_w d_x and
 * one FMA into lane j; Q4_1: one FMA with d_w d_x, then m_w d_x sum(x) added). A partial group's lanes past n hold
 * zero integers, scales and sums: what the tile's tail (q4x_tail_group) holds there. */
TARGET_INLINE __m256 FN(group_q4x_x1)(const int kind, const uint8_t *p, const int n, const __m512i *xl,
                                      const __m512i *xh, const __m256 dx, const __m256i off, const __m256 dsx,
                                      __m256 acc) {
    const int64_t bsz = QX_BSZ(kind), qs_off = kind == PI_TYPE_Q4_0 ? 2 : 4;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i fold = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i w[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int h = 0; h < 2 && 4 * h < n; h++) {
        const uint8_t *q = p + h * 4 * bsz + qs_off; /* block 4h's qs */
        if (n == 8) {
            __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)q));
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q + bsz)), 1);
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q + 2 * bsz)), 2);
            w[h] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q + 3 * bsz)), 3);
        } else {
            __m512i v = _mm512_setzero_si512();
            if (4 * h < n) v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)q));
            if (4 * h + 1 < n) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q + bsz)), 1);
            if (4 * h + 2 < n) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q + 2 * bsz)), 2);
            if (4 * h + 3 < n) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q + 3 * bsz)), 3);
            w[h] = v;
        }
    }
    __m512i s[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int h = 0; h < 2 && 4 * h < n; h++) { /* a partial group of at most 4 blocks: blocks 4-7 are 0 */
        const __m512i lo = _mm512_and_si512(w[h], m4), hi = _mm512_and_si512(_mm512_srli_epi16(w[h], 4), m4);
        s[h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl[h]), hi, xh[h]);
    }
    /* 128-bit lane l of s[h]: block 4h + l's 4 partial sums -> [a_l, a_l, b_l, b_l] per lane -> block order */
    const __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi64(s[0], s[1]), _mm512_unpackhi_epi64(s[0], s[1]));
    const __m512i u = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_CDAB));
    const __m256i dots = _mm512_castsi512_si256(_mm512_permutexvar_epi32(fold, u));
    __m512i lo64, hi64;
    if (n == 8) {
        lo64 = _mm512_loadu_si512((const void *)p);
        hi64 = _mm512_loadu_si512((const void *)(p + 64));
    } else {
        const int64_t bytes = n * bsz; /* < 8 * 20 */
        const __mmask64 m0 = bytes >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << bytes) - 1);
        const __mmask64 m1 = bytes >= 128 ? ~(__mmask64)0 : bytes <= 64 ? 0 : (((__mmask64)1 << (bytes - 64)) - 1);
        lo64 = _mm512_maskz_loadu_epi8(m0, p);
        hi64 = _mm512_maskz_loadu_epi8(m1, p + 64);
    }
    if (kind == PI_TYPE_Q4_0) {
        const __m512i scale_idx = _mm512_setr_epi32(0x00090000, 0x001B0012, 0x002D0024, 0x003F0036, 0, 0, 0, 0, 0, 0, 0,
                                                    0, 0, 0, 0, 0);
        const __m128i dh = _mm512_castsi512_si128(_mm512_permutex2var_epi16(lo64, scale_idx, hi64));
        const __m256i q = _mm256_sub_epi32(dots, off);
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(_mm256_cvtph_ps(dh), dx), acc);
    }
    /* Q4_1: {d, m} of block k at dword 5 k; block 7's (byte 140) apart, as q4_1_pairs_group (0 in a partial group) */
    const __m512i words =
        _mm512_permutex2var_epi32(lo64, _mm512_setr_epi32(0, 5, 10, 15, 20, 25, 30, 0, 0, 0, 0, 0, 0, 0, 0, 0), hi64);
    int32_t last = 0;
    if (n == 8) memcpy(&last, p + 7 * bsz, sizeof last);
    const __m256i dm = _mm256_mask_set1_epi32(_mm512_castsi512_si256(words), 0x80, last);
    const __m256 dw = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(dm));
    const __m256 mw = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(dm, 16)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(dw, dx), acc);
    return _mm256_add_ps(acc, _mm256_mul_ps(mw, dsx));
}

/* One row of ng groups of 8 blocks and a last partial group of tn blocks (0: none) against the rearranged
 * activations (group_q4x_x1 each), hsum256 at the end: every integer exact and every float step the row tile's, so
 * the result is tile_q4_0's / tile_q4_1's at ntok = 1. */
TARGET_INLINE float FN(row_q4x_x1)(const int kind, const uint8_t *row, const FN(rows_q4x_input) *in, const act_q8 *a,
                                   const int64_t ng, const int tn) {
    const int64_t bsz = QX_BSZ(kind);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *p = row + g * 8 * bsz;
        prefetch_act(a, p, 8 * bsz);
        acc = FN(group_q4x_x1)(kind, p, 8, in->xl + 2 * g, in->xh + 2 * g, in->dx[g], in->off[g], in->dsx[g], acc);
    }
    if (tn > 0)
        acc = FN(group_q4x_x1)(kind, row + ng * 8 * bsz, tn, in->xl + 2 * ng, in->xh + 2 * ng, in->dx[ng],
                               in->off[ng], in->dsx[ng], acc);
    return FN(hsum256)(acc);
}

/* group g's activations from qs (8 blocks of int8 elements), ds ({d, d sum} per block) and isum (sums) */
TARGET_INLINE void FN(rows_q4x_group_input)(const int kind, const int8_t *qs, const float *ds, const int32_t *isum,
                                            FN(rows_q4x_input) *in, const int64_t g) {
    for (int64_t h = 0; h < 2; h++) { /* blocks 4h .. 4h + 3: qs units [b0 0-15 | b0 16-31 | b1 0-15 | ...] */
        const __m512i q0 = _mm512_loadu_si512((const void *)(qs + h * 4 * QK));
        const __m512i q1 = _mm512_loadu_si512((const void *)(qs + h * 4 * QK + 64));
        in->xl[2 * g + h] = _mm512_shuffle_i32x4(q0, q1, _MM_SHUFFLE(2, 0, 2, 0));
        in->xh[2 * g + h] = _mm512_shuffle_i32x4(q0, q1, _MM_SHUFFLE(3, 1, 3, 1));
    }
    in->dx[g] = FN(act_pairs)(ds, 0);
    in->off[g] = kind == PI_TYPE_Q4_0 ? _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)isum), 3)
                                      : _mm256_setzero_si256();
    in->dsx[g] = kind == PI_TYPE_Q4_0 ? _mm256_setzero_ps() : FN(act_pairs)(ds, 1);
}

TARGET_INLINE void FN(rows_q4x_prepare)(const int kind, const act_q8 *a, FN(rows_q4x_input) *in) {
    const int64_t ng = a->nb / 8;
    for (int64_t g = 0; g < ng; g++)
        FN(rows_q4x_group_input)(kind, a->qs + g * 8 * QK, a->ds + 2 * 8 * g, a->isum + 8 * g, in, g);
    in->tail_n = (int)(a->nb % 8);
    if (in->tail_n > 0) FN(rows_q4x_group_input)(kind, a->tail->qs, a->tail->ds, a->tail->isum, in, ng);
}

TARGET_INLINE void FN(rows_q4x_n)(const int kind, const uint8_t *w, int64_t stride, const uint8_t *w2, int64_t stride2,
                                  int64_t n, const FN(rows_q4x_input) *in, const FN(rows_q4x_input) *in2,
                                  const act_q8 *a, float *y, float *y2, const int64_t ng, const int tn) {
    if (w2 == NULL) { /* one matrix: its two halves read in turns (two streams in flight) */
        const int64_t h = n >= ROWS_Q4_0_SPLIT_MIN ? n / 2 : 0;
        for (int64_t r = 0; r < h; r++) {
            y[r] = FN(row_q4x_x1)(kind, w + r * stride, in, a, ng, tn);
            y[h + r] = FN(row_q4x_x1)(kind, w + (h + r) * stride, in, a, ng, tn);
        }
        for (int64_t r = 2 * h; r < n; r++) y[r] = FN(row_q4x_x1)(kind, w + r * stride, in, a, ng, tn);
        return;
    }
    for (int64_t r0 = 0; r0 < n; r0 += ROWS_Q4_0_PAIR_RUN) {
        const int64_t r1 = min_i64(r0 + ROWS_Q4_0_PAIR_RUN, n);
        for (int64_t r = r0; r < r1; r++) y[r] = FN(row_q4x_x1)(kind, w + r * stride, in, a, ng, tn);
        for (int64_t r = r0; r < r1; r++) y2[r] = FN(row_q4x_x1)(kind, w2 + r * stride2, in2, a, ng, tn);
    }
}

/* y[r] = row r . x for r < n, the rows stride bytes apart, one token in the q8 precision (a: act_q8_prepare's):
 * the bits of tile_q4_0 / tile_q4_1 at ntok = 1 (a->ahead: its prefetch), without its per-row work on the
 * activations: they are rearranged once per call (rows_q4x_input); w2 (or NULL): a second matrix's rows of the same
 * length against a2 (NULL: a) into y2, read in turns with w's (two streams in flight). Rows up to ROWS_Q4_0_MAX_K,
 * a last partial group of 8 blocks where the activations have its act_tail (as the tile: matmul.h); others row by
 * row through the tile. */
TARGET_INLINE void FN(rows_q4x)(const int kind, tile_quant_fn tile, const uint8_t *w, int64_t stride, const uint8_t *w2,
                                int64_t stride2, int64_t n, const act_q8 *a, const act_q8 *a2, float *y, float *y2) {
    const int64_t nb = a->nb, ng = nb / 8;
    if (a2 == NULL) a2 = a;
    if ((nb % 8 != 0 && (a->tail == NULL || a2->tail == NULL)) || a->K > ROWS_Q4_0_MAX_K || a2->K != a->K) {
        for (int64_t r = 0; r < n; r++) tile(w + r * stride, a, 0, 1, y + r);
        for (int64_t r = 0; w2 != NULL && r < n; r++) tile(w2 + r * stride2, a2, 0, 1, y2 + r);
        return;
    }
    FN(rows_q4x_input) in[2];
    FN(rows_q4x_prepare)(kind, a, &in[0]);
    if (w2 != NULL && a2 != a) FN(rows_q4x_prepare)(kind, a2, &in[1]);
    const FN(rows_q4x_input) *in2 = a2 != a ? &in[1] : &in[0];
    switch (nb) { /* the common row lengths with constant group counts (576 wide: 2 groups and 2 blocks) */
        case 16: FN(rows_q4x_n)(kind, w, stride, w2, stride2, n, &in[0], in2, a, y, y2, 2, 0); break;
        case 18: FN(rows_q4x_n)(kind, w, stride, w2, stride2, n, &in[0], in2, a, y, y2, 2, 2); break;
        case 32: FN(rows_q4x_n)(kind, w, stride, w2, stride2, n, &in[0], in2, a, y, y2, 4, 0); break;
        case 64: FN(rows_q4x_n)(kind, w, stride, w2, stride2, n, &in[0], in2, a, y, y2, 8, 0); break;
        default: FN(rows_q4x_n)(kind, w, stride, w2, stride2, n, &in[0], in2, a, y, y2, ng, (int)(nb % 8)); break;
    }
}

TARGET static void FN(rows_q4_0)(const uint8_t *w, int64_t stride, const uint8_t *w2, int64_t stride2, int64_t n,
                                 const act_q8 *a, const act_q8 *a2, float *y, float *y2) {
    FN(rows_q4x)(PI_TYPE_Q4_0, FN(tile_q4_0), w, stride, w2, stride2, n, a, a2, y, y2);
}

TARGET static void FN(rows_q4_1)(const uint8_t *w, int64_t stride, const uint8_t *w2, int64_t stride2, int64_t n,
                                 const act_q8 *a, const act_q8 *a2, float *y, float *y2) {
    FN(rows_q4x)(PI_TYPE_Q4_1, FN(tile_q4_1), w, stride, w2, stride2, n, a, a2, y, y2);
}
#endif

/* ---- prompts: Q4_0 panels of 8 rows, the rows in the vector lanes ------------------------------------------ */


/* panel bytes per block: Q4_0 / Q4_1 / Q5_0 / Q5_1 8 vectors of 4 weights x 8 rows, then the rows' d and m as
 * floats; Q8_0 the 8 vectors of q (AVX-512: q + 128 as unsigned), AVX2 the 8 of |q| after them, then d */
#define PANEL_Q4X (10 * 32)
#define PANEL_Q8_0 (17 * 32)

/* Eight Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 rows x all tokens. The rows' blocks are first transposed into `panel`:
 * vector j of block b holds weights 4j..4j+3 of each row, row r in 32-bit lane r, so a token's 4 activations of
 * that step (one broadcast) meet all 8 rows in one u8 x s8 dot, and the sums stay in the rows' lanes: no
 * horizontal sum per block. The arithmetic is the row tile's (tile_q4x_n, tile_q8_0_n), row by row: the same exact
 * integer per block (q . x, Q4_0 - 8 sum(x), Q5_0 - 16 sum(x); Q8_0 |q| . sign(x, q), on AVX-512 (q + 128) . x -
 * 128 sum(x)), the same float product d_w d_x and FMA into accumulator b % 8 (the row tile's lane), Q4_1's and
 * Q5_1's m_w (d_x sum(x)) added there, and its hsum256 order at the end ((a0 + a4) + (a2 + a6)) + ((a1 + a5) +
 * (a3 + a7)): the row tile's bits. AVX2 adds the 8 Q4 pair sums of a block in int16 (each <= 2 x 15 x 128: below
 * 2^15) and widens once, the Q5 ones (<= 2 x 31 x 128) 4 at a time; Q8_0 pairs reach 2 x 127 x 128 and widen each. */
TARGET_INLINE void FN(tile8_quant)(const int kind, const uint8_t *const *rows, const act_q8 *a, int64_t T,
                                   uint8_t *panel, float *y, int64_t y_stride) {
    const int64_t nb = a->nb, K = a->K;
    const int64_t bsz = QX_BSZ(kind);
    const int64_t stride = kind == PI_TYPE_Q8_0 ? PANEL_Q8_0 : PANEL_Q4X;
    for (int64_t b = 0; b < nb; b++) {
        __m256i r[8];
        uint16_t dh[8], mh[8];
        for (int i = 0; i < 8; i++) {
            const uint8_t *blk = rows[i] + b * bsz;
            prefetch_act(a, blk, bsz);
            r[i] = kind == PI_TYPE_Q8_0 ? _mm256_loadu_si256((const __m256i *)(blk + 2)) : FN(unpack_qx)(kind, blk);
            memcpy(&dh[i], blk, 2);
            memcpy(&mh[i], QX_HAS_MIN(kind) ? blk + 2 : blk, 2);
        }
        __m256i *v = (__m256i *)(panel + b * stride);
        FN(transpose8_epi32)(r, v);
        if (kind == PI_TYPE_Q8_0) {
#if SIMD_AVX512
            /* q + 128 as unsigned bytes: one dpbusd per step, the exact q . x = (q + 128) . x - 128 sum(x) */
            for (int j = 0; j < 8; j++) _mm256_store_si256(v + j, _mm256_xor_si256(v[j], _mm256_set1_epi8((char)0x80)));
#else
            for (int j = 0; j < 8; j++) _mm256_store_si256(v + 8 + j, _mm256_sign_epi8(v[j], v[j]));
#endif
            _mm256_store_ps((float *)(v + 16), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh)));
        } else {
            _mm256_store_ps((float *)(v + 8), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh)));
            _mm256_store_ps((float *)(v + 9), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mh)));
        }
    }
    for (int64_t t = 0; t < T; t++) {
        const int8_t *xq = a->qs + t * K;
        const float *ds = a->ds + t * nb * 2;
        const int32_t *is = a->isum + t * nb;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0, acc4 = acc0, acc5 = acc0,
               acc6 = acc0, acc7 = acc0;
#define P8_X(xb, j) _mm256_set1_epi32(*(const int32_t *)((xb) + 4 * (j)))
#if SIMD_AVX512
#define P8_Q4(q, v, xb)                                                                                        \
    q = _mm256_setzero_si256();                                                                                \
    for (int j = 0; j < 8; j++) q = _mm256_dpbusd_epi32(q, _mm256_load_si256((v) + j), P8_X(xb, j));
#define P8_Q8_ALL(q, v, xb, isb) \
    P8_Q4(q, v, xb)              \
    q = _mm256_sub_epi32(q, _mm256_slli_epi32(_mm256_set1_epi32(isb), 7));
#else
/* int16 sums of 8 Q4 pairs (at most 8 x 2 x 15 x 128) or of 4 Q5 pairs (4 x 2 x 31 x 128) stay below 2^15 */
#define P8_Q4(q, v, xb)                                                                                        \
    __m256i s16 = _mm256_maddubs_epi16(_mm256_load_si256(v), P8_X(xb, 0));                                     \
    for (int j = 1; j < 4; j++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_load_si256((v) + j), P8_X(xb, j))); \
    if (QX_IS_Q5(kind)) {                                                                                      \
        __m256i h16 = _mm256_maddubs_epi16(_mm256_load_si256((v) + 4), P8_X(xb, 4));                           \
        for (int j = 5; j < 8; j++) h16 = _mm256_add_epi16(h16, _mm256_maddubs_epi16(_mm256_load_si256((v) + j), P8_X(xb, j))); \
        q = _mm256_add_epi32(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)), _mm256_madd_epi16(h16, _mm256_set1_epi16(1))); \
    } else {                                                                                                   \
        for (int j = 4; j < 8; j++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_load_si256((v) + j), P8_X(xb, j))); \
        q = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));                                                      \
    }
#define P8_Q8(q, v, j, xb)                                                                                     \
    q = _mm256_add_epi32(q, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_load_si256((v) + 8 + (j)),          \
                                                                   _mm256_sign_epi8(P8_X(xb, j), _mm256_load_si256((v) + (j)))), \
                                              _mm256_set1_epi16(1)))
#define P8_Q8_ALL(q, v, xb, isb)                       \
    q = _mm256_setzero_si256();                        \
    for (int j = 0; j < 8; j++) P8_Q8(q, v, j, xb);
#endif
#define P8_STEP(ACC)                                                                                           \
    do {                                                                                                       \
        const __m256i *v = (const __m256i *)(panel + b * stride);                                              \
        const int8_t *xb = xq + b * QK;                                                                        \
        __m256 dw;                                                                                             \
        __m256i q;                                                                                             \
        if (kind == PI_TYPE_Q8_0) {                                                                                       \
            P8_Q8_ALL(q, v, xb, is[b])                                                                         \
            dw = _mm256_load_ps((const float *)(v + 16));                                                      \
        } else {                                                                                               \
            P8_Q4(q, v, xb)                                                                                    \
            q = FN(qx_offset)(kind, q, _mm256_set1_epi32(is[b]));                                              \
            dw = _mm256_load_ps((const float *)(v + 8));                                                       \
        }                                                                                                      \
        ACC = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(dw, _mm256_set1_ps(ds[2 * b])), ACC);        \
        if (QX_HAS_MIN(kind))                                                                                  \
            ACC = _mm256_add_ps(ACC, _mm256_mul_ps(_mm256_load_ps((const float *)(v + 9)), _mm256_set1_ps(ds[2 * b + 1]))); \
        b++;                                                                                                   \
    } while (0)
        int64_t b = 0;
        for (; b + 8 <= nb; ) {
            P8_STEP(acc0); P8_STEP(acc1); P8_STEP(acc2); P8_STEP(acc3);
            P8_STEP(acc4); P8_STEP(acc5); P8_STEP(acc6); P8_STEP(acc7);
        }
        if (b < nb) P8_STEP(acc0);
        if (b < nb) P8_STEP(acc1);
        if (b < nb) P8_STEP(acc2);
        if (b < nb) P8_STEP(acc3);
        if (b < nb) P8_STEP(acc4);
        if (b < nb) P8_STEP(acc5);
        if (b < nb) P8_STEP(acc6);
#undef P8_STEP
#undef P8_Q4
#undef P8_Q8
#undef P8_Q8_ALL
#undef P8_X
        const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc0, acc4), _mm256_add_ps(acc2, acc6)),
                                         _mm256_add_ps(_mm256_add_ps(acc1, acc5), _mm256_add_ps(acc3, acc7)));
        _mm256_storeu_ps(y + t * y_stride, sum);
    }
}

#define DEFINE_TILE8(type, kind)                                                                                \
    TARGET static void FN(tile8_##type)(const uint8_t *const *rows, const act_q8 *a, int64_t T, uint8_t *panel,  \
                                        float *y, int64_t y_stride) {                                            \
        FN(tile8_quant)(kind, rows, a, T, panel, y, y_stride);                                                  \
    }
DEFINE_TILE8(q4_0, PI_TYPE_Q4_0)
DEFINE_TILE8(q4_1, PI_TYPE_Q4_1)
DEFINE_TILE8(q5_0, PI_TYPE_Q5_0)
DEFINE_TILE8(q5_1, PI_TYPE_Q5_1)
DEFINE_TILE8(q8_0, PI_TYPE_Q8_0)
#undef DEFINE_TILE8

#if SIMD_AVX512
/* Tokens t0..t0 + ntok - 1 (ntok <= 4, a constant after inlining) over a filled panel of 16 rows: each panel vector
 * loaded once serves the ntok tokens (their 4 activations broadcast, one VNNI dot each); per token and row the
 * arithmetic of tile16_quant's comment. */
TARGET_INLINE void FN(tile16_tokens)(const int kind, const uint8_t *panel, const act_q8 *a, int64_t t0, const int ntok,
                                     float *y, int64_t y_stride) {
    const int64_t nb = a->nb, K = a->K;
    const int shift = kind == PI_TYPE_Q4_0 ? 3 : kind == PI_TYPE_Q5_0 ? 4 : 7; /* the offset's 8, 16, 128 */
    const int offset = kind == PI_TYPE_Q4_0 || kind == PI_TYPE_Q5_0 || kind == PI_TYPE_Q8_0;
    const int32_t *xq[4];
    const float *ds[4];
    const int32_t *is[4];
    __m512 acc[4][8];
    for (int t = 0; t < ntok; t++) {
        xq[t] = (const int32_t *)(a->qs + (t0 + t) * K);
        ds[t] = a->ds + (t0 + t) * nb * 2;
        is[t] = a->isum + (t0 + t) * nb;
        for (int l = 0; l < 8; l++) acc[t][l] = _mm512_setzero_ps();
    }
#define P16_STEP(l)                                                                                            \
    do {                                                                                                       \
        const __m512i *v = (const __m512i *)(panel + b * PANEL16_BYTES_PER_BLOCK);                             \
        __m512i q[4];                                                                                          \
        for (int t = 0; t < ntok; t++) q[t] = _mm512_setzero_si512();                                          \
        for (int j = 0; j < 8; j++) {                                                                          \
            const __m512i w = _mm512_load_si512(v + j);                                                        \
            for (int t = 0; t < ntok; t++) q[t] = _mm512_dpbusd_epi32(q[t], w, _mm512_set1_epi32(xq[t][b * 8 + j])); \
        }                                                                                                      \
        const __m512 dw = _mm512_load_ps((const float *)(v + 8));                                              \
        for (int t = 0; t < ntok; t++) {                                                                       \
            if (offset) q[t] = _mm512_sub_epi32(q[t], _mm512_slli_epi32(_mm512_set1_epi32(is[t][b]), (unsigned)shift)); \
            acc[t][l] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[t]), _mm512_mul_ps(dw, _mm512_set1_ps(ds[t][2 * b])), acc[t][l]); \
            if (QX_HAS_MIN(kind))                                                                              \
                acc[t][l] = _mm512_add_ps(acc[t][l], _mm512_mul_ps(_mm512_load_ps((const float *)(v + 9)),     \
                                                                   _mm512_set1_ps(ds[t][2 * b + 1])));         \
        }                                                                                                      \
        b++;                                                                                                   \
    } while (0)
    int64_t b = 0;
    for (; b + 8 <= nb;) {
        P16_STEP(0); P16_STEP(1); P16_STEP(2); P16_STEP(3);
        P16_STEP(4); P16_STEP(5); P16_STEP(6); P16_STEP(7);
    }
    for (int l = 0; b < nb; l++) P16_STEP(l);
#undef P16_STEP
    for (int t = 0; t < ntok; t++) {
        const __m512 *c = acc[t];
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c[0], c[4]), _mm512_add_ps(c[2], c[6])),
                                         _mm512_add_ps(_mm512_add_ps(c[1], c[5]), _mm512_add_ps(c[3], c[7])));
        _mm512_storeu_ps(y + (t0 + t) * y_stride, sum);
    }
}

/* Sixteen Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 rows x all tokens (AVX-512): tile8_quant's panels of rows 0-7 and 8-15 side
 * by side in 512-bit vectors (rows 0-7 in the low half, 8-15 in the high half), so one load, one broadcast and one
 * VNNI dot serve 16 rows. Each row keeps tile8_quant's exact integer per block (Q8_0 from q + 128 as there), its
 * float product d_w d_x, FMA into accumulator b % 8, the minimum's add and the final sum order, in its lane: the
 * bits of the row tile. Panel per block (PANEL16_BYTES_PER_BLOCK): 8 vectors of 4 weights x 16 rows, then the
 * rows' d and m as floats. */
TARGET_INLINE void FN(tile16_quant)(const int kind, const uint8_t *const *rows, const act_q8 *a, int64_t T,
                                    uint8_t *panel, float *y, int64_t y_stride) {
    const int64_t nb = a->nb, bsz = QX_BSZ(kind);
    for (int64_t b = 0; b < nb; b++) {
        __m512i *v = (__m512i *)(panel + b * PANEL16_BYTES_PER_BLOCK);
        _Alignas(32) __m256i half[2][8];
        _Alignas(32) uint16_t dh[16], mh[16];
        for (int h = 0; h < 2; h++) {
            __m256i r[8];
            for (int i = 0; i < 8; i++) {
                const uint8_t *blk = rows[8 * h + i] + b * bsz;
                prefetch_act(a, blk, bsz);
                r[i] = kind == PI_TYPE_Q8_0
                           ? _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), _mm256_set1_epi8((char)0x80))
                           : FN(unpack_qx)(kind, blk);
                memcpy(&dh[8 * h + i], blk, 2);
                memcpy(&mh[8 * h + i], QX_HAS_MIN(kind) ? blk + 2 : blk, 2);
            }
            FN(transpose8_epi32)(r, half[h]);
        }
        for (int j = 0; j < 8; j++)
            _mm512_store_si512(v + j, _mm512_inserti64x4(_mm512_castsi256_si512(half[0][j]), half[1][j], 1));
        _mm512_store_ps((float *)(v + 8), _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)dh)));
        _mm512_store_ps((float *)(v + 9), _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)mh)));
    }
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) FN(tile16_tokens)(kind, panel, a, t, 4, y, y_stride);
    switch (T - t) {
        case 3: FN(tile16_tokens)(kind, panel, a, t, 3, y, y_stride); break;
        case 2: FN(tile16_tokens)(kind, panel, a, t, 2, y, y_stride); break;
        case 1: FN(tile16_tokens)(kind, panel, a, t, 1, y, y_stride); break;
        default: break;
    }
}

#define DEFINE_TILE16(type, kind)                                                                               \
    TARGET static void FN(tile16_##type)(const uint8_t *const *rows, const act_q8 *a, int64_t T, uint8_t *panel, \
                                         float *y, int64_t y_stride) {                                           \
        FN(tile16_quant)(kind, rows, a, T, panel, y, y_stride);                                                 \
    }
DEFINE_TILE16(q4_0, PI_TYPE_Q4_0)
DEFINE_TILE16(q4_1, PI_TYPE_Q4_1)
DEFINE_TILE16(q5_0, PI_TYPE_Q5_0)
DEFINE_TILE16(q5_1, PI_TYPE_Q5_1)
DEFINE_TILE16(q8_0, PI_TYPE_Q8_0)
#undef DEFINE_TILE16
#endif

/* ---- one token over Q4_0 rows repacked by 8 (matmul.c, pi_repack_rows8) ---------------------------------------- */

/* Eight rows x one token from their repacked blocks (R8_BLOCK_BYTES each: 4 vectors, lane r of vector k the bytes
 * 4k..4k+3 of row r's nibbles, then the 8 rows' d): the panels' arithmetic (tile8_quant at T = 1: the same exact
 * integer per block, the same float product and FMA into accumulator b % 8, the same final sum), without the
 * per-call transpose: the bits of every other one-token path over the same rows. */
TARGET static void FN(r8_q4_0)(const uint8_t *g, const act_q8 *a, float *y) {
    const int64_t nb = a->nb;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * R8_BLOCK_BYTES;
        const int8_t *xb = a->qs + b * QK;
        __builtin_prefetch(blk + MATVEC_STREAM_AHEAD, 0, 3);
        __builtin_prefetch(blk + MATVEC_STREAM_AHEAD + 64, 0, 3);
        __builtin_prefetch(blk + MATVEC_STREAM_AHEAD + 128, 0, 3);
#if SIMD_AVX512
        __m256i q = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 * k));
            q = _mm256_dpbusd_epi32(q, _mm256_and_si256(v, m4), _mm256_set1_epi32(*(const int32_t *)(xb + 4 * k)));
            q = _mm256_dpbusd_epi32(q, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                    _mm256_set1_epi32(*(const int32_t *)(xb + 16 + 4 * k)));
        }
#else
        __m256i s16 = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 * k));
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_and_si256(v, m4),
                                                             _mm256_set1_epi32(*(const int32_t *)(xb + 4 * k))));
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                                             _mm256_set1_epi32(*(const int32_t *)(xb + 16 + 4 * k))));
        }
        __m256i q = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
        q = _mm256_sub_epi32(q, _mm256_slli_epi32(_mm256_set1_epi32(a->isum[b]), 3));
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 128)));
        acc[b % 8] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(dw, _mm256_set1_ps(a->ds[2 * b])), acc[b % 8]);
    }
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6])),
                                     _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7])));
    _mm256_storeu_ps(y, sum);
}

DEFINE_TILE_QUANT_BODY(q5_0, tile_q4x_n, PI_TYPE_Q5_0)
DEFINE_TILE_QUANT_BODY(q5_1, tile_q4x_n, PI_TYPE_Q5_1)

/* Q8_0 rows in 8-block groups (tile_q8_0_n: what the prompt panels repeat), a last partial group in the low lanes:
 * the form depends on nothing but the row, so a token's result does not depend on its batch. */
TARGET static void FN(tile_q8_0)(const uint8_t *row, const act_q8 *a, int64_t t0, int ntok, float *out) {
    FN(tile_q8_0_g)(row, a, t0, ntok, out);
}

#undef DEFINE_TILE_QUANT_BODY

/* ---- float weight x float activation tiles ------------------------------------------------------------- */

#if SIMD_AVX512
#define VF __m512
#define VF_N 16
#define VF_ZERO() _mm512_setzero_ps()
#define VF_LOAD(p) _mm512_loadu_ps(p)
#define VF_LOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VF_LOAD_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define VF_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VF_HSUM(v) \
    FN(hsum256)(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))))
#define VF_ADD(a, b) _mm512_add_ps(a, b)
#else
#define VF __m256
#define VF_N 8
#define VF_ZERO() _mm256_setzero_ps()
#define VF_LOAD(p) _mm256_loadu_ps(p)
#define VF_LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VF_LOAD_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define VF_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VF_HSUM(v) FN(hsum256)(v)
#define VF_ADD(a, b) _mm256_add_ps(a, b)
#endif

/* fmt: PI_TYPE_F32, PI_TYPE_F16 or PI_TYPE_BF16 (a compile-time constant after inlining) */
#define VF_LOAD_W(fmt, w16, w32, k)                                                                \
    ((fmt) == PI_TYPE_F16    ? VF_LOAD_F16((w16) + (k))                                           \
     : (fmt) == PI_TYPE_BF16 ? VF_LOAD_BF16((w16) + (k))                                          \
                             : VF_LOAD((w32) + (k)))
#define W_SCALAR(fmt, w16, w32, k) \
    ((fmt) == PI_TYPE_F16 ? _cvtsh_ss((w16)[k]) : (fmt) == PI_TYPE_BF16 ? bf16_to_fp32((w16)[k]) : (w32)[k])

/* One row x ntok <= TILE_T tokens in one pass: per token two chains (acc0 over the even vectors, acc1 over the odd
 * ones), the scalar tail and one final sum, whatever ntok (the one-token dots repeat it: the same bits); `ahead`
 * != 0 prefetches that many bytes past what it reads (tiles_<type>: a few tokens, such as a speculative step's,
 * then read each dense row once from DRAM at the one-token rate). */
TARGET_INLINE void FN(tile_float_n)(const int fmt, const uint8_t *row, int64_t K, const float *x, int64_t x_stride,
                                    const int ntok, float *out, const int64_t ahead) {
    const int64_t elem = fmt == PI_TYPE_F32 ? 4 : 2;
    const uint16_t *w16 = (const uint16_t *)row;
    const float *w32 = (const float *)row;
    VF acc0[TILE_T], acc1[TILE_T];
    float tail[TILE_T];
    for (int t = 0; t < ntok; t++) {
        acc0[t] = acc1[t] = VF_ZERO();
        tail[t] = 0.0f;
    }
    int64_t k = 0;
    for (; k + 2 * VF_N <= K; k += 2 * VF_N) {
        prefetch_stream(row + k * elem, ahead, 2 * VF_N * elem);
        const VF w0 = VF_LOAD_W(fmt, w16, w32, k);
        const VF w1 = VF_LOAD_W(fmt, w16, w32, k + VF_N);
        for (int t = 0; t < ntok; t++) {
            acc0[t] = VF_FMA(w0, VF_LOAD(x + t * x_stride + k), acc0[t]);
            acc1[t] = VF_FMA(w1, VF_LOAD(x + t * x_stride + k + VF_N), acc1[t]);
        }
    }
    if (k + VF_N <= K) {
        const VF w0 = VF_LOAD_W(fmt, w16, w32, k);
        for (int t = 0; t < ntok; t++) acc0[t] = VF_FMA(w0, VF_LOAD(x + t * x_stride + k), acc0[t]);
        k += VF_N;
    }
    for (; k < K; k++) {
        const float wk = W_SCALAR(fmt, w16, w32, k);
        for (int t = 0; t < ntok; t++) tail[t] += wk * x[t * x_stride + k];
    }
    for (int t = 0; t < ntok; t++) out[t] = VF_HSUM(VF_ADD(acc0[t], acc1[t])) + tail[t];
}

/* Four rows x ntok <= TILE4_PASS tokens (tokens tbase.. of the tile) over columns [k0, k1): per (row, token) exactly
 * tile_float_n's two chains (acc0 over the even vectors, acc1 over the odd ones, the scalar tail, one final sum),
 * so the same bits. The chains are independent, so the even vectors of the columns go first with the even
 * accumulators in registers, then the odd ones; `state` keeps them between calls. AVX2: 4 rows x 3 tokens (12
 * accumulators, 3 activation vectors and one weight vector: the 16 ymm registers); measured in L1, 1 thread, ~80
 * GFLOP/s against ~66 for two rows x 3 tokens with both parities live. AVX-512: 4 rows x 6 tokens (24 + 6 + 1 of the
 * 32 zmm registers): half the weight loads and conversions per FMA. */
#if SIMD_AVX512
#define TILE4_PASS 6
#else
#define TILE4_PASS 3
#endif
TARGET_INLINE void FN(tile4_float_n)(const int fmt, const uint8_t *const *rows, int64_t K, int64_t k0,
                                     int64_t k1, const float *x, int64_t x_stride, const int tbase, const int ntok,
                                     void *state, float *out) {
    VF *sv = (VF *)state; /* [parity][row][token] */
    const uint8_t *const r0 = rows[0], *const r1 = rows[1], *const r2 = rows[2], *const r3 = rows[3];
    const int64_t kend = k0 + (k1 - k0) / (2 * VF_N) * (2 * VF_N);
    const int last = k1 == K, extra = last && kend + VF_N <= K; /* one more even vector at kend */
    x += tbase * x_stride;
    for (int par = 0; par < 2; par++) {
        VF acc[4][TILE4_PASS];
        VF *s = sv + par * 4 * TILE_T2 + tbase;
        for (int r = 0; r < 4; r++)
            for (int t = 0; t < ntok; t++) acc[r][t] = k0 == 0 ? VF_ZERO() : s[r * TILE_T2 + t];
        const int64_t stop = par == 0 && extra ? kend + VF_N : kend;
        for (int64_t k = k0 + par * VF_N; k + VF_N <= stop; k += 2 * VF_N) {
            VF xv[TILE4_PASS];
            for (int t = 0; t < ntok; t++) xv[t] = VF_LOAD(x + t * x_stride + k);
            for (int r = 0; r < 4; r++) {
                const uint8_t *row = r == 0 ? r0 : r == 1 ? r1 : r == 2 ? r2 : r3;
                const VF wv = VF_LOAD_W(fmt, (const uint16_t *)row, (const float *)row, k);
                for (int t = 0; t < ntok; t++) acc[r][t] = VF_FMA(wv, xv[t], acc[r][t]);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int t = 0; t < ntok; t++) s[r * TILE_T2 + t] = acc[r][t];
    }
    if (!last) return;
    for (int r = 0; r < 4; r++) {
        const uint8_t *row = rows[r];
        const uint16_t *w16 = (const uint16_t *)row;
        const float *w32 = (const float *)row;
        float tail[TILE4_PASS];
        for (int t = 0; t < ntok; t++) tail[t] = 0.0f;
        for (int64_t k = extra ? kend + VF_N : kend; k < K; k++) {
            const float wk = W_SCALAR(fmt, w16, w32, k);
            for (int t = 0; t < ntok; t++) tail[t] += wk * x[t * x_stride + k];
        }
        for (int t = 0; t < ntok; t++) {
            const int i = r * TILE_T2 + tbase + t;
            out[i] = VF_HSUM(VF_ADD(sv[i], sv[4 * TILE_T2 + i])) + tail[t];
        }
    }
}

/* ntok <= TILE_T2 tokens in passes of TILE4_PASS, each pass with its token count a constant */
#define TILE4_CALL(n) FN(tile4_float_n)(fmt, rows, K, k0, k1, x, x_stride, tbase, n, state, out)
TARGET_INLINE void FN(tile4_float_passes)(const int fmt, const uint8_t *const *rows, int64_t K, int64_t k0,
                                          int64_t k1, const float *x, int64_t x_stride, int ntok, void *state,
                                          float *out) {
    for (int tbase = 0; tbase < ntok; tbase += TILE4_PASS) {
        switch (ntok - tbase) {
            case 1: TILE4_CALL(1); break;
            case 2: TILE4_CALL(2); break;
#if TILE4_PASS > 3
            case 3: TILE4_CALL(3); break;
            case 4: TILE4_CALL(4); break;
            case 5: TILE4_CALL(5); break;
#endif
            default: TILE4_CALL(TILE4_PASS); break;
        }
    }
}
#undef TILE4_CALL

#define DEFINE_TILE4_FLOAT(type, fmt)                                                                          \
    TARGET static void FN(tile4_##type)(const uint8_t *const *rows, int64_t K, int64_t k0,                       \
                                        int64_t k1, const float *x, int64_t x_stride, int ntok, void *state,     \
                                        float *out) {                                                            \
        FN(tile4_float_passes)(fmt, rows, K, k0, k1, x, x_stride, ntok, state, out);                            \
    }

DEFINE_TILE4_FLOAT(f32, PI_TYPE_F32)
DEFINE_TILE4_FLOAT(f16, PI_TYPE_F16)
DEFINE_TILE4_FLOAT(bf16, PI_TYPE_BF16)

#undef DEFINE_TILE4_FLOAT
#undef TILE4_PASS

#define DEFINE_TILE_FLOAT(type, fmt)                                                                     \
    TARGET static void FN(tile_##type)(const uint8_t *row, int64_t K, const float *x, int64_t x_stride,      \
                                       int ntok, float *out) {                                               \
        switch (ntok) {                                                                                     \
            case 1: FN(tile_float_n)(fmt, row, K, x, x_stride, 1, out, 0); break;                           \
            case 2: FN(tile_float_n)(fmt, row, K, x, x_stride, 2, out, 0); break;                           \
            case 3: FN(tile_float_n)(fmt, row, K, x, x_stride, 3, out, 0); break;                           \
            default: FN(tile_float_n)(fmt, row, K, x, x_stride, 4, out, 0); break;                          \
        }                                                                                                   \
    }

DEFINE_TILE_FLOAT(f32, PI_TYPE_F32)
DEFINE_TILE_FLOAT(f16, PI_TYPE_F16)
DEFINE_TILE_FLOAT(bf16, PI_TYPE_BF16)

#undef DEFINE_TILE_FLOAT

#define DEFINE_TILE_STREAM(type, fmt)                                                                              \
    TARGET static void FN(tiles_##type)(const uint8_t *row, int64_t K, const float *x, int64_t x_stride, int ntok, \
                                        float *out, int64_t ahead) {                                               \
        switch (ntok) {                                                                                            \
            case 1: FN(tile_float_n)(fmt, row, K, x, x_stride, 1, out, ahead); break;                              \
            case 2: FN(tile_float_n)(fmt, row, K, x, x_stride, 2, out, ahead); break;                              \
            default: FN(tile_float_n)(fmt, row, K, x, x_stride, TILE_TS, out, ahead); break;                       \
        }                                                                                                          \
    }

DEFINE_TILE_STREAM(f32, PI_TYPE_F32)
DEFINE_TILE_STREAM(f16, PI_TYPE_F16)
DEFINE_TILE_STREAM(bf16, PI_TYPE_BF16)

#undef DEFINE_TILE_STREAM

/* ---- quantised weight x float activation tiles (exact mode) -------------------------------------------- */

/* Each weight block is decoded in registers to the floats of the reference dequantiser (Q4_0 (q - 8) * d,
 * Q4_1 d * q + m, Q8_0 q * d; bit-equal except AVX2 Q4_1, within 1 ulp), then FMA'd with float x for
 * every token of the tile. Per token: QF_V vectors per block, vector j of block i goes to accumulator
 * (i * QF_V + j) % 4 (four FMA chains: one token alone is not bound by the FMA latency),
 * one fixed horizontal sum at the end: the result depends neither on the tile size nor on the thread count.
 *
 * AVX-512: 16 floats per vector, the 16 possible values of a Q4 block are built as one vector (table) and
 * picked with vpermps, which reads only the low 4 bits of each index: no masking of the nibbles is needed.
 * AVX2: 8 floats per vector; nibbles are masked, converted and scaled with one FMA (see decode_qf).
 */
#include "quants_x86.h"

#if SIMD_AVX512
#define QF_V 2      /* vectors per block */
#define QF_TILE 8   /* tokens per call to the inner tile: 4 * QF_TILE accumulators, a few spilled (measured: still
                     * faster for prompts than 4 or 6 tokens, which decode each block for fewer tokens) */
#else
#define QF_V 4
#define QF_TILE 2   /* measured faster than 4 (16 accumulators + 4 weight vectors exceed the 16 ymm registers) */
#endif

/* one block of the type decoded into QF_V vectors (quants_x86.h; the AVX2 Q4_1 in one FMA, within 1 ulp) */
TARGET_INLINE void FN(decode_qf)(const int kind, const uint8_t *blk, VF *w) { FN(decode_block32)(kind, 0, blk, w); }

/* Vector v = i * QF_V + j (block i, vector j) of a row goes to accumulator v % 4 of its token: four independent FMA
 * chains per token, so one token alone (decode) is not bound by the FMA latency. */
#define QF_ACC(parity, j) ((int)(((parity) * QF_V + (j)) & 3)) /* parity = block index & 1 */
#define QF_REDUCE(a) VF_HSUM(VF_ADD(VF_ADD((a)[0], (a)[1]), VF_ADD((a)[2], (a)[3])))
/* STEP(i, parity) over blocks 0..nb-1 in pairs, so that every accumulator index is a compile-time constant
 * (registers, not memory) */
#define QF_FOR_BLOCKS(nb, STEP)                  \
    do {                                         \
        int64_t i_ = 0;                          \
        for (; i_ + 1 < (nb); i_ += 2) {         \
            STEP(i_, 0);                         \
            STEP(i_ + 1, 1);                     \
        }                                        \
        if (i_ < (nb)) STEP(i_, 0);              \
    } while (0)

TARGET_INLINE void FN(tile_qf_n)(const int kind, const int64_t block_bytes, const uint8_t *row, int64_t K,
                                 const float *x, int64_t x_stride, const int ntok, float *out) {
    const int64_t nb = K / QK;
    VF acc[QF_TILE][4];
    for (int t = 0; t < ntok; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = VF_ZERO();
#define QF_TILE_BLOCK(i, parity)                                                                                 \
    do {                                                                                                         \
        VF w[QF_V];                                                                                              \
        FN(decode_qf)(kind, row + (i) * block_bytes, w);                                                         \
        const float *xb = x + (i) * QK;                                                                          \
        _Pragma("GCC unroll 8") for (int t = 0; t < ntok; t++)                                                   \
            _Pragma("GCC unroll 4") for (int j = 0; j < QF_V; j++)                                               \
                acc[t][QF_ACC(parity, j)] =                                                                      \
                    VF_FMA(w[j], VF_LOAD(xb + t * x_stride + j * VF_N), acc[t][QF_ACC(parity, j)]);              \
    } while (0)
    QF_FOR_BLOCKS(nb, QF_TILE_BLOCK);
#undef QF_TILE_BLOCK
    for (int t = 0; t < ntok; t++) out[t] = QF_REDUCE(acc[t]);
}

/* ntok <= TILE_TQ tokens, taken QF_TILE at a time */
#define DEFINE_TILE_QF(type, kind, block_t)                                                                  \
    TARGET static void FN(tile_##type##_f)(const uint8_t *row, int64_t K, const float *x, int64_t x_stride,   \
                                           int ntok, float *out) {                                            \
        for (int t0 = 0; t0 < ntok; t0 += QF_TILE, x += QF_TILE * x_stride, out += QF_TILE) {                 \
            switch (ntok - t0) {                                                                              \
                case 1: FN(tile_qf_n)(kind, sizeof(block_t), row, K, x, x_stride, 1, out); break;            \
                QF_CASES(kind, block_t)                                                                       \
                default: FN(tile_qf_n)(kind, sizeof(block_t), row, K, x, x_stride, QF_TILE, out); break;     \
            }                                                                                                 \
        }                                                                                                     \
    }
#if QF_TILE == 8
#define QF_CASES(kind, block_t)                                                                  \
    case 2: FN(tile_qf_n)(kind, sizeof(block_t), row, K, x, x_stride, 2, out); break;            \
    case 3: FN(tile_qf_n)(kind, sizeof(block_t), row, K, x, x_stride, 3, out); break;            \
    case 4: FN(tile_qf_n)(kind, sizeof(block_t), row, K, x, x_stride, 4, out); break;            \
    case 5: FN(tile_qf_n)(kind, sizeof(block_t), row, K, x, x_stride, 5, out); break;            \
    case 6: FN(tile_qf_n)(kind, sizeof(block_t), row, K, x, x_stride, 6, out); break;            \
    case 7: FN(tile_qf_n)(kind, sizeof(block_t), row, K, x, x_stride, 7, out); break;
#else
#define QF_CASES(kind, block_t)
#endif

DEFINE_TILE_QF(q4_0, PI_TYPE_Q4_0, block_q4_0)
DEFINE_TILE_QF(q4_1, PI_TYPE_Q4_1, block_q4_1)
DEFINE_TILE_QF(q8_0, PI_TYPE_Q8_0, block_q8_0)
DEFINE_TILE_QF(q5_0, PI_TYPE_Q5_0, block_q5_0)
DEFINE_TILE_QF(q5_1, PI_TYPE_Q5_1, block_q5_1)

/* ---- K-quant weight x float activation (exact mode) ------------------------------------------------------ */

/* A super-block of 256 is decoded (kquants_x86.h: the reference dequantiser's float operations, so the weights are
 * bit-equal to it) into 256 floats in memory, then FMA'd with x as the 8 blocks of 32 it holds, with the
 * accumulators of tile_qf_n (vector j of block i to accumulator QF_ACC(i & 1, j)) and its horizontal sum. */
#include "kquants_x86.h"

TARGET_INLINE void FN(decode_kq)(const int kind, const uint8_t *blk, float *w) {
    switch (kind) { /* SIMD decoders, bit-equal to kquants.h's */
        case PI_TYPE_Q2_K: FN(kq_simd_q2_k)(blk, w); break;
        case PI_TYPE_Q3_K: FN(kq_simd_q3_k)(blk, w); break;
        case PI_TYPE_Q4_K: FN(kq_simd_q4_k)(blk, w); break;
        case PI_TYPE_Q5_K: FN(kq_simd_q5_k)(blk, w); break;
        default: FN(kq_simd_q6_k)(blk, w); break;
    }
}

TARGET_INLINE void FN(tile_kq_n)(const int kind, const int64_t block_bytes, const uint8_t *row, int64_t K,
                                 const float *x, int64_t x_stride, const int ntok, float *out) {
    VF acc[QF_TILE][4];
    float w[QK_K] __attribute__((aligned(64)));
    for (int t = 0; t < ntok; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = VF_ZERO();
    for (int64_t s = 0; s < K / QK_K; s++) {
        FN(decode_kq)(kind, row + s * block_bytes, w);
#define KQ_TILE_BLOCK(i, parity)                                                                                 \
    do {                                                                                                         \
        const float *xb = x + s * QK_K + (i) * QK;                                                               \
        _Pragma("GCC unroll 8") for (int t = 0; t < ntok; t++)                                                   \
            _Pragma("GCC unroll 4") for (int j = 0; j < QF_V; j++)                                               \
                acc[t][QF_ACC(parity, j)] = VF_FMA(VF_LOAD(w + (i) * QK + j * VF_N),                             \
                                                   VF_LOAD(xb + t * x_stride + j * VF_N), acc[t][QF_ACC(parity, j)]); \
    } while (0)
        QF_FOR_BLOCKS(QK_K / QK, KQ_TILE_BLOCK);
#undef KQ_TILE_BLOCK
    }
    for (int t = 0; t < ntok; t++) out[t] = QF_REDUCE(acc[t]);
}

#define DEFINE_TILE_KQ(type, kind, block_t)                                                                  \
    TARGET static void FN(tile_##type##_f)(const uint8_t *row, int64_t K, const float *x, int64_t x_stride,   \
                                           int ntok, float *out) {                                            \
        for (int t0 = 0; t0 < ntok; t0 += QF_TILE, x += QF_TILE * x_stride, out += QF_TILE) {                 \
            const int n = ntok - t0 < QF_TILE ? ntok - t0 : QF_TILE;                                          \
            if (n == 1)                                                                                       \
                FN(tile_kq_n)(kind, sizeof(block_t), row, K, x, x_stride, 1, out);                            \
            else                                                                                              \
                FN(tile_kq_n)(kind, sizeof(block_t), row, K, x, x_stride, n, out);                            \
        }                                                                                                     \
    }
DEFINE_TILE_KQ(q2_k, PI_TYPE_Q2_K, block_q2_k)
DEFINE_TILE_KQ(q3_k, PI_TYPE_Q3_K, block_q3_k)
DEFINE_TILE_KQ(q4_k, PI_TYPE_Q4_K, block_q4_k)
DEFINE_TILE_KQ(q5_k, PI_TYPE_Q5_K, block_q5_k)
DEFINE_TILE_KQ(q6_k, PI_TYPE_Q6_K, block_q6_k)

/* R rows against one x, each with the operation sequence of tile_kq_n at ntok = 1 (bit-identical to it) */
TARGET_INLINE void FN(dot_kq_n)(const int kind, const int64_t block_bytes, const uint8_t *const *rows, const int R,
                                int64_t K, const float *x, float *out) {
    VF acc[ROWS_DOT_MAX][4];
    float w[ROWS_DOT_MAX][QK_K] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = VF_ZERO();
    for (int64_t s = 0; s < K / QK_K; s++) {
        for (int r = 0; r < R; r++) FN(decode_kq)(kind, rows[r] + s * block_bytes, w[r]);
#define KQ_DOT_BLOCK(i, parity)                                                                                  \
    do {                                                                                                         \
        VF xv[QF_V];                                                                                             \
        for (int j = 0; j < QF_V; j++) xv[j] = VF_LOAD(x + s * QK_K + (i) * QK + j * VF_N);                      \
        for (int r = 0; r < R; r++)                                                                              \
            for (int j = 0; j < QF_V; j++)                                                                       \
                acc[r][QF_ACC(parity, j)] = VF_FMA(VF_LOAD(w[r] + (i) * QK + j * VF_N), xv[j], acc[r][QF_ACC(parity, j)]); \
    } while (0)
        QF_FOR_BLOCKS(QK_K / QK, KQ_DOT_BLOCK);
#undef KQ_DOT_BLOCK
    }
    for (int r = 0; r < R; r++) out[r] = QF_REDUCE(acc[r]);
}

/* ---- one token, several rows: rows_dot_fn ------------------------------------------------------------- */

/* R rows (R <= ROWS_DOT_MAX) against one x: per row the exact operation sequence of tile_qf_n / tile_float_n
 * at ntok = 1 (same decode, same accumulator of each vector, same horizontal sum), so the results are
 * bit-identical to the tiles; interleaving the rows gives 4 * R independent FMA chains instead of 4. */
TARGET_INLINE void FN(dot_qf_n)(const int kind, const int64_t block_bytes, const uint8_t *const *rows, const int R,
                                int64_t K, const float *x, float *out) {
    const int64_t nb = K / QK;
    VF acc[ROWS_DOT_MAX][4];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = VF_ZERO();
#define QF_DOT_BLOCK(i, parity)                                                                                  \
    do {                                                                                                         \
        VF xv[QF_V];                                                                                             \
        for (int j = 0; j < QF_V; j++) xv[j] = VF_LOAD(x + (i) * QK + j * VF_N);                                 \
        for (int r = 0; r < R; r++) {                                                                            \
            VF w[QF_V];                                                                                          \
            FN(decode_qf)(kind, rows[r] + (i) * block_bytes, w);                                                 \
            for (int j = 0; j < QF_V; j++) acc[r][QF_ACC(parity, j)] = VF_FMA(w[j], xv[j], acc[r][QF_ACC(parity, j)]); \
        }                                                                                                        \
    } while (0)
    QF_FOR_BLOCKS(nb, QF_DOT_BLOCK);
#undef QF_DOT_BLOCK
    for (int r = 0; r < R; r++) out[r] = QF_REDUCE(acc[r]);
}

TARGET_INLINE void FN(dot_float_n)(const int fmt, const uint8_t *const *rows, const int R, int64_t K,
                                   const float *x, float *out, const int64_t ahead) {
    const int64_t elem = fmt == PI_TYPE_F32 ? 4 : 2;
    VF acc0[ROWS_DOT_MAX], acc1[ROWS_DOT_MAX];
    float tail[ROWS_DOT_MAX];
    for (int r = 0; r < R; r++) {
        acc0[r] = acc1[r] = VF_ZERO();
        tail[r] = 0.0f;
    }
    int64_t k = 0;
    for (; k + 2 * VF_N <= K; k += 2 * VF_N) {
        const VF x0 = VF_LOAD(x + k), x1 = VF_LOAD(x + k + VF_N);
        for (int r = 0; r < R; r++) {
            prefetch_stream(rows[r] + k * elem, ahead, 2 * VF_N * elem);
            const uint16_t *w16 = (const uint16_t *)rows[r];
            const float *w32 = (const float *)rows[r];
            const VF w0 = VF_LOAD_W(fmt, w16, w32, k);
            const VF w1 = VF_LOAD_W(fmt, w16, w32, k + VF_N);
            acc0[r] = VF_FMA(w0, x0, acc0[r]);
            acc1[r] = VF_FMA(w1, x1, acc1[r]);
        }
    }
    if (k + VF_N <= K) {
        for (int r = 0; r < R; r++) {
            const VF w0 = VF_LOAD_W(fmt, (const uint16_t *)rows[r], (const float *)rows[r], k);
            acc0[r] = VF_FMA(w0, VF_LOAD(x + k), acc0[r]);
        }
        k += VF_N;
    }
    for (; k < K; k++)
        for (int r = 0; r < R; r++) {
            const float wk = W_SCALAR(fmt, (const uint16_t *)rows[r], (const float *)rows[r], k);
            tail[r] += wk * x[k];
        }
    for (int r = 0; r < R; r++) out[r] = VF_HSUM(VF_ADD(acc0[r], acc1[r])) + tail[r];
}

#define DEFINE_DOT(name, call)                                                                                \
    TARGET static void FN(dot_##name)(const uint8_t *const *rows, int R, int64_t K, const float *x, float *out,   \
                                      int64_t ahead) {                                                        \
        (void)ahead;                                                                                          \
        switch (R) {                                                                                          \
            case 1: call(1); break;                                                                           \
            case 2: call(2); break;                                                                           \
            case 3: call(3); break;                                                                           \
            default: call(ROWS_DOT_MAX); break;                                                               \
        }                                                                                                     \
    }
#define DOT_Q4_0(n) FN(dot_qf_n)(PI_TYPE_Q4_0, sizeof(block_q4_0), rows, n, K, x, out)
#define DOT_Q4_1(n) FN(dot_qf_n)(PI_TYPE_Q4_1, sizeof(block_q4_1), rows, n, K, x, out)
#define DOT_Q8_0(n) FN(dot_qf_n)(PI_TYPE_Q8_0, sizeof(block_q8_0), rows, n, K, x, out)
#define DOT_Q5_0(n) FN(dot_qf_n)(PI_TYPE_Q5_0, sizeof(block_q5_0), rows, n, K, x, out)
#define DOT_Q5_1(n) FN(dot_qf_n)(PI_TYPE_Q5_1, sizeof(block_q5_1), rows, n, K, x, out)
#define DOT_F32(n) FN(dot_float_n)(PI_TYPE_F32, rows, n, K, x, out, ahead)
#define DOT_F16(n) FN(dot_float_n)(PI_TYPE_F16, rows, n, K, x, out, ahead)
#define DOT_BF16(n) FN(dot_float_n)(PI_TYPE_BF16, rows, n, K, x, out, ahead)
#define DOT_Q2_K(n) FN(dot_kq_n)(PI_TYPE_Q2_K, sizeof(block_q2_k), rows, n, K, x, out)
#define DOT_Q3_K(n) FN(dot_kq_n)(PI_TYPE_Q3_K, sizeof(block_q3_k), rows, n, K, x, out)
#define DOT_Q4_K(n) FN(dot_kq_n)(PI_TYPE_Q4_K, sizeof(block_q4_k), rows, n, K, x, out)
#define DOT_Q5_K(n) FN(dot_kq_n)(PI_TYPE_Q5_K, sizeof(block_q5_k), rows, n, K, x, out)
#define DOT_Q6_K(n) FN(dot_kq_n)(PI_TYPE_Q6_K, sizeof(block_q6_k), rows, n, K, x, out)
DEFINE_DOT(q2_k_f, DOT_Q2_K)
DEFINE_DOT(q3_k_f, DOT_Q3_K)
DEFINE_DOT(q4_k_f, DOT_Q4_K)
DEFINE_DOT(q5_k_f, DOT_Q5_K)
DEFINE_DOT(q6_k_f, DOT_Q6_K)
DEFINE_DOT(q4_0_f, DOT_Q4_0)
DEFINE_DOT(q4_1_f, DOT_Q4_1)
DEFINE_DOT(q8_0_f, DOT_Q8_0)
DEFINE_DOT(q5_0_f, DOT_Q5_0)
DEFINE_DOT(q5_1_f, DOT_Q5_1)
DEFINE_DOT(f32, DOT_F32)
DEFINE_DOT(f16, DOT_F16)
DEFINE_DOT(bf16, DOT_BF16)
#undef DOT_Q4_0
#undef DOT_Q4_1
#undef DOT_Q8_0
#undef DOT_Q5_0
#undef DOT_Q5_1
#undef DOT_Q2_K
#undef DOT_Q3_K
#undef DOT_Q4_K
#undef DOT_Q5_K
#undef DOT_Q6_K
#undef DOT_F32
#undef DOT_F16
#undef DOT_BF16
#undef DEFINE_DOT

#undef DEFINE_TILE_QF
#undef DEFINE_TILE_KQ
#undef QF_CASES
#undef QF_V
#undef QF_TILE
#undef QF_ACC
#undef QF_REDUCE
#undef QF_FOR_BLOCKS
#undef VF
#undef VF_N
#undef VF_ZERO
#undef VF_LOAD
#undef VF_LOAD_F16
#undef VF_LOAD_BF16
#undef VF_LOAD_W
#undef W_SCALAR
#undef VF_FMA
#undef VF_HSUM
#undef VF_ADD
#undef TARGET
#undef TARGET_INLINE
#undef FN
#undef SIMD_CAT
#undef SIMD_CAT_
