/* Fused decode FFN of one token: pi_ffn_rows (a row list), pi_predict_ffn (the predictor in front) and pi_cats_ffn
 * (CATS: every gate row, a threshold per neuron), each one parallel region, on the sparse kernels' arithmetic
 * (sparse.h): bit-identical to rows_matmul(gate), rows_matmul(up), the gating, rows_axpy(down_t) for ReLU. All
 * work in the caller's scratch buffer and allocate nothing; all take the activation (enum ffn_act) and the SIMD
 * level `isa` (enum pi_isa).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "sparse.h"

/* ---- fused decode FFN: one token, one parallel region ------------------------------------------------------ */

/* ffn_rows computes, for the neurons idx[0..M) and one token u (K,):
 *   g = gate[idx] . u,  v = up[idx] . u,  h = act(g) * (relu(v) if relu_up else v),  y = sum_m h_m down_t[idx_m]
 * Phase 1: the M neurons split in contiguous ranges over threads; each thread reads its gate rows, then its up
 *   rows (see ffn_phase1 for the prefetching). The dot products are those of
 *   rows_matmul for the activation precision (q8: u is quantised once, for both).
 * Barrier.
 * Phase 2: every thread lists the rows with h != 0 in index order, a chunk at a time, and sums them into its
 *   slice of the output, exactly as rows_axpy does (the same SIMD bodies).
 * So y is bit-identical to rows_matmul(gate), rows_matmul(up), the gating in float32, rows_axpy(down_t), and
 * does not depend on the thread count. With act = relu the gating is torch's relu(g) * v bit for bit; the other
 * activations use libm (expf, erff, tanhf) in torch's formulas, within a few float32 ulps of torch's. */
#define FFN_AHEAD 4 /* steps of two rows prefetched ahead */

typedef struct {
    ffn_mat gate, up;
    const int64_t *idx;
    int64_t M, K;
    const float *u;
    const act_q8 *a;
    int act;
    int relu_up;
    int h_is_act; /* the up pass finds act(gate) in h already (CATS), not the gate's dot product */
    float *h;   /* (M,) shared */
    axpy_ctx down; /* T = 1 over h */
    int kind_down;
    axpy_units_fn units; /* the SIMD variant of the down rows */
    float *chains;       /* the down rows' chains after the first (axpy_chains_scratch(1, D, 0)) */
} ffn_ctx;

static inline void ffn_dot(const ffn_mat *m, const uint8_t *const *rows, int R, const ffn_ctx *c, float *out) {
    if (m->tq != NULL)
        for (int r = 0; r < R; r++) m->tq(rows[r], c->a, 0, 1, out + r);
    else if (m->row_bytes > FFN_DOT_MAX_ROW) /* long rows stream best one at a time (see matmul.c matvec_dot) */
        for (int r = 0; r < R; r++) m->dot(rows + r, 1, c->K, c->u, out + r, 0);
    else
        m->dot(rows, R, c->K, c->u, out, 0);
}

static inline void ffn_prefetch_rows(const ffn_mat *mat, const int64_t *idx, int64_t m, int64_t m1) {
    for (int64_t r = m; r < min_i64(m + 2, m1); r++) prefetch_bytes(mat->w + idx[r] * mat->stride, mat->row_bytes);
}
/* The gate rows of the range first (their dots into h), then the up rows (h = act(gate) * up): one matrix's scattered
 * rows streamed at a time. Reading a gate and an up row side by side measured 35-45% slower (1.1B shapes of a 4-bit
 * block type, 10% of the rows, 1 thread, on a 2-core EPYC; docs/kernels.md). Int8 tiles read a row at a time and
 * prefetch, as they go, the row FFN_STREAM_ROWS further down the list at the same offset (act_q8.ahead is the
 * distance between the two rows), so the requests stay spread over the work; the float kernels take two rows per step
 * with the rows FFN_AHEAD steps ahead prefetched whole. Measured on the AVX-512 Xeon (pi_ffn_rows over the 22 layers
 * of the 1.1B file of a 4-bit block type, 10% random rows, q8): whole rows ahead 4.01 / 2.25 ms at 1 / 2 threads,
 * streamed 2 rows ahead 3.43, 4 rows 3.26 / 1.84, 8 rows 3.21 / 1.77, 16 rows 3.52 / 1.93. Scattered rows' prefetches
 * fill L2 only, runs of consecutive rows stream as dense ones (listed_ahead, matmul.h). */
