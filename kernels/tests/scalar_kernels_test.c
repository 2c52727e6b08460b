/* Tests of the scalar kernels (isa PI_ISA_SCALAR), in C, so that they run where Python and torch do not: under
 * qemu-aarch64 for a cross-compiled build (scripts/check_aarch64.sh), or natively on any CPU.
 *
 *   scalar_kernels_test [GOLDEN_DIR]
 *
 * Checks, for every weight type of the kernels (F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL,
 * IQ4_XS):
 *   get_rows   the block-32 and float types bit-equal to a decoder written here from the layouts in quants.h;
 *   matmul     exact ("f32") and int8-activation ("q8") kernels, one token (the dot kernels) and several (the
 *              tiles), 1 and 2 threads, against a double-precision dot of the decoded weights: within 12 * 2^-24 *
 *              sum|w x| (float32 summation; measured 4.1) for the exact ones, plus 0.3 of the worst activation
 *              rounding sum|w| * d_x / 2 (d_x the block's scale; measured 0.15) for the q8 ones; each token's
 *              result bit-equal whatever the token count and thread count (the kernels' documented contract);
 *   rows       pi_rows_matmul_* (listed rows) bit-equal to the same rows of pi_matmul_*;
 *   axpy       pi_rows_axpy_* (y = sum h[m] W[idx[m]]) against a double-precision sum, within 12 * 2^-24 *
 *              sum|h w| (measured 3.8), and Q4_0 with bfloat16 coefficients within 2^-9 of sum|h w| more (their
 *              rounding, sparse.h);
 *   quantize   pi_quantize_q8_k within d / 2 per element with exact block sums; pi_quantize_rows (Q2_K..Q6_K,
 *              IQ4_NL, IQ4_XS) bytes equal to llama.cpp's for the rows of tests/data/kquant_golden.npz when
 *              GOLDEN_DIR holds its members (x.npy, Q2_K.npy, ...), and a round trip through get_rows within a
 *              relative RMS error per type.
 * K-quant and IQ4 weights are made by pi_quantize_rows and decoded by pi_get_rows (checked by the round trip and by
 * the golden bytes), the other types from random bits.
 *
 * Prints one "digest <case> <hex>" line per result (FNV-1a of its bytes): scripts/check_aarch64.sh compares them
 * between a native x86-64 build and the aarch64 one under qemu, so the scalar results must be the same bits on
 * both. Exit status 0 when every check passes, 1 otherwise.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the ABI of the kernels in kernels/cpu ---- */

typedef int32_t (*matmul_fn)(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, const float *x,
                             int64_t x_stride, int64_t T, float *y, int64_t y_stride, int32_t n_threads, int32_t isa);
typedef int32_t (*get_rows_fn)(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, const int64_t *ids,
                               int64_t n_ids, float *y, int64_t y_stride, int32_t n_threads, int32_t isa);
typedef int32_t (*rows_matmul_fn)(const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, const int64_t *idx,
                                  int64_t M, const float *x, int64_t x_stride, int64_t T, float *y, int64_t y_stride,
                                  int32_t n_threads, int32_t isa);
typedef int32_t (*rows_axpy_fn)(const uint8_t *w, int64_t w_stride, int64_t N, int64_t D, const int64_t *idx,
                                int64_t M, const float *h, int64_t h_stride, int64_t T, float *y, int64_t y_stride,
                                int32_t q8_act, float h_min, int32_t n_threads, int32_t isa);

int32_t pi_kernels_isa_best(void);
int32_t pi_quantize_rows(int32_t ggml_type, const float *src, int64_t n_rows, int64_t n_cols, uint8_t *dst,
                         int32_t n_threads);
int32_t pi_quantize_q8_k(const float *x, int64_t K, int64_t T, int8_t *qs, float *d, int16_t *bsums, int32_t isa);

#define DECLARE_MATMUL(name)                                                                                   \
    int32_t pi_matmul_##name(const uint8_t *, int64_t, int64_t, int64_t, const float *, int64_t, int64_t, float *, \
                             int64_t, int32_t, int32_t);
#define DECLARE_GET_ROWS(name)                                                                                       \
    int32_t pi_get_rows_##name(const uint8_t *, int64_t, int64_t, int64_t, const int64_t *, int64_t, float *, int64_t, \
                               int32_t, int32_t);
#define DECLARE_ROWS_MATMUL(name)                                                                                    \
    int32_t pi_rows_matmul_##name(const uint8_t *, int64_t, int64_t, int64_t, const int64_t *, int64_t, const float *, \
                                  int64_t, int64_t, float *, int64_t, int32_t, int32_t);
