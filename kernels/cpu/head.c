/* The sparse output head's chain for one token (model/head.py's SparseHead): u = RMSNorm(x) (pi_rms_norm, where the
 * head's final norm is one; else the caller passes u), z = P u, s = A z, the candidates C (about k rows: every row at
 * or above a threshold sampled from s), their exact logits e = W_C u; while the screen's values leave more than
 * widen_mass of the probability outside the exact rows, the rows the screen ranks next (about wide[j] in all); the
 * exact values written over s, and what the head's safety check needs (the largest screen value left out, max
 * |e - s_C| and max e). The products are the kernels the caller would call one by one (pi_matmul_<type> and
 * pi_rows_matmul_<type> of its precision, passed in the descriptor); a screen of a rows8 type in the q8 precision may
 * come repacked by 8 rows (pi_matvec_rows8: the same bits, no per-call transpose of the short rows; 2x faster on
 * SmolLM2's 49152 x 256 screen). A step of several tokens computes the screen over all of them and then calls
 * pi_head_pick per token: the same bits as one token alone. One call instead of a dozen torch and ctypes calls a
 * token, with the selection sampled instead of exact and the widening's probability check in vectorized C: on
 * SmolLM2 at 1 thread the Python widening (exact top-k of 4096 and 8192 rows, two logsumexp) cost ~0.9 ms of a
 * 7.8 ms token.
 */
#include <math.h>

#include "common.h"

#define SIMD_SUFFIX scalar
#include "head_body.h"
#undef SIMD_SUFFIX

#define SIMD_BODY "head_body.h"
#include "simd_variants.h"

typedef float (*head_max_fn)(const float *s, int64_t n);
typedef float (*head_exp_sum_fn)(const float *s, int64_t n, float shift);

static const struct {
    head_max_fn max;
    head_exp_sum_fn exp_sum;
} head_variants[] = {
    [PI_ISA_SCALAR] = {head_max_scalar, head_exp_sum_scalar},
#if PI_X86
    [PI_ISA_AVX2] = {head_max_avx2, head_exp_sum_avx2},
    [PI_ISA_AVX512] = {head_max_avx512, head_exp_sum_avx512},
#endif
};

typedef int32_t (*head_matmul_fn)(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, const float *x,
                                  int64_t x_stride, int64_t T, float *y, int64_t y_stride, int32_t n_threads,
                                  int32_t isa);
typedef int32_t (*head_rows_fn)(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, const int64_t *idx,
                                int64_t M, const float *x, int64_t x_stride, int64_t T, float *y, int64_t y_stride,
                                int32_t n_threads, int32_t isa);

#define HEAD_MAX_WIDE 2

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
    /* widening: while the screen's values leave more than widen_mass of the probability outside the exact rows,
     * about wide[j] rows get exact values (j = 0 .. n_wide - 1 in turn, increasing, each over k) */
    float widen_mass;
    int64_t n_wide;
    int64_t wide[HEAD_MAX_WIDE];
} head_desc;

/* What one token's pick found (model/head.py's safety check and statistics read it). */
typedef struct {
    int64_t m;        /* exact rows: their ids in increasing order in the caller's ids */
    int64_t steps;    /* widening steps taken */
    int64_t new_rows; /* rows the widening added */
    int32_t whole;    /* 1: a set overflowed its room (a screen of many ties): the caller computes the whole head */
    float left;       /* the largest screen value left out */
    float err;        /* max |e - s| over the first k candidates */
    float best;       /* the largest exact logit */
} head_result;

int32_t pi_rms_norm(const float *x, int64_t T, int64_t D, int64_t x_stride, const float *w, float eps, float *out,
                    int64_t out_stride);
int32_t pi_matvec_rows8(int32_t type, const uint8_t *packed, int64_t N, int64_t K, const float *x, float *y,
                        int32_t n_threads, int32_t isa);
int32_t pi_top_k(const float *s, int64_t n, int64_t k, int64_t *idx, float *next, float *scratch);
int32_t pi_sampled_key(const float *s, int64_t n, int64_t k, float *scratch, uint32_t *key);
int64_t pi_select_at_least(const float *s, int64_t n, uint32_t lo, int64_t cap, int64_t *idx, float *next,
                           int32_t isa);

static inline int64_t head_part(int64_t bytes) { return (bytes + 63) / 64 * 64; }

/* the room of a set of about n rows: 4n (pi_top_about_k's); the most rows any set of the desc may hold */
static int64_t head_room(const head_desc *d) {
    int64_t most = d->k;
    for (int64_t j = 0; j < d->n_wide; j++) most = d->wide[j] > most ? d->wide[j] : most;
    return 4 * most;
}