#define FFN_STREAM_ROWS 8
/* One pass over the neurons [m0, m1) of the list: the gate rows (pass 0, their dots into h) or the up rows (pass 1,
 * h = act(h) * up, or h * up when h holds act(gate) already) */
static void ffn_pass(const ffn_ctx *c, int pass, int64_t m0, int64_t m1) {
    const ffn_mat *mat = pass == 0 ? &c->gate : &c->up;
    const int act = c->h_is_act ? -1 : c->act;
#define FFN_GATED(g, v) (act < 0 ? (g) : ffn_act(act, (g))) * (c->relu_up ? relu_f(v) : (v))
    if (mat->tq != NULL) {
        act_q8 al = *c->a;
        for (int64_t r = m0; r < min_i64(m0 + FFN_STREAM_ROWS, m1); r++)
            prefetch_bytes_l2(mat->w + c->idx[r] * mat->stride, mat->row_bytes);
        for (int64_t m = m0; m < m1; m++) {
            listed_ahead(&al, m + FFN_STREAM_ROWS < m1 ? c->idx[m + FFN_STREAM_ROWS] - c->idx[m] : 0, FFN_STREAM_ROWS,
                         mat->stride);
            float out;
            mat->tq(mat->w + c->idx[m] * mat->stride, &al, 0, 1, &out);
            c->h[m] = pass == 0 ? out : FFN_GATED(c->h[m], out);
        }
        return;
    }
    for (int64_t a = 0; a < FFN_AHEAD; a++) ffn_prefetch_rows(mat, c->idx, m0 + 2 * a, m1);
    for (int64_t m = m0; m < m1; m += 2) {
        const int n = (int)min_i64(2, m1 - m);
        ffn_prefetch_rows(mat, c->idx, m + 2 * FFN_AHEAD, m1);
        const uint8_t *rows[2];
        float out[2];
        for (int r = 0; r < n; r++) rows[r] = mat->w + c->idx[m + r] * mat->stride;
        ffn_dot(mat, rows, n, c, out);
        for (int r = 0; r < n; r++) c->h[m + r] = pass == 0 ? out[r] : FFN_GATED(c->h[m + r], out[r]);
    }
#undef FFN_GATED
}

static void ffn_phase1(const ffn_ctx *c, int64_t m0, int64_t m1) {
    ffn_pass(c, 0, m0, m1);
    ffn_pass(c, 1, m0, m1);
}

/* this thread's share of the down rows with h != 0, as rows_axpy sums them (its chains: axpy_chains); every
 * thread of the team calls it */
static void ffn_phase2(const ffn_ctx *c, int64_t me, int64_t all) {
    axpy_chains(c->units, c->kind_down, &c->down, c->chains, me, all);
}

/* Scratch of pi_ffn_rows over M neurons of K inputs: h (M floats), then the int8 activations in the q8 precision. */
static size_t ffn_rows_scratch(int64_t M, int64_t K, int q8) {
    return align_up((size_t)M * 4) + (q8 ? act_q8_bytes(K) : 0);
}

/* Bytes of scratch pi_ffn_rows needs for up to M neurons of K inputs (q8_act: the int8 activation precision),
 * the alignment slack included; -1 for negative sizes. */
PI_EXPORT int64_t pi_ffn_rows_scratch_bytes(int64_t M, int64_t K, int32_t q8_act) {
    if (M < 0 || K < 0) return -1;
    return (int64_t)(ffn_rows_scratch(M, K, q8_act != 0) + PI_SCRATCH_ALIGN);
}

