/* onnxkv/_kernels/simd.h -- vector primitives for the onnxkv kernels.
 *
 * Every primitive has a portable scalar version (`*_scalar`) and, on x86 with
 * GCC/Clang, an AVX2+FMA+F16C version (`*_avx2`) written with intrinsics inside
 * functions marked __attribute__((target("avx2,fma,f16c"))).  Nothing here is
 * compiled with global -mavx2/-march flags: the AVX2 code is only *executed*
 * when okv_cpu_simd_ok() says the CPU (and OS) support it, and the caller
 * passes the decision as the `simd` flag of the dispatching wrappers.
 *
 * Scalar and AVX2 paths agree to float32 rounding (they sum in a different
 * order).  float64 kernels use the scalar path only (the compiler may still
 * auto-vectorise with the baseline ISA).  Define OKV_NO_SIMD to compile the
 * scalar path only (also automatic on non-x86 targets and non-GNU compilers).
 */
#ifndef ONNXKV_SIMD_H
#define ONNXKV_SIMD_H

/* The umbrella every kernel includes: */
#include "simd_cpu.h"      /* OpenMP, instruction-set macros, okv_settings, CPU checks */
#include "simd_scalar.h"   /* scalar primitives */
#include "simd_avx2.h"     /* AVX2+FMA+F16C primitives */
#include "simd_convert.h"  /* float16 / bfloat16 conversions */

/* ------------------------------------------------------------------ */
/* Dispatching row kernels (simd = 1 selects the AVX2 path)             */
/* ------------------------------------------------------------------ */
#if OKV_X86_SIMD
#define OKV_DISPATCH(simd, call_avx2, call_scalar) do { if (simd) { call_avx2; } else { call_scalar; } } while (0)
#else
#define OKV_DISPATCH(simd, call_avx2, call_scalar) do { (void)(simd); call_scalar; } while (0)
#endif

static void okv_rms_row_f32(const float *x, const float *g, float eps, float *out, int64_t n, int simd) {
    OKV_DISPATCH(simd, okv_rms_row_f32_avx2(x, g, eps, out, n), okv_rms_row_f32_scalar(x, g, eps, out, n));
}

static void okv_rms_row_f64(const double *x, const double *g, double eps, double *out, int64_t n) {
    double ms = okv_sumsq_f64(x, n) / (double)n;
    okv_scale_mul_f64(x, 1.0 / sqrt(ms + eps), g, out, n);
}

/* s = x + skip (+ bias) -> sum_out (optional); out = rms_norm(s) * g.  Row-wise,
 * safe when out == x or out == skip; sum_out must not overlap out. */
static void okv_skip_rms_row_f32(const float *x, const float *skip, const float *bias, const float *g, float eps,
                                 float *out, float *sum_out, int64_t n, int simd) {
    OKV_DISPATCH(simd, okv_add3_f32_avx2(x, skip, bias, out, n), okv_add3_f32_scalar(x, skip, bias, out, n));
    if (sum_out) memcpy(sum_out, out, (size_t)n * sizeof(float));
    okv_rms_row_f32(out, g, eps, out, n, simd);
}

static void okv_skip_rms_row_f64(const double *x, const double *skip, const double *bias, const double *g, double eps,
                                 double *out, double *sum_out, int64_t n) {
    okv_add3_f64(x, skip, bias, out, n);
    if (sum_out) memcpy(sum_out, out, (size_t)n * sizeof(double));
    okv_rms_row_f64(out, g, eps, out, n);
}

static void okv_softmax_row_f32(const float *x, float *out, int64_t n, float dead, int simd) {
    OKV_DISPATCH(simd, okv_softmax_row_f32_avx2(x, out, n, dead), okv_softmax_row_f32_scalar(x, out, n, dead));
}

static void okv_act_f32(int mode, const float *x, const float *up, float *out, int64_t n, int simd) {
    OKV_DISPATCH(simd, okv_act_f32_avx2(mode, x, up, out, n), okv_act_f32_scalar(mode, x, up, out, n));
}

/* One head row of rotary embedding: rotates the first 2*half dims, copies the
 * rest (head_size - 2*half) when out != x. */
static void okv_rope_row_f32(const float *x, const float *c, const float *s, float *out, int64_t half,
                             int64_t head_size, int interleaved, int simd) {
    if (interleaved)
        OKV_DISPATCH(simd, okv_rope_inter_f32_avx2(x, c, s, out, half), okv_rope_inter_f32_scalar(x, c, s, out, half));
    else
        OKV_DISPATCH(simd, okv_rope_half_f32_avx2(x, c, s, out, half), okv_rope_half_f32_scalar(x, c, s, out, half));
    if (out != x && head_size > 2 * half)
        memcpy(out + 2 * half, x + 2 * half, (size_t)(head_size - 2 * half) * sizeof(float));
}

static void okv_h2f_row(const uint16_t *x, float *out, int64_t n, int simd) {
    OKV_DISPATCH(simd, okv_h2f_row_avx2(x, out, n), okv_h2f_row_scalar(x, out, n));
}

static void okv_f2h_row(const float *x, uint16_t *out, int64_t n, int simd) {
    OKV_DISPATCH(simd, okv_f2h_row_avx2(x, out, n), okv_f2h_row_scalar(x, out, n));
}

/* Sum of n floats with independent accumulators: a memory read-bandwidth probe
 * (benchmarks compare the attention kernels' K/V read rate against it). */
static inline double okv_read_sum_f32_scalar(const float *x, int64_t n) {
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t i = 0;
    int u;
    for (; i + 8 <= n; i += 8)
        for (u = 0; u < 8; u++) s[u] += x[i + u];
    for (; i < n; i++) s[0] += x[i];
    return ((double)s[0] + s[1] + s[2] + s[3]) + ((double)s[4] + s[5] + s[6] + s[7]);
}

#if OKV_X86_SIMD
OKV_AVX2 static inline double okv_read_sum_f32_avx2(const float *x, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_add_ps(s0, _mm256_loadu_ps(x + i));
        s1 = _mm256_add_ps(s1, _mm256_loadu_ps(x + i + 8));
        s2 = _mm256_add_ps(s2, _mm256_loadu_ps(x + i + 16));
        s3 = _mm256_add_ps(s3, _mm256_loadu_ps(x + i + 24));
    }
    return (double)okv_hsum256(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)))
           + okv_read_sum_f32_scalar(x + i, n - i);
}
#endif

static double okv_read_sum_f32(const float *x, int64_t n, int simd) {
#if OKV_X86_SIMD
    if (simd) return okv_read_sum_f32_avx2(x, n);
#endif
    (void)simd;
    return okv_read_sum_f32_scalar(x, n);
}

static void okv_bf2f_row(const uint16_t *x, float *out, int64_t n, int simd) {
    OKV_DISPATCH(simd, okv_bf2f_row_avx2(x, out, n), okv_bf2f_row_scalar(x, out, n));
}

static void okv_f2bf_row(const float *x, uint16_t *out, int64_t n, int simd) {
    OKV_DISPATCH(simd, okv_f2bf_row_avx2(x, out, n), okv_f2bf_row_scalar(x, out, n));
}

#endif /* ONNXKV_SIMD_H */
