/* onnxkv/_kernels/matmul_packed.h -- products against constant weights packed once into 16-column panels:
 * out[M,N] = x[M,K] @ w[K,N] (+ bias[N]), w held as float32 or float16 panels (float16 widened in registers,
 * F16C on the SIMD paths), float32 x, sums and out.
 */
#ifndef ONNXKV_MATMUL_PACKED_H
#define ONNXKV_MATMUL_PACKED_H

#include "matmul.h"

/* ------------------------------------------------------------------ */
/* Packed weights: wp[P][K][16], P = ceil(N / 16)                       */
/* ------------------------------------------------------------------ */
/* Panel p holds columns 16p .. 16p+15 of w; its row k is the 64-byte line
 * w[k, 16p:16p+16] (zero past column N in the last panel), so a panel is one
 * contiguous K x 64-byte block.  A register tile of rows x 16 NP columns (NP
 * adjacent panels, see okv_mmp_shape; up to OKV_MMP_MR rows with 2 YMM
 * accumulators per row and panel, or OKV_MMP_MR512 rows with one ZMM each)
 * keeps its accumulators in registers while its panels stream in order, one
 * line per k and panel, and each x value is broadcast from L1: weights are
 * read from memory once per call whatever M is, and no accumulator goes
 * through memory inside a k-chunk (the tile loops carry #pragma GCC unroll:
 * unrolled late, GCC kept the accumulator arrays on the stack and stored
 * them every k).  With more than one row tile the k range is cut into chunks
 * (the lengths okv_mmp_shape chooses per instruction set: slices kept in L1
 * or L2) for the next row tiles; out holds the partial sums between chunks.
 * Callers split the panels into contiguous ranges (one per thread), so every
 * thread streams one contiguous region; each output element is summed in the
 * same order whatever the thread count.  Scalar,
 * AVX2 and AVX-512 tiles (chosen at run time) share this structure. */
#define OKV_MMP_NR 16
#define OKV_MMP_MR 6
#define OKV_MMP_MR512 12
#define OKV_MMP_KC 256
#define OKV_MMP_KC_L2 2048
#define OKV_MMP_KC_AHEAD 64
#define OKV_MMP_PF (32 * 64) /* bytes the tiles prefetch ahead of the panel line they read */
#define OKV_MMP_KC_AVX2 1024

static inline int64_t okv_mmp_panels(int64_t N) { return (N + OKV_MMP_NR - 1) / OKV_MMP_NR; }

/* Address of element i of panels (or of a row) holding float16 (H) or float32 values. */
#define OKV_MMP_AT(wp, H, i) ((const char *)(wp) + (int64_t)(i) * ((H) ? 2 : 4))

/* Rows [k0, k1) of every panel of wp from w [K, N] (row-major), elements of esz bytes (4: float32, 2: float16;
 * zero bits are 0.0 in both).  Blocks of 16 rows are read sequentially and written as 16 consecutive lines per
 * panel. */
static void okv_mmp_pack_rows(const void *w, int64_t K, int64_t N, void *wp, int64_t k0, int64_t k1, size_t esz) {
    const int64_t P = okv_mmp_panels(N);
    int64_t kb, k, p, n0, nb;
    for (kb = k0; kb < k1; kb += 16) {
        int64_t ke = okv_mm_min(kb + 16, k1);
        for (p = 0; p < P; p++) {
            n0 = p * OKV_MMP_NR;
            nb = okv_mm_min(OKV_MMP_NR, N - n0);
            for (k = kb; k < ke; k++) {
                char *d = (char *)wp + (p * K + k) * OKV_MMP_NR * (int64_t)esz;
                memcpy(d, (const char *)w + (k * N + n0) * (int64_t)esz, (size_t)nb * esz);
                if (nb < OKV_MMP_NR) memset(d + nb * (int64_t)esz, 0, (size_t)(OKV_MMP_NR - nb) * esz);
            }
        }
    }
}

