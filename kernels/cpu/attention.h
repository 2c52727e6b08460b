/* Internal interface of the decode attention (attention.c), shared with the fused decode layer (layer.c). */
#ifndef POWERINFER_KERNELS_ATTENTION_H
#define POWERINFER_KERNELS_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

/* One layer's keys or values of one sequence: n_ctx rows (positions) of Hkv heads of D elements of `type`
 * (ggml ids: PI_TYPE_F32, _F16, _BF16, _Q8_0 or _Q4_0; the block types need D % 32 == 0: each head is D / 32
 * whole blocks). Row t, head h starts at data + t * row_bytes + h * head_bytes.
 * rot: the block types store heads rotated, as llama.cpp does since its attention rotation (LLAMA_ATTN_ROT_DISABLE
 * turns it off there): each head times the orthonormal Walsh-Hadamard matrix of size rot (Sylvester order,
 * entries +-1 / sqrt(rot)) in blocks of rot, which spreads an outlier over its block before the rounding. Keys:
 * rot = the largest power of two >= 64 dividing D, the queries rotated alike (q . k unchanged); values: rot = 64,
 * the output rotated back (the matrix is its own inverse). 0 (no rotation) for the float types and D % 64 != 0. */
typedef struct {
    uint8_t *data;
    int64_t head_bytes;
    int64_t row_bytes;
    int32_t type;
    int32_t rot;
} kv_rows;

/* Heads up to this size in a typed (non-f32) cache: the attention decodes tiles of its rows on the stack. */
#define PI_KV_MAX_D 512

/* *c = the keys (values != 0: the values) of a cache at `data` of `type` with Hkv heads of D; 0 when the type or D
 * is not one a cache takes. */
int kv_rows_make(kv_rows *c, void *data, int32_t type, int64_t Hkv, int64_t D, int values);

/* KV heads [kvh0, kvh1) of one token at position pos, with SIMD level `level` (already clamped): the query heads
 * of each (G = H / Hkv of them) and its k head rotated in place by rope, its k and v written to cache row pos
 * (encoded in the cache's type), and (attend != 0) out's G heads = softmax(q . K[0..pos] * scale) . V[0..pos].
 * scores: G * (pos + 1) floats per KV head, at kvh * G * (pos + 1). Heads of different ranges touch disjoint
 * memory, so threads may run disjoint ranges. neox: element i of a head pairs with i + D / 2 in the rotation (else
 * 2i with 2i + 1). */
void attn_decode_heads(int32_t level, float *q, float *k, const float *v, const float *rope, const kv_rows *kc,
                       const kv_rows *vc, int64_t pos, int64_t H, int64_t Hkv, int64_t D, float scale, float *scores,
                       float *out, int64_t kvh0, int64_t kvh1, int attend, int neox);

/* Bytes of the scores scratch of attn_decode_part at L positions with H query heads. */
size_t attn_scores_bytes(int64_t L, int64_t H);

/* The whole attention of one token, called by every thread `me` of a team of `all` (inside its parallel region:
 * it may hold barriers): the KV heads split over the threads, or every head shared by all of them. scores:
 * attn_scores_bytes(pos + 1, H). The same bits for any team size. */
void attn_decode_part(int32_t level, float *q, float *k, const float *v, const float *rope, const kv_rows *kc,
                      const kv_rows *vc, int64_t pos, int64_t H, int64_t Hkv, int64_t D, float scale, float *scores,
                      float *out, int64_t me, int64_t all, int neox);

#endif
