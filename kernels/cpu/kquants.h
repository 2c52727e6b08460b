/* The K-quant block formats of ggml (super-blocks of QK_K = 256 elements) and their scalar row decoders.
 *
 * Layouts, byte for byte as ggml writes them (little endian, fp16 IEEE binary16):
 *   Q2_K  84 B: scales[16] (low nibble scale, high nibble min, per 16 elements), qs[64] (2-bit), d, dmin
 *   Q3_K 110 B: hmask[32] (the third bit), qs[64] (low 2 bits), scales[12] (16 6-bit scales, biased by 32), d
 *   Q4_K 144 B: d, dmin, scales[12] (8 6-bit scales and 8 6-bit mins, per 32 elements), qs[128] (4-bit)
 *   Q5_K 176 B: d, dmin, scales[12] (as Q4_K), qh[32] (the fifth bit), qs[128] (low 4 bits)
 *   Q6_K 210 B: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8, per 16 elements), d
 * The decoders compute each element with the float operations of the reference dequantisers (ggml's and the
 * gguf package's, which agree): Q2_K/Q4_K/Q5_K (d * scale) * q - (dmin * min), Q3_K (d * (scale - 32)) * q,
 * Q6_K (d * scale) * q, every product and difference rounded to float32 (the build uses -ffp-contract=off).
 */
#ifndef POWERINFER_KERNELS_KQUANTS_H
#define POWERINFER_KERNELS_KQUANTS_H

#include "common.h"

#define QK_K 256 /* elements per K-quant super-block */

typedef struct {
    uint8_t scales[QK_K / 16];
    uint8_t qs[QK_K / 4];
    uint16_t d, dmin;
} block_q2_k;

typedef struct {
    uint8_t hmask[QK_K / 8];
    uint8_t qs[QK_K / 4];
    uint8_t scales[12];
    uint16_t d;
} block_q3_k;

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[QK_K / 2];
} block_q4_k;

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
} block_q5_k;

typedef struct {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    uint16_t d;
} block_q6_k;

_Static_assert(sizeof(block_q2_k) == 84, "block_q2_k must be 84 bytes");
_Static_assert(sizeof(block_q3_k) == 110, "block_q3_k must be 110 bytes");
_Static_assert(sizeof(block_q4_k) == 144, "block_q4_k must be 144 bytes");
_Static_assert(sizeof(block_q5_k) == 176, "block_q5_k must be 176 bytes");
_Static_assert(sizeof(block_q6_k) == 210, "block_q6_k must be 210 bytes");

/* Scale and min j (0..7) of a Q4_K / Q5_K super-block: 6 bits each, j < 4 in the low 6 bits of bytes j and
 * j + 4, j >= 4 as the nibbles of byte j + 4 with their top 2 bits in the top bits of bytes j - 4 and j. */
static inline void kq_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* The factors of 32-element groups j and j + 1 of a Q4_K / Q5_K super-block: d * scale and dmin * min */
static inline void kq_pair_factors(int j, const uint8_t *scales, float d, float dmin, float *d1, float *m1,
                                   float *d2, float *m2) {
    uint8_t sc, m;
    kq_scale_min(j, scales, &sc, &m);
    *d1 = d * (float)sc;
    *m1 = dmin * (float)m;
    kq_scale_min(j + 1, scales, &sc, &m);
    *d2 = d * (float)sc;
    *m2 = dmin * (float)m;
}

/* The 16 6-bit scales of a Q3_K super-block (still biased by 32): the low 4 bits are the nibbles of bytes
 * 0..7 (scales 0..7 low nibbles, 8..15 high nibbles), the top 2 bits come from bytes 8..11, two per scale. */
