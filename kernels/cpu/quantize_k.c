/* quantize_k: float32 rows -> Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS blocks.
 *
 * Bit-exact with llama.cpp's quantizers as its `quantize` tool runs them without an importance matrix
 * (ggml_quantize_chunk with imatrix NULL): the K types take the reference row quantizers (quantize_row_q*_K_ref),
 * IQ4_NL and IQ4_XS the non-linear search with 7 trial scales either side. Bit-exactness needs the same float
 * operations in the same order: every sum below is a sequential float32 sum in element order, every product and
 * quotient is rounded to float32 on its own (the build uses -ffp-contract=off, so no FMA is formed). For speed,
 * independent fits run side by side with their index innermost (the groups of a super-block for the asymmetric
 * fit, the trial scales of one group for Q6_K and IQ4), so that the compiler vectorises across them: a SIMD lane
 * does the same IEEE operations as the scalar code, and each lane's sums keep the element order.
 *
 * Per 256-element super-block (per 32 for IQ4_NL):
 *   Q2_K  16 groups of 16: an asymmetric 2-bit fit (scale, min) per group searched over 16 trial scales, least
 *         absolute error weighted by |x|; scales and mins quantized to 4 bits against fp16 d = max scale / 15,
 *         dmin = max min / 15; then every element requantized with the stored factors.
 *   Q3_K  16 groups of 16: a symmetric 3-bit fit (weights x^2) refined by up to 5 coordinate-descent passes;
 *         6-bit signed scales against fp16 d = -max scale / 32; requantized.
 *   Q4_K  8 groups of 32: the asymmetric fit with 4 bits (21 trial scales, squared error weighted by rms + |x|);
 *   Q5_K  the same with 5 bits (16 trial scales); both keep 6-bit scales and mins against fp16 d, dmin = max / 63.
 *   Q6_K  16 groups of 16: a symmetric 6-bit fit (weights x^2, 19 trial scales); 8-bit scales against fp16
 *         d = -max scale / 128.
 *   IQ4_NL / IQ4_XS  groups of 32 mapped onto the 16 non-linear levels below (weights x^2, 15 trial scales);
 *         IQ4_NL keeps each group's scale as fp16, IQ4_XS 6-bit scales against fp16 d = -max scale / 32.
 *
 * fp16 conversion rounds to nearest, ties to even (as F16C's vcvtps2ph and ggml's software conversion do), with
 * overflow to inf and nan to the quiet nan 0x7E00.
 */
#include <math.h>

#include "quants.h"
#include "matmul.h"

/* IQ4_NL: {fp16 d; u8 qs[16]}, 18 bytes per 32: x[j] = d * levels[qs[j] & 15], x[j + 16] = d * levels[qs[j] >> 4].
 * IQ4_XS: {fp16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]}, 136 bytes per 256: group g (of 32) has the 6-bit
 * scale (nibble g % 2 of scales_l[g / 2]) | (bits 2g, 2g+1 of scales_h) << 4, factor d * (scale - 32), and its
 * quants as an IQ4_NL block's qs at qs + 16 g. */
/* (the IQ4 block structs and their 16 levels, kvalues_iq4, are kquants.h's, shared with the decoders) */

#define GROUP_EPS 1e-15f /* a group whose largest |x| is below this is all zero */

/* ------------------------------------------------------------------------------------------------------------ */
/* rounding                                                                                                     */

/* v rounded to the nearest integer, ties to even, for |v| < 2^22: adding 1.5 * 2^23 leaves round(v) + 2^22 in
 * the low 23 bits of the sum. (Outside that range the result is the same wrapped value the reference gets.) */
static inline int round_int(float v) {
    const float shifted = v + 12582912.0f;
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    return (bits & 0x007FFFFF) - 0x00400000;
}