#define DECLARE_AXPY(name)                                                                                          \
    int32_t pi_rows_axpy_##name(const uint8_t *, int64_t, int64_t, int64_t, const int64_t *, int64_t, const float *, \
                                int64_t, int64_t, float *, int64_t, int32_t, float, int32_t, int32_t);
#define DECLARE_ALL(name) DECLARE_MATMUL(name) DECLARE_GET_ROWS(name)
DECLARE_ALL(f32)
DECLARE_ALL(f16)
DECLARE_ALL(bf16)
DECLARE_ALL(q4_0)
DECLARE_ALL(q4_1)
DECLARE_ALL(q8_0)
DECLARE_ALL(q5_0)
DECLARE_ALL(q5_1)
DECLARE_ALL(q2_k)
DECLARE_ALL(q3_k)
DECLARE_ALL(q4_k)
DECLARE_ALL(q5_k)
DECLARE_ALL(q6_k)
DECLARE_ALL(iq4_nl)
DECLARE_ALL(iq4_xs)
DECLARE_MATMUL(q4_0_f)
DECLARE_MATMUL(q4_1_f)
DECLARE_MATMUL(q8_0_f)
DECLARE_MATMUL(q5_0_f)
DECLARE_MATMUL(q5_1_f)
DECLARE_MATMUL(q2_k_f)
DECLARE_MATMUL(q3_k_f)
DECLARE_MATMUL(q4_k_f)
DECLARE_MATMUL(q5_k_f)
DECLARE_MATMUL(q6_k_f)
DECLARE_MATMUL(iq4_nl_f)
DECLARE_MATMUL(iq4_xs_f)
DECLARE_ROWS_MATMUL(f32)
DECLARE_ROWS_MATMUL(f16)
DECLARE_ROWS_MATMUL(bf16)
DECLARE_ROWS_MATMUL(q4_0)
DECLARE_ROWS_MATMUL(q4_1)
DECLARE_ROWS_MATMUL(q8_0)
DECLARE_ROWS_MATMUL(q5_0)
DECLARE_ROWS_MATMUL(q5_1)
DECLARE_ROWS_MATMUL(q4_0_f)
DECLARE_ROWS_MATMUL(q4_1_f)
DECLARE_ROWS_MATMUL(q8_0_f)
DECLARE_ROWS_MATMUL(q5_0_f)
DECLARE_ROWS_MATMUL(q5_1_f)
DECLARE_ROWS_MATMUL(q2_k_f)
DECLARE_ROWS_MATMUL(q3_k_f)
DECLARE_ROWS_MATMUL(q4_k_f)
DECLARE_ROWS_MATMUL(q5_k_f)
DECLARE_ROWS_MATMUL(q6_k_f)
DECLARE_AXPY(f32)
DECLARE_AXPY(f16)
DECLARE_AXPY(bf16)
DECLARE_AXPY(q4_0)
DECLARE_AXPY(q4_1)
DECLARE_AXPY(q8_0)
DECLARE_AXPY(q5_0)
DECLARE_AXPY(q5_1)
DECLARE_AXPY(q2_k)
DECLARE_AXPY(q3_k)
DECLARE_AXPY(q4_k)
DECLARE_AXPY(q5_k)
DECLARE_AXPY(q6_k)

#define ISA 0 /* PI_ISA_SCALAR */
#define U 5.9604644775390625e-8 /* 2^-24, float32's unit roundoff */

/* ---- types ---- */

enum act { ACT_FLOAT, ACT_Q8_BLOCK32, ACT_Q8_K }; /* what the "q8" kernel does to the activations */
enum source { SRC_F32, SRC_F16, SRC_BF16, SRC_BLOCK32, SRC_QUANTIZE }; /* how the test makes weights */

typedef struct {
    const char *name;
    int ggml_type;
    int block_elems, block_bytes;
    enum source source;
    enum act q8_act;
    matmul_fn matmul_q8, matmul_f;
    get_rows_fn get_rows;
    rows_matmul_fn rows_q8, rows_f; /* NULL: none (the K-quants' listed rows are exact in both precisions) */
    rows_axpy_fn axpy;              /* NULL: none */
    double roundtrip_rms;           /* quantize -> get_rows relative RMS error bound (SRC_QUANTIZE) */
} type_info;

