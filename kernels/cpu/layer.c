/* Fused decode blocks of one token: a whole attention block or a whole dense FFN block in one call and one
 * parallel region, instead of a dozen ops (and as many fork/joins and Python round trips) per block.
 *
 *   pi_attn_block: x += wo . attention(rope(wq . n), rope(wk . n), wv . n),  n = rmsnorm(x) * norm
 *   pi_ffn_block:  x += down . (act(gate . n) * up . n),                     n = rmsnorm(x) * norm
 *   pi_sparse_ffn_block: x += pi_predict_ffn(x, n) (PowerInfer's predictor on x, the predicted rows on n)
 *   pi_cats_ffn_block: x += pi_cats_ffn(n) (CATS: every gate row, the thresholds, the active up and down rows)
 *
 * Every matrix product is the arithmetic of pi_matmul_<type> at T = 1 in the chosen activation precision (q8: the
 * int8 blocks of 32 for the block-32 types, int8 super-blocks of 256 for the K-quants; float activations for the
 * other types and in f32),
 * attention is pi_attn_decode's (attention.h), the norm pi_rms_norm's and the gating pi_gated's (that of the fused
 * sparse FFN, sparse.h): so a block gives the bits of the same ops called one by one. Rows are split over threads in contiguous ranges, one thread per output
 * element: results do not depend on the thread count. Weights are described by pi_mat (kinds: ggml type ids, enum pi_type)
 * and checked on every call before any row is read; the caller's scratch holds every intermediate.
 */
#include <math.h>
#include <omp.h>

#include "attention.h"
#include "sparse.h"

/* One weight matrix: n_rows rows of n_cols elements of `kind` (enum pi_type), stride bytes apart. */
typedef struct {
    const uint8_t *w;
    int64_t stride;
    int64_t n_rows;
    int64_t n_cols;
    int32_t kind;
    int32_t reserved;
} pi_mat;

/* A Llama-style attention block (no biases, full RoPE on adjacent pairs or NEOX-style, optional per-head QK-norm):
 * the ctypes mirror is powerinfer/ops/layer.py */
typedef struct {
    int64_t n_embd, n_head, n_head_kv, head_dim;
    float eps, scale;
    const float *norm; /* n_embd */
    pi_mat wq, wk, wv, wo;
    const float *q_norm, *k_norm; /* head_dim each: RMSNorm of every q and k head before RoPE; NULL: none */
    float qk_eps;
    int32_t rope_neox; /* RoPE pairs i, i + head_dim / 2 (else 2i, 2i + 1) */
} pi_attn_block_desc;

/* A gated dense FFN block without biases */
typedef struct {
    int64_t n_embd, n_ff;
    float eps;
    int32_t act, relu_up, reserved;
    const float *norm; /* n_embd */
    pi_mat gate, up, down;
} pi_ffn_block_desc;

/* ---- RMSNorm --------------------------------------------------------------------------------------------------- */

/* 1 / sqrt(mean(x^2) + eps), the mean accumulated and the root taken in double */
static double rms_scale(const float *x, int64_t D, float eps) {
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < D; i++) ss += (double)x[i] * (double)x[i];
    return 1.0 / sqrt(ss / (double)D + (double)eps);
}

/* out = x * rms_scale(x) * w, each element rounded once (w NULL: no weight) */
static void rms_norm_row(const float *x, const float *w, int64_t D, float eps, float *out) {
    const double r = rms_scale(x, D, eps);
    if (w == NULL) {
        for (int64_t i = 0; i < D; i++) out[i] = (float)((double)x[i] * r);
        return;
    }
#pragma omp simd
    for (int64_t i = 0; i < D; i++) out[i] = (float)((double)x[i] * r * (double)w[i]);
}

/* pi_rms_norm(x, T, D, x_stride, w, eps, out, out_stride): each of T rows of D floats normed as rms_norm_row (within
 * half an ulp of the exact value, where torch's float arithmetic rounds 2-3 times); w may be NULL (no weight). */
PI_EXPORT int32_t pi_rms_norm(const float *x, int64_t T, int64_t D, int64_t x_stride, const float *w, float eps,
                              float *out, int64_t out_stride) {
    if (T < 0 || D <= 0 || !stride_ok(T, x_stride, D) || !stride_ok(T, out_stride, D)) return PI_ERR_SHAPE;
    if (T > 0 && (x == NULL || out == NULL)) return PI_ERR_SHAPE;
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * x_stride;
        float *ot = out + t * out_stride;
        rms_norm_row(xt, w, D, eps, ot);
    }
    return PI_OK;
}

/* ---- the gating -------------------------------------------------------------------------------------------------- */

/* pi_gated(g, u, n, act, relu_up, out): out[i] = act(g[i]) * (relu(u[i]) if relu_up else u[i]), act as enum ffn_act:
 * the gating of the fused FFN kernels, for the op-by-op path (out may be g). */
PI_EXPORT int32_t pi_gated(const float *g, const float *u, int64_t n, int32_t act, int32_t relu_up, float *out) {
    if (n < 0 || act < ACT_RELU || act > ACT_LAST || (n > 0 && (g == NULL || u == NULL || out == NULL)))
        return PI_ERR_SHAPE;
    for (int64_t i = 0; i < n; i++) out[i] = ffn_act(act, g[i]) * (relu_up ? relu_f(u[i]) : u[i]);
    return PI_OK;
}

/* ---- one token's matrix-vector products in row ranges ---------------------------------------------------------- */

/* A vector prepared for the products of a phase: the floats, and where some matrix of the phase needs them in the
 * q8 precision, its int8 blocks of 32 (kind_has_q8_tile) and its int8 super-blocks of 256 (K-quants). */
typedef struct {
    const float *x;
    act_q8 a;
    act_q8k ak;
} mv_input;

static inline int mv_needs_q8(const pi_mat *m, int q8) { return q8 && kind_has_q8_tile(m->kind); }
static inline int mv_needs_q8k(const pi_mat *m, int q8) { return q8 && kind_is_kq(m->kind); }

static size_t mv_input_bytes(int64_t K) {
    return act_q8_bytes(K) + kq8_act_bytes(K);
}

/* x (K) prepared in buf (mv_input_bytes(K)) for the matrices of one phase */
static void mv_prepare(const matmul_table *t, int32_t level, const float *x, int64_t K, const pi_mat *const *mats,
                       int n_mats, int q8, uint8_t *buf, mv_input *in) {
    int need_q8 = 0, need_q8k = 0;
    for (int i = 0; i < n_mats; i++) {
        need_q8 |= mv_needs_q8(mats[i], q8);
        need_q8k |= mv_needs_q8k(mats[i], q8);
    }
    in->x = x;
    if (need_q8) act_q8_prepare(t, x, K, buf, &in->a);
    if (need_q8k) kq8_act_prepare(level, x, K, buf + act_q8_bytes(K), &in->ak);
}

