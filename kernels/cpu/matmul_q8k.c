/* K-quant (Q2_K..Q6_K) and IQ4_XS matmul in "q8" precision, IQ4_NL in "q8" precision, and the exact (float
 * activation) IQ4_NL / IQ4_XS kernels.
 *
 * "q8" K-quants (llama.cpp's arithmetic): the activations of each token are quantised per super-block of 256 to
 * Q8_K: x ~= d_x * q, q int8 in [-127, 127], with d_x = -max / 127 where max is the first element of largest
 * magnitude (so the sign of d_x is that of -max), q = min(127, round_half_even(x * (-127 / max))), d_x = 1 / that
 * factor, and bsums[g] = sum(q) over the 16 elements of group g. A super-block of weights is, per 16 elements g,
 * an unsigned value u (Q2_K 0..3, Q3_K 0..7, Q4_K 0..15, Q5_K 0..31, Q6_K 0..63; IQ4_XS: the signed kv[index]),
 * an integer scale sc_g and, for some types, an integer min mn_g or an offset o (Q3_K 4, Q6_K 32):
 *   w = d * sc_g * (u - o) - dmin * mn_g,
 * so that the block's contribution to w . x is, with exact integer sums,
 *   d * d_x * S - dmin * d_x * M,   S = sum_g sc_g * (u_g . q_g - o * bsums[g]),   M = sum_g mn_g * bsums[g].
 * (Q4_K / Q5_K scales and mins are per 32 elements: both groups of 16 take them.)
 *
 * Float order (so that decode, batch, any thread count and every SIMD variant give the same bits): S and M are
 * kept as 8 int32 lanes, lane l holding elements 4l..4l+3 of every 32 (and groups 2l, 2l+1 of the bsums terms),
 * the lanes the AVX2 maddubs/madd sequence produces. Per super-block and lane, in float32:
 *   acc[l] = acc[l] + (d * d_x) * (float)S[l];   then, types with mins: acc[l] = acc[l] - (dmin * d_x) * (float)M[l]
 * and the result is ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)). The scalar fallback follows
 * this lane by lane, so it is bit-equal to the SIMD variants.
 *
 * IQ4_NL "q8": the activations are the Q8_0-style blocks of 32 of the other int8 kernels (matmul.c's quantize_act)
 * and each block contributes d_w * d_x * (kv[index] . q_x), accumulated like the Q8_0 tiles.
 *
 * Exact IQ4 (pi_matmul_iq4_nl_f / _iq4_xs_f): the weights are decoded to the gguf decoder's floats (kquants.h) and
 * multiplied with float x, as the K-quant exact kernels do.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "quants.h"
#include "matmul.h"

#define KQ8_TILE_T 8 /* tokens per tile: one super-block decode shared by all of them */
#define KQ8_PANEL_Q4_K (8 * 10 * 32 + 2 * 32) /* per super-block of 8 rows: 8 chunks x (8 vectors, scales, mins), d, dmin */
#define KQ8_PANEL16_Q4_K (8 * 10 * 64 + 2 * 64) /* the same for 16 rows in 512-bit vectors (AVX-512) */
#define KQ8_TILE8_MIN_T 4                      /* tokens from which Q4_K rows go by panels of 8 */
/* bytes per super-block of a type's panels of 8 and of 16 rows (0: it has none) */
static const int32_t kq8_panel_bytes[PI_TYPE_COUNT][2] = {[PI_TYPE_Q4_K] = {KQ8_PANEL_Q4_K, KQ8_PANEL16_Q4_K}};

typedef void (*quantize_q8k_fn)(const float *x, int64_t nb, int8_t *qs, float *d, int16_t *bsums);
/* out[t] = row . token t0 + t, t < ntok <= KQ8_TILE_T */
typedef void (*kq8_tile_fn)(const uint8_t *row, const act_q8k *a, int64_t t0, int ntok, float *out);
/* out[r] = row r . token 0 for the n_rows rows at w, w_stride bytes apart: per row the arithmetic of the tile.
 * One row at a time (measured: interleaving 2 or 4 rows is no faster in cache, and for Q6_K 6x slower: the
 * values, scales and accumulators of several rows exceed the 16 ymm registers). */
typedef void (*kq8_dot_fn)(const uint8_t *w, int64_t w_stride, int64_t n_rows, const act_q8k *a, float *out);
typedef void (*kq8_panel_fn)(const uint8_t *const *rows, const act_q8k *a, int64_t T, uint8_t *panel, float *y,
                             int64_t y_stride);

