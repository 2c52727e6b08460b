/* Sparse FFN kernels over a subset of neurons (rows): PowerInfer's SPARSE_MATMUL and AXPY, done deterministically.
 *
 * rows_matmul: y[t, m] = W[idx[m]] . x[t]. Runs the dense matmul drivers (matmul.c) with a row list, so the
 *   arithmetic is exactly that of pi_matmul_<type>[_f] for the current activation precision: with idx = 0..N-1 the
 *   result is bit-identical to the dense matmul. Only the rows in idx are read.
 *
 * rows_axpy: y[t, :] = sum_m h[t, m] * W_t[idx[m], :] (idx NULL: all N rows). Rows with h[t, m] == 0 are skipped.
 *   Each output element is one sequential chain in index order: y = fma(h[t, m], w[m, e], y) over the rows with
 *   h != 0, starting from 0. Weights are decoded in registers to the reference dequantiser's floats (bit-equal,
 *   Q4_1 included: d * q then + m, rounded separately). The OUTPUT dimension D is split over threads in units of
 *   32 elements, each thread summing all rows for its slice, so there is no cross-thread reduction: the result
 *   depends neither on the thread count, nor on the SIMD variant (scalar uses fmaf), nor on the other tokens of
 *   the batch. (The original sums per-thread partial buffers without synchronisation, spec 4.3.)
 *
 * Both validate row ids before any work (PI_ERR_INDEX) and accept M == 0 (rows_axpy then writes zeros).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "matmul.h"

#define AXPY_UNIT 32   /* elements per work unit along D: one quant block, or 32 floats of an F32/F16 row */
#define AXPY_GROUP 8   /* T = 1: rows applied to a unit of y while it stays in registers */
#define AXPY_TILE_T 4  /* T > 1: tokens sharing one decode of each weight unit */

enum axpy_kind { KIND_Q4_0 = 0, KIND_Q4_1 = 1, KIND_Q8_0 = 2, KIND_F32 = 3, KIND_F16 = 4 };

/* Everything a thread needs; the row list of T = 1 is compacted once (rows with h != 0, in index order). */
typedef struct {
    const uint8_t *w;
    int64_t w_stride;
    const int64_t *idx; /* NULL: all rows */
    int64_t M;
    int64_t D;
    size_t unit_bytes; /* bytes of one unit of a row */
    const float *h;
    int64_t h_stride;
    int64_t T;
    float *y;
    int64_t y_stride;
    const uint8_t **act_rows; /* T == 1: rows with h != 0 */
    const float *act_h;       /* and their h */
    int64_t n_act;
} axpy_ctx;

static int check_ids(const int64_t *idx, int64_t M, int64_t N) {
    if (idx == NULL) return M == N ? PI_OK : PI_ERR_SHAPE;
    for (int64_t m = 0; m < M; m++)
        if (idx[m] < 0 || idx[m] >= N) return PI_ERR_INDEX;
    return PI_OK;
}

/* ---- rows_matmul --------------------------------------------------------------------------------------------- */

#define ROWS_MATMUL_PROLOGUE                                                  \
    if (N < 0 || M < 0 || K < 0 || T < 0) return PI_ERR_SHAPE;              \
    if (M == 0 || T == 0) return PI_OK;                                      \
    if (idx == NULL) return PI_ERR_SHAPE;                                    \
    const int32_t status = check_ids(idx, M, N);                             \
    if (status != PI_OK) return status;

/* pi_rows_matmul_<type>(w, w_stride bytes, N rows, K cols, idx, M, x, x_stride, T, y, y_stride, threads):
 * y[t * y_stride + m] = W[idx[m]] . x[t * x_stride], t < T, m < M; arithmetic of pi_matmul_<type>. */
#define DEFINE_ROWS_MATMUL(type, driver, row_bytes)                                                              \
    PI_EXPORT int32_t pi_rows_matmul_##type(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,            \
                                            const int64_t *idx, int64_t M, const float *x, int64_t x_stride,     \
                                            int64_t T, float *y, int64_t y_stride, int32_t n_threads) {          \
        ROWS_MATMUL_PROLOGUE                                                                                     \
        return driver(row_bytes, matmul_table_active()->tile_##type, w, w_stride, idx, M, K, x, x_stride, T, y,  \
                      y_stride, n_threads);                                                                      \
    }

