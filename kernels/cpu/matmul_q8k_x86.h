/* SIMD bodies of the K-quant / IQ4 kernels, compiled twice through simd_variants.h (from matmul_q8k.c).
 *
 * Both variants work on 256-bit vectors with the same integer and float operations, so their results are
 * bit-identical (and equal to the scalar fallback, see matmul_q8k.c): the AVX-512 one only fuses the int16
 * multiply-adds (VNNI vpdpwssd / vpdpbusd), which gives the same exact integers.
 *
 * K-quant x Q8_K: per chunk of 32 elements, the 32 unsigned weight values u (bytes) times the 32 int8 activations
 * with maddubs (16 int16 pair sums, no saturation: |u| <= 63 or, IQ4_XS, |kv| <= 127 with the sign moved onto x,
 * |q| <= 127), then madd with the int16 scale of each half (8 int32 lanes, lane l = elements 4l..4l+3 of the
 * chunk); the 8 chunks of a super-block add up in S. Offsets and mins come from the bsums: madd(bsums, coefficient
 * per group of 16), lane l = groups 2l, 2l+1.
 */

/* bytes per super-block of the Q4_K panels (kq8_tile8_q4_k, kq8_tile16_q4_k; their traits, matmul_q8k_types.h) */
#ifndef KQ8_PANEL_Q4_K
#define KQ8_PANEL_Q4_K (8 * 10 * 32 + 2 * 32) /* per super-block of 8 rows: 8 chunks x (8 vectors, scales, mins), d, dmin */
#define KQ8_PANEL16_Q4_K (8 * 10 * 64 + 2 * 64) /* the same for 16 rows in 512-bit vectors (AVX-512) */
#endif

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

/* acc + madd(a, b): int16 pairs multiplied and summed into 8 int32 lanes */
TARGET_INLINE __m256i FN(madd_acc)(__m256i acc, __m256i a, __m256i b) {
#if SIMD_AVX512
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* acc + sum over each group of 4 bytes of u (unsigned) * s (signed) */
TARGET_INLINE __m256i FN(dot_u8s8)(__m256i acc, __m256i u, __m256i s) {
#if SIMD_AVX512
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* {lo nibbles of the 16 bytes at p, hi nibbles}: 32 indices 0..15 in IQ4 element order */
TARGET_INLINE __m256i FN(iq4_indices)(const uint8_t *p) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

TARGET_INLINE __m256i FN(iq4_table)(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues_iq4));
}

/* ---- Q8_K activation quantisation ----------------------------------------------------------------------- */

/* 8 int32 vectors -> their 8 horizontal sums, in order */
TARGET_INLINE __m256i FN(hsum8x8_epi32)(const __m256i *g) {
    const __m256i e = FN(hadd_epi32)(FN(hadd_epi32)(g[0], g[1]), FN(hadd_epi32)(g[2], g[3]));
    const __m256i f = FN(hadd_epi32)(FN(hadd_epi32)(g[4], g[5]), FN(hadd_epi32)(g[6], g[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(e, f, 0x20), _mm256_permute2x128_si256(e, f, 0x31));
}

TARGET static void FN(quantize_q8k)(const float *x, int64_t nb, int8_t *qs, float *d, int16_t *bsums) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < nb; i++, x += QK_K, qs += QK_K, bsums += QK_K / 16) {
        /* max |x|; max_ps returns its second operand when the first is NaN: NaNs are skipped as in the reference */
        __m256 amax = _mm256_setzero_ps();
        for (int j = 0; j < QK_K; j += 8)
            amax = _mm256_max_ps(_mm256_andnot_ps(sign_bit, _mm256_loadu_ps(x + j)), amax);
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float am = _mm_cvtss_f32(m);
        if (am == 0.0f) {
            d[i] = 0.0f;
            memset(qs, 0, QK_K);
            memset(bsums, 0, QK_K / 16 * sizeof(int16_t));
            continue;
        }
        /* the signed value: the first element of magnitude am */
        const __m256 vam = _mm256_set1_ps(am);
        int first = 0;
        for (int j = 0; j < QK_K; j += 8) {
            const __m256 ax = _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(x + j));
            const int hit = _mm256_movemask_ps(_mm256_cmp_ps(ax, vam, _CMP_EQ_OQ));
            if (hit) {
                first = j + __builtin_ctz((unsigned)hit);
                break;
            }
        }
        const float iscale = -127.0f / x[first];
        const __m256 vs = _mm256_set1_ps(iscale);
        const __m256i top = _mm256_set1_epi32(127);
        for (int half = 0; half < 2; half++) {
            __m256i g[8]; /* int32 partial sums of the 8 groups of 16 of this half */
            for (int c = 0; c < 4; c++) {
                const float *xc = x + 128 * half + 32 * c;
                __m256i v[4];
                /* cvtps rounds half to even, like the reference's nearest_int */
                for (int k = 0; k < 4; k++)
                    v[k] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xc + 8 * k), vs)), top);
                __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
                packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256((__m256i *)(qs + 128 * half + 32 * c), packed);
                g[2 * c] = _mm256_add_epi32(v[0], v[1]);
                g[2 * c + 1] = _mm256_add_epi32(v[2], v[3]);
            }
            const __m256i sums = FN(hsum8x8_epi32)(g); /* |sum| <= 16 * 127: packs does not saturate */
            const __m128i s16 = _mm_packs_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
            _mm_storeu_si128((__m128i *)(bsums + 8 * half), s16);
        }
        d[i] = 1.0f / iscale;
    }
}

/* ---- K-quant super-blocks in integer form ------------------------------------------------------------------ */