/* Element i of float16 (H) or float32 panels, as float. */
static inline __attribute__((always_inline)) float okv_mmp_w1(const int H, const void *wp, int64_t i) {
    return H ? okv_h2f_scalar(((const uint16_t *)wp)[i]) : ((const float *)wp)[i];
}

/* Scalar tile: c[r, 0:nb] (+)= x[r, 0:kn] @ panel[0:kn, 0:nb] for r < mr.
 * first: start from bias (or 0) instead of the partial sums in c. */
static inline __attribute__((always_inline)) void
okv_mmp_tile_scalar(const int H, int mr, const float *x, int64_t ldx, const void *wp, int64_t kn, float *c,
                    int64_t ldc, int64_t nb, int first, const float *bias) {
    float acc[OKV_MMP_MR][OKV_MMP_NR];
    int64_t k, j;
    int r;
    for (r = 0; r < mr; r++)
        for (j = 0; j < OKV_MMP_NR; j++)
            acc[r][j] = j >= nb ? 0.0f : (!first ? c[r * ldc + j] : (bias ? bias[j] : 0.0f));
    for (k = 0; k < kn; k++) {
        float wk[OKV_MMP_NR];
        for (j = 0; j < OKV_MMP_NR; j++) wk[j] = okv_mmp_w1(H, wp, k * OKV_MMP_NR + j);
        for (r = 0; r < mr; r++) {
            const float a = x[r * ldx + k];
            for (j = 0; j < OKV_MMP_NR; j++) acc[r][j] += a * wk[j];
        }
    }
    for (r = 0; r < mr; r++)
        for (j = 0; j < nb; j++) c[r * ldc + j] = acc[r][j];
}

#if OKV_X86_SIMD
/* Prefetch of the 64-byte line at p: into L1 (far = 0: a line the tile reads soon), or into L2 only (far:
 * a line of the next chunk, which must not evict the chunk the row tiles are reading). */
OKV_AVX2 static inline __attribute__((always_inline)) void okv_mmp_prefetch(const void *p, int far) {
    if (far) _mm_prefetch((const char *)p, _MM_HINT_T1);
    else _mm_prefetch((const char *)p, _MM_HINT_T0);
}

/* 8 weights at p (float16 if H, else float32) as floats. */
OKV_AVX2 static inline __attribute__((always_inline)) __m256 okv_mmp_w8(const int H, const char *p) {
    return H ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)) : _mm256_loadu_ps((const float *)p);
}

/* AVX2 tile, MR rows of one panel (a constant at every call site: the
 * accumulators stay in registers).  With split, one and two rows also keep a
 * second accumulator set for odd k, so enough independent FMA chains are in
 * flight to hide the FMA latency; without, every element is summed in k order
 * (the order of okv_mmp_tile_avx2_np). */
