/* onnxkv/_kernels/simd_avx2.h -- the AVX2+FMA+F16C primitives (`*_avx2`, float32),
 * compiled only when OKV_X86_SIMD; each inside a function with the OKV_AVX2
 * target attribute.
 */
#ifndef ONNXKV_SIMD_AVX2_H
#define ONNXKV_SIMD_AVX2_H

#include "simd_scalar.h"

/* ------------------------------------------------------------------ */
/* AVX2 + FMA + F16C primitives (float32)                               */
/* ------------------------------------------------------------------ */
#if OKV_X86_SIMD

OKV_AVX2 static inline float okv_hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

OKV_AVX2 static inline float okv_hmax256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_max_ps(lo, hi);
    lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* exp(x) for 8 floats (Cephes polynomial, ~1 ulp on the normal range).
 * x < -87.3 gives 0, x > 88.37 saturates to ~FLT_MAX*... (not inf).  NaN inputs
 * are not propagated. */
OKV_AVX2 static inline __m256 okv_exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f);
    const __m256 lo = _mm256_set1_ps(-87.3365447505531f);
    __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_min_ps(x, hi);
    x = _mm256_max_ps(x, lo);
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_cvttps_epi32(fx);
    e = _mm256_add_epi32(e, _mm256_set1_epi32(127));
    e = _mm256_slli_epi32(e, 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_and_ps(y, keep);
}

/* mask for the first r (0..7) lanes */
OKV_AVX2 static inline __m256i okv_tailmask(int64_t r) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)r), idx);
}

OKV_AVX2 static inline float okv_dot_f32_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    if (i < n) {
        __m256i m = okv_tailmask(n - i);
        s1 = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, m), _mm256_maskload_ps(b + i, m), s1);
    }
    return okv_hsum256(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
}

/* 8 keys at a time: one q load feeds 8 FMAs, one transposing reduction
 * replaces 8 horizontal sums. */
OKV_AVX2 static inline void okv_scores_f32_avx2(const float *q, const float *k, int64_t n, int64_t D, float scale,
                                                float *s) {
    const __m256 vscale = _mm256_set1_ps(scale);
    const int64_t Dv = D & ~(int64_t)7;
    const __m256i tm = okv_tailmask(D - Dv);
    int64_t j = 0, i, u;
    for (; j + 8 <= n; j += 8) {
        const float *kj = k + j * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        __m256 a4 = _mm256_setzero_ps(), a5 = _mm256_setzero_ps(), a6 = _mm256_setzero_ps(), a7 = _mm256_setzero_ps();
        for (i = 0; i < Dv; i += 8) {
            __m256 vq = _mm256_loadu_ps(q + i);
            a0 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + i), a0);
            a1 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + D + i), a1);
            a2 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + 2 * D + i), a2);
            a3 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + 3 * D + i), a3);
            a4 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + 4 * D + i), a4);
            a5 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + 5 * D + i), a5);
            a6 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + 6 * D + i), a6);
            a7 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + 7 * D + i), a7);
        }
        if (Dv < D) {
            __m256 vq = _mm256_maskload_ps(q + Dv, tm);
            a0 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + Dv, tm), a0);
            a1 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + D + Dv, tm), a1);
            a2 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + 2 * D + Dv, tm), a2);
            a3 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + 3 * D + Dv, tm), a3);
            a4 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + 4 * D + Dv, tm), a4);
            a5 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + 5 * D + Dv, tm), a5);
            a6 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + 6 * D + Dv, tm), a6);
            a7 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + 7 * D + Dv, tm), a7);
        }
        {
            __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
            __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
            __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
            __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
            _mm256_storeu_ps(s + j, _mm256_mul_ps(r, vscale));
        }
    }
    for (u = j; u < n; u++) s[u] = okv_dot_f32_avx2(q, k + u * D, D) * scale;
}

/* acc[0:D] += sum_j p[j] * v[j*D : j*D+D]; acc is kept in registers 64 floats
 * at a time while the keys stream by. */