static inline int clamp_int(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* ------------------------------------------------------------------------------------------------------------ */
/* group fits                                                                                                   */

#define FIT_MAX_GROUPS 16 /* groups fitted side by side */
#define FIT_MAX_ELEMS 32  /* elements per group */

/* Asymmetric fits of G groups of n values each (x, w, L: element i of group g at [g * n + i]) to levels 0..nmax:
 * x ~ scale * L - m with m >= 0. Per group: the min/max grid, then trial scales iscale = (rmin + rdelta * k +
 * nmax) / (max - min) for k = 0..nstep, each with its weighted least-squares scale and offset (offset clamped to
 * <= 0), a trial kept only when its weighted error (|diff| when use_abs, else diff^2) is strictly smaller; a kept
 * trial's offset replaces min in the later trials' grids. A flat group (max == min once min is clamped to <= 0)
 * gets L = 0 and scale 0. Writes L, scale[g] and neg_min[g] = m.
 *
 * The groups are independent; they run in lockstep with the group index innermost (the data transposed) so that
 * the compiler vectorises across groups, while each group's sums stay sequential in element order. */
static inline __attribute__((always_inline)) void fit_scale_min(const int G, const int n, const int nmax,
                                                                const float *x, const float *w, uint8_t *L,
                                                                float *scale, float *neg_min, float rmin,
                                                                float rdelta, int nstep, int use_abs) {
    float xt[FIT_MAX_ELEMS][FIT_MAX_GROUPS], wt[FIT_MAX_ELEMS][FIT_MAX_GROUPS];
    float best_l[FIT_MAX_ELEMS][FIT_MAX_GROUPS], trial_l[FIT_MAX_ELEMS][FIT_MAX_GROUPS];
    for (int g = 0; g < G; g++) {
        for (int i = 0; i < n; i++) {
            xt[i][g] = x[g * n + i];
            wt[i][g] = w[g * n + i];
        }
    }
    float lo[FIT_MAX_GROUPS], hi[FIT_MAX_GROUPS], sum_w[FIT_MAX_GROUPS], sum_x[FIT_MAX_GROUPS];
    for (int g = 0; g < G; g++) {
        lo[g] = hi[g] = xt[0][g];
        sum_w[g] = wt[0][g];
        sum_x[g] = sum_w[g] * xt[0][g];
    }
    for (int i = 1; i < n; i++) {
#pragma omp simd
        for (int g = 0; g < G; g++) {
            lo[g] = xt[i][g] < lo[g] ? xt[i][g] : lo[g];
            hi[g] = xt[i][g] > hi[g] ? xt[i][g] : hi[g];
            sum_w[g] += wt[i][g];
            sum_x[g] += wt[i][g] * xt[i][g];
        }
    }
    float range[FIT_MAX_GROUPS], iscale[FIT_MAX_GROUPS], best_scale[FIT_MAX_GROUPS], flat_min[FIT_MAX_GROUPS];
    int flat[FIT_MAX_GROUPS];
    for (int g = 0; g < G; g++) {
        lo[g] = lo[g] > 0 ? 0 : lo[g];
        flat[g] = hi[g] == lo[g];
        flat_min[g] = lo[g];
        range[g] = hi[g] - lo[g];
        iscale[g] = (float)nmax / range[g];
        best_scale[g] = 1 / iscale[g];
    }
    float best_error[FIT_MAX_GROUPS] = {0};
    for (int i = 0; i < n; i++) {
#pragma omp simd
        for (int g = 0; g < G; g++) {
            const float l = (float)clamp_int(round_int(iscale[g] * (xt[i][g] - lo[g])), 0, nmax);
            best_l[i][g] = l;
            const float d = best_scale[g] * l + lo[g] - xt[i][g];
            best_error[g] += wt[i][g] * (use_abs ? fabsf(d) : d * d);
        }
    }
    for (int step = 0; step <= nstep; step++) {
        float sum_l[FIT_MAX_GROUPS] = {0}, sum_l2[FIT_MAX_GROUPS] = {0}, sum_xl[FIT_MAX_GROUPS] = {0};
        for (int g = 0; g < G; g++) iscale[g] = (rmin + rdelta * (float)step + (float)nmax) / range[g];
        for (int i = 0; i < n; i++) {
    #pragma omp simd
        for (int g = 0; g < G; g++) {
                const float l = (float)clamp_int(round_int(iscale[g] * (xt[i][g] - lo[g])), 0, nmax);
                trial_l[i][g] = l;
                const float wl = wt[i][g] * l;
                sum_l[g] += wl;
                sum_l2[g] += wl * l;
                sum_xl[g] += wl * xt[i][g];
            }
        }
        float this_scale[FIT_MAX_GROUPS], this_min[FIT_MAX_GROUPS], error[FIT_MAX_GROUPS] = {0};
        int keep[FIT_MAX_GROUPS];
#pragma omp simd
        for (int g = 0; g < G; g++) {
            const float D = sum_w[g] * sum_l2[g] - sum_l[g] * sum_l[g];
            const float s = (sum_w[g] * sum_xl[g] - sum_x[g] * sum_l[g]) / D;
            const float m = (sum_l2[g] * sum_x[g] - sum_l[g] * sum_xl[g]) / D;
            this_scale[g] = m > 0 ? sum_xl[g] / sum_l2[g] : s;
            this_min[g] = m > 0 ? 0.0f : m;
            keep[g] = D > 0 && !flat[g]; /* D <= 0: the trial is skipped */
        }
        for (int i = 0; i < n; i++) {
    #pragma omp simd
        for (int g = 0; g < G; g++) {
                const float d = this_scale[g] * trial_l[i][g] + this_min[g] - xt[i][g];
                error[g] += wt[i][g] * (use_abs ? fabsf(d) : d * d);
            }
        }
        int any = 0;
#pragma omp simd
        for (int g = 0; g < G; g++) {
            keep[g] = keep[g] && error[g] < best_error[g];
            any |= keep[g];
            if (keep[g]) {
                best_error[g] = error[g];
                best_scale[g] = this_scale[g];
                lo[g] = this_min[g];
                range[g] = hi[g] - lo[g];
            }
        }
        if (!any) continue;
        for (int i = 0; i < n; i++) {
            for (int g = 0; g < G; g++) best_l[i][g] = keep[g] ? trial_l[i][g] : best_l[i][g];
        }
    }
    for (int g = 0; g < G; g++) {
        scale[g] = flat[g] ? 0.0f : best_scale[g];
        neg_min[g] = flat[g] ? -flat_min[g] : -lo[g];
        for (int i = 0; i < n; i++) L[g * n + i] = flat[g] ? 0 : (uint8_t)best_l[i][g];
    }
}

/* The value of largest magnitude among n (the first one on ties) and that magnitude */
static inline float signed_max(int n, const float *x, float *amax_out) {
    float amax = 0, max = 0;
    for (int i = 0; i < n; i++) {
        const float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            max = x[i];
        }
    }
    *amax_out = amax;
    return max;
}

