/* Compiles the SIMD body named by SIMD_BODY (a header written against SIMD_SUFFIX / SIMD_TARGET / SIMD_AVX512)
 * twice: the AVX2 variant (suffix avx2) and the AVX-512 one (suffix avx512). One place for the target strings, so
 * every kernel file builds the same two variants. Usage: #define SIMD_BODY "matmul_x86.h", then include this (after
 * common.h). On a CPU other than x86-64 (PI_X86 0) it compiles nothing: the includer's tables list the scalar variant
 * only, and pi_isa_clamp maps every level to it. */

#if PI_X86
#include <immintrin.h>

#define SIMD_SUFFIX avx2
#define SIMD_TARGET "avx2,fma,f16c"
#define SIMD_AVX512 0
#include SIMD_BODY
#undef SIMD_SUFFIX
#undef SIMD_TARGET
#undef SIMD_AVX512

#define SIMD_SUFFIX avx512
#define SIMD_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"
#define SIMD_AVX512 1
#include SIMD_BODY
#undef SIMD_SUFFIX
#undef SIMD_TARGET
#undef SIMD_AVX512
#endif

#undef SIMD_BODY
