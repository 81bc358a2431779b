/* onnxkv/_kernels/simd_convert.h -- float16 / bfloat16 <-> float32 conversions:
 * bit-exact scalar ones and (OKV_X86_SIMD) F16C / AVX2 rows.
 */
#ifndef ONNXKV_SIMD_CONVERT_H
#define ONNXKV_SIMD_CONVERT_H

#include "simd_cpu.h"

/* ------------------------------------------------------------------ */
/* IEEE half <-> float conversion (scalar: bit tricks after M. Dukhan's  */
/* FP16 library, round to nearest even; AVX2 path: F16C)                */
/* ------------------------------------------------------------------ */
static inline uint32_t okv_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float okv_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float okv_h2f_scalar(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = okv_bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = okv_bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    return okv_bits_f32(sign | (two_w < (1u << 27) ? okv_f32_bits(denormalized) : okv_f32_bits(normalized)));
}

static inline uint16_t okv_f2h_scalar(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = okv_f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u, bits, nonsign;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = okv_bits_f32((bias >> 1) + 0x07800000u) + base;
    bits = okv_f32_bits(base);
    nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline void okv_h2f_row_scalar(const uint16_t *x, float *out, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) out[i] = okv_h2f_scalar(x[i]);
}

static inline void okv_f2h_row_scalar(const float *x, uint16_t *out, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) out[i] = okv_f2h_scalar(x[i]);
}

/* bfloat16 <-> float: widening is exact (bits << 16); narrowing rounds to
 * nearest even, NaN stays NaN (quiet bit set), overflow gives +-inf. */
static inline float okv_bf2f_scalar(uint16_t h) { return okv_bits_f32((uint32_t)h << 16); }

static inline uint16_t okv_f2bf_scalar(float f) {
    const uint32_t u = okv_f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline void okv_bf2f_row_scalar(const uint16_t *x, float *out, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) out[i] = okv_bf2f_scalar(x[i]);
}

static inline void okv_f2bf_row_scalar(const float *x, uint16_t *out, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) out[i] = okv_f2bf_scalar(x[i]);
}

#if OKV_X86_SIMD
/* 8 bfloat16 -> 8 float (zero-extend, shift left 16). */
OKV_AVX2 static inline __m256 okv_bf16x8_to_ps(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

OKV_AVX2 static inline void okv_bf2f_row_avx2(const uint16_t *x, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, okv_bf16x8_to_ps(x + i));
    for (; i < n; i++) out[i] = okv_bf2f_scalar(x[i]);
}

OKV_AVX2 static inline void okv_f2bf_row_avx2(const float *x, uint16_t *out, int64_t n) {
    const __m256i one = _mm256_set1_epi32(1), rnd = _mm256_set1_epi32(0x7FFF);
    const __m256i absm = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    const __m256i qnan = _mm256_set1_epi32(0x0040);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i u0 = _mm256_castps_si256(_mm256_loadu_ps(x + i));
        __m256i u1 = _mm256_castps_si256(_mm256_loadu_ps(x + i + 8));
        __m256i r0 = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u0, rnd),
                                                        _mm256_and_si256(_mm256_srli_epi32(u0, 16), one)), 16);
        __m256i r1 = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u1, rnd),
                                                        _mm256_and_si256(_mm256_srli_epi32(u1, 16), one)), 16);
        __m256i n0 = _mm256_cmpgt_epi32(_mm256_and_si256(u0, absm), inf);
        __m256i n1 = _mm256_cmpgt_epi32(_mm256_and_si256(u1, absm), inf);
        r0 = _mm256_blendv_epi8(r0, _mm256_or_si256(_mm256_srli_epi32(u0, 16), qnan), n0);
        r1 = _mm256_blendv_epi8(r1, _mm256_or_si256(_mm256_srli_epi32(u1, 16), qnan), n1);
        /* packus works per 128-bit lane: fix the order with a 64-bit permute */
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8));
    }
    for (; i < n; i++) out[i] = okv_f2bf_scalar(x[i]);
}

OKV_AVX2 static inline void okv_h2f_row_avx2(const uint16_t *x, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    for (; i < n; i++) out[i] = okv_h2f_scalar(x[i]);
}

OKV_AVX2 static inline void okv_f2h_row_avx2(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) out[i] = okv_f2h_scalar(x[i]);
}
#endif

#endif /* ONNXKV_SIMD_CONVERT_H */
