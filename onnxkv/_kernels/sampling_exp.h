/* onnxkv/_kernels/sampling_exp.h -- exp(x[i] - m) in float64 for the sampler (sampling.pyx), the same
 * bits on every instruction set.
 *
 * okv_exp_sub_f64(x, n, m, level) replaces x[i] by exp(x[i] - m), or by 0 where x[i] is -inf and m is
 * not (an entry top-k dropped).  exp(y) for y = x[i] - m:
 *   k = nearest integer to y / ln 2, r = y - k ln 2 (ln 2 in two parts, each step one fused
 *   multiply-add: |r| <= ln 2 / 2 exactly computed to about 1e-20);
 *   e^r by its Taylor polynomial of degree 13 in Horner form (fused multiply-adds; truncation below
 *   5e-18 relative), times 2^k built in the exponent bits (k = 1024, y near the top: 2 e^r times
 *   2^1023, the doubling exact).
 * The result is within 2 ulp of the correctly rounded exp on [-708.39, 709.78]; below -708.39 it is 0
 * (a probability under 2^-1022 of the largest: no sum or draw can see it), above it +inf, NaN stays NaN.
 * Every path runs the same operations in the same order with fused multiply-adds (libm's fma() on the
 * scalar path, correctly rounded in hardware or software alike), so scalar, AVX2 and AVX-512 give
 * identical bits: a draw never depends on the level.  level: 0 scalar, 1 AVX2, 2 AVX-512 (the caller
 * checked the CPU).
 */
#ifndef ONNXKV_SAMPLING_EXP_H
#define ONNXKV_SAMPLING_EXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define OKV_EXP_LOG2E 1.4426950408889634
#define OKV_EXP_LN2_HI 6.93147180369123816490e-01   /* ln 2 to 32 bits (fdlibm): k * LN2_HI exact */
#define OKV_EXP_LN2_LO 1.90821492927058770002e-10   /* ln 2 - LN2_HI */
#define OKV_EXP_MIN (-708.39)                 /* below: 0 (2^k would be subnormal) */
#define OKV_EXP_MAX 709.78                    /* above: +inf */

/* 1/j! for j = 13 .. 0, the Horner order. */
static const double okv_exp_taylor[14] = {
    1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
    1.0 / 40320.0,      1.0 / 5040.0,      1.0 / 720.0,      1.0 / 120.0,     1.0 / 24.0,
    1.0 / 6.0,          0.5,               1.0,              1.0};

static inline double okv_exp_f64_scalar(double y) {
    double k, r, p;
    int64_t bits;
    int j;
    if (y != y) return y;
    if (y < OKV_EXP_MIN) return 0.0;
    if (y > OKV_EXP_MAX) return INFINITY;
    k = nearbyint(y * OKV_EXP_LOG2E);
    r = fma(k, -OKV_EXP_LN2_HI, y);
    r = fma(k, -OKV_EXP_LN2_LO, r);
    p = okv_exp_taylor[0];
    for (j = 1; j < 14; j++) p = fma(p, r, okv_exp_taylor[j]);
    if (k > 1023) {
        p *= 2.0;
        k = 1023;
    }
    bits = ((int64_t)k + 1023) << 52;
    memcpy(&k, &bits, sizeof k);
    return p * k;
}

#if OKV_X86_SIMD
OKV_AVX2 static inline __m256d okv_exp_f64_avx2(__m256d y) {
    const __m256d lo = _mm256_set1_pd(OKV_EXP_MIN), hi = _mm256_set1_pd(OKV_EXP_MAX);
    const __m256d under = _mm256_cmp_pd(y, lo, _CMP_LT_OQ), over = _mm256_cmp_pd(y, hi, _CMP_GT_OQ);
    const __m256d nan = _mm256_cmp_pd(y, y, _CMP_UNORD_Q);
    const __m256d yc = _mm256_blendv_pd(y, _mm256_setzero_pd(), _mm256_or_pd(_mm256_or_pd(under, over), nan));
    const __m256d k = _mm256_round_pd(_mm256_mul_pd(yc, _mm256_set1_pd(OKV_EXP_LOG2E)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256d r = _mm256_fmadd_pd(k, _mm256_set1_pd(-OKV_EXP_LN2_HI), yc), p, s, res, top;
    __m128i k32;
    __m256i e;
    int j;
    r = _mm256_fmadd_pd(k, _mm256_set1_pd(-OKV_EXP_LN2_LO), r);
    p = _mm256_set1_pd(okv_exp_taylor[0]);
    for (j = 1; j < 14; j++) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(okv_exp_taylor[j]));
    top = _mm256_cmp_pd(k, _mm256_set1_pd(1023.5), _CMP_GT_OQ);
    p = _mm256_blendv_pd(p, _mm256_add_pd(p, p), top);
    k32 = _mm256_cvtpd_epi32(_mm256_min_pd(k, _mm256_set1_pd(1023.0)));   /* an exact integer in [-1022, 1023] */
    e = _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(k32), _mm256_set1_epi64x(1023)), 52);
    s = _mm256_castsi256_pd(e);
    res = _mm256_mul_pd(p, s);
    res = _mm256_blendv_pd(res, _mm256_setzero_pd(), under);
    res = _mm256_blendv_pd(res, _mm256_set1_pd(INFINITY), over);
    return _mm256_blendv_pd(res, y, nan);
}