/* pi_ffn_rows(u, K, D, N, gate, gate_stride, gate_kind, up, up_stride, up_kind, down_t, down_stride, down_kind,
 *             idx, M, act, relu_up, q8_act, y, scratch, scratch_bytes, threads, isa):
 * y (D,) as described above; gate and up are (N, K), down_t (N, D); kinds are ggml type ids (enum pi_type:
 * the float, block-32 and K-quant types of quants.h; a K-quant weight needs its row length, K or D, a multiple of
 * 256); act as enum ffn_act (0 relu, 1 silu, 2 gelu, 3 gelu_tanh);
 * q8_act != 0 uses the int8 activation dot products of the quant types (the "q8" precision of rows_matmul).
 * scratch: at least pi_ffn_rows_scratch_bytes(M, K, q8_act) bytes, else PI_ERR_SCRATCH. */
PI_EXPORT int32_t pi_ffn_rows(const float *u, int64_t K, int64_t D, int64_t N, const uint8_t *gate,
                              int64_t gate_stride, int32_t gate_kind, const uint8_t *up, int64_t up_stride,
                              int32_t up_kind, const uint8_t *down, int64_t down_stride, int32_t down_kind,
                              const int64_t *idx, int64_t M, int32_t act, int32_t relu_up, int32_t q8_act, float *y,
                              void *scratch, int64_t scratch_bytes, int32_t n_threads, int32_t isa) {
    if (K < 0 || D < 0 || N < 0 || M < 0 || act < ACT_RELU || act > ACT_LAST) return PI_ERR_SHAPE;
    if (y == NULL || (M > 0 && u == NULL)) return PI_ERR_SHAPE;
    const int32_t kinds[3] = {gate_kind, up_kind, down_kind};
    const int64_t lens[3] = {K, K, D}, strides[3] = {gate_stride, up_stride, down_stride};
    const uint8_t *weights[3] = {gate, up, down};
    for (int i = 0; i < 3; i++)
        if (check_weight(kinds[i], N, lens[i], weights[i], strides[i]) != PI_OK) return PI_ERR_SHAPE;
    if (M == 0) { /* idx may be NULL (an empty tensor has no data) */
        for (int64_t e = 0; e < D; e++) y[e] = 0.0f;
        return PI_OK;
    }
    if (idx == NULL) return PI_ERR_SHAPE;
    int32_t status = check_ids(idx, M, N);
    if (status != PI_OK) return status;
    const int need_q8 = q8_act && (kind_has_q8_tile(gate_kind) || kind_has_q8_tile(up_kind));
    uint8_t *buf;
    status = scratch_take(scratch, scratch_bytes, ffn_rows_scratch(M, K, need_q8), &buf);
    if (status != PI_OK) return status;
    const int32_t level = pi_isa_clamp(isa);
    const matmul_table *table = matmul_table_for(level);
    const int32_t nt = threads_for_work(n_threads, M * (2 * K + D));
    float *h = (float *)buf;
    act_q8 a = {0};
    if (need_q8) act_q8_prepare(table, u, K, buf + align_up((size_t)M * 4), &a);
    const ffn_ctx c = {
        .gate = ffn_mat_of(table, gate_kind, q8_act, gate, gate_stride, K),
        .up = ffn_mat_of(table, up_kind, q8_act, up, up_stride, K),
        .idx = idx, .M = M, .K = K, .u = u, .a = &a, .act = act, .relu_up = relu_up != 0, .h = h,
        .down = {.w = down, .w_stride = down_stride, .idx = idx, .M = M, .D = D,
                 .unit_bytes = axpy_unit_bytes(down_kind), .h = h, .h_stride = M, .T = 1, .y = y, .y_stride = D,
                 .coef_bf16 = q8_act && type_coef_bf16(down_kind), .n_rows = N},
        .kind_down = down_kind,
        .units = axpy_units_for(level),
        .chains = malloc(axpy_chains_scratch(1, D, 0)),
    };
    if (c.chains == NULL) return PI_ERR_ALLOC;
    if (nt == 1) {
        ffn_phase1(&c, 0, M);
        ffn_phase2(&c, 0, 1);
    } else {
#pragma omp parallel num_threads(nt)
        {
            const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
            ffn_phase1(&c, M * me / all, M * (me + 1) / all);
#pragma omp barrier
            ffn_phase2(&c, me, all);
        }
    }
    free(c.chains);
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
        dot(rows, R, K, x, out + (n - n0), MATVEC_STREAM_AHEAD); /* dense rows: the float kinds stream */
    }
}