static int head_valid(const head_desc *d) {
    if (d == NULL || d->proj_matmul == NULL || d->screen_matmul == NULL || d->output_rows == NULL) return 0;
    if (d->n_vocab <= 0 || d->n_vocab > INT32_MAX || d->n_embd <= 0 || d->rank <= 0 || d->rank > INT32_MAX)
        return 0;
    if (d->n_wide < 0 || d->n_wide > HEAD_MAX_WIDE || d->k <= 0 || (d->k + 15) / 16 > d->n_vocab / 16) return 0;
    int64_t prev = d->k;
    for (int64_t j = 0; j < d->n_wide; j++) {
        if (d->wide[j] <= prev || (d->wide[j] + 15) / 16 > d->n_vocab / 16) return 0;
        prev = d->wide[j];
    }
    return 1;
}

/* scratch (after its 64-byte aligned start): z (rank floats); two sets' exact values (room floats each); the second
 * set's ids and the fresh rows' ids (room int64 each); the fresh rows' values and the screen values set aside (room
 * floats each); the sample's n_vocab floats. Each part 64-byte aligned. */
static int64_t head_need(const head_desc *d) {
    const int64_t room = head_room(d);
    return head_part(d->rank * 4) + 4 * head_part(room * 4) + 2 * head_part(room * 8) + head_part(d->n_vocab * 4);
}

PI_EXPORT int64_t pi_head_scratch_bytes(const head_desc *d) {
    return head_valid(d) ? head_need(d) + PI_SCRATCH_ALIGN : -1;
}

/* the most ids a pick may list (the caller's ids buffer) */
PI_EXPORT int64_t pi_head_ids_room(const head_desc *d) { return head_valid(d) ? head_room(d) : -1; }

/* The share of probability the row's values leave outside its exact rows: the values are s with e[c] at ids[c]
 * (c < m). The exact rows' screen values are set aside in `saved` for the pass and put back. */
static float head_outside(const head_desc *d, float *s, const int64_t *ids, const float *e, int64_t m, float *saved,
                          int32_t level) {
    for (int64_t c = 0; c < m; c++) {
        saved[c] = s[ids[c]];
        s[ids[c]] = -INFINITY;
    }
    float mx = head_variants[level].max(s, d->n_vocab);
    const float e_max = head_variants[level].max(e, m);
    mx = e_max > mx ? e_max : mx;
    const float out = head_variants[level].exp_sum(s, d->n_vocab, mx); /* the set-aside rows add ~1e-38 each */
    const float in = head_variants[level].exp_sum(e, m, mx);
    for (int64_t c = 0; c < m; c++) s[ids[c]] = saved[c];
    return out / (out + in);
}

/* One token's rows, given u and its screen values s (n_vocab): the candidates (about k: every row at or above the
 * sampled threshold of pi_sampled_key, pi_top_k's exact k where more than 4k are), their exact logits; then, while
 * the probability outside the exact rows exceeds widen_mass, about wide[j] rows by the screen's values (each set
 * holds the last); the exact values written over s at the end. */