typedef struct {
    quantize_q8k_fn quantize;
    kq8_tile_fn tile[PI_TYPE_COUNT];
    kq8_dot_fn dot[PI_TYPE_COUNT];
    /* prompts by panels of 8 rows, per type id: rows[0..7] x T tokens into y[t * y_stride + r], the bits of the
     * tile; `panel` holds nb * kq8_panel_bytes[type][0] bytes, 32-byte aligned (NULL: row by row) */
    kq8_panel_fn tile8[PI_TYPE_COUNT];
    /* the same by panels of 16 rows (NULL: none), `panel` of nb * kq8_panel_bytes[type][1] bytes, 64-byte aligned */
    kq8_panel_fn tile16[PI_TYPE_COUNT];
    tile_quant_fn tile_iq4_nl;                    /* Q8_0-style activations (act_q8) */
    tile_float_fn tile_iq4_nl_f, tile_iq4_xs_f; /* float activations, ntok <= TILE_TQ */
} kq8_table;

/* the final sum of the 8 lanes, in the order of the SIMD horizontal sum */
static inline float kq8_lanes_sum(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* ---- scalar fallback --------------------------------------------------------------------------------------- */

static void quantize_q8k_scalar(const float *x, int64_t nb, int8_t *qs, float *d, int16_t *bsums) {
    for (int64_t i = 0; i < nb; i++, x += QK_K, qs += QK_K, bsums += QK_K / 16) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK_K; j++) {
            const float ax = fabsf(x[j]);
            if (ax > amax) {
                amax = ax;
                max = x[j];
            }
        }
        if (amax == 0.0f) {
            d[i] = 0.0f;
            memset(qs, 0, QK_K);
            memset(bsums, 0, QK_K / 16 * sizeof(int16_t));
            continue;
        }
        const float iscale = -127.0f / max;
        for (int j = 0; j < QK_K; j++) {
            const float v = iscale * x[j];
            /* |v| <= 127 for finite x: the clamp only keeps a non-finite input from undefined conversions */
            qs[j] = v == v ? (int8_t)rintf(fminf(fmaxf(v, -128.0f), 127.0f)) : (int8_t)-128;
        }
        for (int g = 0; g < QK_K / 16; g++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += qs[16 * g + j];
            bsums[g] = (int16_t)sum;
        }
        d[i] = 1.0f / iscale;
    }
}

/* A super-block in integer form: per element the value u (or kv for IQ4_XS), per group of 16 the scale, the
 * bsums coefficient subtracted from S (sc * offset) and the min. */
typedef struct {
    int16_t w[QK_K];
    int16_t sc[16], corr[16], mn[16];
    float d, dmin;
    int has_min;
    int reduce; /* Q4_K: S and M summed over the super-block first, one float step into lane (block % 8) */
} kq8_int_block;

static void kq8_int_scalar(int kind, const uint8_t *blk, kq8_int_block *o) {
    memset(o, 0, sizeof *o);
    if (kind == PI_TYPE_Q2_K) {
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
    } else if (kind == PI_TYPE_Q3_K) {
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
    } else if (kind == PI_TYPE_Q4_K || kind == PI_TYPE_Q5_K) {
        const uint8_t *scales = kind == PI_TYPE_Q4_K ? ((const block_q4_k *)blk)->scales : ((const block_q5_k *)blk)->scales;
        const uint8_t *qs = kind == PI_TYPE_Q4_K ? ((const block_q4_k *)blk)->qs : ((const block_q5_k *)blk)->qs;
        for (int e = 0; e < QK_K; e++) {
            const int c = e / 32, l = e % 32;
            const uint8_t q = qs[32 * (c / 2) + l];
            o->w[e] = c % 2 ? q >> 4 : q & 0x0F;
            if (kind == PI_TYPE_Q5_K) o->w[e] |= ((((const block_q5_k *)blk)->qh[l] >> c) & 1) << 4;
        }
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            kq_scale_min(j, scales, &sc, &m);
            o->sc[2 * j] = o->sc[2 * j + 1] = sc;
            o->mn[2 * j] = o->mn[2 * j + 1] = m;
        }
        const uint16_t *dd = (const uint16_t *)blk; /* d, dmin lead both layouts */
        o->d = fp16_to_fp32(dd[0]);
        o->dmin = fp16_to_fp32(dd[1]);
        o->has_min = 1;
        o->reduce = kind == PI_TYPE_Q4_K;
    } else if (kind == PI_TYPE_Q6_K) {
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
    } else {
        const block_iq4_xs *b = (const block_iq4_xs *)blk;
        for (int e = 0; e < QK_K; e++) {
            const int c = e / 32, l = e % 32;
            const uint8_t q = b->qs[16 * c + l % 16];
            o->w[e] = kvalues_iq4[l < 16 ? q & 0x0F : q >> 4];
        }
        for (int g = 0; g < 16; g++) o->sc[g] = (int16_t)iq4_xs_scale(b, g / 2);
        o->d = fp16_to_fp32(b->d);
    }
}