OKV_AVX2 static inline __attribute__((always_inline)) void
okv_mmp_tile_avx2(const int H, const int MR, const float *x, int64_t ldx, const void *wp, int64_t kn, float *c,
                  int64_t ldc, __m256i m0, __m256i m1, int first, const float *bias, int split, const void *pf,
                  int far) {
    __m256 a[OKV_MMP_MR][2], b[2][2];
    int64_t k = 0;
    int r;
#pragma GCC unroll 8
    for (r = 0; r < MR; r++) {
        if (!first) {
            a[r][0] = _mm256_maskload_ps(c + r * ldc, m0);
            a[r][1] = _mm256_maskload_ps(c + r * ldc + 8, m1);
        } else if (bias) {
            a[r][0] = _mm256_maskload_ps(bias, m0);
            a[r][1] = _mm256_maskload_ps(bias + 8, m1);
        } else {
            a[r][0] = a[r][1] = _mm256_setzero_ps();
        }
    }
    if (MR <= 2 && split) {
#pragma GCC unroll 8
        for (r = 0; r < MR; r++) b[r][0] = b[r][1] = _mm256_setzero_ps();
        for (; k + 2 <= kn; k += 2) {
            const char *wk = OKV_MMP_AT(wp, H, k * OKV_MMP_NR);
            const __m256 w0 = okv_mmp_w8(H, wk), w1 = okv_mmp_w8(H, OKV_MMP_AT(wk, H, 8));
            const __m256 w2 = okv_mmp_w8(H, OKV_MMP_AT(wk, H, 16)), w3 = okv_mmp_w8(H, OKV_MMP_AT(wk, H, 24));
            okv_mmp_prefetch(OKV_MMP_AT(pf, H, k * OKV_MMP_NR), far);
            okv_mmp_prefetch(OKV_MMP_AT(pf, H, (k + 1) * OKV_MMP_NR), far);
#pragma GCC unroll 8
            for (r = 0; r < MR; r++) {
                const __m256 xe = _mm256_broadcast_ss(x + r * ldx + k), xo = _mm256_broadcast_ss(x + r * ldx + k + 1);
                a[r][0] = _mm256_fmadd_ps(xe, w0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(xe, w1, a[r][1]);
                b[r][0] = _mm256_fmadd_ps(xo, w2, b[r][0]);
                b[r][1] = _mm256_fmadd_ps(xo, w3, b[r][1]);
            }
        }
#pragma GCC unroll 8
        for (r = 0; r < MR; r++) {
            a[r][0] = _mm256_add_ps(a[r][0], b[r][0]);
            a[r][1] = _mm256_add_ps(a[r][1], b[r][1]);
        }
    }
    for (; k < kn; k++) {
        const char *wk = OKV_MMP_AT(wp, H, k * OKV_MMP_NR);
        const __m256 w0 = okv_mmp_w8(H, wk), w1 = okv_mmp_w8(H, OKV_MMP_AT(wk, H, 8));
        okv_mmp_prefetch(OKV_MMP_AT(pf, H, k * OKV_MMP_NR), far);
#pragma GCC unroll 8
        for (r = 0; r < MR; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
            a[r][0] = _mm256_fmadd_ps(xb, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xb, w1, a[r][1]);
        }
    }
#pragma GCC unroll 8
    for (r = 0; r < MR; r++) {
        _mm256_maskstore_ps(c + r * ldc, m0, a[r][0]);
        _mm256_maskstore_ps(c + r * ldc + 8, m1, a[r][1]);
    }
}

/* AVX2 tile of NP full adjacent panels x MR rows (2 NP MR YMM accumulators;
 * the weight vectors feed the FMAs as memory operands), summed in k order:
 * NP sequential panel streams side by side keep more lines in flight from
 * memory than one (see okv_mmp_tile_avx512).  pstride: floats from one panel
 * to the next (K * 16). */
OKV_AVX2 static inline __attribute__((always_inline)) void
okv_mmp_tile_avx2_np(const int H, const int MR, const int NP, const float *x, int64_t ldx, const void *wp,
                     int64_t pstride, int64_t kn, float *c, int64_t ldc, int first, const float *bias, const void *pf,
                     int far) {
    __m256 a[4][3][2];
    int64_t k;
    int r, q;
#pragma GCC unroll 4
    for (q = 0; q < NP; q++)
#pragma GCC unroll 4
        for (r = 0; r < MR; r++) {
            if (!first) {
                a[q][r][0] = _mm256_loadu_ps(c + r * ldc + 16 * q);
                a[q][r][1] = _mm256_loadu_ps(c + r * ldc + 16 * q + 8);
            } else if (bias) {
                a[q][r][0] = _mm256_loadu_ps(bias + 16 * q);
                a[q][r][1] = _mm256_loadu_ps(bias + 16 * q + 8);
            } else {
                a[q][r][0] = a[q][r][1] = _mm256_setzero_ps();
            }
        }
    for (k = 0; k < kn; k++) {
        const char *wk = OKV_MMP_AT(wp, H, k * OKV_MMP_NR);
        __m256 w[4][2];
#pragma GCC unroll 4
        for (q = 0; q < NP; q++) okv_mmp_prefetch(OKV_MMP_AT(pf, H, q * pstride + k * OKV_MMP_NR), far);
        if (H) /* widened once per k and panel; float32 weights feed the FMAs as memory operands */
#pragma GCC unroll 4
            for (q = 0; q < NP; q++) {
                w[q][0] = okv_mmp_w8(H, OKV_MMP_AT(wk, H, q * pstride));
                w[q][1] = okv_mmp_w8(H, OKV_MMP_AT(wk, H, q * pstride + 8));
            }
#pragma GCC unroll 4
        for (r = 0; r < MR; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 4
            for (q = 0; q < NP; q++) {
                a[q][r][0] = _mm256_fmadd_ps(xb, H ? w[q][0] : okv_mmp_w8(H, OKV_MMP_AT(wk, H, q * pstride)),
                                             a[q][r][0]);
                a[q][r][1] = _mm256_fmadd_ps(xb, H ? w[q][1] : okv_mmp_w8(H, OKV_MMP_AT(wk, H, q * pstride + 8)),
                                             a[q][r][1]);
            }
        }
    }
#pragma GCC unroll 4
    for (q = 0; q < NP; q++)
#pragma GCC unroll 4
        for (r = 0; r < MR; r++) {
            _mm256_storeu_ps(c + r * ldc + 16 * q, a[q][r][0]);
            _mm256_storeu_ps(c + r * ldc + 16 * q + 8, a[q][r][1]);
        }
}

/* np: panels in the tile: 1 (split: see okv_mmp_tile_avx2), or the
 * okv_mmp_shape choice (4 for one row, else 2 for up to 3 rows). */
OKV_AVX2 static inline __attribute__((always_inline)) void
okv_mmp_tile_avx2_any(const int H, int mr, int np, int split, const float *x, int64_t ldx, const void *wp,
                      int64_t pstride, int64_t kn, float *c, int64_t ldc, int64_t nb, int first, const float *bias,
                      const void *pf, int far) {
    const __m256i m0 = okv_tailmask(okv_mm_min(nb, 8)), m1 = okv_tailmask(nb - 8);
    if (np == 4) {
        okv_mmp_tile_avx2_np(H, 1, 4, x, ldx, wp, pstride, kn, c, ldc, first, bias, pf, far);
        return;
    }
    if (np == 2) {
        if (mr == 1) okv_mmp_tile_avx2_np(H, 1, 2, x, ldx, wp, pstride, kn, c, ldc, first, bias, pf, far);
        else if (mr == 2) okv_mmp_tile_avx2_np(H, 2, 2, x, ldx, wp, pstride, kn, c, ldc, first, bias, pf, far);
        else okv_mmp_tile_avx2_np(H, 3, 2, x, ldx, wp, pstride, kn, c, ldc, first, bias, pf, far);
        return;
    }
    switch (mr) {
    case 1: okv_mmp_tile_avx2(H, 1, x, ldx, wp, kn, c, ldc, m0, m1, first, bias, split, pf, far); break;
    case 2: okv_mmp_tile_avx2(H, 2, x, ldx, wp, kn, c, ldc, m0, m1, first, bias, split, pf, far); break;
    case 3: okv_mmp_tile_avx2(H, 3, x, ldx, wp, kn, c, ldc, m0, m1, first, bias, split, pf, far); break;
    case 4: okv_mmp_tile_avx2(H, 4, x, ldx, wp, kn, c, ldc, m0, m1, first, bias, split, pf, far); break;
    case 5: okv_mmp_tile_avx2(H, 5, x, ldx, wp, kn, c, ldc, m0, m1, first, bias, split, pf, far); break;
    default: okv_mmp_tile_avx2(H, 6, x, ldx, wp, kn, c, ldc, m0, m1, first, bias, split, pf, far); break;
    }
}

/* AVX-512 tile: NP adjacent panels (16 NP columns) x MR rows, one ZMM
 * accumulator per row and panel (MR <= OKV_MMP_MR512, x values as embedded
 * broadcasts), summed in k order.  The NP panels are NP sequential streams
 * read side by side: more streams keep more lines in flight from memory, so
 * the product stays bound by reading the weights as MR grows (one stream per
 * tile is not: it leaves several rows slower than one).  pstride: floats from one
 * panel to the next (K * 16).  m masks the columns of the last panel (all 16
 * when NP > 1: those tiles cover full panels only). */
#define OKV_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

/* The accumulators of an MR x NP AVX-512 register tile: from the partial sums
 * in c, or (first) from bias or 0; and their store (columns of mask m). */
OKV_AVX512 static inline __attribute__((always_inline)) void
okv_mmp_acc_load512(const int MR, const int NP, __m512 a[4][OKV_MMP_MR512], const float *c, int64_t ldc,
                    __mmask16 m, int first, const float *bias) {
    int r, q;
#pragma GCC unroll 16
    for (q = 0; q < NP; q++)
#pragma GCC unroll 16
        for (r = 0; r < MR; r++)
            a[q][r] = !first ? _mm512_maskz_loadu_ps(m, c + r * ldc + 16 * q)
                             : (bias ? _mm512_maskz_loadu_ps(m, bias + 16 * q) : _mm512_setzero_ps());
}

OKV_AVX512 static inline __attribute__((always_inline)) void
okv_mmp_acc_store512(const int MR, const int NP, __m512 a[4][OKV_MMP_MR512], float *c, int64_t ldc, __mmask16 m) {
    int r, q;
#pragma GCC unroll 16
    for (q = 0; q < NP; q++)
#pragma GCC unroll 16
        for (r = 0; r < MR; r++) _mm512_mask_storeu_ps(c + r * ldc + 16 * q, m, a[q][r]);
}

OKV_AVX512 static inline __attribute__((always_inline)) void
okv_mmp_tile_avx512(const int H, const int MR, const int NP, const float *x, int64_t ldx, const void *wp,
                    int64_t pstride, int64_t kn, float *c, int64_t ldc, __mmask16 m, int first, const float *bias) {
    __m512 a[4][OKV_MMP_MR512], w[4];
    int64_t k;
    int r, q;
    okv_mmp_acc_load512(MR, NP, a, c, ldc, m, first, bias);
    for (k = 0; k < kn; k++) {
#pragma GCC unroll 16
        for (q = 0; q < NP; q++) {
            const char *wk = OKV_MMP_AT(wp, H, q * pstride + k * OKV_MMP_NR);
            w[q] = H ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)wk)) : _mm512_loadu_ps((const float *)wk);
            _mm_prefetch(wk + OKV_MMP_PF, _MM_HINT_T0);
        }
