/* onnxkv/_kernels/matmul.h -- decode-sized float32 matmul: out[M,N] = x[M,K] @ w[K,N] (+ bias[N]).
 *
 * Built for small M (batch x new tokens, 1..16) where the product is bound by
 * reading the weight matrix.  The caller splits N into blocks of OKV_MM_NB
 * columns (one OpenMP task each); a block function computes all M rows of its
 * columns, so every weight element is fetched from memory once per call.
 * Within a block, K is walked in chunks of OKV_MM_KC rows so the [KC x NB]
 * weight slab (32 KB) stays in L1 while the row groups of x reuse it; partial
 * sums live in registers (AVX2) and are parked in `out` between chunks.
 *
 * The AVX2+FMA path uses register tiles of MR rows x NV vectors of 8 columns
 * (1x8, 2x4, 3x4, 4x2), single-vector tiles and a masked tail vector for the
 * rest, and prefetches the weight rows OKV_MM_PF rows ahead (the row stride is
 * N*4 bytes, usually beyond the reach of the hardware stride prefetchers).
 * The scalar path has the same blocking with a plain axpy inner loop.
 */
#ifndef ONNXKV_MATMUL_H
#define ONNXKV_MATMUL_H

#include "simd.h"

#define OKV_MM_NB 64  /* columns per block (parallel task) */
#define OKV_MM_KC 128 /* k rows per L1 chunk: KC * NB * 4 = 32 KB */
#define OKV_MM_PF 8   /* weight rows prefetched ahead */

static inline int64_t okv_mm_min(int64_t a, int64_t b) { return a < b ? a : b; }

/* ------------------------------------------------------------------ */
/* Scalar path                                                          */
/* ------------------------------------------------------------------ */
static void okv_matmul_block_f32_scalar(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                                        const float *bias, float *out, int64_t n0, int64_t nb) {
    int64_t k0, k, m, j;
    for (k0 = 0; k0 < K; k0 += OKV_MM_KC) {
        const int64_t k1 = okv_mm_min(K, k0 + OKV_MM_KC);
        for (m = 0; m < M; m++) {
            float *restrict c = out + m * N + n0;
            const float *xm = x + m * K;
            if (k0 == 0) {
                if (bias) for (j = 0; j < nb; j++) c[j] = bias[n0 + j];
                else      for (j = 0; j < nb; j++) c[j] = 0.f;
            }
            for (k = k0; k < k1; k++) {
                const float a = xm[k];
                const float *restrict wr = w + k * N + n0;
                for (j = 0; j < nb; j++) c[j] += a * wr[j];
            }
        }
    }
}

/* ------------------------------------------------------------------ */
/* AVX2 + FMA path                                                      */
/* ------------------------------------------------------------------ */
#if OKV_X86_SIMD

/* One MR x NV tile over kc rows of k.  x: row 0 of the tile at the chunk's first
 * k (row stride ldx); w: weight row of the chunk's first k at the tile's first
 * column (row stride ldw); c: out at the tile origin (row stride ldc).  first:
 * start from bias (or 0) instead of c.  masked: the last vector covers only the
 * lanes of `tm`.  MR, NV are constants at every call site, so the loops unroll
 * and the accumulators stay in registers. */