/* One super-block of one token into the 8 lane accumulators */
static void kq8_lanes_scalar(const kq8_int_block *b, const int8_t *xq, const int16_t *bs, float dx, float *acc,
                             int64_t s_index) {
    int32_t S[8] = {0}, M[8] = {0};
    for (int e = 0; e < QK_K; e++) S[(e % 32) / 4] += b->sc[e / 16] * (b->w[e] * xq[e]);
    for (int l = 0; l < 8; l++) {
        S[l] -= b->corr[2 * l] * bs[2 * l] + b->corr[2 * l + 1] * bs[2 * l + 1];
        M[l] = b->mn[2 * l] * bs[2 * l] + b->mn[2 * l + 1] * bs[2 * l + 1];
    }
    const float dd = b->d * dx, dm = b->dmin * dx;
    if (b->reduce) {
        int32_t s = 0, m = 0;
        for (int l = 0; l < 8; l++) s += S[l], m += M[l];
        float *lane = acc + (s_index & 7);
        *lane = *lane + dd * (float)s;
        *lane = *lane - dm * (float)m;
        return;
    }
    for (int l = 0; l < 8; l++) {
        acc[l] = acc[l] + dd * (float)S[l];
        if (b->has_min) acc[l] = acc[l] - dm * (float)M[l];
    }
}

static void kq8_tile_scalar(int kind, int64_t block_bytes, const uint8_t *row, const act_q8k *a, int64_t t0,
                            int ntok, float *out) {
    float acc[KQ8_TILE_T][8] = {{0}};
    kq8_int_block b;
    for (int64_t s = 0; s < a->nb; s++) {
        kq8_int_scalar(kind, row + s * block_bytes, &b);
        for (int t = 0; t < ntok; t++) {
            const int64_t tb = (t0 + t) * a->nb + s;
            kq8_lanes_scalar(&b, a->qs + (t0 + t) * a->K + s * QK_K, a->bsums + tb * 16, a->d[tb], acc[t], s);
        }
    }
    for (int t = 0; t < ntok; t++) out[t] = kq8_lanes_sum(acc[t]);
}

#define DEFINE_KQ8_SCALAR(type, kind, block_t)                                                                  \
    static void kq8_tile_##type##_scalar(const uint8_t *row, const act_q8k *a, int64_t t0, int ntok, float *out) { \
        kq8_tile_scalar(kind, sizeof(block_t), row, a, t0, ntok, out);                                          \
    }                                                                                                           \
    static void kq8_dot_##type##_scalar(const uint8_t *w, int64_t w_stride, int64_t n_rows, const act_q8k *a,    \
                                        float *out) {                                                           \
        for (int64_t r = 0; r < n_rows; r++) kq8_tile_scalar(kind, sizeof(block_t), w + r * w_stride, a, 0, 1, out + r); \
    }
DEFINE_KQ8_SCALAR(q2_k, PI_TYPE_Q2_K, block_q2_k)
DEFINE_KQ8_SCALAR(q3_k, PI_TYPE_Q3_K, block_q3_k)
DEFINE_KQ8_SCALAR(q4_k, PI_TYPE_Q4_K, block_q4_k)
DEFINE_KQ8_SCALAR(q5_k, PI_TYPE_Q5_K, block_q5_k)
DEFINE_KQ8_SCALAR(q6_k, PI_TYPE_Q6_K, block_q6_k)
DEFINE_KQ8_SCALAR(iq4_xs, PI_TYPE_IQ4_XS, block_iq4_xs)
#undef DEFINE_KQ8_SCALAR