/* Scratch of pi_predict_ffn: z (rank floats), then the scores of the N neurons, which h later overwrites. */
/* the scores, h, then in the q8 precision the int8 blocks of x (fc1) and of u (gate, up) */
static size_t predict_ffn_scratch(int64_t N, int64_t K, int64_t rank, int q8) {
    return align_up((size_t)rank * 4) + align_up((size_t)N * 4) + (q8 ? 2 * act_q8_bytes(K) : 0);
}

/* Bytes of scratch pi_predict_ffn needs for N neurons of K inputs and a predictor of rank `rank` (q8_act: the int8
 * activation precision), the alignment slack included; -1 for negative sizes. */
PI_EXPORT int64_t pi_predict_ffn_scratch_bytes(int64_t N, int64_t K, int64_t rank, int32_t q8_act) {
    if (N < 0 || K < 0 || rank < 0) return -1;
    return (int64_t)(predict_ffn_scratch(N, K, rank, q8_act != 0) + PI_SCRATCH_ALIGN);
}

/* pi_predict_ffn(x, u, K, D, N, fc1, fc1_stride, fc1_kind, rank, fc2, fc2_stride, fc2_kind, threshold, gate, ...,
 *                up, ..., down_t, ..., act, relu_up, q8_act, idx, n_active, predictor_seconds, y, scratch,
 *                scratch_bytes, threads, isa):
 * PowerInfer's predicted sparse FFN of one token, every neuron on the CPU:
 *   s = fc2 . relu(fc1 . x),  idx = {n : s_n >= threshold} in increasing order (written to idx, count to
 *   *n_active),  y = ffn_rows(u, gate, up, down_t, idx, act).
 * Bit-identical to pi_matmul of fc1 in the precision q8_act, pi_matmul of fc2 with float activations (its rows are
 * short: the float several-rows dot), torch's relu and >= on float32, nonzero, then pi_ffn_rows with q8_act: the
 * same kernels, the same phases. With q8_act, fc1 must be a type whose q8 matmul is the int8 row tile or a float
 * type (not a K-quant: PI_ERR_SHAPE). idx must hold N entries. predictor_seconds (may be NULL) receives the wall
 * time until the active list was complete. scratch: at least pi_predict_ffn_scratch_bytes(N, K, rank, q8_act)
 * bytes, else PI_ERR_SCRATCH. */
