/* onnxkv/_kernels/matmul.h -- decode-sized float32 matmul: out[M,N] = x[M,K] @ w[K,N] (+ bias[N]).
 *
 * Built for small M (batch x new tokens, 1..16) where the product is bound by
 * reading the weight matrix.  The caller splits N into column segments (one
 * OpenMP task each, okv_matmul_plan); a segment function computes all M rows
 * of its columns, so every weight element is fetched from memory once per call.
 *
 * Inside a segment the weight rows are streamed in order, four at a time (four
 * sequential streams the hardware prefetchers follow), and the out segment
 * itself is the accumulator: per 8 columns, four weight vectors are loaded once
 * and FMA'd into every row of out, in groups of 4, 2 and 1 rows whose x
 * values are broadcast once per step (the compiler may keep some of the 16
 * broadcasts of a 4-row group on the stack; they then feed the FMAs as memory
 * operands).  The segment width is capped so the M out rows plus four weight
 * row slices stay in L1.  Walking whole rows avoids the large-stride column
 * walks that alias into a few L1 sets when N*4 is a multiple of 4 KB.
 *
 * The scalar path has the same structure with a plain axpy inner loop.
 */
#ifndef ONNXKV_MATMUL_H
#define ONNXKV_MATMUL_H

#include "claim.h"
#include "simd.h"

static inline int64_t okv_mm_min(int64_t a, int64_t b) { return a < b ? a : b; }

/* Segment plan: sets *width (multiple of 8, or N) and returns the number of
 * segments ceil(N / width).  With nt > 1 the segment count is a multiple of nt
 * when N allows, so a static schedule balances. */
static int64_t okv_matmul_plan(int64_t M, int64_t N, int nt, int64_t *width) {
    int64_t cap = M <= 1 ? 4096 : (M <= 4 ? 1024 : (M <= 8 ? 512 : 256));
    int64_t nseg = (N + cap - 1) / cap, w;
    if (nt > 1) nseg = ((nseg + nt - 1) / nt) * nt;
    w = (N + nseg - 1) / nseg;
    w = (w + 7) & ~(int64_t)7;
    if (w > N) w = N;
    *width = w;
    return (N + w - 1) / w;
}

static void okv_matmul_init_seg(int64_t M, int64_t N, const float *bias, float *out, int64_t n0, int64_t nb) {
    int64_t m;
    for (m = 0; m < M; m++) {
        if (bias) memcpy(out + m * N + n0, bias + n0, (size_t)nb * sizeof(float));
        else      memset(out + m * N + n0, 0, (size_t)nb * sizeof(float));
    }
}

/* ------------------------------------------------------------------ */
/* Scalar path                                                          */
/* ------------------------------------------------------------------ */
static void okv_matmul_seg_f32_scalar(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                                      const float *bias, float *out, int64_t n0, int64_t nb) {
    int64_t k, m, j;
    okv_matmul_init_seg(M, N, bias, out, n0, nb);
    for (k = 0; k < K; k++) {
        const float *restrict wr = w + k * N + n0;
        for (m = 0; m < M; m++) {
            float *restrict c = out + m * N + n0;
            const float a = x[m * K + k];
            for (j = 0; j < nb; j++) c[j] += a * wr[j];
        }
    }
}

/* ------------------------------------------------------------------ */
/* AVX2 + FMA path                                                      */
/* ------------------------------------------------------------------ */
#if OKV_X86_SIMD

/* c[r, 0:nb] += sum_{i<KS} x[r*ldx + i] * w[i*ldw + 0:nb] for r < MR.  KS, MR
 * are constants at every call site (the loops unroll, x stays in registers). */