/* y[n] = W[n] . x for n in [n0, n1): as pi_matmul_<type> computes row n at T = 1 in the precision q8 */
static void mv_rows(const matmul_table *t, int32_t level, const pi_mat *m, int q8, const mv_input *in, int64_t n0,
                    int64_t n1, float *y) {
    if (n0 >= n1) return;
    const int64_t stride = m->stride, K = m->n_cols;
    if (mv_needs_q8k(m, q8)) {
        kq8_rows(level, m->kind, m->w + n0 * stride, stride, n1 - n0, &in->ak, y + n0);
        return;
    }
    const ffn_mat f = ffn_mat_of(t, m->kind, q8, m->w, stride, K);
    ffn_mat_matvec(&f, m->kind, &in->a, in->x, K, n0, n1, y);
}

/* The rows of several matrices read by one input, numbered one after the other and split in contiguous ranges
 * over the team: this thread's share. */
static void mv_split(const matmul_table *t, int32_t level, const pi_mat *const *mats, float *const *ys, int n_mats,
                     int q8, const mv_input *in, int64_t me, int64_t all) {
    int64_t total = 0;
    for (int i = 0; i < n_mats; i++) total += mats[i]->n_rows;
    const int64_t r0 = total * me / all, r1 = total * (me + 1) / all;
    int64_t off = 0;
    for (int i = 0; i < n_mats; i++) {
        const int64_t N = mats[i]->n_rows;
        const int64_t lo = r0 > off ? r0 - off : 0, hi = r1 < off + N ? r1 - off : N;
        if (lo < hi) mv_rows(t, level, mats[i], q8, in, lo, hi, ys[i]);
        off += N;
    }
}

/* The start of a block, on one thread: xn = rmsnorm(x) * norm, prepared for the matrices that read it. */
static void norm_prepare(const matmul_table *t, int32_t level, const float *x, const float *norm, int64_t E, float eps,
                         const pi_mat *const *mats, int n_mats, int q8, float *xn, uint8_t *prep, mv_input *in) {
    rms_norm_row(x, norm, E, eps, xn);
    mv_prepare(t, level, xn, E, mats, n_mats, q8, prep, in);
}

/* The end of a block: this thread's share of the output projection's rows (into y), added to the residual x. */
static void project_add(const matmul_table *t, int32_t level, const pi_mat *m, int q8, const mv_input *in,
                        int64_t me, int64_t all, float *y, float *x) {
    const int64_t N = m->n_rows, n0 = N * me / all, n1 = N * (me + 1) / all;
    mv_rows(t, level, m, q8, in, n0, n1, y);
    for (int64_t n = n0; n < n1; n++) x[n] += y[n];
}

/* ---- checks --------------------------------------------------------------------------------------------------- */

/* a matrix of the expected shape whose rows fit its stride (check_weight: kind, whole blocks, buffer) */
static int mat_ok(const pi_mat *m, int64_t n_rows, int64_t n_cols) {
    if (m->n_rows != n_rows || m->n_cols != n_cols || n_rows <= 0 || n_cols <= 0) return 0;
    return check_weight(m->kind, m->n_rows, m->n_cols, m->w, m->stride) == PI_OK;
}

static size_t attn_block_scratch(int64_t n_embd, int64_t H, int64_t Hkv, int64_t D, int64_t n_ctx) {
    const int64_t n_q = H * D, n_kv = Hkv * D;
    return align_up((size_t)n_embd * 4) * 2 + align_up((size_t)n_q * 4) * 2 + align_up((size_t)n_kv * 4) * 2 +
           attn_scores_bytes(n_ctx, H) + mv_input_bytes(n_embd > n_q ? n_embd : n_q);
}

static size_t ffn_block_scratch(int64_t n_embd, int64_t n_ff) {
    return align_up((size_t)n_embd * 4) * 2 + align_up((size_t)n_ff * 4) * 2 + mv_input_bytes(n_embd > n_ff ? n_embd : n_ff);
}

/* Bytes of scratch pi_attn_block needs for positions below n_ctx, the alignment slack included; -1 for bad sizes. */
PI_EXPORT int64_t pi_attn_block_scratch_bytes(int64_t n_embd, int64_t n_head, int64_t n_head_kv, int64_t head_dim,
                                              int64_t n_ctx) {
    if (n_embd <= 0 || n_head <= 0 || n_head_kv <= 0 || head_dim <= 0 || n_ctx <= 0) return -1;
    return (int64_t)(attn_block_scratch(n_embd, n_head, n_head_kv, head_dim, n_ctx) + PI_SCRATCH_ALIGN);
}

/* Bytes of scratch pi_ffn_block needs, the alignment slack included; -1 for bad sizes. */
PI_EXPORT int64_t pi_ffn_block_scratch_bytes(int64_t n_embd, int64_t n_ff) {
    if (n_embd <= 0 || n_ff <= 0) return -1;
    return (int64_t)(ffn_block_scratch(n_embd, n_ff) + PI_SCRATCH_ALIGN);
}

/* A predictor-selected sparse FFN block (gated, no biases, every neuron on the CPU): the ctypes mirror is
 * powerinfer/ops/layer.py. tokens / active / predictor_seconds: this layer's counters, updated by each call. */
typedef struct {
    int64_t n_embd, n_ff, rank;
    float eps, threshold;
    int32_t act, relu_up;
    const float *norm; /* n_embd */
    pi_mat fc1, fc2, gate, up, down_t;
    int64_t *tokens, *active;
    double *predictor_seconds;
} pi_sparse_ffn_block_desc;

static size_t sparse_ffn_block_scratch(int64_t n_embd, int64_t n_ff, int64_t rank) {
    return align_up((size_t)n_embd * 4) * 2 + align_up((size_t)n_ff * 8) +
           (size_t)pi_predict_ffn_scratch_bytes(n_ff, n_embd, rank, 1);
}

/* Bytes of scratch pi_sparse_ffn_block needs (either precision), the alignment slack included; -1 for bad sizes. */
PI_EXPORT int64_t pi_sparse_ffn_block_scratch_bytes(int64_t n_embd, int64_t n_ff, int64_t rank) {
    if (n_embd <= 0 || n_ff <= 0 || rank <= 0) return -1;
    return (int64_t)(sparse_ffn_block_scratch(n_embd, n_ff, rank) + PI_SCRATCH_ALIGN);
}