/* IQ4_NL x Q8_0-style activations: integer block dot, one float product-sum per block */
static void tile_iq4_nl_scalar(const uint8_t *row, const act_q8 *a, int64_t t0, int ntok, float *out) {
    const block_iq4_nl *b = (const block_iq4_nl *)row;
    for (int t = 0; t < ntok; t++) {
        const int8_t *xq = a->qs + (t0 + t) * a->K;
        const float *xds = a->ds + (t0 + t) * a->nb * 2;
        float acc = 0.0f;
        for (int64_t i = 0; i < a->nb; i++) {
            int32_t dot = 0;
            for (int j = 0; j < QK / 2; j++)
                dot += kvalues_iq4[b[i].qs[j] & 0x0F] * xq[i * QK + j] +
                       kvalues_iq4[b[i].qs[j] >> 4] * xq[i * QK + j + QK / 2];
            acc += (float)dot * (fp16_to_fp32(b[i].d) * xds[2 * i]);
        }
        out[t] = acc;
    }
}

/* Exact IQ4: blocks decoded by kquants.h, then float products summed per token in 32 partial sums (element j of
 * every 32 into sum j), reduced as the SIMD tiles reduce their 4 vectors of 8 */
static void tile_iq4_f_scalar(void (*decode)(const uint8_t *, int64_t, float *), int64_t block_elems,
                              int64_t block_bytes, const uint8_t *row, int64_t K, const float *x, int64_t x_stride,
                              int ntok, float *out) {
    float acc[TILE_TQ][QK] = {{0}};
    float w[QK_K];
    for (int64_t i = 0; i < K / block_elems; i++) {
        decode(row + i * block_bytes, block_elems, w);
        for (int t = 0; t < ntok; t++) {
            const float *xb = x + t * x_stride + i * block_elems;
            for (int j = 0; j < block_elems; j++) acc[t][j % QK] += w[j] * xb[j];
        }
    }
    for (int t = 0; t < ntok; t++) {
        float v[8];
        for (int l = 0; l < 8; l++) v[l] = (acc[t][l] + acc[t][8 + l]) + (acc[t][16 + l] + acc[t][24 + l]);
        out[t] = kq8_lanes_sum(v);
    }
}
static void tile_iq4_nl_f_scalar(const uint8_t *row, int64_t K, const float *x, int64_t x_stride, int ntok,
                                 float *out) {
    tile_iq4_f_scalar(decode_iq4_nl, QK, sizeof(block_iq4_nl), row, K, x, x_stride, ntok, out);
}
static void tile_iq4_xs_f_scalar(const uint8_t *row, int64_t K, const float *x, int64_t x_stride, int ntok,
                                 float *out) {
    tile_iq4_f_scalar(decode_iq4_xs, QK_K, sizeof(block_iq4_xs), row, K, x, x_stride, ntok, out);
}

/* ---- SIMD variants ------------------------------------------------------------------------------------------- */

#define SIMD_BODY "matmul_q8k_x86.h"
#include "simd_variants.h"

/* ---- dispatch ---------------------------------------------------------------------------------------------- */