#pragma GCC unroll 16
        for (r = 0; r < MR; r++) {
            const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 16
            for (q = 0; q < NP; q++) a[q][r] = _mm512_fmadd_ps(xb, w[q], a[q][r]);
        }
    }
    okv_mmp_acc_store512(MR, NP, a, c, ldc, m);
}

/* np: panels in the tile (1, or the okv_mmp_shape choice: 4, 3 or 2). */
#define OKV_MMP_T512(MR)                                                                                   \
    if (np == 4 && MR <= 6) okv_mmp_tile_avx512(H, MR, 4, x, ldx, wp, pstride, kn, c, ldc, m, first, bias);      \
    else if (np == 3 && MR <= 8) okv_mmp_tile_avx512(H, MR, 3, x, ldx, wp, pstride, kn, c, ldc, m, first, bias); \
    else if (np == 2) okv_mmp_tile_avx512(H, MR, 2, x, ldx, wp, pstride, kn, c, ldc, m, first, bias);            \
    else okv_mmp_tile_avx512(H, MR, 1, x, ldx, wp, pstride, kn, c, ldc, m, first, bias);                         \
    break
OKV_AVX512 static inline __attribute__((always_inline)) void
okv_mmp_tile_avx512_any(const int H, int mr, int np, const float *x, int64_t ldx, const void *wp, int64_t pstride,
                        int64_t kn, float *c, int64_t ldc, int64_t nb, int first, const float *bias) {
    const __mmask16 m = (__mmask16)((1u << nb) - 1u);
    switch (mr) {
    case 1: OKV_MMP_T512(1);
    case 2: OKV_MMP_T512(2);
    case 3: OKV_MMP_T512(3);
    case 4: OKV_MMP_T512(4);
    case 5: OKV_MMP_T512(5);
    case 6: OKV_MMP_T512(6);
    case 7: OKV_MMP_T512(7);
    case 8: OKV_MMP_T512(8);
    case 9: OKV_MMP_T512(9);
    case 10: OKV_MMP_T512(10);
    case 11: OKV_MMP_T512(11);
    default: OKV_MMP_T512(12);
    }
}
#undef OKV_MMP_T512
#endif /* OKV_X86_SIMD */