/* pi_sparse_ffn_block(desc, x, scratch, scratch_bytes, q8, threads, isa): n = rmsnorm(x) * norm (pi_rms_norm's),
 * y = pi_predict_ffn(x, n, ...) (the predictor reads the residual x, as PowerInfer's), x += y; the layer's counters
 * take the token, its active neurons and the predictor's time. The bits of rms_norm, predict_ffn and a float add
 * called one by one. scratch: at least pi_sparse_ffn_block_scratch_bytes bytes. */
PI_EXPORT int32_t pi_sparse_ffn_block(const pi_sparse_ffn_block_desc *b, float *x, void *scratch, int64_t scratch_bytes,
                                      int32_t q8, int32_t n_threads, int32_t isa) {
    if (b == NULL || x == NULL || b->norm == NULL || b->tokens == NULL || b->active == NULL ||
        b->predictor_seconds == NULL)
        return PI_ERR_SHAPE;
    const int64_t E = b->n_embd, F = b->n_ff, R = b->rank;
    if (E <= 0 || F <= 0 || R <= 0) return PI_ERR_SHAPE;
    if (!mat_ok(&b->fc1, R, E) || !mat_ok(&b->fc2, F, R) || !mat_ok(&b->gate, F, E) || !mat_ok(&b->up, F, E) ||
        !mat_ok(&b->down_t, F, E))
        return PI_ERR_SHAPE;
    uint8_t *buf;
    int32_t status = scratch_take(scratch, scratch_bytes, sparse_ffn_block_scratch(E, F, R), &buf);
    if (status != PI_OK) return status;
    float *xn = (float *)buf;
    float *y = (float *)(buf + align_up((size_t)E * 4));
    int64_t *idx = (int64_t *)((uint8_t *)y + align_up((size_t)E * 4));
    uint8_t *rest = (uint8_t *)idx + align_up((size_t)F * 8);
    const int64_t rest_bytes = scratch_bytes - (int64_t)(rest - (uint8_t *)scratch);
    rms_norm_row(x, b->norm, E, b->eps, xn);
    int64_t n_active = 0;
    double seconds = 0.0;
    status = pi_predict_ffn(x, xn, E, E, F, b->fc1.w, b->fc1.stride, b->fc1.kind, R, b->fc2.w, b->fc2.stride,
                            b->fc2.kind, b->threshold, b->gate.w, b->gate.stride, b->gate.kind, b->up.w,
                            b->up.stride, b->up.kind, b->down_t.w, b->down_t.stride, b->down_t.kind, b->act,
                            b->relu_up, q8, idx, &n_active, &seconds, y, rest, rest_bytes, n_threads, isa);
    if (status != PI_OK) return status;
    for (int64_t e = 0; e < E; e++) x[e] += y[e];
    *b->tokens += 1;
    *b->active += n_active;
    *b->predictor_seconds += seconds;
    return PI_OK;
}

/* A CATS FFN block (gated, no biases, every neuron on the CPU): the ctypes mirror is powerinfer/ops/layer.py.
 * thresholds, out_thresholds (NULL: one stage): n_ff floats each; tokens / active / up_read: this layer's
 * counters, updated by each call. */
typedef struct {
    int64_t n_embd, n_ff;
    float eps;
    int32_t act, relu_up, reserved;
    const float *norm; /* n_embd */
    const float *thresholds, *out_thresholds;
    pi_mat gate, up, down_t;
    int64_t *tokens, *active, *up_read;
} pi_cats_ffn_block_desc;

static size_t cats_ffn_block_scratch(int64_t n_embd, int64_t n_ff) {
    return align_up((size_t)n_embd * 4) * 2 + align_up((size_t)n_ff * 8) +
           (size_t)pi_cats_ffn_scratch_bytes(n_ff, n_embd, 1);
}

/* Bytes of scratch pi_cats_ffn_block needs (either precision), the alignment slack included; -1 for bad sizes. */
PI_EXPORT int64_t pi_cats_ffn_block_scratch_bytes(int64_t n_embd, int64_t n_ff) {
    if (n_embd <= 0 || n_ff <= 0) return -1;
    return (int64_t)(cats_ffn_block_scratch(n_embd, n_ff) + PI_SCRATCH_ALIGN);
}

/* pi_cats_ffn_block(desc, x, dense, scratch, scratch_bytes, q8, threads, isa): n = rmsnorm(x) * norm
 * (pi_rms_norm's), y = pi_cats_ffn(n) over every neuron with the desc's thresholds, x += y; dense != 0 (the first
 * token of a sequence) makes every neuron active (no threshold read, one stage). The layer's counters take the
 * token, its active neurons and its up rows read. The bits of rms_norm, cats_ffn (with thresholds of -1 when
 * dense) and a float add called one by one. scratch: at least pi_cats_ffn_block_scratch_bytes bytes. */
PI_EXPORT int32_t pi_cats_ffn_block(const pi_cats_ffn_block_desc *b, float *x, int32_t dense, void *scratch,
                                    int64_t scratch_bytes, int32_t q8, int32_t n_threads, int32_t isa) {
    if (b == NULL || x == NULL || b->norm == NULL || b->thresholds == NULL || b->tokens == NULL ||
        b->active == NULL || b->up_read == NULL)
        return PI_ERR_SHAPE;
    const int64_t E = b->n_embd, F = b->n_ff;
    if (E <= 0 || F <= 0) return PI_ERR_SHAPE;
    if (!mat_ok(&b->gate, F, E) || !mat_ok(&b->up, F, E) || !mat_ok(&b->down_t, F, E)) return PI_ERR_SHAPE;
    uint8_t *buf;
    int32_t status = scratch_take(scratch, scratch_bytes, cats_ffn_block_scratch(E, F), &buf);
    if (status != PI_OK) return status;
    float *xn = (float *)buf;
    float *y = (float *)(buf + align_up((size_t)E * 4));
    int64_t *idx = (int64_t *)((uint8_t *)y + align_up((size_t)E * 4));
    uint8_t *rest = (uint8_t *)idx + align_up((size_t)F * 8);
    const int64_t rest_bytes = scratch_bytes - (int64_t)(rest - (uint8_t *)scratch);
    rms_norm_row(x, b->norm, E, b->eps, xn);
    int64_t n_active = 0, n_up = 0;
    status = cats_ffn_run(xn, E, E, F, b->gate.w, b->gate.stride, b->gate.kind, b->up.w, b->up.stride, b->up.kind,
                          b->down_t.w, b->down_t.stride, b->down_t.kind, NULL, F, b->thresholds, b->out_thresholds,
                          dense != 0, b->act, b->relu_up, q8, idx, &n_active, &n_up, y, rest, rest_bytes, n_threads,
                          isa);
    if (status != PI_OK) return status;
    for (int64_t e = 0; e < E; e++) x[e] += y[e];
    *b->tokens += 1;
    *b->active += n_active;
    *b->up_read += n_up;
    return PI_OK;
}

