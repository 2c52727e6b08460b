/* The traits tables of the matmul kernels: for each SIMD level, every type's kernels at that level, indexed by type
 * id (matmul.h, type_kernels). Included once, by matmul.c, after the SIMD variants it names. A new type with dense
 * kernels is a row here (the K-quants' int8 kernels and IQ4's are matmul_q8k.c's table, matmul_q8k_types.h).
 *
 * Panels of 8 rows (tile8) where a type has them, and of 16 (tile16, AVX-512: 4 tokens per panel load) where both
 * run: the block-32 types Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 from TILE8_MIN_T_Q4_0 / TILE8_MIN_T_Q8_0 tokens, on rows
 * of any block count (a last partial group of 8 blocks in the low lanes, as the row tiles do), and Q4_0 / Q4_1 for
 * one token over short rows (a sparse head's screen: 8 blocks), where one row's few blocks leave the tile's per-row
 * work (horizontal sums, the call) dominant; panels measured 1.7x faster on the 49152 x 256 screen of SmolLM2's head
 * (0.94 -> 0.55 ms, 1 thread). The row tiles of all five share one form (tile_q4x_n, tile_q8_0_n: one exact integer
 * per block, one FMA per lane), so the panels have their bits. Measured (scripts/bench_matmul.py, 1 thread, CPU
 * time on the shared 2-core Xeon): SmolLM2 shapes at 64 tokens Q5_0 / Q8_0 22 / 27 -> 97 / 111 G multiply-adds/s,
 * 1.1B shapes Q4_0 68 -> 117-135, Q8_0 52 -> 114; Q8_0 panels (q + 128, one VNNI dot a step) now pay from 4
 * tokens (SmolLM2 shapes, 4 / 8 tokens: 22 / 26 -> 37 / 60).
 */
#ifndef POWERINFER_KERNELS_MATMUL_TYPES_H
#define POWERINFER_KERNELS_MATMUL_TYPES_H

#include "matmul.h"

#define TILE8_MIN_T_Q4_0 4
#define TILE8_MIN_T_Q8_0 4

