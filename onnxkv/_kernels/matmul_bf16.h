/* onnxkv/_kernels/matmul_bf16.h -- the bfloat16 prompt product (prefill_precision="bf16"):
 * out[M,N] = bf16(x)[M,K] @ bf16(w)[K,N] (+ bias) with float32 accumulation,
 * w given as the float32 panels of matmul_packed.h (wp[P][K][16]); no second copy of
 * the weights is kept.
 *
 * Rounding: okv_bf16_round (bf16_round.h).
 *
 * Layout.  The caller rounds x once into xb [M][K2] (K2 = ceil(K/2) pairs:
 * the low half of pair j is x[2j], the high half x[2j+1], 0 past K).  Each
 * thread rounds the panel lines of one tile's k-chunk into its workspace wb:
 * for each of the NP panels, K-pair j holds 32 halves, column c's pair
 * (w[2j][c], w[2j+1][c]) at 2c, 2c+1 (VDPBF16PS multiplies the two halves of
 * a 32-bit lane of each operand and adds both products to the lane's float32
 * sum).  The tiles are those of the float32 AVX-512 kernel (okv_mmp_shape:
 * rows x NP panels of accumulators in registers, one broadcast pair of x per
 * row and K-pair), with half the K steps.  A chunk's rounded lines serve every
 * row tile, so rounding costs K x N per call against M x K x N products.
 *
 * The scalar tile is the portable twin: per K-pair, the high product then
 * the low one added to the float32 sum (products of two bfloat16 are exact in
 * float32).  The hardware may order or round the pair's sum differently and
 * flushes subnormal sums; results agree with the float64 product of the
 * rounded operands within float32 accumulation error, not bit for bit. */
#ifndef ONNXKV_MATMUL_BF16_H
#define ONNXKV_MATMUL_BF16_H

#include "bf16_round.h"
#include "matmul_packed.h"

/* xb[m][0:K2] = the rounded pairs of x[m][0:K] (K2 = (K + 1) / 2). */
static void okv_bf16_rows_scalar(const float *x, int64_t M, int64_t K, uint32_t *xb) {
    const int64_t K2 = (K + 1) / 2;
    int64_t m, j;
    for (m = 0; m < M; m++)
        for (j = 0; j < K2; j++) {
            uint32_t lo = okv_bf16_round(x[m * K + 2 * j]);
            uint32_t hi = 2 * j + 1 < K ? okv_bf16_round(x[m * K + 2 * j + 1]) : 0u;
            xb[m * K2 + j] = lo | (hi << 16);
        }
}

/* wb = the rounded pairs of lines [k0, k0 + kn) of np adjacent panels
 * (panel q at wp + q * pstride), kn2 = (kn + 1) / 2 pairs each (lines past K: 0). */
static void okv_bf16_panels_scalar(const float *wp, int64_t pstride, int np, int64_t k0, int64_t kn, int64_t K,
                                   uint16_t *wb) {
    const int64_t kn2 = (kn + 1) / 2;
    int64_t j, c;
    int q;
    for (q = 0; q < np; q++)
        for (j = 0; j < kn2; j++) {
            const float *l0 = wp + q * pstride + (k0 + 2 * j) * OKV_MMP_NR;
            const int odd = k0 + 2 * j + 1 < K && 2 * j + 1 < kn;
            uint16_t *d = wb + (q * kn2 + j) * 2 * OKV_MMP_NR;
            for (c = 0; c < OKV_MMP_NR; c++) {
                d[2 * c] = okv_bf16_round(l0[c]);
                d[2 * c + 1] = odd ? okv_bf16_round(l0[OKV_MMP_NR + c]) : 0;
            }
        }
}

/* Portable tile: c[r, 0:nb] (+)= rows of xb (ldx pairs apart) @ the np panels
 * of wb (kn2 pairs each), for r < mr; first: from bias (or 0). */
static void okv_mmb_tile_scalar(int mr, int np, const uint32_t *xb, int64_t ldx, const uint16_t *wb, int64_t kn2,
                                float *c, int64_t ldc, int64_t nb, int first, const float *bias) {
    float acc[OKV_MMP_NR];
    int64_t j, k;
    int r, q;
    for (q = 0; q < np; q++)
        for (r = 0; r < mr; r++) {
            float *cr = c + r * ldc + q * OKV_MMP_NR;
            const int64_t w = np > 1 ? OKV_MMP_NR : nb;
            for (j = 0; j < OKV_MMP_NR; j++)
                acc[j] = j >= w ? 0.0f : (!first ? cr[j] : (bias ? bias[q * OKV_MMP_NR + j] : 0.0f));
            for (k = 0; k < kn2; k++) {
                const uint32_t p = xb[r * ldx + k];
                const float lo = okv_bf16_float((uint16_t)(p & 0xffffu)), hi = okv_bf16_float((uint16_t)(p >> 16));
                const uint16_t *wk = wb + (q * kn2 + k) * 2 * OKV_MMP_NR;
                for (j = 0; j < OKV_MMP_NR; j++) {
                    acc[j] += hi * okv_bf16_float(wk[2 * j + 1]);
                    acc[j] += lo * okv_bf16_float(wk[2 * j]);
                }
            }
            for (j = 0; j < w; j++) cr[j] = acc[j];
        }
}

