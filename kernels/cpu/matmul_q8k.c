/* The "q8" matmul of the super-block types (PI_KQ8_TYPES: the K-quants and the non-linear 4-bit type of 256), the
 * "q8" matmul of the block-32 types whose kernels are here (PI_KQ8_BLOCK32_TYPES), and the exact (float
 * activation) kernels of the non-linear 4-bit types (PI_IQ4_TYPES). Each type's kernels at each SIMD level are
 * its entry of kq8_tables (matmul_q8k_types.h); nothing here depends on a type but through that table and
 * TYPE_TRAITS (quants.h).
 *
 * "q8" super-block types (llama.cpp's arithmetic): the activations of each token are quantised per super-block of
 * 256 to int8 (act_q8k, ggml's activation format of these types): x ~= d_x * q, q int8 in [-127, 127], with
 * d_x = -max / 127 where max is the first element of largest magnitude (so the sign of d_x is that of -max),
 * q = min(127, round_half_even(x * (-127 / max))), d_x = 1 / that factor, and bsums[g] = sum(q) over the 16
 * elements of group g. A super-block of weights is, per 16 elements g, a value u per element, an integer scale
 * sc_g and, for some types, an integer min mn_g or an offset o (its integer form, kquants.h: kq8_int_block):
 *   w = d * sc_g * (u - o) - dmin * mn_g,
 * so that the block's contribution to w . x is, with exact integer sums,
 *   d * d_x * S - dmin * d_x * M,   S = sum_g sc_g * (u_g . q_g - o * bsums[g]),   M = sum_g mn_g * bsums[g].
 *
 * Float order (so that decode, batch, any thread count and every SIMD variant give the same bits): S and M are
 * kept as 8 int32 lanes, lane l holding elements 4l..4l+3 of every 32 (and groups 2l, 2l+1 of the bsums terms),
 * the lanes the AVX2 maddubs/madd sequence produces. Per super-block and lane, in float32:
 *   acc[l] = acc[l] + (d * d_x) * (float)S[l];   then, types with mins: acc[l] = acc[l] - (dmin * d_x) * (float)M[l]
 * (a type whose integer form sets `reduce`: S and M summed over the lanes first, one such step into lane
 * (block % 8)) and the result is ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)). The scalar
 * fallback follows this lane by lane, so it is bit-equal to the SIMD variants.
 *
 * Block-32 "q8" (PI_KQ8_BLOCK32_TYPES): the activations are the int8 blocks of 32 of matmul.c's block-32 kernels
 * (act_q8, quantize_act) and each block contributes d_w * d_x * (q_w . q_x), q_w the type's integer view
 * (quants.h), accumulated as matmul.c's int8 tiles of a type without offset or minimum.
 *
 * Exact (pi_matmul_<type>_f of PI_IQ4_TYPES): the weights are decoded to the gguf decoder's floats (kquants.h) and
 * multiplied with float x, as the K-quant exact kernels do.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "quants.h"
#include "matmul.h"

#define KQ8_TILE_T 8 /* tokens per tile: one super-block decode shared by all of them */

/* out[t] = row . token t0 + t, t < ntok <= KQ8_TILE_T */
typedef void (*kq8_tile_fn)(const uint8_t *row, const act_q8k *a, int64_t t0, int ntok, float *out);
/* out[r] = row r . token 0 for the n_rows rows at w, w_stride bytes apart: per row the arithmetic of the tile.
 * One row at a time (measured: interleaving 2 or 4 rows is no faster in cache, and for the 6-bit K-quant 6x
 * slower: the values, scales and accumulators of several rows exceed the 16 ymm registers; docs/kernels.md). */
typedef void (*kq8_dot_fn)(const uint8_t *w, int64_t w_stride, int64_t n_rows, const act_q8k *a, float *out);
typedef void (*kq8_panel_fn)(const uint8_t *const *rows, const act_q8k *a, int64_t T, uint8_t *panel, float *y,
                             int64_t y_stride);

/* The kernels of one type at one SIMD level; NULL where the type has none. */
typedef struct {
    kq8_tile_fn tile; /* super-block types: ntok <= KQ8_TILE_T tokens */
    kq8_dot_fn dot;   /* super-block types: one token, a range of rows */
    /* prompts by panels of 8 rows: rows[0..7] x T tokens into y[t * y_stride + r], the bits of the tile, from
     * tile8_min_t tokens; `panel` holds nb * panel8_bytes bytes, 32-byte aligned (NULL: row by row) */
    kq8_panel_fn tile8;
    /* the same by panels of 16 rows (NULL: none), `panel` of nb * panel16_bytes bytes, 64-byte aligned */
    kq8_panel_fn tile16;
    int32_t panel8_bytes, panel16_bytes, tile8_min_t;
    tile_quant_fn tile_q8; /* block-32 types: int8 blocks of 32 (act_q8) */
    tile_float_fn tile_f;  /* float activations, ntok <= TILE_TQ: the exact kernel */
} kq8_kernels;

