/* matmul: y[t, n] = sum_k W[n, k] * x[t, k] for T tokens, W given as raw ggml rows.
 *
 * The block-32 types (PI_BLOCK32_TYPES) quantise the activations once per call into int8 blocks of 32
 * (x ~= d * q, |q| <= 127, plus sum(q) per block) and compute integer block dot products scaled per block:
 *   d_w * d_x * (q_w . q_x - offset * sum(q_x)) [+ m_w * d_x * sum(q_x)]
 * with the type's integer view q_w, int8_offset and minimum (quants.h, TYPE_TRAITS). Float types use float FMA
 * directly.
 *
 * Exact mode (pi_matmul_<type>_f, quant types only): the activations stay float32. Each weight block is decoded
 * in registers to the floats of the reference dequantiser (bit-equal, but for the one AVX2 decoder quants_x86.h
 * says is within 1 ulp) and multiplied
 * with x in float32 (FMA), so the result equals x @ dequant(W).T up to float summation order, like F32/F16 (and
 * like transformers). Nothing is
 * dequantised to memory. Token tiles are TILE_TQ wide there: the block decode is shared by more tokens.
 *
 * Work is split over blocks of TILE_N rows; inside a block, tokens are taken TILE_T at a time, and each weight
 * block is decoded once per token tile and used for all its tokens (T = 1 is the decode matvec).
 *
 * The SIMD variant (scalar, AVX2+FMA+F16C, AVX-512+VNNI) is the caller's `isa` argument on every call, clamped to
 * what the CPU has: nothing is selected globally, so two callers may run different variants side by side. Off
 * x86-64 only the scalar variant is built (common.h, PI_X86).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "quants.h"
#include "matmul.h"

/* ---- scalar fallback ---------------------------------------------------------------------------------------- */

static void quantize_act_scalar(const float *x, int64_t nb, int8_t *qs, float *ds, int32_t *isum) {
    for (int64_t i = 0; i < nb; i++) {
        const float *xb = x + i * QK;
        float am = 0.0f;
        for (int j = 0; j < QK; j++) am = fmaxf(am, fabsf(xb[j]));
        const float inv = am != 0.0f ? 127.0f / am : 0.0f;
        int32_t total = 0;
        for (int j = 0; j < QK; j++) {
            const int32_t q = (int32_t)rintf(xb[j] * inv);
            qs[i * QK + j] = (int8_t)q;
            total += q;
        }
        ds[2 * i] = am / 127.0f;
        ds[2 * i + 1] = ds[2 * i] * (float)total;
        isum[i] = total;
    }
}

/* The int8 tile of a block-32 type, one block at a time (its integer view, quants.h: block_ints_fn): the integer
 * dot of q with x, minus int8_offset * sum(x) where the values are stored offset, times d_w * d_x; the types with a
 * minimum add m * d_x * sum(x) apart. */
static void tile_quant_scalar(int kind, const uint8_t *row, const act_q8 *a, int64_t t0, int ntok, float *out) {
    const type_traits *tt = &TYPE_TRAITS[kind];
    const int offset = tt->int8_offset, has_m = tt->has_min;
    for (int t = 0; t < ntok; t++) {
        const int8_t *xq = a->qs + (t0 + t) * a->K;
        const float *xds = a->ds + (t0 + t) * a->nb * 2;
        const int32_t *xi = a->isum + (t0 + t) * a->nb;
        float acc = 0.0f, bias = 0.0f;
        for (int64_t i = 0; i < a->nb; i++) {
            int q[QK];
            float d, m;
            tt->ints(row, i, q, &d, &m);
            int32_t dot = 0;
            for (int j = 0; j < QK; j++) dot += q[j] * xq[i * QK + j];
            acc += (float)(dot - offset * xi[i]) * (d * xds[2 * i]);
            if (has_m) bias += m * xds[2 * i + 1];
        }
        out[t] = has_m ? acc + bias : acc;
    }
}

/* the offset of the rows8 type's 4-bit values (block_coef4: q - 8) */
#define ROWS8_OFFSET 8

/* Eight repacked block_coef4 rows (pi_repack_rows8) x one token: each row tile_quant_scalar's arithmetic */
static void r8_coef4_scalar(const uint8_t *g, const act_q8 *a, float *y) {
    for (int r = 0; r < 8; r++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < a->nb; i++) {
            const uint8_t *blk = g + i * R8_BLOCK_BYTES;
            int32_t dot = 0;
            for (int k = 0; k < 4; k++)
                for (int j = 0; j < 4; j++) {
                    const uint8_t byte = blk[32 * k + 4 * r + j];
                    dot += (byte & 0x0F) * a->qs[i * QK + 4 * k + j] + (byte >> 4) * a->qs[i * QK + 16 + 4 * k + j];
                }
            uint16_t dh;
            memcpy(&dh, blk + 128 + 2 * r, sizeof dh);
            acc += (float)(dot - ROWS8_OFFSET * a->isum[i]) * (fp16_to_fp32(dh) * a->ds[2 * i]);
        }
        y[r] = acc;
    }
}

