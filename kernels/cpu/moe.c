/* The experts of a mixture-of-experts FFN for one token, in one call and one parallel region:
 *
 *   pi_moe_experts: y += sum_j w_j * down_{e_j} . (act(gate_{e_j} . n) * up_{e_j} . n), j = 0 .. k - 1 in order
 *
 * over the stacked expert tensors as ggml files store them (gate and up (n_expert * n_ff, n_embd), down
 * (n_expert * n_embd, n_ff)): only the k selected experts' rows are read. The gate and up rows of all k experts are
 * one list of k * n_ff neurons split over the team in contiguous ranges (a neuron's gate and up rows on one thread,
 * so h needs no barrier), then each expert's h is prepared for its down rows, then each thread takes a contiguous
 * range of the n_embd outputs of every expert and sums the k products with the routing weights in expert order.
 * ReGLU experts (sparse) read the up row of a neuron only where its gate is > 0 (h = 0 elsewhere: exact), all the
 * up rows of a chunk of neurons as one stream where at least MOE_DENSE_NUM / MOE_DENSE_DEN of its gates are.
 * With CATS thresholds the same machinery reads the up rows of the neurons with |act(gate)| > their expert's
 * threshold (h = 0 elsewhere: an approximation the thresholds were calibrated for; a chunk's up rows as one stream
 * only where all its neurons are active, so an inactive neuron's up row is never read). The down matrices are stored
 * (n_expert * n_embd, n_ff), a zero h cannot skip a row of them: down stays a dense product over h, zeros and all.
 *
 * Every product is the arithmetic of pi_matmul_<type> at T = 1 in the chosen precision (the helpers of sparse.h
 * and matmul.h the fused blocks of layer.c use), the activation pi_gated's, and the sum is torch's
 * `out += y_j * w_j` from zero in expert order: the bits of the per-expert matmuls the prompt path groups
 * (powerinfer/model/moe.py), whatever the thread count.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "sparse.h"

/* One stacked weight: n_rows rows of n_cols elements of `kind` (enum pi_type, a ggml type id), stride bytes apart (the layout
 * of layer.c's pi_mat; the ctypes mirror is powerinfer/ops/layer.py's _Mat). */
typedef struct {
    const uint8_t *w;
    int64_t stride;
    int64_t n_rows;
    int64_t n_cols;
    int32_t kind;
    int32_t reserved;
} pi_moe_mat;

/* The experts of a layer and, for the whole block (pi_moe_ffn_block), its norm and router: the ctypes mirror is
 * powerinfer/ops/moe.py */
typedef struct {
    int64_t n_embd, n_ff, n_expert;
    int32_t act, sparse; /* act: enum ffn_act; sparse: ReGLU, up rows of neurons whose gate is <= 0 not read */
    pi_moe_mat gate, up, down;
    /* the block: RMSNorm weight (n_embd) and eps, router (n_expert, n_embd), k experts per token, the gating (0
     * softmax, 1 sigmoid), the renormalisation of the top-k weights and their scale (pi_moe_route) */
    const float *norm;
    float eps, weights_scale;
    pi_moe_mat router;
    int64_t n_used;
    int32_t gating, norm_weights;
    /* NULL, or where each expert's rows start when the experts live apart from the stacked tensors (a bounded
     * cache of them, powerinfer/runtime/expert_store.py): 3 * n_expert pointers, the gate rows of expert e at
     * [e], its up rows at [n_expert + e], its down rows at [2 n_expert + e] (rows `stride` bytes apart as in the
     * stack); NULL for an expert not resident, which no call may select */
    const uint8_t *const *experts;
    /* CATS (`powerinfer sparsify` on MoE files): thresholds (n_expert, n_ff) or NULL; a neuron n of expert e is
     * active where |act(gate_n . x)| > thresholds[e * n_ff + n], else h_n = 0 and its up row is not read (the
     * one-token kernel; the grouped one computes it and drops it: the same h). counts (3 int64, or NULL): the
     * one-token kernel adds (active neurons, up rows read, neurons) of the selected experts to it. */
    const float *thresholds;
    int64_t *counts;
} pi_moe_desc;

/* Where expert e's rows of matrix m (0 gate, 1 up, 2 down) start. */
static inline const uint8_t *moe_expert_w(const pi_moe_desc *d, int m, int64_t e) {
    if (d->experts != NULL) return d->experts[m * d->n_expert + e];
    const pi_moe_mat *w = m == 0 ? &d->gate : m == 1 ? &d->up : &d->down;
    return w->w + e * (m == 2 ? d->n_embd : d->n_ff) * w->stride;
}

/* Every expert `ids` selects (n of them, -1: none) has its rows: PI_OK, else PI_ERR_INDEX. */
static int32_t moe_experts_resident(const pi_moe_desc *d, const int64_t *ids, int64_t n) {
    if (d->experts == NULL) return PI_OK;
    for (int64_t j = 0; j < n; j++)
        if (ids[j] >= 0 && (moe_expert_w(d, 0, ids[j]) == NULL || moe_expert_w(d, 1, ids[j]) == NULL ||
                            moe_expert_w(d, 2, ids[j]) == NULL))
            return PI_ERR_INDEX;
    return PI_OK;
}

