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

enum axpy_kind { KIND_Q4_0 = 0, KIND_Q4_1 = 1, KIND_Q8_0 = 2, KIND_F32 = 3, KIND_F16 = 4, KIND_BF16 = 5,
                 KIND_Q5_0 = 6, KIND_Q5_1 = 7, KIND_LAST = KIND_Q5_1 };

/* block types: rows made of 32-element blocks (the others are plain float arrays) */
static inline int kind_is_block(int kind) { return kind <= KIND_Q8_0 || kind >= KIND_Q5_0; }

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

/* Rows of one token, groups of ROWS_DOT_MAX rows per call of a rows_dot_fn; the rows of group g + MATVEC_AHEAD
 * are prefetched while group g is computed (scattered rows: the hardware prefetcher does not see them coming). */
#define MATVEC_AHEAD 2

static inline void prefetch_group(const uint8_t *w, int64_t w_stride, const int64_t *idx, int64_t m, int64_t m1,
                                  int64_t row_bytes) {
    const int64_t n = min_i64(ROWS_DOT_MAX, m1 - m);
    for (int64_t r = 0; r < n; r++) prefetch_bytes(w + idx[m + r] * w_stride, row_bytes);
}

static void matvec_range(rows_dot_fn dot, int64_t row_bytes, const uint8_t *w, int64_t w_stride, const int64_t *idx,
                         int64_t m0, int64_t m1, int64_t K, const float *x, float *y) {
    for (int64_t a = 0; a < MATVEC_AHEAD; a++)
        if (m0 + a * ROWS_DOT_MAX < m1) prefetch_group(w, w_stride, idx, m0 + a * ROWS_DOT_MAX, m1, row_bytes);
    for (int64_t m = m0; m < m1; m += ROWS_DOT_MAX) {
        const int n = (int)min_i64(ROWS_DOT_MAX, m1 - m);
        const int64_t ahead = m + MATVEC_AHEAD * ROWS_DOT_MAX;
        if (ahead < m1) prefetch_group(w, w_stride, idx, ahead, m1, row_bytes);
        const uint8_t *rows[ROWS_DOT_MAX];
        for (int r = 0; r < n; r++) rows[r] = w + idx[m + r] * w_stride;
        dot(rows, n, K, x, y + m);
    }
}

/* T = 1 with float activations: rows split in contiguous ranges over threads, ROWS_DOT_MAX rows per step. */
static int32_t rows_matvec(rows_dot_fn dot, int64_t row_bytes, const uint8_t *w, int64_t w_stride, const int64_t *idx,
                           int64_t M, int64_t K, const float *x, float *y, int32_t n_threads) {
    const int32_t nt = threads_for_work(n_threads, M * K);
    if (nt == 1) {
        matvec_range(dot, row_bytes, w, w_stride, idx, 0, M, K, x, y);
        return PI_OK;
    }
#pragma omp parallel num_threads(nt)
    {
        const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
        matvec_range(dot, row_bytes, w, w_stride, idx, M * me / all, M * (me + 1) / all, K, x, y);
    }
    return PI_OK;
}

/* pi_rows_matmul_<type>(w, w_stride bytes, N rows, K cols, idx, M, x, x_stride, T, y, y_stride, threads):
 * y[t * y_stride + m] = W[idx[m]] . x[t * x_stride], t < T, m < M; arithmetic of pi_matmul_<type>. T = 1 with
 * float activations runs the rows_dot kernels (the same arithmetic per row, several rows interleaved). */
#define DEFINE_ROWS_MATMUL(type, driver, row_bytes, dot_expr, k_unit)                                            \
    PI_EXPORT int32_t pi_rows_matmul_##type(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,            \
                                            const int64_t *idx, int64_t M, const float *x, int64_t x_stride,     \
                                            int64_t T, float *y, int64_t y_stride, int32_t n_threads) {          \
        ROWS_MATMUL_PROLOGUE                                                                                     \
        const matmul_table *table = matmul_table_active();                                                       \
        const rows_dot_fn dot = dot_expr;                                                                        \
        if (dot != NULL && T == 1 && K % (k_unit) == 0) /* else the driver reports the shape error */         \
            return rows_matvec(dot, row_bytes, w, w_stride, idx, M, K, x, y, n_threads);                        \
        return driver(row_bytes, table->tile_##type, w, w_stride, idx, M, K, x, x_stride, T, y, y_stride,        \
                      n_threads);                                                                                \
    }