#define DEFINE_TILE_QUANT_SCALAR(type, kind)                                                                   \
    static void tile_##type##_scalar(const uint8_t *row, const act_q8 *a, int64_t t0, int ntok, float *out) { \
        tile_quant_scalar(kind, row, a, t0, ntok, out);                                                      \
    }
PI_BLOCK32_TYPES(DEFINE_TILE_QUANT_SCALAR)
#undef DEFINE_TILE_QUANT_SCALAR

void tile_quant_scalar_of(int kind, const uint8_t *row, const act_q8 *a, int64_t t0, int ntok, float *out) {
    tile_quant_scalar(kind, row, a, t0, ntok, out);
}

static void tile_f32_scalar(const uint8_t *row, int64_t K, const float *x, int64_t x_stride, int ntok, float *out) {
    const float *w = (const float *)row;
    for (int t = 0; t < ntok; t++) {
        float acc = 0.0f;
        for (int64_t k = 0; k < K; k++) acc += w[k] * x[t * x_stride + k];
        out[t] = acc;
    }
}

/* 16-bit float weights (F16, BF16): each element widened exactly, then a plain float dot product */
#define DEFINE_TILE_HALF_SCALAR(type, widen)                                                                   \
    static void tile_##type##_scalar(const uint8_t *row, int64_t K, const float *x, int64_t x_stride, int ntok, \
                                     float *out) {                                                             \
        const uint16_t *w = (const uint16_t *)row;                                                             \
        for (int t = 0; t < ntok; t++) {                                                                       \
            float acc = 0.0f;                                                                                  \
            for (int64_t k = 0; k < K; k++) acc += widen(w[k]) * x[t * x_stride + k];                          \
            out[t] = acc;                                                                                      \
        }                                                                                                      \
    }
DEFINE_TILE_HALF_SCALAR(f16, fp16_to_fp32)
DEFINE_TILE_HALF_SCALAR(bf16, bf16_to_fp32)
#undef DEFINE_TILE_HALF_SCALAR


/* Exact mode (quant types, float activations): each block (a super-block of 256 for the K-quants) decoded by the
 * type's decoder, as get_rows does (quants.h, kquants.h), then one running sum per token. */
static inline __attribute__((always_inline)) void tile_decoded_scalar(row_decode_fn decode, int64_t block_elems,
                                                                      int64_t block_bytes, const uint8_t *row,
                                                                      int64_t K, const float *x, int64_t x_stride,
                                                                      int ntok, float *out) {
    float acc[TILE_TQ];
    for (int t = 0; t < ntok; t++) acc[t] = 0.0f;
    for (int64_t i = 0; i < K / block_elems; i++) {
        float w[QK_K];
        decode(row + i * block_bytes, block_elems, w);
        for (int t = 0; t < ntok; t++) {
            const float *xb = x + t * x_stride + i * block_elems;
            float a = acc[t];
            for (int64_t j = 0; j < block_elems; j++) a += w[j] * xb[j];
            acc[t] = a;
        }
    }
    for (int t = 0; t < ntok; t++) out[t] = acc[t];
}
#define DEFINE_TILE_DECODED_SCALAR(name, type)                                                                 \
    static void tile_##name##_f_scalar(const uint8_t *row, int64_t K, const float *x, int64_t x_stride, int ntok, \
                                       float *out) {                                                           \
        tile_decoded_scalar(decode_##name, TYPE_TRAITS[type].block_elems, TYPE_TRAITS[type].block_bytes, row, K, \
                            x, x_stride, ntok, out);                                                           \
    }
PI_BLOCK32_TYPES(DEFINE_TILE_DECODED_SCALAR)
PI_KQUANT_TYPES(DEFINE_TILE_DECODED_SCALAR)
#undef DEFINE_TILE_DECODED_SCALAR

/* One token, R rows: the tile of each row in turn (the scalar tiles have no interleaving to gain). */
#define DEFINE_DOT_SCALAR(type)                                                                                \
    static void dot_##type##_scalar(const uint8_t *const *rows, int R, int64_t K, const float *x, float *out,   \
                                    int64_t ahead) {                                                           \
        (void)ahead;                                                                                           \
        for (int r = 0; r < R; r++) tile_##type##_scalar(rows[r], K, x, K, 1, out + r);                      \
    }