/* ---- the attention block ---------------------------------------------------------------------------------------- */

/* pi_attn_block(desc, x, kc, vc, type_k, type_v, n_ctx, pos, rope, scratch, scratch_bytes, q8, threads, isa): x
 * (n_embd) += the block's output for the token at pos; kc, vc: this sequence's cache of the layer, n_ctx rows of
 * n_head_kv heads of head_dim elements of type_k / type_v (as pi_attn_decode), row pos written; rope: head_dim / 2 (cos, sin) pairs of position pos (q and k normed per head first
 * when the desc has q_norm and k_norm); scratch: at least
 * pi_attn_block_scratch_bytes(..., n_ctx) bytes. */
PI_EXPORT int32_t pi_attn_block(const pi_attn_block_desc *b, float *x, void *kc, void *vc, int32_t type_k,
                                int32_t type_v, int64_t n_ctx,
                                int64_t pos, const float *rope, void *scratch, int64_t scratch_bytes, int32_t q8,
                                int32_t n_threads, int32_t isa) {
    if (b == NULL || x == NULL || rope == NULL || b->norm == NULL) return PI_ERR_SHAPE;
    const int64_t E = b->n_embd, H = b->n_head, Hkv = b->n_head_kv, D = b->head_dim;
    if (E <= 0 || H <= 0 || Hkv <= 0 || H % Hkv != 0 || D <= 0 || D % 2 != 0 || pos < 0 || pos >= n_ctx)
        return PI_ERR_SHAPE;
    kv_rows krows, vrows;
    if (!kv_rows_make(&krows, kc, type_k, Hkv, D, 0) || !kv_rows_make(&vrows, vc, type_v, Hkv, D, 1)) return PI_ERR_SHAPE;
    const int64_t n_q = H * D, n_kv = Hkv * D;
    if (!mat_ok(&b->wq, n_q, E) || !mat_ok(&b->wk, n_kv, E) || !mat_ok(&b->wv, n_kv, E) || !mat_ok(&b->wo, E, n_q))
        return PI_ERR_SHAPE;
    uint8_t *buf;
    int32_t status = scratch_take(scratch, scratch_bytes, attn_block_scratch(E, H, Hkv, D, n_ctx), &buf);
    if (status != PI_OK) return status;
    float *xn = (float *)buf;
    float *y = (float *)(buf + align_up((size_t)E * 4));
    float *q = (float *)((uint8_t *)y + align_up((size_t)E * 4));
    float *att = (float *)((uint8_t *)q + align_up((size_t)n_q * 4));
    float *k = (float *)((uint8_t *)att + align_up((size_t)n_q * 4));
    float *v = (float *)((uint8_t *)k + align_up((size_t)n_kv * 4));
    float *scores = (float *)((uint8_t *)v + align_up((size_t)n_kv * 4));
    uint8_t *prep = (uint8_t *)scores + attn_scores_bytes(n_ctx, H);

    const int32_t level = pi_isa_clamp(isa);
    const matmul_table *t = matmul_table_for(level);
    const pi_mat *qkv[3] = {&b->wq, &b->wk, &b->wv};
    float *const qkv_out[3] = {q, k, v};
    const pi_mat *out_mat[1] = {&b->wo};
    const int32_t nt = threads_for_work(n_threads, (n_q + 2 * n_kv) * E + E * n_q);
    const int qk_norm = b->q_norm != NULL;
    if (qk_norm != (b->k_norm != NULL)) return PI_ERR_SHAPE;
    mv_input in_x = {0}, in_att = {0};
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
#pragma omp single
        norm_prepare(t, level, x, b->norm, E, b->eps, qkv, 3, q8, xn, prep, &in_x);
        mv_split(t, level, qkv, qkv_out, 3, q8, &in_x, me, all);
#pragma omp barrier
        if (qk_norm) { /* every q and k head normed as pi_rms_norm's rows */
            for (int64_t h = me; h < H + Hkv; h += all) {
                float *r = h < H ? q + h * D : k + (h - H) * D;
                rms_norm_row(r, h < H ? b->q_norm : b->k_norm, D, b->qk_eps, r);
            }
#pragma omp barrier
        }
        attn_decode_part(level, q, k, v, rope, &krows, &vrows, pos, H, Hkv, D, b->scale, scores, att, me, all,
                         b->rope_neox != 0);
#pragma omp barrier
#pragma omp single
        mv_prepare(t, level, att, n_q, out_mat, 1, q8, prep, &in_att);
        project_add(t, level, &b->wo, q8, &in_att, me, all, y, x);
    }
    return PI_OK;
}

/* ---- the dense FFN block ---------------------------------------------------------------------------------------- */

/* pi_ffn_block(desc, x, scratch, scratch_bytes, q8, threads, isa): x (n_embd) += down . (act(gate . n) *
 * (relu(up . n) if relu_up else up . n)), n = rmsnorm(x) * norm; act as enum ffn_act; gate and up (n_ff, n_embd),
 * down (n_embd, n_ff); scratch: at least pi_ffn_block_scratch_bytes(n_embd, n_ff) bytes. */