/* Instruction sets of okv_matmul_packed_ld (``isa``). */
enum { OKV_MMP_SCALAR = 0, OKV_MMP_AVX2 = 1, OKV_MMP_AVX512 = 2 };

/* 1 if this build and CPU can run the AVX-512 tiles (the AVX2 ones are covered
 * by okv_simd()). */
static int okv_mmp_avx512_usable(void) {
#if OKV_X86_SIMD
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
#else
    return 0;
#endif
}

/* Tiling of an M-row product for isa: *mr rows per register tile, *np full
 * adjacent panels per tile where they fit (1 for the remaining panels), *kc
 * rows of K per chunk.  Multi-panel tiles give each thread several sequential
 * weight streams (AVX-512: NP * MR <= 24 of the 32 ZMM, so more than 12
 * rows take row tiles of 8 over 3 panels; AVX2: 2 NP MR <= 12 of the 16 YMM,
 * so 4 to 12 rows take row tiles of 2 or 3 over 2 panels).  With more than
 * one row tile, the NP panels' lines of up to OKV_MMP_KC_L2 rows of K (384
 * KiB of three panels) stay in L2 for the next row tiles, and out holds the
 * partial sums between such chunks: each row tile then runs its whole chunk
 * with its accumulators in registers (chunks of 64 lines, kept in L1, spent
 * a tenth of the time on the partial sums: 256 x 2816 x 1024 at 2 threads
 * rose from 102 to 218 GFLOP/s, the other prompt shapes from about 180 to
 * 212).  AVX2's tiles of 4 to 12 rows take short chunks (OKV_MMP_KC_AHEAD)
 * and prefetch the next chunk into L2 while they compute ("ahead" in
 * okv_matmul_packed_ld), so the first row tile no longer waits for memory
 * alone (Zen 3, weights from DRAM, in-process A/B: 0.68 to 0.93 of the time
 * of 2,048-line chunks without it).  AVX2's 6-row tiles of longer products
 * take 64 KB slices (OKV_MMP_KC_AVX2; 16 to 1,024 rows: 0.70 to 1.01, most
 * 0.84 to 0.95, of the time of 256-line chunks; prefetching ahead added nothing). */