typedef struct {
    /* int16 scales of chunks 0..3 / 4..7 as int32 lanes of two equal int16: lane k of the low 128-bit half holds
     * group 2k (first 16 elements of chunk k), lane k of the high half group 2k + 1 */
    __m256i sc_lo, sc_hi;
    __m256i corr;         /* int16 per group: sc * offset (Q3_K, Q6_K), subtracted with the bsums */
    __m256i mn;           /* int16 per group: min (Q2_K, Q4_K, Q5_K) */
    float d, dmin;
} FN(kq8_sb);

/* Q4_K / Q5_K: {scales 0..7, mins 0..7} as 16 bytes from the 12 packed ones (see kq_scale_min). Packed bytes
 * 0..3, 4..7, 8..11 are the 32-bit words a0, a1, a2 (a 16-byte load: the block goes on after them):
 * scales 0..3 = a0 & 63, 4..7 = (a2 & 15) | (a0 >> 6) << 4; mins 0..3 = a1 & 63, 4..7 = (a2 >> 4) | (a1 >> 6) << 4 */
TARGET_INLINE __m128i FN(kq8_scales_k4)(const uint8_t *packed) {
    const __m128i v = _mm_loadu_si128((const __m128i *)packed);
    const __m128i t1 = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)); /* a0 a2 a1 a2 */
    const __m128i t2 = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)); /* a0 a0 a1 a1 */
    const __m128i low = _mm_and_si128(_mm_srlv_epi32(t1, _mm_setr_epi32(0, 0, 0, 4)),
                                      _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F));
    const __m128i high = _mm_and_si128(_mm_srlv_epi32(t2, _mm_setr_epi32(0, 2, 0, 2)),
                                       _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(low, high);
}

/* per-32 scales given as int16 pairs, int32 lane c = chunk c: both groups of chunk c take them */
TARGET_INLINE void FN(kq8_scales_per32)(__m256i pairs, FN(kq8_sb) *p) {
    p->sc_lo = _mm256_permute2x128_si256(pairs, pairs, 0x00);
    p->sc_hi = _mm256_permute2x128_si256(pairs, pairs, 0x11);
}

TARGET_INLINE void FN(kq8_setup)(const int kind, const uint8_t *blk, FN(kq8_sb) *p) {
    __m256i sc16;
    p->corr = p->mn = _mm256_setzero_si256();
    p->dmin = 0.0f;
    if (kind == PI_TYPE_Q2_K) {
        const block_q2_k *b = (const block_q2_k *)blk;
        const __m128i s = _mm_loadu_si128((const __m128i *)b->scales), low4 = _mm_set1_epi8(0x0F);
        sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(s, low4));
        p->mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), low4));
        p->d = _cvtsh_ss(b->d);
        p->dmin = _cvtsh_ss(b->dmin);
    } else if (kind == PI_TYPE_Q3_K) {
        const block_q3_k *b = (const block_q3_k *)blk;
        /* the 12 packed bytes as words a0, a1, a2 (no 16-byte load: the block ends 2 bytes after them). Scales
         * 0..3, 4..7, 8..11, 12..15: low 4 bits a0 & 15, a1 & 15, a0 >> 4, a1 >> 4 (per byte); top 2 bits: bit
         * pairs 0, 2, 4, 6 of a2 (see kq3_scales) */
        int32_t a2;
        memcpy(&a2, b->scales + 8, sizeof a2);
        const __m128i v = _mm_insert_epi32(_mm_loadl_epi64((const __m128i *)b->scales), a2, 2);
        const __m128i low = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 1, 0)),
                                                         _mm_setr_epi32(0, 0, 4, 4)),
                                          _mm_set1_epi8(0x0F));
        const __m128i top = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 2, 2));
        const __m128i high = _mm_and_si128(_mm_srlv_epi32(_mm_sllv_epi32(top, _mm_setr_epi32(4, 2, 0, 0)),
                                                          _mm_setr_epi32(0, 0, 0, 2)),
                                           _mm_set1_epi8(0x30));
        const __m128i s = _mm_sub_epi8(_mm_or_si128(low, high), _mm_set1_epi8(32));
        sc16 = _mm256_cvtepi8_epi16(s);
        p->corr = _mm256_slli_epi16(sc16, 2);
        p->d = _cvtsh_ss(b->d);
    } else if (kind == PI_TYPE_Q4_K || kind == PI_TYPE_Q5_K) {
        const __m128i sm = FN(kq8_scales_k4)(kind == PI_TYPE_Q4_K ? ((const block_q4_k *)blk)->scales
                                                                : ((const block_q5_k *)blk)->scales);
        const __m256i sc = _mm256_cvtepu8_epi32(sm); /* per-32 scales, one per int32 lane */
        FN(kq8_scales_per32)(_mm256_or_si256(sc, _mm256_slli_epi32(sc, 16)), p);
        p->mn = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm)); /* each per-32 min for both groups of 16 */
        uint32_t dm_bits; /* d, dmin lead both layouts */
        memcpy(&dm_bits, blk, sizeof dm_bits);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm_bits));
        p->d = _mm_cvtss_f32(dm);
        p->dmin = _mm_cvtss_f32(_mm_movehdup_ps(dm));
        return;
    } else if (kind == PI_TYPE_Q6_K) {
        const block_q6_k *b = (const block_q6_k *)blk;
        sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b->scales));
        p->corr = _mm256_slli_epi16(sc16, 5);
        p->d = _cvtsh_ss(b->d);
    } else {
        const block_iq4_xs *b = (const block_iq4_xs *)blk;
        uint32_t low;
        memcpy(&low, b->scales_l, sizeof low);
        /* int32 lane j: scale j = nibble j of scales_l | bits 2j, 2j+1 of scales_h << 4, minus 32 */
        const __m256i lo = _mm256_srlv_epi32(_mm256_set1_epi32((int)low), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        const __m256i hi = _mm256_srlv_epi32(_mm256_set1_epi32((int)b->scales_h << 4),
                                             _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
        const __m256i v = _mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0x0F)),
                                                           _mm256_and_si256(hi, _mm256_set1_epi32(0x30))),
                                           _mm256_set1_epi32(32));
        const __m256i pairs = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
        FN(kq8_scales_per32)(pairs, p);
        p->d = _cvtsh_ss(b->d);
        return;
    }
    /* per-16 scales g0..g15 -> int16 pairs [g0 g1 g2 g3 | g8 g9 g10 g11], [g4 .. g7 | g12 .. g15] -> halves by
     * chunk, then even groups low, odd groups high */
    const __m256i u_lo = _mm256_unpacklo_epi16(sc16, sc16), u_hi = _mm256_unpackhi_epi16(sc16, sc16);
    const __m256i even_odd = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    p->sc_lo = _mm256_permutevar8x32_epi32(_mm256_permute2x128_si256(u_lo, u_hi, 0x20), even_odd);
    p->sc_hi = _mm256_permutevar8x32_epi32(_mm256_permute2x128_si256(u_lo, u_hi, 0x31), even_odd);
}

