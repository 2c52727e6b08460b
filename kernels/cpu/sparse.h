/* Internal interface of the sparse kernels (sparse.c), shared with the fused decode FFN (ffn.c): the weight kinds,
 * the rows_axpy context and its SIMD bodies, so the fused kernels sum the down rows exactly as rows_axpy does.
 * Nothing here is exported from the library.
 */
#ifndef POWERINFER_KERNELS_SPARSE_H
#define POWERINFER_KERNELS_SPARSE_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "kquants.h"
#include "matmul.h"

#define AXPY_UNIT 32   /* elements per work unit along D: one quant block, or 32 floats of an F32/F16 row */
#define AXPY_GROUP 8   /* T = 1: rows applied to a unit of y while it stays in registers */
#define AXPY_AHEAD 2   /* T = 1: groups of rows prefetched ahead */
#define AXPY_TILE_T 4  /* T > 1: tokens sharing one decode of each weight unit */

enum axpy_kind { KIND_Q4_0 = 0, KIND_Q4_1 = 1, KIND_Q8_0 = 2, KIND_F32 = 3, KIND_F16 = 4, KIND_BF16 = 5,
                 KIND_Q5_0 = 6, KIND_Q5_1 = 7,
                 KIND_Q2_K = 8, KIND_Q3_K = 9, KIND_Q4_K = 10, KIND_Q5_K = 11, KIND_Q6_K = 12, KIND_LAST = KIND_Q6_K };

/* block types: rows made of 32-element blocks (the others are plain float arrays or K-quant super-blocks) */
static inline int kind_is_block(int kind) { return kind <= KIND_Q8_0 || kind == KIND_Q5_0 || kind == KIND_Q5_1; }

/* K-quant kinds: rows made of super-blocks of QK_K = 256, which are also their work units along D (a row length
 * that is not a multiple of 256 is a shape error) */
static inline int kind_is_kq(int kind) { return kind >= KIND_Q2_K && kind <= KIND_Q6_K; }

/* elements per work unit along D of a kind: AXPY_UNIT, or a whole super-block for the K-quants */
static inline int64_t axpy_unit_of(int kind) { return kind_is_kq(kind) ? QK_K : AXPY_UNIT; }

/* bytes of one K-quant super-block of a kind (0 for the other kinds) */
static inline size_t kq_block_bytes(int kind) {
    switch (kind) {
        case KIND_Q2_K: return sizeof(block_q2_k);
        case KIND_Q3_K: return sizeof(block_q3_k);
        case KIND_Q4_K: return sizeof(block_q4_k);
        case KIND_Q5_K: return sizeof(block_q5_k);
        case KIND_Q6_K: return sizeof(block_q6_k);
        default: return 0;
    }
}

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
} axpy_ctx;

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

#endif
