/* Internal interface of the matmul kernels (matmul.c), shared with the sparse kernels (sparse.c).
 *
 * Nothing here is exported from the library (-fvisibility=hidden): these are the tile function tables of the SIMD
 * variants and the drivers with an optional row list, so that sparse row selections run exactly the arithmetic of
 * the dense matmul.
 */
#ifndef POWERINFER_KERNELS_MATMUL_H
#define POWERINFER_KERNELS_MATMUL_H

#include <stddef.h>
#include <stdint.h>

#include "quants.h"

#define TILE_T 4  /* tokens per tile */
/* tokens per pass of the float kernels' few-token streaming tile (tile_stream_fn). Measured, SmolLM2 F32 from DRAM,
 * 1 thread, a step of 3 / 4 / 6 tokens through the decode stack: passes of 3 tokens 29.9 / 31.4 / 35.6 ms, of 4
 * 29.5 / 38.3 / 36.8, of 8 30.7 / 37.9 / 42.2 (four tokens a pass read the rows at a lower rate, cause not found) */
#define TILE_TS 3
_Static_assert(TILE_TS <= TILE_T, "the streaming tile runs the row tile's body");
#define TILE_N 16 /* rows per parallel work item */
#define TILE_TQ 8 /* tokens per tile of the exact-mode quant kernels */
#define TILE_T2 6 /* tokens per tile of the four-row float kernels (prompts; AVX2 in two passes of 3) */
/* one token over rows of at most this many blocks takes a type's panels of 8 rows where its entry says so
 * (type_kernels.tile8_short_rows; the tokens from which each type's panels pay are its entry's, matmul_types.h) */
#define TILE8_SHORT_ROW_BLOCKS 8
#define PANEL_MAX_BYTES_PER_BLOCK (17 * 32) /* a block of 8 rows in the panel of a tile8_quant_fn, at most */
#define PANEL16_BYTES_PER_BLOCK (10 * 64) /* a block of 16 rows in the panel of a tile16 (AVX-512) */

/* Token 0's last nb % 8 blocks as a whole group of 8 (act_pair_order, where nb % 8 != 0): their int8 activations
 * (qs), the same in pair order (qp), their {d, d sum} pairs (ds) and sums (isum), zero past the last block. The
 * one-token rows of the 4-bit and 8-bit block types (matmul_x86.h) run a row's last partial group as one more
 * group against it, reading only the row's own blocks: the zero lanes are the exact no-ops the tile's tail leaves,
 * so the bits are the tile's (a tail of 2 blocks, SmolLM2's 576-wide rows, cost more than a whole group;
 * docs/kernels.md). */
typedef struct {
    int8_t qs[8 * QK];
    int8_t qp[8 * QK];
    float ds[16];
    int32_t isum[8];
} act_tail;

/* Activations quantised per call; arrays indexed [t * K + k], [(t * nb + block) * 2] and [t * nb + block]. */
typedef struct {
    int8_t *qs;
    float *ds;     /* per block {d, d * sum(qs)}: scale and the sum term the types with a minimum need */
    int32_t *isum; /* sum(qs) over the block */
    int64_t K;
    int64_t nb;
    /* token 0's qs in pair order (act_pair_order), or NULL: the one-token rows of a 4-bit type read two blocks' nibbles with
     * one vector when it is there (the same integers, so the same results, as without it) */
    const int8_t *qp;
    const act_tail *tail; /* with qp: token 0's last partial group (act_tail), or NULL (none, or nb % 8 == 0) */
    /* != 0: the SIMD tiles of one token prefetch, as they read, the bytes this far from what they read, a few lines
     * per step: MATVEC_STREAM_AHEAD for a dense matrix read in order, the distance to a row further down the list
     * for scattered rows (ffn.c); 0: no prefetch in the tile */
    int64_t ahead;
    /* != 0: those prefetches fill L2 only (scattered listed rows, listed_ahead); 0: L1 (rows read in order) */
    int32_t ahead_l2;
} act_q8;

/* Token 0's int8 activations of the whole 8-block groups in pair order for the one-token 4-bit rows: blocks a, a + 1
 * as [a 0..15 | a+1 0..15] then [a 16..31 | a+1 16..31] (the low and the high nibbles of the two blocks' weights
 * side by side in one vector), and the last partial group as an act_tail. qp holds act_pair_bytes(K), 8-byte aligned. */