static inline void kq3_scales(const uint8_t *packed, int8_t *out) {
    for (int j = 0; j < 16; j++) {
        const int low = j < 8 ? packed[j] & 0x0F : packed[j - 8] >> 4;
        const int high = (packed[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
        out[j] = (int8_t)(low | (high << 4));
    }
}

static inline void decode_q2_k(const uint8_t *row, int64_t K, float *y) {
    const block_q2_k *b = (const block_q2_k *)row;
    for (int64_t i = 0; i < K / QK_K; i++, b++) {
        const float d = fp16_to_fp32(b->d), dmin = fp16_to_fp32(b->dmin);
        int is = 0;
        for (int n = 0; n < QK_K; n += 128) {
            const uint8_t *q = b->qs + n / 4;
            for (int shift = 0; shift < 8; shift += 2) {
                for (int half = 0; half < 2; half++, is++) {
                    const float dl = d * (float)(b->scales[is] & 0x0F), ml = dmin * (float)(b->scales[is] >> 4);
                    for (int l = 0; l < 16; l++) *y++ = dl * (float)((q[l + 16 * half] >> shift) & 3) - ml;
                }
            }
        }
    }
}

static inline void decode_q3_k(const uint8_t *row, int64_t K, float *y) {
    const block_q3_k *b = (const block_q3_k *)row;
    for (int64_t i = 0; i < K / QK_K; i++, b++) {
        const float d = fp16_to_fp32(b->d);
        int8_t sc[16];
        kq3_scales(b->scales, sc);
        int is = 0;
        uint8_t m = 1;
        for (int n = 0; n < QK_K; n += 128) {
            const uint8_t *q = b->qs + n / 4;
            for (int shift = 0; shift < 8; shift += 2, m = (uint8_t)(m << 1)) {
                for (int half = 0; half < 2; half++, is++) {
                    const float dl = d * (float)(sc[is] - 32);
                    for (int l = 16 * half; l < 16 * half + 16; l++) {
                        const int v = ((q[l] >> shift) & 3) - ((b->hmask[l] & m) ? 0 : 4);
                        *y++ = dl * (float)v;
                    }
                }
            }
        }
    }
}

static inline void decode_q4_k(const uint8_t *row, int64_t K, float *y) {
    const block_q4_k *b = (const block_q4_k *)row;
    for (int64_t i = 0; i < K / QK_K; i++, b++) {
        const float d = fp16_to_fp32(b->d), dmin = fp16_to_fp32(b->dmin);
        const uint8_t *q = b->qs;
        for (int j = 0; j < 8; j += 2, q += 32) {
            float d1, m1, d2, m2;
            kq_pair_factors(j, b->scales, d, dmin, &d1, &m1, &d2, &m2);
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0x0F) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
        }
    }
}

static inline void decode_q5_k(const uint8_t *row, int64_t K, float *y) {
    const block_q5_k *b = (const block_q5_k *)row;
    for (int64_t i = 0; i < K / QK_K; i++, b++) {
        const float d = fp16_to_fp32(b->d), dmin = fp16_to_fp32(b->dmin);
        const uint8_t *q = b->qs;
        for (int j = 0; j < 8; j += 2, q += 32) {
            float d1, m1, d2, m2;
            kq_pair_factors(j, b->scales, d, dmin, &d1, &m1, &d2, &m2);
            const uint8_t u1 = (uint8_t)(1u << j), u2 = (uint8_t)(2u << j);
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)((q[l] & 0x0F) + ((b->qh[l] & u1) ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (float)((q[l] >> 4) + ((b->qh[l] & u2) ? 16 : 0)) - m2;
        }
    }
}

static inline void decode_q6_k(const uint8_t *row, int64_t K, float *y) {
    const block_q6_k *b = (const block_q6_k *)row;
    for (int64_t i = 0; i < K / QK_K; i++, b++) {
        const float d = fp16_to_fp32(b->d);
        const uint8_t *ql = b->ql, *qh = b->qh;
        const int8_t *sc = b->scales;
        for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * (float)sc[is] * (float)q1;
                y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
        }
    }
}

/* ---- super-blocks in integer form: what the scalar "q8" kernels (matmul_q8k.c) compute on ------------------
 *
 * A super-block of weights is, per 16 elements g, an unsigned value u per element (Q2_K 0..3, Q3_K 0..7, Q4_K
 * 0..15, Q5_K 0..31, Q6_K 0..63; IQ4_XS: the signed kv[index]), an integer scale sc_g and, for some types, an
 * integer min mn_g (Q2_K, Q4_K, Q5_K) or an offset o (Q3_K 4, Q6_K 32):
 *   w = d * sc_g * (u - o) - dmin * mn_g.
 * corr_g = sc_g * o is the coefficient of the activations' group sum subtracted from the integer dot. Q4_K / Q5_K
 * scales and mins are per 32 elements: both groups of 16 take them. */
typedef struct {
    int16_t w[QK_K];
    int16_t sc[16], corr[16], mn[16];
    float d, dmin;
    int has_min;
    /* the float order of the type's "q8" kernels (matmul_q8k.c): S and M summed over the super-block first, one
     * float step into lane (block % 8) (Q4_K, whose SIMD kernels run 8 super-blocks at a time) */
    int reduce;
} kq8_int_block;

typedef void (*kq8_ints_fn)(const uint8_t *blk, kq8_int_block *o);

static inline void kq8_ints_q2_k(const uint8_t *blk, kq8_int_block *o) {
    memset(o, 0, sizeof *o);
    const block_q2_k *b = (const block_q2_k *)blk;
    for (int e = 0; e < QK_K; e++) {
        const int h = e / 128, j = (e % 128) / 32, l = e % 32;
        o->w[e] = (b->qs[32 * h + l] >> (2 * j)) & 3;
    }
    for (int g = 0; g < 16; g++) {
        o->sc[g] = b->scales[g] & 0x0F;
        o->mn[g] = b->scales[g] >> 4;
    }
    o->d = fp16_to_fp32(b->d);
    o->dmin = fp16_to_fp32(b->dmin);
    o->has_min = 1;
}

static inline void kq8_ints_q3_k(const uint8_t *blk, kq8_int_block *o) {
    memset(o, 0, sizeof *o);
    const block_q3_k *b = (const block_q3_k *)blk;
    for (int e = 0; e < QK_K; e++) {
        const int h = e / 128, j = (e % 128) / 32, l = e % 32;
        o->w[e] = ((b->qs[32 * h + l] >> (2 * j)) & 3) | (((b->hmask[l] >> (4 * h + j)) & 1) << 2);
    }
    int8_t sc[16];
    kq3_scales(b->scales, sc);
    for (int g = 0; g < 16; g++) {
        o->sc[g] = sc[g] - 32;
        o->corr[g] = 4 * o->sc[g];
    }
    o->d = fp16_to_fp32(b->d);
}

/* Q4_K and Q5_K (qh: the fifth bits, NULL for Q4_K); d and dmin lead both layouts */
static inline void kq8_ints_k45(const uint8_t *blk, const uint8_t *scales, const uint8_t *qs, const uint8_t *qh,
                                int reduce, kq8_int_block *o) {
    memset(o, 0, sizeof *o);
    for (int e = 0; e < QK_K; e++) {
        const int c = e / 32, l = e % 32;
        const uint8_t q = qs[32 * (c / 2) + l];
        o->w[e] = c % 2 ? q >> 4 : q & 0x0F;
        if (qh != NULL) o->w[e] |= ((qh[l] >> c) & 1) << 4;
    }
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        kq_scale_min(j, scales, &sc, &m);
        o->sc[2 * j] = o->sc[2 * j + 1] = sc;
        o->mn[2 * j] = o->mn[2 * j + 1] = m;
    }
    const uint16_t *dd = (const uint16_t *)blk;
    o->d = fp16_to_fp32(dd[0]);
    o->dmin = fp16_to_fp32(dd[1]);
    o->has_min = 1;
    o->reduce = reduce;
}