/* The int16 scales of chunk c (elements 32c..32c+31): group 2c in the low 128-bit lane, 2c + 1 in the high one
 * (an immediate shuffle: no control vector held in a register) */
#define KQ8_SCALE(p, c) _mm256_shuffle_epi32((c) < 4 ? (p)->sc_lo : (p)->sc_hi, ((c) & 3) * 0x55)

/* (v >> s) per byte with s = from - to moved onto bit `to` (mask: that bit), bits of the neighbour byte masked off */
#define KQ8_BIT(v, from, to, mask)                                                                            \
    ((from) >= (to) ? _mm256_and_si256(_mm256_srli_epi16(v, (from) - (to)), _mm256_set1_epi8(mask))          \
                    : _mm256_and_si256(_mm256_slli_epi16(v, (to) - (from)), _mm256_set1_epi8(mask)))

/* The 32 unsigned values of chunk c (IQ4_XS: |kv|, and *sg the signed kv) */
TARGET_INLINE __m256i FN(kq8_chunk)(const int kind, const uint8_t *blk, const int c, __m256i *sg) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    switch (kind) {
        case PI_TYPE_Q2_K: {
            const block_q2_k *b = (const block_q2_k *)blk;
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * (c / 4)));
            return _mm256_and_si256(_mm256_srli_epi16(q, 2 * (c & 3)), _mm256_set1_epi8(3));
        }
        case PI_TYPE_Q3_K: {
            const block_q3_k *b = (const block_q3_k *)blk;
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * (c / 4)));
            const __m256i hm = _mm256_loadu_si256((const __m256i *)b->hmask);
            const __m256i low = _mm256_and_si256(_mm256_srli_epi16(q, 2 * (c & 3)), _mm256_set1_epi8(3));
            return _mm256_or_si256(low, KQ8_BIT(hm, c, 2, 0x04)); /* hmask bit c -> value bit 2 */
        }
        case PI_TYPE_Q4_K:
        case PI_TYPE_Q5_K: {
            const uint8_t *qs = kind == PI_TYPE_Q4_K ? ((const block_q4_k *)blk)->qs : ((const block_q5_k *)blk)->qs;
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * (c / 2)));
            const __m256i nib = _mm256_and_si256(c & 1 ? _mm256_srli_epi16(q, 4) : q, low4);
            if (kind == PI_TYPE_Q4_K) return nib;
            const __m256i qh = _mm256_loadu_si256((const __m256i *)((const block_q5_k *)blk)->qh);
            return _mm256_or_si256(nib, KQ8_BIT(qh, c, 4, 0x10)); /* qh bit c -> value bit 4 */
        }
        case PI_TYPE_Q6_K: {
            const block_q6_k *b = (const block_q6_k *)blk;
            const int h = c / 4, k = c & 3;
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32 * (k & 1)));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
            const __m256i nib = _mm256_and_si256(k >= 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
            return _mm256_or_si256(nib, KQ8_BIT(qh, 2 * k, 4, 0x30)); /* qh bits 2k, 2k+1 -> value bits 4, 5 */
        }
        default: {
            const block_iq4_xs *b = (const block_iq4_xs *)blk;
            const __m256i idx = FN(iq4_indices)(b->qs + 16 * c);
            const __m256i table = FN(iq4_table)();
            *sg = _mm256_shuffle_epi8(table, idx);
            return _mm256_shuffle_epi8(_mm256_abs_epi8(table), idx);
        }
    }
}

/* Activations of chunk c as the maddubs signed operand (IQ4_XS: the sign of the weight moved onto them) */
TARGET_INLINE __m256i FN(kq8_act)(const int kind, __m256i x, __m256i sg) {
    return kind == PI_TYPE_IQ4_XS ? _mm256_sign_epi8(x, sg) : x;
}