static inline void pair_order_blocks(const int8_t *x, int64_t n, int8_t *o) {
    for (int64_t b = 0; b + 1 < n; b += 2, x += 2 * QK, o += 2 * QK) {
        memcpy(o, x, 16);
        memcpy(o + 16, x + QK, 16);
        memcpy(o + 32, x + 16, 16);
        memcpy(o + 48, x + QK + 16, 16);
    }
}
static inline size_t act_pair_bytes(int64_t K) {
    return (((size_t)K + 63) & ~(size_t)63) + ((sizeof(act_tail) + 63) & ~(size_t)63);
}
static inline void act_pair_order(act_q8 *a, int8_t *qp) {
    const int64_t n = a->nb / 8 * 8, rest = a->nb - n;
    pair_order_blocks(a->qs, n, qp);
    a->qp = qp;
    a->tail = NULL;
    if (rest == 0) return;
    act_tail *t = (act_tail *)(qp + (((size_t)a->K + 63) & ~(size_t)63));
    memset(t, 0, sizeof *t);
    memcpy(t->qs, a->qs + n * QK, (size_t)rest * QK);
    pair_order_blocks(t->qs, rest + (rest & 1), t->qp); /* an odd last block pairs with a zero one */
    memcpy(t->ds, a->ds + 2 * n, (size_t)rest * 2 * sizeof(float));
    memcpy(t->isum, a->isum + n, (size_t)rest * sizeof(int32_t));
    a->tail = t;
}

typedef void (*quantize_act_fn)(const float *x, int64_t nb, int8_t *qs, float *ds, int32_t *isum);
typedef void (*tile_quant_fn)(const uint8_t *row, const act_q8 *a, int64_t t0, int ntok, float *out);
/* Eight rows (rows[0..7]) x T tokens into y[t * y_stride + r]; `panel`: nb * PANEL_MAX_BYTES_PER_BLOCK bytes,
 * 32-byte aligned. */
typedef void (*tile8_quant_fn)(const uint8_t *const *rows, const act_q8 *a, int64_t T, uint8_t *panel, float *y,
                               int64_t y_stride);
/* One token over n consecutive rows at w (stride bytes apart) into y[0..n): the bits of the type's tile_q8 at
 * ntok = 1 row by row (its prefetch too, a->ahead), the per-row work on the activations done once per call. w2 (or
 * NULL): a second matrix's n rows (stride2 apart, rows of the same length) against a2 (NULL: a) into y2, read side by
 * side with w's. */
typedef void (*rows_q8_fn)(const uint8_t *w, int64_t stride, const uint8_t *w2, int64_t stride2, int64_t n,
                           const act_q8 *a, const act_q8 *a2, float *y, float *y2);
typedef void (*tile_float_fn)(const uint8_t *row, int64_t K, const float *x, int64_t x_stride, int ntok, float *out);
/* One dense row x ntok <= TILE_TS tokens in one pass, as tile_float_fn computes each (the same bits), prefetching
 * `ahead` bytes past what it reads (0: none) */
typedef void (*tile_stream_fn)(const uint8_t *row, int64_t K, const float *x, int64_t x_stride, int ntok, float *out,
                               int64_t ahead);
/* Four rows x ntok <= TILE_T2 tokens into out[r * TILE_T2 + t], as the matching
 * tile_float_fn computes each (the same bits); each activation vector loaded feeds 4 rows, each weight vector
 * TILE_T2 tokens. Columns [k0, k1) only: k0 > 0 carries the accumulators on from `state` (TILE4_STATE_BYTES,
 * 64-byte aligned), k1 < K (k1 - k0 a multiple of TILE4_K_UNIT) leaves them there; the call with k1 = K writes out. */
typedef void (*tile_float4_fn)(const uint8_t *const *rows, int64_t K, int64_t k0, int64_t k1,
                               const float *x, int64_t x_stride, int ntok, void *state, float *out);
#define TILE4_STATE_BYTES (2 * 4 * TILE_T2 * 64)
#define TILE4_K_UNIT 32
/* One token, R <= ROWS_DOT_MAX rows at once: out[r] = rows[r] . x, each row with exactly the arithmetic of the
 * matching tile_float_fn at ntok = 1 (the rows only interleave, for instruction-level parallelism). */
/* R rows x one token into out[0..R); ahead != 0: the float kernels (F32, F16, BF16) prefetch, as they read, the bytes
 * this far from what they read (act_q8.ahead's rule: MATVEC_STREAM_AHEAD for a dense matrix read in order); the
 * others ignore it (their callers prefetch whole rows) */
typedef void (*rows_dot_fn)(const uint8_t *const *rows, int R, int64_t K, const float *x, float *out, int64_t ahead);

