/* The weight types of the kernels: their ids (ggml's type numbers), the block-32 layouts, one scalar decoder per
 * block-32 and float type (the K-quants' layouts and decoders are in kquants.h), and the traits table that gives
 * every type's block size and decoder, shared by get_rows.c, matmul.c and sparse.c. The kernels of a type at each
 * SIMD level are the per-ISA tables of matmul.c (matmul_table, matmul_types.h) and matmul_q8k.c (kq8_table,
 * matmul_q8k_types.h).
 *
 * All formats are little endian; fp16 is IEEE binary16. Blocks hold 32 elements (QK).
 *
 *   Q4_0  {fp16 d; uint8 qs[16]}          18 bytes  x[i] = ((qs[i] & 15) - 8) * d, x[i+16] = ((qs[i] >> 4) - 8) * d
 *   Q4_1  {fp16 d; fp16 m; uint8 qs[16]}  20 bytes  x[i] = (qs[i] & 15) * d + m,   x[i+16] = (qs[i] >> 4) * d + m
 *   Q8_0  {fp16 d; int8 qs[32]}           34 bytes  x[i] = qs[i] * d
 *   Q5_0  {fp16 d; u8 qh[4]; u8 qs[16]}   22 bytes  q[i] = (qs[i] & 15) | bit i of qh << 4, q[i+16] = (qs[i] >> 4) |
 *                                                   bit i+16 of qh << 4 (qh little endian); x = (q - 16) * d
 *   Q5_1  {fp16 d, m; u8 qh[4]; qs[16]}   24 bytes  q as Q5_0; x = q * d + m
 *
 * The decoders compute each element with the float operations of the reference dequantiser (one product, plus one
 * separately rounded add for Q4_1 / Q5_1: the build uses -ffp-contract=off), so their floats are bit-equal to it.
 * Every decoder has the signature of a row_decode_fn: K elements (whole blocks) of the row at `row` into y.
 */
#ifndef POWERINFER_KERNELS_QUANTS_H
#define POWERINFER_KERNELS_QUANTS_H

#include "common.h"
#include "kquants.h"

/* Weight type ids: ggml's type numbers (enum ggml_type, the GGUF tensor type), the `type` argument of the kernels
 * that take one (pi_ffn_rows, pi_predict_ffn, pi_quantize_rows, ...) and the index of the per-ISA traits tables. */
enum pi_type {
    PI_TYPE_F32 = 0,
    PI_TYPE_F16 = 1,
    PI_TYPE_Q4_0 = 2,
    PI_TYPE_Q4_1 = 3,
    PI_TYPE_Q5_0 = 6,
    PI_TYPE_Q5_1 = 7,
    PI_TYPE_Q8_0 = 8,
    PI_TYPE_Q2_K = 10,
    PI_TYPE_Q3_K = 11,
    PI_TYPE_Q4_K = 12,
    PI_TYPE_Q5_K = 13,
    PI_TYPE_Q6_K = 14,
    PI_TYPE_IQ4_NL = 20,
    PI_TYPE_IQ4_XS = 23,
    PI_TYPE_BF16 = 30,
    PI_TYPE_COUNT = 31, /* table size: ids are < PI_TYPE_COUNT */
};

/* The types with kernels, by family, as X(name, id) lists: name is the suffix of their symbols (pi_matmul_<name>,
 * decode_<name>, block_<name>, ...), id their PI_TYPE_. The kernel files instantiate their exported functions from
 * these lists; a new type is a row here, its layout, decoder and TYPE_TRAITS entry, and its kernels. */
#define PI_FLOAT_TYPES(X) X(f32, PI_TYPE_F32) X(f16, PI_TYPE_F16) X(bf16, PI_TYPE_BF16)
#define PI_BLOCK32_TYPES(X)                                                                                        \
    X(q4_0, PI_TYPE_Q4_0) X(q4_1, PI_TYPE_Q4_1) X(q5_0, PI_TYPE_Q5_0) X(q5_1, PI_TYPE_Q5_1) X(q8_0, PI_TYPE_Q8_0)
#define PI_KQUANT_TYPES(X)                                                                                         \
    X(q2_k, PI_TYPE_Q2_K) X(q3_k, PI_TYPE_Q3_K) X(q4_k, PI_TYPE_Q4_K) X(q5_k, PI_TYPE_Q5_K) X(q6_k, PI_TYPE_Q6_K)