DEFINE_ROWS_MATMUL(f32, matmul_float_rows, K * 4, table->dot_f32, 1)
DEFINE_ROWS_MATMUL(f16, matmul_float_rows, K * 2, table->dot_f16, 1)
DEFINE_ROWS_MATMUL(bf16, matmul_float_rows, K * 2, table->dot_bf16, 1)
DEFINE_ROWS_MATMUL(q4_0, matmul_quant_rows, K / QK * (int64_t)sizeof(block_q4_0), NULL, QK)
DEFINE_ROWS_MATMUL(q4_1, matmul_quant_rows, K / QK * (int64_t)sizeof(block_q4_1), NULL, QK)
DEFINE_ROWS_MATMUL(q8_0, matmul_quant_rows, K / QK * (int64_t)sizeof(block_q8_0), NULL, QK)
DEFINE_ROWS_MATMUL(q4_0_f, matmul_quant_f_rows, K / QK * (int64_t)sizeof(block_q4_0), table->dot_q4_0_f, QK)
DEFINE_ROWS_MATMUL(q4_1_f, matmul_quant_f_rows, K / QK * (int64_t)sizeof(block_q4_1), table->dot_q4_1_f, QK)
DEFINE_ROWS_MATMUL(q8_0_f, matmul_quant_f_rows, K / QK * (int64_t)sizeof(block_q8_0), table->dot_q8_0_f, QK)
DEFINE_ROWS_MATMUL(q5_0_f, matmul_quant_f_rows, K / QK * (int64_t)sizeof(block_q5_0), table->dot_q5_0_f, QK)
DEFINE_ROWS_MATMUL(q5_1_f, matmul_quant_f_rows, K / QK * (int64_t)sizeof(block_q5_1), table->dot_q5_1_f, QK)

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
        case KIND_Q5_0:
        case KIND_Q5_1: {
            const uint8_t *blk = row + u * (kind == KIND_Q5_0 ? sizeof(block_q5_0) : sizeof(block_q5_1));
            const float d = fp16_to_fp32(((const block_q5_0 *)blk)->d);
            int q[QK];
            if (kind == KIND_Q5_0) {
                const block_q5_0 *b = (const block_q5_0 *)blk;
                q5_values(b->qh, b->qs, q);
                for (int j = j0; j < j1; j++) out[j] = (float)(q[j] - 16) * d;
            } else {
                const block_q5_1 *b = (const block_q5_1 *)blk;
                const float m = fp16_to_fp32(b->m);
                q5_values(b->qh, b->qs, q);
                for (int j = j0; j < j1; j++) out[j] = d * (float)q[j] + m; /* -ffp-contract=off: as the reference */
            }
            break;
        }
        case KIND_BF16:
            for (int j = j0; j < j1; j++) {
                uint16_t h;
                memcpy(&h, row + (u * AXPY_UNIT + j) * 2, sizeof h);
                out[j] = bf16_to_fp32(h);
            }
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
 * variants for the partial last unit of F32/F16/BF16 rows whose length is not a multiple of 32. */
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

#define SIMD_BODY "sparse_x86.h"
#include "simd_variants.h"

static const axpy_units_fn axpy_units_table[] = {
    [MATMUL_ISA_SCALAR] = axpy_units_scalar,
    [MATMUL_ISA_AVX2] = axpy_units_avx2,
    [MATMUL_ISA_AVX512] = axpy_units_avx512,
};