OKV_AVX2 static inline void okv_pvs_f32_avx2(const float *p, const float *v, int64_t n, int64_t D, int64_t S,
                                             float *acc) {
    int64_t i = 0, j;
    for (; i + 64 <= D; i += 64) {
        __m256 c0 = _mm256_loadu_ps(acc + i), c1 = _mm256_loadu_ps(acc + i + 8);
        __m256 c2 = _mm256_loadu_ps(acc + i + 16), c3 = _mm256_loadu_ps(acc + i + 24);
        __m256 c4 = _mm256_loadu_ps(acc + i + 32), c5 = _mm256_loadu_ps(acc + i + 40);
        __m256 c6 = _mm256_loadu_ps(acc + i + 48), c7 = _mm256_loadu_ps(acc + i + 56);
        for (j = 0; j < n; j++) {
            const float *vj = v + j * S + i;
            __m256 pj = _mm256_broadcast_ss(p + j);
            c0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj), c0);
            c1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8), c1);
            c2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 16), c2);
            c3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 24), c3);
            c4 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 32), c4);
            c5 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 40), c5);
            c6 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 48), c6);
            c7 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 56), c7);
        }
        _mm256_storeu_ps(acc + i, c0); _mm256_storeu_ps(acc + i + 8, c1);
        _mm256_storeu_ps(acc + i + 16, c2); _mm256_storeu_ps(acc + i + 24, c3);
        _mm256_storeu_ps(acc + i + 32, c4); _mm256_storeu_ps(acc + i + 40, c5);
        _mm256_storeu_ps(acc + i + 48, c6); _mm256_storeu_ps(acc + i + 56, c7);
    }
    for (; i + 8 <= D; i += 8) {
        __m256 c0 = _mm256_loadu_ps(acc + i);
        for (j = 0; j < n; j++) c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), _mm256_loadu_ps(v + j * S + i), c0);
        _mm256_storeu_ps(acc + i, c0);
    }
    if (i < D) {
        const __m256i tm = okv_tailmask(D - i);
        __m256 c0 = _mm256_maskload_ps(acc + i, tm);
        for (j = 0; j < n; j++)
            c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), _mm256_maskload_ps(v + j * S + i, tm), c0);
        _mm256_maskstore_ps(acc + i, tm, c0);
    }
}

OKV_AVX2 static inline void okv_pv_f32_avx2(const float *p, const float *v, int64_t n, int64_t D, float *acc) {
    okv_pvs_f32_avx2(p, v, n, D, D, acc);
}

/* Two rows x 4 keys per step: 6 loads feed 8 FMAs. */
OKV_AVX2 static inline void okv_scores2_f32_avx2(const float *q0, const float *q1, const float *k, int64_t n,
                                                 int64_t D, float scale, float *s0, float *s1) {
    const __m256 vscale = _mm256_set1_ps(scale);
    const int64_t Dv = D & ~(int64_t)7;
    const __m256i tm = okv_tailmask(D - Dv);
    int64_t j = 0, i, u;
    for (; j + 4 <= n; j += 4) {
        const float *kj = k + j * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
        for (i = 0; i < Dv; i += 8) {
            __m256 x0 = _mm256_loadu_ps(q0 + i), x1 = _mm256_loadu_ps(q1 + i), kk;
            kk = _mm256_loadu_ps(kj + i);         a0 = _mm256_fmadd_ps(x0, kk, a0); b0 = _mm256_fmadd_ps(x1, kk, b0);
            kk = _mm256_loadu_ps(kj + D + i);     a1 = _mm256_fmadd_ps(x0, kk, a1); b1 = _mm256_fmadd_ps(x1, kk, b1);
            kk = _mm256_loadu_ps(kj + 2 * D + i); a2 = _mm256_fmadd_ps(x0, kk, a2); b2 = _mm256_fmadd_ps(x1, kk, b2);
            kk = _mm256_loadu_ps(kj + 3 * D + i); a3 = _mm256_fmadd_ps(x0, kk, a3); b3 = _mm256_fmadd_ps(x1, kk, b3);
        }
        if (Dv < D) {
            __m256 x0 = _mm256_maskload_ps(q0 + Dv, tm), x1 = _mm256_maskload_ps(q1 + Dv, tm), kk;
            kk = _mm256_maskload_ps(kj + Dv, tm);         a0 = _mm256_fmadd_ps(x0, kk, a0); b0 = _mm256_fmadd_ps(x1, kk, b0);
            kk = _mm256_maskload_ps(kj + D + Dv, tm);     a1 = _mm256_fmadd_ps(x0, kk, a1); b1 = _mm256_fmadd_ps(x1, kk, b1);
            kk = _mm256_maskload_ps(kj + 2 * D + Dv, tm); a2 = _mm256_fmadd_ps(x0, kk, a2); b2 = _mm256_fmadd_ps(x1, kk, b2);
            kk = _mm256_maskload_ps(kj + 3 * D + Dv, tm); a3 = _mm256_fmadd_ps(x0, kk, a3); b3 = _mm256_fmadd_ps(x1, kk, b3);
        }
        {
            __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
            __m256 t2 = _mm256_hadd_ps(b0, b1), t3 = _mm256_hadd_ps(b2, b3);
            __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
            __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
            r = _mm256_mul_ps(r, vscale);
            _mm_storeu_ps(s0 + j, _mm256_castps256_ps128(r));
            _mm_storeu_ps(s1 + j, _mm256_extractf128_ps(r, 1));
        }
    }
    for (u = j; u < n; u++) {
        s0[u] = okv_dot_f32_avx2(q0, k + u * D, D) * scale;
        s1[u] = okv_dot_f32_avx2(q1, k + u * D, D) * scale;
    }
}