static inline void kq8_ints_q4_k(const uint8_t *blk, kq8_int_block *o) {
    const block_q4_k *b = (const block_q4_k *)blk;
    kq8_ints_k45(blk, b->scales, b->qs, NULL, 1, o);
}

static inline void kq8_ints_q5_k(const uint8_t *blk, kq8_int_block *o) {
    const block_q5_k *b = (const block_q5_k *)blk;
    kq8_ints_k45(blk, b->scales, b->qs, b->qh, 0, o);
}

static inline void kq8_ints_q6_k(const uint8_t *blk, kq8_int_block *o) {
    memset(o, 0, sizeof *o);
    const block_q6_k *b = (const block_q6_k *)blk;
    for (int e = 0; e < QK_K; e++) {
        const int h = e / 128, k = (e % 128) / 32, l = e % 32;
        const uint8_t q = b->ql[64 * h + 32 * (k & 1) + l];
        o->w[e] = (k < 2 ? q & 0x0F : q >> 4) | (((b->qh[32 * h + l] >> (2 * k)) & 3) << 4);
    }
    for (int g = 0; g < 16; g++) {
        o->sc[g] = b->scales[g];
        o->corr[g] = 32 * o->sc[g];
    }
    o->d = fp16_to_fp32(b->d);
}

/* ---- IQ4_NL / IQ4_XS: 4-bit indices into the non-linear table kvalues_iq4 ----------------------------------
 *
 *   IQ4_NL  18 B (32 elements):  d, qs[16]: element j < 16 is the low nibble of qs[j], j >= 16 the high nibble of
 *                                qs[j - 16]; x = d * kv[index]
 *   IQ4_XS 136 B (256 elements): d, scales_h (u16: 2 high bits of sub-block scale j at bits 2j), scales_l[4] (low
 *                                4 bits of scale j in nibble j & 1 of byte j / 2), qs[128] (sub-block j of 32 in
 *                                qs[16j..16j+15] as IQ4_NL); x = (d * (scale - 32)) * kv[index]
 * The decoders round as the gguf package does: one float product per element (two for IQ4_XS).
 */