#if OKV_X86_SIMD && OKV_HAVE_BF16

/* okv_bf16_rows_scalar with the hardware conversion (same bits). */
OKV_BF16 static void okv_bf16_rows_avx512(const float *x, int64_t M, int64_t K, uint32_t *xb) {
    const int64_t K2 = (K + 1) / 2;
    int64_t m, k;
    for (m = 0; m < M; m++) {
        uint16_t *d = (uint16_t *)(xb + m * K2);
        const float *s = x + m * K;
        for (k = 0; k + 16 <= K; k += 16)
            _mm256_storeu_si256((__m256i *)(d + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + k)));
        if (k < K) {
            const __mmask16 t = (__mmask16)((1u << (K - k)) - 1u);
            _mm256_mask_storeu_epi16(d + k, t, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(t, s + k)));
        }
        if (K & 1) d[K] = 0;
    }
}

/* okv_bf16_panels_scalar with the hardware conversion and an interleave. */
OKV_BF16 static void okv_bf16_panels_avx512(const float *wp, int64_t pstride, int np, int64_t k0, int64_t kn,
                                            int64_t K, uint16_t *wb) {
    const int64_t kn2 = (kn + 1) / 2;
    int64_t j;
    int q;
    for (q = 0; q < np; q++)
        for (j = 0; j < kn2; j++) {
            const float *l0 = wp + q * pstride + (k0 + 2 * j) * OKV_MMP_NR;
            const int odd = k0 + 2 * j + 1 < K && 2 * j + 1 < kn;
            const __m512 hi = odd ? _mm512_loadu_ps(l0 + OKV_MMP_NR) : _mm512_setzero_ps();
            _mm512_storeu_si512((void *)(wb + (q * kn2 + j) * 2 * OKV_MMP_NR), okv_bf16_pairs16(_mm512_loadu_ps(l0), hi));
        }
}

OKV_BF16 static inline __attribute__((always_inline)) void
okv_mmb_tile_avx512(const int MR, const int NP, const uint32_t *xb, int64_t ldx, const uint16_t *wb, int64_t kn2,
                    float *c, int64_t ldc, __mmask16 m, int first, const float *bias) {
    __m512 a[4][OKV_MMP_MR512];
    __m512bh w[4];
    int64_t k;
    int r, q;
    okv_mmp_acc_load512(MR, NP, a, c, ldc, m, first, bias);
    for (k = 0; k < kn2; k++) {
#pragma GCC unroll 16
        for (q = 0; q < NP; q++) w[q] = (__m512bh)_mm512_loadu_si512((const void *)(wb + (q * kn2 + k) * 32));
#pragma GCC unroll 16
        for (r = 0; r < MR; r++) {
            const __m512bh xp = (__m512bh)_mm512_set1_epi32((int)xb[r * ldx + k]);
#pragma GCC unroll 16
            for (q = 0; q < NP; q++) a[q][r] = _mm512_dpbf16_ps(a[q][r], xp, w[q]);
        }
    }
    okv_mmp_acc_store512(MR, NP, a, c, ldc, m);
}

#define OKV_MMB_T(MR)                                                                                \
    if (np == 4 && MR <= 6) okv_mmb_tile_avx512(MR, 4, xb, ldx, wb, kn2, c, ldc, m, first, bias);      \
    else if (np == 3 && MR <= 8) okv_mmb_tile_avx512(MR, 3, xb, ldx, wb, kn2, c, ldc, m, first, bias); \
    else if (np == 2) okv_mmb_tile_avx512(MR, 2, xb, ldx, wb, kn2, c, ldc, m, first, bias);            \
    else okv_mmb_tile_avx512(MR, 1, xb, ldx, wb, kn2, c, ldc, m, first, bias);                         \
    break
OKV_BF16 static void okv_mmb_tile_avx512_any(int mr, int np, const uint32_t *xb, int64_t ldx, const uint16_t *wb,
                                             int64_t kn2, float *c, int64_t ldc, int64_t nb, int first,
                                             const float *bias) {
    const __mmask16 m = (__mmask16)(np > 1 ? 0xffffu : (1u << nb) - 1u);
    switch (mr) {
    case 1: OKV_MMB_T(1);
    case 2: OKV_MMB_T(2);
    case 3: OKV_MMB_T(3);
    case 4: OKV_MMB_T(4);
    case 5: OKV_MMB_T(5);
    case 6: OKV_MMB_T(6);
    case 7: OKV_MMB_T(7);
    case 8: OKV_MMB_T(8);
    case 9: OKV_MMB_T(9);
    case 10: OKV_MMB_T(10);
    case 11: OKV_MMB_T(11);
    default: OKV_MMB_T(12);
    }
}
#undef OKV_MMB_T
#endif /* OKV_X86_SIMD && OKV_HAVE_BF16 */