static int32_t head_pick(const head_desc *d, const float *u, float *s, int64_t *ids, head_result *r, uint8_t *p,
                         int32_t n_threads, int32_t isa) {
    const int64_t n = d->n_vocab, room = head_room(d);
    const int32_t level = pi_isa_clamp(isa);
    p += head_part(d->rank * 4); /* z */
    float *exact_a = (float *)p, *exact_b = (float *)(p + head_part(room * 4));
    p += 2 * head_part(room * 4);
    int64_t *ids_b = (int64_t *)p, *fresh = (int64_t *)(p + head_part(room * 8));
    p += 2 * head_part(room * 8);
    float *fresh_e = (float *)p, *saved = (float *)(p + head_part(room * 4));
    float *sel = (float *)(p + 2 * head_part(room * 4));
    memset(r, 0, sizeof *r);

    uint32_t lo;
    int32_t status = pi_sampled_key(s, n, d->k, sel, &lo);
    if (status != PI_OK) return status;
    int64_t m = pi_select_at_least(s, n, lo, 4 * d->k, ids, &r->left, isa);
    if (m > 4 * d->k) { /* ties: the exact k */
        m = d->k;
        status = pi_top_k(s, n, d->k, ids, &r->left, sel);
        if (status != PI_OK) return status;
    }
    status = d->output_rows(d->output, d->output_stride, n, d->n_embd, ids, m, u, d->n_embd, 1, exact_a, m, n_threads,
                            isa);
    if (status != PI_OK) return status;
    float e_max = -INFINITY, b_max = -INFINITY;
    int nan_err = 0, nan_best = 0;
    for (int64_t c = 0; c < m; c++) {
        const float e = exact_a[c], diff = fabsf(e - s[ids[c]]);
        nan_err |= isnan(diff);
        nan_best |= isnan(e);
        e_max = diff > e_max ? diff : e_max;
        b_max = e > b_max ? e : b_max;
    }
    int64_t *cur = ids, *next_ids = ids_b;
    float *cur_e = exact_a, *next_e = exact_b;
    for (int64_t j = 0; j < d->n_wide && d->widen_mass < 1.0f; j++) {
        if (head_outside(d, s, cur, cur_e, m, saved, level) <= d->widen_mass) break;
        status = pi_sampled_key(s, n, d->wide[j], sel, &lo);
        if (status != PI_OK) return status;
        float left;
        const int64_t m2 = pi_select_at_least(s, n, lo, 4 * d->wide[j], next_ids, &left, isa);
        /* the rows of the new set not exact yet (the set holds the last: its threshold is no higher) */
        int64_t n_fresh = 0, a = 0;
        if (m2 <= 4 * d->wide[j])
            for (int64_t i = 0; i < m2; i++) {
                if (a < m && cur[a] == next_ids[i])
                    a++;
                else
                    fresh[n_fresh++] = next_ids[i];
            }
        if (m2 > 4 * d->wide[j] || a != m) { /* ties past the room, or a set that does not hold the last */
            r->whole = 1;
            return PI_OK;
        }
        if (n_fresh > 0) {
            status = d->output_rows(d->output, d->output_stride, n, d->n_embd, fresh, n_fresh, u, d->n_embd, 1,
                                    fresh_e, n_fresh, n_threads, isa);
            if (status != PI_OK) return status;
        }
        for (int64_t i = 0, c = 0, f = 0; i < m2; i++) {
            if (c < m && cur[c] == next_ids[i]) {
                next_e[i] = cur_e[c++];
            } else {
                const float e = fresh_e[f++];
                nan_best |= isnan(e);
                b_max = e > b_max ? e : b_max;
                next_e[i] = e;
            }
        }
        int64_t *t = cur;
        cur = next_ids, next_ids = t;
        float *te = cur_e;
        cur_e = next_e, next_e = te;
        m = m2;
        r->left = left;
        r->steps++;
        r->new_rows += n_fresh;
    }
    for (int64_t c = 0; c < m; c++) s[cur[c]] = cur_e[c];
    if (cur != ids) memcpy(ids, cur, (size_t)m * sizeof(int64_t));
    r->m = m;
    r->err = nan_err ? NAN : e_max;
    r->best = nan_best ? NAN : b_max;
    return PI_OK;
}

/* pi_head_t1(desc, x, u, logits, ids, result, scratch, scratch_bytes, n_threads, isa): x (n_embd) the hidden state,
 * u (n_embd) receives the final-normed one (x itself where desc->norm is 0); logits (n_vocab) the screen's values
 * with the exact rows' logits written in; ids (pi_head_ids_room of them) the exact rows' ids in increasing order;
 * result the rest (head_result; NaN err or best when a value they take is NaN, as torch's max). */
PI_EXPORT int32_t pi_head_t1(const head_desc *d, const float *x, float *u, float *logits, int64_t *ids,
                             head_result *result, void *scratch, int64_t scratch_bytes, int32_t n_threads,
                             int32_t isa) {
    if (!head_valid(d) || x == NULL || u == NULL || logits == NULL || ids == NULL || result == NULL ||
        scratch == NULL)
        return PI_ERR_SHAPE;
    uint8_t *p;
    int32_t status = scratch_take(scratch, scratch_bytes, (size_t)head_need(d), &p);
    if (status != PI_OK) return status;
    float *z = (float *)p;
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
    return head_pick(d, u, logits, ids, result, p, n_threads, isa);
}

/* pi_head_pick(desc, u, s, ids, result, scratch, scratch_bytes, n_threads, isa): pi_head_t1 after its screen, for a
 * token whose final-normed state u and screen values s (n_vocab, overwritten as pi_head_t1's logits) the caller
 * computed (a step of several tokens: the screen's product over all of them, then each token's pick). */
PI_EXPORT int32_t pi_head_pick(const head_desc *d, const float *u, float *s, int64_t *ids, head_result *result,
                               void *scratch, int64_t scratch_bytes, int32_t n_threads, int32_t isa) {
    if (!head_valid(d) || u == NULL || s == NULL || ids == NULL || result == NULL || scratch == NULL)
        return PI_ERR_SHAPE;
    uint8_t *p;
    const int32_t status = scratch_take(scratch, scratch_bytes, (size_t)head_need(d), &p);
    if (status != PI_OK) return status;
    return head_pick(d, u, s, ids, result, p, n_threads, isa);
}
