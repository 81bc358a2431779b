/* onnxkv/_kernels/imatmul.h -- ONNX MatMulInteger with a constant (packed) weight, and
 * DynamicQuantizeLinear: the integer products of ONNX Runtime's dynamically quantized models.
 *
 * Product.  out[m, n] = sum_k (A[m, k] - azp[m]) (B[k, n] - bzp[n]) in int32 arithmetic that wraps
 * (ONNX Runtime accumulates in int32), for A uint8 or int8 [M, K] and B uint8 or int8 [K, N].  The
 * caller (imatmul.pyx) brings both to one form:
 *   A' = A as uint8 (int8 A: A ^ 0x80 = A + 128) and azp' = azp (+ 128 for int8 A), per call;
 *   B' = B as int8 (uint8 B: B ^ 0x80 = B - 128) and bzp' = bzp (- 128 for uint8 B), packed once;
 * so that (A - azp)(B - bzp) = (A' - azp')(B' - bzp') and
 *   out = sum_k A'B' - azp' csum[n] - bzp'[n] rsum[m] + K azp' bzp'[n]   (mod 2^32),
 * csum[n] = sum_k B'[k, n] (packed with the weight), rsum[m] = sum_k A'[m, k] (per call).
 *
 * Layouts.  K4 = K rounded up to a multiple of 4.  Weight: P = ceil(N / 16) panels of 16 columns;
 * panel p is K4 / 4 lines of 64 bytes, byte 4c + kk of line j = B'[4j + kk, 16p + c] (0 past K and N):
 * the operand of one VPDPBUSD (16 int32 lanes, each the dot of 4 uint8 activations with 4 int8
 * weights).  csum and bzp: int32 [P * 16] (0 past N).  Activations: A' rows of K4 bytes (0 past K);
 * azp, rsum: int32 [M].
 *
 * Paths: scalar; AVX2 (8 columns: each activation byte split into its nibbles, so that VPMADDUBSW's
 * int16 pairs cannot saturate, 2 * 15 * 128 < 2^15); AVX-512 VNNI (16 columns).  All compute the
 * same integers mod 2^32, so every path gives the same bits.
 *
 * With fout, the int32 results become float32 as a Cast and a scale per column would make them (ONNX
 * Runtime's dynamically quantized products: DynamicQuantizeLinear, MatMulInteger, Cast, Mul; the
 * activations then come from okv_dql_rows).
 *
 * DynamicQuantizeLinear (okv_dql), as ONNX Runtime's CPU kernel: over the elements of x that are not
 * NaN, lo = min(0, min x), hi = max(0, max x); scale = (hi - lo) / 255 in float32, 1 when hi == lo;
 * zp = rint(clamp(0 - lo / scale)) where clamp takes a NaN to 255 (v < 255 ? v : 255, then
 * 0 < v ? v : 0); y = clamp(rint(x / scale) + zp) to [0, 255], a NaN to 0.  Division, rint (ties to
 * even) and the clamps are exact operations, so the SIMD path equals the scalar one.  (ONNX Runtime's
 * range takes a NaN in or not depending on its position in x; this one never does.)
 */
#ifndef ONNXKV_IMATMUL_H
#define ONNXKV_IMATMUL_H

#include "claim.h"
#include "simd.h"

typedef struct okv_imm {
    int64_t M, K, N, P, K4;
    const int8_t *wq;     /* [P][K4 * 16] */
    const int32_t *csum;  /* [P * 16] */
    const int32_t *bzp;   /* [P * 16] */
    const uint8_t *a;     /* [M][K4] */
    const int32_t *azp;   /* [M] */
    const int32_t *rsum;  /* [M] */
    int32_t *out;         /* [M][N], unless fout */
    float *fout;          /* or [M][N] float32: (float)result * fs[n] (the Cast and scale of a dynamic product) */
    const float *fs;      /* [P * 16] with fout: each column's scale */
} okv_imm;

enum { OKV_IMM_SCALAR = 0, OKV_IMM_AVX2 = 1, OKV_IMM_AVX512 = 2 };