static const kq8_table kq8_tables[] = {
#define KQ8_TABLE(isa)                                                                                             \
    {                                                                                                              \
        quantize_q8k_##isa,                                                                                        \
        {[PI_TYPE_Q2_K] = kq8_tile_q2_k_##isa, [PI_TYPE_Q3_K] = kq8_tile_q3_k_##isa,                               \
         [PI_TYPE_Q4_K] = kq8_tile_q4_k_##isa, [PI_TYPE_Q5_K] = kq8_tile_q5_k_##isa,                               \
         [PI_TYPE_Q6_K] = kq8_tile_q6_k_##isa, [PI_TYPE_IQ4_XS] = kq8_tile_iq4_xs_##isa},                          \
        {[PI_TYPE_Q2_K] = kq8_dot_q2_k_##isa, [PI_TYPE_Q3_K] = kq8_dot_q3_k_##isa,                                 \
         [PI_TYPE_Q4_K] = kq8_dot_q4_k_##isa, [PI_TYPE_Q5_K] = kq8_dot_q5_k_##isa,                                 \
         [PI_TYPE_Q6_K] = kq8_dot_q6_k_##isa, [PI_TYPE_IQ4_XS] = kq8_dot_iq4_xs_##isa},                            \
        {[PI_TYPE_Q4_K] = KQ8_TILE8(isa)},                                                                         \
        {[PI_TYPE_Q4_K] = KQ8_TILE16(isa)},                                                                        \
        tile_iq4_nl_##isa, tile_iq4_nl_f_##isa, tile_iq4_xs_f_##isa,                                               \
    }
#define KQ8_TILE8(isa) kq8_tile8_q4_k_##isa
#define kq8_tile8_q4_k_scalar NULL
#define KQ8_TILE16(isa) KQ8_TILE16_##isa
#define KQ8_TILE16_scalar NULL
#define KQ8_TILE16_avx2 NULL
#define KQ8_TILE16_avx512 kq8_tile16_q4_k_avx512
    [PI_ISA_SCALAR] = KQ8_TABLE(scalar),
#if PI_X86
    [PI_ISA_AVX2] = KQ8_TABLE(avx2),
    [PI_ISA_AVX512] = KQ8_TABLE(avx512),
#endif
#undef KQ8_TABLE
#undef KQ8_TILE8
#undef kq8_tile8_q4_k_scalar
#undef KQ8_TILE16
#undef KQ8_TILE16_scalar
#undef KQ8_TILE16_avx2
#undef KQ8_TILE16_avx512
};

/* ---- driver ------------------------------------------------------------------------------------------------ */

/* Q8_K activations up to this size live on the stack (one token up to K = 32768 takes 37 KB) */
#define KQ8_STACK_ACT_BYTES (48 * 1024)
/* y[t * y_stride + n] = W[n] . x[t] with Q8_K activations; the caller has checked the arguments (K % 256 == 0). */
static int32_t kq8_matmul(const kq8_table *tb, int kind, const uint8_t *w, int64_t w_stride,
                          int64_t N, int64_t K, const float *x, int64_t x_stride, int64_t T, float *y,
                          int64_t y_stride, int32_t n_threads) {
    if (N == 0 || T == 0) return PI_OK;
    const int64_t nb = K / QK_K;
    /* one buffer: int8 quants, then the float scales, then the int16 bsums */
    const size_t qs_bytes = ((size_t)(T * K) + 63) & ~(size_t)63;
    const size_t d_bytes = ((size_t)(T * nb) * sizeof(float) + 63) & ~(size_t)63;
    const size_t need = qs_bytes + d_bytes + (size_t)(T * nb) * 16 * sizeof(int16_t);
    _Alignas(64) uint8_t on_stack[KQ8_STACK_ACT_BYTES];
    uint8_t *scratch = need <= sizeof on_stack ? on_stack : malloc(need);
    if (scratch == NULL) return PI_ERR_ALLOC;
    const act_q8k a = {
        .qs = (int8_t *)scratch,
        .d = (float *)(scratch + qs_bytes),
        .bsums = (int16_t *)(scratch + qs_bytes + d_bytes),
        .K = K,
        .nb = nb,
    };
    const kq8_tile_fn tile = tb->tile[kind];
    const kq8_dot_fn dot = tb->dot[kind];
    const int32_t nt = threads_for_work(n_threads, N * K * T);
    if (T == 1) {
        /* one token: quantised here (about a microsecond), then one contiguous range of rows per thread and one
         * row-dot call for all of it: a single fork/join */
        tb->quantize(x, nb, a.qs, a.d, a.bsums);
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
            const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
            const int64_t n0 = N * me / all, n1 = N * (me + 1) / all;
            dot(w + n0 * w_stride, w_stride, n1 - n0, &a, y + n0);
        }
    } else {
        /* several tokens: by panels of 8 or 16 rows where the type has them (the same bits), the last rows and the
         * other kinds by tiles */
        const kq8_panel_fn tile8 = T >= KQ8_TILE8_MIN_T ? tb->tile8[kind] : NULL;
        const kq8_panel_fn tile16 = tile8 != NULL ? tb->tile16[kind] : NULL;
        const int64_t n16 = tile16 != NULL ? N / 16 * 16 : 0;
        const int64_t n8 = tile8 != NULL ? N / 8 * 8 : 0;
        const size_t panel_bytes = (size_t)nb * (size_t)kq8_panel_bytes[kind][n16 > 0 ? 1 : 0];
        uint8_t *panels = n8 > 0 ? aligned_alloc(64, ((size_t)nt * panel_bytes + 63) & ~(size_t)63) : NULL;
        if (n8 > 0 && panels == NULL) {
            if (scratch != on_stack) free(scratch);
            return PI_ERR_ALLOC;
        }
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                tb->quantize(x + t * x_stride, nb, a.qs + t * K, a.d + t * nb, a.bsums + t * nb * 16);
            if (n8 > 0) {
                uint8_t *panel = panels + (size_t)omp_get_thread_num() * panel_bytes;
#pragma omp for schedule(static) nowait
                for (int64_t n0 = 0; n0 < n16; n0 += 16) {
                    const uint8_t *r16[16];
                    for (int i = 0; i < 16; i++) r16[i] = w + (n0 + i) * w_stride;
                    tile16(r16, &a, T, panel, y + n0, y_stride);
                }
#pragma omp for schedule(static) nowait
                for (int64_t n0 = n16; n0 < n8; n0 += 8) {
                    const uint8_t *r8[8];
                    for (int i = 0; i < 8; i++) r8[i] = w + (n0 + i) * w_stride;
                    tile8(r8, &a, T, panel, y + n0, y_stride);
                }
            }
#pragma omp for schedule(static)
            for (int64_t n0 = n8; n0 < N; n0 += TILE_N) {
                const int64_t n1 = min_i64(n0 + TILE_N, N);
                for (int64_t t0 = 0; t0 < T; t0 += KQ8_TILE_T) {
                    const int ntok = (int)min_i64(KQ8_TILE_T, T - t0);
                    for (int64_t n = n0; n < n1; n++) {
                        float out[KQ8_TILE_T];
                        tile(w + n * w_stride, &a, t0, ntok, out);
                        for (int j = 0; j < ntok; j++) y[(t0 + j) * y_stride + n] = out[j];
                    }
                }
            }
        }
        free(panels);
    }
    if (scratch != on_stack) free(scratch);
    return PI_OK;
}

