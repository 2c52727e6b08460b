/* Decode attention: one new token of one sequence, Llama style (RoPE on adjacent pairs, or NEOX style, grouped-query
 * heads, causal over positions 0..pos), in one call instead of a dozen tensor ops per layer.
 *
 * pi_attn_decode(q, k, v, rope, kc, vc, type_k, type_v, n_ctx, pos, H, Hkv, D, scale, out, scratch, scratch_bytes,
 *                neox, threads, isa):
 *   q (H * D), k and v (Hkv * D): the token's projections (float32; q and k are rotated here, in place);
 *   rope (D / 2 pairs of cos, sin): the rotation of each pair at position pos; pair i is elements 2i, 2i + 1 of a
 *   head, or i, i + D / 2 with neox;
 *   kc, vc: this sequence's cache of this layer, n_ctx rows of Hkv heads of D elements of type_k / type_v (ggml
 *   ids: f32, f16, bf16, q8_0, q4_0; see kv_rows_make), contiguous; k and v go to row pos, encoded in that type;
 *   out (H * D): per head h, softmax(q_h . K[0..pos, h / G] * scale) . V[0..pos, h / G], G = H / Hkv;
 *   scratch: at least pi_attn_decode_scratch_bytes(pos + 1, H) bytes (the scores), else PI_ERR_SCRATCH.
 *
 * Per KV head, the G query heads that share it read each cached row once. Softmax subtracts the row maximum and
 * uses a polynomial exp (Cephes, ~1e-7 relative); the weighted sum of V is divided by the sum of weights at the
 * end. KV heads are split over threads, or, when they do not split evenly, every part of each head (attend_team);
 * each score, sum and output element is computed by one thread in a fixed order, so the result does not depend
 * on the thread count. The body (attention_body.h) is compiled for the baseline CPU, and on x86-64 also for AVX2
 * and AVX-512; `isa` (enum pi_isa, clamped to what the CPU has) picks one per call.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "attention.h"
#include "common.h"
#include "quants.h"

#define SIMD_SUFFIX scalar
#include "attention_body.h"
#undef SIMD_SUFFIX

#define SIMD_BODY "attention_body.h"
#include "simd_variants.h"

typedef void (*rope_rotate_fn)(float *x, const float *rope, int64_t D);
typedef void (*attend_kv_head_fn)(const float *q, const kv_rows *kc, const kv_rows *vc, int64_t kvh, int64_t G,
                                  int64_t L, int64_t D, float scale, float *s, float *out);
typedef void (*attend_team_fn)(const float *q, const kv_rows *kc, const kv_rows *vc, int64_t Hkv, int64_t G, int64_t L,
                               int64_t D, float scale, float *s, float *inv, float *out, int64_t me, int64_t all);

static const struct {
    rope_rotate_fn rope_rotate;
    attend_kv_head_fn attend_kv_head;
    attend_team_fn attend_team; /* NULL: KV heads split over threads only */
} attn_variants[] = {
    [PI_ISA_SCALAR] = {rope_rotate_scalar, attend_kv_head_scalar, NULL},
#if PI_X86
    [PI_ISA_AVX2] = {rope_rotate_avx2, attend_kv_head_avx2, attend_team_avx2},
    [PI_ISA_AVX512] = {rope_rotate_avx512, attend_kv_head_avx512, attend_team_avx512},
#endif
};

/* Floats of the attention scratch: the scores of every head, then 1 / (sum of weights) per head. */
size_t attn_scores_bytes(int64_t L, int64_t H) { return align_up((size_t)(H * L + H) * sizeof(float)); }

/* Bytes of scratch pi_attn_decode needs at L = pos + 1 positions with H query heads, the alignment slack
 * included; -1 for non-positive sizes. */
PI_EXPORT int64_t pi_attn_decode_scratch_bytes(int64_t L, int64_t H) {
    if (L <= 0 || H <= 0) return -1;
    return (int64_t)(attn_scores_bytes(L, H) + PI_SCRATCH_ALIGN);
}

/* x (D) rotated NEOX-style: element i pairs with i + D / 2, (a, b) -> (a c - b s, a s + b c) with pair i's (c, s),
 * each product and sum rounded (torch's cat(x1 cos - x2 sin, x1 sin + x2 cos)) */
static void rope_rotate_neox(float *x, const float *rope, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half], c = rope[2 * i], s = rope[2 * i + 1];
        x[i] = a * c - b * s;
        x[i + half] = a * s + b * c;
    }
}