/* out[m, n] from the raw dot d = sum_k A'B' (mod 2^32). */
static inline int32_t okv_imm_fix(const okv_imm *a, int64_t m, int64_t n, uint32_t d) {
    const uint32_t az = (uint32_t)a->azp[m], bz = (uint32_t)a->bzp[n];
    const uint32_t v = d - az * (uint32_t)a->csum[n] - bz * (uint32_t)a->rsum[m] + (uint32_t)a->K * az * bz;
    int32_t r;
    memcpy(&r, &v, 4);
    return r;
}

/* Store out[m, n] = v, or with fout its float: (float)v * fs[n] (round to nearest, then one product). */
static inline void okv_imm_put(const okv_imm *a, int64_t m, int64_t n, int32_t v) {
    if (a->fout) a->fout[m * a->N + n] = (float)v * a->fs[n];
    else a->out[m * a->N + n] = v;
}

static void okv_imm_scalar(const okv_imm *a, int64_t p0, int64_t p1) {
    int64_t p, m, k;
    int c;
    for (p = p0; p < p1; p++)
        for (c = 0; c < 16 && p * 16 + c < a->N; c++)
            for (m = 0; m < a->M; m++) {
                const uint8_t *x = a->a + m * a->K4;
                const int8_t *w = a->wq + p * a->K4 * 16 + 4 * c;
                uint32_t d = 0;
                for (k = 0; k < a->K4; k++) d += (uint32_t)((int32_t)x[k] * (int32_t)w[(k >> 2) * 64 + (k & 3)]);
                okv_imm_put(a, m, p * 16 + c, okv_imm_fix(a, m, p * 16 + c, d));
            }
}

static inline int32_t okv_imm_x4(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if OKV_X86_SIMD
/* out = acc - az csum - bz rsum + K az bz on 8 lanes (wrapping), columns n0.. (cnt of them) of row m. */
OKV_AVX2 static inline __attribute__((always_inline)) void okv_imm_store8(const okv_imm *a, int64_t m, int64_t n0,
                                                                          __m256i acc) {
    const __m256i az = _mm256_set1_epi32(a->azp[m]), rs = _mm256_set1_epi32(a->rsum[m]);
    const __m256i cs = _mm256_loadu_si256((const __m256i *)(a->csum + n0));
    const __m256i bz = _mm256_loadu_si256((const __m256i *)(a->bzp + n0));
    __m256i v = _mm256_sub_epi32(acc, _mm256_mullo_epi32(az, cs));
    int32_t tmp[8];
    int64_t c, cnt = a->N - n0 < 8 ? a->N - n0 : 8;
    v = _mm256_sub_epi32(v, _mm256_mullo_epi32(bz, rs));
    v = _mm256_add_epi32(v, _mm256_mullo_epi32(_mm256_mullo_epi32(az, bz), _mm256_set1_epi32((int32_t)a->K)));
    if (a->fout) {
        float ftmp[8];
        const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_loadu_ps(a->fs + n0));
        if (cnt == 8) {
            _mm256_storeu_ps(a->fout + m * a->N + n0, f);
            return;
        }
        _mm256_storeu_ps(ftmp, f);
        for (c = 0; c < cnt; c++) a->fout[m * a->N + n0 + c] = ftmp[c];
        return;
    }
    if (cnt == 8) {
        _mm256_storeu_si256((__m256i *)(a->out + m * a->N + n0), v);
        return;
    }
    _mm256_storeu_si256((__m256i *)tmp, v);
    for (c = 0; c < cnt; c++) a->out[m * a->N + n0 + c] = tmp[c];
}

/* MR (1 or 2) rows x the two 8-column halves of panel p.  Each activation byte enters as its low and
 * high nibble (two VPMADDUBSW, no saturation), the high-nibble sums times 16 at the end; 8 accumulators,
 * within the 16 YMM registers. */