static int32_t rows_axpy(int kind, size_t unit_bytes, const uint8_t *w, int64_t w_stride, int64_t N, int64_t D,
                         const int64_t *idx, int64_t M, const float *h, int64_t h_stride, int64_t T, float *y,
                         int64_t y_stride, int32_t n_threads) {
    if (N < 0 || M < 0 || D < 0 || T < 0) return PI_ERR_SHAPE;
    if (kind_is_block(kind) && D % QK != 0) return PI_ERR_SHAPE;
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
DEFINE_ROWS_AXPY(bf16, KIND_BF16, AXPY_UNIT * 2)
DEFINE_ROWS_AXPY(q4_0, KIND_Q4_0, sizeof(block_q4_0))
DEFINE_ROWS_AXPY(q4_1, KIND_Q4_1, sizeof(block_q4_1))
DEFINE_ROWS_AXPY(q8_0, KIND_Q8_0, sizeof(block_q8_0))
DEFINE_ROWS_AXPY(q5_0, KIND_Q5_0, sizeof(block_q5_0))
DEFINE_ROWS_AXPY(q5_1, KIND_Q5_1, sizeof(block_q5_1))

/* ---- fused decode FFN: one token, one parallel region ------------------------------------------------------ */

/* ffn_rows computes, for the neurons idx[0..M) and one token u (K,):
 *   g = gate[idx] . u,  v = up[idx] . u,  h = relu(g) * (relu(v) if relu_up else v),  y = sum_m h_m down_t[idx_m]
 * Phase 1: the M neurons split in contiguous ranges over threads; gate and up rows of two neurons at a time in
 *   one rows_dot call (4 interleaved rows), with the rows of the pairs FFN_AHEAD ahead prefetched. The dot
 *   products are those of rows_matmul for the current activation precision (q8: u is quantised once, for both).
 * Barrier.
 * Phase 2: every thread lists the rows with h != 0 in index order (a few hundred compares), then sums them into
 *   its slice of the output, exactly as rows_axpy does (the same SIMD bodies).
 * So y is bit-identical to rows_matmul(gate), rows_matmul(up), relu * mul in float32, rows_axpy(down_t), and
 * does not depend on the thread count. */
#define FFN_AHEAD 2 /* pairs of neurons prefetched ahead */

typedef struct {
    const uint8_t *w;
    int64_t stride;
    int64_t row_bytes;
    rows_dot_fn dot;   /* float activations */
    tile_quant_fn tq;  /* int8 activations ("q8" precision, quant types); NULL otherwise */
} ffn_mat;

typedef struct {
    ffn_mat gate, up;
    const int64_t *idx;
    int64_t M, K;
    const float *u;
    const act_q8 *a;
    int relu_up;
    float *h;   /* (M,) shared */
    axpy_ctx down; /* T = 1; act_rows / act_h / n_act filled per thread */
    int kind_down;
} ffn_ctx;

static int64_t row_bytes_of(int kind, int64_t K) {
    switch (kind) {
        case KIND_Q4_0: return K / QK * (int64_t)sizeof(block_q4_0);
        case KIND_Q4_1: return K / QK * (int64_t)sizeof(block_q4_1);
        case KIND_Q8_0: return K / QK * (int64_t)sizeof(block_q8_0);
        case KIND_Q5_0: return K / QK * (int64_t)sizeof(block_q5_0);
        case KIND_Q5_1: return K / QK * (int64_t)sizeof(block_q5_1);
        case KIND_F32: return K * 4;
        default: return K * 2;
    }
}

static size_t unit_bytes_of(int kind) {
    switch (kind) {
        case KIND_Q4_0: return sizeof(block_q4_0);
        case KIND_Q4_1: return sizeof(block_q4_1);
        case KIND_Q8_0: return sizeof(block_q8_0);
        case KIND_Q5_0: return sizeof(block_q5_0);
        case KIND_Q5_1: return sizeof(block_q5_1);
        case KIND_F32: return AXPY_UNIT * 4;
        default: return AXPY_UNIT * 2;
    }
}

static ffn_mat ffn_mat_of(const matmul_table *t, int kind, int q8, const uint8_t *w, int64_t stride, int64_t K) {
    ffn_mat m = {.w = w, .stride = stride, .row_bytes = row_bytes_of(kind, K), .dot = NULL, .tq = NULL};
    switch (kind) {
        case KIND_Q4_0: m.dot = t->dot_q4_0_f; m.tq = q8 ? t->tile_q4_0 : NULL; break;
        case KIND_Q4_1: m.dot = t->dot_q4_1_f; m.tq = q8 ? t->tile_q4_1 : NULL; break;
        case KIND_Q8_0: m.dot = t->dot_q8_0_f; m.tq = q8 ? t->tile_q8_0 : NULL; break;
        case KIND_F32: m.dot = t->dot_f32; break;
        case KIND_BF16: m.dot = t->dot_bf16; break;
        case KIND_Q5_0: m.dot = t->dot_q5_0_f; break; /* no int8 tiles: float activations in both precisions */
        case KIND_Q5_1: m.dot = t->dot_q5_1_f; break;
        default: m.dot = t->dot_f16; break;
    }
    return m;
}

static inline void ffn_dot(const ffn_mat *m, const uint8_t *const *rows, int R, const ffn_ctx *c, float *out) {
    if (m->tq != NULL)
        for (int r = 0; r < R; r++) m->tq(rows[r], c->a, 0, 1, out + r);
    else
        m->dot(rows, R, c->K, c->u, out);
}

/* torch.relu: NaN stays NaN */
static inline float relu_f(float x) { return x > 0.0f || x != x ? x : 0.0f; }

static inline void ffn_prefetch_pair(const ffn_ctx *c, int64_t m, int64_t m1) {
    for (int64_t r = m; r < min_i64(m + 2, m1); r++) {
        prefetch_bytes(c->gate.w + c->idx[r] * c->gate.stride, c->gate.row_bytes);
        prefetch_bytes(c->up.w + c->idx[r] * c->up.stride, c->up.row_bytes);
    }
}

static void ffn_phase1(const ffn_ctx *c, int64_t m0, int64_t m1) {
    const int fuse = c->gate.tq == NULL && c->up.tq == NULL && c->gate.dot == c->up.dot;
    for (int64_t a = 0; a < FFN_AHEAD; a++) ffn_prefetch_pair(c, m0 + 2 * a, m1);
    for (int64_t m = m0; m < m1; m += 2) {
        const int n = (int)min_i64(2, m1 - m);
        ffn_prefetch_pair(c, m + 2 * FFN_AHEAD, m1);
        const uint8_t *rows[4]; /* gate rows, then up rows */
        float out[4];
        for (int r = 0; r < n; r++) {
            rows[r] = c->gate.w + c->idx[m + r] * c->gate.stride;
            rows[n + r] = c->up.w + c->idx[m + r] * c->up.stride;
        }
        if (fuse) {
            c->gate.dot(rows, 2 * n, c->K, c->u, out);
        } else {
            ffn_dot(&c->gate, rows, n, c, out);
            ffn_dot(&c->up, rows + n, n, c, out + n);
        }
        for (int r = 0; r < n; r++) c->h[m + r] = relu_f(out[r]) * (c->relu_up ? relu_f(out[n + r]) : out[n + r]);
    }
}

static void ffn_phase2(const ffn_ctx *c, int64_t me, int64_t all, const uint8_t **rows, float *hs) {
    axpy_ctx d = c->down;
    int64_t n = 0;
    for (int64_t m = 0; m < c->M; m++) {
        if (c->h[m] == 0.0f) continue;
        rows[n] = d.w + c->idx[m] * d.w_stride;
        hs[n++] = c->h[m];
    }
    d.act_rows = rows;
    d.act_h = hs;
    d.n_act = n;
    const int64_t n_full = d.D / AXPY_UNIT, n_units = (d.D + AXPY_UNIT - 1) / AXPY_UNIT;
    const int64_t u0 = n_units * me / all, u1 = n_units * (me + 1) / all;
    axpy_units_table[matmul_isa_level()](c->kind_down, &d, u0, min_i64(u1, n_full));
    if (u1 > n_full) axpy_range_scalar(c->kind_down, &d, n_full * AXPY_UNIT, d.D); /* partial unit: F32/F16 */
}

/* pi_ffn_rows(u, K, D, N, gate, gate_stride, gate_kind, up, up_stride, up_kind, down_t, down_stride, down_kind,
 *             idx, M, relu_up, q8_act, y, threads): y (D,) as described above; gate and up are (N, K), down_t
 * (N, D); kinds as enum axpy_kind (0 Q4_0, 1 Q4_1, 2 Q8_0, 3 F32, 4 F16, 5 BF16, 6 Q5_0, 7 Q5_1); q8_act != 0 uses the int8 activation
 * dot products of the quant types (the "q8" precision of rows_matmul). */
PI_EXPORT int32_t pi_ffn_rows(const float *u, int64_t K, int64_t D, int64_t N, const uint8_t *gate,
                              int64_t gate_stride, int32_t gate_kind, const uint8_t *up, int64_t up_stride,
                              int32_t up_kind, const uint8_t *down, int64_t down_stride, int32_t down_kind,
                              const int64_t *idx, int64_t M, int32_t relu_up, int32_t q8_act, float *y,
                              int32_t n_threads) {
    if (K < 0 || D < 0 || N < 0 || M < 0) return PI_ERR_SHAPE;
    const int32_t kinds[3] = {gate_kind, up_kind, down_kind};
    for (int i = 0; i < 3; i++) {
        if (kinds[i] < KIND_Q4_0 || kinds[i] > KIND_LAST) return PI_ERR_SHAPE;
        if (kind_is_block(kinds[i]) && (i < 2 ? K : D) % QK != 0) return PI_ERR_SHAPE;
    }
    if (M == 0) { /* idx may be NULL (an empty tensor has no data) */
        for (int64_t e = 0; e < D; e++) y[e] = 0.0f;
        return PI_OK;
    }
    if (idx == NULL) return PI_ERR_SHAPE;
    const int32_t status = check_ids(idx, M, N);
    if (status != PI_OK) return status;
    const matmul_table *table = matmul_table_active();
    int32_t nt = threads_for_work(n_threads, M * (2 * K + D));
    const int64_t nb = K / QK;
    const int need_q8 = q8_act && (gate_kind <= KIND_Q8_0 || up_kind <= KIND_Q8_0);
    /* scratch: h (M), per-thread row lists (M pointers + M floats each), then the int8 activations */
    const size_t h_bytes = ((size_t)M * 4 + 63) & ~(size_t)63;
    const size_t list_bytes = (((size_t)M * (sizeof(const uint8_t *) + sizeof(float))) + 63) & ~(size_t)63;
    const size_t q_bytes = need_q8 ? (((size_t)K + 63) & ~(size_t)63) + (size_t)nb * 12 : 0;
    uint8_t *scratch = malloc(h_bytes + (size_t)nt * list_bytes + q_bytes);
    if (scratch == NULL) return PI_ERR_ALLOC;
    act_q8 a = {0};
    if (need_q8) {
        uint8_t *q = scratch + h_bytes + (size_t)nt * list_bytes;
        a.qs = (int8_t *)q;
        a.ds = (float *)(q + (((size_t)K + 63) & ~(size_t)63));
        a.isum = (int32_t *)(a.ds + 2 * nb);
        a.K = K;
        a.nb = nb;
        table->quantize_act(u, nb, a.qs, a.ds, a.isum);
    }
    ffn_ctx c = {
        .gate = ffn_mat_of(table, gate_kind, q8_act, gate, gate_stride, K),
        .up = ffn_mat_of(table, up_kind, q8_act, up, up_stride, K),
        .idx = idx, .M = M, .K = K, .u = u, .a = &a, .relu_up = relu_up != 0,
        .h = (float *)scratch,
        .down = {.w = down, .w_stride = down_stride, .idx = idx, .M = M, .D = D,
                 .unit_bytes = unit_bytes_of(down_kind), .h = (float *)scratch, .h_stride = M, .T = 1, .y = y,
                 .y_stride = D},
        .kind_down = down_kind,
    };
    if (nt == 1) {
        const uint8_t **rows = (const uint8_t **)(scratch + h_bytes);
        ffn_phase1(&c, 0, M);
        ffn_phase2(&c, 0, 1, rows, (float *)(rows + M));
    } else {
#pragma omp parallel num_threads(nt)
        {
            const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
            const uint8_t **rows = (const uint8_t **)(scratch + h_bytes + (size_t)me * list_bytes);
            ffn_phase1(&c, M * me / all, M * (me + 1) / all);
#pragma omp barrier
            ffn_phase2(&c, me, all, rows, (float *)(rows + M));
        }
    }
    free(scratch);
    return PI_OK;
}

/* ---- predictor + fused decode FFN: one token, one parallel region --------------------------------------------- */

/* out[n - n0] = W[n] . x for n in [n0, n1), ROWS_DOT_MAX consecutive rows per rows_dot call (the bits of
 * pi_matmul_<type> with float activations at T = 1, whatever the grouping) */
static void dense_rows_range(rows_dot_fn dot, const uint8_t *w, int64_t stride, int64_t n0, int64_t n1, int64_t K,
                             const float *x, float *out) {
    for (int64_t n = n0; n < n1; n += ROWS_DOT_MAX) {
        const int R = (int)min_i64(ROWS_DOT_MAX, n1 - n);
        const uint8_t *rows[ROWS_DOT_MAX];
        for (int r = 0; r < R; r++) rows[r] = w + (n + r) * stride;
        dot(rows, R, K, x, out + (n - n0));
    }
}

/* pi_predict_ffn(x, u, K, D, N, fc1, fc1_stride, fc1_kind, rank, fc2, fc2_stride, fc2_kind, threshold, gate, ...,
 *                up, ..., down_t, ..., relu_up, idx, n_active, predictor_seconds, y, threads):
 * PowerInfer's predicted sparse FFN of one token with float activations, every neuron on the CPU:
 *   s = fc2 . relu(fc1 . x),  idx = {n : s_n >= threshold} in increasing order (written to idx, count to
 *   *n_active),  y = ffn_rows(u, gate, up, down_t, idx).
 * Bit-identical to pi_matmul (fc1, fc2), torch's relu and >= on float32, nonzero, then pi_ffn_rows with
 * q8_act = 0: the same rows_dot kernels, the same phases. idx must hold N entries. predictor_seconds (may be
 * NULL) receives the wall time until the active list was complete. */
PI_EXPORT int32_t pi_predict_ffn(const float *x, const float *u, int64_t K, int64_t D, int64_t N,
                                 const uint8_t *fc1, int64_t fc1_stride, int32_t fc1_kind, int64_t rank,
                                 const uint8_t *fc2, int64_t fc2_stride, int32_t fc2_kind, float threshold,
                                 const uint8_t *gate, int64_t gate_stride, int32_t gate_kind, const uint8_t *up,
                                 int64_t up_stride, int32_t up_kind, const uint8_t *down, int64_t down_stride,
                                 int32_t down_kind, int32_t relu_up, int64_t *idx, int64_t *n_active,
                                 double *predictor_seconds, float *y, int32_t n_threads) {
    const double t_start = omp_get_wtime();
    if (K < 0 || D < 0 || N < 0 || rank < 0 || idx == NULL || n_active == NULL) return PI_ERR_SHAPE;
    const int32_t kinds[5] = {gate_kind, up_kind, down_kind, fc1_kind, fc2_kind};
    const int64_t lens[5] = {K, K, D, K, rank};
    for (int i = 0; i < 5; i++) {
        if (kinds[i] < KIND_Q4_0 || kinds[i] > KIND_LAST) return PI_ERR_SHAPE;
        if (kind_is_block(kinds[i]) && lens[i] % QK != 0) return PI_ERR_SHAPE;
    }
    const matmul_table *table = matmul_table_active();
    const ffn_mat m1 = ffn_mat_of(table, fc1_kind, 0, fc1, fc1_stride, K);
    const ffn_mat m2 = ffn_mat_of(table, fc2_kind, 0, fc2, fc2_stride, rank);
    int32_t nt = threads_for_work(n_threads, N * (2 * K + D + rank));
    /* scratch: z (rank), h (N), per-thread row lists (N pointers + N floats each), per-thread active counts */
    const size_t z_bytes = ((size_t)rank * 4 + 63) & ~(size_t)63;
    const size_t h_bytes = ((size_t)N * 4 + 63) & ~(size_t)63;
    const size_t list_bytes = (((size_t)N * (sizeof(const uint8_t *) + sizeof(float))) + 63) & ~(size_t)63;
    uint8_t *scratch = malloc(z_bytes + h_bytes + (size_t)nt * list_bytes + (size_t)(nt + 1) * sizeof(int64_t));
    if (scratch == NULL) return PI_ERR_ALLOC;
    float *z = (float *)scratch;
    int64_t *counts = (int64_t *)(scratch + z_bytes + h_bytes + (size_t)nt * list_bytes);
    act_q8 a = {0};
    ffn_ctx c = {
        .gate = ffn_mat_of(table, gate_kind, 0, gate, gate_stride, K),
        .up = ffn_mat_of(table, up_kind, 0, up, up_stride, K),
        .idx = idx, .M = 0, .K = K, .u = u, .a = &a, .relu_up = relu_up != 0,
        .h = (float *)(scratch + z_bytes),
        .down = {.w = down, .w_stride = down_stride, .idx = idx, .M = 0, .D = D,
                 .unit_bytes = unit_bytes_of(down_kind), .h = (float *)(scratch + z_bytes), .h_stride = 0, .T = 1,
                 .y = y, .y_stride = D},
        .kind_down = down_kind,
    };
    double t_pred = 0.0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
        const uint8_t **rows = (const uint8_t **)(scratch + z_bytes + h_bytes + (size_t)me * list_bytes);
        /* fc1 and relu over this thread's rank rows */
        const int64_t r0 = rank * me / all, r1 = rank * (me + 1) / all;
        dense_rows_range(m1.dot, fc1, fc1_stride, r0, r1, K, x, z + r0);
        for (int64_t r = r0; r < r1; r++) z[r] = relu_f(z[r]);
#pragma omp barrier
        /* fc2 and the threshold over this thread's neurons: ids into this thread's slice of idx */
        const int64_t n0 = N * me / all, n1 = N * (me + 1) / all;
        float *s = (float *)(rows + N); /* this thread's float list doubles as score buffer */
        dense_rows_range(m2.dot, fc2, fc2_stride, n0, n1, rank, z, s);
        int64_t n_here = 0;
        for (int64_t n = n0; n < n1; n++)
            if (s[n - n0] >= threshold) idx[n0 + n_here++] = n;
        counts[me] = n_here;
#pragma omp barrier
#pragma omp single
        {
            /* compact the per-thread slices in thread (= index) order */
            int64_t M = counts[0];
            for (int64_t t = 1; t < all; t++) {
                const int64_t src = N * t / all;
                memmove(idx + M, idx + src, (size_t)counts[t] * sizeof(int64_t));
                M += counts[t];
            }
            c.M = M;
            c.down.M = M;
            c.down.h_stride = M;
            t_pred = omp_get_wtime() - t_start;
        } /* implicit barrier */
        ffn_phase1(&c, c.M * me / all, c.M * (me + 1) / all);
#pragma omp barrier
        ffn_phase2(&c, me, all, rows, (float *)(rows + N));
    }
    *n_active = c.M;
    if (predictor_seconds != NULL) *predictor_seconds = t_pred;
    if (c.M == 0)
        for (int64_t e = 0; e < D; e++) y[e] = 0.0f;
    free(scratch);
    return PI_OK;
}