/* pi_rms_norm (layer.c) */
int32_t pi_rms_norm(const float *x, int64_t T, int64_t D, int64_t x_stride, const float *w, float eps, float *out,
                    int64_t out_stride);

#define MOE_MAX_EXPERTS (1 << 16)
#define MOE_ROUTE_MAX_EXPERTS 4096
#define MOE_CHUNK 256     /* ReGLU: gate values scanned per list of active neurons */
#define MOE_ROWS_AHEAD 2  /* ReGLU: rows of that list prefetched ahead */
#define MOE_DENSE_NUM 3   /* ReGLU: a chunk with at least NUM / DEN of its gates positive reads all its up rows */
#define MOE_DENSE_DEN 8
#define MOE_MAX_DIM (1LL << 30)

static size_t moe_input_bytes(int64_t K) { return act_q8_bytes(K) + kq8_act_bytes(K); }

static size_t moe_scratch(int64_t E, int64_t F, int64_t k) {
    return moe_input_bytes(E) + align_up((size_t)(k * F) * 4) * 2 + align_up((size_t)(k * E) * 4) +
           (size_t)k * moe_input_bytes(F) + align_up((size_t)k * sizeof(act_q8)) +
           align_up((size_t)k * sizeof(act_q8k));
}

/* Bytes of scratch pi_moe_experts needs for k selected experts, the alignment slack included; -1 for bad sizes. */
PI_EXPORT int64_t pi_moe_experts_scratch_bytes(int64_t n_embd, int64_t n_ff, int64_t k) {
    if (n_embd <= 0 || n_ff <= 0 || k <= 0 || n_embd > MOE_MAX_DIM || n_ff > MOE_MAX_DIM || k > MOE_MAX_EXPERTS)
        return -1;
    return (int64_t)(moe_scratch(n_embd, n_ff, k) + PI_SCRATCH_ALIGN);
}

/* x (K) prepared in buf (moe_input_bytes(K)) for matrices of kinds ka and kb in the precision q8 */
static void moe_prepare(const matmul_table *t, int32_t level, int ka, int kb, int q8, const float *x, int64_t K,
                        uint8_t *buf, act_q8 *a, act_q8k *ak) {
    if (q8 && (kind_has_q8_tile(ka) || kind_has_q8_tile(kb))) act_q8_prepare(t, x, K, buf, a);
    if (q8 && (kind_is_kq(ka) || kind_is_kq(kb))) kq8_act_prepare(level, x, K, buf + act_q8_bytes(K), ak);
}

/* y[n] = row n of the matrix at w (rows stride bytes apart, K columns of `kind`) . x for n in [n0, n1): as
 * pi_matmul_<type> computes row n at T = 1 in the precision q8 (layer.c's mv_rows) */
static void moe_rows(const matmul_table *t, int32_t level, int kind, const uint8_t *w, int64_t stride, int64_t K,
                     int q8, const act_q8 *a, const act_q8k *ak, const float *x, int64_t n0, int64_t n1, float *y) {
    if (n0 >= n1) return;
    if (q8 && kind_is_kq(kind)) {
        kq8_rows(level, kind, w + n0 * stride, stride, n1 - n0, ak, y + n0);
        return;
    }
    const ffn_mat f = ffn_mat_of(t, kind, q8, w, stride, K);
    ffn_mat_matvec(&f, kind, a, x, K, n0, n1, y);
}

/* rows [n0, n1) of two matrices of K columns: m1's at w1 times x1 (a1, ak1) into y1, m2's at w2 times x2 into y2:
 * moe_rows on each, the two read side by side where one kernel takes both (a one-token rows kernel of their common
 * kind: the same bits; two streams of rows in flight instead of one). An expert's gate and up rows (one input):
 * measured 13.1-13.5 -> 11.8-12.2 ms a token for the experts of the Qwen3-MoE-shaped bench file, -t 1; two
 * experts' down rows (their own inputs) the same way. */
static void moe_rows_pair(const matmul_table *t, int32_t level, const pi_moe_mat *m1, const uint8_t *w1,
                          const pi_moe_mat *m2, const uint8_t *w2, int64_t K, int q8, const act_q8 *a1,
                          const act_q8k *ak1, const float *x1, const act_q8 *a2, const act_q8k *ak2, const float *x2,
                          int64_t n0, int64_t n1, float *y1, float *y2) {
    if (n0 >= n1) return;
    if (q8 && m1->kind == m2->kind && !kind_is_kq(m1->kind)) {
        const ffn_mat f = ffn_mat_of(t, m1->kind, q8, w1, m1->stride, K);
        if (f.rows != NULL) {
            act_q8 b1 = *a1, b2 = *a2;
            b1.ahead = b2.ahead = MATVEC_STREAM_AHEAD;
            f.rows(w1 + n0 * m1->stride, m1->stride, w2 + n0 * m2->stride, m2->stride, n1 - n0, &b1,
                   a2 == a1 ? NULL : &b2, y1 + n0, y2 + n0);
            return;
        }
    }
    moe_rows(t, level, m1->kind, w1, m1->stride, K, q8, a1, ak1, x1, n0, n1, y1);
    moe_rows(t, level, m2->kind, w2, m2->stride, K, q8, a2, ak2, x2, n0, n1, y2);
}