/* Q6_K's symmetric fit of 16 values to levels -32..31 (stored + 32), weights x^2: the grid of the largest
 * magnitude, then 18 trial scales iscale = -(32 + 0.1 k) / max (k = -9..9, k != 0), each kept when its
 * least-squares score sumlx^2 / suml2 is strictly larger. Returns the scale (0 for an all-zero group, L = 0).
 * The trials are independent until the choice, so their sums run side by side (trial index innermost, each sum
 * still sequential in element order) and the choice walks them in order afterwards. */
#define Q6_TRIALS 20 /* the grid, 18 trial scales, one unused lane */
static float fit_q6_group(const float *x, int8_t *L) {
    const int nmax = 32, n = 16;
    float amax;
    const float max = signed_max(n, x, &amax);
    if (amax < GROUP_EPS) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    float w[16], wx[16];
    for (int i = 0; i < n; i++) {
        w[i] = x[i] * x[i];
        wx[i] = w[i] * x[i];
    }
    float iscale[Q6_TRIALS];
    iscale[0] = (float)-nmax / max;
    for (int t = 1; t < Q6_TRIALS; t++) {
        const int k = t <= 9 ? t - 10 : (t <= 18 ? t - 9 : 9);
        iscale[t] = -((float)nmax + 0.1f * (float)k) / max;
    }
    float sumlx[Q6_TRIALS] = {0}, suml2[Q6_TRIALS] = {0};
    for (int i = 0; i < n; i++) {
#pragma omp simd
        for (int t = 0; t < Q6_TRIALS; t++) {
            const float l = (float)clamp_int(round_int(iscale[t] * x[i]), -nmax, nmax - 1);
            sumlx[t] += wx[i] * l;
            suml2[t] += w[i] * l * l;
        }
    }
    int chosen = 0;
    float scale = suml2[0] != 0 ? sumlx[0] / suml2[0] : 0.0f;
    float best = scale * sumlx[0];
    for (int t = 1; t <= 18; t++) {
        if (suml2[t] > 0 && sumlx[t] * sumlx[t] > best * suml2[t]) {
            chosen = t;
            scale = sumlx[t] / suml2[t];
            best = scale * sumlx[t];
        }
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(clamp_int(round_int(iscale[chosen] * x[i]), -nmax, nmax - 1) + nmax);
    return scale;
}

/* Q3_K's symmetric fit of 16 values to levels -4..3 (stored + 4), weights x^2: the grid of the largest magnitude,
 * then up to 5 passes that move one element at a time to the level its leave-one-out scale picks, when that
 * raises sumlx^2 / suml2. Returns the scale (0 for an all-zero group, L = 0). */
static float fit_q3_group(const float *x, int8_t *L) {
    const int nmax = 4, n = 16;
    float amax;
    const float max = signed_max(n, x, &amax);
    if (amax < GROUP_EPS) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    float w[16], wx[16];
    for (int i = 0; i < n; i++) {
        w[i] = x[i] * x[i];
        wx[i] = w[i] * x[i];
    }
    const float iscale = (float)-nmax / max;
    for (int i = 0; i < n; i++) L[i] = (int8_t)clamp_int(round_int(iscale * x[i]), -nmax, nmax - 1);
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        sumlx += wx[i] * (float)L[i];
        suml2 += w[i] * (float)L[i] * (float)L[i];
    }
    for (int pass = 0; pass < 5; pass++) {
        int changed = 0;
        for (int i = 0; i < n; i++) {
            float slx = sumlx - wx[i] * (float)L[i];
            if (!(slx > 0)) continue;
            float sl2 = suml2 - w[i] * (float)L[i] * (float)L[i];
            const int l = clamp_int(round_int(x[i] * sl2 / slx), -nmax, nmax - 1);
            if (l == L[i]) continue;
            slx += wx[i] * (float)l;
            sl2 += w[i] * (float)l * (float)l;
            if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                L[i] = (int8_t)l;
                sumlx = slx;
                suml2 = sl2;
                changed++;
            }
        }
        if (!changed) break;
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* The level nearest v: with the bracket levels[k] <= v < levels[k + 1] (k = 0 below the levels, 14 above them and
 * for nan), the lower level when v is strictly nearer to it, else the upper one. This is the reference's bisection
 * (which returns the end levels outright beyond the ends: the same levels) without branches, so that it
 * vectorises. iq4_nearest_index gives the level's index, iq4_nearest_level its value. */
static inline int iq4_nearest_index(float v) {
    int k = 0;
    for (int i = 1; i < 15; i++) k += !(v < (float)kvalues_iq4[i]);
    return v - (float)kvalues_iq4[k] < (float)kvalues_iq4[k + 1] - v ? k : k + 1;
}

static inline float iq4_nearest_level(float v) {
    float lower = (float)kvalues_iq4[0], upper = (float)kvalues_iq4[15];
    for (int i = 1; i < 15; i++) lower = !(v < (float)kvalues_iq4[i]) ? (float)kvalues_iq4[i] : lower;
    for (int i = 14; i > 0; i--) upper = v < (float)kvalues_iq4[i] ? (float)kvalues_iq4[i] : upper;
    return v - lower < upper - v ? lower : upper;
}

/* The IQ4 scale of a group of 32 (weights x^2): the levels of d = max / 127, then 15 trial scales
 * id = (k - 127) / max (k = -7..7), keeping the least-squares d of the best score sumqx^2 / sumq2. Returns 0 for an
 * all-zero group. The 16 grids' sums run side by side (as in fit_q6_group), the choice walks them in order. */
#define IQ4_TRIALS 16
static float fit_iq4_group(const float *x) {
    float amax;
    const float max = signed_max(32, x, &amax);
    if (amax < GROUP_EPS) return 0.0f;
    float w[32];
    for (int j = 0; j < 32; j++) w[j] = x[j] * x[j];
    float id[IQ4_TRIALS];
    id[0] = 1 / (-max / (float)kvalues_iq4[0]);
    for (int t = 1; t < IQ4_TRIALS; t++) id[t] = (float)(t - 8 + kvalues_iq4[0]) / max;
    float sumqx[IQ4_TRIALS] = {0}, sumq2[IQ4_TRIALS] = {0};
    for (int j = 0; j < 32; j++) {
#pragma omp simd
        for (int t = 0; t < IQ4_TRIALS; t++) {
            const float q = iq4_nearest_level(id[t] * x[j]);
            const float wq = w[j] * q;
            sumqx[t] += wq * x[j];
            sumq2[t] += wq * q;
        }
    }
    float d = sumq2[0] > 0 ? sumqx[0] / sumq2[0] : 0.0f;
    float best = d * sumqx[0];
    for (int t = 1; t < IQ4_TRIALS; t++) {
        if (sumq2[t] > 0 && sumqx[t] * sumqx[t] > best * sumq2[t]) {
            d = sumqx[t] / sumq2[t];
            best = d * sumqx[t];
        }
    }
    return d;
}

/* the 32 nibbles of a group at scale 1 / inv_scale: qs[j] = idx[j] | idx[j + 16] << 4 */
static void iq4_pack_group(const float *x, float inv_scale, uint8_t *qs) {
    int idx[32];
    for (int j = 0; j < 32; j++) idx[j] = iq4_nearest_index(inv_scale * x[j]);
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)(idx[j] | (idx[j + 16] << 4));
}

