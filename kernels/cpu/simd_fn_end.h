/* The end of a SIMD body that began with simd_fn.h */
#undef TARGET
#undef TARGET_INLINE
#undef FN
#undef SIMD_CAT
#undef SIMD_CAT_