OKV_AVX2 static inline __attribute__((always_inline)) void okv_imm_avx2_tile(const int MR, const okv_imm *a,
                                                                             int64_t p, int64_t m0) {
    const int64_t L = a->K4 / 4;
    const int8_t *wp = a->wq + p * a->K4 * 16;
    const __m256i ones = _mm256_set1_epi16(1), nib = _mm256_set1_epi8(0x0F);
    __m256i lo[2][2], hi[2][2];
    int64_t j;
    int r, h;
    for (r = 0; r < MR; r++)
        for (h = 0; h < 2; h++) lo[r][h] = hi[r][h] = _mm256_setzero_si256();
    for (j = 0; j < L; j++) {
        __m256i xl[2], xh[2];
        for (r = 0; r < MR; r++) {
            const __m256i x = _mm256_set1_epi32(okv_imm_x4(a->a + (m0 + r) * a->K4 + 4 * j));
            xl[r] = _mm256_and_si256(x, nib);
            xh[r] = _mm256_and_si256(_mm256_srli_epi16(x, 4), nib);
        }
        for (h = 0; h < 2; h++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wp + 64 * j + 32 * h));
            for (r = 0; r < MR; r++) {
                lo[r][h] = _mm256_add_epi32(lo[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(xl[r], w), ones));
                hi[r][h] = _mm256_add_epi32(hi[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(xh[r], w), ones));
            }
        }
    }
    for (h = 0; h < 2; h++) {
        const int64_t n0 = p * 16 + 8 * h;
        if (n0 >= a->N) continue;
        for (r = 0; r < MR; r++)
            okv_imm_store8(a, m0 + r, n0, _mm256_add_epi32(lo[r][h], _mm256_slli_epi32(hi[r][h], 4)));
    }
}

OKV_AVX2 static void okv_imm_avx2(const okv_imm *a, int64_t p0, int64_t p1) {
    int64_t p, m0;
    for (p = p0; p < p1; p++)
        for (m0 = 0; m0 < a->M; m0 += 2) {
            if (a->M - m0 >= 2) okv_imm_avx2_tile(2, a, p, m0);
            else okv_imm_avx2_tile(1, a, p, m0);
        }
}

#if OKV_HAVE_VNNI
/* MR rows x NP panels of 16 columns on VPDPBUSD (activations the unsigned operand). */
OKV_VNNI512 static inline __attribute__((always_inline)) void okv_imm_512_tile(const int MR, const int NP,
                                                                              const okv_imm *a, int64_t p,
                                                                              int64_t m0) {
    const int64_t L = a->K4 / 4, pstride = a->K4 * 16;
    __m512i acc[4][4];
    int64_t j;
    int r, q;
    for (r = 0; r < MR; r++)
        for (q = 0; q < NP; q++) acc[r][q] = _mm512_setzero_si512();
    for (j = 0; j < L; j++) {
        __m512i x[4];
        for (r = 0; r < MR; r++) x[r] = _mm512_set1_epi32(okv_imm_x4(a->a + (m0 + r) * a->K4 + 4 * j));
        for (q = 0; q < NP; q++) {
            const __m512i w = _mm512_loadu_si512((const void *)(a->wq + (p + q) * pstride + 64 * j));
            for (r = 0; r < MR; r++) acc[r][q] = _mm512_dpbusd_epi32(acc[r][q], x[r], w);
        }
    }
    for (q = 0; q < NP; q++) {
        const int64_t n0 = (p + q) * 16;
        const __mmask16 mask = n0 + 16 <= a->N ? (__mmask16)0xFFFF : (__mmask16)((1u << (a->N - n0)) - 1);
        const __m512i cs = _mm512_loadu_si512((const void *)(a->csum + n0));
        const __m512i bz = _mm512_loadu_si512((const void *)(a->bzp + n0));
        const __m512i bzk = _mm512_mullo_epi32(bz, _mm512_set1_epi32((int32_t)a->K));
        for (r = 0; r < MR; r++) {
            const __m512i az = _mm512_set1_epi32(a->azp[m0 + r]);
            __m512i v = _mm512_sub_epi32(acc[r][q], _mm512_mullo_epi32(az, cs));
            v = _mm512_sub_epi32(v, _mm512_mullo_epi32(bz, _mm512_set1_epi32(a->rsum[m0 + r])));
            v = _mm512_add_epi32(v, _mm512_mullo_epi32(az, bzk));
            if (a->fout)
                _mm512_mask_storeu_ps(a->fout + (m0 + r) * a->N + n0, mask,
                                      _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_loadu_ps(a->fs + n0)));
            else
                _mm512_mask_storeu_epi32(a->out + (m0 + r) * a->N + n0, mask, v);
        }
    }
}