static int moe_mat_ok(const pi_moe_mat *m, int64_t n_rows, int64_t n_cols) {
    if (m->n_rows != n_rows || m->n_cols != n_cols || n_rows <= 0 || n_cols <= 0) return 0;
    return check_weight(m->kind, m->n_rows, m->n_cols, m->w, m->stride) == PI_OK;
}

/* pi_moe_experts(desc, xn, ids, weights, k, y, scratch, scratch_bytes, q8, threads, isa): y (n_embd) += the sum
 * above for the token's normed FFN input xn (n_embd), its k experts ids (in the order their products are added)
 * and routing weights; scratch: at least pi_moe_experts_scratch_bytes(n_embd, n_ff, k) bytes. */
PI_EXPORT int32_t pi_moe_experts(const pi_moe_desc *d, const float *xn, const int64_t *ids, const float *weights,
                                 int64_t k, float *y, void *scratch, int64_t scratch_bytes, int32_t q8,
                                 int32_t n_threads, int32_t isa) {
    if (d == NULL || xn == NULL || ids == NULL || weights == NULL || y == NULL) return PI_ERR_SHAPE;
    const int64_t E = d->n_embd, F = d->n_ff, NE = d->n_expert;
    if (E <= 0 || F <= 0 || E > MOE_MAX_DIM || F > MOE_MAX_DIM || NE <= 0 || NE > MOE_MAX_EXPERTS || k <= 0 ||
        k > NE || d->act < ACT_RELU || d->act > ACT_LAST)
        return PI_ERR_SHAPE;
    if (!moe_mat_ok(&d->gate, NE * F, E) || !moe_mat_ok(&d->up, NE * F, E) || !moe_mat_ok(&d->down, NE * E, F))
        return PI_ERR_SHAPE;
    for (int64_t j = 0; j < k; j++)
        if (ids[j] < 0 || ids[j] >= NE) return PI_ERR_INDEX;
    if (moe_experts_resident(d, ids, k) != PI_OK) return PI_ERR_INDEX;
    uint8_t *buf;
    int32_t status = scratch_take(scratch, scratch_bytes, moe_scratch(E, F, k), &buf);
    if (status != PI_OK) return status;
    uint8_t *prep_x = buf;
    float *g = (float *)(buf + moe_input_bytes(E));
    float *u = (float *)((uint8_t *)g + align_up((size_t)(k * F) * 4));
    float *yb = (float *)((uint8_t *)u + align_up((size_t)(k * F) * 4));
    uint8_t *prep_h = (uint8_t *)yb + align_up((size_t)(k * E) * 4);
    act_q8 *ha = (act_q8 *)(prep_h + (size_t)k * moe_input_bytes(F));
    act_q8k *hak = (act_q8k *)((uint8_t *)ha + align_up((size_t)k * sizeof(act_q8)));

    const int32_t level = pi_isa_clamp(isa);
    const matmul_table *t = matmul_table_for(level);
    const pi_moe_mat *gm = &d->gate, *um = &d->up, *dm = &d->down;
    const int act = d->act, sparse = d->sparse != 0 || d->thresholds != NULL;
    const float *thr = d->thresholds;
    const int32_t nt = threads_for_work(n_threads, 3 * k * F * E);
    act_q8 xa = {0};
    act_q8k xak = {0};
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
#pragma omp single
        moe_prepare(t, level, gm->kind, um->kind, q8, xn, E, prep_x, &xa, &xak);
        /* this thread's neurons of the k * F, each with its gate and up rows */
        const int64_t total = k * F, r0 = total * me / all, r1 = total * (me + 1) / all;
        int64_t n_active = 0, n_read = 0;
        for (int64_t j = r0 / F; j < k && j * F < r1; j++) {
            const int64_t lo = r0 > j * F ? r0 - j * F : 0, hi = r1 < (j + 1) * F ? r1 - j * F : F;
            const uint8_t *gw = moe_expert_w(d, 0, ids[j]), *uw = moe_expert_w(d, 1, ids[j]);
            float *gj = g + j * F, *uj = u + j * F;
            if (!sparse) { /* every up row: read beside its gate row */
                moe_rows_pair(t, level, gm, gw, um, uw, E, q8, &xa, &xak, xn, &xa, &xak, xn, lo, hi, gj, uj);
                for (int64_t n = lo; n < hi; n++) gj[n] = ffn_act(act, gj[n]) * uj[n];
                n_active += hi - lo;
                n_read += hi - lo;
                continue;
            }
            moe_rows(t, level, gm->kind, gw, gm->stride, E, q8, &xa, &xak, xn, lo, hi, gj);
            {
                /* the up rows of the active neurons (ReGLU: a positive gate; CATS: |act(gate)| above the threshold,
                 * gj then holding act(gate)), a chunk of them at a time: the int8-tile kinds prefetch each row
                 * MOE_ROWS_AHEAD rows of the list ahead (not the stream after it: the rows between are not read),
                 * the others row by row as moe_rows computes them */
                const ffn_mat f = ffn_mat_of(t, um->kind, q8, uw, um->stride, E);
                act_q8 al = xa;
                al.ahead = 0;
                for (int64_t c0 = lo; c0 < hi; c0 += MOE_CHUNK) {
                    const int64_t c1 = min_i64(c0 + MOE_CHUNK, hi);
                    int64_t act[MOE_CHUNK], m = 0;
                    if (thr != NULL) {
                        const float *tj = thr + ids[j] * F;
                        for (int64_t n = c0; n < c1; n++) {
                            const float a = ffn_act(d->act, gj[n]);
                            const int on = fabsf(a) > tj[n];
                            gj[n] = on ? a : 0.0f;
                            if (on) act[m++] = n;
                        }
                    } else {
                        for (int64_t n = c0; n < c1; n++) {
                            if (gj[n] > 0.0f) act[m++] = n;
                            else gj[n] = 0.0f;
                        }
                    }
                    n_active += m;
                    /* CATS streams a chunk only when every neuron of it is active: an inactive neuron's up row is
                     * never read (ReGLU: the measured rule below) */
                    if (thr != NULL ? m == c1 - c0 : m * MOE_DENSE_DEN >= MOE_DENSE_NUM * (c1 - c0)) {
                        n_read += c1 - c0;
                        /* most rows active: all the chunk's up rows as one stream (a row list costs about as much
                         * to read, the hardware prefetchers fetching the gaps), the inactive products unused (the
                         * same values: an active row's product is the same bits either way; measured, 24 MoE
                         * blocks of the SmallThinker-shaped bench file, ~50% active, best of 60 on 2 busy cores:
                         * 9.39 -> 9.12 ms at -t 1, 10.19 -> 9.81 ms at -t 2) */
                        moe_rows(t, level, um->kind, uw, um->stride, E, q8, &xa, &xak, xn, c0, c1, uj);
                        for (int64_t i = 0; i < m; i++) {
                            const int64_t n = act[i];
                            gj[n] = (thr != NULL ? gj[n] : relu_f(gj[n])) * uj[n];
                        }
                        continue;
                    }
                    n_read += m;
                    for (int64_t i = 0; i < m; i++) {
                        const int64_t n = act[i];
                        if (f.tq != NULL) {
                            if (i + MOE_ROWS_AHEAD < m) prefetch_bytes(uw + act[i + MOE_ROWS_AHEAD] * um->stride, f.row_bytes);
                            f.tq(uw + n * um->stride, &al, 0, 1, uj + n);
                        } else {
                            moe_rows(t, level, um->kind, uw, um->stride, E, q8, &xa, &xak, xn, n, n + 1, uj);
                        }
                        gj[n] = (thr != NULL ? gj[n] : relu_f(gj[n])) * uj[n];
                    }
                }
            }
        }
        if (d->counts != NULL) {
#pragma omp atomic
            d->counts[0] += n_active;
#pragma omp atomic
            d->counts[1] += n_read;
#pragma omp atomic
            d->counts[2] += r1 - r0;
        }
#pragma omp barrier
        for (int64_t j = me; j < k; j += all)
            moe_prepare(t, level, dm->kind, dm->kind, q8, g + j * F, F, prep_h + j * moe_input_bytes(F), &ha[j],
                        &hak[j]);
#pragma omp barrier
        const int64_t e0 = E * me / all, e1 = E * (me + 1) / all;
        for (int64_t j = 0; j + 1 < k; j += 2) /* two experts' down rows side by side */
            moe_rows_pair(t, level, dm, moe_expert_w(d, 2, ids[j]), dm, moe_expert_w(d, 2, ids[j + 1]), F, q8, &ha[j],
                          &hak[j], g + j * F, &ha[j + 1], &hak[j + 1], g + (j + 1) * F, e0, e1, yb + j * E,
                          yb + (j + 1) * E);
        if (k % 2 != 0)
            moe_rows(t, level, dm->kind, moe_expert_w(d, 2, ids[k - 1]), dm->stride, F, q8, &ha[k - 1], &hak[k - 1],
                     g + (k - 1) * F, e0, e1, yb + (k - 1) * E);
        for (int64_t n = e0; n < e1; n++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++) acc += yb[j * E + n] * weights[j];
            y[n] += acc;
        }
    }
    return PI_OK;
}