PI_EXPORT int32_t pi_ffn_block(const pi_ffn_block_desc *b, float *x, void *scratch, int64_t scratch_bytes, int32_t q8,
                               int32_t n_threads, int32_t isa) {
    if (b == NULL || x == NULL || b->norm == NULL) return PI_ERR_SHAPE;
    const int64_t E = b->n_embd, F = b->n_ff;
    if (E <= 0 || F <= 0 || b->act < ACT_RELU || b->act > ACT_LAST) return PI_ERR_SHAPE;
    if (!mat_ok(&b->gate, F, E) || !mat_ok(&b->up, F, E) || !mat_ok(&b->down, E, F)) return PI_ERR_SHAPE;
    uint8_t *buf;
    int32_t status = scratch_take(scratch, scratch_bytes, ffn_block_scratch(E, F), &buf);
    if (status != PI_OK) return status;
    float *xn = (float *)buf;
    float *y = (float *)(buf + align_up((size_t)E * 4));
    float *g = (float *)((uint8_t *)y + align_up((size_t)E * 4));
    float *u = (float *)((uint8_t *)g + align_up((size_t)F * 4));
    uint8_t *prep = (uint8_t *)u + align_up((size_t)F * 4);

    const int32_t level = pi_isa_clamp(isa);
    const matmul_table *t = matmul_table_for(level);
    const pi_mat *in_mats[2] = {&b->gate, &b->up};
    const pi_mat *down_mat[1] = {&b->down};
    const int32_t nt = threads_for_work(n_threads, 3 * E * F);
    const int act = b->act, relu_up = b->relu_up != 0;
    mv_input in_x = {0}, in_h = {0};
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
#pragma omp single
        norm_prepare(t, level, x, b->norm, E, b->eps, in_mats, 2, q8, xn, prep, &in_x);
        /* the same neurons' gate and up rows on one thread, so h needs no barrier between them */
        const int64_t f0 = F * me / all, f1 = F * (me + 1) / all;
        mv_rows(t, level, &b->gate, q8, &in_x, f0, f1, g);
        mv_rows(t, level, &b->up, q8, &in_x, f0, f1, u);
        for (int64_t f = f0; f < f1; f++) g[f] = ffn_act(act, g[f]) * (relu_up ? relu_f(u[f]) : u[f]);
#pragma omp barrier
#pragma omp single
        mv_prepare(t, level, g, F, down_mat, 1, q8, prep, &in_h);
        project_add(t, level, &b->down, q8, &in_h, me, all, y, x);
    }
    return PI_OK;
}

/* ---- a TEAL layer (sparsify --method teal) ----------------------------------------------------------------------- */

/* A Llama-style layer whose matrices are kept transposed, one row per input, and skip the inputs at or below their
 * thresholds (powerinfer.ops.InputSparseWeight): q, k and v side by side in one matrix (they read one input), gate
 * and up in another. The ctypes mirror is powerinfer/ops/layer.py. */
typedef struct {
    int64_t n_embd, n_head, n_head_kv, head_dim, n_ff;
    float attn_eps, ffn_eps, scale;
    int32_t act, relu_up, rope_neox;
    const float *attn_norm, *ffn_norm; /* n_embd each */
    pi_mat qkv_t;                      /* (n_embd, n_q + 2 n_kv) */
    pi_mat o_t;                        /* (n_q, n_embd) */
    pi_mat gate_up_t;                  /* (n_embd, 2 n_ff): gate's outputs, then up's */
    pi_mat down_t;                     /* (n_ff, n_embd) */
    float t_qkv, t_o, t_gate_up, t_down;
    /* counters or NULL: tokens += 1 per call, bytes_read += the bytes of the rows each product read (its inputs
     * above the threshold times the row stride), the counted share of the matrices a token reads */
    int64_t *tokens, *bytes_read;
} pi_teal_layer_desc;

static size_t teal_layer_scratch(int64_t E, int64_t H, int64_t Hkv, int64_t D, int64_t F, int64_t n_ctx) {
    const int64_t n_q = H * D, n_qkv = n_q + 2 * Hkv * D;
    int64_t d_max = n_qkv > E ? n_qkv : E;
    if (2 * F > d_max) d_max = 2 * F;
    int64_t m_max = E > n_q ? E : n_q;
    if (F > m_max) m_max = F;
    return align_up((size_t)E * 4) * 2 + align_up((size_t)n_qkv * 4) + align_up((size_t)n_q * 4) +
           align_up((size_t)F * 8) + align_up((size_t)F * 4) + attn_scores_bytes(n_ctx, H) +
           align_up(axpy_chains_scratch(1, d_max, m_max));
}

/* Bytes of scratch pi_teal_layer needs for positions below n_ctx, the alignment slack included; -1 for bad sizes. */
PI_EXPORT int64_t pi_teal_layer_scratch_bytes(int64_t n_embd, int64_t n_head, int64_t n_head_kv, int64_t head_dim,
                                              int64_t n_ff, int64_t n_ctx) {
    if (n_embd <= 0 || n_head <= 0 || n_head_kv <= 0 || head_dim <= 0 || n_ff <= 0 || n_ctx <= 0) return -1;
    return (int64_t)(teal_layer_scratch(n_embd, n_head, n_head_kv, head_dim, n_ff, n_ctx) + PI_SCRATCH_ALIGN);
}

/* a transposed matrix the one-token axpy can read: rows of whole units (blocks of 32, super-blocks of 256) */
static int teal_mat_ok(const pi_mat *m, int64_t n_rows, int64_t n_cols) {
    if (!mat_ok(m, n_rows, n_cols)) return 0;
    if (kind_is_kq(m->kind)) return n_cols % QK_K == 0;
    return !kind_is_block(m->kind) || n_cols % QK == 0;
}

/* The bytes of m's rows a product with inputs h reads: the rows whose input is not skipped (h != 0 and
 * |h| > t, the axpy's own test) times the row stride. */
static int64_t teal_read_bytes(const pi_mat *m, const float *h, float t) {
    int64_t n = 0;
    for (int64_t k = 0; k < m->n_rows; k++) n += h[k] != 0.0f && !(fabsf(h[k]) <= t);
    return n * m->stride;
}

/* This thread's part of y = sum over |h[k]| > t of h[k] * m[k] (m transposed, one row per input), as
 * pi_rows_axpy_<type> computes it for one token (the same chains whatever the team size); ends at a barrier when
 * the team has more than one thread. Thread 0 adds the bytes read to *bytes when bytes is not NULL. */
static void teal_axpy(axpy_units_fn units, const pi_mat *m, const float *h, float t, int q8, float *y, float *chains,
                      int64_t me, int64_t all, int64_t *bytes) {
    if (bytes != NULL && me == 0) *bytes += teal_read_bytes(m, h, t);
    const axpy_ctx c = {.w = m->w, .w_stride = m->stride, .idx = NULL, .M = m->n_rows, .D = m->n_cols,
                        .unit_bytes = axpy_unit_bytes(m->kind), .h = h, .h_stride = m->n_rows, .T = 1, .y = y,
                        .y_stride = m->n_cols, .coef_bf16 = q8 != 0 && type_coef_bf16(m->kind),
                        .n_rows = m->n_rows, .h_min = t};
    axpy_chains(units, m->kind, &c, chains, me, all);
    if (all > 1) {
#pragma omp barrier
    }
}

/* pi_teal_layer(desc, x, kc, vc, type_k, type_v, n_ctx, pos, rope, scratch, scratch_bytes, q8, threads, isa): x (n_embd) += the
 * layer's attention output, then += its FFN output, for the token at pos; kc, vc, their types and rope as
 * pi_attn_block.
 * Each step as its op: rms_norm, rows_axpy with the threshold (q, k, v at once), attention as pi_attn_decode,
 * rows_axpy (o), the residual add, rms_norm, rows_axpy (gate and up at once), pi_gated, rows_axpy (down), the
 * residual add: the bits of the layer run op by op, in one call and one parallel region. */
