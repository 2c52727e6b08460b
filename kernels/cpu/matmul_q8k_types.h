/* The traits tables of matmul_q8k.c's kernels: for each SIMD level, the activation quantiser and every type's
 * kernels at that level, indexed by type id (kq8_table). Included once, by matmul_q8k.c, after the SIMD variants it
 * names. A new super-block type with "q8" kernels is a row here (and in PI_KQ8_TYPES, quants.h).
 *
 * Panels of 8 rows (tile8) for Q4_K from KQ8_TILE8_MIN_T_Q4_K tokens (AVX2 and AVX-512), of 16 rows (tile16) on
 * AVX-512 (docs/kernels.md: measured +35-42% at 64 tokens on the 1.1B shapes, 1 thread).
 */
#ifndef POWERINFER_KERNELS_MATMUL_Q8K_TYPES_H
#define POWERINFER_KERNELS_MATMUL_Q8K_TYPES_H

#define KQ8_TILE8_MIN_T_Q4_K 4 /* tokens from which Q4_K rows go by panels */

#define KQ8_KERNELS(isa, type) .tile = kq8_tile_##type##_##isa, .dot = kq8_dot_##type##_##isa
/* q4_k_panels: the Q4_K entry's panel kernels at this level (none for the scalar variant) */
#define KQ8_TABLE(isa, ...)                                                                                        \
    {                                                                                                              \
        .quantize = quantize_q8k_##isa,                                                                            \
        .types = {                                                                                                 \
            [PI_TYPE_Q2_K] = {KQ8_KERNELS(isa, q2_k)},                                                             \
            [PI_TYPE_Q3_K] = {KQ8_KERNELS(isa, q3_k)},                                                             \
            [PI_TYPE_Q4_K] = {KQ8_KERNELS(isa, q4_k), __VA_ARGS__},                                                \
            [PI_TYPE_Q5_K] = {KQ8_KERNELS(isa, q5_k)},                                                             \
            [PI_TYPE_Q6_K] = {KQ8_KERNELS(isa, q6_k)},                                                             \
            [PI_TYPE_IQ4_NL] = {.tile_q8 = tile_iq4_nl_##isa, .tile_f = tile_iq4_nl_f_##isa},                      \
            [PI_TYPE_IQ4_XS] = {KQ8_KERNELS(isa, iq4_xs), .tile_f = tile_iq4_xs_f_##isa},                          \
        },                                                                                                         \
    }
static const kq8_table kq8_tables[] = {
    [PI_ISA_SCALAR] = KQ8_TABLE(scalar, .tile8 = NULL),
#if PI_X86
    [PI_ISA_AVX2] = KQ8_TABLE(avx2, .tile8 = kq8_tile8_q4_k_avx2, .panel8_bytes = KQ8_PANEL_Q4_K,
                              .tile8_min_t = KQ8_TILE8_MIN_T_Q4_K),
    [PI_ISA_AVX512] = KQ8_TABLE(avx512, .tile8 = kq8_tile8_q4_k_avx512, .tile16 = kq8_tile16_q4_k_avx512,
                                .panel8_bytes = KQ8_PANEL_Q4_K, .panel16_bytes = KQ8_PANEL16_Q4_K,
                                .tile8_min_t = KQ8_TILE8_MIN_T_Q4_K),
#endif
};
#undef KQ8_KERNELS
#undef KQ8_TABLE

#endif