/* ---- routing ------------------------------------------------------------------------------------------------------ */

/* One token's router logits (n) -> its k experts in increasing id order and their weights: probabilities (softmax:
 * exp(l - max) / their sum, summed in index order; sigmoid: 1 / (1 + exp(-l))), the k largest (ties: the lower id),
 * divided by their sum (largest first) when norm, times scale when scale != 1. probs: n floats of scratch;
 * n <= MOE_ROUTE_MAX_EXPERTS. */
static void moe_route_row(const float *logits, int64_t n, int64_t k, int gating, int norm, float scale, float *probs,
                          int64_t *ids, float *w) {
    if (gating == 0) {
        float m = logits[0];
        for (int64_t i = 1; i < n; i++) m = logits[i] > m ? logits[i] : m;
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            probs[i] = expf(logits[i] - m);
            sum += probs[i];
        }
        for (int64_t i = 0; i < n; i++) probs[i] = probs[i] / sum;
    } else {
        for (int64_t i = 0; i < n; i++) probs[i] = 1.0f / (1.0f + expf(-logits[i]));
    }
    unsigned char taken[MOE_ROUTE_MAX_EXPERTS];
    memset(taken, 0, (size_t)n);
    for (int64_t j = 0; j < k; j++) { /* selection: the largest not yet taken (NaN never wins over a number) */
        int64_t best = -1;
        for (int64_t i = 0; i < n; i++)
            if (!taken[i] && (best < 0 || probs[i] > probs[best])) best = i;
        taken[best] = 1;
        ids[j] = best;
        w[j] = probs[best];
    }
    if (norm) {
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) sum += w[j];
        for (int64_t j = 0; j < k; j++) w[j] = w[j] / sum;
    }
    if (scale != 1.0f)
        for (int64_t j = 0; j < k; j++) w[j] = w[j] * scale;
    for (int64_t j = 1; j < k; j++) { /* insertion sort by id, the weights along */
        const int64_t id = ids[j];
        const float wj = w[j];
        int64_t q = j - 1;
        for (; q >= 0 && ids[q] > id; q--) {
            ids[q + 1] = ids[q];
            w[q + 1] = w[q];
        }
        ids[q + 1] = id;
        w[q + 1] = wj;
    }
}