/* acc0 += p0 @ V, acc1 += p1 @ V sharing the V loads (32 columns per pass). */
OKV_AVX2 static inline void okv_pv2_f32_avx2(const float *p0, const float *p1, const float *v, int64_t n, int64_t D,
                                             float *acc0, float *acc1) {
    int64_t i = 0, j;
    for (; i + 32 <= D; i += 32) {
        __m256 c0 = _mm256_loadu_ps(acc0 + i), c1 = _mm256_loadu_ps(acc0 + i + 8);
        __m256 c2 = _mm256_loadu_ps(acc0 + i + 16), c3 = _mm256_loadu_ps(acc0 + i + 24);
        __m256 d0 = _mm256_loadu_ps(acc1 + i), d1 = _mm256_loadu_ps(acc1 + i + 8);
        __m256 d2 = _mm256_loadu_ps(acc1 + i + 16), d3 = _mm256_loadu_ps(acc1 + i + 24);
        for (j = 0; j < n; j++) {
            const float *vj = v + j * D + i;
            __m256 w0 = _mm256_broadcast_ss(p0 + j), w1 = _mm256_broadcast_ss(p1 + j), vv;
            vv = _mm256_loadu_ps(vj);      c0 = _mm256_fmadd_ps(w0, vv, c0); d0 = _mm256_fmadd_ps(w1, vv, d0);
            vv = _mm256_loadu_ps(vj + 8);  c1 = _mm256_fmadd_ps(w0, vv, c1); d1 = _mm256_fmadd_ps(w1, vv, d1);
            vv = _mm256_loadu_ps(vj + 16); c2 = _mm256_fmadd_ps(w0, vv, c2); d2 = _mm256_fmadd_ps(w1, vv, d2);
            vv = _mm256_loadu_ps(vj + 24); c3 = _mm256_fmadd_ps(w0, vv, c3); d3 = _mm256_fmadd_ps(w1, vv, d3);
        }
        _mm256_storeu_ps(acc0 + i, c0); _mm256_storeu_ps(acc0 + i + 8, c1);
        _mm256_storeu_ps(acc0 + i + 16, c2); _mm256_storeu_ps(acc0 + i + 24, c3);
        _mm256_storeu_ps(acc1 + i, d0); _mm256_storeu_ps(acc1 + i + 8, d1);
        _mm256_storeu_ps(acc1 + i + 16, d2); _mm256_storeu_ps(acc1 + i + 24, d3);
    }
    if (i < D) {
        okv_pvs_f32_avx2(p0, v + i, n, D - i, D, acc0 + i);   /* remaining columns, row stride D */
        okv_pvs_f32_avx2(p1, v + i, n, D - i, D, acc1 + i);
    }
}

OKV_AVX2 static inline void okv_axpy_f32_avx2(float a, const float *x, float *y, int64_t n) {
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
        _mm256_storeu_ps(y + i + 8, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8)));
    }
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

OKV_AVX2 static inline void okv_scal_f32_avx2(float a, float *y, int64_t n) {
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] *= a;
}

/* The largest of x[0..n), or NaN if one is NaN (maxps alone would drop it). */
OKV_AVX2 static inline float okv_max_f32_avx2(const float *x, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY), m1 = m, nan = _mm256_setzero_ps();
    int64_t i = 0;
    float r;
    for (; i + 16 <= n; i += 16) {   /* two chains of maxps */
        const __m256 v = _mm256_loadu_ps(x + i), w = _mm256_loadu_ps(x + i + 8);
        m = _mm256_max_ps(m, v);
        m1 = _mm256_max_ps(m1, w);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, w, _CMP_UNORD_Q));
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        m = _mm256_max_ps(m, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    r = okv_hmax256(_mm256_max_ps(m, m1));
    for (; i < n; i++) {
        if (x[i] != x[i]) return NAN;
        r = x[i] > r ? x[i] : r;
    }
    return r;
}