DEFINE_ROWS_MATMUL(f32, matmul_float_rows, K * 4)
DEFINE_ROWS_MATMUL(f16, matmul_float_rows, K * 2)
DEFINE_ROWS_MATMUL(q4_0, matmul_quant_rows, K / QK * (int64_t)sizeof(block_q4_0))
DEFINE_ROWS_MATMUL(q4_1, matmul_quant_rows, K / QK * (int64_t)sizeof(block_q4_1))
DEFINE_ROWS_MATMUL(q8_0, matmul_quant_rows, K / QK * (int64_t)sizeof(block_q8_0))
DEFINE_ROWS_MATMUL(q4_0_f, matmul_quant_f_rows, K / QK * (int64_t)sizeof(block_q4_0))
DEFINE_ROWS_MATMUL(q4_1_f, matmul_quant_f_rows, K / QK * (int64_t)sizeof(block_q4_1))
DEFINE_ROWS_MATMUL(q8_0_f, matmul_quant_f_rows, K / QK * (int64_t)sizeof(block_q8_0))

/* ---- rows_axpy: scalar ------------------------------------------------------------------------------------- */

/* Elements [j0, j1) of unit u of a row, decoded as the reference dequantiser does. */
static void decode_unit_scalar(int kind, const uint8_t *row, int64_t u, int j0, int j1, float *out) {
    switch (kind) {
        case KIND_Q4_0: {
            const block_q4_0 *b = (const block_q4_0 *)row + u;
            const float d = fp16_to_fp32(b->d);
            for (int j = j0; j < j1; j++) {
                const int q = j < QK / 2 ? (b->qs[j] & 0x0F) : (b->qs[j - QK / 2] >> 4);
                out[j] = (float)(q - 8) * d;
            }
            break;
        }
        case KIND_Q4_1: {
            const block_q4_1 *b = (const block_q4_1 *)row + u;
            const float d = fp16_to_fp32(b->d), m = fp16_to_fp32(b->m);
            for (int j = j0; j < j1; j++) {
                const int q = j < QK / 2 ? (b->qs[j] & 0x0F) : (b->qs[j - QK / 2] >> 4);
                out[j] = d * (float)q + m; /* -ffp-contract=off: two roundings, as the reference */
            }
            break;
        }
        case KIND_Q8_0: {
            const block_q8_0 *b = (const block_q8_0 *)row + u;
            const float d = fp16_to_fp32(b->d);
            for (int j = j0; j < j1; j++) out[j] = (float)b->qs[j] * d;
            break;
        }
        case KIND_F32:
            memcpy(out + j0, row + (u * AXPY_UNIT + j0) * 4, (size_t)(j1 - j0) * 4);
            break;
        default: {
            for (int j = j0; j < j1; j++) {
                uint16_t bits;
                memcpy(&bits, row + (u * AXPY_UNIT + j) * 2, sizeof bits);
                out[j] = fp16_to_fp32(bits);
            }
            break;
        }
    }
}

/* Elements [e0, e1) of y for every token (e0 a multiple of AXPY_UNIT): the plain definition. Also used by the SIMD
 * variants for the partial last unit of F32/F16 rows whose length is not a multiple of 32. */
static void axpy_range_scalar(int kind, const axpy_ctx *c, int64_t e0, int64_t e1) {
    for (int64_t t = 0; t < c->T; t++) {
        float *yt = c->y + t * c->y_stride;
        const float *ht = c->h + t * c->h_stride;
        for (int64_t e = e0; e < e1; e++) yt[e] = 0.0f;
        for (int64_t m = 0; m < c->M; m++) {
            const float hv = ht[m];
            if (hv == 0.0f) continue;
            const uint8_t *row = c->w + row_of(c->idx, m) * c->w_stride;
            for (int64_t u = e0 / AXPY_UNIT; u * AXPY_UNIT < e1; u++) {
                const int j1 = (int)min_i64(AXPY_UNIT, e1 - u * AXPY_UNIT);
                float wv[AXPY_UNIT];
                decode_unit_scalar(kind, row, u, 0, j1, wv);
                float *yu = yt + u * AXPY_UNIT;
                for (int j = 0; j < j1; j++) yu[j] = fmaf(hv, wv[j], yu[j]);
            }
        }
    }
}

static void axpy_units_scalar(int kind, const axpy_ctx *c, int64_t u0, int64_t u1) {
    axpy_range_scalar(kind, c, u0 * AXPY_UNIT, u1 * AXPY_UNIT);
}

/* ---- rows_axpy: SIMD variants ------------------------------------------------------------------------------ */

typedef void (*axpy_units_fn)(int kind, const axpy_ctx *c, int64_t u0, int64_t u1);