OKV_VNNI512 static void okv_imm_512(const okv_imm *a, int64_t p0, int64_t p1) {
    int64_t p, m0;
    for (p = p0; p < p1;) {
        const int np = p + 4 <= p1 ? 4 : 1;
        for (m0 = 0; m0 < a->M; m0 += 4) {
            const int64_t mr = a->M - m0 >= 4 ? 4 : a->M - m0;
            if (np == 4) {
                switch (mr) {
                case 4: okv_imm_512_tile(4, 4, a, p, m0); break;
                case 3: okv_imm_512_tile(3, 4, a, p, m0); break;
                case 2: okv_imm_512_tile(2, 4, a, p, m0); break;
                default: okv_imm_512_tile(1, 4, a, p, m0); break;
                }
            } else {
                switch (mr) {
                case 4: okv_imm_512_tile(4, 1, a, p, m0); break;
                case 3: okv_imm_512_tile(3, 1, a, p, m0); break;
                case 2: okv_imm_512_tile(2, 1, a, p, m0); break;
                default: okv_imm_512_tile(1, 1, a, p, m0); break;
                }
            }
        }
        p += np;
    }
}
#endif /* OKV_HAVE_VNNI */
#endif /* OKV_X86_SIMD */

/* Panels [p0, p1) of the product on isa (OKV_IMM_*, checked by the caller). */
static void okv_imm_range(const okv_imm *a, int64_t p0, int64_t p1, int isa) {
#if OKV_X86_SIMD
#if OKV_HAVE_VNNI
    if (isa == OKV_IMM_AVX512) { okv_imm_512(a, p0, p1); return; }
#endif
    if (isa != OKV_IMM_SCALAR) { okv_imm_avx2(a, p0, p1); return; }
#else
    (void)isa;
#endif
    okv_imm_scalar(a, p0, p1);
}

typedef struct {
    const okv_imm *a;
    int isa;
} okv_imm_work;

static void okv_imm_work_range(void *ctx, int64_t lo, int64_t hi) {
    const okv_imm_work *w = (const okv_imm_work *)ctx;
    okv_imm_range(w->a, lo, hi, w->isa);
}

/* Thread t of nt takes its panels of the product (ranges set by okv_claim_setup over a->P panels). */
static int64_t okv_imm_claim(const okv_imm *a, int isa, uint64_t *ranges, int nt, int t, int64_t chunk) {
    okv_imm_work w;
    w.a = a;
    w.isa = isa;
    return okv_claim_run(ranges, nt, t, chunk, okv_imm_work_range, &w);
}

/* The activation rows: A (rows of K bytes, uint8, or int8 when sgn) into A' [M][K4] (0 past K), their
 * sums rsum [M] (as int32, mod 2^32). */
static void okv_imm_rows(const uint8_t *A, int64_t M, int64_t K, int64_t K4, int sgn, uint8_t *ap, int32_t *rsum) {
    int64_t m, k;
    for (m = 0; m < M; m++) {
        const uint8_t *x = A + m * K;
        uint8_t *y = ap + m * K4;
        uint32_t s = 0;
        for (k = 0; k < K; k++) {
            const uint8_t v = sgn ? (uint8_t)(x[k] ^ 0x80u) : x[k];
            y[k] = v;
            s += v;
        }
        for (; k < K4; k++) y[k] = 0;
        memcpy(rsum + m, &s, 4);
    }
}

/* ------------------------------------------------------------------ */
/* DynamicQuantizeLinear                                                */
/* ------------------------------------------------------------------ */

/* lo = min(0, x), hi = max(0, x) over the elements that are not NaN. */
static void okv_dql_range_scalar(const float *x, int64_t n, float *lo, float *hi) {
    float mn = 0.f, mx = 0.f;
    int64_t i;
    for (i = 0; i < n; i++) {
        mn = x[i] < mn ? x[i] : mn;
        mx = x[i] > mx ? x[i] : mx;
    }
    *lo = mn;
    *hi = mx;
}