PI_EXPORT int32_t pi_teal_layer(const pi_teal_layer_desc *b, float *x, void *kc, void *vc, int32_t type_k,
                                int32_t type_v, int64_t n_ctx,
                                int64_t pos, const float *rope, void *scratch, int64_t scratch_bytes, int32_t q8,
                                int32_t n_threads, int32_t isa) {
    if (b == NULL || x == NULL || rope == NULL || b->attn_norm == NULL || b->ffn_norm == NULL) return PI_ERR_SHAPE;
    const int64_t E = b->n_embd, H = b->n_head, Hkv = b->n_head_kv, D = b->head_dim, F = b->n_ff;
    if (E <= 0 || H <= 0 || Hkv <= 0 || H % Hkv != 0 || D <= 0 || D % 2 != 0 || F <= 0 || pos < 0 || pos >= n_ctx ||
        b->act < ACT_RELU || b->act > ACT_LAST)
        return PI_ERR_SHAPE;
    kv_rows krows, vrows;
    if (!kv_rows_make(&krows, kc, type_k, Hkv, D, 0) || !kv_rows_make(&vrows, vc, type_v, Hkv, D, 1)) return PI_ERR_SHAPE;
    const float thr[4] = {b->t_qkv, b->t_o, b->t_gate_up, b->t_down};
    for (int i = 0; i < 4; i++)
        if (!(thr[i] >= 0.0f)) return PI_ERR_SHAPE;
    const int64_t n_q = H * D, n_kv = Hkv * D;
    if (!teal_mat_ok(&b->qkv_t, E, n_q + 2 * n_kv) || !teal_mat_ok(&b->o_t, n_q, E) ||
        !teal_mat_ok(&b->gate_up_t, E, 2 * F) || !teal_mat_ok(&b->down_t, F, E))
        return PI_ERR_SHAPE;
    uint8_t *buf;
    int32_t status = scratch_take(scratch, scratch_bytes, teal_layer_scratch(E, H, Hkv, D, F, n_ctx), &buf);
    if (status != PI_OK) return status;
    float *xn = (float *)buf;
    float *y = (float *)(buf + align_up((size_t)E * 4));
    float *qkv = (float *)((uint8_t *)y + align_up((size_t)E * 4));
    float *att = (float *)((uint8_t *)qkv + align_up((size_t)(n_q + 2 * n_kv) * 4));
    float *gu = (float *)((uint8_t *)att + align_up((size_t)n_q * 4));
    float *h = (float *)((uint8_t *)gu + align_up((size_t)F * 8));
    float *scores = (float *)((uint8_t *)h + align_up((size_t)F * 4));
    float *chains = (float *)((uint8_t *)scores + attn_scores_bytes(n_ctx, H));

    const int32_t level = pi_isa_clamp(isa);
    const axpy_units_fn units = axpy_units_for(level);
    const int32_t nt = threads_for_work(n_threads, (n_q + 2 * n_kv) * E + E * n_q + 3 * E * F);
    const int act = b->act, relu_up = b->relu_up != 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
        const int64_t e0 = E * me / all, e1 = E * (me + 1) / all;
#pragma omp single
        rms_norm_row(x, b->attn_norm, E, b->attn_eps, xn);
        teal_axpy(units, &b->qkv_t, xn, b->t_qkv, q8, qkv, chains, me, all, b->bytes_read);
        attn_decode_part(level, qkv, qkv + n_q, qkv + n_q + n_kv, rope, &krows, &vrows, pos, H, Hkv, D, b->scale, scores,
                         att, me, all, b->rope_neox != 0);
#pragma omp barrier
        teal_axpy(units, &b->o_t, att, b->t_o, q8, y, chains, me, all, b->bytes_read);
        for (int64_t n = e0; n < e1; n++) x[n] += y[n];
#pragma omp barrier
#pragma omp single
        rms_norm_row(x, b->ffn_norm, E, b->ffn_eps, xn);
        teal_axpy(units, &b->gate_up_t, xn, b->t_gate_up, q8, gu, chains, me, all, b->bytes_read);
        for (int64_t f = F * me / all; f < F * (me + 1) / all; f++)
            h[f] = ffn_act(act, gu[f]) * (relu_up ? relu_f(gu[F + f]) : gu[F + f]);
#pragma omp barrier
        teal_axpy(units, &b->down_t, h, b->t_down, q8, y, chains, me, all, b->bytes_read);
        for (int64_t n = e0; n < e1; n++) x[n] += y[n];
    }
    if (b->tokens != NULL) *b->tokens += 1;
    return PI_OK;
}

/* ---- a decode step's layer stack ------------------------------------------------------------------------------- */

enum { STACK_FFN_DENSE = 0, STACK_FFN_SPARSE = 1, STACK_FFN_CATS = 2, STACK_TEAL = 3 };

/* One layer of one sequence: its attention block with that sequence's cache rows and the RoPE table, then its
 * FFN block of kind ffn_kind (STACK_FFN_*: pi_ffn_block, pi_sparse_ffn_block or pi_cats_ffn_block); or, with
 * ffn_kind STACK_TEAL, the whole layer as pi_teal_layer (ffn: its pi_teal_layer_desc, attn unused, the attention
 * scratch its scratch). The ctypes mirror is powerinfer/ops/layer.py. */
typedef struct {
    const pi_attn_block_desc *attn;
    void *k_cache, *v_cache; /* n_ctx rows of n_head_kv heads of head_dim elements each */
    int32_t type_k, type_v;  /* their types, as pi_attn_block's */
    int64_t n_ctx;
    const float *rope; /* (n_positions, head_dim / 2, 2) (cos, sin) pairs */
    int64_t n_positions;
    int32_t ffn_kind;
    int32_t reserved;
    const void *ffn;
} pi_stack_layer;

/* pi_decode_stack(layers, n_layers, x, pos, attn_scratch, attn_bytes, ffn_scratch, ffn_bytes, q8, threads, isa):
 * one token at position pos through n_layers layers in order, x (n_embd) updated in place, each block exactly as
 * its own call (pi_attn_block then the FFN block, the CATS one dense at position 0), so the bits are those of the
 * blocks called one by one. One call a token instead of two per layer from Python: on SmolLM2 (30 layers) that
 * saved ~0.8 ms of a 9-11 ms token (1 thread, interleaved per token; docs/sparsity.md). Stops at the first block that fails, with its status. */