#define DOT_SCALAR_FLOAT(name, type) DEFINE_DOT_SCALAR(name)
#define DOT_SCALAR_QUANT(name, type) DEFINE_DOT_SCALAR(name##_f)
PI_FLOAT_TYPES(DOT_SCALAR_FLOAT)
PI_BLOCK32_TYPES(DOT_SCALAR_QUANT)
PI_KQUANT_TYPES(DOT_SCALAR_QUANT)
#undef DOT_SCALAR_FLOAT
#undef DOT_SCALAR_QUANT
#undef DEFINE_DOT_SCALAR

/* ---- SIMD variants ------------------------------------------------------------------------------------------- */

#define SIMD_BODY "matmul_x86.h"
#include "simd_variants.h"

/* ---- dispatch: the caller's level on each call ---------------------------------------------------------- */

/* the per-ISA traits tables: matmul_tables[isa].types[type id] (matmul_types.h) */
#include "matmul_types.h"

/* The best SIMD level of this CPU (enum pi_isa): 2 AVX-512 (F, BW, VL, DQ, VNNI), 1 AVX2 (+ FMA, F16C), 0 scalar;
 * always 0 on a CPU other than x86-64, where only the scalar variant is built. */
PI_EXPORT int32_t pi_kernels_isa_best(void) {
#if !PI_X86
    return PI_ISA_SCALAR;
#else
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
        return PI_ISA_SCALAR;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni"))
        return PI_ISA_AVX512;
    return PI_ISA_AVX2;
#endif
}

int32_t pi_isa_clamp(int32_t isa) {
    const int32_t best = pi_kernels_isa_best();
    return isa < PI_ISA_SCALAR ? PI_ISA_SCALAR : isa > best ? best : isa;
}

const matmul_table *matmul_table_for(int32_t isa) { return &matmul_tables[pi_isa_clamp(isa)]; }

/* ---- drivers ------------------------------------------------------------------------------------------------- */

/* Quantised activations up to this size live on the caller's stack (one token up to K = 32768): the decode
 * matvec allocates nothing. Larger batches (prefill) allocate them per call. */
#define MATMUL_STACK_ACT_BYTES (48 * 1024)
/* dense int8 products of at most this many tokens prefetch the rows as they read them (act_q8.ahead) */
#define QUANT_STREAM_MAX_T 32