/* y = clamp(rint(x / scale) + zp), a NaN to 0 (see the top). */
static void okv_dql_quant_scalar(const float *x, int64_t n, float scale, float zp, uint8_t *y) {
    int64_t i;
    for (i = 0; i < n; i++) {
        float v = rintf(x[i] / scale) + zp;
        v = v > 0.f ? v : 0.f; /* a NaN to 0 */
        v = v < 255.f ? v : 255.f;
        y[i] = (uint8_t)v;
    }
}

#if OKV_X86_SIMD
OKV_AVX512BW static void okv_dql_range_512(const float *x, int64_t n, float *lo, float *hi) {
    __m512 mn = _mm512_setzero_ps(), mx = _mm512_setzero_ps();
    float a, b;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        mn = _mm512_min_ps(v, mn); /* a NaN in v: the second operand */
        mx = _mm512_max_ps(v, mx);
    }
    if (i < n) {
        const __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << (n - i)) - 1), x + i);
        mn = _mm512_min_ps(v, mn);
        mx = _mm512_max_ps(v, mx);
    }
    a = _mm512_reduce_min_ps(mn);
    b = _mm512_reduce_max_ps(mx);
    *lo = a < 0.f ? a : 0.f;
    *hi = b > 0.f ? b : 0.f;
}

OKV_AVX512BW static void okv_dql_quant_512(const float *x, int64_t n, float scale, float zp, uint8_t *y) {
    const __m512 s = _mm512_set1_ps(scale), z = _mm512_set1_ps(zp), top = _mm512_set1_ps(255.f);
    int64_t i = 0;
    for (; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(k, x + i), s);
        v = _mm512_add_ps(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), z);
        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_setzero_ps()), top); /* max: a NaN to 0 */
        _mm_mask_storeu_epi8(y + i, k, _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v)));
    }
}
#endif

/* The scale and zero point of x [n] (see the top). simd: the AVX-512 path (checked by the caller). */
static void okv_dql_params(const float *x, int64_t n, float *scale, float *zp, int simd) {
    float lo, hi, s, z;
#if OKV_X86_SIMD
    if (simd) okv_dql_range_512(x, n, &lo, &hi);
    else
#else
    (void)simd;
#endif
        okv_dql_range_scalar(x, n, &lo, &hi);
    s = hi == lo ? 1.f : (hi - lo) / 255.f;
    z = 0.f - lo / s;
    z = z < 255.f ? z : 255.f; /* a NaN to 255 */
    z = 0.f < z ? z : 0.f;
    *scale = s;
    *zp = rintf(z);
}

static void okv_dql_quant(const float *x, int64_t n, float scale, float zp, uint8_t *y, int simd) {
#if OKV_X86_SIMD
    if (simd) {
        okv_dql_quant_512(x, n, scale, zp, y);
        return;
    }
#else
    (void)simd;
#endif
    okv_dql_quant_scalar(x, n, scale, zp, y);
}

/* DynamicQuantizeLinear of x [n] into y [n]; *scale and *zp its outputs (see the top). */
static void okv_dql(const float *x, int64_t n, uint8_t *y, float *scale, uint8_t *zp, int simd) {
    float z;
    okv_dql_params(x, n, scale, &z, simd);
    *zp = (uint8_t)z;
    okv_dql_quant(x, n, *scale, z, y, simd);
}

/* The activations of a dynamic product: DynamicQuantizeLinear of the whole x [M][K] (one scale and zero
 * point, as the node computes them) into A' [M][K4] (0 past K) with the row sums rsum [M]. */
static void okv_dql_rows(const float *x, int64_t M, int64_t K, int64_t K4, uint8_t *ap, int32_t *rsum, float *scale,
                         uint8_t *zp, int simd) {
    float z;
    int64_t m, k;
    okv_dql_params(x, M * K, scale, &z, simd);
    *zp = (uint8_t)z;
    for (m = 0; m < M; m++) {
        uint8_t *y = ap + m * K4;
        uint32_t s = 0;
        okv_dql_quant(x + m * K, K, *scale, z, y, simd);
        for (k = 0; k < K; k++) s += y[k];
        for (; k < K4; k++) y[k] = 0;
        memcpy(rsum + m, &s, 4);
    }
}

#endif /* ONNXKV_IMATMUL_H */