/* The float step of one super-block: S (and M) into the 8 float lanes of acc */
TARGET_INLINE __m256 FN(kq8_accumulate)(const int kind, const FN(kq8_sb) *p, __m256i S, const int16_t *bsums,
                                        float dx, __m256 acc) {
    if (kind == PI_TYPE_Q3_K || kind == PI_TYPE_Q6_K || kind == PI_TYPE_Q2_K || kind == PI_TYPE_Q4_K || kind == PI_TYPE_Q5_K) {
        const __m256i bs = _mm256_loadu_si256((const __m256i *)bsums);
        if (kind == PI_TYPE_Q3_K || kind == PI_TYPE_Q6_K) S = _mm256_sub_epi32(S, _mm256_madd_epi16(bs, p->corr));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(p->d * dx), _mm256_cvtepi32_ps(S)));
        if (kind == PI_TYPE_Q3_K || kind == PI_TYPE_Q6_K) return acc;
        const __m256i M = _mm256_madd_epi16(bs, p->mn);
        return _mm256_sub_ps(acc, _mm256_mul_ps(_mm256_set1_ps(p->dmin * dx), _mm256_cvtepi32_ps(M)));
    }
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(p->d * dx), _mm256_cvtepi32_ps(S)));
}

/* One row, ntok tokens: each super-block decoded once (values and scales of its 8 chunks), then every token;
 * ntok = 1 (a constant in the row dot) keeps everything in registers */
TARGET_INLINE void FN(kq8_tile_n)(const int kind, const int64_t block_bytes, const uint8_t *row, const act_q8k *a,
                                  int64_t t0, int ntok, float *out) {
    __m256 acc[KQ8_TILE_T];
    for (int t = 0; t < ntok; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t s = 0; s < a->nb; s++) {
        const uint8_t *blk = row + s * block_bytes;
        /* one token: the rows' dot over a dense matrix read in order (kq8_dot_*), prefetching as it reads */
        if (ntok == 1) prefetch_stream(blk, MATVEC_STREAM_AHEAD, block_bytes);
        FN(kq8_sb) p;
        FN(kq8_setup)(kind, blk, &p);
        __m256i u[8], sg[8], sc[8];
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            sg[c] = _mm256_setzero_si256();
            u[c] = FN(kq8_chunk)(kind, blk, c, &sg[c]);
            sc[c] = KQ8_SCALE(&p, c);
        }
        for (int t = 0; t < ntok; t++) {
            const int64_t tb = (t0 + t) * a->nb + s;
            const int8_t *xq = a->qs + (t0 + t) * a->K + s * QK_K;
            __m256i S = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                const __m256i x = FN(kq8_act)(kind, _mm256_loadu_si256((const __m256i *)(xq + 32 * c)), sg[c]);
                S = FN(madd_acc)(S, _mm256_maddubs_epi16(u[c], x), sc[c]);
            }
            acc[t] = FN(kq8_accumulate)(kind, &p, S, a->bsums + tb * 16, a->d[tb], acc[t]);
        }
    }
    for (int t = 0; t < ntok; t++) out[t] = FN(hsum256)(acc[t]);
}

/* Lanes j < n: the f16 at p + j * stride as a float (block j's d or dmin), 0 from lane n; clamped block indices
 * read nothing past the row, and no scalar stores are read back as a vector (a store-forwarding stall each). */
TARGET_INLINE __m256 FN(kq8_halves8)(const uint8_t *p, int64_t stride, int n) {
    uint16_t h[8];
    for (int j = 0; j < 8; j++) memcpy(&h[j], p + (j < n ? j : n - 1) * stride, 2);
    const __m128i v = _mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], (short)h[4], (short)h[5],
                                     (short)h[6], (short)h[7]);
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_and_ps(_mm256_cvtph_ps(v), _mm256_castsi256_ps(lanes));
}
/* Lanes j < n of x[0..n), 0 from lane n */
TARGET_INLINE __m256 FN(kq8_floats8)(const float *x, int n) {
    return _mm256_maskload_ps(x, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

/* Q4_K rows: per super-block the exact integers S (scales x dots) and M (mins x bsums), 8 super-blocks at a time
 * summed into the lanes (lane j = super-block g + j), then one float step per lane: acc_j + d_j dx_j S_j - dmin_j
 * dx_j M_j, hsum256 at the end. The same float steps lane by lane as kq8_tile8_q4_k, whose lanes are rows. */
TARGET_INLINE void FN(kq8_tile_q4_k_n)(const uint8_t *row, const act_q8k *a, int64_t t0, int ntok, float *out) {
    const block_q4_k *b = (const block_q4_k *)row;
    const int64_t nb = a->nb;
    __m256 acc[KQ8_TILE_T];
    for (int t = 0; t < ntok; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g += 8) {
        const int n = (int)min_i64(8, nb - g);
        __m256i S[KQ8_TILE_T][8], M[KQ8_TILE_T][8];
        for (int j = 0; j < 8; j++) {
            if (j >= n) {
                for (int t = 0; t < ntok; t++) S[t][j] = M[t][j] = _mm256_setzero_si256();
                continue;
            }
            const uint8_t *blk = (const uint8_t *)(b + g + j);
            FN(kq8_sb) p;
            FN(kq8_setup)(PI_TYPE_Q4_K, blk, &p);
            __m256i u[8], sc[8], unused;
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                u[c] = FN(kq8_chunk)(PI_TYPE_Q4_K, blk, c, &unused);
                sc[c] = KQ8_SCALE(&p, c);
            }
            for (int t = 0; t < ntok; t++) {
                const int64_t tb = (t0 + t) * nb + g + j;
                const int8_t *xq = a->qs + (t0 + t) * a->K + (g + j) * QK_K;
                __m256i acc_s = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++)
                    acc_s = FN(madd_acc)(acc_s, _mm256_maddubs_epi16(u[c], _mm256_loadu_si256((const __m256i *)(xq + 32 * c))),
                                         sc[c]);
                S[t][j] = acc_s;
                M[t][j] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a->bsums + tb * 16)), p.mn);
            }
        }
        const __m256 dv = FN(kq8_halves8)((const uint8_t *)(b + g), (int64_t)sizeof(block_q4_k), n);
        const __m256 mv = FN(kq8_halves8)((const uint8_t *)(b + g) + 2, (int64_t)sizeof(block_q4_k), n);
        for (int t = 0; t < ntok; t++) {
            const __m256 x = FN(kq8_floats8)(a->d + (t0 + t) * nb + g, n);
            acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_mul_ps(dv, x), _mm256_cvtepi32_ps(FN(hsum8x8_epi32)(S[t]))));
            acc[t] = _mm256_sub_ps(acc[t], _mm256_mul_ps(_mm256_mul_ps(mv, x), _mm256_cvtepi32_ps(FN(hsum8x8_epi32)(M[t]))));
        }
    }
    for (int t = 0; t < ntok; t++) out[t] = FN(hsum256)(acc[t]);
}