int32_t matmul_quant_rows(const matmul_table *table, int64_t row_bytes, tile_quant_fn tile, const uint8_t *w,
                          int64_t w_stride, const int64_t *rows, int64_t N, int64_t K, const float *x,
                          int64_t x_stride, int64_t T, float *y, int64_t y_stride, int32_t n_threads) {
    if (N < 0 || T < 0 || K < 0 || K % QK != 0) return PI_ERR_SHAPE;
    if (N == 0 || T == 0) return PI_OK;
    const int64_t nb = K / QK;
    /* one buffer: int8 quants first, then the per-block arrays (8-byte aligned) */
    const size_t qs_bytes = ((size_t)(T * K) + 63) & ~(size_t)63;
    const size_t block_bytes = (size_t)(T * nb) * 4;
    _Alignas(64) uint8_t on_stack[MATMUL_STACK_ACT_BYTES];
    const size_t pair_bytes = T == 1 ? act_pair_bytes(K) : 0; /* act_pair_order */
    const size_t need = qs_bytes + 3 * block_bytes + pair_bytes;
    uint8_t *scratch = need <= sizeof on_stack ? on_stack : malloc(need);
    if (scratch == NULL) return PI_ERR_ALLOC;
    act_q8 a = {
        .qs = (int8_t *)scratch,
        .ds = (float *)(scratch + qs_bytes),
        .isum = (int32_t *)(scratch + qs_bytes + 2 * block_bytes),
        .K = K,
        .nb = nb,
    };
    const int32_t nt = threads_for_work(n_threads, N * K * T);
    if (T == 1) { /* one token: quantised here, once, with its pair order for the kernels that read it */
        table->quantize_act(x, nb, a.qs, a.ds, a.isum);
        act_pair_order(&a, (int8_t *)(scratch + qs_bytes + 3 * block_bytes));
    }
    /* dense rows, up to a few tokens: the tiles and the panels' transposes prefetch as they go (a speculative step's
     * tokens then read each row from DRAM at the one-token rate; without it at about half of it); more tokens
     * compute long enough per row for the hardware prefetcher */
    if (rows == NULL && T <= QUANT_STREAM_MAX_T) a.ahead = MATVEC_STREAM_AHEAD;
    /* several tokens: panels of 8 rows where the type has them (the same bits), the last N % 8 rows by tiles */
    /* the panels' rule is the type's entry (type_kernels: tile8_min_t, tile8_short_rows, tile8_nb_multiple) */
    const tile8_quant_fn tile8 = tile8_for(table, tile, T, nb), tile16 = tile16_for(table, tile, T, nb);
    const int64_t n16 = tile16 != NULL ? N / 16 * 16 : 0;
    const int64_t n8 = tile8 != NULL ? N / 8 * 8 : 0;
    /* one token's dense rows after the panels: each thread's share in one call where the type has one (tile's bits) */
    const rows_q8_fn rows1 = rows == NULL && T == 1 ? rows_q8_for(table, tile) : NULL;
    const size_t panel_bytes = (size_t)nb * (n16 > 0 ? PANEL16_BYTES_PER_BLOCK : PANEL_MAX_BYTES_PER_BLOCK);
    uint8_t *panels = n8 > 0 ? aligned_alloc(64, ((size_t)nt * panel_bytes + 63) & ~(size_t)63) : NULL;
    if (n8 > 0 && panels == NULL) {
        if (scratch != on_stack) free(scratch);
        return PI_ERR_ALLOC;
    }
#pragma omp parallel num_threads(nt)
    {
        if (T > 1) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                table->quantize_act(x + t * x_stride, nb, a.qs + t * K, a.ds + t * nb * 2, a.isum + t * nb);
        }
        if (n8 > 0) {
            uint8_t *panel = panels + (size_t)omp_get_thread_num() * panel_bytes;
#pragma omp for schedule(static) nowait
            for (int64_t n0 = 0; n0 < n16; n0 += 16) {
                const uint8_t *r16[16];
                for (int i = 0; i < 16; i++) r16[i] = w + row_of(rows, n0 + i) * w_stride;
                tile16(r16, &a, T, panel, y + n0, y_stride);
            }
#pragma omp for schedule(static) nowait
            for (int64_t n0 = n16; n0 < n8; n0 += 8) {
                const uint8_t *r8[8];
                for (int i = 0; i < 8; i++) r8[i] = w + row_of(rows, n0 + i) * w_stride;
                tile8(r8, &a, T, panel, y + n0, y_stride);
            }
        }
        if (rows1 != NULL) {
            const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
            const int64_t r0 = n8 + (N - n8) * me / all, r1 = n8 + (N - n8) * (me + 1) / all;
            if (r0 < r1) rows1(w + r0 * w_stride, w_stride, NULL, 0, r1 - r0, &a, NULL, y + r0, NULL);
        } else {
#pragma omp for schedule(static)
            for (int64_t n0 = n8; n0 < N; n0 += TILE_N) {
                const int64_t n1 = min_i64(n0 + TILE_N, N);
                for (int64_t t0 = 0; t0 < T; t0 += TILE_T) {
                    const int ntok = (int)min_i64(TILE_T, T - t0);
                    for (int64_t n = n0; n < n1; n++) {
                        float out[TILE_T];
                        act_q8 an = a;
                        if (rows != NULL && T == 1) {
                            /* one token's listed rows: streamed by the row ROWS_STREAM_AHEAD down the list (matmul.h) */
                            listed_ahead(&an, n + ROWS_STREAM_AHEAD < N ? rows[n + ROWS_STREAM_AHEAD] - rows[n] : 0,
                                         ROWS_STREAM_AHEAD, w_stride);
                        } else if (rows != NULL && row_bytes > 0 && t0 == 0 && n + ROWS_PREFETCH_AHEAD < N) {
                            prefetch_bytes(w + rows[n + ROWS_PREFETCH_AHEAD] * w_stride, row_bytes);
                        }
                        tile(w + row_of(rows, n) * w_stride, &an, t0, ntok, out);
                        for (int j = 0; j < ntok; j++) y[(t0 + j) * y_stride + n] = out[j];
                    }
                }
            }
        }
    }
    free(panels);
    if (scratch != on_stack) free(scratch);
    return PI_OK;
}

