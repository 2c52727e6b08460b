/* get_rows: decode selected rows (token ids) of a ggml tensor into float32 (embedding lookup).
 *
 * The arithmetic matches the reference dequantiser bit for bit: each element is one float product
 * (plus one separately rounded add for Q4_1); the build uses -ffp-contract=off so no FMA is formed.
 * This op moves a few rows per call, so a scalar loop (auto-vectorised by the compiler) is enough.
 */
#include "common.h"
#include "kquants.h"

static void row_decode_f32(const uint8_t *row, int64_t K, float *out) { memcpy(out, row, (size_t)K * sizeof(float)); }

static void row_decode_f16(const uint8_t *row, int64_t K, float *out) {
    for (int64_t k = 0; k < K; k++) {
        uint16_t h;
        memcpy(&h, row + 2 * k, sizeof h);
        out[k] = fp16_to_fp32(h);
    }
}

static void row_decode_bf16(const uint8_t *row, int64_t K, float *out) {
    for (int64_t k = 0; k < K; k++) {
        uint16_t h;
        memcpy(&h, row + 2 * k, sizeof h);
        out[k] = bf16_to_fp32(h);
    }
}

static void row_decode_q4_0(const uint8_t *row, int64_t K, float *out) {
    const block_q4_0 *blocks = (const block_q4_0 *)row;
    for (int64_t i = 0; i < K / QK; i++) {
        const float d = fp16_to_fp32(blocks[i].d);
        for (int j = 0; j < QK / 2; j++) {
            out[i * QK + j] = (float)((blocks[i].qs[j] & 0x0F) - 8) * d;
            out[i * QK + j + QK / 2] = (float)((blocks[i].qs[j] >> 4) - 8) * d;
        }
    }
}

static void row_decode_q4_1(const uint8_t *row, int64_t K, float *out) {
    const block_q4_1 *blocks = (const block_q4_1 *)row;
    for (int64_t i = 0; i < K / QK; i++) {
        const float d = fp16_to_fp32(blocks[i].d);
        const float m = fp16_to_fp32(blocks[i].m);
        for (int j = 0; j < QK / 2; j++) {
            out[i * QK + j] = d * (float)(blocks[i].qs[j] & 0x0F) + m;
            out[i * QK + j + QK / 2] = d * (float)(blocks[i].qs[j] >> 4) + m;
        }
    }
}

static void row_decode_q8_0(const uint8_t *row, int64_t K, float *out) {
    const block_q8_0 *blocks = (const block_q8_0 *)row;
    for (int64_t i = 0; i < K / QK; i++) {
        const float d = fp16_to_fp32(blocks[i].d);
        for (int j = 0; j < QK; j++) out[i * QK + j] = (float)blocks[i].qs[j] * d;
    }
}

static void row_decode_q5_0(const uint8_t *row, int64_t K, float *out) {
    const block_q5_0 *blocks = (const block_q5_0 *)row;
    for (int64_t i = 0; i < K / QK; i++) {
        const float d = fp16_to_fp32(blocks[i].d);
        int q[QK];
        q5_values(blocks[i].qh, blocks[i].qs, q);
        for (int j = 0; j < QK; j++) out[i * QK + j] = (float)(q[j] - 16) * d;
    }
}

static void row_decode_q5_1(const uint8_t *row, int64_t K, float *out) {
    const block_q5_1 *blocks = (const block_q5_1 *)row;
    for (int64_t i = 0; i < K / QK; i++) {
        const float d = fp16_to_fp32(blocks[i].d);
        const float m = fp16_to_fp32(blocks[i].m);
        int q[QK];
        q5_values(blocks[i].qh, blocks[i].qs, q);
        for (int j = 0; j < QK; j++) out[i * QK + j] = d * (float)q[j] + m;
    }
}