PI_EXPORT int32_t pi_predict_ffn(const float *x, const float *u, int64_t K, int64_t D, int64_t N,
                                 const uint8_t *fc1, int64_t fc1_stride, int32_t fc1_kind, int64_t rank,
                                 const uint8_t *fc2, int64_t fc2_stride, int32_t fc2_kind, float threshold,
                                 const uint8_t *gate, int64_t gate_stride, int32_t gate_kind, const uint8_t *up,
                                 int64_t up_stride, int32_t up_kind, const uint8_t *down, int64_t down_stride,
                                 int32_t down_kind, int32_t act, int32_t relu_up, int32_t q8_act, int64_t *idx,
                                 int64_t *n_active, double *predictor_seconds, float *y, void *scratch, int64_t scratch_bytes,
                                 int32_t n_threads, int32_t isa) {
    const double t_start = omp_get_wtime();
    if (K < 0 || D < 0 || N < 0 || rank < 0 || idx == NULL || n_active == NULL) return PI_ERR_SHAPE;
    if (act < ACT_RELU || act > ACT_LAST || x == NULL || u == NULL || y == NULL) return PI_ERR_SHAPE;
    /* gate, up (N, K), down_t (N, D), fc1 (rank, K), fc2 (N, rank) */
    const int32_t kinds[5] = {gate_kind, up_kind, down_kind, fc1_kind, fc2_kind};
    const int64_t rows[5] = {N, N, N, rank, N}, lens[5] = {K, K, D, K, rank};
    const int64_t strides[5] = {gate_stride, up_stride, down_stride, fc1_stride, fc2_stride};
    const uint8_t *weights[5] = {gate, up, down, fc1, fc2};
    for (int i = 0; i < 5; i++)
        if (check_weight(kinds[i], rows[i], lens[i], weights[i], strides[i]) != PI_OK) return PI_ERR_SHAPE;
    const int q8 = q8_act != 0;
    if (q8 && kind_is_kq(fc1_kind)) return PI_ERR_SHAPE; /* its q8 matmul takes int8 super-blocks, not a row tile */
    uint8_t *buf;
    const int32_t status = scratch_take(scratch, scratch_bytes, predict_ffn_scratch(N, K, rank, q8), &buf);
    if (status != PI_OK) return status;
    const int32_t level = pi_isa_clamp(isa);
    const matmul_table *table = matmul_table_for(level);
    const ffn_mat m1 = ffn_mat_of(table, fc1_kind, q8, fc1, fc1_stride, K);
    const ffn_mat m2 = ffn_mat_of(table, fc2_kind, 0, fc2, fc2_stride, rank);
    const int32_t nt = threads_for_work(n_threads, N * (2 * K + D + rank));
    float *z = (float *)buf;
    float *h = (float *)(buf + align_up((size_t)rank * 4)); /* the scores first, then h of the active neurons */
    int64_t counts[PI_MAX_THREADS]; /* active neurons per thread */
    act_q8 a = {0}, ax = {0};
    if (q8) { /* x for fc1, u for gate and up, each quantised once (where their kinds read int8 blocks) */
        uint8_t *q = (uint8_t *)h + align_up((size_t)N * 4);
        if (m1.tq != NULL) {
            act_q8_prepare(table, x, K, q, &ax);
            ax.ahead = MATVEC_STREAM_AHEAD; /* fc1's rows are read in order */
        }
        if (kind_has_q8_tile(gate_kind) || kind_has_q8_tile(up_kind))
            act_q8_prepare(table, u, K, q + act_q8_bytes(K), &a);
    }
    ffn_ctx c = {
        .gate = ffn_mat_of(table, gate_kind, q8, gate, gate_stride, K),
        .up = ffn_mat_of(table, up_kind, q8, up, up_stride, K),
        .idx = idx, .M = 0, .K = K, .u = u, .a = &a, .act = act, .relu_up = relu_up != 0, .h = h,
        .down = {.w = down, .w_stride = down_stride, .idx = idx, .M = 0, .D = D,
                 .unit_bytes = axpy_unit_bytes(down_kind), .h = h, .h_stride = 0, .T = 1, .y = y, .y_stride = D,
                 .coef_bf16 = q8 && type_coef_bf16(down_kind), .n_rows = N},
        .kind_down = down_kind,
        .units = axpy_units_for(level),
        .chains = malloc(axpy_chains_scratch(1, D, 0)),
    };
    if (c.chains == NULL) return PI_ERR_ALLOC;
    double t_pred = 0.0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
        /* fc1 and relu over this thread's rank rows */
        const int64_t r0 = rank * me / all, r1 = rank * (me + 1) / all;
        if (m1.tq != NULL)
            for (int64_t r = r0; r < r1; r++) m1.tq(fc1 + r * fc1_stride, &ax, 0, 1, z + r);
        else
            dense_rows_range(m1.dot, fc1, fc1_stride, r0, r1, K, x, z + r0);
        for (int64_t r = r0; r < r1; r++) z[r] = relu_f(z[r]);
#pragma omp barrier
        /* fc2 and the threshold over this thread's neurons: scores into its slice of h, ids into its slice of idx */
        const int64_t n0 = N * me / all, n1 = N * (me + 1) / all;
        dense_rows_range(m2.dot, fc2, fc2_stride, n0, n1, rank, z, h + n0);
        int64_t n_here = 0;
        for (int64_t n = n0; n < n1; n++)
            if (h[n] >= threshold) idx[n0 + n_here++] = n;
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
        } /* implicit barrier: every score is read, h may be written */
        ffn_phase1(&c, c.M * me / all, c.M * (me + 1) / all);