/* ---- the cache's row types -------------------------------------------------------------------------------------
 * f32 and f16 / bf16 (one element per unit), q8_0 (per 32 elements: f16 d, 32 int8 q; x = q d) and q4_0 (per 32:
 * f16 d, 16 bytes of nibbles, element j < 16 the low nibble of byte j, j >= 16 the high nibble of byte j - 16;
 * x = (nibble - 8) d), each head D / 32 whole blocks, rotated as kv_rows says (attention.h). Rows are encoded as ggml's reference quantisers do
 * (quantize_row_q8_0_ref, quantize_row_q4_0_ref; round to nearest even for f16 / bf16), so a row's bytes depend on
 * its floats alone: the same bits whichever call wrote it. */

int kv_rows_make(kv_rows *c, void *data, int32_t type, int64_t Hkv, int64_t D, int values) {
    int64_t head_bytes;
    switch (type) {
        case PI_TYPE_F32: head_bytes = 4 * D; break;
        case PI_TYPE_F16:
        case PI_TYPE_BF16: head_bytes = 2 * D; break;
        case PI_TYPE_Q8_0: head_bytes = D / QK * (int64_t)sizeof(block_q8_0); break;
        case PI_TYPE_Q4_0: head_bytes = D / QK * (int64_t)sizeof(block_q4_0); break;
        default: return 0;
    }
    if (data == NULL || (type != PI_TYPE_F32 && D > PI_KV_MAX_D)) return 0;
    const int blocks = type == PI_TYPE_Q8_0 || type == PI_TYPE_Q4_0;
    if (blocks && D % QK != 0) return 0;
    int32_t rot = 0;
    if (blocks && D % 64 == 0) {
        rot = 64;
        while (!values && D % (2 * rot) == 0) rot *= 2;
    }
    *c = (kv_rows){.data = (uint8_t *)data, .head_bytes = head_bytes, .row_bytes = Hkv * head_bytes, .type = type,
                   .rot = rot};
    return 1;
}

/* x (D) times the orthonormal Walsh-Hadamard matrix of size n (a power of two dividing D) in blocks of n: the
 * butterflies of the fast transform, then the scale 1 / sqrt(n) */
static void hadamard_rotate(float *x, int64_t D, int32_t n) {
    const float scale = 1.0f / sqrtf((float)n);
    for (int64_t b = 0; b < D; b += n) {
        float *y = x + b;
        for (int32_t h = 1; h < n; h *= 2)
            for (int32_t i = 0; i < n; i += 2 * h)
                for (int32_t j = i; j < i + h; j++) {
                    const float u = y[j], w = y[j + h];
                    y[j] = u + w;
                    y[j + h] = u - w;
                }
        for (int32_t j = 0; j < n; j++) y[j] *= scale;
    }
}

/* x (D floats) encoded into row pos, head kvh */
static void kv_store(const kv_rows *c, int64_t pos, int64_t kvh, const float *x, int64_t D) {
    uint8_t *dst = c->data + pos * c->row_bytes + kvh * c->head_bytes;
    switch (c->type) {
        case PI_TYPE_F16:
        case PI_TYPE_BF16:
            for (int64_t i = 0; i < D; i++) {
                const uint16_t h = c->type == PI_TYPE_F16 ? fp32_to_fp16(x[i]) : fp32_to_bf16(x[i]);
                memcpy(dst + 2 * i, &h, sizeof h);
            }
            break;
        case PI_TYPE_Q8_0:
            for (int64_t b = 0; b < D / QK; b++, x += QK) {
                block_q8_0 *blk = (block_q8_0 *)dst + b;
                float amax = 0.0f;
                for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
                const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
                blk->d = fp32_to_fp16(d);
                for (int j = 0; j < QK; j++) blk->qs[j] = (int8_t)roundf(x[j] * id);
            }
            break;
        case PI_TYPE_Q4_0:
            for (int64_t b = 0; b < D / QK; b++, x += QK) {
                block_q4_0 *blk = (block_q4_0 *)dst + b;
                float amax = 0.0f, max = 0.0f; /* the element of largest magnitude, its sign kept (the first) */
                for (int j = 0; j < QK; j++)
                    if (amax < fabsf(x[j])) {
                        amax = fabsf(x[j]);
                        max = x[j];
                    }
                const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
                blk->d = fp32_to_fp16(d);
                for (int j = 0; j < QK / 2; j++) {
                    const int8_t lo = (int8_t)(x[j] * id + 8.5f), hi = (int8_t)(x[j + QK / 2] * id + 8.5f);
                    blk->qs[j] = (uint8_t)((lo < 15 ? lo : 15) | (hi < 15 ? hi : 15) << 4);
                }
            }
            break;
        default: memcpy(dst, x, (size_t)D * sizeof(float)); break;
    }
}