static void okv_mmp_shape(int isa, int64_t M, int64_t K, int64_t *mr, int *np, int64_t *kc) {
    if (isa == OKV_MMP_AVX512) {
        *mr = M <= OKV_MMP_MR512 ? OKV_MMP_MR512 : 8;
        *np = M <= 6 ? 4 : (M <= 8 ? 3 : (M <= OKV_MMP_MR512 ? 2 : 3));
    } else if (isa == OKV_MMP_AVX2 && M <= 12) {
        *mr = M <= 3 ? M : (M == 4 ? 2 : 3);
        *np = M == 1 ? 4 : 2;
    } else {
        *mr = OKV_MMP_MR;
        *np = 1;
    }
    if (M <= *mr) *kc = K;
    else if (*np == 1) *kc = isa == OKV_MMP_AVX2 ? okv_mm_min(K, OKV_MMP_KC_AVX2) : OKV_MMP_KC;
    else *kc = okv_mm_min(K, isa == OKV_MMP_AVX2 ? OKV_MMP_KC_AHEAD : OKV_MMP_KC_L2);
}

/* The tile functions the drivers call: one instance per weight type (H) of the inlined tiles above. */
#define OKV_MMP_TILE_ARGS                                                                                      \
    int mr, int np, int split, const float *x, int64_t ldx, const void *wp, int64_t pstride, int64_t kn, float *c, \
        int64_t ldc, int64_t nb, int first, const float *bias, const void *pf, int far