static void row_decode_q2_k(const uint8_t *row, int64_t K, float *out) { kq_decode_q2_k(row, K, out); }
static void row_decode_q3_k(const uint8_t *row, int64_t K, float *out) { kq_decode_q3_k(row, K, out); }
static void row_decode_q4_k(const uint8_t *row, int64_t K, float *out) { kq_decode_q4_k(row, K, out); }
static void row_decode_q5_k(const uint8_t *row, int64_t K, float *out) { kq_decode_q5_k(row, K, out); }
static void row_decode_q6_k(const uint8_t *row, int64_t K, float *out) { kq_decode_q6_k(row, K, out); }
static void row_decode_iq4_nl(const uint8_t *row, int64_t K, float *out) { kq_decode_iq4_nl(row, K, out); }
static void row_decode_iq4_xs(const uint8_t *row, int64_t K, float *out) { kq_decode_iq4_xs(row, K, out); }

typedef void (*row_decode_fn)(const uint8_t *row, int64_t K, float *out);

/* y[r, :] = decode(W[ids[r], :]) for r < n_ids; W has N rows of K elements, w_stride bytes apart. */
static int32_t get_rows(row_decode_fn decode, int64_t block_elems, int64_t block_bytes, const uint8_t *w,
                        int64_t w_stride, int64_t N, int64_t K, const int64_t *ids, int64_t n_ids, float *y,
                        int64_t y_stride, int32_t n_threads) {
    if (N < 0 || K < 0 || n_ids < 0 || K % block_elems != 0) return PI_ERR_SHAPE;
    if (!stride_ok(N, w_stride, K / block_elems * block_bytes) || !stride_ok(n_ids, y_stride, K)) return PI_ERR_SHAPE;
    if (n_ids > 0 && (ids == NULL || w == NULL || y == NULL)) return PI_ERR_SHAPE;
    for (int64_t r = 0; r < n_ids; r++) {
        if (ids[r] < 0 || ids[r] >= N) return PI_ERR_INDEX;
    }
    const int32_t nt = threads_for_work(n_threads, n_ids * K);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < n_ids; r++) decode(w + ids[r] * w_stride, K, y + r * y_stride);
    return PI_OK;
}

/* pi_get_rows_<type>(w, w_stride bytes, N rows, K cols, ids, n_ids, y, y_stride floats, threads, isa): one variant
 * for every level (a few rows per call, auto-vectorised); isa is taken for the uniform kernel ABI. */
#define DEFINE_GET_ROWS(type, block_elems, block_bytes)                                                        \
    PI_EXPORT int32_t pi_get_rows_##type(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,              \
                                         const int64_t *ids, int64_t n_ids, float *y, int64_t y_stride,         \
                                         int32_t n_threads, int32_t isa) {                                      \
        (void)isa;                                                                                              \
        return get_rows(row_decode_##type, block_elems, block_bytes, w, w_stride, N, K, ids, n_ids, y, y_stride, \
                        n_threads);                                                                             \
    }

DEFINE_GET_ROWS(f32, 1, 4)
DEFINE_GET_ROWS(f16, 1, 2)
DEFINE_GET_ROWS(bf16, 1, 2)
DEFINE_GET_ROWS(q4_0, QK, sizeof(block_q4_0))
DEFINE_GET_ROWS(q4_1, QK, sizeof(block_q4_1))
DEFINE_GET_ROWS(q8_0, QK, sizeof(block_q8_0))
DEFINE_GET_ROWS(q5_0, QK, sizeof(block_q5_0))
DEFINE_GET_ROWS(q5_1, QK, sizeof(block_q5_1))
DEFINE_GET_ROWS(q2_k, QK_K, sizeof(block_q2_k))
DEFINE_GET_ROWS(q3_k, QK_K, sizeof(block_q3_k))
DEFINE_GET_ROWS(q4_k, QK_K, sizeof(block_q4_k))
DEFINE_GET_ROWS(q5_k, QK_K, sizeof(block_q5_k))
DEFINE_GET_ROWS(q6_k, QK_K, sizeof(block_q6_k))
DEFINE_GET_ROWS(iq4_nl, QK, sizeof(block_iq4_nl))
DEFINE_GET_ROWS(iq4_xs, QK_K, sizeof(block_iq4_xs))