/* ------------------------------------------------------------------------------------------------------------ */
/* block quantizers: x -> one block                                                                             */

/* 2-bit quants of 256 values (levels 0..3 for each element index i; L in element order) into the qs layout of
 * Q2_K / Q3_K: byte 32 c + l (c = i / 128, l = i % 32) holds elements 128 c + l + 32 s in bits 2s, 2s+1 */
static void pack_2bit(const uint8_t *L, uint8_t *qs) {
    for (int c = 0; c < QK_K; c += 128) {
        for (int l = 0; l < 32; l++) {
            qs[c / 4 + l] =
                (uint8_t)(L[c + l] | (L[c + l + 32] << 2) | (L[c + l + 64] << 4) | (L[c + l + 96] << 6));
        }
    }
}

static void quantize_block_q2_k(const float *x, uint8_t *out) {
    block_q2_k *y = (block_q2_k *)out;
    uint8_t L[QK_K];
    float scales[16], mins[16], w[QK_K];
    for (int i = 0; i < QK_K; i++) w[i] = fabsf(x[i]);
    fit_scale_min(16, 16, 3, x, w, L, scales, mins, -0.5f, 0.1f, 15, 1);
    float max_scale = 0, max_min = 0;
    for (int g = 0; g < 16; g++) {
        if (scales[g] > max_scale) max_scale = scales[g];
        if (mins[g] > max_min) max_min = mins[g];
    }
    if (max_scale > 0) {
        const float iscale = 15.0f / max_scale;
        for (int g = 0; g < 16; g++) y->scales[g] = (uint8_t)round_int(iscale * scales[g]);
        y->d = fp32_to_fp16(max_scale / 15.0f);
    } else {
        memset(y->scales, 0, sizeof y->scales);
        y->d = fp32_to_fp16(0.0f);
    }
    if (max_min > 0) {
        const float iscale = 15.0f / max_min;
        for (int g = 0; g < 16; g++) {
            y->scales[g] = (uint8_t)(y->scales[g] | ((unsigned)round_int(iscale * mins[g]) << 4));
        }
        y->dmin = fp32_to_fp16(max_min / 15.0f);
    } else {
        y->dmin = fp32_to_fp16(0.0f);
    }
    const float d = fp16_to_fp32(y->d), dmin = fp16_to_fp32(y->dmin);
    for (int g = 0; g < 16; g++) {
        const float dg = d * (float)(y->scales[g] & 0x0F);
        if (dg == 0) continue; /* a zero factor keeps the fit's levels */
        const float mg = dmin * (float)(y->scales[g] >> 4);
        for (int l = 0; l < 16; l++) L[16 * g + l] = (uint8_t)clamp_int(round_int((x[16 * g + l] + mg) / dg), 0, 3);
    }
    pack_2bit(L, y->qs);
}