OKV_AVX2 static inline __attribute__((always_inline)) void
okv_mm_tile_avx2(const int MR, const int NV, const int masked, __m256i tm, const float *x, int64_t ldx,
                 const float *w, int64_t ldw, float *c, int64_t ldc, int64_t kc, int first, const float *bias) {
    __m256 acc[4][8];
    int r, v;
    int64_t k;
    for (r = 0; r < MR; r++)
        for (v = 0; v < NV; v++) {
            const int tail = masked && v == NV - 1;
            if (first) {
                if (bias) acc[r][v] = tail ? _mm256_maskload_ps(bias + 8 * v, tm) : _mm256_loadu_ps(bias + 8 * v);
                else      acc[r][v] = _mm256_setzero_ps();
            } else {
                const float *p = c + r * ldc + 8 * v;
                acc[r][v] = tail ? _mm256_maskload_ps(p, tm) : _mm256_loadu_ps(p);
            }
        }
    for (k = 0; k < kc; k++) {
        const float *wk = w + k * ldw;
        __m256 wv[8];
        /* prefetch hint only: may point past the chunk or the matrix (never faults) */
        for (v = 0; v < NV; v += 2) _mm_prefetch((const char *)(wk + OKV_MM_PF * ldw + 8 * v), _MM_HINT_T0);
        for (v = 0; v < NV; v++)
            wv[v] = (masked && v == NV - 1) ? _mm256_maskload_ps(wk + 8 * v, tm) : _mm256_loadu_ps(wk + 8 * v);
        for (r = 0; r < MR; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
            for (v = 0; v < NV; v++) acc[r][v] = _mm256_fmadd_ps(xb, wv[v], acc[r][v]);
        }
    }
    for (r = 0; r < MR; r++)
        for (v = 0; v < NV; v++) {
            float *p = c + r * ldc + 8 * v;
            if (masked && v == NV - 1) _mm256_maskstore_ps(p, tm, acc[r][v]);
            else                       _mm256_storeu_ps(p, acc[r][v]);
        }
}

/* Columns [j, nb) of a row group of MR rows: full NV-vector tiles, then single
 * vectors, then the masked tail. */
#define OKV_MM_ROWGROUP(MR, NV)                                                                              \
    do {                                                                                                     \
        int64_t j = 0;                                                                                       \
        for (; j + 8 * (NV) <= nb; j += 8 * (NV))                                                            \
            okv_mm_tile_avx2(MR, NV, 0, tm, xg, K, wc + j, N, cg + j, N, kc, first, bias ? bias + n0 + j : 0); \
        for (; j + 8 <= nb; j += 8)                                                                          \
            okv_mm_tile_avx2(MR, 1, 0, tm, xg, K, wc + j, N, cg + j, N, kc, first, bias ? bias + n0 + j : 0);  \
        if (j < nb)                                                                                          \
            okv_mm_tile_avx2(MR, 1, 1, tm, xg, K, wc + j, N, cg + j, N, kc, first, bias ? bias + n0 + j : 0);  \
    } while (0)

OKV_AVX2 static void okv_matmul_block_f32_avx2(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                                               const float *bias, float *out, int64_t n0, int64_t nb) {
    const __m256i tm = okv_tailmask(nb & 7);
    int64_t k0, m0;
    for (k0 = 0; k0 < K; k0 += OKV_MM_KC) {
        const int64_t kc = okv_mm_min(OKV_MM_KC, K - k0);
        const int first = k0 == 0;
        const float *wc = w + k0 * N + n0;
        for (m0 = 0; m0 < M;) {
            const int64_t rest = M - m0;
            const float *xg = x + m0 * K + k0;
            float *cg = out + m0 * N + n0;
            if (rest >= 4)      { OKV_MM_ROWGROUP(4, 2); m0 += 4; }
            else if (rest == 3) { OKV_MM_ROWGROUP(3, 4); m0 += 3; }
            else if (rest == 2) { OKV_MM_ROWGROUP(2, 4); m0 += 2; }
            else                { OKV_MM_ROWGROUP(1, 8); m0 += 1; }
        }
    }
}
#undef OKV_MM_ROWGROUP

#endif /* OKV_X86_SIMD */

/* Columns [n0, n0 + nb) of out = x @ w (+ bias), all M rows.  K >= 1. */
static void okv_matmul_block_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                                 const float *bias, float *out, int64_t n0, int64_t nb, int simd) {
    OKV_DISPATCH(simd, okv_matmul_block_f32_avx2(x, M, K, w, N, bias, out, n0, nb),
                 okv_matmul_block_f32_scalar(x, M, K, w, N, bias, out, n0, nb));
}

#endif /* ONNXKV_MATMUL_H */