#define ROWS_DOT_MAX 4

/* The kernels of one weight type at one SIMD level; NULL where the type has none. */
typedef struct {
    tile_quant_fn tile_q8; /* int8 activations (act_q8): the "q8" precision of the block-32 types */
    rows_q8_fn rows_q8;    /* one token over consecutive rows, tile_q8's bits (NULL: tile_q8 row by row) */
    tile_float_fn tile;    /* float activations, ntok <= TILE_TQ: the float types, the exact kernel of the quant types */
    rows_dot_fn dot;       /* float activations, one token, R rows at once: the arithmetic of `tile` */
    tile_float4_fn tile4;  /* float types, prompts: 4 rows x TILE_T2 tokens (NULL: one row at a time) */
    tile_stream_fn tiles;  /* float types, a few tokens over dense rows: one pass a row (NULL: the tiles) */
    tile8_quant_fn tile8;  /* prompts by panels of 8 rows, the bits of tile_q8 (NULL: row by row) */
    tile8_quant_fn tile16; /* the same by 16 rows (AVX-512), where tile8 runs from tile8_min_t tokens (NULL: none) */
    /* when tile8 runs: from tile8_min_t tokens, or for one token over rows of at most TILE8_SHORT_ROW_BLOCKS blocks
     * where tile8_short_rows; only on rows of a multiple of tile8_nb_multiple blocks (0: any) */
    int32_t tile8_min_t, tile8_short_rows, tile8_nb_multiple;
} type_kernels;

/* Rows of block_coef4 (quants.h) repacked by 8 (pi_repack_rows8): per group of 8 rows and block, 4 vectors of 32
 * bytes (lane r of vector k: bytes 4k..4k+3 of row r's nibbles), then the 8 rows' d as halves */
#define R8_BLOCK_BYTES 144
/* one token over one group of 8 repacked rows (nb blocks each) into y[0..8) */
typedef void (*r8_fn)(const uint8_t *group, const act_q8 *a, float *y);

/* The traits table of one SIMD level: the activation quantiser and the kernels of every type, indexed by type id
 * (enum pi_type; a type without kernels here has an all-NULL entry). */
typedef struct {
    quantize_act_fn quantize_act;
    r8_fn r8; /* the q8 precision's one-token rows of the rows8 type (block_coef4), repacked by 8 */
    type_kernels types[PI_TYPE_COUNT];
} matmul_table;

/* The panels of 8 rows for the int8 tile `tile` (a tile_q8 of table's) at T tokens over rows of nb blocks, or NULL:
 * row by row (the type has none, or its entry's rule says they do not pay here). */
static inline tile8_quant_fn tile8_for(const matmul_table *table, tile_quant_fn tile, int64_t T, int64_t nb) {
    if (tile == NULL) return NULL;
    for (int i = 0; i < PI_TYPE_COUNT; i++) {
        const type_kernels *k = &table->types[i];
        if (k->tile_q8 != tile) continue;
        const int tokens_ok = T >= k->tile8_min_t || (k->tile8_short_rows && T == 1 && nb <= TILE8_SHORT_ROW_BLOCKS);
        const int rows_ok = k->tile8_nb_multiple <= 1 || nb % k->tile8_nb_multiple == 0;
        return tokens_ok && rows_ok ? k->tile8 : NULL;
    }
    return NULL;
}

/* The panels of 16 rows for `tile` at T tokens (where tile8_for gives panels of 8 from the type's tile8_min_t
 * tokens), or NULL: panels of 8 only. */
static inline tile8_quant_fn tile16_for(const matmul_table *table, tile_quant_fn tile, int64_t T, int64_t nb) {
    if (tile8_for(table, tile, T, nb) == NULL) return NULL;
    for (int i = 0; i < PI_TYPE_COUNT; i++) {
        const type_kernels *k = &table->types[i];
        if (k->tile_q8 == tile) return T >= k->tile8_min_t ? k->tile16 : NULL;
    }
    return NULL;
}

/* The one-token kernel over consecutive rows for the int8 tile `tile` (a tile_q8 of table's), or NULL: row by row. */
static inline rows_q8_fn rows_q8_for(const matmul_table *table, tile_quant_fn tile) {
    if (tile == NULL) return NULL;
    for (int i = 0; i < PI_TYPE_COUNT; i++)
        if (table->types[i].tile_q8 == tile) return table->types[i].rows_q8;
    return NULL;
}