static void quantize_block_q3_k(const float *x, uint8_t *out) {
    block_q3_k *y = (block_q3_k *)out;
    int8_t L[QK_K];
    float scales[16];
    float max_scale = 0, amax = 0;
    for (int g = 0; g < 16; g++) {
        scales[g] = fit_q3_group(x + 16 * g, L + 16 * g);
        const float a = fabsf(scales[g]);
        if (a > amax) {
            amax = a;
            max_scale = scales[g];
        }
    }
    memset(y->scales, 0, sizeof y->scales);
    if (max_scale != 0) {
        const float iscale = -32.0f / max_scale;
        for (int g = 0; g < 16; g++) {
            /* 6 bits biased by 32: the low nibble at byte g (g < 8) or the high nibble of byte g - 8, the top two
             * bits at bits 2 (g / 4) of byte 8 + g % 4 */
            const int8_t l8 = (int8_t)round_int(iscale * scales[g]);
            const int q = clamp_int(l8, -32, 31) + 32;
            if (g < 8) {
                y->scales[g] = (uint8_t)(q & 0x0F);
            } else {
                y->scales[g - 8] = (uint8_t)(y->scales[g - 8] | ((q & 0x0F) << 4));
            }
            y->scales[8 + g % 4] = (uint8_t)(y->scales[8 + g % 4] | ((q >> 4) << (2 * (g / 4))));
        }
        y->d = fp32_to_fp16(1 / iscale);
    } else {
        y->d = fp32_to_fp16(0.0f);
    }
    int8_t sc[16];
    kq3_scales(y->scales, sc);
    const float d = fp16_to_fp32(y->d);
    for (int g = 0; g < 16; g++) {
        const float dg = d * (float)(int8_t)(sc[g] - 32);
        if (dg == 0) continue;
        for (int l = 0; l < 16; l++) L[16 * g + l] = (int8_t)(clamp_int(round_int(x[16 * g + l] / dg), -4, 3) + 4);
    }
    /* the third bit of element i goes to bit i / 32 of hmask[i % 32] */
    memset(y->hmask, 0, sizeof y->hmask);
    uint8_t low[QK_K];
    for (int i = 0; i < QK_K; i++) {
        const int v = L[i];
        if (v > 3) y->hmask[i % 32] = (uint8_t)(y->hmask[i % 32] | (1u << (i / 32)));
        low[i] = (uint8_t)(v > 3 ? v - 4 : v);
    }
    pack_2bit(low, y->qs);
}