/* Super-block sb of R Q4_K rows: each row's 8 scales and 8 mins (sm[r], kq8_scales_k4) and its d and dmin halves */
TARGET_INLINE void FN(kq8_q4_k_heads)(const uint8_t *const *rows, int R, int64_t sb, uint8_t (*sm)[16], uint16_t *dh,
                                      uint16_t *mh) {
    for (int r = 0; r < R; r++) {
        const block_q4_k *blk = (const block_q4_k *)rows[r] + sb;
        _mm_store_si128((__m128i *)sm[r], FN(kq8_scales_k4)(blk->scales));
        uint16_t dm[2];
        memcpy(dm, blk, sizeof dm);
        dh[r] = dm[0], mh[r] = dm[1];
    }
}

/* Q4_K prompts, 8 rows at once with the rows in the vector lanes (as tile8_q4_0 in matmul_x86.h): per super-block
 * the rows' chunks are transposed into `panel` (vector j of chunk c: weights 4j..4j+3 of each row, row r in lane r)
 * with each row's chunk scales and mins as int16 pairs in its lane, so one broadcast of 4 activations meets all 8
 * rows. Per row the integers of kq8_tile_q4_k_n (S: 8 pair sums of <= 2 x 15 x 127 per int16, then madd with the
 * scale; M: mins times the bsum pairs) and its float steps into accumulator sb % 8 (its lane), then its hsum256
 * order ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)): the same bits. */
TARGET static void FN(kq8_tile8_q4_k)(const uint8_t *const *rows, const act_q8k *a, int64_t T, uint8_t *panel,
                                      float *y, int64_t y_stride) {
    const int64_t nb = a->nb, K = a->K;
    for (int64_t sb = 0; sb < nb; sb++) {
        __m256i *v = (__m256i *)(panel + sb * KQ8_PANEL_Q4_K);
        _Alignas(16) uint8_t sm[8][16];
        uint16_t dh[8], mh[8];
        FN(kq8_q4_k_heads)(rows, 8, sb, sm, dh, mh);
        for (int c = 0; c < 8; c++, v += 10) {
            __m256i u[8], unused;
            for (int r = 0; r < 8; r++) u[r] = FN(kq8_chunk)(PI_TYPE_Q4_K, rows[r] + sb * sizeof(block_q4_k), c, &unused);
            FN(transpose8_epi32)(u, v);
            int32_t sc[8], mn[8];
            /* AVX-512 multiplies the chunk's int32 sum by the scale, AVX2 madds int16 pair sums with (scale, scale) */
            for (int r = 0; r < 8; r++) sc[r] = sm[r][c] * (SIMD_AVX512 ? 1 : 0x10001), mn[r] = sm[r][8 + c] * 0x10001;
            _mm256_store_si256(v + 8, _mm256_loadu_si256((const __m256i *)sc));
            _mm256_store_si256(v + 9, _mm256_loadu_si256((const __m256i *)mn));
        }
        _mm256_store_ps((float *)v, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh)));
        _mm256_store_ps((float *)(v + 1), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mh)));
    }
    for (int64_t t = 0; t < T; t++) {
        __m256 acc8[8];
        for (int l = 0; l < 8; l++) acc8[l] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nb; sb++) {
            __m256 acc = acc8[sb & 7];
            const __m256i *v = (const __m256i *)(panel + sb * KQ8_PANEL_Q4_K);
            const int8_t *xq = a->qs + t * K + sb * QK_K;
            const int16_t *bs = a->bsums + (t * nb + sb) * 16;
            __m256i S = _mm256_setzero_si256(), M = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++, v += 10) {
                const int8_t *xc = xq + 32 * c;
#if SIMD_AVX512
                /* the chunk's exact sum in int32 by VNNI (at most 32 x 15 x 127), times the scale: the integer the
                 * pair sums and madd give below, in fewer instructions */
                __m256i s32 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_load_si256(v),
                                                  _mm256_set1_epi32(*(const int32_t *)xc));
                for (int j = 1; j < 8; j++)
                    s32 = _mm256_dpbusd_epi32(s32, _mm256_load_si256(v + j), _mm256_set1_epi32(*(const int32_t *)(xc + 4 * j)));
                S = _mm256_add_epi32(S, _mm256_mullo_epi32(s32, _mm256_load_si256(v + 8)));