#pragma omp barrier
        ffn_phase2(&c, me, all);
    }
    free(c.chains);
    *n_active = c.M;
    if (predictor_seconds != NULL) *predictor_seconds = t_pred;
    if (c.M == 0)
        for (int64_t e = 0; e < D; e++) y[e] = 0.0f;
    return PI_OK;
}

/* ---- CATS: dense gate, threshold on |act(gate)|, then only the active up and down rows ------------------------ */

/* pi_cats_ffn computes, for one token u (K,) over the candidate neurons cand[0..C) (NULL: all N rows, C == N):
 *   a_n = act(gate_n . u),  active = {n : |a_n| > thresholds[n]} in candidate order (written to idx, count to
 *   *n_active),  h_n = a_n * (relu(up_n . u) if relu_up else up_n . u),  y = sum_{n active} h_n down_t[n]
 * in one parallel region:
 * Gate: the candidates split in contiguous ranges over threads; each thread computes its gate rows (all rows:
 *   read in order and streamed as the dense matvec reads them, ffn_mat_matvec; a candidate list: the rows a few
 *   steps ahead prefetched) and keeps, in order, those passing the threshold.
 * Barrier; the per-thread lists compacted in thread (= candidate) order.
 * Up: the active list split evenly over threads, its up rows streamed as ffn_pass streams a row list.
 * Barrier; phase 2 sums the down rows exactly as pi_ffn_rows does.
 * So y equals rows_matmul(gate, cand), the activation, the mask, rows_matmul(up, idx), the gating and
 * rows_axpy(down_t, idx) bit for bit for ReLU (libm activations otherwise), and does not depend on the thread
 * count. A candidate list in increasing order gives idx in increasing order.
 * Two-stage selection (out_thresholds not NULL): the neurons passing the gate threshold have their up rows
 * read, and only those with |h_n| > out_thresholds[n] stay active (their down rows summed); *n_up receives the
 * count of up rows read. */
typedef struct {
    ffn_ctx c;        /* c.idx and c.h: the compacted active list and h; c.M its length */
    int gate_kind;
    const int64_t *cand; /* NULL: rows 0..C) */
    int64_t C;
    const float *thresholds; /* N entries, by row (a NaN never passes) */
    const float *out_thresholds; /* NULL, or N entries on |h| by row: the second stage */
    int dense;         /* every candidate active: thresholds and out_thresholds not read */
    int64_t *idx;      /* C entries: the active rows, per-thread slices before compaction */
    float *a;          /* C entries: gate, act(gate) then h of the active rows, per-thread slices before compaction */
} cats_ctx;

static inline int64_t cats_row(const cats_ctx *k, int64_t i) { return k->cand == NULL ? i : k->cand[i]; }

/* candidates [i0, i1) of this thread: the gate rows into a[i0..i1), then the threshold; returns the number
 * active, their rows at idx[i0..) and act(gate) at a[i0..) */
static int64_t cats_gate(const cats_ctx *k, int64_t i0, int64_t i1) {
    const ffn_ctx *c = &k->c;
    if (k->cand == NULL) {
        ffn_mat_matvec(&c->gate, k->gate_kind, c->a, c->u, c->K, i0, i1, k->a);
    } else {
        for (int64_t i = i0; i < i1; i += ROWS_DOT_MAX) {
            const int R = (int)min_i64(ROWS_DOT_MAX, i1 - i);
            const uint8_t *rows[ROWS_DOT_MAX];
            /* a candidate list skips rows: fetch ahead */
            for (int64_t j = i + 2 * ROWS_DOT_MAX; j < min_i64(i + 3 * ROWS_DOT_MAX, i1); j++)
                prefetch_bytes(c->gate.w + k->cand[j] * c->gate.stride, c->gate.row_bytes);
            for (int r = 0; r < R; r++) rows[r] = c->gate.w + k->cand[i + r] * c->gate.stride;
            ffn_dot(&c->gate, rows, R, c, k->a + i);
        }
    }
    int64_t n_act = 0; /* compacted in place: the write position never passes the read one */
    for (int64_t i = i0; i < i1; i++) {
        const float a = ffn_act(c->act, k->a[i]);
        const int64_t row = cats_row(k, i);
        if (!k->dense && !(fabsf(a) > k->thresholds[row])) continue;
        k->idx[i0 + n_act] = row;
        k->a[i0 + n_act++] = a;
    }
    return n_act;
}