static inline int32_t matmul_float_tiled(int64_t row_bytes, tile_float_fn tile, const int64_t tile_t, const uint8_t *w,
                                         int64_t w_stride, const int64_t *rows, int64_t N, int64_t K, const float *x,
                                         int64_t x_stride, int64_t T, float *y, int64_t y_stride, int32_t n_threads) {
    if (N < 0 || T < 0 || K < 0) return PI_ERR_SHAPE;
    if (N == 0 || T == 0) return PI_OK;
    const int32_t nt = threads_for_work(n_threads, N * K * T);
    /* dense rows are prefetched MATVEC_AHEAD_BYTES ahead on the first token tile (a few tokens, such as a
     * speculative step's, read each row once from DRAM: without it they read at about half the one-token rate) */
    const int64_t ahead = rows == NULL ? matvec_rows_ahead(row_bytes) : 0;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += TILE_N) {
        const int64_t n1 = min_i64(n0 + TILE_N, N);
        for (int64_t t0 = 0; t0 < T; t0 += tile_t) {
            const int ntok = (int)min_i64(tile_t, T - t0);
            for (int64_t n = n0; n < n1; n++) {
                float out[TILE_TQ > TILE_T ? TILE_TQ : TILE_T];
                if (rows != NULL && row_bytes > 0 && t0 == 0 && n + ROWS_PREFETCH_AHEAD < N) {
                    prefetch_bytes(w + rows[n + ROWS_PREFETCH_AHEAD] * w_stride, row_bytes);
                } else if (ahead > 0 && t0 == 0 && n + ahead < N) {
                    prefetch_bytes(w + (n + ahead) * w_stride, row_bytes);
                }
                tile(w + row_of(rows, n) * w_stride, K, x + t0 * x_stride, x_stride, ntok, out);
                for (int j = 0; j < ntok; j++) y[(t0 + j) * y_stride + n] = out[j];
            }
        }
    }
    return PI_OK;
}

int32_t matmul_float_rows(const matmul_table *table, int64_t row_bytes, tile_float_fn tile, const uint8_t *w,
                          int64_t w_stride, const int64_t *rows, int64_t N, int64_t K, const float *x,
                          int64_t x_stride, int64_t T, float *y, int64_t y_stride, int32_t n_threads) {
    (void)table;
    return matmul_float_tiled(row_bytes, tile, TILE_T, w, w_stride, rows, N, K, x, x_stride, T, y, y_stride, n_threads);
}

/* Float weights, several tokens: 4 rows x TILE_T2 tokens (tile4), the same bits as matmul_float_rows with `tile`.
 * A block of FLOAT_BLOCK_ROWS rows goes through K in chunks of FLOAT_CHUNK_BYTES of each row, every token tile
 * over each chunk, the accumulators carried between chunks (tile4's state): the rows' chunk stays in the caches
 * while all tokens pass (tile4 reads it twice, by parity). Measured, 1.1B F16 shapes at 64 tokens, 1 thread: 1 KB
 * chunks -10%, 4 KB and whole rows -15%; copying the chunks into a contiguous panel: no gain. */
#define FLOAT_CHUNK_BYTES 2048
#define FLOAT_BLOCK_ROWS 16
/* fewer tokens take the row tiles (each row streamed once per TILE_T tokens, prefetched): a speculative step of a
 * few tokens then costs about one token's weight reads, where the quads' chunked blocks read at about half the rate */
#define FLOAT_QUADS_MIN_T 8
#ifndef FLOAT_STREAM_MAX_T
#define FLOAT_STREAM_MAX_T 20
#endif

/* Dense float rows x 2..FLOAT_STREAM_MAX_T tokens: rows in contiguous ranges over threads (as the one-token dots), each
 * row read once per TILE_TS tokens by `tiles`, prefetching as it reads on the first pass (the later passes find the
 * row in L1): the same bits as the tiles. */
static int32_t matmul_float_stream(tile_stream_fn tiles, const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,
                                   const float *x, int64_t x_stride, int64_t T, float *y, int64_t y_stride,
                                   int32_t n_threads) {
    const int32_t nt = threads_for_work(n_threads, N * K * T);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
        const int64_t n1 = N * (me + 1) / all;
        for (int64_t n = N * me / all; n < n1; n++) {
            for (int64_t t0 = 0; t0 < T; t0 += TILE_TS) {
                const int ntok = (int)min_i64(TILE_TS, T - t0);
                float out[TILE_TS];
                tiles(w + n * w_stride, K, x + t0 * x_stride, x_stride, ntok, out, t0 == 0 ? MATVEC_STREAM_AHEAD : 0);
                for (int j = 0; j < ntok; j++) y[(t0 + j) * y_stride + n] = out[j];
            }
        }
    }
    return PI_OK;
}

