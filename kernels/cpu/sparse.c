/* Sparse FFN kernels over a subset of neurons (rows): PowerInfer's SPARSE_MATMUL and AXPY, done deterministically.
 *
 * rows_matmul: y[t, m] = W[idx[m]] . x[t]. Runs the dense matmul drivers (matmul.c) with a row list, so the
 *   arithmetic is exactly that of pi_matmul_<type>[_f] for the current activation precision: with idx = 0..N-1 the
 *   result is bit-identical to the dense matmul. Only the rows in idx are read.
 *
 * rows_axpy: y[t, :] = sum_m h[t, m] * W_t[idx[m], :] (idx NULL: all N rows). Rows with h[t, m] == 0 are skipped.
 *   Each output element is one sequential chain in index order: y = fma(h[t, m], w[m, e], y) over the rows with
 *   h != 0, starting from 0. Weights are decoded in registers to the reference dequantiser's floats (bit-equal,
 *   a minimum included: d * q then + m, rounded separately; K-quant super-blocks into a small buffer in L1). The
 *   OUTPUT dimension D is split over threads in units of 32 elements (a super-block of 256 for the K-quants, whose
 *   D must be a multiple of 256), each thread summing all rows for its slice, so there is no cross-thread
 *   reduction: the result depends neither on the thread count, nor on the SIMD variant (scalar uses fmaf), nor on
 *   the other tokens of the batch. (The original sums per-thread partial buffers without synchronisation, spec
 *   4.3.)
 *
 * Both validate row ids before any work (PI_ERR_INDEX) and accept M == 0 (rows_axpy then writes zeros). Every
 * kernel takes the SIMD level `isa` (enum pi_isa) last. The fused decode FFN built on them is in ffn.c.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "sparse.h"

int32_t check_ids(const int64_t *idx, int64_t M, int64_t N) {
    if (idx == NULL) return M == N ? PI_OK : PI_ERR_SHAPE;
    for (int64_t m = 0; m < M; m++)
        if (idx[m] < 0 || idx[m] >= N) return PI_ERR_INDEX;
    return PI_OK;
}

/* ---- rows_matmul --------------------------------------------------------------------------------------------- */

#define ROWS_MATMUL_PROLOGUE(row_bytes)                                                             \
    if (N < 0 || M < 0 || K < 0 || T < 0) return PI_ERR_SHAPE;                                    \
    if (!stride_ok(N, w_stride, row_bytes) || !stride_ok(T, x_stride, K) || !stride_ok(T, y_stride, M)) \
        return PI_ERR_SHAPE;                                                                       \
    if (M == 0 || T == 0) return PI_OK;                                                            \
    if (idx == NULL || w == NULL || x == NULL || y == NULL) return PI_ERR_SHAPE;                   \
    const int32_t status = check_ids(idx, M, N);                                                   \
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
        dot(rows, n, K, x, y + m, 0);
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

/* pi_rows_matmul_<type>(w, w_stride bytes, N rows, K cols, idx, M, x, x_stride, T, y, y_stride, threads, isa):
 * y[t * y_stride + m] = W[idx[m]] . x[t * x_stride], t < T, m < M; arithmetic of pi_matmul_<type>. T = 1 with
 * float activations runs the rows_dot kernels (the same arithmetic per row, several rows interleaved). */
/* name: the symbol's suffix; type: the type id; tile: the type_kernels member the driver runs (tile_q8 or tile);
 * use_dot: T = 1 goes through the type's dot (float activations). */