#else
                __m256i s16 = _mm256_maddubs_epi16(_mm256_load_si256(v), _mm256_set1_epi32(*(const int32_t *)xc));
                for (int j = 1; j < 8; j++)
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_load_si256(v + j),
                                                                     _mm256_set1_epi32(*(const int32_t *)(xc + 4 * j))));
                S = FN(madd_acc)(S, s16, _mm256_load_si256(v + 8));
#endif
                M = FN(madd_acc)(M, _mm256_load_si256(v + 9), _mm256_set1_epi32(*(const int32_t *)(bs + 2 * c)));
            }
            const __m256 dx = _mm256_set1_ps(a->d[t * nb + sb]);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(_mm256_load_ps((const float *)v), dx), _mm256_cvtepi32_ps(S)));
            acc = _mm256_sub_ps(acc, _mm256_mul_ps(_mm256_mul_ps(_mm256_load_ps((const float *)(v + 1)), dx),
                                                   _mm256_cvtepi32_ps(M)));
            acc8[sb & 7] = acc;
        }
        const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc8[0], acc8[4]), _mm256_add_ps(acc8[2], acc8[6])),
                                         _mm256_add_ps(_mm256_add_ps(acc8[1], acc8[5]), _mm256_add_ps(acc8[3], acc8[7])));
        _mm256_storeu_ps(y + t * y_stride, sum);
    }
}

#if SIMD_AVX512
/* Tokens t0..t0 + ntok - 1 (ntok <= 4, a constant after inlining) over a filled Q4_K panel of 16 rows
 * (kq8_tile16_q4_k): each panel vector loaded once serves the ntok tokens; per token and row the integers and
 * float steps of kq8_tile16_q4_k's comment, so the same bits. */
TARGET_INLINE void FN(kq8_tile16_q4_k_tokens)(const uint8_t *panel, const act_q8k *a, int64_t t0, const int ntok,
                                             float *y, int64_t y_stride) {
    const int64_t nb = a->nb, K = a->K;
    __m512 acc8[4][8];
    for (int t = 0; t < ntok; t++)
        for (int l = 0; l < 8; l++) acc8[t][l] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nb; sb++) {
        const __m512i *v = (const __m512i *)(panel + sb * KQ8_PANEL16_Q4_K);
        __m512i S[4], M[4];
        for (int t = 0; t < ntok; t++) S[t] = M[t] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++, v += 10) {
            __m512i s32[4];
            for (int t = 0; t < ntok; t++) s32[t] = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                const __m512i w = _mm512_load_si512(v + j);
                for (int t = 0; t < ntok; t++)
                    s32[t] = _mm512_dpbusd_epi32(
                        s32[t], w, _mm512_set1_epi32(*(const int32_t *)(a->qs + (t0 + t) * K + sb * QK_K + 32 * c + 4 * j)));
            }
            const __m512i sc = _mm512_load_si512(v + 8), mn = _mm512_load_si512(v + 9);
            for (int t = 0; t < ntok; t++) {
                S[t] = _mm512_add_epi32(S[t], _mm512_mullo_epi32(s32[t], sc));
                M[t] = _mm512_dpwssd_epi32(
                    M[t], mn, _mm512_set1_epi32(*(const int32_t *)(a->bsums + ((t0 + t) * nb + sb) * 16 + 2 * c)));
            }
        }
        const __m512 d = _mm512_load_ps((const float *)v), dmin = _mm512_load_ps((const float *)(v + 1));
        for (int t = 0; t < ntok; t++) {
            const __m512 dx = _mm512_set1_ps(a->d[(t0 + t) * nb + sb]);
            __m512 acc = acc8[t][sb & 7];
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(S[t])));
            acc = _mm512_sub_ps(acc, _mm512_mul_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(M[t])));
            acc8[t][sb & 7] = acc;
        }
    }
    for (int t = 0; t < ntok; t++) {
        const __m512 *c = acc8[t];
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c[0], c[4]), _mm512_add_ps(c[2], c[6])),
                                         _mm512_add_ps(_mm512_add_ps(c[1], c[5]), _mm512_add_ps(c[3], c[7])));
        _mm512_storeu_ps(y + (t0 + t) * y_stride, sum);
    }
}

/* Q4_K prompts, 16 rows at once (AVX-512): kq8_tile8_q4_k with two panels side by side in 512-bit vectors, rows 0-7
 * in the low half and 8-15 in the high half: one load, one broadcast and one VNNI dot serve 16 rows. Each row keeps
 * kq8_tile8_q4_k's integers (the chunk's exact sum times its scale; mins times the bsum pairs) and float steps in
 * its lane, so the same bits. Panel per super-block: 8 chunks x (8 vectors, the scales as int32, the mins as int16
 * pairs), then d and dmin as floats. */