/* Q4_K / Q5_K share the scale search: 8 groups of 32 with weights rms(group) + |x|, 6-bit scales and mins
 * (packed as kq_scale_min reads them), then the requantized levels 0..nmax in L */
static void quantize_block_k_asym(const float *x, int nmax, float rmin, int nstep, uint16_t *d_out, uint16_t *dmin_out,
                                  uint8_t *packed_scales, uint8_t *L) {
    float scales[8], mins[8], w[QK_K];
    for (int g = 0; g < 8; g++) {
        const float *xg = x + 32 * g;
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += xg[l] * xg[l];
        const float av_x = sqrtf(sum_x2 / 32.0f);
        for (int l = 0; l < 32; l++) w[32 * g + l] = av_x + fabsf(xg[l]);
    }
    if (nmax == 15) {
        fit_scale_min(8, 32, 15, x, w, L, scales, mins, rmin, 0.1f, nstep, 0);
    } else {
        fit_scale_min(8, 32, 31, x, w, L, scales, mins, rmin, 0.1f, nstep, 0);
    }
    float max_scale = 0, max_min = 0;
    for (int g = 0; g < 8; g++) {
        if (scales[g] > max_scale) max_scale = scales[g];
        if (mins[g] > max_min) max_min = mins[g];
    }
    const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
    const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
    for (int g = 0; g < 8; g++) {
        uint8_t ls = (uint8_t)round_int(inv_scale * scales[g]);
        uint8_t lm = (uint8_t)round_int(inv_min * mins[g]);
        ls = ls < 63 ? ls : 63;
        lm = lm < 63 ? lm : 63;
        if (g < 4) {
            packed_scales[g] = ls;
            packed_scales[g + 4] = lm;
        } else {
            packed_scales[g + 4] = (uint8_t)((ls & 0x0F) | ((lm & 0x0F) << 4));
            packed_scales[g - 4] = (uint8_t)(packed_scales[g - 4] | ((ls >> 4) << 6));
            packed_scales[g] = (uint8_t)(packed_scales[g] | ((lm >> 4) << 6));
        }
    }
    *d_out = fp32_to_fp16(max_scale / 63.0f);
    *dmin_out = fp32_to_fp16(max_min / 63.0f);
    const float d = fp16_to_fp32(*d_out), dmin = fp16_to_fp32(*dmin_out);
    for (int g = 0; g < 8; g++) {
        uint8_t sc, m;
        kq_scale_min(g, packed_scales, &sc, &m);
        const float dg = d * (float)sc;
        if (dg == 0) continue;
        const float mg = dmin * (float)m;
        for (int l = 0; l < 32; l++) L[32 * g + l] = (uint8_t)clamp_int(round_int((x[32 * g + l] + mg) / dg), 0, nmax);
    }
}

static void quantize_block_q4_k(const float *x, uint8_t *out) {
    block_q4_k *y = (block_q4_k *)out;
    uint8_t L[QK_K];
    quantize_block_k_asym(x, 15, -1.0f, 20, &y->d, &y->dmin, y->scales, L);
    /* byte 32 c + l: element 64 c + l in the low nibble, 64 c + l + 32 in the high one */
    for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) y->qs[32 * c + l] = (uint8_t)(L[64 * c + l] | (L[64 * c + l + 32] << 4));
    }
}