/* pi_moe_route(logits, T, n, k, gating, norm, scale, ids, weights): each of T rows of n router logits -> k expert ids
 * (T, k) int64 in increasing order and their weights (T, k) float32, as moe_route_row; the decode block routes with
 * the same function, so a token's experts and weights do not depend on how it is batched. */
PI_EXPORT int32_t pi_moe_route(const float *logits, int64_t T, int64_t n, int64_t k, int32_t gating, int32_t norm,
                               float scale, int64_t *ids, float *weights) {
    if (T < 0 || n <= 0 || n > MOE_ROUTE_MAX_EXPERTS || k <= 0 || k > n || gating < 0 || gating > 1) return PI_ERR_SHAPE;
    if (T > 0 && (logits == NULL || ids == NULL || weights == NULL)) return PI_ERR_SHAPE;
    float probs[MOE_ROUTE_MAX_EXPERTS];
    for (int64_t t = 0; t < T; t++)
        moe_route_row(logits + t * n, n, k, gating, norm != 0, scale, probs, ids + t * k, weights + t * k);
    return PI_OK;
}

/* ---- the whole block ---------------------------------------------------------------------------------------------- */

static size_t moe_block_scratch(int64_t E, int64_t NE, int64_t F, int64_t k) {
    return align_up((size_t)E * 4) + align_up((size_t)NE * 4) * 2 + align_up((size_t)k * 8) + align_up((size_t)k * 4) +
           moe_input_bytes(E) + moe_scratch(E, F, k) + PI_SCRATCH_ALIGN;
}

/* Bytes of scratch pi_moe_ffn_block needs, the alignment slack included; -1 for bad sizes. */
PI_EXPORT int64_t pi_moe_ffn_block_scratch_bytes(int64_t n_embd, int64_t n_expert, int64_t n_ff, int64_t k) {
    if (n_embd <= 0 || n_ff <= 0 || k <= 0 || n_expert < k || n_embd > MOE_MAX_DIM || n_ff > MOE_MAX_DIM ||
        n_expert > MOE_ROUTE_MAX_EXPERTS)
        return -1;
    return (int64_t)(moe_block_scratch(n_embd, n_expert, n_ff, k) + PI_SCRATCH_ALIGN);
}

/* pi_moe_ffn_block(desc, x, logits, ids_out, scratch, scratch_bytes, q8, threads, isa): one token's MoE FFN block,
 * x (n_embd) += pi_moe_experts(n, pi_moe_route(logits)), n = rmsnorm(x) * norm (pi_rms_norm's), logits = router . n
 * (pi_matmul's row products) unless given (n_expert floats: a router that reads the layer input); ids_out (k, may be
 * NULL) takes the experts chosen. The bits of rms_norm, linear, route, the experts and a float add one by one. */