/* x[i] = exp(x[i] - m); returns the sum: eight float lanes over 256 elements at a time, those partial
 * sums added in double (a vocabulary-sized row summed in float lanes alone drifts 3e-5 relative). */
OKV_AVX2 static inline float okv_exp_sub_sum_f32_avx2(float *x, float m, int64_t n) {
    __m256 vm = _mm256_set1_ps(m), s = _mm256_setzero_ps();
    double total = 0.;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = okv_exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, e);
        s = _mm256_add_ps(s, e);
        if ((i & 255) == 248) {
            total += okv_hsum256(s);
            s = _mm256_setzero_ps();
        }
    }
    if (i < n) {
        __m256i mk = okv_tailmask(n - i);
        __m256 e = okv_exp256(_mm256_sub_ps(_mm256_maskload_ps(x + i, mk), vm));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(mk));
        _mm256_maskstore_ps(x + i, mk, e);
        s = _mm256_add_ps(s, e);
    }
    return (float)(total + okv_hsum256(s));
}

OKV_AVX2 static inline float okv_sumsq_f32_avx2(const float *x, int64_t n) {
    return okv_dot_f32_avx2(x, x, n);
}

OKV_AVX2 static inline void okv_scale_mul_f32_avx2(const float *x, float s, const float *g, float *out, int64_t n) {
    __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs), _mm256_loadu_ps(g + i)));
    for (; i < n; i++) out[i] = x[i] * s * g[i];
}

OKV_AVX2 static inline void okv_add3_f32_avx2(const float *x, const float *y, const float *b, float *out, int64_t n) {
    int64_t i = 0;
    if (b) {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)),
                                                    _mm256_loadu_ps(b + i)));
        for (; i < n; i++) out[i] = x[i] + y[i] + b[i];
    } else {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
        for (; i < n; i++) out[i] = x[i] + y[i];
    }
}

/* 1 / (1 + exp(-x)) where x >= -88.38, else 0 (okv_exp256 saturates there instead of overflowing), and
 * 0 for NaN: silu's product with x makes that NaN again; sigmoid puts x back (okv_act_f32_avx2). */
OKV_AVX2 static inline __m256 okv_sigmoid256(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.f);
    __m256 e = okv_exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
    __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
    return _mm256_and_ps(r, _mm256_cmp_ps(x, _mm256_set1_ps(-88.3762626647949f), _CMP_GE_OQ));
}

/* tanh of 8 floats.  |y| < 0.5: y + y^3 P(y^2), P the Taylor polynomial of (tanh(y) - y) / y^3 through y^12
 * (truncation below 1e-8 of the value); else sign(y) (1 - 2 / (exp(2|y|) + 1)), 1 where okv_exp256
 * saturates (|y| > 44).  NaN stays NaN (it takes the polynomial's side). */
OKV_AVX2 static inline __m256 okv_tanh256(__m256 y) {
    const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
    __m256 a = _mm256_andnot_ps(sign, y), z = _mm256_mul_ps(a, a);
    __m256 p = _mm256_set1_ps(-929569.f / 638512875.f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(21844.f / 6081075.f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-1382.f / 155925.f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(62.f / 2835.f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-17.f / 315.f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.f / 15.f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-1.f / 3.f));
    __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(a, z), p, a);
    __m256 e = okv_exp256(_mm256_add_ps(a, a));
    __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
    __m256 r = _mm256_blendv_ps(small, big, _mm256_cmp_ps(a, _mm256_set1_ps(0.5f), _CMP_GE_OQ));
    return _mm256_or_ps(r, _mm256_and_ps(y, sign));
}

