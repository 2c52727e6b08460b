/* Internal interface of the sparse kernels (sparse.c), shared with the fused decode FFN (ffn.c): the weight kinds,
 * the rows_axpy context and its SIMD bodies, so the fused kernels sum the down rows exactly as rows_axpy does.
 * Nothing here is exported from the library.
 */
#ifndef POWERINFER_KERNELS_SPARSE_H
#define POWERINFER_KERNELS_SPARSE_H

#include <stddef.h>
#include <stdint.h>

#include "quants.h"
#include "matmul.h"

#define AXPY_UNIT 32   /* elements per work unit along D: one quant block, or 32 floats of an F32/F16 row */
#define AXPY_GROUP 8   /* T = 1: rows applied to a unit of y while it stays in registers */
#define AXPY_AHEAD 2   /* T = 1: groups of rows prefetched ahead */
#define AXPY_COEF_BLOCK 64 /* T = 1, coef_bf16 rows in the q8 precision: units whose coefficients are made at once */
#define AXPY_PAIRS_AHEAD 4 /* T = 1, coef_bf16 rows in the q8 precision: pairs of rows prefetched ahead */
#define AXPY_TILE_T 4  /* T > 1: tokens sharing one decode of each weight unit */

/* The weight kinds of the sparse and fused FFN kernels are type ids (enum pi_type, quants.h): the float types, the
 * block-32 types and the K-quants (quants.h's PI_FLOAT_TYPES, PI_BLOCK32_TYPES and PI_KQUANT_TYPES). */

#define KIND_CASE(name, type) case type:

/* block types: rows made of 32-element blocks (the others are plain float arrays or K-quant super-blocks) */
static inline int kind_is_block(int kind) {
    switch (kind) {
        PI_BLOCK32_TYPES(KIND_CASE) return 1;
        default: return 0;
    }
}

/* kinds with int8-activation tiles (tile_quant_fn): in the "q8" precision their products read x as int8 blocks of
 * 32 (act_q8), quantised once per vector */
static inline int kind_has_q8_tile(int kind) { return kind_is_block(kind); }

/* K-quant kinds: rows made of super-blocks of QK_K = 256, which are also their work units along D (a row length
 * that is not a multiple of 256 is a shape error) */
static inline int kind_is_kq(int kind) {
    switch (kind) {
        PI_KQUANT_TYPES(KIND_CASE) return 1;
        default: return 0;
    }
}

/* the kinds these kernels take: float, block-32 and K-quant types */
static inline int kind_ok(int kind) {
    switch (kind) {
        PI_FLOAT_TYPES(KIND_CASE) PI_BLOCK32_TYPES(KIND_CASE) PI_KQUANT_TYPES(KIND_CASE) return 1;
        default: return 0;
    }
}
#undef KIND_CASE

/* elements per work unit along D of a kind: AXPY_UNIT, or a whole super-block for the K-quants */
static inline int64_t axpy_unit_of(int kind) { return kind_is_kq(kind) ? QK_K : AXPY_UNIT; }

/* bytes of one work unit of a kind: a quant block, 32 floats of a float row, or a K-quant super-block */
static inline size_t axpy_unit_bytes(int kind) { return (size_t)type_row_bytes(kind, axpy_unit_of(kind)); }

/* Everything a thread needs; with T = 1 the rows with h != 0 are listed a chunk at a time (axpy_t1_units). */
typedef struct {
    const uint8_t *w;
    int64_t w_stride;
    const int64_t *idx; /* NULL: all rows */
    int64_t M;
    int64_t D;
    size_t unit_bytes; /* bytes of one unit of a row (a K-quant super-block for the K kinds) */
    const float *h;
    int64_t h_stride;
    int64_t T;
    float *y;
    int64_t y_stride;
    const uint8_t **act_rows; /* T == 1: a chunk of the rows with h != 0 */
    const float *act_h;       /* and their h */
    int64_t n_act;
    int accumulate; /* T == 1: add the chunk to y (else y starts from 0) */
    int64_t n_rows;         /* rows of the weight (the ids idx may hold): the chains split this range */
    int64_t row_lo, row_hi; /* the chain's rows (axpy_chains): axpy_t1_units and axpy_range_scalar take only the
                             * listed rows with an id in [row_lo, row_hi); T > 1 gets them through h */
    int coef_bf16;  /* rows of a coef_bf16 type (quants.h) in the q8 precision: bfloat16 coefficients */
    float h_min;    /* rows with |h| <= h_min are skipped as h = 0 is (0: only h = 0; NaN is never skipped): TEAL's
                     * input threshold on a transposed matrix (ops.InputSparseWeight) */
} axpy_ctx;