/* KV heads [kvh0, kvh1) of one token: the RoPE of their query heads and of the KV head, the KV head's k and v written
 * to cache row pos, then attention over positions 0..pos (see attention.h). */
void attn_decode_heads(int32_t level, float *q, float *k, const float *v, const float *rope, const kv_rows *kc,
                       const kv_rows *vc, int64_t pos, int64_t H, int64_t Hkv, int64_t D, float scale, float *scores,
                       float *out, int64_t kvh0, int64_t kvh1, int attend, int neox) {
    const rope_rotate_fn rope_rotate = neox ? rope_rotate_neox : attn_variants[level].rope_rotate;
    const attend_kv_head_fn attend_kv_head = attn_variants[level].attend_kv_head;
    const int64_t G = H / Hkv, L = pos + 1;
    for (int64_t kvh = kvh0; kvh < kvh1; kvh++) {
        for (int64_t h = kvh * G; h < (kvh + 1) * G; h++) {
            rope_rotate(q + h * D, rope, D);
            if (kc->rot) hadamard_rotate(q + h * D, D, kc->rot);
        }
        rope_rotate(k + kvh * D, rope, D);
        if (kc->rot) hadamard_rotate(k + kvh * D, D, kc->rot);
        kv_store(kc, pos, kvh, k + kvh * D, D);
        if (vc->rot) {
            float rotated[PI_KV_MAX_D];
            memcpy(rotated, v + kvh * D, (size_t)D * sizeof(float));
            hadamard_rotate(rotated, D, vc->rot);
            kv_store(vc, pos, kvh, rotated, D);
        } else {
            kv_store(vc, pos, kvh, v + kvh * D, D);
        }
        if (attend) {
            attend_kv_head(q, kc, vc, kvh, G, L, D, scale, scores + kvh * G * L, out);
            if (vc->rot)
                for (int64_t h = kvh * G; h < (kvh + 1) * G; h++) hadamard_rotate(out + h * D, D, vc->rot);
        }
    }
}

/* Several threads share each KV head when the heads do not split evenly over them (SmolLM2: 3 KV heads on 2
 * threads left one thread a third of the time idle) and the context is long enough for the two extra barriers to
 * pay: the same bits either way (attend_team). */
#define ATT_TEAM_MIN_L 128

void attn_decode_part(int32_t level, float *q, float *k, const float *v, const float *rope, const kv_rows *kc,
                      const kv_rows *vc, int64_t pos, int64_t H, int64_t Hkv, int64_t D, float scale, float *scores, float *out,
                      int64_t me, int64_t all, int neox) {
    const attend_team_fn team = attn_variants[level].attend_team;
    const int64_t G = H / Hkv, L = pos + 1, kvh0 = Hkv * me / all, kvh1 = Hkv * (me + 1) / all;
    if (all > 1 && team != NULL && Hkv % all != 0 && L >= ATT_TEAM_MIN_L && D % 8 == 0 && G <= 64) {
        attn_decode_heads(level, q, k, v, rope, kc, vc, pos, H, Hkv, D, scale, scores, out, kvh0, kvh1, 0, neox);
#pragma omp barrier
        team(q, kc, vc, Hkv, G, L, D, scale, scores, scores + H * L, out, me, all);
        if (vc->rot) { /* every lane of a head is written: each head rotated back by one thread */
#pragma omp barrier
            for (int64_t h = H * me / all; h < H * (me + 1) / all; h++) hadamard_rotate(out + h * D, D, vc->rot);
        }
    } else {
        attn_decode_heads(level, q, k, v, rope, kc, vc, pos, H, Hkv, D, scale, scores, out, kvh0, kvh1, 1, neox);
    }
}