#define DEFINE_ROWS_MATMUL(name, type, driver, tile, use_dot)                                                     \
    PI_EXPORT int32_t pi_rows_matmul_##name(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,            \
                                            const int64_t *idx, int64_t M, const float *x, int64_t x_stride,     \
                                            int64_t T, float *y, int64_t y_stride, int32_t n_threads,            \
                                            int32_t isa) {                                                       \
        const int64_t row_bytes = type_row_bytes(type, K);                                                       \
        ROWS_MATMUL_PROLOGUE(row_bytes)                                                                          \
        const matmul_table *table = matmul_table_for(isa);                                                       \
        const rows_dot_fn dot = (use_dot) ? table->types[type].dot : NULL;                                       \
        if (dot != NULL && T == 1 && K % TYPE_TRAITS[type].block_elems == 0) /* else the driver reports it */    \
            return rows_matvec(dot, row_bytes, w, w_stride, idx, M, K, x, y, n_threads);                         \
        return driver(table, row_bytes, table->types[type].tile, w, w_stride, idx, M, K, x, x_stride, T, y,      \
                      y_stride, n_threads);                                                                      \
    }

#define ROWS_MATMUL_FLOAT(name, type) DEFINE_ROWS_MATMUL(name, type, matmul_float_rows, tile, 1)
#define ROWS_MATMUL_BLOCK32(name, type)                                                                          \
    DEFINE_ROWS_MATMUL(name, type, matmul_quant_rows, tile_q8, 0)                                                \
    DEFINE_ROWS_MATMUL(name##_f, type, matmul_quant_f_rows, tile, 1)
PI_FLOAT_TYPES(ROWS_MATMUL_FLOAT)
PI_BLOCK32_TYPES(ROWS_MATMUL_BLOCK32)
#undef ROWS_MATMUL_FLOAT
#undef ROWS_MATMUL_BLOCK32

/* K-quants: float activations (the exact kernel of both precisions). Rows hold whole super-blocks of 256: any other
 * K is a shape error before a row is read (the T = 1 path checks K % QK_K itself, the tiled one here). */
static int32_t matmul_kq_f_rows_checked(const matmul_table *table, int64_t row_bytes, tile_float_fn tile,
                                        const uint8_t *w, int64_t w_stride, const int64_t *rows, int64_t N, int64_t K,
                                        const float *x, int64_t x_stride, int64_t T, float *y, int64_t y_stride,
                                        int32_t n_threads) {
    if (K % QK_K != 0) return PI_ERR_SHAPE;
    return matmul_quant_f_rows(table, row_bytes, tile, w, w_stride, rows, N, K, x, x_stride, T, y, y_stride, n_threads);
}

#define ROWS_MATMUL_KQUANT(name, type) DEFINE_ROWS_MATMUL(name##_f, type, matmul_kq_f_rows_checked, tile, 1)
PI_KQUANT_TYPES(ROWS_MATMUL_KQUANT)
#undef ROWS_MATMUL_KQUANT

/* ---- rows_axpy: scalar ------------------------------------------------------------------------------------- */

/* Elements [j0, j1) of unit u of a row, decoded as the reference dequantiser does (quants.h); a block kind's unit is
 * one whole block (j0 = 0, j1 = QK: its rows hold whole blocks). */
static void decode_unit_scalar(int kind, const uint8_t *row, int64_t u, int j0, int j1, float *out) {
#define BLOCK_CASE(name, type)                                                                                     \
    case type: decode_##name(row + u * sizeof(block_##name), QK, out); break;
#define FLOAT_CASE(name, type)                                                                                     \
    case type: decode_##name(row + (u * AXPY_UNIT + j0) * TYPE_TRAITS[type].block_bytes, j1 - j0, out + j0); break;
    switch (kind) {
        PI_BLOCK32_TYPES(BLOCK_CASE)
        PI_FLOAT_TYPES(FLOAT_CASE)
        default: break; /* not a kind of these kernels: check_weight refuses it first */
    }
#undef BLOCK_CASE
#undef FLOAT_CASE
}

/* y += c * (q - offset) over unit u of a row of a coef_bf16 type (its integer view, quants.h), c = bf16(h * d) as
 * axpy_coef_bf16 rounds it: the q8 precision's chain (sparse.h) */
static void axpy_coef_unit_scalar(int kind, float h, const uint8_t *row, int64_t u, float *yu) {
    const type_traits *tt = &TYPE_TRAITS[kind];
    int q[QK];
    float d, m;
    tt->ints(row, u, q, &d, &m);
    const float cf = bf16_to_fp32(bf16_round(h * d));
    for (int j = 0; j < QK; j++) yu[j] = fmaf(cf, (float)(q[j] - tt->int8_offset), yu[j]);
}

/* Elements [e0, e1) of y for every token (e0 a multiple of AXPY_UNIT): the plain definition. Also used by the SIMD
 * variants for the partial last unit of F32/F16/BF16 rows whose length is not a multiple of 32. */
void axpy_range_scalar(int kind, const axpy_ctx *c, int64_t e0, int64_t e1) {
    for (int64_t t = 0; t < c->T; t++) {
        float *yt = c->y + t * c->y_stride;
        const float *ht = c->h + t * c->h_stride;
        for (int64_t e = e0; e < e1; e++) yt[e] = 0.0f;
        for (int64_t m = 0; m < c->M; m++) {
            const float hv = ht[m];
            const int64_t id = row_of(c->idx, m);
            if (hv == 0.0f || id < c->row_lo || id >= c->row_hi) continue; /* this chain's rows (axpy_chains) */
            const uint8_t *row = c->w + id * c->w_stride;
            for (int64_t u = e0 / AXPY_UNIT; u * AXPY_UNIT < e1; u++) {
                const int j1 = (int)min_i64(AXPY_UNIT, e1 - u * AXPY_UNIT);
                if (c->coef_bf16 && type_coef_bf16(kind)) {
                    axpy_coef_unit_scalar(kind, hv, row, u, yt + u * AXPY_UNIT);
                    continue;
                }
                float wv[AXPY_UNIT];
                decode_unit_scalar(kind, row, u, 0, j1, wv);
                float *yu = yt + u * AXPY_UNIT;
                for (int j = 0; j < j1; j++) yu[j] = fmaf(hv, wv[j], yu[j]);
            }
        }
    }
}

/* K-quant kinds, super-blocks [u0, u1) of y: each super-block of a row decoded once (kquants.h), then the same
 * fmaf chain per element as the other kinds. T = 1 takes the listed rows, T > 1 every row with h != 0. */
static void axpy_kq_units_scalar(int kind, const axpy_ctx *c, int64_t u0, int64_t u1) {
    const int64_t n_rows = c->T == 1 ? c->n_act : c->M;
    for (int64_t t = 0; t < c->T; t++) {
        float *yt = c->y + t * c->y_stride;
        if (c->T != 1 || !c->accumulate)
            for (int64_t e = u0 * QK_K; e < u1 * QK_K; e++) yt[e] = 0.0f;
        for (int64_t m = 0; m < n_rows; m++) {
            const float hv = c->T == 1 ? c->act_h[m] : c->h[t * c->h_stride + m];
            if (hv == 0.0f) continue;
            const uint8_t *row = c->T == 1 ? c->act_rows[m] : c->w + row_of(c->idx, m) * c->w_stride;
            for (int64_t u = u0; u < u1; u++) {
                float wv[QK_K];
                TYPE_TRAITS[kind].decode(row + u * c->unit_bytes, QK_K, wv); /* quants.h */
                float *yu = yt + u * QK_K;
                for (int j = 0; j < QK_K; j++) yu[j] = fmaf(hv, wv[j], yu[j]);
            }
        }
    }
}

static void axpy_units_scalar(int kind, const axpy_ctx *c, int64_t u0, int64_t u1) {
    if (kind_is_kq(kind)) {
        axpy_kq_units_scalar(kind, c, u0, u1);
        return;
    }
    if (c->T != 1) {
        axpy_range_scalar(kind, c, u0 * AXPY_UNIT, u1 * AXPY_UNIT);
        return;
    }
    /* T = 1: the listed rows, as the SIMD variants take them */
    float *y = c->y;
    if (!c->accumulate)
        for (int64_t e = u0 * AXPY_UNIT; e < u1 * AXPY_UNIT; e++) y[e] = 0.0f;
    for (int64_t r = 0; r < c->n_act; r++) {
        const float hv = c->act_h[r];
        for (int64_t u = u0; u < u1; u++) {
            if (c->coef_bf16 && type_coef_bf16(kind)) {
                axpy_coef_unit_scalar(kind, hv, c->act_rows[r], u, y + u * AXPY_UNIT);
                continue;
            }
            float wv[AXPY_UNIT];
            decode_unit_scalar(kind, c->act_rows[r], u, 0, AXPY_UNIT, wv);
            float *yu = y + u * AXPY_UNIT;
            for (int j = 0; j < AXPY_UNIT; j++) yu[j] = fmaf(hv, wv[j], yu[j]);
        }
    }
}

/* ---- rows_axpy: SIMD variants ------------------------------------------------------------------------------ */

#define SIMD_BODY "sparse_x86.h"
#include "simd_variants.h"

static const axpy_units_fn axpy_units_table[] = {
    [PI_ISA_SCALAR] = axpy_units_scalar,
#if PI_X86
    [PI_ISA_AVX2] = axpy_units_avx2,
    [PI_ISA_AVX512] = axpy_units_avx512,
#endif
};

axpy_units_fn axpy_units_for(int32_t isa) { return axpy_units_table[pi_isa_clamp(isa)]; }

static int bf16_dot_ok; /* set once when the library loads, read-only after */

__attribute__((constructor)) static void bf16_dot_probe(void) {
#if PI_X86
    __builtin_cpu_init();
    bf16_dot_ok = pi_kernels_isa_best() >= PI_ISA_AVX512 && __builtin_cpu_supports("avx512bf16") &&
                  __builtin_cpu_supports("avx512vbmi") && bf16_dot_selftest_avx512();
#else
    bf16_dot_ok = 0; /* vdpbf16ps is x86 only */
#endif
}

int axpy_bf16_dot_ok(void) { return bf16_dot_ok; }

/* 1 when the coef_bf16 rows of the q8 precision run on vdpbf16ps here (sparse.h), for reports */
PI_EXPORT int32_t pi_kernels_bf16_dot(void) { return bf16_dot_ok; }

#define AXPY_CHUNK 256 /* T = 1: rows listed at a time on a thread's stack (3 KiB) */

void axpy_t1_units(axpy_units_fn units, int kind, const axpy_ctx *c, int64_t u0, int64_t u1) {
    if (u1 <= u0) return;
    const uint8_t *rows[AXPY_CHUNK];
    float hs[AXPY_CHUNK];
    axpy_ctx d = *c;
    d.act_rows = rows;
    d.act_h = hs;
    d.accumulate = 0;
    int64_t m = 0;
    do {
        int64_t n = 0;
        for (; m < c->M && n < AXPY_CHUNK; m++) {
            const float hv = c->h[m];
            const int64_t row = row_of(c->idx, m);
            if (hv == 0.0f || fabsf(hv) <= c->h_min || row < c->row_lo || row >= c->row_hi) continue;
            rows[n] = c->w + row * c->w_stride;
            hs[n++] = hv;
        }
        d.n_act = n;
        units(kind, &d, u0, u1);
        d.accumulate = 1;
    } while (m < c->M);
}

static inline int64_t axpy_chain_lo(const axpy_ctx *c, int p) { return c->n_rows * p / AXPY_CHAINS; }

void axpy_chains_prepare(const axpy_ctx *c, float *scratch) {
    if (c->T <= 1) return;
    float *hp = scratch + (int64_t)(AXPY_CHAINS - 1) * c->T * c->D;
    for (int p = 0; p < AXPY_CHAINS; p++) {
        const int64_t lo = axpy_chain_lo(c, p), hi = axpy_chain_lo(c, p + 1);
        for (int64_t t = 0; t < c->T; t++)
            for (int64_t m = 0; m < c->M; m++) {
                const int64_t row = row_of(c->idx, m);
                const float hv = c->h[t * c->h_stride + m];
                hp[(p * c->T + t) * c->M + m] = row >= lo && row < hi && !(fabsf(hv) <= c->h_min) ? hv : 0.0f;
            }
    }
}

void axpy_chains(axpy_units_fn units, int kind, const axpy_ctx *c, float *scratch, int64_t me, int64_t all) {
    const int64_t unit = axpy_unit_of(kind);
    const int64_t n_full = c->D / unit, n_units = (c->D + unit - 1) / unit;
    const int64_t n = c->T * c->D;
    for (int p = 0; p < AXPY_CHAINS; p++) {
        int64_t j = 0, g = 1; /* this thread's slice j of the chain's g slices of units */
        if (all >= AXPY_CHAINS) {
            if (me % AXPY_CHAINS != p) continue;
            g = (all - p + AXPY_CHAINS - 1) / AXPY_CHAINS;
            j = me / AXPY_CHAINS;
        } else if (p % all != me) {
            continue;
        }
        axpy_ctx d = *c;
        d.row_lo = axpy_chain_lo(c, p);
        d.row_hi = axpy_chain_lo(c, p + 1);
        if (p > 0) {
            d.y = scratch + (int64_t)(p - 1) * n;
            d.y_stride = c->D;
        }
        if (c->T > 1) { /* the other chains' rows at h = 0, which every path skips */
            d.h = scratch + (int64_t)(AXPY_CHAINS - 1) * n + (int64_t)p * c->T * c->M;
            d.h_stride = c->M;
        }
        const int64_t u0 = n_units * j / g, u1 = n_units * (j + 1) / g;
        if (c->T == 1)
            axpy_t1_units(units, kind, &d, u0, min_i64(u1, n_full));
        else if (u0 < min_i64(u1, n_full))
            units(kind, &d, u0, min_i64(u1, n_full));
        if (u1 > n_full) axpy_range_scalar(kind, &d, n_full * unit, c->D); /* partial unit: F32/F16 only */
    }
    if (all > 1) {
#pragma omp barrier
    }
    /* y = ((chain 0 + chain 1) + ...), this thread's elements of every token (a token's run of them at a time, so
     * the loop vectorizes; each element is the same sum) */
    const int64_t e0 = n * me / all, e1 = n * (me + 1) / all;
    for (int64_t t = e0 / max_i64(c->D, 1); t < c->T && t * c->D < e1; t++) {
        const int64_t lo = max_i64(e0, t * c->D), hi = min_i64(e1, (t + 1) * c->D);
        float *yt = c->y + t * c->y_stride - t * c->D;
        for (int64_t i = lo; i < hi; i++) {
            float v = yt[i];
            for (int p = 1; p < AXPY_CHAINS; p++) v += scratch[(int64_t)(p - 1) * n + i];
            yt[i] = v;
        }
    }
}

static int32_t rows_axpy(int kind, size_t unit_bytes, const uint8_t *w, int64_t w_stride, int64_t N, int64_t D,
                         const int64_t *idx, int64_t M, const float *h, int64_t h_stride, int64_t T, float *y,
                         int64_t y_stride, int32_t q8_act, float h_min, int32_t n_threads, int32_t isa) {
    if (N < 0 || M < 0 || D < 0 || T < 0) return PI_ERR_SHAPE;
    if (!(h_min >= 0.0f)) return PI_ERR_SHAPE; /* a negative or NaN threshold would skip nothing or everything */
    if (kind_is_block(kind) && D % QK != 0) return PI_ERR_SHAPE;
    if (kind_is_kq(kind) && D % QK_K != 0) return PI_ERR_SHAPE; /* K-quant rows hold whole super-blocks */
    /* bytes of one row of D elements: D / 32 units of unit_bytes (a quant block, or 32 floats of 2 or 4 bytes), or
     * D / 256 super-blocks of unit_bytes for the K-quants */
    const int64_t row_bytes = kind_is_kq(kind)      ? D / QK_K * (int64_t)unit_bytes
                              : kind_is_block(kind) ? D / QK * (int64_t)unit_bytes
                                                    : D * (int64_t)(unit_bytes / AXPY_UNIT);
    if (!stride_ok(N, w_stride, row_bytes) || !stride_ok(T, h_stride, M) || !stride_ok(T, y_stride, D))
        return PI_ERR_SHAPE;
    const int32_t status = check_ids(idx, M, N);
    if (status != PI_OK) return status;
    if (T == 0 || D == 0) return PI_OK;
    if (y == NULL || (M > 0 && (w == NULL || h == NULL))) return PI_ERR_SHAPE;
    const axpy_ctx c = {.w = w, .w_stride = w_stride, .idx = idx, .M = M, .D = D, .unit_bytes = unit_bytes, .h = h,
                        .h_stride = h_stride, .T = T, .y = y, .y_stride = y_stride,
                        .coef_bf16 = q8_act != 0 && type_coef_bf16(kind), .n_rows = N, .h_min = h_min};
    int64_t work_rows = M;
    if (T == 1) {
        work_rows = 0;
        for (int64_t m = 0; m < M; m++) work_rows += h[m] != 0.0f && !(fabsf(h[m]) <= h_min);
    }
    const axpy_units_fn units = axpy_units_for(isa);
    const int64_t n_units = (D + axpy_unit_of(kind) - 1) / axpy_unit_of(kind);
    int32_t nt = threads_for_work(n_threads, work_rows * D * T);
    if (nt > AXPY_CHAINS * n_units) nt = (int32_t)(AXPY_CHAINS * n_units);
    float *scratch = malloc(axpy_chains_scratch(T, D, M));
    if (scratch == NULL) return PI_ERR_ALLOC;
    axpy_chains_prepare(&c, scratch);
#pragma omp parallel num_threads(nt) if (nt > 1)
    axpy_chains(units, kind, &c, scratch, omp_get_thread_num(), omp_get_num_threads());
    free(scratch);
    return PI_OK;
}

/* pi_rows_axpy_<type>(w_t, w_stride bytes, N rows, D cols, idx or NULL, M, h, h_stride, T, y, y_stride, q8_act,
 * h_min, threads, isa): y[t * y_stride + e] = sum_{m < M, |h[t, m]| > h_min} h[t * h_stride + m] * W_t[idx[m], e]
 * (h_min >= 0; 0 skips the rows with h = 0 only, NaN is kept); q8_act != 0
 * takes the rows of a coef_bf16 type (quants.h) with bfloat16 coefficients (sparse.h, axpy_coef_bf16), the other types as with 0. */
#define DEFINE_ROWS_AXPY(type, kind)                                                                  \
    PI_EXPORT int32_t pi_rows_axpy_##type(const uint8_t *w, int64_t w_stride, int64_t N, int64_t D,               \
                                          const int64_t *idx, int64_t M, const float *h, int64_t h_stride,        \
                                          int64_t T, float *y, int64_t y_stride, int32_t q8_act, float h_min,         \
                                          int32_t n_threads, int32_t isa) {                                       \
        return rows_axpy(kind, axpy_unit_bytes(kind), w, w_stride, N, D, idx, M, h, h_stride, T, y, y_stride, q8_act, h_min, n_threads, \
                         isa);                                                                                    \
    }

PI_FLOAT_TYPES(DEFINE_ROWS_AXPY)
PI_BLOCK32_TYPES(DEFINE_ROWS_AXPY)
/* K-quants: D must be a multiple of 256 (PI_ERR_SHAPE otherwise); work units are super-blocks */
PI_KQUANT_TYPES(DEFINE_ROWS_AXPY)