PI_EXPORT int32_t pi_moe_ffn_block(const pi_moe_desc *d, float *x, const float *logits, int64_t *ids_out,
                                   void *scratch, int64_t scratch_bytes, int32_t q8, int32_t n_threads, int32_t isa) {
    if (d == NULL || x == NULL || d->norm == NULL) return PI_ERR_SHAPE;
    const int64_t E = d->n_embd, NE = d->n_expert, F = d->n_ff, k = d->n_used;
    if (E <= 0 || F <= 0 || E > MOE_MAX_DIM || F > MOE_MAX_DIM || NE <= 0 || NE > MOE_ROUTE_MAX_EXPERTS || k <= 0 ||
        k > NE || d->gating < 0 || d->gating > 1)
        return PI_ERR_SHAPE;
    if (logits == NULL && !moe_mat_ok(&d->router, NE, E)) return PI_ERR_SHAPE;
    uint8_t *buf;
    int32_t status = scratch_take(scratch, scratch_bytes, moe_block_scratch(E, NE, F, k), &buf);
    if (status != PI_OK) return status;
    float *xn = (float *)buf;
    float *lg = (float *)(buf + align_up((size_t)E * 4));
    float *probs = (float *)((uint8_t *)lg + align_up((size_t)NE * 4));
    int64_t *ids = (int64_t *)((uint8_t *)probs + align_up((size_t)NE * 4));
    float *w = (float *)((uint8_t *)ids + align_up((size_t)k * 8));
    uint8_t *prep = (uint8_t *)w + align_up((size_t)k * 4);
    uint8_t *rest = prep + moe_input_bytes(E);
    const int64_t rest_bytes = scratch_bytes - (int64_t)(rest - (uint8_t *)scratch);
    pi_rms_norm(x, 1, E, E, d->norm, d->eps, xn, E);
    if (logits == NULL) {
        const int32_t level = pi_isa_clamp(isa);
        const matmul_table *t = matmul_table_for(level);
        act_q8 a = {0};
        act_q8k ak = {0};
        moe_prepare(t, level, d->router.kind, d->router.kind, q8, xn, E, prep, &a, &ak);
        moe_rows(t, level, d->router.kind, d->router.w, d->router.stride, E, q8, &a, &ak, xn, 0, NE, lg);
        logits = lg;
    }
    moe_route_row(logits, NE, k, d->gating, d->norm_weights != 0, d->weights_scale, probs, ids, w);
    if (ids_out != NULL) memcpy(ids_out, ids, (size_t)k * sizeof(int64_t));
    return pi_moe_experts(d, xn, ids, w, k, x, rest, rest_bytes, q8, n_threads, isa);
}

/* ---- a prompt's tokens grouped by expert -------------------------------------------------------------------------- */

/* a pi_matmul_<type> kernel (matmul.c) */
typedef int32_t (*moe_matmul_fn)(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, const float *x,
                                 int64_t x_stride, int64_t T, float *y, int64_t y_stride, int32_t n_threads,
                                 int32_t isa);

/* pi_grouped_matmul(matmul, w, w_stride, n_rows, K, n_expert, x, N, experts, counts, n_groups, y, threads, isa):
 * group g, rows start_g .. start_g + counts[g] of x (N, K) (the groups one after the other), times expert
 * experts[g]'s n_rows x K matrix of the stack w (n_expert * n_rows rows, w_stride bytes apart) into the same rows of
 * y (N, n_rows), with `matmul` (a pi_matmul_<type> of the stack's type): each group is one call of it on one
 * thread, the groups shared by the team (dynamic, larger ones first), so the result is `matmul` called group by
 * group at any thread count, in one parallel region. */
PI_EXPORT int32_t pi_grouped_matmul(const void *matmul, const uint8_t *w, int64_t w_stride, int64_t n_rows, int64_t K,
                                    int64_t n_expert, const float *x, int64_t N, const int64_t *experts,
                                    const int64_t *counts, int64_t n_groups, float *y, int32_t n_threads,
                                    int32_t isa) {
    if (matmul == NULL || w == NULL || n_rows <= 0 || K <= 0 || n_expert <= 0 || N < 0 || n_groups < 0 ||
        n_groups > MOE_MAX_EXPERTS || (n_groups > 0 && (experts == NULL || counts == NULL)) ||
        (N > 0 && (x == NULL || y == NULL)))
        return PI_ERR_SHAPE;
    int64_t total = 0;
    for (int64_t g = 0; g < n_groups; g++) {
        if (experts[g] < 0 || experts[g] >= n_expert) return PI_ERR_INDEX;
        if (counts[g] < 0 || counts[g] > N - total) return PI_ERR_SHAPE;
        total += counts[g];
    }
    if (total != N) return PI_ERR_SHAPE;
    int64_t *start = malloc((size_t)(2 * n_groups + 1) * sizeof(int64_t));
    if (start == NULL) return PI_ERR_ALLOC;
    int64_t *order = start + n_groups + 1;
    start[0] = 0;
    for (int64_t g = 0; g < n_groups; g++) {
        start[g + 1] = start[g] + counts[g];
        order[g] = g;
    }
    for (int64_t i = 1; i < n_groups; i++) { /* larger groups first: the team ends together */
        const int64_t g = order[i];
        int64_t j = i - 1;
        for (; j >= 0 && counts[order[j]] < counts[g]; j--) order[j + 1] = order[j];
        order[j + 1] = g;
    }
    const moe_matmul_fn fn = (moe_matmul_fn)matmul;
    int32_t nt = threads_for_work(n_threads, N * n_rows * K);
    if (nt > n_groups) nt = (int32_t)(n_groups > 0 ? n_groups : 1);
    int32_t status = PI_OK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (int64_t i = 0; i < n_groups; i++) {
        const int64_t g = order[i], n = counts[g];
        if (n == 0) continue;
        const int32_t s = fn(w + experts[g] * n_rows * w_stride, w_stride, n_rows, K, x + start[g] * K, K, n,
                             y + start[g] * n_rows, n_rows, 1, isa);
        if (s != PI_OK) {
#pragma omp critical(pi_grouped_matmul_status)
            status = s;
        }
    }
    free(start);
    return status;
}