/* Bytes of one input of K in the int8 precision as act_q8_prepare lays it out: K int8, the nb {d, d sum} pairs and
 * sums, then the K int8 in pair order */
static inline size_t act_q8_bytes(int64_t K) {
    return align_up((size_t)K) + align_up((size_t)(K / QK) * 12) + act_pair_bytes(K);
}

/* x (K) quantised into int8 blocks at buf (act_q8_bytes(K)), with its pair order, as the one-token kernels read it */
static inline void act_q8_prepare(const matmul_table *table, const float *x, int64_t K, uint8_t *buf, act_q8 *a) {
    const int64_t nb = K / QK;
    a->qs = (int8_t *)buf;
    a->ds = (float *)(buf + align_up((size_t)K));
    a->isum = (int32_t *)(a->ds + 2 * nb);
    a->K = K;
    a->nb = nb;
    a->ahead = 0;
    a->ahead_l2 = 0;
    table->quantize_act(x, nb, a->qs, a->ds, a->isum);
    act_pair_order(a, (int8_t *)(buf + align_up((size_t)K) + align_up((size_t)nb * 12)));
}

/* The scalar int8 tile of block-32 type `kind` through its integer view (quants.h, TYPE_TRAITS.ints), as
 * matmul.c's own: for the block-32 types whose kernels are matmul_q8k.c's (PI_KQ8_BLOCK32_TYPES). */
void tile_quant_scalar_of(int kind, const uint8_t *row, const act_q8 *a, int64_t t0, int ntok, float *out);

/* The tile functions of SIMD level `isa` (enum pi_isa), clamped to what the CPU has. */
const matmul_table *matmul_table_for(int32_t isa);

/* Row n of the weight used for output column n: rows[n], or n when rows is NULL (dense). */
static inline int64_t row_of(const int64_t *rows, int64_t n) { return rows != NULL ? rows[n] : n; }

/* Prefetch `bytes` of a row into the cache (rows of a sparse selection are scattered: the hardware prefetcher
 * does not see them coming). A prefetch never faults. */