static void quantize_block_q5_k(const float *x, uint8_t *out) {
    block_q5_k *y = (block_q5_k *)out;
    uint8_t L[QK_K];
    quantize_block_k_asym(x, 31, -0.5f, 15, &y->d, &y->dmin, y->scales, L);
    /* low nibbles as Q4_K; the fifth bit of element 64 c + l (+ 32) at bit 2 c (2 c + 1) of qh[l] */
    memset(y->qh, 0, sizeof y->qh);
    for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) {
            const int a = L[64 * c + l], b = L[64 * c + l + 32];
            y->qh[l] = (uint8_t)(y->qh[l] | ((a >> 4) << (2 * c)) | ((b >> 4) << (2 * c + 1)));
            y->qs[32 * c + l] = (uint8_t)((a & 0x0F) | ((b & 0x0F) << 4));
        }
    }
}

static void quantize_block_q6_k(const float *x, uint8_t *out) {
    block_q6_k *y = (block_q6_k *)out;
    int8_t L[QK_K];
    float scales[16];
    float max_scale = 0, max_abs = 0;
    for (int g = 0; g < 16; g++) {
        scales[g] = fit_q6_group(x + 16 * g, L + 16 * g);
        const float a = fabsf(scales[g]);
        if (a > max_abs) {
            max_abs = a;
            max_scale = scales[g];
        }
    }
    memset(y, 0, sizeof *y);
    if (max_abs < GROUP_EPS) return; /* all zero (d = +0) */
    const float iscale = -128.0f / max_scale;
    y->d = fp32_to_fp16(1 / iscale);
    for (int g = 0; g < 16; g++) {
        const int s = round_int(iscale * scales[g]);
        y->scales[g] = (int8_t)(s < 127 ? s : 127);
    }
    const float d = fp16_to_fp32(y->d);
    for (int g = 0; g < 16; g++) {
        const float dg = d * (float)y->scales[g];
        if (dg == 0) continue;
        for (int l = 0; l < 16; l++) L[16 * g + l] = (int8_t)(clamp_int(round_int(x[16 * g + l] / dg), -32, 31) + 32);
    }
    /* per 128 (c): ql[64 c' + l] / ql[64 c' + l + 32] hold elements l, l + 64 / l + 32, l + 96 (low, high nibble);
     * qh[32 c' + l] the top two bits of elements l, l + 32, l + 64, l + 96 at bits 0, 2, 4, 6 */
    for (int c = 0; c < 2; c++) {
        const int8_t *Lc = L + 128 * c;
        uint8_t *ql = y->ql + 64 * c, *qh = y->qh + 32 * c;
        for (int l = 0; l < 32; l++) {
            ql[l] = (uint8_t)((Lc[l] & 0x0F) | ((Lc[l + 64] & 0x0F) << 4));
            ql[l + 32] = (uint8_t)((Lc[l + 32] & 0x0F) | ((Lc[l + 96] & 0x0F) << 4));
            qh[l] = (uint8_t)((Lc[l] >> 4) | ((Lc[l + 32] >> 4) << 2) | ((Lc[l + 64] >> 4) << 4) |
                              ((Lc[l + 96] >> 4) << 6));
        }
    }
}

static void quantize_block_iq4_nl(const float *x, uint8_t *out) {
    block_iq4_nl *y = (block_iq4_nl *)out;
    const float d = fit_iq4_group(x);
    y->d = fp32_to_fp16(d);
    iq4_pack_group(x, d != 0 ? 1 / d : 0.0f, y->qs);
}

static void quantize_block_iq4_xs(const float *x, uint8_t *out) {
    block_iq4_xs *y = (block_iq4_xs *)out;
    float scales[8];
    float max_scale = 0, amax = 0;
    for (int g = 0; g < 8; g++) {
        scales[g] = fit_iq4_group(x + 32 * g);
        const float a = fabsf(scales[g]);
        if (a > amax) {
            amax = a;
            max_scale = scales[g];
        }
    }
    const float d = -max_scale / 32.0f; /* -0.0 for an all-zero block, as the reference stores it */
    y->d = fp32_to_fp16(d);
    const float id = d != 0 ? 1 / d : 0.0f;
    uint16_t scales_h = 0;
    for (int g = 0; g < 8; g++) {
        const int l = clamp_int(round_int(id * scales[g]), -32, 31);
        const float dl = d * (float)l;
        iq4_pack_group(x + 32 * g, dl != 0 ? 1 / dl : 0.0f, y->qs + 16 * g);
        const int q = l + 32;
        if (g % 2 == 0) {
            y->scales_l[g / 2] = (uint8_t)(q & 0x0F);
        } else {
            y->scales_l[g / 2] = (uint8_t)(y->scales_l[g / 2] | ((q & 0x0F) << 4));
        }
        scales_h = (uint16_t)(scales_h | ((q >> 4) << (2 * g)));
    }
    y->scales_h = scales_h;
}