/* ---- exported kernels ------------------------------------------------------------------------------------ */

static inline int32_t matmul_args_ok(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, int64_t row_bytes,
                                     const float *x, int64_t x_stride, int64_t T, const float *y, int64_t y_stride) {
    if (N < 0 || K < 0 || T < 0 || !stride_ok(N, w_stride, row_bytes) || !stride_ok(T, x_stride, K) ||
        !stride_ok(T, y_stride, N))
        return 0;
    return !(N > 0 && T > 0 && (w == NULL || x == NULL || y == NULL));
}

/* pi_matmul_<type>(w, w_stride bytes, N rows, K cols, x, x_stride floats, T tokens, y, y_stride floats, threads,
 * isa): y[t * y_stride + n] = W[n] . x[t], "q8" precision (Q8_K activations); K must be a multiple of 256. */
#define DEFINE_MATMUL_KQ8(type, kind, block_t)                                                                   \
    PI_EXPORT int32_t pi_matmul_##type(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, const float *x, \
                                       int64_t x_stride, int64_t T, float *y, int64_t y_stride,               \
                                       int32_t n_threads, int32_t isa) {                                      \
        if (K < 0 || K % QK_K != 0) return PI_ERR_SHAPE;                                                      \
        const int64_t row_bytes = K / QK_K * (int64_t)sizeof(block_t);                                        \
        if (!matmul_args_ok(w, w_stride, N, K, row_bytes, x, x_stride, T, y, y_stride)) return PI_ERR_SHAPE;  \
        return kq8_matmul(&kq8_tables[pi_isa_clamp(isa)], kind, w, w_stride, N, K, x, x_stride, T, y, \
                          y_stride, n_threads);                                                               \
    }
DEFINE_MATMUL_KQ8(q2_k, PI_TYPE_Q2_K, block_q2_k)
DEFINE_MATMUL_KQ8(q3_k, PI_TYPE_Q3_K, block_q3_k)
DEFINE_MATMUL_KQ8(q4_k, PI_TYPE_Q4_K, block_q4_k)
DEFINE_MATMUL_KQ8(q5_k, PI_TYPE_Q5_K, block_q5_k)
DEFINE_MATMUL_KQ8(q6_k, PI_TYPE_Q6_K, block_q6_k)
DEFINE_MATMUL_KQ8(iq4_xs, PI_TYPE_IQ4_XS, block_iq4_xs)
#undef DEFINE_MATMUL_KQ8