PI_EXPORT int32_t pi_attn_decode(float *q, float *k, const float *v, const float *rope, void *kc, void *vc,
                                 int32_t type_k, int32_t type_v, int64_t n_ctx, int64_t pos, int64_t H, int64_t Hkv, int64_t D, float scale, float *out,
                                 void *scratch, int64_t scratch_bytes, int32_t neox, int32_t n_threads, int32_t isa) {
    if (pos < 0 || pos >= n_ctx || H <= 0 || Hkv <= 0 || H % Hkv != 0 || D <= 0 || D % 2 != 0) return PI_ERR_SHAPE;
    if (q == NULL || k == NULL || v == NULL || rope == NULL || out == NULL) return PI_ERR_SHAPE;
    kv_rows krows, vrows;
    if (!kv_rows_make(&krows, kc, type_k, Hkv, D, 0) || !kv_rows_make(&vrows, vc, type_v, Hkv, D, 1)) return PI_ERR_SHAPE;
    const int64_t L = pos + 1;
    uint8_t *buf;
    const int32_t status = scratch_take(scratch, scratch_bytes, attn_scores_bytes(L, H), &buf);
    if (status != PI_OK) return status;
    const int32_t level = pi_isa_clamp(isa);
    float *scores = (float *)buf; /* G * L per KV head */
    int32_t nt = threads_for_work(n_threads, 2 * H * L * D);
    if (nt > Hkv && L < ATT_TEAM_MIN_L) nt = (int32_t)Hkv;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();
        attn_decode_part(level, q, k, v, rope, &krows, &vrows, pos, H, Hkv, D, scale, scores, out, me, all, neox != 0);
    }
    return PI_OK;
}

/* Tokens t < T, token t the query q + t H D (its k and v at t Hkv D, its rope pairs at t D) at position pos[t] over
 * the cache kr[t], vr[t], each exactly as pi_attn_decode computes it (q and k rotated in place, k and v written to
 * row pos[t], attention over positions 0..pos[t]). First every token's rotation and cache write, split over the
 * threads, or (serial) in token order on one thread, for tokens that may repeat a (cache, position): the repeat
 * writes the same bytes after the first, never beside it. Then the (token, KV head) items, each on one thread with
 * its own scores: the bits do not depend on the thread count. */
static int32_t attn_tokens(int32_t level, float *q, float *k, const float *v, const float *rope, const kv_rows *kr,
                           const kv_rows *vr, const int64_t *pos, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                           float scale, float *out, int serial, int neox, int32_t n_threads) {
    const attend_kv_head_fn attend_kv_head = attn_variants[level].attend_kv_head;
    const int64_t G = H / Hkv, row = Hkv * D;
    int64_t L_max = 0;
    for (int64_t t = 0; t < T; t++) L_max = pos[t] + 1 > L_max ? pos[t] + 1 : L_max;
    const int32_t nt = threads_for_work(n_threads, 2 * H * L_max * D * T);
    const size_t per_thread = align_up((size_t)(G * L_max) * sizeof(float));
    float *scores = aligned_alloc(64, per_thread * (size_t)nt);
    if (scores == NULL) return PI_ERR_ALLOC;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *s = (float *)((uint8_t *)scores + per_thread * (size_t)omp_get_thread_num());
        if (serial) {
#pragma omp single
            for (int64_t t = 0; t < T; t++)
                attn_decode_heads(level, q + t * H * D, k + t * row, v + t * row, rope + t * D, &kr[t], &vr[t],
                                  pos[t], H, Hkv, D, scale, NULL, NULL, 0, Hkv, 0, neox);
        } else {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                attn_decode_heads(level, q + t * H * D, k + t * row, v + t * row, rope + t * D, &kr[t], &vr[t],
                                  pos[t], H, Hkv, D, scale, NULL, NULL, 0, Hkv, 0, neox);
        }
        /* tokens at later positions see more rows: dynamic, so the threads end together */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < T * Hkv; i++) {
            const int64_t t = i / Hkv, kvh = i % Hkv;
            attend_kv_head(q + t * H * D, &kr[t], &vr[t], kvh, G, pos[t] + 1, D, scale, s, out + t * H * D);
            if (vr[t].rot)
                for (int64_t h = kvh * G; h < (kvh + 1) * G; h++) hadamard_rotate(out + t * H * D + h * D, D, vr[t].rot);
        }
    }
    free(scores);
    return PI_OK;
}

/* pi_attn_prefill(q, k, v, rope, kc, vc, type_k, type_v, n_ctx, pos, T, H, Hkv, D, scale, out, neox, threads, isa): T consecutive tokens
 * of one sequence at positions pos..pos + T - 1, each exactly as pi_attn_decode computes it at its position (its q
 * and k rotated in place with its rope row, k and v written to its cache row, attention over positions 0 up to its
 * own), so a token's output does not depend on how its prompt was split into batches, nor on the thread count.
 * q (T, H * D), k and v (T, Hkv * D), rope (T, D / 2 pairs), out (T, H * D) (attn_tokens). */