#define SIMD_SUFFIX avx2
#define SIMD_TARGET "avx2,fma,f16c"
#define SIMD_AVX512 0
#include "sparse_x86.h"
#undef SIMD_SUFFIX
#undef SIMD_TARGET
#undef SIMD_AVX512

#define SIMD_SUFFIX avx512
#define SIMD_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"
#define SIMD_AVX512 1
#include "sparse_x86.h"
#undef SIMD_SUFFIX
#undef SIMD_TARGET
#undef SIMD_AVX512

static const axpy_units_fn axpy_units_table[] = {
    [MATMUL_ISA_SCALAR] = axpy_units_scalar,
    [MATMUL_ISA_AVX2] = axpy_units_avx2,
    [MATMUL_ISA_AVX512] = axpy_units_avx512,
};

static int32_t rows_axpy(int kind, size_t unit_bytes, const uint8_t *w, int64_t w_stride, int64_t N, int64_t D,
                         const int64_t *idx, int64_t M, const float *h, int64_t h_stride, int64_t T, float *y,
                         int64_t y_stride, int32_t n_threads) {
    if (N < 0 || M < 0 || D < 0 || T < 0) return PI_ERR_SHAPE;
    if (kind <= KIND_Q8_0 && D % QK != 0) return PI_ERR_SHAPE;
    const int32_t status = check_ids(idx, M, N);
    if (status != PI_OK) return status;
    if (T == 0 || D == 0) return PI_OK;
    axpy_ctx c = {.w = w, .w_stride = w_stride, .idx = idx, .M = M, .D = D, .unit_bytes = unit_bytes, .h = h,
                  .h_stride = h_stride, .T = T, .y = y, .y_stride = y_stride};
    void *scratch = NULL;
    int64_t work_rows = M;
    if (T == 1 && M > 0) {
        scratch = malloc((size_t)M * (sizeof(const uint8_t *) + sizeof(float)));
        if (scratch == NULL) return PI_ERR_ALLOC;
        const uint8_t **rows = scratch;
        float *hs = (float *)(rows + M);
        int64_t n = 0;
        for (int64_t m = 0; m < M; m++) {
            if (h[m] == 0.0f) continue;
            rows[n] = w + row_of(idx, m) * w_stride;
            hs[n++] = h[m];
        }
        c.act_rows = rows;
        c.act_h = hs;
        c.n_act = work_rows = n;
    }
    const axpy_units_fn units = axpy_units_table[matmul_isa_level()];
    const int64_t n_full = D / AXPY_UNIT;
    const int64_t n_units = (D + AXPY_UNIT - 1) / AXPY_UNIT;
    int32_t nt = threads_for_work(n_threads, work_rows * D * T);
    if (nt > n_units) nt = (int32_t)n_units;
#pragma omp parallel num_threads(nt)
    {
        const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
        const int64_t u0 = n_units * me / all, u1 = n_units * (me + 1) / all;
        units(kind, &c, u0, min_i64(u1, n_full));
        if (u1 > n_full) axpy_range_scalar(kind, &c, n_full * AXPY_UNIT, D); /* partial unit: F32/F16 only */
    }
    free(scratch);
    return PI_OK;
}

/* pi_rows_axpy_<type>(w_t, w_stride bytes, N rows, D cols, idx or NULL, M, h, h_stride, T, y, y_stride, threads):
 * y[t * y_stride + e] = sum_{m < M, h[t, m] != 0} h[t * h_stride + m] * W_t[idx[m], e]. */
#define DEFINE_ROWS_AXPY(type, kind, unit_bytes)                                                                  \
    PI_EXPORT int32_t pi_rows_axpy_##type(const uint8_t *w, int64_t w_stride, int64_t N, int64_t D,               \
                                          const int64_t *idx, int64_t M, const float *h, int64_t h_stride,        \
                                          int64_t T, float *y, int64_t y_stride, int32_t n_threads) {             \
        return rows_axpy(kind, unit_bytes, w, w_stride, N, D, idx, M, h, h_stride, T, y, y_stride, n_threads);   \
    }

DEFINE_ROWS_AXPY(f32, KIND_F32, AXPY_UNIT * 4)
DEFINE_ROWS_AXPY(f16, KIND_F16, AXPY_UNIT * 2)
DEFINE_ROWS_AXPY(q4_0, KIND_Q4_0, sizeof(block_q4_0))
DEFINE_ROWS_AXPY(q4_1, KIND_Q4_1, sizeof(block_q4_1))
DEFINE_ROWS_AXPY(q8_0, KIND_Q8_0, sizeof(block_q8_0))