OKV_AVX512BW static inline __m512d okv_exp_f64_avx512(__m512d y) {
    const __mmask8 under = _mm512_cmp_pd_mask(y, _mm512_set1_pd(OKV_EXP_MIN), _CMP_LT_OQ);
    const __mmask8 over = _mm512_cmp_pd_mask(y, _mm512_set1_pd(OKV_EXP_MAX), _CMP_GT_OQ);
    const __mmask8 nan = _mm512_cmp_pd_mask(y, y, _CMP_UNORD_Q);
    const __m512d yc = _mm512_mask_blend_pd(under | over | nan, y, _mm512_setzero_pd());
    const __m512d k = _mm512_roundscale_pd(_mm512_mul_pd(yc, _mm512_set1_pd(OKV_EXP_LOG2E)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fmadd_pd(k, _mm512_set1_pd(-OKV_EXP_LN2_HI), yc), p, res;
    __m512i e;
    int j;
    r = _mm512_fmadd_pd(k, _mm512_set1_pd(-OKV_EXP_LN2_LO), r);
    p = _mm512_set1_pd(okv_exp_taylor[0]);
    for (j = 1; j < 14; j++) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(okv_exp_taylor[j]));
    p = _mm512_mask_add_pd(p, _mm512_cmp_pd_mask(k, _mm512_set1_pd(1023.5), _CMP_GT_OQ), p, p);
    e = _mm512_slli_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(
                                               _mm512_min_pd(k, _mm512_set1_pd(1023.0)))),
                                           _mm512_set1_epi64(1023)),
                          52);
    res = _mm512_mul_pd(p, _mm512_castsi512_pd(e));
    res = _mm512_mask_blend_pd(under, res, _mm512_setzero_pd());
    res = _mm512_mask_blend_pd(over, res, _mm512_set1_pd(INFINITY));
    return _mm512_mask_blend_pd(nan, res, y);
}

OKV_AVX2 static void okv_exp_sub_f64_avx2(double *x, int64_t n, double m) {
    const __m256d vm = _mm256_set1_pd(m), ninf = _mm256_set1_pd(-INFINITY);
    const int drop = m > -INFINITY;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const __m256d v = _mm256_loadu_pd(x + i);
        __m256d e = okv_exp_f64_avx2(_mm256_sub_pd(v, vm));
        if (drop) e = _mm256_blendv_pd(e, _mm256_setzero_pd(), _mm256_cmp_pd(v, ninf, _CMP_EQ_OQ));
        _mm256_storeu_pd(x + i, e);
    }
    for (; i < n; i++) x[i] = x[i] == -INFINITY && drop ? 0.0 : okv_exp_f64_scalar(x[i] - m);
}

OKV_AVX512BW static void okv_exp_sub_f64_avx512(double *x, int64_t n, double m) {
    const __m512d vm = _mm512_set1_pd(m), ninf = _mm512_set1_pd(-INFINITY);
    const int drop = m > -INFINITY;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m512d v = _mm512_loadu_pd(x + i);
        __m512d e = okv_exp_f64_avx512(_mm512_sub_pd(v, vm));
        if (drop) e = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(v, ninf, _CMP_EQ_OQ), e, _mm512_setzero_pd());
        _mm512_storeu_pd(x + i, e);
    }
    for (; i < n; i++) x[i] = x[i] == -INFINITY && drop ? 0.0 : okv_exp_f64_scalar(x[i] - m);
}
#endif

static void okv_exp_sub_f64(double *x, int64_t n, double m, int level) {
    const int drop = m > -INFINITY;
    int64_t i;
#if OKV_X86_SIMD
    if (level >= 2) { okv_exp_sub_f64_avx512(x, n, m); return; }
    if (level == 1) { okv_exp_sub_f64_avx2(x, n, m); return; }
#else
    (void)level;
#endif
    for (i = 0; i < n; i++) x[i] = x[i] == -INFINITY && drop ? 0.0 : okv_exp_f64_scalar(x[i] - m);
}

#endif /* ONNXKV_SAMPLING_EXP_H */