TARGET static void FN(kq8_tile16_q4_k)(const uint8_t *const *rows, const act_q8k *a, int64_t T, uint8_t *panel,
                                       float *y, int64_t y_stride) {
    const int64_t nb = a->nb;
    for (int64_t sb = 0; sb < nb; sb++) {
        __m512i *v = (__m512i *)(panel + sb * KQ8_PANEL16_Q4_K);
        _Alignas(16) uint8_t sm[16][16];
        uint16_t dh[16], mh[16];
        FN(kq8_q4_k_heads)(rows, 16, sb, sm, dh, mh);
        for (int c = 0; c < 8; c++, v += 10) {
            __m256i u[8], unused;
            _Alignas(32) __m256i lo[8], hi[8];
            for (int r = 0; r < 8; r++) u[r] = FN(kq8_chunk)(PI_TYPE_Q4_K, rows[r] + sb * sizeof(block_q4_k), c, &unused);
            FN(transpose8_epi32)(u, lo);
            for (int r = 0; r < 8; r++)
                u[r] = FN(kq8_chunk)(PI_TYPE_Q4_K, rows[8 + r] + sb * sizeof(block_q4_k), c, &unused);
            FN(transpose8_epi32)(u, hi);
            for (int j = 0; j < 8; j++) _mm512_store_si512(v + j, _mm512_inserti64x4(_mm512_castsi256_si512(lo[j]), hi[j], 1));
            int32_t sc[16], mn[16];
            for (int r = 0; r < 16; r++) sc[r] = sm[r][c], mn[r] = sm[r][8 + c] * 0x10001;
            _mm512_store_si512(v + 8, _mm512_loadu_si512(sc));
            _mm512_store_si512(v + 9, _mm512_loadu_si512(mn));
        }
        _mm512_store_ps((float *)v, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh)));
        _mm512_store_ps((float *)(v + 1), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)mh)));
    }
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) FN(kq8_tile16_q4_k_tokens)(panel, a, t, 4, y, y_stride);
    switch (T - t) {
        case 3: FN(kq8_tile16_q4_k_tokens)(panel, a, t, 3, y, y_stride); break;
        case 2: FN(kq8_tile16_q4_k_tokens)(panel, a, t, 2, y, y_stride); break;
        case 1: FN(kq8_tile16_q4_k_tokens)(panel, a, t, 1, y, y_stride); break;
        default: break;
    }
}
#endif

#define DEFINE_KQ8(type, kind, block_t)                                                                          \
    TARGET static void FN(kq8_tile_##type)(const uint8_t *row, const act_q8k *a, int64_t t0, int ntok, float *out) { \
        FN(kq8_tile_n)(kind, sizeof(block_t), row, a, t0, ntok, out);                                           \
    }                                                                                                           \
    TARGET static void FN(kq8_dot_##type)(const uint8_t *w, int64_t w_stride, int64_t n_rows, const act_q8k *a, \
                                          float *out) {                                                         \
        for (int64_t n = 0; n < n_rows; n++) FN(kq8_tile_n)(kind, sizeof(block_t), w + n * w_stride, a, 0, 1, out + n); \
    }
DEFINE_KQ8(q2_k, PI_TYPE_Q2_K, block_q2_k)
DEFINE_KQ8(q3_k, PI_TYPE_Q3_K, block_q3_k)
TARGET static void FN(kq8_tile_q4_k)(const uint8_t *row, const act_q8k *a, int64_t t0, int ntok, float *out) {
    FN(kq8_tile_q4_k_n)(row, a, t0, ntok, out);
}
/* One token: kq8_tile_q4_k_n's arithmetic with each chunk's values made as they are used (nothing to share) and
 * the group's S and M in registers */
TARGET static void FN(kq8_dot_q4_k)(const uint8_t *w, int64_t w_stride, int64_t n_rows, const act_q8k *a, float *out) {
    const int64_t nb = a->nb;
    for (int64_t n = 0; n < n_rows; n++) {
        const block_q4_k *b = (const block_q4_k *)(w + n * w_stride);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t g = 0; g < nb; g += 8) {
            const int cnt = (int)min_i64(8, nb - g);
            __m256i S[8], M[8];
            for (int j = 0; j < 8; j++) {
                S[j] = M[j] = _mm256_setzero_si256();
                if (j >= cnt) continue;
                const uint8_t *blk = (const uint8_t *)(b + g + j);
                prefetch_stream(blk, MATVEC_STREAM_AHEAD, (int64_t)sizeof(block_q4_k)); /* dense rows, in order */
                FN(kq8_sb) p;
                FN(kq8_setup)(PI_TYPE_Q4_K, blk, &p);
                const int8_t *xq = a->qs + (g + j) * QK_K;
                __m256i acc_s = _mm256_setzero_si256(), unused;
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++)
                    acc_s = FN(madd_acc)(acc_s,
                                         _mm256_maddubs_epi16(FN(kq8_chunk)(PI_TYPE_Q4_K, blk, c, &unused),
                                                              _mm256_loadu_si256((const __m256i *)(xq + 32 * c))),
                                         KQ8_SCALE(&p, c));
                S[j] = acc_s;
                M[j] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a->bsums + (g + j) * 16)), p.mn);
            }
            const __m256 x = FN(kq8_floats8)(a->d + g, cnt);
            const __m256 dv = FN(kq8_halves8)((const uint8_t *)(b + g), (int64_t)sizeof(block_q4_k), cnt);
            const __m256 mv = FN(kq8_halves8)((const uint8_t *)(b + g) + 2, (int64_t)sizeof(block_q4_k), cnt);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dv, x), _mm256_cvtepi32_ps(FN(hsum8x8_epi32)(S))));
            acc = _mm256_sub_ps(acc, _mm256_mul_ps(_mm256_mul_ps(mv, x), _mm256_cvtepi32_ps(FN(hsum8x8_epi32)(M))));
        }
        out[n] = FN(hsum256)(acc);
    }
}
DEFINE_KQ8(q5_k, PI_TYPE_Q5_K, block_q5_k)
DEFINE_KQ8(q6_k, PI_TYPE_Q6_K, block_q6_k)
DEFINE_KQ8(iq4_xs, PI_TYPE_IQ4_XS, block_iq4_xs)
#undef DEFINE_KQ8
#undef KQ8_BIT
#undef KQ8_SCALE

/* ---- IQ4_NL x Q8_0-style activations --------------------------------------------------------------------- */