static int32_t matmul_float_quads(tile_float4_fn tile4, tile_stream_fn tiles, int64_t row_bytes, tile_float_fn tile,
                                  const uint8_t *w, int64_t w_stride, const int64_t *rows, int64_t N, int64_t K,
                                  const float *x, int64_t x_stride, int64_t T, float *y, int64_t y_stride,
                                  int32_t n_threads) {
    const int64_t elem = K > 0 ? row_bytes / K : 0; /* 2 or 4 bytes; 0 for rows of unknown size */
    if (tiles != NULL && rows == NULL && T >= 2 && T <= FLOAT_STREAM_MAX_T && N > 0 && K > 0)
        return matmul_float_stream(tiles, w, w_stride, N, K, x, x_stride, T, y, y_stride, n_threads);
    if (tile4 == NULL || T < FLOAT_QUADS_MIN_T || elem <= 0 || N < 4)
        return matmul_float_tiled(row_bytes, tile, TILE_T, w, w_stride, rows, N, K, x, x_stride, T, y, y_stride,
                                  n_threads);
    if (K < 0) return PI_ERR_SHAPE;
    const int32_t nt = threads_for_work(n_threads, N * K * T);
    const int64_t kc = FLOAT_CHUNK_BYTES / elem; /* a multiple of TILE4_K_UNIT */
    const int64_t n_tiles = (T + TILE_T2 - 1) / TILE_T2;
    const size_t state_bytes = (size_t)(FLOAT_BLOCK_ROWS / 4) * (size_t)n_tiles * TILE4_STATE_BYTES;
    uint8_t *buf = aligned_alloc(64, (size_t)nt * state_bytes);
    if (buf == NULL) return PI_ERR_ALLOC;
#pragma omp parallel num_threads(nt)
    {
        uint8_t *state = buf + (size_t)omp_get_thread_num() * state_bytes;
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += FLOAT_BLOCK_ROWS) {
            const int64_t n1 = min_i64(n0 + FLOAT_BLOCK_ROWS, N), n_quads = (n1 - n0) / 4;
            for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += kc) {
                const int64_t k1 = K - k0 > kc ? k0 + kc : K;
                for (int64_t t0 = 0; t0 < T; t0 += TILE_T2) {
                    const int ntok = (int)min_i64(TILE_T2, T - t0);
                    uint8_t *st = state + (size_t)(t0 / TILE_T2) * (FLOAT_BLOCK_ROWS / 4) * TILE4_STATE_BYTES;
                    for (int64_t q = 0; q < n_quads; q++, st += TILE4_STATE_BYTES) {
                        float out[4 * TILE_T2];
                        const uint8_t *r4[4];
                        for (int r = 0; r < 4; r++) r4[r] = w + row_of(rows, n0 + 4 * q + r) * w_stride;
                        tile4(r4, K, k0, k1, x + t0 * x_stride, x_stride, ntok, st, out);
                        if (k1 < K) continue;
                        for (int r = 0; r < 4; r++)
                            for (int j = 0; j < ntok; j++) y[(t0 + j) * y_stride + n0 + 4 * q + r] = out[r * TILE_T2 + j];
                    }
                }
                if (k1 >= K) break;
            }
            for (int64_t n = n0 + 4 * n_quads; n < n1; n++) { /* the last N % 4 rows, whole */
                for (int64_t t0 = 0; t0 < T; t0 += TILE_T) {
                    const int ntok = (int)min_i64(TILE_T, T - t0);
                    float out[TILE_T];
                    tile(w + row_of(rows, n) * w_stride, K, x + t0 * x_stride, x_stride, ntok, out);
                    for (int j = 0; j < ntok; j++) y[(t0 + j) * y_stride + n] = out[j];
                }
            }
        }
    }
    free(buf);
    return PI_OK;
}

#define DEFINE_FLOAT_DRIVER(name, type)                                                                            \
    static int32_t matmul_##name##_rows(const matmul_table *table, int64_t row_bytes, tile_float_fn tile,          \
                                        const uint8_t *w, int64_t w_stride, const int64_t *rows, int64_t N,        \
                                        int64_t K, const float *x, int64_t x_stride, int64_t T, float *y,          \
                                        int64_t y_stride, int32_t n_threads) {                                     \
        return matmul_float_quads(table->types[type].tile4, table->types[type].tiles, row_bytes, tile, w, w_stride, \
                                  rows, N, K, x, x_stride, T, y, y_stride, n_threads);                             \
    }
PI_FLOAT_TYPES(DEFINE_FLOAT_DRIVER)
#undef DEFINE_FLOAT_DRIVER

/* exact mode of the quant types: float activations, weight blocks decoded in registers */
int32_t matmul_quant_f_rows(const matmul_table *table, int64_t row_bytes, tile_float_fn tile, const uint8_t *w,
                            int64_t w_stride, const int64_t *rows, int64_t N, int64_t K, const float *x,
                            int64_t x_stride, int64_t T, float *y, int64_t y_stride, int32_t n_threads) {
    (void)table;
    if (K < 0 || K % QK != 0) return PI_ERR_SHAPE;
    return matmul_float_tiled(row_bytes, tile, TILE_TQ, w, w_stride, rows, N, K, x, x_stride, T, y, y_stride, n_threads);
}

