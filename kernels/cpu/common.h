/* Shared definitions of the CPU kernels: fp16 decoding, error codes, scratch and thread helpers. The weight types
 * (enum pi_type) and their block layouts are in quants.h and kquants.h.
 *
 * Kernel ABI: every exported function takes sized integers, explicit row counts and strides, the thread count and
 * the SIMD level `isa` (enum pi_isa; clamped to what the CPU has), and returns 0 or one of the PI_ERR_* codes below.
 * No function keeps state between calls, and the library has no mutable globals. The decode kernels (pi_ffn_rows,
 * pi_predict_ffn, pi_attn_decode) work in a caller-owned scratch buffer sized by their pi_<op>_scratch_bytes.
 */
#ifndef POWERINFER_KERNELS_COMMON_H
#define POWERINFER_KERNELS_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PI_EXPORT __attribute__((visibility("default")))

#define QK 32 /* elements per quant block */

enum pi_status {
    PI_OK = 0,
    PI_ERR_SHAPE = 1, /* K is not a multiple of the block size, or a negative count */
    PI_ERR_ALLOC = 2, /* scratch allocation failed */
    PI_ERR_INDEX = 3, /* a row id is outside [0, N) */
    PI_ERR_SCRATCH = 4, /* the caller's scratch buffer is smaller than pi_<op>_scratch_bytes asks */
};

/* SIMD levels, the `isa` argument of every kernel */
enum pi_isa { PI_ISA_SCALAR = 0, PI_ISA_AVX2 = 1, PI_ISA_AVX512 = 2 };

/* PI_X86: 1 when compiling for x86-64, where the AVX2 and AVX-512 variants are built (simd_variants.h) and the CPU
 * is probed for them. Elsewhere (aarch64, ...) only the scalar variant exists, nothing includes <immintrin.h>, and
 * every level clamps to PI_ISA_SCALAR. Code that names an x86 intrinsic or an _avx2/_avx512 function sits behind
 * `#if PI_X86`. -DPI_SCALAR_ONLY makes an x86-64 build the same as the others (tests/test_portability.py). */
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(PI_SCALAR_ONLY)
#define PI_X86 1
#else
#define PI_X86 0
#endif

/* The best level this CPU runs (AVX2 = AVX2 + FMA + F16C; AVX512 = F, BW, VL, DQ and VNNI), and `isa` clamped to
 * [PI_ISA_SCALAR, best]. Read from the CPU on every call: no state. */
int32_t pi_isa_clamp(int32_t isa);

/* The best SIMD level of this CPU (enum pi_isa), exported for the bindings (matmul.c). */
int32_t pi_kernels_isa_best(void);

#define PI_MAX_THREADS 1024 /* thread counts above this are clamped */
#define PI_SCRATCH_ALIGN 64 /* the kernels align the caller's scratch start up to this; sizes include the slack */

static inline size_t align_up(size_t n) { return (n + PI_SCRATCH_ALIGN - 1) & ~(size_t)(PI_SCRATCH_ALIGN - 1); }

/* *out = the 64-byte aligned start of a caller's scratch buffer of scratch_bytes; PI_ERR_SCRATCH when fewer than
 * `need` bytes follow that start (a NULL buffer holds none). */
static inline int32_t scratch_take(void *scratch, int64_t scratch_bytes, size_t need, uint8_t **out) {
    *out = NULL;
    if (need == 0) return PI_OK;
    if (scratch == NULL || scratch_bytes < 0) return PI_ERR_SCRATCH;
    const uintptr_t start = (uintptr_t)scratch;
    const uintptr_t aligned = (start + PI_SCRATCH_ALIGN - 1) & ~(uintptr_t)(PI_SCRATCH_ALIGN - 1);
    if ((uint64_t)scratch_bytes < (uint64_t)(aligned - start) + need) return PI_ERR_SCRATCH;
    *out = (uint8_t *)aligned;
    return PI_OK;
}

/* Exact IEEE half -> float conversion (subnormals, inf and nan included). */
static inline float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1Fu;
    const uint32_t mantissa = h & 0x3FFu;
    uint32_t bits;
    if (exponent == 0) {
        /* zero or subnormal: mantissa * 2^-24, exact in float */
        const float value = (float)mantissa * 5.9604644775390625e-8f;
        memcpy(&bits, &value, sizeof bits);
        bits |= sign;
    } else if (exponent == 31) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* bfloat16 -> float: the top half of the float's bits (exact). */
static inline float bf16_to_fp32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* |f| without <math.h> */
static inline float mag_f(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits &= 0x7FFFFFFFu;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float -> IEEE half, round to nearest even; |f| >= 65520 -> inf, nan -> 0x7E00 (sign kept) */
static inline uint16_t fp32_to_fp16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    const uint32_t mag = bits & 0x7FFFFFFFu;
    if (mag > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);
    if (mag >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);
    if (mag < 0x38800000u) {
        /* below 2^-14, a subnormal half: |f| + 0.5 lands in [0.5, 1), whose ulp is 2^-24, the half's subnormal
         * step, so the add rounds |f| to a multiple of it (ties to even); 1024 steps is the smallest normal */
        const float sum = (mag_f(f)) + 0.5f;
        uint32_t sum_bits;
        memcpy(&sum_bits, &sum, sizeof sum_bits);
        return (uint16_t)(sign | (sum_bits - 0x3F000000u));
    }
    /* normal: drop 13 mantissa bits rounding to even (a carry into the exponent is the right result), rebias */
    const uint32_t rounded = mag + 0x0FFFu + ((mag >> 13) & 1u);
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

/* float -> bfloat16, round to nearest even (ggml's GGML_FP32_TO_BF16); nan -> a quiet nan, sign kept */
static inline uint16_t fp32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 64u);
    return (uint16_t)((bits + (0x7FFFu + ((bits >> 16) & 1u))) >> 16);
}

static inline int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max_i64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Argument check of a strided operand of n_rows rows of row_len units (bytes of a weight row, floats of an
 * activation row): rows must not overlap, so every row the kernel reads lies inside the n_rows * stride the
 * caller owns. One row needs no stride. */
static inline int stride_ok(int64_t n_rows, int64_t stride, int64_t row_len) { return n_rows <= 1 || stride >= row_len; }

/* Threads actually used: small problems run on one thread (the fork/join costs more than it saves).
 * The split never changes results: each output element is computed by exactly one thread. */
static inline int32_t threads_for_work(int32_t n_threads, int64_t work) {
    if (n_threads < 1 || work < (1 << 15)) return 1;
    return n_threads < PI_MAX_THREADS ? n_threads : PI_MAX_THREADS;
}

#endif