PI_EXPORT int32_t pi_decode_stack(const pi_stack_layer *layers, int64_t n_layers, float *x, int64_t pos,
                                  void *attn_scratch, int64_t attn_bytes, void *ffn_scratch, int64_t ffn_bytes,
                                  int32_t q8, int32_t n_threads, int32_t isa) {
    if (layers == NULL || n_layers < 0 || x == NULL || pos < 0) return PI_ERR_SHAPE;
    for (int64_t l = 0; l < n_layers; l++) {
        const pi_stack_layer *L = &layers[l];
        if (L->ffn == NULL || L->rope == NULL || pos >= L->n_positions) return PI_ERR_SHAPE;
        if (L->ffn_kind == STACK_TEAL) {
            const pi_teal_layer_desc *t = (const pi_teal_layer_desc *)L->ffn;
            const int32_t status = pi_teal_layer(t, x, L->k_cache, L->v_cache, L->type_k, L->type_v, L->n_ctx, pos,
                                                 L->rope + pos * t->head_dim, attn_scratch, attn_bytes, q8, n_threads,
                                                 isa);
            if (status != PI_OK) return status;
            continue;
        }
        if (L->attn == NULL) return PI_ERR_SHAPE;
        int32_t status = pi_attn_block(L->attn, x, L->k_cache, L->v_cache, L->type_k, L->type_v, L->n_ctx, pos,
                                       L->rope + pos * L->attn->head_dim, attn_scratch, attn_bytes, q8, n_threads, isa);
        if (status != PI_OK) return status;
        switch (L->ffn_kind) {
            case STACK_FFN_DENSE:
                status = pi_ffn_block((const pi_ffn_block_desc *)L->ffn, x, ffn_scratch, ffn_bytes, q8, n_threads, isa);
                break;
            case STACK_FFN_SPARSE:
                status = pi_sparse_ffn_block((const pi_sparse_ffn_block_desc *)L->ffn, x, ffn_scratch, ffn_bytes, q8,
                                             n_threads, isa);
                break;
            case STACK_FFN_CATS:
                status = pi_cats_ffn_block((const pi_cats_ffn_block_desc *)L->ffn, x, pos == 0, ffn_scratch, ffn_bytes,
                                           q8, n_threads, isa);
                break;
            default: return PI_ERR_SHAPE;
        }
        if (status != PI_OK) return status;
    }
    return PI_OK;
}

/* ---- a few tokens of one sequence through the stack (a speculative step's) ------------------------------------- */

/* pi_matmul_<type> (matmul.c): the product each matrix of the stack has op by op, in the precision of the call */
typedef int32_t (*stack_matmul_fn)(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, const float *x,
                                   int64_t x_stride, int64_t T, float *y, int64_t y_stride, int32_t n_threads,
                                   int32_t isa);

/* A dense layer's products for several tokens: the pi_matmul_<type> function of each matrix. The ctypes mirror is
 * powerinfer/ops/layer.py. */
typedef struct {
    const void *q, *k, *v, *o, *gate, *up, *down;
} pi_stack_matmuls;

/* the sizes of one layer of the stack, for the scratch of T tokens */
static size_t stack_tokens_scratch(const pi_stack_layer *L, int64_t T) {
    const pi_attn_block_desc *a = L->attn;
    const pi_ffn_block_desc *f = (const pi_ffn_block_desc *)L->ffn;
    const int64_t E = a->n_embd, n_q = a->n_head * a->head_dim, n_kv = a->n_head_kv * a->head_dim, F = f->n_ff;
    return 2 * align_up((size_t)(T * E) * 4) + 2 * align_up((size_t)(T * n_q) * 4) +
           2 * align_up((size_t)(T * n_kv) * 4) + 2 * align_up((size_t)(T * F) * 4) +
           attn_scores_bytes(L->n_ctx, a->n_head);
}

static int stack_tokens_layer_ok(const pi_stack_layer *L, const pi_stack_matmuls *m) {
    if (L->ffn_kind != STACK_FFN_DENSE || L->attn == NULL || L->ffn == NULL || L->rope == NULL) return 0;
    if (m->q == NULL || m->k == NULL || m->v == NULL || m->o == NULL || m->gate == NULL || m->up == NULL ||
        m->down == NULL)
        return 0;
    const pi_attn_block_desc *a = L->attn;
    const pi_ffn_block_desc *f = (const pi_ffn_block_desc *)L->ffn;
    return a->n_embd > 0 && a->n_head > 0 && a->n_head_kv > 0 && a->n_head % a->n_head_kv == 0 && a->head_dim > 0 &&
           a->head_dim % 2 == 0 && f->n_embd == a->n_embd && f->n_ff > 0 && f->norm != NULL && a->norm != NULL &&
           f->act >= ACT_RELU && f->act <= ACT_LAST;
}

/* pi_decode_stack_tokens_scratch_bytes(layers, matmuls, n_layers, T): the scratch pi_decode_stack_tokens needs for T
 * tokens; -1 where a layer is not a dense one it can run (an attention block and a dense FFN block, every product
 * given). */
PI_EXPORT int64_t pi_decode_stack_tokens_scratch_bytes(const pi_stack_layer *layers, const pi_stack_matmuls *matmuls,
                                                       int64_t n_layers, int64_t T) {
    if (layers == NULL || matmuls == NULL || n_layers <= 0 || T <= 0) return -1;
    size_t most = 0;
    for (int64_t l = 0; l < n_layers; l++) {
        if (!stack_tokens_layer_ok(&layers[l], &matmuls[l])) return -1;
        const size_t need = stack_tokens_scratch(&layers[l], T);
        if (need > most) most = need;
    }
    return (int64_t)most;
}

/* one product of the stack over T tokens: y (T, m->n_rows) = x (T, m->n_cols) . W^T */
static int32_t stack_product(const void *fn, const pi_mat *m, const float *x, int64_t T, float *y, int32_t n_threads,
                             int32_t isa) {
    return ((stack_matmul_fn)fn)(m->w, m->stride, m->n_rows, m->n_cols, x, m->n_cols, T, y, m->n_rows, n_threads, isa);
}

/* pi_decode_stack_tokens(layers, matmuls, n_layers, x, T, pos, scratch, scratch_bytes, threads, isa): T tokens of one
 * sequence at positions pos.. pos + T - 1 through n_layers dense layers in order, x (T, n_embd) updated in place.
 * Per layer: every token's norm as pi_attn_block's, the q, k and v products of all T tokens by the matrices'
 * pi_matmul_<type> (matmuls[l]: the functions the ops call, so the precision of the call), then each token in turn
 * through pi_attn_block's attention at its own position (its k and v rows written, then the rows up to its own
 * read: the causal mask), the output product and the residual, the FFN block as pi_ffn_block computes each token
 * with its products over all T tokens. A product over T tokens gives each token the bits of one token alone
 * (the matmul kernels' rule) and the rest is per token, so a token gets the bits of pi_decode_stack. Only dense
 * layers (pi_decode_stack_tokens_scratch_bytes says); checked before anything is written. */
