/* Selection of the k largest values of a vector (the sparse output head's candidates: model/head.py).
 *
 * pi_top_k maps each float to an unsigned key of the same order (NaN lowest), finds the k-th largest key by a
 * radix select over 11 + 11 + 10 bits (three histogram passes, no data-dependent branch in the first: a
 * comparison-based quickselect mispredicts about every other step and took ~0.5 ms for 49152 values), then
 * lists, in increasing index order, every index whose key is larger and the first indices holding exactly that
 * key until k are listed. The result depends only on the values: the same set and order for any thread count
 * and any other rows of a step.
 */
#include <math.h>
#include <string.h>

#include "common.h"

static inline uint32_t key_of(float v) {
    if (isnan(v)) return 0;
    if (v == 0.0f) v = 0.0f; /* -0 ties with +0, as == says */
    uint32_t b;
    memcpy(&b, &v, 4);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

static inline float value_of(uint32_t key) {
    const uint32_t b = (key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key;
    float v;
    memcpy(&v, &b, 4);
    return v;
}

/* the bucket, from the top of hist[0..n_buckets), holding the `need`-th largest key; *need becomes the rank of
 * that key within the bucket (1 = its largest) */
static uint32_t bucket_of(const uint32_t *hist, uint32_t n_buckets, int64_t *need) {
    int64_t seen = 0;
    for (uint32_t b = n_buckets; b-- > 0;) {
        if (seen + hist[b] >= *need) {
            *need -= seen;
            return b;
        }
        seen += hist[b];
    }
    return 0; /* unreachable for 0 < need <= n */
}

/* pi_top_k(s, n, k, idx, next, scratch): idx[0..k) receives the indices of the k largest of s[0..n) in increasing
 * order, *next the largest value left out (-inf when k == n); scratch holds n floats. 0 < k <= n. A NaN is
 * the smallest value (and *next is NaN when only NaNs are left out). */
PI_EXPORT int32_t pi_top_k(const float *s, int64_t n, int64_t k, int64_t *idx, float *next, float *scratch) {
    if (s == NULL || idx == NULL || next == NULL || scratch == NULL || n <= 0 || k <= 0 || k > n)
        return PI_ERR_SHAPE;
    uint32_t *keys = (uint32_t *)scratch;
    uint32_t hist[2048];
    memset(hist, 0, sizeof hist);
    for (int64_t i = 0; i < n; i++) {
        keys[i] = key_of(s[i]);
        hist[keys[i] >> 21]++;
    }
    int64_t need = k;
    const uint32_t b1 = bucket_of(hist, 2048, &need);
    memset(hist, 0, sizeof hist);
    for (int64_t i = 0; i < n; i++)
        if (keys[i] >> 21 == b1) hist[(keys[i] >> 10) & 0x7FFu]++;
    const uint32_t b2 = bucket_of(hist, 2048, &need);
    const uint32_t prefix = b1 << 11 | b2;
    memset(hist, 0, sizeof hist);
    for (int64_t i = 0; i < n; i++)
        if (keys[i] >> 10 == prefix) hist[keys[i] & 0x3FFu]++;
    const uint32_t kth = prefix << 10 | bucket_of(hist, 1024, &need);
    /* `need` keys equal to kth are taken (the first ones), the rest of them left out */
    int64_t ties = need, m = 0;
    uint32_t left = 0;
    int any_left = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t key = keys[i];
        if (key > kth || (key == kth && ties > 0)) {
            ties -= key == kth;
            idx[m++] = i;
        } else {
            left = key > left ? key : left;
            any_left = 1;
        }
    }
    if (m != k) return PI_ERR_SHAPE;
    *next = any_left ? value_of(left) : -INFINITY;
    return PI_OK;
}

/* The pass of pi_top_about_k over s[i0, i1): every index whose key is >= lo goes to idx (the first `cap` of them,
 * counted from `count`), the others' largest key to *left (*any_left set when there is one); returns the new count. */
static int64_t select_above(const float *s, int64_t i0, int64_t i1, uint32_t lo, int64_t cap, int64_t count,
                            int64_t *idx, uint32_t *left, int *any_left) {
    for (int64_t i = i0; i < i1; i++) {
        const uint32_t key = key_of(s[i]);
        if (key >= lo) {
            if (count < cap) idx[count] = i;
            count++;
        } else {
            *left = key > *left ? key : *left;
            *any_left = 1;
        }
    }
    return count;
}

#define SIMD_BODY "select_x86.h"
#include "simd_variants.h"
#if !PI_X86
static int64_t select_above_avx512(const float *s, int64_t n, uint32_t lo, int64_t cap, int64_t *idx, uint32_t *left,
                                   int *any_left) {
    return select_above(s, 0, n, lo, cap, 0, idx, left, any_left);
}
#endif

/* pi_sampled_key(s, n, k, scratch, key): *key = the key of tau, the ceil(k / 16)-th largest of every 16th value of
 * s[0..n) (pi_top_k on the sample); ceil(k / 16) <= n / 16. scratch: n floats. A set of about k large values is then
 * every index at or above it (pi_select_at_least): two passes over s where pi_top_k makes four. */
int32_t pi_sampled_key(const float *s, int64_t n, int64_t k, float *scratch, uint32_t *key) {
    const int64_t n_sample = n / 16, k_sample = (k + 15) / 16;
    if (k <= 0 || k_sample > n_sample) return PI_ERR_SHAPE;
    float *sample = scratch;
    for (int64_t i = 0; i < n_sample; i++) sample[i] = s[16 * i];
    int64_t *sample_idx = (int64_t *)(scratch + n_sample + (n_sample & 1)); /* 8-byte aligned, within n floats */
    float *rest = scratch + n_sample + (n_sample & 1) + 2 * k_sample;
    float below;
    const int32_t status = pi_top_k(sample, n_sample, k_sample, sample_idx, &below, rest);
    if (status != PI_OK) return status;
    uint32_t lo = key_of(sample[sample_idx[0]]); /* tau's key: the smallest of the sample's largest */
    for (int64_t j = 1; j < k_sample; j++) {
        const uint32_t kj = key_of(sample[sample_idx[j]]);
        lo = kj < lo ? kj : lo;
    }
    *key = lo;
    return PI_OK;
}

/* pi_select_at_least(s, n, lo, cap, idx, next, isa): every index of s[0..n) whose key is >= lo, in increasing order
 * (the first `cap` of them to idx), and *next the largest value below (-inf when none); returns how many there are.
 * isa (enum pi_isa): at PI_ISA_AVX512 the pass runs 16 keys at a time (select_above_avx512), with the same result. */
int64_t pi_select_at_least(const float *s, int64_t n, uint32_t lo, int64_t cap, int64_t *idx, float *next,
                           int32_t isa) {
    uint32_t left = 0;
    int any_left = 0;
    const int64_t count = pi_isa_clamp(isa) >= PI_ISA_AVX512
                              ? select_above_avx512(s, n, lo, cap, idx, &left, &any_left)
                              : select_above(s, 0, n, lo, cap, 0, idx, &left, &any_left);
    *next = any_left ? value_of(left) : -INFINITY;
    return count;
}

/* pi_top_about_k(s, n, k, idx, m, next, scratch): about k of the largest values of s[0..n), for a caller that needs
 * a set of large values and the largest value left out, not exactly k of them: every index at or above the sampled
 * threshold tau (pi_sampled_key), in increasing order (*m of them, 0 < *m <= n), *next the largest value below tau
 * (-inf when none). Where the set would be over 4k, or n < 32k, it is pi_top_k's exact k instead. ~3x faster than
 * pi_top_k on 49152 values. idx holds up to max(4k, k) entries; scratch n floats. NaN is the smallest value. isa
 * (enum pi_isa): the SIMD level of the pass, with the same result. */
PI_EXPORT int32_t pi_top_about_k(const float *s, int64_t n, int64_t k, int64_t *idx, int64_t *m, float *next,
                                 float *scratch, int32_t isa) {
    if (s == NULL || idx == NULL || m == NULL || next == NULL || scratch == NULL || n <= 0 || k <= 0 || k > n)
        return PI_ERR_SHAPE;
    if (n >= 32 * k) {
        uint32_t lo;
        const int32_t status = pi_sampled_key(s, n, k, scratch, &lo);
        if (status != PI_OK) return status;
        const int64_t count = pi_select_at_least(s, n, lo, 4 * k, idx, next, isa);
        if (count <= 4 * k) {
            *m = count;
            return PI_OK;
        }
    }
    *m = k;
    return pi_top_k(s, n, k, idx, next, scratch);
}