static inline void prefetch_bytes(const uint8_t *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

#define ROWS_PREFETCH_AHEAD 2 /* rows ahead of the one being computed */
/* One token's listed rows (rows_matmul, T = 1): each tile prefetches, as it reads, the row this many places further
 * down the list at the same offset (act_q8.ahead), into L2 (listed_ahead), instead of whole rows ROWS_PREFETCH_AHEAD
 * ahead. Measured on the 2-core EPYC (1 thread, 12 matrices of 5632 x 2048 of a 4-bit block type from DRAM, q8, two
 * runs each; docs/kernels.md): into L1 4 rows ahead, a random quarter / half / three quarters of the rows
 * 0.26-0.29 / 0.45-0.50 / 0.57-0.60 ms, all rows listed 0.35-0.44, the dense matvec 0.36-0.44; into L2 8 rows ahead 0.20-0.23 / 0.31-0.34 / 0.35-0.42,
 * all listed 0.40-0.49, dense 0.40-0.43. A plain read of the same rows (no arithmetic) shows why: a random half
 * read in order with L1 prefetches took 1.7x the time of reading every row, with L2 prefetches 8 rows ahead 1.0x;
 * the hardware prefetchers fetch the gaps' lines too, so a random subset of short rows moves about the bytes of all
 * rows, and what it saves is the arithmetic of the rows skipped (docs/sparsity.md). */
#define ROWS_STREAM_AHEAD 8

/* One token's dense rows of the int8 tiles (act_q8.ahead): each step of a tile prefetches the lines this far past the
 * bytes it reads, so the requests stay spread over the row and DRAM sees a steady stream. Measured on a Xeon with
 * AVX-512 (1 thread, 225,280 rows of K = 2048 of a 4-bit block type from DRAM): whole rows 1-4 KB ahead 8.0-8.1 GB/s,
 * none 5.4, in-step 256 B ahead 12.0, 1 KB 13.0-13.7, 2 KB 13.7-14.4 (a plain read streams 13.7), 4 KB 9.8-12.0. */
#define MATVEC_STREAM_AHEAD 2048
static inline void prefetch_stream(const uint8_t *p, int64_t ahead, int64_t bytes) {
    if (ahead != 0) prefetch_bytes(p + ahead, bytes);
}
static inline void prefetch_bytes_l2(const uint8_t *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}
/* The int8 tiles' prefetch as they read: listed rows (act_q8.ahead_l2, the row ROWS_STREAM_AHEAD or FFN_STREAM_ROWS
 * down the list) into L2 only, a dense matrix read in order into L1 (into L2 it measured 1.4x slower, 0.59-0.61
 * against 0.36-0.44 ms in the measurement above). */
static inline void prefetch_act(const act_q8 *a, const uint8_t *p, int64_t bytes) {
    if (a->ahead == 0) return;
    if (a->ahead_l2)
        prefetch_bytes_l2(p + a->ahead, bytes);
    else
        prefetch_bytes(p + a->ahead, bytes);
}

/* One token's listed rows, `gap` ids between this row and the one `ahead_rows` down the list (0: none): a run of
 * consecutive ids (gap == ahead_rows) streams as the dense matvec does, 2 KB ahead into L1; other rows prefetch the
 * row down the list into L2 (streaming rows with gaps as dense ones measured 1.45x slower at 75% of the rows). */
static inline void listed_ahead(act_q8 *a, int64_t gap, int64_t ahead_rows, int64_t stride) {
    a->ahead_l2 = gap != ahead_rows;
    a->ahead = gap == ahead_rows ? MATVEC_STREAM_AHEAD : gap * stride;
}

/* One token's dense rows are prefetched this many bytes ahead: the compute per byte is high enough that the hardware
 * prefetcher alone leaves the DRAM idle between rows (measured: the bundled SmolLM2 file's decode, a 4-bit block type
 * with a minimum, 1 thread, ~20% less time a token with 4 KB than without; 2 KB and 8 KB in between). */
#define MATVEC_AHEAD_BYTES 4096
static inline int64_t matvec_rows_ahead(int64_t row_bytes) {
    return row_bytes > 0 ? (MATVEC_AHEAD_BYTES + row_bytes - 1) / row_bytes : 0;
}

/* Drivers: y[t * y_stride + n] = W[row_of(rows, n)] . x[t] for n < N. Row ids are not checked here. With a row
 * list, row_bytes > 0 prefetches the rows ROWS_PREFETCH_AHEAD ahead; dense (rows NULL) with one token, the rows
 * MATVEC_AHEAD_BYTES ahead. `table` is the variant of `tile` (the quant driver quantises the activations with it). */
int32_t matmul_quant_rows(const matmul_table *table, int64_t row_bytes, tile_quant_fn tile, const uint8_t *w,
                          int64_t w_stride, const int64_t *rows, int64_t N, int64_t K, const float *x,
                          int64_t x_stride, int64_t T, float *y, int64_t y_stride, int32_t n_threads);
int32_t matmul_float_rows(const matmul_table *table, int64_t row_bytes, tile_float_fn tile, const uint8_t *w,
                          int64_t w_stride, const int64_t *rows, int64_t N, int64_t K, const float *x,
                          int64_t x_stride, int64_t T, float *y, int64_t y_stride, int32_t n_threads);
int32_t matmul_quant_f_rows(const matmul_table *table, int64_t row_bytes, tile_float_fn tile, const uint8_t *w,
                            int64_t w_stride, const int64_t *rows, int64_t N, int64_t K, const float *x,
                            int64_t x_stride, int64_t T, float *y, int64_t y_stride, int32_t n_threads);

/* Activations of T tokens in int8 super-blocks of 256 (the "q8" precision of the K-quants): arrays indexed [t * K + k], [t * nb + s]
 * and [(t * nb + s) * 16 + g]. */
typedef struct {
    int8_t *qs;
    float *d;
    int16_t *bsums;
    int64_t K;
    int64_t nb;
} act_q8k;

/* One token of the K-quant "q8" matvec in parts (matmul_q8k.c), for the fused decode kernels: the bytes of its
 * int8 super-block activations (K a multiple of 256), their computation into buf, and out[r] = row r . a for n_rows rows at
 * w, w_stride bytes apart, of the K-quant `type` (enum pi_type): the arithmetic of its pi_matmul_<name>. */
size_t kq8_act_bytes(int64_t K);
/* nb super-blocks of x into qs (nb * 256), d (nb) and bsums (nb * 16): the activation quantiser of those kernels */
typedef void (*quantize_q8k_fn)(const float *x, int64_t nb, int8_t *qs, float *d, int16_t *bsums);
quantize_q8k_fn kq8_quantizer(int32_t level);
void kq8_act_prepare(int32_t level, const float *x, int64_t K, uint8_t *buf, act_q8k *a);
void kq8_rows(int32_t level, int type, const uint8_t *w, int64_t w_stride, int64_t n_rows, const act_q8k *a,
              float *out);

#endif