#define PI_IQ4_TYPES(X) X(iq4_nl, PI_TYPE_IQ4_NL) X(iq4_xs, PI_TYPE_IQ4_XS) /* dense kernels only: matmul_q8k.c */
/* matmul_q8k.c's "q8" kernels: the types on int8 super-block activations (act_q8k), and the block-32 ones on the
 * int8 blocks of 32 of matmul.c (act_q8) whose kernels are there rather than in matmul.c's table */
#define PI_KQ8_TYPES(X) PI_KQUANT_TYPES(X) X(iq4_xs, PI_TYPE_IQ4_XS)
#define PI_KQ8_BLOCK32_TYPES(X) X(iq4_nl, PI_TYPE_IQ4_NL)

typedef void (*row_decode_fn)(const uint8_t *row, int64_t K, float *y);

typedef struct {
    uint16_t d;
    uint8_t qs[QK / 2];
} block_q4_0;

typedef struct {
    uint16_t d;
    uint16_t m;
    uint8_t qs[QK / 2];
} block_q4_1;

typedef struct {
    uint16_t d;
    int8_t qs[QK];
} block_q8_0;

typedef struct {
    uint16_t d;
    uint8_t qh[4];
    uint8_t qs[QK / 2];
} block_q5_0;

typedef struct {
    uint16_t d;
    uint16_t m;
    uint8_t qh[4];
    uint8_t qs[QK / 2];
} block_q5_1;

_Static_assert(sizeof(block_q5_0) == 22, "block_q5_0 must be 22 bytes");
_Static_assert(sizeof(block_q5_1) == 24, "block_q5_1 must be 24 bytes");
_Static_assert(sizeof(block_q4_0) == 18, "block_q4_0 must be 18 bytes");
_Static_assert(sizeof(block_q4_1) == 20, "block_q4_1 must be 20 bytes");
_Static_assert(sizeof(block_q8_0) == 34, "block_q8_0 must be 34 bytes");

/* The 32 five-bit values of a Q5 block, in element order. */
static inline void q5_values(const uint8_t *qh_bytes, const uint8_t *qs, int *q) {
    uint32_t qh;
    memcpy(&qh, qh_bytes, sizeof qh);
    for (int j = 0; j < QK / 2; j++) {
        q[j] = (qs[j] & 0x0F) | (int)(((qh >> j) & 1u) << 4);
        q[j + QK / 2] = (qs[j] >> 4) | (int)(((qh >> (j + QK / 2)) & 1u) << 4);
    }
}

/* ---- float types: one element per unit -------------------------------------------------------------------- */

static inline void decode_f32(const uint8_t *row, int64_t K, float *y) { memcpy(y, row, (size_t)K * sizeof(float)); }

static inline void decode_f16(const uint8_t *row, int64_t K, float *y) {
    for (int64_t k = 0; k < K; k++) {
        uint16_t h;
        memcpy(&h, row + 2 * k, sizeof h);
        y[k] = fp16_to_fp32(h);
    }
}

static inline void decode_bf16(const uint8_t *row, int64_t K, float *y) {
    for (int64_t k = 0; k < K; k++) {
        uint16_t h;
        memcpy(&h, row + 2 * k, sizeof h);
        y[k] = bf16_to_fp32(h);
    }
}

/* ---- block-32 types ---------------------------------------------------------------------------------------- */

static inline void decode_q4_0(const uint8_t *row, int64_t K, float *y) {
    const block_q4_0 *blocks = (const block_q4_0 *)row;
    for (int64_t i = 0; i < K / QK; i++) {
        const float d = fp16_to_fp32(blocks[i].d);
        for (int j = 0; j < QK / 2; j++) {
            y[i * QK + j] = (float)((blocks[i].qs[j] & 0x0F) - 8) * d;
            y[i * QK + j + QK / 2] = (float)((blocks[i].qs[j] >> 4) - 8) * d;
        }
    }
}

