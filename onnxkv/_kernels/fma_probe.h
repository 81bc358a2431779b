/* onnxkv/_kernels/fma_probe.h -- the float32 FMA throughput probe of the benchmarks
 * (matmul.pyx: fma_peak_gflops), at the instruction sets of matmul_packed (OKV_MMP_*).
 */
#ifndef ONNXKV_FMA_PROBE_H
#define ONNXKV_FMA_PROBE_H

#include "matmul_packed.h"

/* n steps of OKV_FMA_CHAINS independent float32 FMA chains of the widest
 * vectors of isa (OKV_MMP_*): 2 * OKV_FMA_CHAINS * lanes * n FLOP, enough
 * chains to cover the FMA latency of every current core, so the time is the
 * FMA units' throughput (benchmarks measure the products and the attention
 * against it).  Returns a value of the chains for the caller to consume. */
#define OKV_FMA_CHAINS 12
static float okv_fma_probe_scalar(int64_t n) {
    float a[OKV_FMA_CHAINS];
    int64_t k;
    int i;
    for (i = 0; i < OKV_FMA_CHAINS; i++) a[i] = (float)i;
    for (k = 0; k < n; k++)
        for (i = 0; i < OKV_FMA_CHAINS; i++) a[i] = a[i] * 0.999999f + 1e-7f;
    for (i = 1; i < OKV_FMA_CHAINS; i++) a[0] += a[i];
    return a[0];
}
#if OKV_X86_SIMD
OKV_AVX2 static float okv_fma_probe_avx2(int64_t n) {
    const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
    __m256 a[OKV_FMA_CHAINS];
    float o[8];
    int64_t k;
    int i;
    for (i = 0; i < OKV_FMA_CHAINS; i++) a[i] = _mm256_set1_ps((float)i);
    for (k = 0; k < n; k++)
#pragma GCC unroll 12
        for (i = 0; i < OKV_FMA_CHAINS; i++) a[i] = _mm256_fmadd_ps(a[i], x, y);
    for (i = 1; i < OKV_FMA_CHAINS; i++) a[0] = _mm256_add_ps(a[0], a[i]);
    _mm256_storeu_ps(o, a[0]);
    return o[0];
}
OKV_AVX512 static float okv_fma_probe_avx512(int64_t n) {
    const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
    __m512 a[OKV_FMA_CHAINS];
    int64_t k;
    int i;
    for (i = 0; i < OKV_FMA_CHAINS; i++) a[i] = _mm512_set1_ps((float)i);
    for (k = 0; k < n; k++)
#pragma GCC unroll 12
        for (i = 0; i < OKV_FMA_CHAINS; i++) a[i] = _mm512_fmadd_ps(a[i], x, y);
    for (i = 1; i < OKV_FMA_CHAINS; i++) a[0] = _mm512_add_ps(a[0], a[i]);
    return _mm512_reduce_add_ps(a[0]);
}
#endif

/* okv_fma_probe_* of isa. */
static float okv_fma_probe(int isa, int64_t n) {
#if OKV_X86_SIMD
    if (isa == OKV_MMP_AVX512) return okv_fma_probe_avx512(n);
    if (isa == OKV_MMP_AVX2) return okv_fma_probe_avx2(n);
#endif
    return okv_fma_probe_scalar(n);
}

/* The float32 lanes of the vectors of okv_fma_probe at isa. */
static int okv_fma_lanes(int isa) { return isa == OKV_MMP_AVX512 ? 16 : (isa == OKV_MMP_AVX2 ? 8 : 1); }

#endif /* ONNXKV_FMA_PROBE_H */
