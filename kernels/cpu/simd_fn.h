/* The names of a SIMD body compiled once per variant (attention_body.h, head_body.h): FN(name) is name_<suffix>,
 * TARGET / TARGET_INLINE the variant's target attribute (none for the scalar build, SIMD_TARGET unset). Included at
 * the top of the body; simd_fn_end.h at its end takes the names back for the next variant. */

#define SIMD_CAT_(a, b) a##_##b
#define SIMD_CAT(a, b) SIMD_CAT_(a, b)
#define FN(name) SIMD_CAT(name, SIMD_SUFFIX)
#ifdef SIMD_TARGET
#define TARGET __attribute__((target(SIMD_TARGET)))
#define TARGET_INLINE static inline __attribute__((target(SIMD_TARGET), always_inline))
#else
#define TARGET
#define TARGET_INLINE static inline __attribute__((always_inline))
#endif