#define FLOAT_KERNELS(isa, type) \
    {.tile = tile_##type##_##isa, .dot = dot_##type##_##isa, .tile4 = TILE4(isa, type), .tiles = TILES(isa, type)}
#define BLOCK32_KERNELS(isa, type, ...)                                                                           \
    {.tile_q8 = tile_##type##_##isa, .tile = tile_##type##_f_##isa, .dot = dot_##type##_f_##isa, __VA_ARGS__}
#define KQ_KERNELS(isa, type) {.tile = tile_##type##_f_##isa, .dot = dot_##type##_f_##isa}
#define MATMUL_TABLE(isa)                                                                                          \
    {                                                                                                              \
        .quantize_act = quantize_act_##isa,                                                                        \
        .r8 = R8(isa),                                                                                             \
        .types = {                                                                                                 \
            [PI_TYPE_F32] = FLOAT_KERNELS(isa, f32),                                                               \
            [PI_TYPE_F16] = FLOAT_KERNELS(isa, f16),                                                               \
            [PI_TYPE_BF16] = FLOAT_KERNELS(isa, bf16),                                                             \
            [PI_TYPE_Q4_0] = BLOCK32_KERNELS(isa, q4_0, .rows_q8 = ROWS_Q8(isa, q4_0), .tile8 = TILE8(isa, q4_0), .tile16 = TILE16(isa, q4_0), .tile8_min_t = TILE8_MIN_T_Q4_0, \
                                             .tile8_short_rows = 1),                                               \
            [PI_TYPE_Q4_1] = BLOCK32_KERNELS(isa, q4_1, .rows_q8 = ROWS_Q8(isa, q4_1), .tile8 = TILE8(isa, q4_1), .tile16 = TILE16(isa, q4_1), .tile8_min_t = TILE8_MIN_T_Q4_0, \
                                             .tile8_short_rows = 1),                                               \
            [PI_TYPE_Q5_0] = BLOCK32_KERNELS(isa, q5_0, .tile8 = TILE8(isa, q5_0), .tile16 = TILE16(isa, q5_0), .tile8_min_t = TILE8_MIN_T_Q4_0), \
            [PI_TYPE_Q5_1] = BLOCK32_KERNELS(isa, q5_1, .tile8 = TILE8(isa, q5_1), .tile16 = TILE16(isa, q5_1), .tile8_min_t = TILE8_MIN_T_Q4_0), \
            [PI_TYPE_Q8_0] = BLOCK32_KERNELS(isa, q8_0, .tile8 = TILE8(isa, q8_0), .tile16 = TILE16(isa, q8_0), .tile8_min_t = TILE8_MIN_T_Q8_0), \
            [PI_TYPE_Q2_K] = KQ_KERNELS(isa, q2_k),                                                                \
            [PI_TYPE_Q3_K] = KQ_KERNELS(isa, q3_k),                                                                \
            [PI_TYPE_Q4_K] = KQ_KERNELS(isa, q4_k),                                                                \
            [PI_TYPE_Q5_K] = KQ_KERNELS(isa, q5_k),                                                                \
            [PI_TYPE_Q6_K] = KQ_KERNELS(isa, q6_k),                                                                \
        },                                                                                                         \
    }
#define TILE4(isa, type) tile4_##type##_##isa
#define TILES(isa, type) tiles_##type##_##isa
#define tiles_f32_scalar NULL
#define tiles_f16_scalar NULL
#define tiles_bf16_scalar NULL
#define TILE8(isa, type) tile8_##type##_##isa
#define TILE16(isa, type) tile16_##type##_##isa
#define R8(isa) r8_q4_0_##isa
#define ROWS_Q8(isa, type) rows_##type##_##isa
#define rows_q4_0_scalar NULL
#define rows_q4_0_avx2 NULL
#define rows_q4_1_scalar NULL
#define rows_q4_1_avx2 NULL
#define r8_q4_0_scalar r8_coef4_scalar
#define tile4_f32_scalar NULL
#define tile4_f16_scalar NULL
#define tile4_bf16_scalar NULL
#define tile8_q4_0_scalar NULL
#define tile8_q4_1_scalar NULL
#define tile8_q5_0_scalar NULL
#define tile8_q5_1_scalar NULL
#define tile8_q8_0_scalar NULL
#define tile16_q4_0_scalar NULL
#define tile16_q4_1_scalar NULL
#define tile16_q5_0_scalar NULL
#define tile16_q5_1_scalar NULL
#define tile16_q8_0_scalar NULL
#define tile16_q4_0_avx2 NULL
#define tile16_q4_1_avx2 NULL
#define tile16_q5_0_avx2 NULL
#define tile16_q5_1_avx2 NULL
#define tile16_q8_0_avx2 NULL
static const matmul_table matmul_tables[] = {
    [PI_ISA_SCALAR] = MATMUL_TABLE(scalar),
#if PI_X86
    [PI_ISA_AVX2] = MATMUL_TABLE(avx2),
    [PI_ISA_AVX512] = MATMUL_TABLE(avx512),
#endif
};
#undef FLOAT_KERNELS
#undef BLOCK32_KERNELS
#undef KQ_KERNELS
#undef MATMUL_TABLE
#undef TILE4
#undef TILE8
#undef TILE16
#undef R8
#undef ROWS_Q8
#undef rows_q4_0_scalar
#undef rows_q4_0_avx2
#undef rows_q4_1_scalar
#undef rows_q4_1_avx2
#undef r8_q4_0_scalar
#undef tile4_f32_scalar
#undef tile4_f16_scalar
#undef tile4_bf16_scalar
#undef tile8_q4_0_scalar
#undef tile8_q4_1_scalar
#undef tile8_q5_0_scalar
#undef tile8_q5_1_scalar
#undef tile8_q8_0_scalar
#undef tile16_q4_0_scalar
#undef tile16_q4_1_scalar
#undef tile16_q5_0_scalar
#undef tile16_q5_1_scalar
#undef tile16_q8_0_scalar
#undef tile16_q4_0_avx2
#undef tile16_q4_1_avx2
#undef tile16_q5_0_avx2
#undef tile16_q5_1_avx2
#undef tile16_q8_0_avx2

#endif