/* roundtrip bounds: about 1.4x the relative RMS error measured on these gaussian rows (x86-64 and aarch64 alike):
 * Q2_K 0.2932, Q3_K 0.1489, Q4_K 0.0705, Q5_K 0.0357, Q6_K 0.0174, IQ4_NL 0.0759, IQ4_XS 0.0759 */
static const type_info TYPES[] = {
    {"f32", 0, 1, 4, SRC_F32, ACT_FLOAT, pi_matmul_f32, pi_matmul_f32, pi_get_rows_f32, pi_rows_matmul_f32,
     pi_rows_matmul_f32, pi_rows_axpy_f32, 0},
    {"f16", 1, 1, 2, SRC_F16, ACT_FLOAT, pi_matmul_f16, pi_matmul_f16, pi_get_rows_f16, pi_rows_matmul_f16,
     pi_rows_matmul_f16, pi_rows_axpy_f16, 0},
    {"bf16", 30, 1, 2, SRC_BF16, ACT_FLOAT, pi_matmul_bf16, pi_matmul_bf16, pi_get_rows_bf16, pi_rows_matmul_bf16,
     pi_rows_matmul_bf16, pi_rows_axpy_bf16, 0},
    {"q4_0", 2, 32, 18, SRC_BLOCK32, ACT_Q8_BLOCK32, pi_matmul_q4_0, pi_matmul_q4_0_f, pi_get_rows_q4_0,
     pi_rows_matmul_q4_0, pi_rows_matmul_q4_0_f, pi_rows_axpy_q4_0, 0},
    {"q4_1", 3, 32, 20, SRC_BLOCK32, ACT_Q8_BLOCK32, pi_matmul_q4_1, pi_matmul_q4_1_f, pi_get_rows_q4_1,
     pi_rows_matmul_q4_1, pi_rows_matmul_q4_1_f, pi_rows_axpy_q4_1, 0},
    {"q5_0", 6, 32, 22, SRC_BLOCK32, ACT_Q8_BLOCK32, pi_matmul_q5_0, pi_matmul_q5_0_f, pi_get_rows_q5_0,
     pi_rows_matmul_q5_0, pi_rows_matmul_q5_0_f, pi_rows_axpy_q5_0, 0},
    {"q5_1", 7, 32, 24, SRC_BLOCK32, ACT_Q8_BLOCK32, pi_matmul_q5_1, pi_matmul_q5_1_f, pi_get_rows_q5_1,
     pi_rows_matmul_q5_1, pi_rows_matmul_q5_1_f, pi_rows_axpy_q5_1, 0},
    {"q8_0", 8, 32, 34, SRC_BLOCK32, ACT_Q8_BLOCK32, pi_matmul_q8_0, pi_matmul_q8_0_f, pi_get_rows_q8_0,
     pi_rows_matmul_q8_0, pi_rows_matmul_q8_0_f, pi_rows_axpy_q8_0, 0},
    {"q2_k", 10, 256, 84, SRC_QUANTIZE, ACT_Q8_K, pi_matmul_q2_k, pi_matmul_q2_k_f, pi_get_rows_q2_k, NULL,
     pi_rows_matmul_q2_k_f, pi_rows_axpy_q2_k, 0.41},
    {"q3_k", 11, 256, 110, SRC_QUANTIZE, ACT_Q8_K, pi_matmul_q3_k, pi_matmul_q3_k_f, pi_get_rows_q3_k, NULL,
     pi_rows_matmul_q3_k_f, pi_rows_axpy_q3_k, 0.21},
    {"q4_k", 12, 256, 144, SRC_QUANTIZE, ACT_Q8_K, pi_matmul_q4_k, pi_matmul_q4_k_f, pi_get_rows_q4_k, NULL,
     pi_rows_matmul_q4_k_f, pi_rows_axpy_q4_k, 0.10},
    {"q5_k", 13, 256, 176, SRC_QUANTIZE, ACT_Q8_K, pi_matmul_q5_k, pi_matmul_q5_k_f, pi_get_rows_q5_k, NULL,
     pi_rows_matmul_q5_k_f, pi_rows_axpy_q5_k, 0.050},
    {"q6_k", 14, 256, 210, SRC_QUANTIZE, ACT_Q8_K, pi_matmul_q6_k, pi_matmul_q6_k_f, pi_get_rows_q6_k, NULL,
     pi_rows_matmul_q6_k_f, pi_rows_axpy_q6_k, 0.025},
    {"iq4_nl", 20, 32, 18, SRC_QUANTIZE, ACT_Q8_BLOCK32, pi_matmul_iq4_nl, pi_matmul_iq4_nl_f, pi_get_rows_iq4_nl,
     NULL, NULL, NULL, 0.105},
    {"iq4_xs", 23, 256, 136, SRC_QUANTIZE, ACT_Q8_K, pi_matmul_iq4_xs, pi_matmul_iq4_xs_f, pi_get_rows_iq4_xs, NULL,
     NULL, NULL, 0.105},
};
#define N_TYPES (int)(sizeof TYPES / sizeof TYPES[0])