/* ------------------------------------------------------------------------------------------------------------ */
/* entry                                                                                                        */

typedef void (*quantize_block_fn)(const float *x, uint8_t *out);

/* pi_quantize_rows(ggml_type, src, n_rows, n_cols, dst, n_threads): quantize n_rows contiguous rows of n_cols
 * floats into dst, n_rows * (n_cols / block elements * block bytes) bytes, rows back to back (the GGUF layout).
 * PI_ERR_SHAPE for a type not listed above, negative counts, n_cols not a multiple of the block (256; 32 for
 * IQ4_NL), a size that overflows, or NULL buffers with work to do. Blocks are independent, so the result does not
 * depend on n_threads. */
PI_EXPORT int32_t pi_quantize_rows(int32_t ggml_type, const float *src, int64_t n_rows, int64_t n_cols, uint8_t *dst,
                                   int32_t n_threads) {
    quantize_block_fn fn;
    int64_t block_elems = QK_K, block_bytes;
    switch (ggml_type) {
    case PI_TYPE_Q2_K: fn = quantize_block_q2_k, block_bytes = sizeof(block_q2_k); break;
    case PI_TYPE_Q3_K: fn = quantize_block_q3_k, block_bytes = sizeof(block_q3_k); break;
    case PI_TYPE_Q4_K: fn = quantize_block_q4_k, block_bytes = sizeof(block_q4_k); break;
    case PI_TYPE_Q5_K: fn = quantize_block_q5_k, block_bytes = sizeof(block_q5_k); break;
    case PI_TYPE_Q6_K: fn = quantize_block_q6_k, block_bytes = sizeof(block_q6_k); break;
    case PI_TYPE_IQ4_NL: fn = quantize_block_iq4_nl, block_elems = 32, block_bytes = sizeof(block_iq4_nl); break;
    case PI_TYPE_IQ4_XS: fn = quantize_block_iq4_xs, block_bytes = sizeof(block_iq4_xs); break;
    default: return PI_ERR_SHAPE;
    }
    if (n_rows < 0 || n_cols < 0 || n_cols % block_elems != 0) return PI_ERR_SHAPE;
    if (n_cols > 0 && n_rows > INT64_MAX / n_cols) return PI_ERR_SHAPE;
    const int64_t n_blocks = n_rows * (n_cols / block_elems);
    if (n_blocks == 0) return PI_OK;
    if (src == NULL || dst == NULL) return PI_ERR_SHAPE;
    const int32_t nt = threads_for_work(n_threads, n_rows * n_cols);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < n_blocks; b++) fn(src + b * block_elems, dst + b * block_bytes);
    return PI_OK;
}

/* pi_quantize_q8_k(x, K, T, qs, d, bsums, isa): the Q8_K activations the "q8" K-quant kernels compute with
 * (matmul_q8k.c, at SIMD level `isa`), for T contiguous rows of K floats (K a multiple of 256): qs (T, K) int8,
 * d (T, K / 256) float, bsums (T, K / 16) int16. Exported for tests and tools; the kernels quantise internally. */
PI_EXPORT int32_t pi_quantize_q8_k(const float *x, int64_t K, int64_t T, int8_t *qs, float *d, int16_t *bsums,
                                   int32_t isa) {
    if (K < 0 || T < 0 || K % QK_K != 0) return PI_ERR_SHAPE;
    if (K > 0 && T > 0 && (x == NULL || qs == NULL || d == NULL || bsums == NULL)) return PI_ERR_SHAPE;
    const quantize_q8k_fn quantize = kq8_quantizer(isa);
    const int64_t nb = K / QK_K;
    for (int64_t t = 0; t < T; t++) quantize(x + t * K, nb, qs + t * K, d + t * nb, bsums + t * nb * 16);
    return PI_OK;
}