/* IQ4_NL, "q8" precision: the int8 block activations of Q4_0 / Q8_0 (K a multiple of 32) */
PI_EXPORT int32_t pi_matmul_iq4_nl(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, const float *x,
                                   int64_t x_stride, int64_t T, float *y, int64_t y_stride, int32_t n_threads,
                                   int32_t isa) {
    if (K < 0 || K % QK != 0) return PI_ERR_SHAPE;
    const int64_t row_bytes = K / QK * (int64_t)sizeof(block_iq4_nl);
    if (!matmul_args_ok(w, w_stride, N, K, row_bytes, x, x_stride, T, y, y_stride)) return PI_ERR_SHAPE;
    const int32_t level = pi_isa_clamp(isa);
    return matmul_quant_rows(matmul_table_for(level), 0, kq8_tables[level].tile_iq4_nl, w, w_stride, NULL, N, K, x,
                             x_stride, T, y, y_stride, n_threads);
}

/* Exact IQ4 (float activations): the tiled float driver of matmul.c, T = 1 included (one row per tile call) */
#define DEFINE_MATMUL_IQ4_F(type, block_elems, block_t)                                                          \
    PI_EXPORT int32_t pi_matmul_##type##_f(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,            \
                                           const float *x, int64_t x_stride, int64_t T, float *y,               \
                                           int64_t y_stride, int32_t n_threads, int32_t isa) {                  \
        if (K < 0 || K % (block_elems) != 0) return PI_ERR_SHAPE;                                             \
        const int64_t row_bytes = K / (block_elems) * (int64_t)sizeof(block_t);                               \
        if (!matmul_args_ok(w, w_stride, N, K, row_bytes, x, x_stride, T, y, y_stride)) return PI_ERR_SHAPE;  \
        const int32_t level = pi_isa_clamp(isa);                                                              \
        return matmul_quant_f_rows(matmul_table_for(level), 0, kq8_tables[level].tile_##type##_f, w, w_stride,   \
                                   NULL, N, K, x, x_stride, T, y, y_stride, n_threads);                       \
    }
DEFINE_MATMUL_IQ4_F(iq4_nl, QK, block_iq4_nl)
DEFINE_MATMUL_IQ4_F(iq4_xs, QK_K, block_iq4_xs)
#undef DEFINE_MATMUL_IQ4_F

/* pi_quantize_q8_k(x, K, T, qs, d, bsums, isa): the Q8_K activations the "q8" K-quant kernels compute with, for
 * T contiguous rows of K floats (K a multiple of 256): qs (T, K) int8, d (T, K / 256) float, bsums (T, K / 16)
 * int16. Exported for tests and tools; the kernels quantise internally. */
PI_EXPORT int32_t pi_quantize_q8_k(const float *x, int64_t K, int64_t T, int8_t *qs, float *d, int16_t *bsums,
                                   int32_t isa) {
    if (K < 0 || T < 0 || K % QK_K != 0) return PI_ERR_SHAPE;
    if (K > 0 && T > 0 && (x == NULL || qs == NULL || d == NULL || bsums == NULL)) return PI_ERR_SHAPE;
    const kq8_table *tb = &kq8_tables[pi_isa_clamp(isa)];
    const int64_t nb = K / QK_K;
    for (int64_t t = 0; t < T; t++) tb->quantize(x + t * K, nb, qs + t * K, d + t * nb, bsums + t * nb * 16);
    return PI_OK;
}

/* ---- internal: one token's Q8_K activations and row ranges, for the fused decode kernels (matmul.h) ---------- */

size_t kq8_act_bytes(int64_t K) {
    const int64_t nb = K / QK_K;
    return align_up((size_t)K) + align_up((size_t)nb * sizeof(float)) + align_up((size_t)nb * 16 * sizeof(int16_t));
}

void kq8_act_prepare(int32_t level, const float *x, int64_t K, uint8_t *buf, act_q8k *a) {
    const int64_t nb = K / QK_K;
    a->qs = (int8_t *)buf;
    a->d = (float *)(buf + align_up((size_t)K));
    a->bsums = (int16_t *)(buf + align_up((size_t)K) + align_up((size_t)nb * sizeof(float)));
    a->K = K;
    a->nb = nb;
    kq8_tables[pi_isa_clamp(level)].quantize(x, nb, a->qs, a->d, a->bsums);
}

void kq8_rows(int32_t level, int type, const uint8_t *w, int64_t w_stride, int64_t n_rows, const act_q8k *a,
              float *out) {
    kq8_tables[pi_isa_clamp(level)].dot[type](w, w_stride, n_rows, a, out);
}