/* The traits table of one SIMD level: the activation quantiser and every type's kernels, indexed by type id. */
typedef struct {
    quantize_q8k_fn quantize;
    kq8_kernels types[PI_TYPE_COUNT];
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

/* A row's super-blocks in integer form (the type's kq8_ints_<name>, kquants.h) against ntok tokens */
static void kq8_tile_scalar(kq8_ints_fn ints, int64_t block_bytes, const uint8_t *row, const act_q8k *a, int64_t t0,
                            int ntok, float *out) {
    float acc[KQ8_TILE_T][8] = {{0}};
    kq8_int_block b;
    for (int64_t s = 0; s < a->nb; s++) {
        ints(row + s * block_bytes, &b);
        for (int t = 0; t < ntok; t++) {
            const int64_t tb = (t0 + t) * a->nb + s;
            kq8_lanes_scalar(&b, a->qs + (t0 + t) * a->K + s * QK_K, a->bsums + tb * 16, a->d[tb], acc[t], s);
        }
    }
    for (int t = 0; t < ntok; t++) out[t] = kq8_lanes_sum(acc[t]);
}

#define DEFINE_KQ8_SCALAR(name, type)                                                                          \
    static void kq8_tile_##name##_scalar(const uint8_t *row, const act_q8k *a, int64_t t0, int ntok, float *out) { \
        kq8_tile_scalar(kq8_ints_##name, TYPE_TRAITS[type].block_bytes, row, a, t0, ntok, out);                  \
    }                                                                                                           \
    static void kq8_dot_##name##_scalar(const uint8_t *w, int64_t w_stride, int64_t n_rows, const act_q8k *a,    \
                                        float *out) {                                                           \
        for (int64_t r = 0; r < n_rows; r++)                                                                    \
            kq8_tile_scalar(kq8_ints_##name, TYPE_TRAITS[type].block_bytes, w + r * w_stride, a, 0, 1, out + r); \
    }
PI_KQ8_TYPES(DEFINE_KQ8_SCALAR)
#undef DEFINE_KQ8_SCALAR

/* Block-32 types on int8 blocks of 32: matmul.c's scalar int8 tile through the type's integer view */
#define DEFINE_TILE_Q8_SCALAR(name, type)                                                                      \
    static void tile_##name##_scalar(const uint8_t *row, const act_q8 *a, int64_t t0, int ntok, float *out) { \
        tile_quant_scalar_of(type, row, a, t0, ntok, out);                                                   \
    }
PI_KQ8_BLOCK32_TYPES(DEFINE_TILE_Q8_SCALAR)
#undef DEFINE_TILE_Q8_SCALAR

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
#define DEFINE_TILE_IQ4_F_SCALAR(name, type)                                                                   \
    static void tile_##name##_f_scalar(const uint8_t *row, int64_t K, const float *x, int64_t x_stride, int ntok, \
                                       float *out) {                                                           \
        tile_iq4_f_scalar(TYPE_TRAITS[type].decode, TYPE_TRAITS[type].block_elems, TYPE_TRAITS[type].block_bytes, \
                          row, K, x, x_stride, ntok, out);                                                     \
    }
PI_IQ4_TYPES(DEFINE_TILE_IQ4_F_SCALAR)
#undef DEFINE_TILE_IQ4_F_SCALAR

/* ---- SIMD variants ------------------------------------------------------------------------------------------- */

#define SIMD_BODY "matmul_q8k_x86.h"
#include "simd_variants.h"

/* ---- dispatch ---------------------------------------------------------------------------------------------- */

/* the per-ISA traits tables: kq8_tables[isa].types[type id] (matmul_q8k_types.h) */
#include "matmul_q8k_types.h"

/* ---- driver ------------------------------------------------------------------------------------------------ */