/* ---- a prompt's MoE FFN in one call ------------------------------------------------------------------------------- */

#define MOE_GROUP_ROWS 64 /* a group's matrices split in row ranges of a multiple of this (a multiple of every tile) */

/* pi_moe_grouped_ffn(desc, gate_mm, up_mm, down_mm, x, T, ids, weights, out, n_threads, isa): the experts of T tokens
 * at once, out (T, n_embd) = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) from zero, j = 0 .. k - 1 in order (k =
 * desc->n_used), x (T, n_embd) the normed inputs. The tokens are grouped by expert (tokens in order within a group)
 * and each group's gate, up and down products are the matmul kernels given (pi_matmul_<type> of each stack's type)
 * over the group's tokens; the team shares work items (larger groups first): a row range of a group's gate and up
 * with its activation (pi_gated's), then a row range of its down; few groups are split in more ranges (multiples
 * of MOE_GROUP_ROWS rows) so the threads end together. A product's bits do not depend on the thread count, the
 * split or the grouping, and the weighted sum is pi_moe_experts': one token's row of out is the bits the one-token
 * kernel adds to it. One parallel region, no Python between the steps. An id of -1 leaves its pair out of the sum
 * (the pairs another device computes). */
PI_EXPORT int32_t pi_moe_grouped_ffn(const pi_moe_desc *d, const void *gate_mm, const void *up_mm,
                                     const void *down_mm, const float *x, int64_t T, const int64_t *ids,
                                     const float *weights, float *out, int32_t n_threads, int32_t isa) {
    if (d == NULL || gate_mm == NULL || up_mm == NULL || down_mm == NULL || T < 0) return PI_ERR_SHAPE;
    const int64_t E = d->n_embd, F = d->n_ff, NE = d->n_expert, k = d->n_used;
    if (E <= 0 || F <= 0 || E > MOE_MAX_DIM || F > MOE_MAX_DIM || NE <= 0 || NE > MOE_MAX_EXPERTS || k <= 0 ||
        k > NE || d->act < ACT_RELU || d->act > ACT_LAST || T > MOE_MAX_DIM / k)
        return PI_ERR_SHAPE;
    if (!moe_mat_ok(&d->gate, NE * F, E) || !moe_mat_ok(&d->up, NE * F, E) || !moe_mat_ok(&d->down, NE * E, F))
        return PI_ERR_SHAPE;
    if (T == 0) return PI_OK;
    if (x == NULL || ids == NULL || weights == NULL || out == NULL) return PI_ERR_SHAPE;
    const int64_t S = T * k; /* slots: (token, expert) pairs */
    if ((double)S * (double)(2 * E + 2 * F) * 4.0 > 0x1p48 || (double)NE * (double)(E + F) > 0x1p40)
        return PI_ERR_ALLOC; /* the buffers below, before their sizes overflow */
    for (int64_t s = 0; s < S; s++)
        if (ids[s] < -1 || ids[s] >= NE) return PI_ERR_INDEX;
    if (moe_experts_resident(d, ids, S) != PI_OK) return PI_ERR_INDEX;
    const int64_t RF = (F + MOE_GROUP_ROWS - 1) / MOE_GROUP_ROWS, RE = (E + MOE_GROUP_ROWS - 1) / MOE_GROUP_ROWS;
    /* (at most RF and RE row ranges per group below) */
    /* per expert: count, start; per slot: its row in the grouped layout, the token of each grouped row; the groups
     * by size; the work items */
    const size_t ints = (size_t)(2 * NE + 1) + (size_t)(2 * S) + (size_t)NE + (size_t)NE * (size_t)(RF + RE);
    int64_t *count = malloc(ints * sizeof(int64_t));
    float *fbuf = malloc((size_t)S * (size_t)(2 * E + 2 * F) * sizeof(float));
    if (count == NULL || fbuf == NULL) {
        free(count);
        free(fbuf);
        return PI_ERR_ALLOC;
    }
    int64_t *start = count + NE, *slot_row = start + NE + 1, *row_token = slot_row + S, *order = row_token + S;
    int64_t *items = order + NE;
    float *xs = fbuf, *g = xs + S * E, *u = g + S * F, *yd = u + S * F;
    memset(count, 0, (size_t)NE * sizeof(int64_t));
    for (int64_t s = 0; s < S; s++)
        if (ids[s] >= 0) count[ids[s]]++;
    start[0] = 0;
    for (int64_t e = 0; e < NE; e++) start[e + 1] = start[e] + count[e];
    int64_t n_groups = 0;
    for (int64_t e = 0; e < NE; e++) {
        if (count[e] == 0) continue;
        int64_t q = n_groups++ - 1; /* insertion by size, larger first (ties: lower id first) */
        for (; q >= 0 && count[order[q]] < count[e]; q--) order[q + 1] = order[q];
        order[q + 1] = e;
        count[e] = 0; /* reused as the fill position below */
    }
    for (int64_t s = 0; s < S; s++) { /* slots in token order: a group's tokens in order */
        if (ids[s] < 0) {
            slot_row[s] = -1;
            continue;
        }
        const int64_t e = ids[s], r = start[e] + count[e]++;
        slot_row[s] = r;
        row_token[r] = s / k;
    }
    int32_t nt = threads_for_work(n_threads, S * 3 * F * E);
    if (nt > S) nt = (int32_t)S;
    /* a group's matrix in `chunks` row ranges, enough items for the team to end together (4 per thread), each a
     * multiple of MOE_GROUP_ROWS rows (every call quantises the group's inputs again: no more ranges than that) */
    const int64_t chunks = nt > 1 && n_groups > 0 ? (4 * nt + n_groups - 1) / n_groups : 1; /* 0 groups: all masked */
    const int64_t rows_f = min_i64(F, ((F + chunks - 1) / chunks + MOE_GROUP_ROWS - 1) / MOE_GROUP_ROWS * MOE_GROUP_ROWS),
                  rows_e = min_i64(E, ((E + chunks - 1) / chunks + MOE_GROUP_ROWS - 1) / MOE_GROUP_ROWS * MOE_GROUP_ROWS);
    const int64_t rf = (F + rows_f - 1) / rows_f, re = (E + rows_e - 1) / rows_e;
    int64_t n_items = 0; /* (group, row range) of gate and up, then the down items at n_up */
    for (int64_t i = 0; i < n_groups; i++)
        for (int64_t c = 0; c < rf; c++) items[n_items++] = order[i] * rf + c;
    const int64_t n_up = n_items;
    for (int64_t i = 0; i < n_groups; i++)
        for (int64_t c = 0; c < re; c++) items[n_items++] = order[i] * re + c;
    const moe_matmul_fn fg = (moe_matmul_fn)gate_mm, fu = (moe_matmul_fn)up_mm, fd = (moe_matmul_fn)down_mm;
    const pi_moe_mat *gm = &d->gate, *um = &d->up, *dm = &d->down;
    const int act = d->act;
    const float *thr = d->thresholds;
    int32_t status = PI_OK;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int32_t mine = PI_OK;
#pragma omp for schedule(static)
        for (int64_t s = 0; s < S; s++)
            if (slot_row[s] >= 0) memcpy(xs + slot_row[s] * E, x + (s / k) * E, (size_t)E * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_up; i++) { /* a row range of a group's gate and up, then its activation */
            const int64_t it = items[i], c = it % rf, e = it / rf;
            const int64_t r0 = c * rows_f, nr = min_i64(rows_f, F - r0), n = start[e + 1] - start[e];
            float *gg = g + start[e] * F + r0, *uu = u + start[e] * F + r0;
            const float *xe = xs + start[e] * E;
            int32_t st = fg(moe_expert_w(d, 0, e) + r0 * gm->stride, gm->stride, nr, E, xe, E, n, gg, F, 1, isa);
            if (st == PI_OK) st = fu(moe_expert_w(d, 1, e) + r0 * um->stride, um->stride, nr, E, xe, E, n, uu, F, 1, isa);
            if (st != PI_OK) mine = st;
            if (thr != NULL) { /* CATS: the one-token kernel's h, the inactive neurons' products dropped */
                const float *te = thr + e * F + r0;
                for (int64_t r = 0; r < n; r++)
                    for (int64_t q = 0; q < nr; q++) {
                        const float a = ffn_act(act, gg[r * F + q]);
                        gg[r * F + q] = fabsf(a) > te[q] ? a * uu[r * F + q] : 0.0f;
                    }
                continue;
            }
            for (int64_t r = 0; r < n; r++)
                for (int64_t q = 0; q < nr; q++) gg[r * F + q] = ffn_act(act, gg[r * F + q]) * uu[r * F + q];
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = n_up; i < n_items; i++) {
            const int64_t it = items[i], c = it % re, e = it / re;
            const int64_t r0 = c * rows_e, nr = min_i64(rows_e, E - r0), n = start[e + 1] - start[e];
            const int32_t st = fd(moe_expert_w(d, 2, e) + r0 * dm->stride, dm->stride, nr, F, g + start[e] * F, F, n,
                                  yd + start[e] * E + r0, E, 1, isa);
            if (st != PI_OK) mine = st;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *o = out + t * E; /* o[n] = ((0 + y_0 w_0) + y_1 w_1) + ..., pi_moe_experts' acc */
            for (int64_t n = 0; n < E; n++) o[n] = 0.0f;
            for (int64_t j = 0; j < k; j++) {
                if (slot_row[t * k + j] < 0) continue;
                const float *yj = yd + slot_row[t * k + j] * E, wj = weights[t * k + j];
                for (int64_t n = 0; n < E; n++) o[n] += yj[n] * wj;
            }
        }
        if (mine != PI_OK) {
#pragma omp critical(pi_moe_grouped_status)
            status = mine;
        }
    }
    free(count);
    free(fbuf);
    return status;
}