/* One token, float activations: rows in contiguous ranges over threads, `group` rows per rows_dot call (the tile
 * arithmetic per row, so the same bits as the tiled driver). Short rows: ROWS_DOT_MAX per call, one call and one
 * horizontal sum setup per group instead of per row, which counts for short rows such as the predictor's fc2.
 * Long exact-mode quant rows and long float rows: one per call (less per-row overhead than the tiled driver).
 * stream: the dot prefetches as it reads (the float kernels, rows_dot_fn's ahead), else whole rows ahead here. */
static int32_t matvec_dot(rows_dot_fn dot, int group, int stream, const uint8_t *w, int64_t w_stride, int64_t N,
                          int64_t K, int64_t row_bytes, const float *x, float *y, int32_t n_threads) {
    const int32_t nt = threads_for_work(n_threads, N * K);
    const int64_t ahead = stream ? 0 : matvec_rows_ahead(row_bytes);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
        const int64_t n1 = N * (me + 1) / all;
        for (int64_t n = N * me / all; n < n1; n += group) {
            const int R = (int)min_i64(group, n1 - n);
            const uint8_t *rows[ROWS_DOT_MAX];
            for (int r = 0; r < R; r++) {
                rows[r] = w + (n + r) * w_stride;
                if (ahead > 0 && n + r + ahead < n1) prefetch_bytes(rows[r] + ahead * w_stride, row_bytes);
            }
            dot(rows, R, K, x, y + n, stream ? MATVEC_STREAM_AHEAD : 0);
        }
    }
    return PI_OK;
}

/* Dense rows longer than this stream better one at a time (measured: interleaving 4 long consecutive rows halves the
 * DRAM throughput of the tiled driver; 2 rows of a 4-bit block type, K = 2048, cut it from 37 to 15 GB/s on a 2-core
 * EPYC, although faster in cache), shorter ones (predictor fc2: 72 bytes) gain from the grouping. */
#define MATVEC_DOT_MAX_ROW 512

/* K-quant rows hold whole super-blocks of 256: any other K is a shape error (before the row size is trusted) */
static int32_t matmul_kq_f_rows(const matmul_table *table, int64_t row_bytes, tile_float_fn tile, const uint8_t *w,
                                int64_t w_stride, const int64_t *rows, int64_t N, int64_t K, const float *x,
                                int64_t x_stride, int64_t T, float *y, int64_t y_stride, int32_t n_threads) {
    (void)table;
    if (K < 0 || K % QK_K != 0) return PI_ERR_SHAPE;
    return matmul_float_tiled(row_bytes, tile, TILE_TQ, w, w_stride, rows, N, K, x, x_stride, T, y, y_stride, n_threads);
}

/* pi_matmul_<type>(w, w_stride bytes, N rows, K cols, x, x_stride floats, T tokens, y, y_stride floats, threads, isa)
 * computes y[t * y_stride + n] = sum_k W[n, k] * x[t * x_stride + k] with SIMD level isa (enum pi_isa). */
/* long_group > 0: T = 1 with rows longer than MATVEC_DOT_MAX_ROW also goes through matvec_dot, long_group rows per call;
 * stream: the type's dot prefetches as it reads (the float types) */
/* name: the symbol's suffix; type: the type id; tile: the type_kernels member the driver runs (tile_q8 or tile);
 * use_dot: T = 1 may go through the type's dot (float activations). */
#define DEFINE_MATMUL(name, type, driver, tile, use_dot, long_group, stream)                                       \
    PI_EXPORT int32_t pi_matmul_##name(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, const float *x,   \
                                       int64_t x_stride, int64_t T, float *y, int64_t y_stride, int32_t n_threads, \
                                       int32_t isa) {                                                              \
        const int64_t row_bytes = type_row_bytes(type, K), k_unit = TYPE_TRAITS[type].block_elems;                 \
        if (N < 0 || K < 0 || T < 0 || !stride_ok(N, w_stride, row_bytes) || !stride_ok(T, x_stride, K) ||       \
            !stride_ok(T, y_stride, N))                                                                            \
            return PI_ERR_SHAPE;                                                                                   \
        if (N > 0 && T > 0 && (w == NULL || x == NULL || y == NULL)) return PI_ERR_SHAPE;                          \
        const matmul_table *table = matmul_table_for(isa);                                                         \
        const rows_dot_fn dot_fn = (use_dot) ? table->types[type].dot : NULL;                                      \
        if (dot_fn != NULL && T == 1 && N > 0 && K >= 0 && K % k_unit == 0 && row_bytes <= MATVEC_DOT_MAX_ROW)     \
            return matvec_dot(dot_fn, ROWS_DOT_MAX, (stream), w, w_stride, N, K, row_bytes, x, y, n_threads);      \
        if ((long_group) > 0 && dot_fn != NULL && T == 1 && N > 0 && K >= 0 && K % k_unit == 0)                   \
            return matvec_dot(dot_fn, (long_group), (stream), w, w_stride, N, K, row_bytes, x, y, n_threads);      \
        return driver(table, row_bytes, table->types[type].tile, w, w_stride, NULL, N, K, x, x_stride, T, y,       \
                      y_stride, n_threads);                                                                        \
    }