PI_EXPORT int32_t pi_decode_stack_tokens(const pi_stack_layer *layers, const pi_stack_matmuls *matmuls,
                                         int64_t n_layers, float *x, int64_t T, int64_t pos, void *scratch,
                                         int64_t scratch_bytes, int32_t n_threads, int32_t isa) {
    if (x == NULL || pos < 0 || T <= 0) return PI_ERR_SHAPE;
    const int64_t need = pi_decode_stack_tokens_scratch_bytes(layers, matmuls, n_layers, T);
    if (need < 0) return PI_ERR_SHAPE;
    for (int64_t l = 0; l < n_layers; l++) { /* every layer's shapes, caches and positions before any is run */
        const pi_stack_layer *L = &layers[l];
        const pi_attn_block_desc *a = L->attn;
        const pi_ffn_block_desc *f = (const pi_ffn_block_desc *)L->ffn;
        const int64_t E = a->n_embd, n_q = a->n_head * a->head_dim, n_kv = a->n_head_kv * a->head_dim;
        if (pos + T > L->n_positions || pos + T > L->n_ctx || E != layers[0].attn->n_embd) return PI_ERR_SHAPE;
        if (!mat_ok(&a->wq, n_q, E) || !mat_ok(&a->wk, n_kv, E) || !mat_ok(&a->wv, n_kv, E) ||
            !mat_ok(&a->wo, E, n_q) || !mat_ok(&f->gate, f->n_ff, E) || !mat_ok(&f->up, f->n_ff, E) ||
            !mat_ok(&f->down, E, f->n_ff))
            return PI_ERR_SHAPE;
        if ((a->q_norm != NULL) != (a->k_norm != NULL)) return PI_ERR_SHAPE;
        kv_rows kr, vr;
        if (!kv_rows_make(&kr, L->k_cache, L->type_k, a->n_head_kv, a->head_dim, 0) ||
            !kv_rows_make(&vr, L->v_cache, L->type_v, a->n_head_kv, a->head_dim, 1))
            return PI_ERR_SHAPE;
    }
    uint8_t *buf;
    int32_t status = scratch_take(scratch, scratch_bytes, (size_t)need, &buf);
    if (status != PI_OK) return status;
    const int32_t level = pi_isa_clamp(isa);
    for (int64_t l = 0; l < n_layers; l++) {
        const pi_stack_layer *L = &layers[l];
        const pi_stack_matmuls *mm = &matmuls[l];
        const pi_attn_block_desc *a = L->attn;
        const pi_ffn_block_desc *f = (const pi_ffn_block_desc *)L->ffn;
        const int64_t E = a->n_embd, H = a->n_head, Hkv = a->n_head_kv, D = a->head_dim, F = f->n_ff;
        const int64_t n_q = H * D, n_kv = Hkv * D;
        float *xn = (float *)buf;
        float *y = (float *)((uint8_t *)xn + align_up((size_t)(T * E) * 4));
        float *q = (float *)((uint8_t *)y + align_up((size_t)(T * E) * 4));
        float *att = (float *)((uint8_t *)q + align_up((size_t)(T * n_q) * 4));
        float *k = (float *)((uint8_t *)att + align_up((size_t)(T * n_q) * 4));
        float *v = (float *)((uint8_t *)k + align_up((size_t)(T * n_kv) * 4));
        float *g = (float *)((uint8_t *)v + align_up((size_t)(T * n_kv) * 4));
        float *u = (float *)((uint8_t *)g + align_up((size_t)(T * F) * 4));
        float *scores = (float *)((uint8_t *)u + align_up((size_t)(T * F) * 4));
        kv_rows krows, vrows;
        kv_rows_make(&krows, L->k_cache, L->type_k, Hkv, D, 0);
        kv_rows_make(&vrows, L->v_cache, L->type_v, Hkv, D, 1);

        /* attention */
        for (int64_t t = 0; t < T; t++) rms_norm_row(x + t * E, a->norm, E, a->eps, xn + t * E);
        if ((status = stack_product(mm->q, &a->wq, xn, T, q, n_threads, isa)) != PI_OK ||
            (status = stack_product(mm->k, &a->wk, xn, T, k, n_threads, isa)) != PI_OK ||
            (status = stack_product(mm->v, &a->wv, xn, T, v, n_threads, isa)) != PI_OK)
            return status;
        if (a->q_norm != NULL)
            for (int64_t t = 0; t < T; t++)
                for (int64_t h = 0; h < H + Hkv; h++) {
                    float *r = h < H ? q + t * n_q + h * D : k + t * n_kv + (h - H) * D;
                    rms_norm_row(r, h < H ? a->q_norm : a->k_norm, D, a->qk_eps, r);
                }
        const int32_t nt = threads_for_work(n_threads, (n_q + 2 * n_kv) * E + E * n_q);
        for (int64_t t = 0; t < T; t++) {
#pragma omp parallel num_threads(nt) if (nt > 1)
            attn_decode_part(level, q + t * n_q, k + t * n_kv, v + t * n_kv, L->rope + (pos + t) * D, &krows, &vrows,
                             pos + t, H, Hkv, D, a->scale, scores, att + t * n_q, omp_get_thread_num(),
                             omp_get_num_threads(), a->rope_neox != 0);
        }
        if ((status = stack_product(mm->o, &a->wo, att, T, y, n_threads, isa)) != PI_OK) return status;
        for (int64_t i = 0; i < T * E; i++) x[i] += y[i];

        /* FFN */
        for (int64_t t = 0; t < T; t++) rms_norm_row(x + t * E, f->norm, E, f->eps, xn + t * E);
        if ((status = stack_product(mm->gate, &f->gate, xn, T, g, n_threads, isa)) != PI_OK ||
            (status = stack_product(mm->up, &f->up, xn, T, u, n_threads, isa)) != PI_OK)
            return status;
        const int act = f->act, relu_up = f->relu_up != 0;
        for (int64_t i = 0; i < T * F; i++) g[i] = ffn_act(act, g[i]) * (relu_up ? relu_f(u[i]) : u[i]);
        if ((status = stack_product(mm->down, &f->down, g, T, y, n_threads, isa)) != PI_OK) return status;
        for (int64_t i = 0; i < T * E; i++) x[i] += y[i];
    }
    return PI_OK;
}