/* Scratch of pi_cats_ffn over C candidates of K inputs: a/h (C floats), then the int8 activations (q8). */
static size_t cats_ffn_scratch(int64_t C, int64_t K, int q8) { return ffn_rows_scratch(C, K, q8); }

/* Bytes of scratch pi_cats_ffn needs for up to C candidate neurons of K inputs, the alignment slack included;
 * -1 for negative sizes. */
PI_EXPORT int64_t pi_cats_ffn_scratch_bytes(int64_t C, int64_t K, int32_t q8_act) {
    if (C < 0 || K < 0) return -1;
    return (int64_t)(cats_ffn_scratch(C, K, q8_act != 0) + PI_SCRATCH_ALIGN);
}

int32_t cats_ffn_run(const float *u, int64_t K, int64_t D, int64_t N, const uint8_t *gate, int64_t gate_stride,
                     int32_t gate_kind, const uint8_t *up, int64_t up_stride, int32_t up_kind, const uint8_t *down,
                     int64_t down_stride, int32_t down_kind, const int64_t *cand, int64_t C, const float *thresholds,
                     const float *out_thresholds, int dense, int32_t act, int32_t relu_up, int32_t q8_act, int64_t *idx,
                     int64_t *n_active, int64_t *n_up, float *y, void *scratch, int64_t scratch_bytes,
                     int32_t n_threads, int32_t isa) {
    if (K < 0 || D < 0 || N < 0 || C < 0 || act < ACT_RELU || act > ACT_LAST) return PI_ERR_SHAPE;
    if (y == NULL || n_active == NULL || (C > 0 && (u == NULL || idx == NULL || (!dense && thresholds == NULL))))
        return PI_ERR_SHAPE;
    const int32_t kinds[3] = {gate_kind, up_kind, down_kind};
    const int64_t lens[3] = {K, K, D}, strides[3] = {gate_stride, up_stride, down_stride};
    const uint8_t *weights[3] = {gate, up, down};
    for (int i = 0; i < 3; i++)
        if (check_weight(kinds[i], N, lens[i], weights[i], strides[i]) != PI_OK) return PI_ERR_SHAPE;
    *n_active = 0;
    if (n_up != NULL) *n_up = 0;
    if (C == 0) { /* cand may be NULL (an empty tensor has no data) */
        for (int64_t e = 0; e < D; e++) y[e] = 0.0f;
        return PI_OK;
    }
    if (cand == NULL && C != N) return PI_ERR_SHAPE;
    int32_t status = cand == NULL ? PI_OK : check_ids(cand, C, N);
    if (status != PI_OK) return status;
    const int need_q8 = q8_act && (kind_has_q8_tile(gate_kind) || kind_has_q8_tile(up_kind));
    uint8_t *buf;
    status = scratch_take(scratch, scratch_bytes, cats_ffn_scratch(C, K, need_q8), &buf);
    if (status != PI_OK) return status;
    const int32_t level = pi_isa_clamp(isa);
    const matmul_table *table = matmul_table_for(level);
    const int32_t nt = threads_for_work(n_threads, C * (2 * K + D));
    float *a_buf = (float *)buf;
    act_q8 aq = {0};
    if (need_q8) act_q8_prepare(table, u, K, buf + align_up((size_t)C * 4), &aq);
    int64_t counts[PI_MAX_THREADS]; /* active neurons per thread */
    int64_t up_total = 0;
    cats_ctx k = {
        .c = {
            .gate = ffn_mat_of(table, gate_kind, q8_act, gate, gate_stride, K),
            .up = ffn_mat_of(table, up_kind, q8_act, up, up_stride, K),
            .idx = idx, .M = 0, .K = K, .u = u, .a = &aq, .act = act, .relu_up = relu_up != 0, .h_is_act = 1,
            .h = a_buf,
            .down = {.w = down, .w_stride = down_stride, .idx = idx, .M = 0, .D = D,
                     .unit_bytes = axpy_unit_bytes(down_kind), .h = a_buf, .h_stride = 0, .T = 1, .y = y,
                     .y_stride = D, .coef_bf16 = q8_act && type_coef_bf16(down_kind), .n_rows = N},
            .kind_down = down_kind,
            .units = axpy_units_for(level),
            .chains = malloc(axpy_chains_scratch(1, D, 0)),
        },
        .gate_kind = gate_kind, .cand = cand, .C = C, .thresholds = thresholds,
        .out_thresholds = dense ? NULL : out_thresholds, .dense = dense != 0, .idx = idx, .a = a_buf,
    };
    if (k.c.chains == NULL) return PI_ERR_ALLOC;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
        counts[me] = cats_gate(&k, C * me / all, C * (me + 1) / all);
#pragma omp barrier
#pragma omp single
        {
            /* compact the per-thread slices in thread (= candidate) order */
            int64_t M = counts[0];
            for (int64_t t = 1; t < all; t++) {
                const int64_t src = C * t / all;
                memmove(idx + M, idx + src, (size_t)counts[t] * sizeof(int64_t));
                memmove(a_buf + M, a_buf + src, (size_t)counts[t] * sizeof(float));
                M += counts[t];
            }
            k.c.M = M;
            up_total = M;
        } /* implicit barrier */
        const int64_t M = k.c.M;
        ffn_pass(&k.c, 1, M * me / all, M * (me + 1) / all);
#pragma omp barrier
#pragma omp single
        {
            int64_t kept = M;
            if (k.out_thresholds != NULL) { /* second stage: keep the neurons whose |h| passes, in order */
                kept = 0;
                for (int64_t m = 0; m < M; m++) {
                    const int64_t row = idx[m];
                    const float h = a_buf[m];
                    if (!(fabsf(h) > k.out_thresholds[row])) continue;
                    idx[kept] = row;
                    a_buf[kept++] = h;
                }
            }
            k.c.M = kept;
            k.c.down.M = kept;
            k.c.down.h_stride = kept;
        } /* implicit barrier */
        ffn_phase2(&k.c, me, all);
    }
    free(k.c.chains);
    *n_active = k.c.M;
    if (n_up != NULL) *n_up = up_total;
    if (k.c.M == 0)
        for (int64_t e = 0; e < D; e++) y[e] = 0.0f;
    return PI_OK;
}