/* Rows of a coef_bf16 type (quants.h: the 4-bit type with offset 8) in the "q8" precision: y += c * (q - 8) per
 * element, the listed rows in order, with one coefficient per row and unit, c = bf16(h * d): h * d rounded to float, then to bfloat16 to nearest even (a
 * subnormal c is 0). c * (q - 8) is exact in float (8 significant bits times 4), so each step rounds once, and
 * the chain is the same whether a float FMA applies one row at a time or AVX512-BF16's vdpbf16ps applies a pair
 * (which adds its odd lane's product first, then the even lane's: the pair's first row goes in the odd lane).
 * Every variant gives the same bits; the products of rows of 32 elements run at twice the rate of the float path
 * (vdpbf16ps: 32 multiply-adds per instruction), and the coefficient's rounding (at most 2^-8 relative) is smaller than
 * the int8 activation blocks' of the q8 matmuls. */
static inline uint16_t bf16_round(float p) {
    uint32_t u;
    memcpy(&u, &p, sizeof u);
    if ((u & 0x7F800000u) == 0) return (uint16_t)((u >> 16) & 0x8000u); /* zero or subnormal: a signed zero */
    if ((u & 0x7F800000u) == 0x7F800000u) return (uint16_t)((u >> 16) | ((u & 0xFFFFu) ? 0x40u : 0u)); /* inf, NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline uint16_t axpy_coef_bf16(float h, uint16_t d) { return bf16_round(h * fp16_to_fp32(d)); }

/* nonzero when this CPU's vdpbf16ps has the chain above (checked once at load); the AVX-512 variant then uses it */
int axpy_bf16_dot_ok(void);

typedef void (*axpy_units_fn)(int kind, const axpy_ctx *c, int64_t u0, int64_t u1);

/* PI_OK when every idx[m] (m < M) is in [0, N) (idx NULL: M must equal N), else PI_ERR_INDEX / PI_ERR_SHAPE. */
int32_t check_ids(const int64_t *idx, int64_t M, int64_t N);

/* Elements [e0, e1) of y for every token, the plain definition (the partial last unit of F32/F16/BF16 rows). */
void axpy_range_scalar(int kind, const axpy_ctx *c, int64_t e0, int64_t e1);

/* The rows_axpy body of SIMD level `isa`, clamped to what the CPU has: full units [u0, u1) of y (units of
 * axpy_unit_of(kind) elements). */
axpy_units_fn axpy_units_for(int32_t isa);

/* T = 1, full units [u0, u1) of y: the rows with h != 0 in index order (c->h, c->idx, c->M), listed a chunk at a
 * time on the calling thread's stack; each element is the same FMA chain whatever the chunking. */
void axpy_t1_units(axpy_units_fn units, int kind, const axpy_ctx *c, int64_t u0, int64_t u1);

/* The sum over the listed rows is AXPY_CHAINS chains, fixed whatever the thread count and however the rows are
 * listed: chain p takes the listed rows with an id in [n_rows p / AXPY_CHAINS, n_rows (p + 1) / AXPY_CHAINS), in
 * list order, each element a chain of FMAs (or of bfloat16 coefficient steps) from 0, and y = ((chain 0 + chain 1)
 * + ...). A token's compact list of active rows (decode) and a prompt's list of every row with h = 0 where the token
 * is inactive give the same chains. With two or more threads each chain has threads of its own, which read whole
 * rows of their half of the matrix: a split of the output columns had every thread read part of every row, and each
 * core's prefetchers fetched the rest of the row too, so both cores pulled the whole matrix (measured on the 2-core
 * EPYC, 12 matrices of 5632 rows of 1152 bytes, a plain read: 1 thread 0.276 ms a matrix, 2 threads on half of each
 * row 0.691, 2 threads on half of the rows 0.175; docs/sparsity.md). */
#define AXPY_CHAINS 2

/* Bytes of the scratch axpy_chains needs for T tokens of D outputs over a list of M rows: the chains after the
 * first, and for T > 1 each chain's copy of h with the other chains' rows at 0 */
static inline size_t axpy_chains_scratch(int64_t T, int64_t D, int64_t M) {
    return (size_t)(AXPY_CHAINS - 1) * (size_t)T * (size_t)D * sizeof(float) +
           (T > 1 ? (size_t)AXPY_CHAINS * (size_t)T * (size_t)M * sizeof(float) : 0);
}

/* T > 1: chain p's h (T x M, stride M) at scratch + (AXPY_CHAINS - 1) T D floats + p T M, filled from c->h; once,
 * before the threads of axpy_chains start */
void axpy_chains_prepare(const axpy_ctx *c, float *scratch);

/* Thread `me` of a team of `all` (all = 1 outside a parallel region): its share of every chain of c into c->y (chain
 * 0) and the scratch (the others), then, after a barrier of the team, its share of the sum into c->y. Every thread
 * of the team must call it. */
void axpy_chains(axpy_units_fn units, int kind, const axpy_ctx *c, float *scratch, int64_t me, int64_t all);

/* ---- shared with the fused decode kernels (ffn.c, layer.c) ---- */

/* rows longer than this go through the float dot products one at a time: interleaving several long rows halves the
 * DRAM throughput (measured on a 2-core EPYC: the 22 gate matrices of a 1.1B model of a 4-bit block type, one token,
 * 45 ms with 4 rows per call against 27 ms one row at a time), as for the dense matvec (matmul.c) */
#define FFN_DOT_MAX_ROW 512

enum ffn_act { ACT_RELU = 0, ACT_SILU = 1, ACT_GELU = 2, ACT_GELU_TANH = 3, ACT_LAST = ACT_GELU_TANH };

typedef struct {
    const uint8_t *w;
    int64_t stride;
    int64_t row_bytes;
    rows_dot_fn dot;   /* float activations */
    tile_quant_fn tq;  /* int8 activations ("q8" precision, kind_has_q8_tile kinds); NULL otherwise */
    rows_q8_fn rows;   /* with tq: consecutive rows in one call, tq's bits (NULL: tq row by row) */
} ffn_mat;

/* bytes of a row of K elements of a kind (K a multiple of its block: check_weight) */
static inline int64_t row_bytes_of(int kind, int64_t K) { return type_row_bytes(kind, K); }

static inline ffn_mat ffn_mat_of(const matmul_table *t, int kind, int q8, const uint8_t *w, int64_t stride, int64_t K) {
    /* the K-quants have float activations in both precisions here (their q8 matvec is kq8_rows, matmul_q8k.c) */
    const type_kernels *k = &t->types[kind];
    return (ffn_mat){.w = w, .stride = stride, .row_bytes = row_bytes_of(kind, K), .dot = k->dot,
                     .tq = q8 ? k->tile_q8 : NULL, .rows = q8 ? k->rows_q8 : NULL};
}

/* y[n] = rows n of f . x for n in [n0, n1), consecutive rows of one token (a dense matrix read in order), with the
 * arithmetic of ffn_dot / rows_matmul for the precision whatever the grouping: the int8 tiles (a: x quantised,
 * f->tq set) prefetch as they read (act_q8.ahead = MATVEC_STREAM_AHEAD), the float kinds (F32, F16, BF16) too
 * (rows_dot_fn's ahead), the other kinds take whole rows MATVEC_AHEAD_BYTES ahead; rows longer than
 * FFN_DOT_MAX_ROW one per call. */
static inline void ffn_mat_matvec(const ffn_mat *f, int kind, const act_q8 *a, const float *x, int64_t K, int64_t n0,
                                  int64_t n1, float *y) {
    if (f->tq != NULL) {
        act_q8 al = *a;
        al.ahead = MATVEC_STREAM_AHEAD;
        if (f->rows != NULL)
            f->rows(f->w + n0 * f->stride, f->stride, NULL, 0, n1 - n0, &al, NULL, y + n0, NULL);
        else
            for (int64_t n = n0; n < n1; n++) f->tq(f->w + n * f->stride, &al, 0, 1, y + n);
        return;
    }
    const int stream = kind == PI_TYPE_F32 || kind == PI_TYPE_F16 || kind == PI_TYPE_BF16;
    const int64_t ahead = stream ? 0 : matvec_rows_ahead(f->row_bytes);
    const int group = f->row_bytes > FFN_DOT_MAX_ROW ? 1 : ROWS_DOT_MAX;
    for (int64_t n = n0; n < n1; n += group) {
        const int R = (int)min_i64(group, n1 - n);
        const uint8_t *rows[ROWS_DOT_MAX];
        for (int r = 0; r < R; r++) {
            rows[r] = f->w + (n + r) * f->stride;
            if (ahead > 0 && n + r + ahead < n1) prefetch_bytes(rows[r] + ahead * f->stride, f->row_bytes);
        }
        f->dot(rows, R, K, x, y + n, stream ? MATVEC_STREAM_AHEAD : 0);
    }
}

/* torch.relu: NaN stays NaN */
static inline float relu_f(float x) { return x > 0.0f || x != x ? x : 0.0f; }

/* The FFN activation (enum ffn_act), in the operation order of torch's CPU kernels (aten/src/ATen/native/cpu/
 * Activation.cpp): silu x / (1 + exp(-x)); gelu x * 0.5 * (1 + erf(x / sqrt 2)); gelu_tanh
 * 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))). -ffp-contract=off: every operation rounds. */
static inline float ffn_act(int act, float x) {
    switch (act) {
        case ACT_SILU: return x / (1.0f + expf(-x));
        case ACT_GELU: return x * 0.5f * (1.0f + erff(x * 0.70710678118654752440f));
        case ACT_GELU_TANH: {
            const float cube = x * x * x;
            const float inner = 0.79788456080286535588f * (x + 0.044715f * cube);
            return 0.5f * x * (1.0f + tanhf(inner));
        }
        default: return relu_f(x);
    }
}

/* A weight of n_rows rows of len elements of `kind`, stride bytes apart: a known kind, whole blocks (super-blocks
 * of 256 for the K-quants), rows that do not overlap, and a buffer when it has rows. The row size every later
 * pointer is computed from (row_bytes_of) follows from the kind and len, so it is checked here first. */
static inline int32_t check_weight(int32_t kind, int64_t n_rows, int64_t len, const uint8_t *w, int64_t stride) {
    if (!kind_ok(kind)) return PI_ERR_SHAPE;
    if (kind_is_block(kind) && len % QK != 0) return PI_ERR_SHAPE;
    if (kind_is_kq(kind) && len % QK_K != 0) return PI_ERR_SHAPE;
    if (!stride_ok(n_rows, stride, row_bytes_of(kind, len))) return PI_ERR_SHAPE;
    return n_rows > 0 && w == NULL ? PI_ERR_SHAPE : PI_OK;
}

/* ffn.c: the predictor and the fused sparse FFN of one token (layer.c's sparse FFN block calls it) */
int64_t pi_predict_ffn_scratch_bytes(int64_t N, int64_t K, int64_t rank, int32_t q8_act);
int32_t pi_predict_ffn(const float *x, const float *u, int64_t K, int64_t D, int64_t N, const uint8_t *fc1,
                       int64_t fc1_stride, int32_t fc1_kind, int64_t rank, const uint8_t *fc2, int64_t fc2_stride,
                       int32_t fc2_kind, float threshold, const uint8_t *gate, int64_t gate_stride, int32_t gate_kind,
                       const uint8_t *up, int64_t up_stride, int32_t up_kind, const uint8_t *down, int64_t down_stride,
                       int32_t down_kind, int32_t act, int32_t relu_up, int32_t q8_act, int64_t *idx, int64_t *n_active,
                       double *predictor_seconds, float *y, void *scratch, int64_t scratch_bytes, int32_t n_threads,
                       int32_t isa);

/* ffn.c: pi_cats_ffn with `dense` != 0 running every candidate (no thresholds read, no second stage); the CATS
 * FFN block (layer.c) calls it */
int32_t cats_ffn_run(const float *u, int64_t K, int64_t D, int64_t N, const uint8_t *gate, int64_t gate_stride,
                     int32_t gate_kind, const uint8_t *up, int64_t up_stride, int32_t up_kind, const uint8_t *down,
                     int64_t down_stride, int32_t down_kind, const int64_t *cand, int64_t C, const float *thresholds,
                     const float *out_thresholds, int dense, int32_t act, int32_t relu_up, int32_t q8_act, int64_t *idx,
                     int64_t *n_active, int64_t *n_up, float *y, void *scratch, int64_t scratch_bytes,
                     int32_t n_threads, int32_t isa);
int64_t pi_cats_ffn_scratch_bytes(int64_t C, int64_t K, int32_t q8_act);

#endif
