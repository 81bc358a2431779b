/* onnxkv/_kernels/attention_softmax.h -- the online-softmax steps of the
 * attention work units per instruction set: the running max of a block of
 * scores (okv_attn_max_*, NaN-propagating), and (AVX-512) exp(x - m) with
 * its sum, the 16-way transposing horizontal sum of the score tiles and the
 * lane masks.  The scalar and AVX2 exp steps are simd.h's
 * okv_exp_sub_sum_f32_*.
 */
#ifndef ONNXKV_ATTENTION_SOFTMAX_H
#define ONNXKV_ATTENTION_SOFTMAX_H

#include "simd.h"

#if OKV_X86_SIMD
/* The 16 horizontal sums of a[0..15] in one vector, by a transposing tree of
 * 128-bit block and in-block shuffles (45 operations): the sum of a[s] lands
 * in lane OKV_HSUM16_LANE(s). */
#define OKV_HSUM16_LANE(s) ((((s) & 3) << 2) | ((s) >> 2))
OKV_INLINE OKV_AVX512BW __m512 okv_hsum16x16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    int p;
    for (p = 0; p < 8; p++)   /* 256-bit halves folded: [a(2p) 8 lanes | a(2p+1) 8 lanes] */
        b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
    for (p = 0; p < 4; p++)   /* block k: a(4p+k) folded to 4 lanes */
        c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0xDD));
    for (p = 0; p < 2; p++)   /* block k: 2 lanes each of a(8p+k), a(8p+4+k) */
        d[p] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * p], c[2 * p + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * p], c[2 * p + 1], 0xEE));
    /* block k: a(k), a(4+k), a(8+k), a(12+k) */
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

/* The first min(r, 16) lanes. */
OKV_INLINE __mmask16 okv_mask16(int64_t r) { return r >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << r) - 1u); }

/* exp(x) in the lanes of k, 0 elsewhere, for x <= 0 or -inf (scores minus
 * their running max): n = round(x log2(e)), r = x - n ln(2) (ln(2) in two
 * parts), e^r by the Cephes polynomial (as okv_exp256), times 2^n by
 * vscalefps; x < -87.34 gives 0, as okv_exp256. */
OKV_INLINE OKV_AVX512BW __m512 okv_exp512_nonpos(__m512 x, __mmask16 k) {
    static const float poly[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                                  4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};
    const __m512 lo = _mm512_set1_ps(-87.3365447505531f);
    const __mmask16 keep = k & _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    __m512 n, r, y;
    int i;
    x = _mm512_max_ps(x, lo);
    n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    y = _mm512_set1_ps(poly[0]);
    for (i = 1; i < 6; i++) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(poly[i]));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, y, n);
}

/* The softmax steps of the AVX-512 unit over at most OKV_BK scores: the
 * maximum of x[0..n) (okv_attn_max: NaN when one of them is NaN), and x[i] =
 * exp(x[i] - m) (-inf -> 0) returning their sum, 16 lanes at a time. */
OKV_INLINE OKV_AVX512BW float okv_attn_max_avx512(const float *x, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    int64_t i;
    for (i = 0; i < n; i += 16) {
        const __m512 v = _mm512_mask_loadu_ps(m, okv_mask16(n - i), x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, v);
    }
    return nan ? NAN : _mm512_reduce_max_ps(m);
}

OKV_INLINE OKV_AVX512BW float okv_exp_sub_sum_f32_avx512(float *x, float m, int64_t n) {
    const __m512 vm = _mm512_set1_ps(m);
    __m512 s = _mm512_setzero_ps();
    int64_t i;
    for (i = 0; i < n; i += 16) {
        const __mmask16 k = okv_mask16(n - i);
        const __m512 e = okv_exp512_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm), k);
        _mm512_mask_storeu_ps(x + i, k, e);
        s = _mm512_add_ps(s, e);
    }
    return _mm512_reduce_add_ps(s);
}

/* The AVX-512 unit and tiles take these simd.h primitives as they are. */
#define okv_scal_f32_avx512 okv_scal_f32_avx2
#define okv_scale_mul_f32_avx512 okv_scale_mul_f32_avx2
#define okv_dot_f32_avx512 okv_dot_f32_avx2
#endif

/* The largest score of x[0..n) for a work unit's softmax, or NaN when one of
 * them is NaN: the running max of the max instructions (and of a plain
 * compare) drops NaN, which would turn a NaN score into weight 0 instead of
 * the NaN row the dense softmax gives.  The NaN test costs one compare per
 * vector of scores, none per key element. */
static inline float okv_attn_max_scalar(const float *x, int64_t n) {
    float m = -INFINITY;
    int nan = 0;
    int64_t i;
    for (i = 0; i < n; i++) {
        m = x[i] > m ? x[i] : m;
        nan |= x[i] != x[i];
    }
    return nan ? NAN : m;
}

#if OKV_X86_SIMD
OKV_AVX2 static inline float okv_attn_max_avx2(const float *x, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    float r;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, v);
    }
    r = okv_hmax256(m);
    if (_mm256_movemask_ps(nan)) return NAN;
    for (; i < n; i++) {
        if (x[i] != x[i]) return NAN;
        r = x[i] > r ? x[i] : r;
    }
    return r;
}
#endif

#endif /* ONNXKV_ATTENTION_SOFTMAX_H */
