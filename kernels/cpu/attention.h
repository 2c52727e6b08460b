/* Internal interface of the decode attention (attention.c), shared with the fused decode layer (layer.c). */
#ifndef POWERINFER_KERNELS_ATTENTION_H
#define POWERINFER_KERNELS_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

/* KV heads [kvh0, kvh1) of one token at position pos, with SIMD level `level` (already clamped): the query heads
 * of each (G = H / Hkv of them) and its k head rotated in place by rope, its k and v written to cache row pos, and
 * (attend != 0) out's G heads = softmax(q . K[0..pos] * scale) . V[0..pos]. scores: G * (pos + 1) floats per KV
 * head, at kvh * G * (pos + 1). Heads of different ranges touch disjoint memory, so threads may run disjoint
 * ranges. neox: element i of a head pairs with i + D / 2 in the rotation (else 2i with 2i + 1). */
void attn_decode_heads(int32_t level, float *q, float *k, const float *v, const float *rope, float *kc, float *vc,
                       int64_t pos, int64_t H, int64_t Hkv, int64_t D, float scale, float *scores, float *out,
                       int64_t kvh0, int64_t kvh1, int attend, int neox);

/* Bytes of the scores scratch of attn_decode_part at L positions with H query heads. */
size_t attn_scores_bytes(int64_t L, int64_t H);

/* The whole attention of one token, called by every thread `me` of a team of `all` (inside its parallel region:
 * it may hold barriers): the KV heads split over the threads, or every head shared by all of them. scores:
 * attn_scores_bytes(pos + 1, H). The same bits for any team size. */
void attn_decode_part(int32_t level, float *q, float *k, const float *v, const float *rope, float *kc, float *vc,
                      int64_t pos, int64_t H, int64_t Hkv, int64_t D, float scale, float *scores, float *out,
                      int64_t me, int64_t all, int neox);

#endif