PI_EXPORT int32_t pi_attn_prefill(float *q, float *k, const float *v, const float *rope, void *kc, void *vc,
                                  int32_t type_k, int32_t type_v, int64_t n_ctx, int64_t pos, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                  float scale, float *out, int32_t neox, int32_t n_threads, int32_t isa) {
    if (pos < 0 || T <= 0 || T > n_ctx || pos > n_ctx - T || H <= 0 || Hkv <= 0 || H % Hkv != 0 || D <= 0 ||
        D % 2 != 0)
        return PI_ERR_SHAPE;
    if (q == NULL || k == NULL || v == NULL || rope == NULL || out == NULL) return PI_ERR_SHAPE;
    kv_rows krows, vrows;
    if (!kv_rows_make(&krows, kc, type_k, Hkv, D, 0) || !kv_rows_make(&vrows, vc, type_v, Hkv, D, 1)) return PI_ERR_SHAPE;
    kv_rows *rows = malloc((size_t)T * (2 * sizeof(kv_rows) + sizeof(int64_t)));
    if (rows == NULL) return PI_ERR_ALLOC;
    int64_t *positions = (int64_t *)(rows + 2 * T);
    for (int64_t t = 0; t < T; t++) {
        rows[t] = krows;
        rows[T + t] = vrows;
        positions[t] = pos + t;
    }
    const int32_t status = attn_tokens(pi_isa_clamp(isa), q, k, v, rope, rows, rows + T, positions, T, H, Hkv, D,
                                       scale, out, 0, neox != 0, n_threads);
    free(rows);
    return status;
}

/* pi_attn_decode_batch(q, k, v, rope, kc, vc, type_k, type_v, n_seq, n_ctx, seqs, pos, B, H, Hkv, D, scale, out, neox,
 * threads, isa): B tokens, token b of sequence seqs[b] at position pos[b], each exactly as pi_attn_decode computes it
 * over that sequence's cache, in one call (a decode step of several sequences: a token's output does not depend on
 * the others). kc, vc: the caches of n_seq sequences, each n_ctx rows as pi_attn_decode's, one after the other;
 * q (B, H * D), k and v (B, Hkv * D), rope (B, D / 2 pairs), out (B, H * D). A token may repeat an earlier one's
 * (sequence, position) with the same q, k, v (a padded batch): it writes the same row again, after the first. */
PI_EXPORT int32_t pi_attn_decode_batch(float *q, float *k, const float *v, const float *rope, void *kc, void *vc,
                                       int32_t type_k, int32_t type_v, int64_t n_seq, int64_t n_ctx, const int64_t *seqs,
                                       const int64_t *pos, int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale,
                                       float *out, int32_t neox, int32_t n_threads, int32_t isa) {
    if (B <= 0 || n_seq <= 0 || n_ctx <= 0 || H <= 0 || Hkv <= 0 || H % Hkv != 0 || D <= 0 || D % 2 != 0)
        return PI_ERR_SHAPE;
    if (q == NULL || k == NULL || v == NULL || rope == NULL || out == NULL || seqs == NULL || pos == NULL)
        return PI_ERR_SHAPE;
    for (int64_t b = 0; b < B; b++)
        if (seqs[b] < 0 || seqs[b] >= n_seq || pos[b] < 0 || pos[b] >= n_ctx) return PI_ERR_SHAPE;
    kv_rows krows, vrows;
    if (!kv_rows_make(&krows, kc, type_k, Hkv, D, 0) || !kv_rows_make(&vrows, vc, type_v, Hkv, D, 1)) return PI_ERR_SHAPE;
    kv_rows *rows = malloc((size_t)B * 2 * sizeof(kv_rows));
    if (rows == NULL) return PI_ERR_ALLOC;
    for (int64_t b = 0; b < B; b++) {
        rows[b] = krows;
        rows[b].data += seqs[b] * n_ctx * krows.row_bytes;
        rows[B + b] = vrows;
        rows[B + b].data += seqs[b] * n_ctx * vrows.row_bytes;
    }
    const int32_t status = attn_tokens(pi_isa_clamp(isa), q, k, v, rope, rows, rows + B, pos, B, H, Hkv, D, scale,
                                       out, 1, neox != 0, n_threads);
    free(rows);
    return status;
}
