/* The sparse output head's chain for one token (model/head.py's SparseHead): u = RMSNorm(x) (pi_rms_norm, where the
 * head's final norm is one; else the caller passes u), z = P u, s = A z, the candidates
 * C = top_about_k(s), their exact logits e = W_C u written over s, and what the head's safety check needs (the
 * largest screen value left out, max |e - s_C| and max e). The three products are the kernels the caller would
 * call one by one (pi_matmul_<type> and pi_rows_matmul_<type> of its precision, passed in the descriptor), so the
 * bits are those of the op-by-op chain; a screen of a rows8 type in the q8 precision may come repacked by 8 rows
 * (pi_matvec_rows8: the same bits, no per-call transpose of the short rows; 2x faster on SmolLM2's 49152 x 256
 * screen). One call instead of about a dozen torch and ctypes calls a token: in a
 * decode step the weights stream through the caches between two heads, and each of those calls ran cold
 * (SmolLM2, 1 thread: ~0.3 ms of the head's ~1.5 ms outside the three products).
 */
#include <math.h>

#include "common.h"

typedef int32_t (*head_matmul_fn)(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, const float *x,
                                  int64_t x_stride, int64_t T, float *y, int64_t y_stride, int32_t n_threads,
                                  int32_t isa);
typedef int32_t (*head_rows_fn)(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, const int64_t *idx,
                                int64_t M, const float *x, int64_t x_stride, int64_t T, float *y, int64_t y_stride,
                                int32_t n_threads, int32_t isa);

/* The head's weights and kernels (ops.head_chain builds it from the QWeights; the memory stays the caller's). */
typedef struct {
    int64_t n_vocab, n_embd, rank, k; /* W (n_vocab, n_embd), P (rank, n_embd), A (n_vocab, rank); about k candidates */
    int32_t norm;                     /* 1: u = RMSNorm(x) with norm_weight (NULL: none) and eps; 0: x is u */
    float eps;
    const float *norm_weight;
    const uint8_t *proj;
    int64_t proj_stride;
    head_matmul_fn proj_matmul;
    const uint8_t *screen;
    int64_t screen_stride;
    head_matmul_fn screen_matmul;
    const uint8_t *output;
    int64_t output_stride;
    head_rows_fn output_rows;
    int32_t screen_type;      /* the screen's type id (enum pi_type) */
    const uint8_t *screen_r8; /* its rows repacked by 8 (pi_repack_rows8; q8 precision), or NULL */
} head_desc;

int32_t pi_rms_norm(const float *x, int64_t T, int64_t D, int64_t x_stride, const float *w, float eps, float *out,
                    int64_t out_stride);
int32_t pi_matvec_rows8(int32_t type, const uint8_t *packed, int64_t N, int64_t K, const float *x, float *y,
                        int32_t n_threads, int32_t isa);
int32_t pi_top_about_k(const float *s, int64_t n, int64_t k, int64_t *idx, int64_t *m, float *next, float *scratch,
                       int32_t isa);

/* scratch of pi_head_t1 (after its 64-byte aligned start): z (rank floats), the candidates' exact logits (up to 4k)
 * and top_about_k's n_vocab floats; each part 64-byte aligned */
static inline int64_t head_part(int64_t bytes) { return (bytes + 63) / 64 * 64; }

static int64_t head_need(int64_t n_vocab, int64_t rank, int64_t k) {
    if (n_vocab <= 0 || rank <= 0 || k <= 0 || n_vocab > INT32_MAX || rank > INT32_MAX || k > INT32_MAX) return -1;
    return head_part(rank * 4) + head_part(4 * k * 4) + head_part(n_vocab * 4);
}

PI_EXPORT int64_t pi_head_t1_scratch_bytes(int64_t n_vocab, int64_t rank, int64_t k) {
    const int64_t need = head_need(n_vocab, rank, k);
    return need < 0 ? -1 : need + PI_SCRATCH_ALIGN;
}

/* pi_head_t1(desc, x, u, logits, ids, m, left, err, best, scratch, scratch_bytes, n_threads, isa): x (n_embd) the
 * hidden state, u (n_embd) receives the final-normed one (x itself where desc->norm is 0); logits (n_vocab)
 * receives s with the candidates' exact values; ids (room for 4k int64) the candidates' ids in increasing order,
 * *m of them; *left the largest screen value left out, *err max |e - s| over the candidates and *best max e (NaN
 * when any value they take is NaN, as torch's max). */
PI_EXPORT int32_t pi_head_t1(const head_desc *d, const float *x, float *u, float *logits, int64_t *ids,
                             int64_t *m, float *left, float *err, float *best, void *scratch, int64_t scratch_bytes,
                             int32_t n_threads, int32_t isa) {
    if (d == NULL || x == NULL || u == NULL || logits == NULL || ids == NULL || m == NULL || left == NULL ||
        err == NULL || best == NULL || scratch == NULL || d->proj_matmul == NULL || d->screen_matmul == NULL || d->output_rows == NULL)
        return PI_ERR_SHAPE;
    const int64_t need = head_need(d->n_vocab, d->rank, d->k);
    if (need < 0 || d->n_embd <= 0 || d->k >= d->n_vocab) return PI_ERR_SHAPE;
    uint8_t *p;
    int32_t status = scratch_take(scratch, scratch_bytes, (size_t)need, &p);
    if (status != PI_OK) return status;
    float *z = (float *)p;
    float *exact = (float *)(p + head_part(d->rank * 4));
    float *sel_scratch = (float *)(p + head_part(d->rank * 4) + head_part(4 * d->k * 4));
    if (d->norm) {
        status = pi_rms_norm(x, 1, d->n_embd, d->n_embd, d->norm_weight, d->eps, u, d->n_embd);
        if (status != PI_OK) return status;
    } else {
        memmove(u, x, (size_t)d->n_embd * sizeof(float));
    }
    status = d->proj_matmul(d->proj, d->proj_stride, d->rank, d->n_embd, u, d->n_embd, 1, z, d->rank, n_threads, isa);
    if (status != PI_OK) return status;
    status = d->screen_r8 != NULL
                 ? pi_matvec_rows8(d->screen_type, d->screen_r8, d->n_vocab, d->rank, z, logits, n_threads, isa)
                 : d->screen_matmul(d->screen, d->screen_stride, d->n_vocab, d->rank, z, d->rank, 1, logits,
                                    d->n_vocab, n_threads, isa);
    if (status != PI_OK) return status;
    int64_t n_cand = 0;
    status = pi_top_about_k(logits, d->n_vocab, d->k, ids, &n_cand, left, sel_scratch, isa);
    if (status != PI_OK) return status;
    status = d->output_rows(d->output, d->output_stride, d->n_vocab, d->n_embd, ids, n_cand, u, d->n_embd, 1, exact,
                            n_cand, n_threads, isa);
    if (status != PI_OK) return status;
    float e_max = -INFINITY, b_max = -INFINITY;
    int nan_err = 0, nan_best = 0;
    for (int64_t c = 0; c < n_cand; c++) {
        const float e = exact[c], diff = fabsf(e - logits[ids[c]]);
        nan_err |= isnan(diff);
        nan_best |= isnan(e);
        e_max = diff > e_max ? diff : e_max;
        b_max = e > b_max ? e : b_max;
        logits[ids[c]] = e;
    }
    *m = n_cand;
    *err = nan_err ? NAN : e_max;
    *best = nan_best ? NAN : b_max;
    return PI_OK;
}