/* pi_cats_ffn(u, K, D, N, gate, gate_stride, gate_kind, up, up_stride, up_kind, down_t, down_stride, down_kind,
 *             cand, C, thresholds, out_thresholds, act, relu_up, q8_act, idx, n_active, n_up, y, scratch,
 *             scratch_bytes, threads, isa):
 * as described above; kinds and act as for pi_ffn_rows; thresholds: N floats, one per row; out_thresholds: NULL
 * (one stage) or N floats; n_up may be NULL; cand: C candidate rows in [0, N) (NULL: all rows, C must equal N);
 * idx must hold C entries. scratch: at least pi_cats_ffn_scratch_bytes(C, K, q8_act) bytes, else
 * PI_ERR_SCRATCH. */
PI_EXPORT int32_t pi_cats_ffn(const float *u, int64_t K, int64_t D, int64_t N, const uint8_t *gate,
                              int64_t gate_stride, int32_t gate_kind, const uint8_t *up, int64_t up_stride,
                              int32_t up_kind, const uint8_t *down, int64_t down_stride, int32_t down_kind,
                              const int64_t *cand, int64_t C, const float *thresholds, const float *out_thresholds,
                              int32_t act, int32_t relu_up, int32_t q8_act, int64_t *idx, int64_t *n_active,
                              int64_t *n_up, float *y, void *scratch, int64_t scratch_bytes, int32_t n_threads,
                              int32_t isa) {
    return cats_ffn_run(u, K, D, N, gate, gate_stride, gate_kind, up, up_stride, up_kind, down, down_stride,
                        down_kind, cand, C, thresholds, out_thresholds, 0, act, relu_up, q8_act, idx, n_active, n_up,
                        y, scratch, scratch_bytes, n_threads, isa);
}
