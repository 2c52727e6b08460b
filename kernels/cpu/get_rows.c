/* get_rows: decode selected rows (token ids) of a ggml tensor into float32 (embedding lookup).
 *
 * Each type's row decoder (quants.h, kquants.h) matches the reference dequantiser bit for bit. This op moves a few
 * rows per call, so the scalar decoders (auto-vectorised by the compiler) are enough.
 */
#include "quants.h"

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
#define DEFINE_GET_ROWS(name, type)                                                                              \
    PI_EXPORT int32_t pi_get_rows_##name(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,               \
                                         const int64_t *ids, int64_t n_ids, float *y, int64_t y_stride,          \
                                         int32_t n_threads, int32_t isa) {                                       \
        (void)isa;                                                                                               \
        const type_traits *tt = &TYPE_TRAITS[type];                                                              \
        return get_rows(tt->decode, tt->block_elems, tt->block_bytes, w, w_stride, N, K, ids, n_ids, y, y_stride, \
                        n_threads);                                                                              \
    }

PI_FLOAT_TYPES(DEFINE_GET_ROWS)
PI_BLOCK32_TYPES(DEFINE_GET_ROWS)
PI_KQUANT_TYPES(DEFINE_GET_ROWS)
PI_IQ4_TYPES(DEFINE_GET_ROWS)