/* xb from x (okv_bf16_rows_scalar) by the AVX-512-BF16 conversion when hw (the caller checked the CPU; a
 * build without it takes the portable one), else the portable one: the same bits either way. */
static void okv_bf16_rows(const float *x, int64_t M, int64_t K, uint32_t *xb, int hw) {
#if OKV_X86_SIMD && OKV_HAVE_BF16
    if (hw) {
        okv_bf16_rows_avx512(x, M, K, xb);
        return;
    }
#endif
    (void)hw;
    okv_bf16_rows_scalar(x, M, K, xb);
}

/* Floats of one thread's wb (whole float32 lines of NP panels of a k-chunk, as 16-bit halves). */
static int64_t okv_mmb_ws_halves(int64_t M, int64_t K) {
    int64_t mr, kc;
    int np;
    okv_mmp_shape(OKV_MMP_AVX512, M, K, &mr, &np, &kc);
    return (int64_t)np * ((kc + 1) / 2) * 2 * OKV_MMP_NR;
}

/* Panels [p0, p1) of out [M, N] (rows ldc apart) = the rounded product of
 * xb (okv_bf16_rows_*) and the float32 panels wp, in the tiles of the float32
 * AVX-512 kernel; wb: okv_mmb_ws_halves(M, K) halves of this thread.  hw: the
 * AVX-512-BF16 tiles (the caller checked the CPU), else the portable ones. */
static void okv_matmul_bf16_ld(const uint32_t *xb, int64_t M, int64_t K, const float *wp, int64_t N, int64_t ldc,
                               const float *bias, float *out, int64_t p0, int64_t p1, uint16_t *wb, int hw) {
    const int64_t K2 = (K + 1) / 2;
    int64_t mrt, kc, p, k0, m, n0, nb, kn, kn2;
    int npw, mr, np;
    okv_mmp_shape(OKV_MMP_AVX512, M, K, &mrt, &npw, &kc);
    if (kc < K) kc &= ~(int64_t)1; /* chunks start at whole pairs */
    for (p = p0; p < p1; p += np) {
        const float *panel = wp + p * K * OKV_MMP_NR;
        np = p + npw <= p1 && (p + npw) * OKV_MMP_NR <= N ? npw : 1;
        n0 = p * OKV_MMP_NR;
        nb = okv_mm_min(OKV_MMP_NR, N - n0);
        for (k0 = 0; k0 < K; k0 += kc) {
            kn = okv_mm_min(kc, K - k0);
            kn2 = (kn + 1) / 2;
#if OKV_X86_SIMD && OKV_HAVE_BF16
            if (hw)
                okv_bf16_panels_avx512(panel, K * OKV_MMP_NR, np, k0, kn, K, wb);
            else
#endif
            okv_bf16_panels_scalar(panel, K * OKV_MMP_NR, np, k0, kn, K, wb);
            for (m = 0; m < M; m += mr) {
                const uint32_t *xt = xb + m * K2 + k0 / 2;
                const float *bt = bias ? bias + n0 : NULL;
                float *ct = out + m * ldc + n0;
                mr = (int)okv_mm_min(mrt, M - m);
#if OKV_X86_SIMD && OKV_HAVE_BF16
                if (hw)
                    okv_mmb_tile_avx512_any(mr, np, xt, K2, wb, kn2, ct, ldc, nb, k0 == 0, bt);
                else
#endif
                okv_mmb_tile_scalar(mr, np, xt, K2, wb, kn2, ct, ldc, nb, k0 == 0, bt);
            }
        }
    }
    (void)hw;
}

typedef struct {
    const uint32_t *xb;
    const float *wp, *bias;
    float *out;
    uint16_t *wb; /* per thread: okv_mmb_ws_halves apart */
    int64_t M, K, N, ws;
    int hw;
} okv_mmb_work;

/* One thread's claims of a bf16 product (okv_claim_run): its range function. */
static void okv_mmb_work_range(void *ctx, int64_t lo, int64_t hi) {
    const okv_mmb_work *w = (const okv_mmb_work *)ctx;
    okv_matmul_bf16_ld(w->xb, w->M, w->K, w->wp, w->N, w->N, w->bias, w->out, lo, hi,
                       w->wb + (int64_t)okv_thread_num() * w->ws, w->hw);
}

#endif /* ONNXKV_MATMUL_BF16_H */