/* ---- helpers ---- */

static int failures;

static void fail(const char *what, const char *detail) {
    printf("FAIL %s: %s\n", what, detail);
    failures++;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng_next(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rng_uniform(void) { return (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0); }
static float rng_gauss(void) { /* Irwin-Hall: sum of 12 uniforms - 6 */
    double s = 0;
    for (int i = 0; i < 12; i++) s += rng_uniform();
    return (float)(s - 6.0);
}

static uint64_t fnv1a(const void *p, size_t n) {
    const uint8_t *b = p;
    uint64_t h = 0xCBF29CE484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001B3ull;
    return h;
}
static void digest(const char *name, const void *p, size_t n) {
    printf("digest %s %016llx\n", name, (unsigned long long)fnv1a(p, n));
}

static void *xmalloc(size_t n) {
    void *p = calloc(1, n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

/* fp16 / bf16 -> float, written from the IEEE definitions (independent of common.h's decoder) */
static float half_value(uint16_t h) {
    const int sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    return (float)(sign ? -v : v);
}
static float bf16_value(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* a random finite fp16 with magnitude in [2^(e0-15), 2^(e1-14)) */
static uint16_t random_half(int e0, int e1, int allow_negative) {
    const uint16_t e = (uint16_t)(e0 + (int)(rng_next() % (uint64_t)(e1 - e0 + 1)));
    const uint16_t sign = allow_negative && (rng_next() & 1) ? 0x8000 : 0;
    return (uint16_t)(sign | e << 10 | (rng_next() & 1023));
}

/* One row of K elements of a block-32 type decoded from the layouts in quants.h. */
static void decode_block32_row(const char *name, const uint8_t *row, int64_t K, float *out) {
    const int bytes = !strcmp(name, "q4_0") ? 18 : !strcmp(name, "q4_1") ? 20 : !strcmp(name, "q5_0") ? 22
                      : !strcmp(name, "q5_1") ? 24 : 34;
    for (int64_t b = 0; b < K / 32; b++) {
        const uint8_t *p = row + b * bytes;
        const float d = half_value(rd16(p));
        float *y = out + b * 32;
        if (!strcmp(name, "q8_0")) {
            for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)p[2 + j] * d;
        } else if (!strcmp(name, "q4_0") || !strcmp(name, "q4_1")) {
            const int has_m = name[3] == '1';
            const float m = has_m ? half_value(rd16(p + 2)) : 0.0f;
            const uint8_t *qs = p + (has_m ? 4 : 2);
            for (int j = 0; j < 16; j++) {
                const int lo = qs[j] & 15, hi = qs[j] >> 4;
                y[j] = has_m ? (float)lo * d + m : (float)(lo - 8) * d;
                y[j + 16] = has_m ? (float)hi * d + m : (float)(hi - 8) * d;
            }
        } else { /* q5_0, q5_1 */
            const int has_m = name[3] == '1';
            const float m = has_m ? half_value(rd16(p + 2)) : 0.0f;
            const uint8_t *qh = p + (has_m ? 4 : 2), *qs = qh + 4;
            const uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
            for (int j = 0; j < 16; j++) {
                const int lo = (qs[j] & 15) | (int)((h >> j) & 1) << 4;
                const int hi = (qs[j] >> 4) | (int)((h >> (j + 16)) & 1) << 4;
                y[j] = has_m ? (float)lo * d + m : (float)(lo - 16) * d;
                y[j + 16] = has_m ? (float)hi * d + m : (float)(hi - 16) * d;
            }
        }
    }
}

/* N rows of K elements of type t: random bytes (w), and their values (wf) */
static void make_weights(const type_info *t, int64_t N, int64_t K, uint8_t *w, float *wf) {
    const int64_t row_bytes = K / t->block_elems * t->block_bytes;
    switch (t->source) {
    case SRC_F32:
        for (int64_t i = 0; i < N * K; i++) {
            wf[i] = rng_gauss() * 0.5f;
            memcpy(w + 4 * i, &wf[i], 4);
        }
        break;
    case SRC_F16:
        for (int64_t i = 0; i < N * K; i++) {
            const uint16_t h = random_half(12, 15, 1);
            memcpy(w + 2 * i, &h, 2);
            wf[i] = half_value(h);
        }
        break;
    case SRC_BF16:
        for (int64_t i = 0; i < N * K; i++) {
            const uint16_t sign = (uint16_t)((rng_next() & 1) << 15); /* one draw per statement: a fixed order */
            const uint16_t e = (uint16_t)(124 + rng_next() % 4);     /* |value| in [2^-3, 2) */
            const uint16_t h = (uint16_t)(sign | e << 7 | (rng_next() & 127));
            memcpy(w + 2 * i, &h, 2);
            wf[i] = bf16_value(h);
        }
        break;
    case SRC_BLOCK32:
        for (int64_t i = 0; i < N * row_bytes; i++) w[i] = (uint8_t)rng_next();
        for (int64_t n = 0; n < N; n++) {
            for (int64_t b = 0; b < K / 32; b++) {
                uint8_t *p = w + n * row_bytes + b * t->block_bytes;
                const uint16_t d = random_half(8, 10, 1); /* |d| in [2^-7, 2^-4) */
                memcpy(p, &d, 2);
                if (t->name[3] == '1') {
                    const uint16_t m = random_half(10, 12, 1);
                    memcpy(p + 2, &m, 2);
                }
            }
            decode_block32_row(t->name, w + n * row_bytes, K, wf + n * K);
        }
        break;
    case SRC_QUANTIZE: {
        float *src = xmalloc((size_t)(N * K) * sizeof(float));
        for (int64_t i = 0; i < N * K; i++) src[i] = rng_gauss() * 0.05f;
        if (pi_quantize_rows(t->ggml_type, src, N, K, w, 1) != 0) fail(t->name, "pi_quantize_rows failed");
        int64_t *ids = xmalloc((size_t)N * sizeof(int64_t));
        for (int64_t n = 0; n < N; n++) ids[n] = n;
        if (t->get_rows(w, row_bytes, N, K, ids, N, wf, K, 1, ISA) != 0) fail(t->name, "get_rows failed");
        double se = 0, sx = 0;
        for (int64_t i = 0; i < N * K; i++) {
            se += ((double)wf[i] - src[i]) * ((double)wf[i] - src[i]);
            sx += (double)src[i] * src[i];
        }
        const double rel = sqrt(se / sx);
        char msg[160];
        snprintf(msg, sizeof msg, "quantize round trip relative RMS error %.4f (bound %.3f)", rel, t->roundtrip_rms);
        printf("measured %s %s\n", t->name, msg);
        if (!(rel <= t->roundtrip_rms)) fail(t->name, msg);
        free(ids);
        free(src);
        break;
    }
    }
}

/* ---- checks ---- */

static void check_get_rows(const type_info *t, const uint8_t *w, const float *wf, int64_t N, int64_t K) {
    if (t->source == SRC_QUANTIZE) return; /* decoded by get_rows itself */
    const int64_t row_bytes = K / t->block_elems * t->block_bytes;
    const int64_t ids[3] = {N - 1, 0, N / 2};
    float *y = xmalloc((size_t)(3 * K) * sizeof(float));
    if (t->get_rows(w, row_bytes, N, K, ids, 3, y, K, 1, ISA) != 0) fail(t->name, "get_rows failed");
    for (int r = 0; r < 3; r++)
        if (memcmp(y + r * K, wf + ids[r] * K, (size_t)K * sizeof(float)) != 0) {
            fail(t->name, "get_rows differs from the decoder of quants.h's layout");
            break;
        }
    const int64_t bad = N;
    if (t->get_rows(w, row_bytes, N, K, &bad, 1, y, K, 1, ISA) != 3) fail(t->name, "get_rows: row N not PI_ERR_INDEX");
    free(y);
}

/* |y - ref| <= bound for every output; prints the largest error relative to its bound */
static void check_close(const char *what, const float *y, const double *ref, const double *bound, int64_t n) {
    double worst = 0;
    int64_t at = -1;
    for (int64_t i = 0; i < n; i++) {
        const double r = fabs((double)y[i] - ref[i]) / bound[i];
        if (!(r <= worst)) worst = r, at = i;
    }
    char msg[200];
    snprintf(msg, sizeof msg, "largest error / bound %.3g (output %lld: %.9g, reference %.9g)", worst, (long long)at,
             at >= 0 ? y[at] : 0.0, at >= 0 ? ref[at] : 0.0);
    printf("measured %s %s\n", what, msg);
    if (!(worst <= 1.0)) fail(what, msg);
}

static void check_matmul(const type_info *t, const uint8_t *w, const float *wf, int64_t N, int64_t K) {
    enum { T = 9 };
    const int64_t row_bytes = K / t->block_elems * t->block_bytes;
    float *x = xmalloc((size_t)(T * K) * sizeof(float));
    for (int64_t i = 0; i < T * K; i++) x[i] = rng_gauss();
    for (int64_t k = 0; k < 32; k++) x[3 * K + k] = 0.0f; /* an all-zero activation block */
    double *ref = xmalloc((size_t)(T * N) * sizeof(double)), *mag = xmalloc((size_t)(T * N) * sizeof(double));
    double *bound = xmalloc((size_t)(T * N) * sizeof(double));
    for (int64_t t_ = 0; t_ < T; t_++)
        for (int64_t n = 0; n < N; n++) {
            double s = 0, a = 0;
            for (int64_t k = 0; k < K; k++) {
                s += (double)wf[n * K + k] * x[t_ * K + k];
                a += fabs((double)wf[n * K + k] * x[t_ * K + k]);
            }
            ref[t_ * N + n] = s, mag[t_ * N + n] = a;
        }
    float *y = xmalloc((size_t)(T * N) * sizeof(float)), *y1 = xmalloc((size_t)N * sizeof(float));
    char what[96];
    for (int q8 = 0; q8 < 2; q8++) {
        if (q8 && t->q8_act == ACT_FLOAT) continue; /* the float types' "q8" kernel is the exact one */
        const matmul_fn mm = q8 ? t->matmul_q8 : t->matmul_f;
        /* the bound: float32 summation, 12 * 2^-24 * sum|w x| (K * 2^-24 * sum|w x| in the worst case; measured
         * at most 4.1 * 2^-24 * sum|w x| over every type here), and for q8 the activation rounding of each block
         * (at most sum|w| * d_x / 2 over its elements, d_x = amax / 127), of which 0.3 (measured: at most 0.15) */
        const int act_block = t->q8_act == ACT_Q8_K ? 256 : 32;
        for (int64_t t_ = 0; t_ < T; t_++)
            for (int64_t n = 0; n < N; n++) {
                double b = 12 * U * mag[t_ * N + n] + 1e-30;
                if (q8)
                    for (int64_t k0 = 0; k0 < K; k0 += act_block) {
                        double amax = 0, sw = 0;
                        for (int64_t k = k0; k < k0 + act_block; k++) {
                            amax = fmax(amax, fabs(x[t_ * K + k]));
                            sw += fabs(wf[n * K + k]);
                        }
                        b += 0.3 * sw * amax / 127.0 * 0.5;
                    }
                bound[t_ * N + n] = b;
            }
        uint64_t first = 0;
        for (int threads = 1; threads <= 2; threads++) {
            if (mm(w, row_bytes, N, K, x, K, T, y, N, threads, ISA) != 0) fail(t->name, "matmul failed");
            const uint64_t h = fnv1a(y, (size_t)(T * N) * sizeof(float));
            if (threads == 1) {
                first = h;
                snprintf(what, sizeof what, "matmul_%s_%s", t->name, q8 ? "q8" : "f32");
                check_close(what, y, ref, bound, T * N);
                digest(what, y, (size_t)(T * N) * sizeof(float));
            } else if (h != first) {
                fail(what, "2 threads give other bits than 1");
            }
            /* each token alone (T = 1: the dot kernels where the type has them) gives that token's bits */
            for (int64_t t_ = 0; t_ < T; t_ += 4) {
                if (mm(w, row_bytes, N, K, x + t_ * K, K, 1, y1, N, threads, ISA) != 0) fail(t->name, "matmul failed");
                if (memcmp(y1, y + t_ * N, (size_t)N * sizeof(float)) != 0) {
                    fail(what, "one token alone gives other bits than in a batch");
                    break;
                }
            }
        }
        /* listed rows: the bits of the same rows of the dense product */
        const rows_matmul_fn rm = q8 ? t->rows_q8 : t->rows_f;
        if (rm != NULL) {
            const int64_t M = 5, idx[5] = {N - 1, 3, 3, 0, N / 2};
            float ys[9 * 5];
            for (int64_t tt = 1; tt <= T; tt += T - 1) {
                if (rm(w, row_bytes, N, K, idx, M, x, K, tt, ys, M, 1, ISA) != 0) fail(t->name, "rows_matmul failed");
                for (int64_t t_ = 0; t_ < tt; t_++)
                    for (int64_t m = 0; m < M; m++)
                        if (memcmp(&ys[t_ * M + m], &y[t_ * N + idx[m]], sizeof(float)) != 0) {
                            snprintf(what, sizeof what, "rows_matmul_%s_%s (T = %lld)", t->name, q8 ? "q8" : "f32",
                                     (long long)tt);
                            fail(what, "a listed row differs from the dense product's");
                            t_ = tt, m = M;
                        }
            }
        }
    }
    free(x), free(ref), free(mag), free(bound), free(y), free(y1);
}

static void check_axpy(const type_info *t, const uint8_t *w, const float *wf, int64_t N, int64_t D) {
    if (t->axpy == NULL) return;
    enum { T = 3, M = 24 };
    const int64_t row_bytes = D / t->block_elems * t->block_bytes;
    int64_t idx[M];
    float h[T * M];
    for (int m = 0; m < M; m++) idx[m] = (int64_t)(rng_next() % (uint64_t)N);
    for (int i = 0; i < T * M; i++) h[i] = (i % 5 == 2) ? 0.0f : rng_gauss();
    float *y = xmalloc((size_t)(T * D) * sizeof(float));
    double *ref = xmalloc((size_t)(T * D) * sizeof(double)), *bound = xmalloc((size_t)(T * D) * sizeof(double));
    for (int q8 = 0; q8 < 2; q8++) {
        if (q8 && strcmp(t->name, "q4_0") != 0) continue; /* q8_act changes Q4_0 only */
        for (int64_t t_ = 0; t_ < T; t_++)
            for (int64_t e = 0; e < D; e++) {
                double s = 0, a = 0;
                for (int m = 0; m < M; m++) {
                    s += (double)h[t_ * M + m] * wf[idx[m] * D + e];
                    a += fabs((double)h[t_ * M + m] * wf[idx[m] * D + e]);
                }
                ref[t_ * D + e] = s;
                /* float32 summation: 12 * 2^-24 * sum|h w| (measured at most 3.8 * 2^-24 * sum|h w|); bfloat16
                 * coefficients add their rounding, 2^-9 of each (plus float32's of h * d) */
                bound[t_ * D + e] = 12 * U * a + (q8 ? a * (1.0 / 512 + 2 * U) : 0.0) + 1e-30;
            }
        for (int64_t tt = 1; tt <= T; tt += T - 1) { /* T = 1 (skips zero coefficients) and T = 3 */
            for (int threads = 1; threads <= 2; threads++) {
                if (t->axpy(w, row_bytes, N, D, idx, M, h, M, tt, y, D, q8, 0.0f, threads, ISA) != 0)
                    fail(t->name, "rows_axpy failed");
                char what[96];
                snprintf(what, sizeof what, "axpy_%s%s_T%lld_threads%d", t->name, q8 ? "_bf16coef" : "", (long long)tt,
                         threads);
                check_close(what, y, ref, bound, tt * D);
                digest(what, y, (size_t)(tt * D) * sizeof(float));
            }
        }
    }
    free(y), free(ref), free(bound);
}

static void check_quantize_q8_k(void) {
    enum { K = 512, T = 2 };
    float x[T * K];
    int8_t qs[T * K];
    float d[T * K / 256];
    int16_t bsums[T * K / 16];
    for (int i = 0; i < T * K; i++) x[i] = rng_gauss() * (i < K ? 1.0f : 1e-3f);
    for (int i = 0; i < 256; i++) x[K + 256 + i] = 0.0f; /* an all-zero super-block */
    if (pi_quantize_q8_k(x, K, T, qs, d, bsums, ISA) != 0) fail("quantize_q8_k", "failed");
    for (int b = 0; b < T * K / 256; b++) {
        for (int j = 0; j < 256; j++) {
            const int i = b * 256 + j;
            if (!(fabs((double)qs[i] * d[b] - x[i]) <= fabs(d[b]) * 0.5 * (1 + 1e-6))) {
                fail("quantize_q8_k", "an element is further than d / 2 from its value");
                b = T * K, j = 256;
            }
        }
        for (int g = 0; g < 16 && b < T * K / 256; g++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += qs[b * 256 + g * 16 + j];
            if (s != bsums[b * 16 + g]) fail("quantize_q8_k", "a block sum differs from the sum of its values");
        }
    }
    digest("quantize_q8_k", qs, sizeof qs);
    digest("quantize_q8_k_d", d, sizeof d);
}

/* ---- llama.cpp's blocks (tests/data/kquant_golden.npz, members unpacked to a folder) ---- */

/* The data of an .npy file (format 1.0-3.0, little endian) of exactly `bytes` bytes; NULL when absent. */
static uint8_t *read_npy(const char *dir, const char *name, size_t bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.npy", dir, name);
    FILE *f = fopen(path, "rb");
    if (f == NULL) return NULL;
    uint8_t head[10];
    size_t header_len = 0, prefix = 10;
    if (fread(head, 1, 10, f) != 10 || memcmp(head, "\x93NUMPY", 6) != 0) {
        fclose(f);
        fail(path, "not an .npy file");
        return NULL;
    }
    if (head[6] == 1) {
        header_len = head[8] | (size_t)head[9] << 8;
    } else {
        uint8_t more[2];
        if (fread(more, 1, 2, f) != 2) more[0] = more[1] = 0;
        header_len = head[8] | (size_t)head[9] << 8 | (size_t)more[0] << 16 | (size_t)more[1] << 24;
        prefix = 12;
    }
    uint8_t *data = xmalloc(bytes + 1);
    const int ok = fseek(f, (long)(prefix + header_len), SEEK_SET) == 0 && fread(data, 1, bytes + 1, f) == bytes;
    fclose(f);
    if (!ok) {
        free(data);
        fail(path, "not the expected size");
        return NULL;
    }
    return data;
}

static void check_quantize_golden(const char *dir) {
    enum { ROWS = 145, COLS = 256 };
    float *x = (float *)read_npy(dir, "x", (size_t)ROWS * COLS * sizeof(float));
    if (x == NULL) {
        fail("quantize golden", "x.npy is missing");
        return;
    }
    static const struct {
        const char *member;
        int ggml_type, row_bytes;
    } golden[] = {{"Q2_K", 10, 84},    {"Q3_K", 11, 110}, {"Q4_K", 12, 144},  {"Q5_K", 13, 176},
                  {"Q6_K", 14, 210},   {"IQ4_NL", 20, 144}, {"IQ4_XS", 23, 136}};
    for (size_t g = 0; g < sizeof golden / sizeof golden[0]; g++) {
        const size_t bytes = (size_t)ROWS * golden[g].row_bytes;
        uint8_t *want = read_npy(dir, golden[g].member, bytes), *got = xmalloc(bytes);
        if (want == NULL) {
            fail(golden[g].member, "golden blocks missing");
        } else {
            if (pi_quantize_rows(golden[g].ggml_type, x, ROWS, COLS, got, 2) != 0)
                fail(golden[g].member, "quantize failed");
            int rows_differ = 0;
            for (int r = 0; r < ROWS; r++)
                rows_differ += memcmp(got + (size_t)r * golden[g].row_bytes, want + (size_t)r * golden[g].row_bytes,
                                      (size_t)golden[g].row_bytes) != 0;
            printf("measured quantize %s: %d of %d rows differ from llama.cpp's blocks\n", golden[g].member,
                   rows_differ, ROWS);
            if (rows_differ) fail(golden[g].member, "pi_quantize_rows differs from llama.cpp's blocks");
        }
        free(want), free(got);
    }
    free(x);
}

int main(int argc, char **argv) {
    printf("best SIMD level of this build and CPU: %d\n", pi_kernels_isa_best());
#if !(defined(__x86_64__) || defined(_M_X64))
    if (pi_kernels_isa_best() != 0) fail("isa", "a build for a CPU other than x86-64 reports a SIMD level");
#endif
    const int64_t N = 67, K = 512; /* N * K above the kernels' one-thread threshold, so 2 threads split the rows */
    for (int i = 0; i < N_TYPES; i++) {
        const type_info *t = &TYPES[i];
        const int64_t row_bytes = K / t->block_elems * t->block_bytes;
        uint8_t *w = xmalloc((size_t)(N * row_bytes));
        float *wf = xmalloc((size_t)(N * K) * sizeof(float));
        make_weights(t, N, K, w, wf);
        check_get_rows(t, w, wf, N, K);
        check_matmul(t, w, wf, N, K);
        check_axpy(t, w, wf, N, K);
        free(w), free(wf);
    }
    check_quantize_q8_k();
    if (argc > 1) check_quantize_golden(argv[1]);
    else printf("no golden folder given: pi_quantize_rows not compared with llama.cpp's blocks\n");
    printf(failures ? "%d FAILED\n" : "all scalar kernel checks passed\n", failures);
    return failures ? 1 : 0;
}