/* int8 super-block activations up to this size live on the stack (one token up to K = 32768 takes 37 KB) */
#define KQ8_STACK_ACT_BYTES (48 * 1024)
/* y[t * y_stride + n] = W[n] . x[t] with int8 super-block activations; the caller has checked the arguments
 * (K % 256 == 0). */
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
    const kq8_kernels *k = &tb->types[kind];
    const kq8_tile_fn tile = k->tile;
    const kq8_dot_fn dot = k->dot;
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
        const kq8_panel_fn tile8 = T >= k->tile8_min_t ? k->tile8 : NULL;
        const kq8_panel_fn tile16 = tile8 != NULL ? k->tile16 : NULL;
        const int64_t n16 = tile16 != NULL ? N / 16 * 16 : 0;
        const int64_t n8 = tile8 != NULL ? N / 8 * 8 : 0;
        const size_t panel_bytes = (size_t)nb * (size_t)(n16 > 0 ? k->panel16_bytes : k->panel8_bytes);
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
 * isa): y[t * y_stride + n] = W[n] . x[t], "q8" precision (int8 super-block activations); K must be a multiple
 * of 256. */
#define DEFINE_MATMUL_KQ8(name, type)                                                                          \
    PI_EXPORT int32_t pi_matmul_##name(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, const float *x, \
                                       int64_t x_stride, int64_t T, float *y, int64_t y_stride,               \
                                       int32_t n_threads, int32_t isa) {                                      \
        if (K < 0 || K % QK_K != 0) return PI_ERR_SHAPE;                                                      \
        const int64_t row_bytes = type_row_bytes(type, K);                                                    \
        if (!matmul_args_ok(w, w_stride, N, K, row_bytes, x, x_stride, T, y, y_stride)) return PI_ERR_SHAPE;  \
        return kq8_matmul(&kq8_tables[pi_isa_clamp(isa)], type, w, w_stride, N, K, x, x_stride, T, y,        \
                          y_stride, n_threads);                                                               \
    }
PI_KQ8_TYPES(DEFINE_MATMUL_KQ8)
#undef DEFINE_MATMUL_KQ8

/* Block-32 types, "q8" precision: the int8 block activations of matmul.c's block-32 types (K a multiple of 32) */
#define DEFINE_MATMUL_Q8_BLOCK32(name, type)                                                                   \
    PI_EXPORT int32_t pi_matmul_##name(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, const float *x, \
                                       int64_t x_stride, int64_t T, float *y, int64_t y_stride,               \
                                       int32_t n_threads, int32_t isa) {                                      \
        if (K < 0 || K % QK != 0) return PI_ERR_SHAPE;                                                        \
        const int64_t row_bytes = type_row_bytes(type, K);                                                    \
        if (!matmul_args_ok(w, w_stride, N, K, row_bytes, x, x_stride, T, y, y_stride)) return PI_ERR_SHAPE;  \
        const int32_t level = pi_isa_clamp(isa);                                                              \
        return matmul_quant_rows(matmul_table_for(level), 0, kq8_tables[level].types[type].tile_q8, w,        \
                                 w_stride, NULL, N, K, x, x_stride, T, y, y_stride, n_threads);               \
    }
PI_KQ8_BLOCK32_TYPES(DEFINE_MATMUL_Q8_BLOCK32)
#undef DEFINE_MATMUL_Q8_BLOCK32

/* Exact IQ4 (float activations): the tiled float driver of matmul.c, T = 1 included (one row per tile call) */
#define DEFINE_MATMUL_IQ4_F(name, type)                                                                        \
    PI_EXPORT int32_t pi_matmul_##name##_f(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,            \
                                           const float *x, int64_t x_stride, int64_t T, float *y,               \
                                           int64_t y_stride, int32_t n_threads, int32_t isa) {                  \
        if (K < 0 || K % TYPE_TRAITS[type].block_elems != 0) return PI_ERR_SHAPE;                            \
        const int64_t row_bytes = type_row_bytes(type, K);                                                    \
        if (!matmul_args_ok(w, w_stride, N, K, row_bytes, x, x_stride, T, y, y_stride)) return PI_ERR_SHAPE;  \
        const int32_t level = pi_isa_clamp(isa);                                                              \
        return matmul_quant_f_rows(matmul_table_for(level), 0, kq8_tables[level].types[type].tile_f, w,       \
                                   w_stride, NULL, N, K, x, x_stride, T, y, y_stride, n_threads);             \
    }
PI_IQ4_TYPES(DEFINE_MATMUL_IQ4_F)
#undef DEFINE_MATMUL_IQ4_F

/* The activation quantiser of SIMD level `level` (clamped), which quantize_k.c exports for tests and tools. */
quantize_q8k_fn kq8_quantizer(int32_t level) { return kq8_tables[pi_isa_clamp(level)].quantize; }

/* ---- internal: one token's int8 super-block activations and row ranges, for the fused decode kernels (matmul.h) */

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
    kq8_tables[pi_isa_clamp(level)].types[type].dot(w, w_stride, n_rows, a, out);
}