#define OKV_MMP_TILE_PASS mr, np, split, x, ldx, wp, pstride, kn, c, ldc, nb, first, bias, pf, far
#define OKV_MMP_TILES(NAME, H)                                                                                 \
    static void okv_mmp_tiles_scalar_##NAME(OKV_MMP_TILE_ARGS) {                                              \
        (void)np, (void)split, (void)pstride, (void)pf, (void)far;                                             \
        okv_mmp_tile_scalar(H, mr, x, ldx, wp, kn, c, ldc, nb, first, bias);                                    \
    }                                                                                                          \
    OKV_MMP_TILES_SIMD(NAME, H)
#if OKV_X86_SIMD
#define OKV_MMP_TILES_SIMD(NAME, H)                                                                            \
    OKV_AVX2 static void okv_mmp_tiles_avx2_##NAME(OKV_MMP_TILE_ARGS) {                                       \
        okv_mmp_tile_avx2_any(H, OKV_MMP_TILE_PASS);                                                           \
    }                                                                                                          \
    OKV_AVX512 static void okv_mmp_tiles_avx512_##NAME(OKV_MMP_TILE_ARGS) {                                   \
        (void)split, (void)pf, (void)far;                                                                      \
        okv_mmp_tile_avx512_any(H, mr, np, x, ldx, wp, pstride, kn, c, ldc, nb, first, bias);                  \
    }
#else
#define OKV_MMP_TILES_SIMD(NAME, H)
#endif
OKV_MMP_TILES(f32, 0)
OKV_MMP_TILES(f16, 1)
#undef OKV_MMP_TILES
#undef OKV_MMP_TILES_SIMD
#undef OKV_MMP_TILE_PASS
#undef OKV_MMP_TILE_ARGS

/* Panels [p0, p1) of out [M, N] = x [M, K] @ w (+ bias), w packed as wp
 * [ceil(N/16)][K][16] of float16 (half) or float32 values; all M rows, in the
 * tiles chosen by okv_mmp_shape.  Every output element is summed in one order
 * whatever p0, p1 (each tile shape used for this M sums in k order, or none
 * has more than one panel); float16 weights are widened exactly, so a float16
 * panel gives the sums of its float32 widening.  isa: OKV_MMP_* (the caller
 * checked the CPU). */