OKV_AVX2 static inline void okv_act_f32_avx2(int mode, const float *x, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    if (mode == 7) {  /* softcap: c tanh(x / c), c = up[0] */
        const __m256 c = _mm256_set1_ps(up[0]);
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_mul_ps(c, okv_tanh256(_mm256_div_ps(_mm256_loadu_ps(x + i), c))));
        if (i < n) {  /* the same arithmetic on a zero-padded tail: a value's result is not its position's */
            float t[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, r[8];
            int64_t j, m = n - i;
            for (j = 0; j < m; j++) t[j] = x[i + j];
            _mm256_storeu_ps(r, _mm256_mul_ps(c, okv_tanh256(_mm256_div_ps(_mm256_loadu_ps(t), c))));
            for (j = 0; j < m; j++) out[i + j] = r[j];
        }
        return;
    }
    for (; i + 8 <= n; i += 8) {
        __m256 vx = _mm256_loadu_ps(x + i);
        __m256 r;
        if (mode == 4) {  /* gelu_tanh(x) * up = x sigmoid(2a (x + c x^3)) * up (okv_act_f32_scalar) */
            __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(vx, vx), vx);
            __m256 u = _mm256_add_ps(vx, _mm256_mul_ps(_mm256_set1_ps(OKV_GELU_C), x3));
            r = _mm256_mul_ps(okv_sigmoid256(_mm256_mul_ps(_mm256_set1_ps(OKV_GELU_2A), u)), vx);
            _mm256_storeu_ps(out + i, _mm256_mul_ps(r, _mm256_loadu_ps(up + i)));
            continue;
        }
        r = okv_sigmoid256(vx);
        if (mode == 0) r = _mm256_blendv_ps(r, vx, _mm256_cmp_ps(vx, vx, _CMP_UNORD_Q));  /* NaN stays NaN */
        if (mode >= 1) r = _mm256_mul_ps(r, vx);
        if (mode == 2) r = _mm256_mul_ps(r, _mm256_loadu_ps(up + i));
        _mm256_storeu_ps(out + i, r);
    }
    if (i < n) okv_act_f32_scalar(mode, x + i, up ? up + i : NULL, out + i, n - i);
}

OKV_AVX2 static inline void okv_rope_half_f32_avx2(const float *x, const float *c, const float *s, float *out, int64_t half) {
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
        __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
        __m256 o1 = _mm256_fnmadd_ps(x2, vs, _mm256_mul_ps(x1, vc));
        __m256 o2 = _mm256_fmadd_ps(x1, vs, _mm256_mul_ps(x2, vc));
        _mm256_storeu_ps(out + i, o1);
        _mm256_storeu_ps(out + half + i, o2);
    }
    for (; i < half; i++) {
        float x1 = x[i], x2 = x[half + i];
        out[i] = x1 * c[i] - x2 * s[i];
        out[half + i] = x2 * c[i] + x1 * s[i];
    }
}

OKV_AVX2 static inline void okv_rope_inter_f32_avx2(const float *x, const float *c, const float *s, float *out, int64_t half) {
    const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    int64_t i = 0;
    for (; i + 4 <= half; i += 4) {
        __m256 vx = _mm256_loadu_ps(x + 2 * i);
        __m256 vc = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(c + i)), dup);
        __m256 vs = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(s + i)), dup);
        __m256 sw = _mm256_permute_ps(vx, 0xB1); /* swap pairs */
        /* even: x0*c - x1*s ; odd: x1*c + x0*s */
        _mm256_storeu_ps(out + 2 * i, _mm256_fmaddsub_ps(vx, vc, _mm256_mul_ps(sw, vs)));
    }
    for (; i < half; i++) {
        float x1 = x[2 * i], x2 = x[2 * i + 1];
        out[2 * i] = x1 * c[i] - x2 * s[i];
        out[2 * i + 1] = x2 * c[i] + x1 * s[i];
    }
}

OKV_AVX2 static inline void okv_softmax_row_f32_avx2(const float *x, float *out, int64_t n, float dead) {
    float m = okv_max_f32_avx2(x, n), s;
    int64_t i;
    if (m == -INFINITY) { for (i = 0; i < n; i++) out[i] = dead; return; }
    if (out != x) memcpy(out, x, (size_t)n * sizeof(float));
    s = okv_exp_sub_sum_f32_avx2(out, m, n);
    okv_scal_f32_avx2(1.f / s, out, n);
}

OKV_AVX2 static inline void okv_rms_row_f32_avx2(const float *x, const float *g, float eps, float *out, int64_t n) {
    float ms = okv_sumsq_f32_avx2(x, n) / (float)n;
    okv_scale_mul_f32_avx2(x, ms < INFINITY ? 1.f / sqrtf(ms + eps) : okv_rms_inv_f64(x, n, eps), g, out, n);
}

#endif /* OKV_X86_SIMD */

#endif /* ONNXKV_SIMD_AVX2_H */