static inline void decode_q4_1(const uint8_t *row, int64_t K, float *y) {
    const block_q4_1 *blocks = (const block_q4_1 *)row;
    for (int64_t i = 0; i < K / QK; i++) {
        const float d = fp16_to_fp32(blocks[i].d);
        const float m = fp16_to_fp32(blocks[i].m);
        for (int j = 0; j < QK / 2; j++) {
            y[i * QK + j] = d * (float)(blocks[i].qs[j] & 0x0F) + m;
            y[i * QK + j + QK / 2] = d * (float)(blocks[i].qs[j] >> 4) + m;
        }
    }
}

static inline void decode_q8_0(const uint8_t *row, int64_t K, float *y) {
    const block_q8_0 *blocks = (const block_q8_0 *)row;
    for (int64_t i = 0; i < K / QK; i++) {
        const float d = fp16_to_fp32(blocks[i].d);
        for (int j = 0; j < QK; j++) y[i * QK + j] = (float)blocks[i].qs[j] * d;
    }
}

static inline void decode_q5_0(const uint8_t *row, int64_t K, float *y) {
    const block_q5_0 *blocks = (const block_q5_0 *)row;
    for (int64_t i = 0; i < K / QK; i++) {
        const float d = fp16_to_fp32(blocks[i].d);
        int q[QK];
        q5_values(blocks[i].qh, blocks[i].qs, q);
        for (int j = 0; j < QK; j++) y[i * QK + j] = (float)(q[j] - 16) * d;
    }
}

static inline void decode_q5_1(const uint8_t *row, int64_t K, float *y) {
    const block_q5_1 *blocks = (const block_q5_1 *)row;
    for (int64_t i = 0; i < K / QK; i++) {
        const float d = fp16_to_fp32(blocks[i].d);
        const float m = fp16_to_fp32(blocks[i].m);
        int q[QK];
        q5_values(blocks[i].qh, blocks[i].qs, q);
        for (int j = 0; j < QK; j++) y[i * QK + j] = d * (float)q[j] + m;
    }
}

/* ---- block-32 types as integers: block i of a row, its 32 integer weights q in element order (stored offset by
 * the type's int8_offset: unsigned for the Q4/Q5 types, signed for Q8_0), scale d and minimum m (0 where the type has
 * none). The scalar int8 ("q8") kernels compute on these; x = (q - int8_offset) * d + m. ----------------------- */

typedef void (*block_ints_fn)(const uint8_t *row, int64_t i, int *q, float *d, float *m);

static inline void q4_values(const uint8_t *qs, int *q) {
    for (int j = 0; j < QK / 2; j++) {
        q[j] = qs[j] & 0x0F;
        q[j + QK / 2] = qs[j] >> 4;
    }
}

static inline void ints_q4_0(const uint8_t *row, int64_t i, int *q, float *d, float *m) {
    const block_q4_0 *b = (const block_q4_0 *)row + i;
    q4_values(b->qs, q);
    *d = fp16_to_fp32(b->d);
    *m = 0.0f;
}

static inline void ints_q4_1(const uint8_t *row, int64_t i, int *q, float *d, float *m) {
    const block_q4_1 *b = (const block_q4_1 *)row + i;
    q4_values(b->qs, q);
    *d = fp16_to_fp32(b->d);
    *m = fp16_to_fp32(b->m);
}

static inline void ints_q8_0(const uint8_t *row, int64_t i, int *q, float *d, float *m) {
    const block_q8_0 *b = (const block_q8_0 *)row + i;
    for (int j = 0; j < QK; j++) q[j] = b->qs[j];
    *d = fp16_to_fp32(b->d);
    *m = 0.0f;
}

static inline void ints_q5_0(const uint8_t *row, int64_t i, int *q, float *d, float *m) {
    const block_q5_0 *b = (const block_q5_0 *)row + i;
    q5_values(b->qh, b->qs, q);
    *d = fp16_to_fp32(b->d);
    *m = 0.0f;
}

static inline void ints_q5_1(const uint8_t *row, int64_t i, int *q, float *d, float *m) {
    const block_q5_1 *b = (const block_q5_1 *)row + i;
    q5_values(b->qh, b->qs, q);
    *d = fp16_to_fp32(b->d);
    *m = fp16_to_fp32(b->m);
}