static void okv_matmul_packed_ld(const float *x, int64_t M, int64_t K, const void *wp, int half, int64_t N,
                                 int64_t ldc, const float *bias, float *out, int64_t p0, int64_t p1, int isa) {
    int64_t mrt, kc, p, k0, m, n0, nb, kn;
    int npw, mr, np, ahead;
    okv_mmp_shape(isa, M, K, &mrt, &npw, &kc);
    ahead = isa == OKV_MMP_AVX2 && npw > 1 && M > mrt;
    for (p = p0; p < p1; p += np) {
        const char *panel = OKV_MMP_AT(wp, half, p * K * OKV_MMP_NR);
        np = p + npw <= p1 && (p + npw) * OKV_MMP_NR <= N ? npw : 1;
        n0 = p * OKV_MMP_NR;
        nb = okv_mm_min(OKV_MMP_NR, N - n0);
        for (k0 = 0; k0 < K; k0 += kc) {
            /* What the tiles prefetch, line k of the chunk fetching line k of pf: the chunk's own lines
             * OKV_MMP_PF bytes ahead, into L1; or (ahead) the next chunk's -- of these panels, else of the
             * next ones -- into L2, so that memory is read while the row tiles after the first compute
             * from the cached chunk, not only while the first waits for it. */
            const char *pf = OKV_MMP_AT(panel, half, k0 * OKV_MMP_NR) + OKV_MMP_PF;
            int far = 0;
            if (ahead && k0 + kc < K) pf = OKV_MMP_AT(panel, half, (k0 + kc) * OKV_MMP_NR), far = 1;
            else if (ahead && p + np < p1) pf = OKV_MMP_AT(panel, half, np * K * OKV_MMP_NR), far = 1;
            kn = okv_mm_min(kc, K - k0);
            for (m = 0; m < M; m += mr) {
                mr = (int)okv_mm_min(mrt, M - m);
                const float *xt = x + m * K + k0, *bt = bias ? bias + n0 : NULL;
                const char *wt = OKV_MMP_AT(panel, half, k0 * OKV_MMP_NR);
                float *ct = out + m * ldc + n0;
                /* direct calls, one site each: the compiler may inline every tile set into this loop */
#define OKV_MMP_CALL(SET) SET(mr, np, npw == 1, xt, K, wt, K * OKV_MMP_NR, kn, ct, ldc, nb, k0 == 0, bt, pf, far)
#if OKV_X86_SIMD
                if (isa == OKV_MMP_AVX512 && !half) OKV_MMP_CALL(okv_mmp_tiles_avx512_f32);
                else if (isa == OKV_MMP_AVX512) OKV_MMP_CALL(okv_mmp_tiles_avx512_f16);
                else if (isa == OKV_MMP_AVX2 && !half) OKV_MMP_CALL(okv_mmp_tiles_avx2_f32);
                else if (isa == OKV_MMP_AVX2) OKV_MMP_CALL(okv_mmp_tiles_avx2_f16);
                else
#endif
                if (!half) OKV_MMP_CALL(okv_mmp_tiles_scalar_f32);
                else OKV_MMP_CALL(okv_mmp_tiles_scalar_f16);
#undef OKV_MMP_CALL
            }
        }
    }
}

/* okv_matmul_packed_ld of float32 panels. */
static void okv_matmul_packed_f32_ld(const float *x, int64_t M, int64_t K, const float *wp, int64_t N, int64_t ldc,
                                     const float *bias, float *out, int64_t p0, int64_t p1, int isa) {
    okv_matmul_packed_ld(x, M, K, wp, 0, N, ldc, bias, out, p0, p1, isa);
}

typedef struct {
    const float *x, *bias;
    const void *wp;
    float *out;
    int64_t M, K, N;
    int isa, half;
} okv_mmp_work;

static void okv_mmp_work_range(void *ctx, int64_t lo, int64_t hi) {
    const okv_mmp_work *w = (const okv_mmp_work *)ctx;
    okv_matmul_packed_ld(w->x, w->M, w->K, w->wp, w->half, w->N, w->N, w->bias, w->out, lo, hi, w->isa);
}

/* Panels of one packed product shared by a thread team without a fixed split
 * (okv_claim_run): each output column is summed by one thread in the one
 * order of okv_matmul_packed_ld, so the result does not depend on who took
 * it.  Returns the number of panels this thread computed. */
static int64_t okv_matmul_packed_claim(const float *x, int64_t M, int64_t K, const void *wp, int half, int64_t N,
                                       const float *bias, float *out, uint64_t *ranges, int nt, int t,
                                       int64_t chunk, int isa) {
    okv_mmp_work w;
    w.x = x; w.wp = wp; w.half = half; w.bias = bias; w.out = out; w.M = M; w.K = K; w.N = N; w.isa = isa;
    return okv_claim_run(ranges, nt, t, chunk, okv_mmp_work_range, &w);
}

/* Sets up okv_matmul_packed_claim for nt threads over P panels: each thread's
 * range in ranges[8 t], and returns the panels per claim (whole multi-panel
 * tiles, about eight claims per thread's range). */
static int64_t okv_matmul_claim_setup(uint64_t *ranges, int isa, int64_t M, int64_t K, int64_t P, int nt) {
    int64_t mr, kc;
    int np;
    okv_mmp_shape(isa, M, K, &mr, &np, &kc);
    return okv_claim_setup(ranges, P, nt, np);
}

#endif /* ONNXKV_MATMUL_PACKED_H */