/* Per block: kv[index] . q_x as 8 int32 lanes (sign moved onto x), converted and FMA'd with d_w * d_x into the
 * accumulator of the block's parity, one fixed horizontal sum at the end (as the Q8_0 tiles). */
TARGET_INLINE void FN(tile_iq4_nl_n)(const uint8_t *row, const act_q8 *a, int64_t t0, const int ntok, float *out) {
    const block_iq4_nl *b = (const block_iq4_nl *)row;
    const __m256i table = FN(iq4_table)(), table_abs = _mm256_abs_epi8(table);
    __m256 acc0[TILE_T], acc1[TILE_T];
    for (int t = 0; t < ntok; t++) acc0[t] = acc1[t] = _mm256_setzero_ps();
#define IQ4_NL_STEP(i, ACC)                                                                                     \
    do {                                                                                                        \
        const __m256i idx = FN(iq4_indices)(b[i].qs);                                                           \
        const __m256i w = _mm256_shuffle_epi8(table, idx), wabs = _mm256_shuffle_epi8(table_abs, idx);          \
        const float dw = _cvtsh_ss(b[i].d);                                                                     \
        for (int t = 0; t < ntok; t++) {                                                                        \
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->qs + (t0 + t) * a->K + (i) * QK));       \
            const __m256i p = FN(dot_u8s8)(_mm256_setzero_si256(), wabs, _mm256_sign_epi8(xv, w));             \
            const float scale = dw * a->ds[((t0 + t) * a->nb + (i)) * 2];                                       \
            ACC[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(scale), ACC[t]);                    \
        }                                                                                                       \
    } while (0)
    int64_t i = 0;
    for (; i + 1 < a->nb; i += 2) {
        IQ4_NL_STEP(i, acc0);
        IQ4_NL_STEP(i + 1, acc1);
    }
    if (i < a->nb) IQ4_NL_STEP(i, acc0);
#undef IQ4_NL_STEP
    for (int t = 0; t < ntok; t++) out[t] = FN(hsum256)(_mm256_add_ps(acc0[t], acc1[t]));
}

TARGET static void FN(tile_iq4_nl)(const uint8_t *row, const act_q8 *a, int64_t t0, int ntok, float *out) {
    switch (ntok) {
        case 1: FN(tile_iq4_nl_n)(row, a, t0, 1, out); break;
        case 2: FN(tile_iq4_nl_n)(row, a, t0, 2, out); break;
        case 3: FN(tile_iq4_nl_n)(row, a, t0, 3, out); break;
        default: FN(tile_iq4_nl_n)(row, a, t0, 4, out); break;
    }
}

/* ---- exact IQ4: weights decoded to floats, float activations ------------------------------------------- */

/* The 32 weights of an IQ4 block of scale `scale`: scale * (float)kv[index], the gguf decoder's product */
TARGET_INLINE void FN(iq4_decode32)(const uint8_t *qs, float scale, __m256 *w) {
    const __m256i v = _mm256_shuffle_epi8(FN(iq4_table)(), FN(iq4_indices)(qs));
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    const __m256 d = _mm256_set1_ps(scale);
    w[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
    w[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
    w[2] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
    w[3] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
}

#define IQ4F_TILE 2 /* tokens per inner pass: 4 accumulators each, plus the 4 weight vectors, fit 16 registers */

/* ntok <= IQ4F_TILE tokens; vector j of each 32 goes to accumulator j of its token, one fixed sum at the end */
TARGET_INLINE void FN(tile_iq4_f_n)(const int xs, const uint8_t *row, int64_t K, const float *x, int64_t x_stride,
                                    const int ntok, float *out) {
    __m256 acc[IQ4F_TILE][4];
    for (int t = 0; t < ntok; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / QK; i++) {
        __m256 w[4];
        if (xs) {
            const block_iq4_xs *b = (const block_iq4_xs *)row + i / 8;
            FN(iq4_decode32)(b->qs + 16 * (i % 8), _cvtsh_ss(b->d) * (float)iq4_xs_scale(b, (int)(i % 8)), w);
        } else {
            const block_iq4_nl *b = (const block_iq4_nl *)row + i;
            FN(iq4_decode32)(b->qs, _cvtsh_ss(b->d), w);
        }
        for (int t = 0; t < ntok; t++)
            for (int j = 0; j < 4; j++)
                acc[t][j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + t * x_stride + i * QK + 8 * j), acc[t][j]);
    }
    for (int t = 0; t < ntok; t++)
        out[t] = FN(hsum256)(_mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), _mm256_add_ps(acc[t][2], acc[t][3])));
}

#define DEFINE_TILE_IQ4_F(type, xs)                                                                          \
    TARGET static void FN(tile_##type##_f)(const uint8_t *row, int64_t K, const float *x, int64_t x_stride,   \
                                           int ntok, float *out) {                                            \
        for (int t0 = 0; t0 < ntok; t0 += IQ4F_TILE, x += IQ4F_TILE * x_stride, out += IQ4F_TILE) {           \
            if (ntok - t0 == 1)                                                                               \
                FN(tile_iq4_f_n)(xs, row, K, x, x_stride, 1, out);                                            \
            else                                                                                              \
                FN(tile_iq4_f_n)(xs, row, K, x, x_stride, IQ4F_TILE, out);                                    \
        }                                                                                                     \
    }
DEFINE_TILE_IQ4_F(iq4_nl, 0)
DEFINE_TILE_IQ4_F(iq4_xs, 1)
#undef DEFINE_TILE_IQ4_F
#undef IQ4F_TILE

#undef TARGET
#undef TARGET_INLINE
#undef FN
#undef SIMD_CAT
#undef SIMD_CAT_