/* IQ4_NL (kquants.h): the table values kv[index], signed as Q8_0's, no offset */
static inline void ints_iq4_nl(const uint8_t *row, int64_t i, int *q, float *d, float *m) {
    const block_iq4_nl *b = (const block_iq4_nl *)row + i;
    for (int j = 0; j < QK / 2; j++) {
        q[j] = kvalues_iq4[b->qs[j] & 0x0F];
        q[j + QK / 2] = kvalues_iq4[b->qs[j] >> 4];
    }
    *d = fp16_to_fp32(b->d);
    *m = 0.0f;
}

/* The blocks of every coef_bf16 type (the traits below): 32 4-bit values q, element j < 16 the low nibble of qs[j],
 * j >= 16 the high nibble of qs[j - 16], w = (q - int8_offset) * d, no minimum. The sparse "q8" kernels read the
 * units of those types through this layout (sparse.c, sparse_x86.h); a type with another layout cannot set it. */
typedef block_q4_0 block_coef4;

/* ---- traits of every type ---------------------------------------------------------------------------------- */

typedef struct {
    int32_t block_elems; /* elements per block: 1 (float types), QK or QK_K; 0: no such type */
    int32_t block_bytes;
    row_decode_fn decode; /* to the reference dequantiser's floats */
    /* block-32 types (IQ4_NL's too): the integer view of a block (block_ints_fn), the offset its q are stored with
     * and whether it has a minimum m; NULL / 0 for the others */
    block_ints_fn ints;
    int32_t int8_offset;
    int32_t has_min;
    /* 1: its sparse rows in the "q8" precision take bfloat16 coefficients c = bf16(h * d) (sparse.h, coef_bf16);
     * its blocks are block_coef4's */
    int32_t coef_bf16;
} type_traits;

static const type_traits TYPE_TRAITS[PI_TYPE_COUNT] = {
    [PI_TYPE_F32] = {1, 4, decode_f32},
    [PI_TYPE_F16] = {1, 2, decode_f16},
    [PI_TYPE_BF16] = {1, 2, decode_bf16},
    [PI_TYPE_Q4_0] = {QK, sizeof(block_q4_0), decode_q4_0, ints_q4_0, .int8_offset = 8, .coef_bf16 = 1},
    [PI_TYPE_Q4_1] = {QK, sizeof(block_q4_1), decode_q4_1, ints_q4_1, .has_min = 1},
    [PI_TYPE_Q5_0] = {QK, sizeof(block_q5_0), decode_q5_0, ints_q5_0, .int8_offset = 16},
    [PI_TYPE_Q5_1] = {QK, sizeof(block_q5_1), decode_q5_1, ints_q5_1, .has_min = 1},
    [PI_TYPE_Q8_0] = {QK, sizeof(block_q8_0), decode_q8_0, ints_q8_0},
    [PI_TYPE_Q2_K] = {QK_K, sizeof(block_q2_k), decode_q2_k},
    [PI_TYPE_Q3_K] = {QK_K, sizeof(block_q3_k), decode_q3_k},
    [PI_TYPE_Q4_K] = {QK_K, sizeof(block_q4_k), decode_q4_k},
    [PI_TYPE_Q5_K] = {QK_K, sizeof(block_q5_k), decode_q5_k},
    [PI_TYPE_Q6_K] = {QK_K, sizeof(block_q6_k), decode_q6_k},
    [PI_TYPE_IQ4_NL] = {QK, sizeof(block_iq4_nl), decode_iq4_nl, ints_iq4_nl},
    [PI_TYPE_IQ4_XS] = {QK_K, sizeof(block_iq4_xs), decode_iq4_xs},
};

/* 1 when `type` is an id of the table (whatever its source: the ids come from callers) */
static inline int type_known(int32_t type) {
    return type >= 0 && type < PI_TYPE_COUNT && TYPE_TRAITS[type].block_elems > 0;
}

/* 1 when sparse rows of `type` in the "q8" precision take bfloat16 coefficients (any id, checked) */
static inline int type_coef_bf16(int32_t type) { return type_known(type) && TYPE_TRAITS[type].coef_bf16; }

/* bytes of a row of K elements (K a multiple of the type's block) */
static inline int64_t type_row_bytes(int32_t type, int64_t K) {
    return K / TYPE_TRAITS[type].block_elems * TYPE_TRAITS[type].block_bytes;
}

#endif