typedef struct {
    uint16_t d;
    uint8_t qs[QK / 2];
} block_iq4_nl;

typedef struct {
    uint16_t d;
    uint16_t scales_h;
    uint8_t scales_l[QK_K / 64];
    uint8_t qs[QK_K / 2];
} block_iq4_xs;

_Static_assert(sizeof(block_iq4_nl) == 18, "block_iq4_nl must be 18 bytes");
_Static_assert(sizeof(block_iq4_xs) == 136, "block_iq4_xs must be 136 bytes");

static const int8_t kvalues_iq4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* The scale of 32-element sub-block j (0..7) of an IQ4_XS super-block, bias removed: -32..31 */
static inline int iq4_xs_scale(const block_iq4_xs *b, int j) {
    const int low = (b->scales_l[j / 2] >> (4 * (j & 1))) & 0x0F;
    const int high = (b->scales_h >> (2 * j)) & 3;
    return (low | (high << 4)) - 32;
}

static inline void decode_iq4_nl(const uint8_t *row, int64_t K, float *y) {
    const block_iq4_nl *b = (const block_iq4_nl *)row;
    for (int64_t i = 0; i < K / QK; i++, b++, y += QK) {
        const float d = fp16_to_fp32(b->d);
        for (int j = 0; j < QK / 2; j++) {
            y[j] = d * (float)kvalues_iq4[b->qs[j] & 0x0F];
            y[j + QK / 2] = d * (float)kvalues_iq4[b->qs[j] >> 4];
        }
    }
}

static inline void decode_iq4_xs(const uint8_t *row, int64_t K, float *y) {
    const block_iq4_xs *b = (const block_iq4_xs *)row;
    for (int64_t i = 0; i < K / QK_K; i++, b++) {
        const float d = fp16_to_fp32(b->d);
        for (int j = 0; j < QK_K / 32; j++, y += 32) {
            const float dl = d * (float)iq4_xs_scale(b, j);
            const uint8_t *q = b->qs + 16 * j;
            for (int l = 0; l < 16; l++) {
                y[l] = dl * (float)kvalues_iq4[q[l] & 0x0F];
                y[l + 16] = dl * (float)kvalues_iq4[q[l] >> 4];
            }
        }
    }
}

static inline void kq8_ints_iq4_xs(const uint8_t *blk, kq8_int_block *o) {
    memset(o, 0, sizeof *o);
    const block_iq4_xs *b = (const block_iq4_xs *)blk;
    for (int e = 0; e < QK_K; e++) {
        const int c = e / 32, l = e % 32;
        const uint8_t q = b->qs[16 * c + l % 16];
        o->w[e] = kvalues_iq4[l < 16 ? q & 0x0F : q >> 4];
    }
    for (int g = 0; g < 16; g++) o->sc[g] = (int16_t)iq4_xs_scale(b, g / 2);
    o->d = fp16_to_fp32(b->d);
}

#endif