#define MATMUL_FLOAT(name, type) DEFINE_MATMUL(name, type, matmul_##name##_rows, tile, 1, 1, 1)
#define MATMUL_BLOCK32(name, type)                                                                                 \
    DEFINE_MATMUL(name, type, matmul_quant_rows, tile_q8, 0, 0, 0)                                                 \
    DEFINE_MATMUL(name##_f, type, matmul_quant_f_rows, tile, 1, 1, 0)
PI_FLOAT_TYPES(MATMUL_FLOAT)
PI_BLOCK32_TYPES(MATMUL_BLOCK32)
#undef MATMUL_FLOAT
#undef MATMUL_BLOCK32
/* K-quants: float activations only (the exact kernel of both precisions); a K not a multiple of 256 fails the
 * dot path's K check and is refused by matmul_kq_f_rows before any row is read */
#define MATMUL_KQUANT(name, type) DEFINE_MATMUL(name##_f, type, matmul_kq_f_rows, tile, 1, 1, 0)
PI_KQUANT_TYPES(MATMUL_KQUANT)
#undef MATMUL_KQUANT


/* ---- rows repacked by 8 for one token (the sparse head's screen) ---------------------------------------------- */

/* the type rows8 serves: block_coef4's (the 4-bit type with offset 8; TYPE_TRAITS coef_bf16) */
static int rows8_type(int32_t type) { return type_coef_bf16(type) && TYPE_TRAITS[type].int8_offset == ROWS8_OFFSET; }

/* pi_repack_rows8(type, w, w_stride bytes, N rows, K cols, out): rows of the rows8 type (block_coef4), N a multiple of
 * 8, K of 32; out holds N / 8 * K / 32 * R8_BLOCK_BYTES bytes (matmul.h: the layout) */
PI_EXPORT int32_t pi_repack_rows8(int32_t type, const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,
                                  uint8_t *out) {
    if (!rows8_type(type) || N < 0 || K < 0 || N % 8 != 0 || K % QK != 0 ||
        !stride_ok(N, w_stride, type_row_bytes(type, K)))
        return PI_ERR_SHAPE;
    if (N > 0 && K > 0 && (w == NULL || out == NULL)) return PI_ERR_SHAPE;
    const int64_t nb = K / QK;
    for (int64_t g = 0; g < N / 8; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (g * nb + b) * R8_BLOCK_BYTES;
            for (int r = 0; r < 8; r++) {
                const block_coef4 *blk = (const block_coef4 *)(w + (8 * g + r) * w_stride) + b;
                for (int k = 0; k < 4; k++) memcpy(o + 32 * k + 4 * r, blk->qs + 4 * k, 4);
                memcpy(o + 128 + 2 * r, &blk->d, 2);
            }
        }
    return PI_OK;
}

/* pi_matvec_rows8(type, packed, N, K, x, y, threads, isa): y[n] = row n . x for one token in the q8 precision, from
 * the rows repacked by pi_repack_rows8: the bits of pi_matmul_<type> at T = 1 over the same rows at that SIMD level. */
PI_EXPORT int32_t pi_matvec_rows8(int32_t type, const uint8_t *packed, int64_t N, int64_t K, const float *x, float *y,
                                  int32_t n_threads, int32_t isa) {
    if (!rows8_type(type) || N < 0 || K < 0 || N % 8 != 0 || K % QK != 0) return PI_ERR_SHAPE;
    if (N == 0) return PI_OK;
    if (packed == NULL || x == NULL || y == NULL) return PI_ERR_SHAPE;
    const matmul_table *table = matmul_table_for(isa);
    const int64_t nb = K / QK;
    _Alignas(64) uint8_t buf[MATMUL_STACK_ACT_BYTES];
    uint8_t *scratch = act_q8_bytes(K) <= sizeof buf ? buf : malloc(act_q8_bytes(K));
    if (scratch == NULL) return PI_ERR_ALLOC;
    act_q8 a;
    act_q8_prepare(table, x, K, scratch, &a);
    const int64_t groups = N / 8, group_bytes = nb * R8_BLOCK_BYTES;
    const int32_t nt = threads_for_work(n_threads, N * K);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t g = 0; g < groups; g++) table->r8(packed + g * group_bytes, &a, y + 8 * g);
    if (scratch != buf) free(scratch);
    return PI_OK;
}