OKV_AVX2 static inline __attribute__((always_inline)) void
okv_mm_step_avx2(const int KS, const int MR, const float *x, int64_t ldx, const float *w, int64_t ldw, float *c,
                 int64_t ldc, int64_t nb, __m256i tm) {
    __m256 xb[4][4], wv[4], acc;
    int64_t j;
    int r, i;
    for (r = 0; r < MR; r++)
        for (i = 0; i < KS; i++) xb[r][i] = _mm256_broadcast_ss(x + r * ldx + i);
    for (j = 0; j + 8 <= nb; j += 8) {
        for (i = 0; i < KS; i++) wv[i] = _mm256_loadu_ps(w + i * ldw + j);
        for (r = 0; r < MR; r++) {
            float *p = c + r * ldc + j;
            acc = _mm256_loadu_ps(p);
            for (i = 0; i < KS; i++) acc = _mm256_fmadd_ps(xb[r][i], wv[i], acc);
            _mm256_storeu_ps(p, acc);
        }
    }
    if (j < nb) {
        for (i = 0; i < KS; i++) wv[i] = _mm256_maskload_ps(w + i * ldw + j, tm);
        for (r = 0; r < MR; r++) {
            float *p = c + r * ldc + j;
            acc = _mm256_maskload_ps(p, tm);
            for (i = 0; i < KS; i++) acc = _mm256_fmadd_ps(xb[r][i], wv[i], acc);
            _mm256_maskstore_ps(p, tm, acc);
        }
    }
}

/* One row (M = 1): eight weight rows per step, so the out segment (in L1) is
 * loaded and stored once per 8 FMAs, and each of the eight row streams is
 * software-prefetched OKV_GEMV_PF bytes ahead. */
#define OKV_GEMV_PF 512
OKV_AVX2 static void okv_gemv_seg_avx2(const float *x, int64_t K, const float *w, int64_t N,
                                       float *c, int64_t nb, __m256i tm, int64_t *k_done) {
    int64_t k = 0, j;
    int i;
    for (; k + 8 <= K; k += 8) {
        const float *wk = w + k * N;
        __m256 xb[8];
        for (i = 0; i < 8; i++) xb[i] = _mm256_broadcast_ss(x + k + i);
        for (j = 0; j + 8 <= nb; j += 8) {
            __m256 acc = _mm256_loadu_ps(c + j);
            if ((j & 15) == 0)
                for (i = 0; i < 8; i++)
                    _mm_prefetch((const char *)(wk + i * N + j) + OKV_GEMV_PF, _MM_HINT_T0);
            for (i = 0; i < 8; i++) acc = _mm256_fmadd_ps(xb[i], _mm256_loadu_ps(wk + i * N + j), acc);
            _mm256_storeu_ps(c + j, acc);
        }
        if (j < nb) {
            __m256 acc = _mm256_maskload_ps(c + j, tm);
            for (i = 0; i < 8; i++) acc = _mm256_fmadd_ps(xb[i], _mm256_maskload_ps(wk + i * N + j, tm), acc);
            _mm256_maskstore_ps(c + j, tm, acc);
        }
    }
    *k_done = k;
}

OKV_AVX2 static void okv_matmul_seg_f32_avx2(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                                             const float *bias, float *out, int64_t n0, int64_t nb) {
    const __m256i tm = okv_tailmask(nb & 7);
    float *c = out + n0;
    int64_t k = 0, m;
    okv_matmul_init_seg(M, N, bias, out, n0, nb);
    if (M == 1) okv_gemv_seg_avx2(x, K, w + n0, N, c, nb, tm, &k);
    for (; k + 4 <= K; k += 4) {
        const float *wk = w + k * N + n0;
        for (m = 0; m + 4 <= M; m += 4) okv_mm_step_avx2(4, 4, x + m * K + k, K, wk, N, c + m * N, N, nb, tm);
        if (m + 2 <= M) { okv_mm_step_avx2(4, 2, x + m * K + k, K, wk, N, c + m * N, N, nb, tm); m += 2; }
        if (m < M) okv_mm_step_avx2(4, 1, x + m * K + k, K, wk, N, c + m * N, N, nb, tm);
    }
    for (; k < K; k++) {
        const float *wk = w + k * N + n0;
        for (m = 0; m + 4 <= M; m += 4) okv_mm_step_avx2(1, 4, x + m * K + k, K, wk, N, c + m * N, N, nb, tm);
        for (; m < M; m++) okv_mm_step_avx2(1, 1, x + m * K + k, K, wk, N, c + m * N, N, nb, tm);
    }
}

#endif /* OKV_X86_SIMD */

/* Columns [n0, n0 + nb) of out = x @ w (+ bias), all M rows. */
static void okv_matmul_seg_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                               const float *bias, float *out, int64_t n0, int64_t nb, int simd) {
    OKV_DISPATCH(simd, okv_matmul_seg_f32_avx2(x, M, K, w, N, bias, out, n0, nb),
                 okv_matmul_seg_f32_scalar(x, M, K, w, N, bias, out, n0, nb));
}

#endif /* ONNXKV_MATMUL_H */
