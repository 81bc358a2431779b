/* onnxkv/_kernels/qmatmul.h -- out[M,N] = x[M,K] @ dequant(w) (+ bias) with w in 4- or 8-bit blocks.
 *
 * Weights.  w is quantized along K in blocks of bs (16..256, a power of two):
 * w[k, n] = (q[n, k] - zp[n, b]) * sc[n, b] for k in block b, q unsigned
 * (0..15 or 0..255).  The caller repacks ONNX Runtime's MatMulNBits layout
 * once into panels of 16 columns (qmatmul.pyx: pack_nbits):
 *   qw [P][nblk][LB]  bytes, LB = 16 * bs * bits / 8, lines of 64 bytes;
 *     8-bit: line j holds k = 4j..4j+3 of the block: byte 4c + kk = q[c, 4j + kk];
 *     4-bit: line j holds k = 8j..8j+7: byte 4c + kk has q[c, 8j + kk] in its
 *       low nibble and q[c, 8j + 4 + kk] in its high nibble.
 *   sc [P][nblk][16] float, zp [P][nblk][16] float or NULL (then zconst).
 * One 64-byte line is thus 16 columns x 4 consecutive k: the operand layout of
 * VPDPBUSD (16 int32 lanes, each the dot of 4 u8 weights with 4 s8 activations).
 *
 * Two arithmetic contracts (the NumPy twins in reference.py follow them):
 *  - int8 (accuracy_level 4): each row's block b is quantized once per call
 *    (okv_qmm_quant_rows): xs = amax / 127, xq = rint(x * (127 / amax)) in
 *    [-127, 127] (amax 0: xs = 0, xq = 0; a NaN or inf in the block: xs = NaN,
 *    so the row's outputs are NaN), xsum = sum(xq).  Then per column, blocks in
 *    order: d = sum(xq * q) (exact int32), t = fl(d - zp * xsum) (one rounding),
 *    acc = fma(t, fl(sc * xs), acc); out = acc + bias.
 *  - float (accuracy_level 0..3): per block, d = sum_k x[k] * q[k] in k order
 *    (float FMA chain, per column), t = fl(d - zp * xsum) with xsum = sum of x
 *    over the block, acc = fma(t, sc, acc); out = acc + bias.
 * Rows past K in the last block are zero in x (the caller pads), so the
 * weight padding is never read into a result.
 *
 * Paths: scalar; AVX2 (8 columns, int8 by VPMADDUBSW; 8-bit weights split
 * into nibbles so the int16 pairs cannot saturate); AVX-VNNI (8 columns,
 * VPDPBUSD on YMM); AVX-512 VNNI (16 columns).  All sum each output in the
 * same order, so paths differ only by FMA contraction (int8: not at all).
 */
#ifndef ONNXKV_QMATMUL_H
#define ONNXKV_QMATMUL_H

#include "claim.h"
#include "simd.h"

typedef struct okv_qmm {
    int64_t M, K, N, P, nblk, bs;
    int bits;
    const uint8_t *qw;   /* [P][nblk][LB] */
    const float *sc;     /* [P][nblk][16] */
    const float *zp;     /* [P][nblk][16] or NULL */
    float zconst;        /* zero point of every block when zp is NULL */
    const float *bias;   /* [N] or NULL */
    float *out;          /* [M][N] */
    const int8_t *xq;    /* int8 path: [M][nblk * bs] */
    const float *xs;     /* int8 path: [M][nblk] */
    const float *xsum;   /* [M][nblk]: sum of xq (int8) or of x (float) per block */
    const float *x;      /* float path: [M][nblk * bs], zero past K */
} okv_qmm;

/* Instruction sets of the int8 and float kernels. */
/* AVX512: the 16-column tiles (int8 on AVX-512 VNNI, float and dequantization on AVX-512 F). */
enum { OKV_QMM_SCALAR = 0, OKV_QMM_AVX2 = 1, OKV_QMM_AVXVNNI = 2, OKV_QMM_AVX512 = 3 };

static inline int64_t okv_qmm_lb(const okv_qmm *a) { return 16 * a->bs * a->bits / 8; }

/* q of column c (0..15), element k (0..bs-1) of block b of panel p. */
static inline int okv_qmm_q(const okv_qmm *a, int64_t p, int64_t b, int c, int64_t k) {
    const uint8_t *blk = a->qw + (p * a->nblk + b) * okv_qmm_lb(a);
    if (a->bits == 8) return blk[(k >> 2) * 64 + 4 * c + (k & 3)];
    {
        const uint8_t v = blk[(k >> 3) * 64 + 4 * c + (k & 3)];
        return (k & 4) ? v >> 4 : v & 15;
    }
}

static inline float okv_qmm_zp(const okv_qmm *a, int64_t p, int64_t b, int c) {
    return a->zp ? a->zp[(p * a->nblk + b) * 16 + c] : a->zconst;
}

/* ------------------------------------------------------------------ */
/* Activations                                                          */
/* ------------------------------------------------------------------ */

/* Round to nearest, ties to even (the default rounding mode), |v| < 2^22. */
static inline float okv_qmm_rint(float v) {
    return (v + 12582912.0f) - 12582912.0f; /* 1.5 * 2^23: no -ffast-math, so this is not folded */
}

/* The int8 blocks of x [M][K] (see the contract above): xq [M][nblk * bs]
 * (zero past K), xs and xsum [M][nblk]. */
static void okv_qmm_quant_rows(const float *x, int64_t M, int64_t K, int64_t bs, int64_t nblk, int8_t *xq,
                               float *xs, float *xsum) {
    int64_t m, b, k;
    for (m = 0; m < M; m++) {
        for (b = 0; b < nblk; b++) {
            const float *xb = x + m * K + b * bs;
            int8_t *qb = xq + m * nblk * bs + b * bs;
            const int64_t n = K - b * bs < bs ? K - b * bs : bs;
            float amax = 0.f;
            int bad = 0, sum = 0;
            for (k = 0; k < n; k++) {
                const float v = fabsf(xb[k]);
                bad |= !(v <= 3.4028234663852886e38f);
                amax = v > amax ? v : amax;
            }
            if (bad || amax == 0.f) {
                memset(qb, 0, (size_t)bs);
                xs[m * nblk + b] = bad ? NAN : 0.f;
                xsum[m * nblk + b] = 0.f;
                continue;
            }
            {
                const float inv = 127.f / amax;
                for (k = 0; k < n; k++) {
                    float r = okv_qmm_rint(xb[k] * inv);
                    r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
                    qb[k] = (int8_t)r;
                    sum += (int)r;
                }
                for (; k < bs; k++) qb[k] = 0;
                xs[m * nblk + b] = amax / 127.f;
                xsum[m * nblk + b] = (float)sum;
            }
        }
    }
}

/* Float path: x copied into xp [M][nblk * bs] (zero past K) unless the caller
 * passes xp == x (K a multiple of bs), and xsum [M][nblk] = block sums in k order. */
static void okv_qmm_float_rows(const float *x, int64_t M, int64_t K, int64_t bs, int64_t nblk, float *xp,
                               float *xsum) {
    int64_t m, b, k;
    for (m = 0; m < M; m++) {
        if (xp != x) {
            memcpy(xp + m * nblk * bs, x + m * K, (size_t)K * sizeof(float));
            memset(xp + m * nblk * bs + K, 0, (size_t)(nblk * bs - K) * sizeof(float));
        }
        for (b = 0; b < nblk; b++) {
            const float *xb = xp + m * nblk * bs + b * bs;
            float s = 0.f;
            for (k = 0; k < bs; k++) s += xb[k];
            xsum[m * nblk + b] = s;
        }
    }
}

/* ------------------------------------------------------------------ */
/* Scalar kernels                                                       */
/* ------------------------------------------------------------------ */

static void okv_qmm_store_col(const okv_qmm *a, int64_t m, int64_t n, float acc) {
    a->out[m * a->N + n] = a->bias ? acc + a->bias[n] : acc;
}

static void okv_qmm_i8_scalar(const okv_qmm *a, int64_t p0, int64_t p1) {
    int64_t p, m, b, k;
    int c;
    for (p = p0; p < p1; p++)
        for (c = 0; c < 16 && p * 16 + c < a->N; c++)
            for (m = 0; m < a->M; m++) {
                float acc = 0.f;
                for (b = 0; b < a->nblk; b++) {
                    const int8_t *xb = a->xq + (m * a->nblk + b) * a->bs;
                    int32_t d = 0;
                    float t;
                    for (k = 0; k < a->bs; k++) d += (int32_t)xb[k] * okv_qmm_q(a, p, b, c, k);
                    t = fmaf(-okv_qmm_zp(a, p, b, c), a->xsum[m * a->nblk + b], (float)d);
                    acc = fmaf(t, a->sc[(p * a->nblk + b) * 16 + c] * a->xs[m * a->nblk + b], acc);
                }
                okv_qmm_store_col(a, m, p * 16 + c, acc);
            }
}

static void okv_qmm_f32_scalar(const okv_qmm *a, int64_t p0, int64_t p1) {
    int64_t p, m, b, k;
    int c;
    for (p = p0; p < p1; p++)
        for (c = 0; c < 16 && p * 16 + c < a->N; c++)
            for (m = 0; m < a->M; m++) {
                float acc = 0.f;
                for (b = 0; b < a->nblk; b++) {
                    const float *xb = a->x + (m * a->nblk + b) * a->bs;
                    float d = 0.f, t;
                    for (k = 0; k < a->bs; k++) d = fmaf(xb[k], (float)okv_qmm_q(a, p, b, c, k), d);
                    t = fmaf(-okv_qmm_zp(a, p, b, c), a->xsum[m * a->nblk + b], d);
                    acc = fmaf(t, a->sc[(p * a->nblk + b) * 16 + c], acc);
                }
                okv_qmm_store_col(a, m, p * 16 + c, acc);
            }
}

/* Panels [p0, p1) dequantized into dst [p1 - p0][K][16] (the panel layout of
 * matmul.h's packed float32 kernel): dst[p][k][c] = (q - zp) * sc, zero for
 * columns past N. */
static void okv_qmm_dequant(const okv_qmm *a, int64_t p0, int64_t p1, float *dst) {
    int64_t p, k;
    int c;
    for (p = p0; p < p1; p++)
        for (k = 0; k < a->K; k++) {
            const int64_t b = k / a->bs;
            float *row = dst + ((p - p0) * a->K + k) * 16;
            for (c = 0; c < 16; c++)
                row[c] = p * 16 + c < a->N
                             ? ((float)okv_qmm_q(a, p, b, c, k % a->bs) - okv_qmm_zp(a, p, b, c)) *
                                   a->sc[(p * a->nblk + b) * 16 + c]
                             : 0.f;
        }
}

#if OKV_X86_SIMD
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11)
#define OKV_QMM_HAVE_VNNI 1
#define OKV_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define OKV_VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#else
#define OKV_QMM_HAVE_VNNI 0
#endif

/* ------------------------------------------------------------------ */
/* 8-column paths (AVX2 and AVX-VNNI)                                   */
/* ------------------------------------------------------------------ */

static inline int32_t okv_qmm_x4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* One 8-column tile body: MR rows x NH half-panels (8 columns each; half h is
 * columns 8 (h & 1).. of panel p + (h >> 1)), int8 path.  DOT(acc, w_u8, x_s8)
 * adds the 4-way u8 x s8 dot products of every int32 lane to acc. */
#define OKV_QMM_I8_256_BODY(DOT)                                                                           \
    const int64_t LB = okv_qmm_lb(a), ldq = a->nblk * a->bs, pstride = a->nblk * LB;                               \
    const __m256i nib = _mm256_set1_epi8(0x0F);                                                                    \
    __m256 accf[2][4];                                                                                             \
    int64_t b, j;                                                                                                  \
    int r, h;                                                                                                      \
    for (r = 0; r < MR; r++)                                                                                       \
        for (h = 0; h < NH; h++) accf[r][h] = _mm256_setzero_ps();                                                 \
    for (b = 0; b < a->nblk; b++) {                                                                                \
        __m256i acc[2][4];                                                                                         \
        const uint8_t *w0 = a->qw + p * pstride + b * LB;                                                          \
        for (r = 0; r < MR; r++)                                                                                   \
            for (h = 0; h < NH; h++) acc[r][h] = _mm256_setzero_si256();                                           \
        for (j = 0; j < a->bs / 4; j += 2) {                                                                       \
            __m256i xa[2], xb[2];                                                                                  \
            for (r = 0; r < MR; r++) {                                                                             \
                const int8_t *xr = a->xq + (m0 + r) * ldq + b * a->bs + 4 * j;                                     \
                xa[r] = _mm256_set1_epi32(okv_qmm_x4(xr));                                                         \
                xb[r] = _mm256_set1_epi32(okv_qmm_x4(xr + 4));                                                     \
            }                                                                                                      \
            for (h = 0; h < NH; h++) {                                                                             \
                const uint8_t *wl = w0 + (h >> 1) * pstride + 32 * (h & 1);                                        \
                __m256i wa, wb;                                                                                    \
                if (a->bits == 4) {                                                                                \
                    const __m256i L = _mm256_loadu_si256((const __m256i *)(wl + 32 * j));                          \
                    wa = _mm256_and_si256(L, nib);                                                                 \
                    wb = _mm256_and_si256(_mm256_srli_epi16(L, 4), nib);                                           \
                } else {                                                                                           \
                    wa = _mm256_loadu_si256((const __m256i *)(wl + 64 * j));                                       \
                    wb = _mm256_loadu_si256((const __m256i *)(wl + 64 * j + 64));                                  \
                }                                                                                                  \
                for (r = 0; r < MR; r++) {                                                                         \
                    acc[r][h] = DOT(acc[r][h], wa, xa[r]);                                                         \
                    acc[r][h] = DOT(acc[r][h], wb, xb[r]);                                                         \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (h = 0; h < NH; h++) {                                                                                 \
            const int64_t o = ((p + (h >> 1)) * a->nblk + b) * 16 + 8 * (h & 1);                                  \
            const __m256 s = _mm256_loadu_ps(a->sc + o);                                                           \
            const __m256 z = a->zp ? _mm256_loadu_ps(a->zp + o) : _mm256_set1_ps(a->zconst);                       \
            for (r = 0; r < MR; r++) {                                                                             \
                const int64_t mb = (m0 + r) * a->nblk + b;                                                         \
                const __m256 t = _mm256_fnmadd_ps(z, _mm256_set1_ps(a->xsum[mb]), _mm256_cvtepi32_ps(acc[r][h]));  \
                accf[r][h] = _mm256_fmadd_ps(t, _mm256_mul_ps(s, _mm256_set1_ps(a->xs[mb])), accf[r][h]);          \
            }                                                                                                      \
        }                                                                                                          \
    }                                                                                                              \
    for (h = 0; h < NH; h++) okv_qmm_store8(a, m0, MR, p * 16 + 8 * h, accf, h);

/* Stores accf[r][h] for rows m0..m0+MR-1 at columns n0..n0+7 (fewer at N), plus bias. */
OKV_AVX2 static inline __attribute__((always_inline)) void
okv_qmm_store8(const okv_qmm *a, int64_t m0, const int MR, int64_t n0, __m256 accf[2][4], int h) {
    float tmp[8];
    int r, c;
    for (r = 0; r < MR; r++) {
        __m256 v = accf[r][h];
        if (n0 + 8 <= a->N) {
            if (a->bias) v = _mm256_add_ps(v, _mm256_loadu_ps(a->bias + n0));
            _mm256_storeu_ps(a->out + (m0 + r) * a->N + n0, v);
        } else {
            _mm256_storeu_ps(tmp, v);
            for (c = 0; n0 + c < a->N; c++) okv_qmm_store_col(a, m0 + r, n0 + c, tmp[c]);
        }
    }
}

/* VPMADDUBSW pairs into int16 (no saturation: |q x| <= 15 * 127 or, signed, 128 * 127), VPMADDWD into int32. */
#define OKV_QMM_DOT_MADDUBS(acc, w, x) \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((w), (x)), _mm256_set1_epi16(1)))
/* 8-bit weights: q = 16 hi + lo, two VPMADDUBSW on the nibbles (pairs <= 2 * 15 * 127), the high one weighted
 * 16 by VPMADDWD (a sign trick on q - 128 would overflow at q = 0 with x < 0). */
#define OKV_QMM_DOT_SPLIT(acc, w, x)                                                                               \
    _mm256_add_epi32(                                                                                          \
        _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256((w), _mm256_set1_epi8(15)), \
                                                                       (x)),                                   \
                                                  _mm256_set1_epi16(1))),                                      \
        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16((w), 4), _mm256_set1_epi8(15)),  \
                                               (x)),                                                           \
                          _mm256_set1_epi16(16)))

OKV_AVX2 static inline __attribute__((always_inline)) void
okv_qmm_i8_avx2_tile(const int MR, const int NH, const okv_qmm *a, int64_t p, int64_t m0) {
    if (a->bits == 4) {
        OKV_QMM_I8_256_BODY(OKV_QMM_DOT_MADDUBS)
    } else {
        OKV_QMM_I8_256_BODY(OKV_QMM_DOT_SPLIT)
    }
}

#if OKV_QMM_HAVE_VNNI
#define OKV_QMM_DOT_VNNI256(acc, w, x) _mm256_dpbusd_avx_epi32((acc), (w), (x))
OKV_AVXVNNI static inline __attribute__((always_inline)) void
okv_qmm_i8_avxvnni_tile(const int MR, const int NH, const okv_qmm *a, int64_t p, int64_t m0) {
    OKV_QMM_I8_256_BODY(OKV_QMM_DOT_VNNI256)
}
#endif

/* Float path, 8 columns: MR rows x NH half-panels. */
OKV_AVX2 static inline __attribute__((always_inline)) void
okv_qmm_f32_avx2_tile(const int MR, const int NH, const okv_qmm *a, int64_t p, int64_t m0) {
    const int64_t LB = okv_qmm_lb(a), ldx = a->nblk * a->bs, pstride = a->nblk * LB;
    const __m256i lowb = _mm256_set1_epi32(0xFF), nib = _mm256_set1_epi8(0x0F);
    __m256 accf[2][4];
    int64_t b, j;
    int r, h, kk;
    for (r = 0; r < MR; r++)
        for (h = 0; h < NH; h++) accf[r][h] = _mm256_setzero_ps();
    for (b = 0; b < a->nblk; b++) {
        __m256 d[2][4];
        const uint8_t *w0 = a->qw + p * pstride + b * LB;
        for (r = 0; r < MR; r++)
            for (h = 0; h < NH; h++) d[r][h] = _mm256_setzero_ps();
        for (j = 0; j < a->bs / 4; j += 2)
            for (h = 0; h < NH; h++) {
                const uint8_t *wl = w0 + (h >> 1) * pstride + 32 * (h & 1);
                __m256i w[2];
                if (a->bits == 4) {
                    const __m256i L = _mm256_loadu_si256((const __m256i *)(wl + 32 * j));
                    w[0] = _mm256_and_si256(L, nib);
                    w[1] = _mm256_and_si256(_mm256_srli_epi16(L, 4), nib);
                } else {
                    w[0] = _mm256_loadu_si256((const __m256i *)(wl + 64 * j));
                    w[1] = _mm256_loadu_si256((const __m256i *)(wl + 64 * j + 64));
                }
                for (kk = 0; kk < 8; kk++) {
                    const __m256 wf =
                        _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w[kk >> 2], 8 * (kk & 3)), lowb));
                    for (r = 0; r < MR; r++)
                        d[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(a->x[(m0 + r) * ldx + b * a->bs + 4 * j + kk]), wf,
                                                  d[r][h]);
                }
            }
        for (h = 0; h < NH; h++) {
            const int64_t o = ((p + (h >> 1)) * a->nblk + b) * 16 + 8 * (h & 1);
            const __m256 s = _mm256_loadu_ps(a->sc + o);
            const __m256 z = a->zp ? _mm256_loadu_ps(a->zp + o) : _mm256_set1_ps(a->zconst);
            for (r = 0; r < MR; r++) {
                const __m256 t = _mm256_fnmadd_ps(z, _mm256_set1_ps(a->xsum[(m0 + r) * a->nblk + b]), d[r][h]);
                accf[r][h] = _mm256_fmadd_ps(t, s, accf[r][h]);
            }
        }
    }
    for (h = 0; h < NH; h++) okv_qmm_store8(a, m0, MR, p * 16 + 8 * h, accf, h);
}

/* ------------------------------------------------------------------ */
/* 16-column path (AVX-512 VNNI)                                         */
/* ------------------------------------------------------------------ */
#if OKV_QMM_HAVE_VNNI
/* MR rows x NP panels; the low- and high-nibble (or even- and odd-line) dot
 * products go to separate accumulators so each VPDPBUSD chain is half as long.
 * 4-bit high nibbles enter masked in place, as 16 q (no shift per line; VPDPBUSD
 * does not saturate), and their sum is divided by 16 exactly once per block. */
OKV_VNNI512 static inline __attribute__((always_inline)) void
okv_qmm_i8_512_tile(const int MR, const int NP, const okv_qmm *a, int64_t p, int64_t m0) {
    const int64_t LB = okv_qmm_lb(a), ldq = a->nblk * a->bs, pstride = a->nblk * LB;
    const __m512i nib = _mm512_set1_epi8(0x0F);
    __m512 accf[4][4];
    int64_t b, j;
    int r, q;
    for (r = 0; r < MR; r++)
        for (q = 0; q < NP; q++) accf[r][q] = _mm512_setzero_ps();
    for (b = 0; b < a->nblk; b++) {
        __m512i lo[4][4], hi[4][4];
        const uint8_t *w0 = a->qw + p * pstride + b * LB;
        for (r = 0; r < MR; r++)
            for (q = 0; q < NP; q++) lo[r][q] = hi[r][q] = _mm512_setzero_si512();
        for (j = 0; j < a->bs / 4; j += 2) {
            __m512i xa[4], xb[4];
            for (r = 0; r < MR; r++) {
                const int8_t *xr = a->xq + (m0 + r) * ldq + b * a->bs + 4 * j;
                xa[r] = _mm512_set1_epi32(okv_qmm_x4(xr));
                xb[r] = _mm512_set1_epi32(okv_qmm_x4(xr + 4));
            }
            for (q = 0; q < NP; q++) {
                __m512i wa, wb;
                if (a->bits == 4) {
                    const __m512i L = _mm512_loadu_si512((const void *)(w0 + q * pstride + 32 * j));
                    wa = _mm512_and_si512(L, nib);
                    wb = _mm512_andnot_si512(nib, L); /* 16 x the high nibble: no shift (port 0) per line */
                } else {
                    wa = _mm512_loadu_si512((const void *)(w0 + q * pstride + 64 * j));
                    wb = _mm512_loadu_si512((const void *)(w0 + q * pstride + 64 * j + 64));
                }
                for (r = 0; r < MR; r++) {
                    lo[r][q] = _mm512_dpbusd_epi32(lo[r][q], wa, xa[r]);
                    hi[r][q] = _mm512_dpbusd_epi32(hi[r][q], wb, xb[r]);
                }
            }
        }
        for (q = 0; q < NP; q++) {
            const int64_t o = ((p + q) * a->nblk + b) * 16;
            const __m512 s = _mm512_loadu_ps(a->sc + o);
            const __m512 z = a->zp ? _mm512_loadu_ps(a->zp + o) : _mm512_set1_ps(a->zconst);
            for (r = 0; r < MR; r++) {
                const int64_t mb = (m0 + r) * a->nblk + b;
                const __m512 t = _mm512_fnmadd_ps(z, _mm512_set1_ps(a->xsum[mb]),
                                                  _mm512_cvtepi32_ps(_mm512_add_epi32(lo[r][q], a->bits == 4
                                                      ? _mm512_srai_epi32(hi[r][q], 4) : hi[r][q])));
                accf[r][q] = _mm512_fmadd_ps(t, _mm512_mul_ps(s, _mm512_set1_ps(a->xs[mb])), accf[r][q]);
            }
        }
    }
    for (q = 0; q < NP; q++) {
        const int64_t n0 = (p + q) * 16;
        const __mmask16 mask = n0 + 16 <= a->N ? (__mmask16)0xFFFF : (__mmask16)((1u << (a->N - n0)) - 1);
        const __m512 bv = a->bias ? _mm512_maskz_loadu_ps(mask, a->bias + n0) : _mm512_setzero_ps();
        for (r = 0; r < MR; r++)
            _mm512_mask_storeu_ps(a->out + (m0 + r) * a->N + n0, mask, _mm512_add_ps(accf[r][q], bv));
    }
}
#endif /* OKV_QMM_HAVE_VNNI */

/* Float path, 16 columns (AVX-512 F; no VNNI needed). */
OKV_AVX512BW static inline __attribute__((always_inline)) void
okv_qmm_f32_512_tile(const int MR, const int NP, const okv_qmm *a, int64_t p, int64_t m0) {
    const int64_t LB = okv_qmm_lb(a), ldx = a->nblk * a->bs, pstride = a->nblk * LB;
    const __m512i lowb = _mm512_set1_epi32(0xFF), nib = _mm512_set1_epi8(0x0F);
    __m512 accf[4][4];
    int64_t b, j;
    int r, q, kk;
    for (r = 0; r < MR; r++)
        for (q = 0; q < NP; q++) accf[r][q] = _mm512_setzero_ps();
    for (b = 0; b < a->nblk; b++) {
        __m512 d[4][4];
        const uint8_t *w0 = a->qw + p * pstride + b * LB;
        for (r = 0; r < MR; r++)
            for (q = 0; q < NP; q++) d[r][q] = _mm512_setzero_ps();
        for (j = 0; j < a->bs / 4; j += 2)
            for (q = 0; q < NP; q++) {
                __m512i w[2];
                if (a->bits == 4) {
                    const __m512i L = _mm512_loadu_si512((const void *)(w0 + q * pstride + 32 * j));
                    w[0] = _mm512_and_si512(L, nib);
                    w[1] = _mm512_and_si512(_mm512_srli_epi16(L, 4), nib);
                } else {
                    w[0] = _mm512_loadu_si512((const void *)(w0 + q * pstride + 64 * j));
                    w[1] = _mm512_loadu_si512((const void *)(w0 + q * pstride + 64 * j + 64));
                }
                for (kk = 0; kk < 8; kk++) {
                    const __m512 wf =
                        _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w[kk >> 2], 8 * (kk & 3)), lowb));
                    for (r = 0; r < MR; r++)
                        d[r][q] = _mm512_fmadd_ps(_mm512_set1_ps(a->x[(m0 + r) * ldx + b * a->bs + 4 * j + kk]), wf,
                                                  d[r][q]);
                }
            }
        for (q = 0; q < NP; q++) {
            const int64_t o = ((p + q) * a->nblk + b) * 16;
            const __m512 s = _mm512_loadu_ps(a->sc + o);
            const __m512 z = a->zp ? _mm512_loadu_ps(a->zp + o) : _mm512_set1_ps(a->zconst);
            for (r = 0; r < MR; r++) {
                const __m512 t = _mm512_fnmadd_ps(z, _mm512_set1_ps(a->xsum[(m0 + r) * a->nblk + b]), d[r][q]);
                accf[r][q] = _mm512_fmadd_ps(t, s, accf[r][q]);
            }
        }
    }
    for (q = 0; q < NP; q++) {
        const int64_t n0 = (p + q) * 16;
        const __mmask16 mask = n0 + 16 <= a->N ? (__mmask16)0xFFFF : (__mmask16)((1u << (a->N - n0)) - 1);
        const __m512 bv = a->bias ? _mm512_maskz_loadu_ps(mask, a->bias + n0) : _mm512_setzero_ps();
        for (r = 0; r < MR; r++)
            _mm512_mask_storeu_ps(a->out + (m0 + r) * a->N + n0, mask, _mm512_add_ps(accf[r][q], bv));
    }
}

/* Dequantized panel rows (okv_qmm_dequant): line by line, each k row of 16
 * (AVX-512) or 8 (AVX2) columns converted, shifted by zp and scaled at once. */
#define OKV_QMM_DEQ_BODY(VEC, W, LOADI, LOADF, SET1I, SET1F, AND, SRLI16, SRLI32, CVT, SUB, MUL, STORE)             \
    const int64_t LB = okv_qmm_lb(a), pstride = a->nblk * LB;                                                       \
    int64_t p, b, j, k;                                                                                             \
    int h, kk;                                                                                                      \
    for (p = p0; p < p1; p++)                                                                                       \
        for (b = 0; b < a->nblk; b++)                                                                               \
            for (h = 0; h < 16 / W; h++) {                                                                          \
                const int64_t o = (p * a->nblk + b) * 16 + W * h;                                                   \
                const VEC s = LOADF(a->sc + o);                                                                     \
                const VEC z = a->zp ? LOADF(a->zp + o) : SET1F(a->zconst);                                          \
                const uint8_t *wl = a->qw + p * pstride + b * LB + 4 * W * h;                                       \
                for (j = 0; j < a->bs / 4; j += 2) {                                                                \
                    VEC##i w[2];                                                                                    \
                    if (a->bits == 4) {                                                                             \
                        const VEC##i L = LOADI(wl + 32 * j);                                                        \
                        w[0] = AND(L, SET1I(0x0F0F0F0F));                                                           \
                        w[1] = AND(SRLI16(L, 4), SET1I(0x0F0F0F0F));                                                \
                    } else {                                                                                        \
                        w[0] = LOADI(wl + 64 * j);                                                                  \
                        w[1] = LOADI(wl + 64 * j + 64);                                                             \
                    }                                                                                               \
                    for (kk = 0; kk < 8; kk++) {                                                                    \
                        k = b * a->bs + 4 * j + kk;                                                                 \
                        if (k >= a->K) break;                                                                       \
                        STORE(dst + ((p - p0) * a->K + k) * 16 + W * h,                                             \
                              MUL(SUB(CVT(AND(SRLI32(w[kk >> 2], 8 * (kk & 3)), SET1I(0xFF))), z), s));             \
                    }                                                                                               \
                }                                                                                                   \
            }

OKV_AVX2 static void okv_qmm_dequant_avx2(const okv_qmm *a, int64_t p0, int64_t p1, float *dst) {
#define OKV_QMM_LDI256(ptr) _mm256_loadu_si256((const __m256i *)(ptr))
#define OKV_QMM_ST256(ptr, v) _mm256_storeu_ps((ptr), (v))
    OKV_QMM_DEQ_BODY(__m256, 8, OKV_QMM_LDI256, _mm256_loadu_ps, _mm256_set1_epi32, _mm256_set1_ps, _mm256_and_si256,
                     _mm256_srli_epi16, _mm256_srli_epi32, _mm256_cvtepi32_ps, _mm256_sub_ps, _mm256_mul_ps,
                     OKV_QMM_ST256)
}

OKV_AVX512BW static void okv_qmm_dequant_512(const okv_qmm *a, int64_t p0, int64_t p1, float *dst) {
#define OKV_QMM_LDI512(ptr) _mm512_loadu_si512((const void *)(ptr))
    OKV_QMM_DEQ_BODY(__m512, 16, OKV_QMM_LDI512, _mm512_loadu_ps, _mm512_set1_epi32, _mm512_set1_ps, _mm512_and_si512,
                     _mm512_srli_epi16, _mm512_srli_epi32, _mm512_cvtepi32_ps, _mm512_sub_ps, _mm512_mul_ps,
                     _mm512_storeu_ps)
}

/* Range drivers: panels [p0, p1), every row, in tiles of MR rows x NP panels
 * (16-column paths) or NH half-panels (8-column paths). */
#define OKV_QMM_RANGE16(TILE, a, p0, p1)                                                   \
    do {                                                                                   \
        int64_t p_, m_;                                                                    \
        for (p_ = (p0); p_ < (p1);) {                                                      \
            const int np_ = p_ + 4 <= (p1) ? 4 : 1;                                        \
            for (m_ = 0; m_ < (a)->M;) {                                                   \
                const int64_t left_ = (a)->M - m_;                                         \
                if (np_ == 4) {                                                            \
                    if (left_ >= 2) { TILE(2, 4, (a), p_, m_); m_ += 2; }                  \
                    else { TILE(1, 4, (a), p_, m_); m_ += 1; }                             \
                } else {                                                                   \
                    if (left_ >= 4) { TILE(4, 1, (a), p_, m_); m_ += 4; }                  \
                    else if (left_ >= 2) { TILE(2, 1, (a), p_, m_); m_ += 2; }             \
                    else { TILE(1, 1, (a), p_, m_); m_ += 1; }                             \
                }                                                                          \
            }                                                                              \
            p_ += np_;                                                                     \
        }                                                                                  \
    } while (0)

#define OKV_QMM_RANGE8(TILE, a, p0, p1)                                                    \
    do {                                                                                   \
        int64_t p_, m_;                                                                    \
        for (p_ = (p0); p_ < (p1);) {                                                      \
            const int two_ = p_ + 2 <= (p1);                                               \
            for (m_ = 0; m_ < (a)->M;) {                                                   \
                if (two_ && (a)->M - m_ == 1) { TILE(1, 4, (a), p_, m_); m_ += 1; }        \
                else if ((a)->M - m_ >= 2) { TILE(2, 2, (a), p_, m_); m_ += 2; }           \
                else { TILE(1, 2, (a), p_, m_); m_ += 1; }                                 \
            }                                                                              \
            p_ += two_ && (a)->M == 1 ? 2 : 1;                                             \
        }                                                                                  \
    } while (0)

OKV_AVX2 static void okv_qmm_i8_avx2(const okv_qmm *a, int64_t p0, int64_t p1) {
    OKV_QMM_RANGE8(okv_qmm_i8_avx2_tile, a, p0, p1);
}
OKV_AVX2 static void okv_qmm_f32_avx2(const okv_qmm *a, int64_t p0, int64_t p1) {
    OKV_QMM_RANGE8(okv_qmm_f32_avx2_tile, a, p0, p1);
}
OKV_AVX512BW static void okv_qmm_f32_512(const okv_qmm *a, int64_t p0, int64_t p1) {
    OKV_QMM_RANGE16(okv_qmm_f32_512_tile, a, p0, p1);
}
#if OKV_QMM_HAVE_VNNI
OKV_AVXVNNI static void okv_qmm_i8_avxvnni(const okv_qmm *a, int64_t p0, int64_t p1) {
    OKV_QMM_RANGE8(okv_qmm_i8_avxvnni_tile, a, p0, p1);
}
OKV_VNNI512 static void okv_qmm_i8_512(const okv_qmm *a, int64_t p0, int64_t p1) {
    OKV_QMM_RANGE16(okv_qmm_i8_512_tile, a, p0, p1);
}
#endif
#endif /* OKV_X86_SIMD */

/* 1 when this build and CPU run the AVX-512 VNNI path (on top of okv_cpu_avx512_ok). */
static int okv_cpu_vnni512_ok(void) {
#if OKV_X86_SIMD && OKV_QMM_HAVE_VNNI
    unsigned int a, b, c, d;
    if (!okv_cpu_avx512_ok() || __get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (c >> 11) & 1;
#else
    return 0;
#endif
}

/* 1 when this build and CPU run the AVX-VNNI (VEX) path. */
static int okv_cpu_avxvnni_ok(void) {
#if OKV_X86_SIMD && OKV_QMM_HAVE_VNNI
    unsigned int a, b, c, d;
    if (!okv_cpu_simd_ok() || __get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 1, a, b, c, d);
    return (a >> 4) & 1;
#else
    return 0;
#endif
}

/* okv_qmm_dequant on isa (the float paths' instruction set). */
static void okv_qmm_dequant_isa(const okv_qmm *a, int64_t p0, int64_t p1, float *dst, int isa) {
#if OKV_X86_SIMD
    if (isa == OKV_QMM_AVX512) { okv_qmm_dequant_512(a, p0, p1, dst); return; }
    if (isa != OKV_QMM_SCALAR) { okv_qmm_dequant_avx2(a, p0, p1, dst); return; }
#else
    (void)isa;
#endif
    okv_qmm_dequant(a, p0, p1, dst);
}

/* Panels [p0, p1) of the int8 (int8 != 0) or float product on isa (OKV_QMM_*, checked by the caller). */
static void okv_qmm_range(const okv_qmm *a, int int8, int64_t p0, int64_t p1, int isa) {
#if OKV_X86_SIMD
    if (int8) {
#if OKV_QMM_HAVE_VNNI
        if (isa == OKV_QMM_AVX512) { okv_qmm_i8_512(a, p0, p1); return; }
        if (isa == OKV_QMM_AVXVNNI) { okv_qmm_i8_avxvnni(a, p0, p1); return; }
#endif
        if (isa != OKV_QMM_SCALAR) { okv_qmm_i8_avx2(a, p0, p1); return; }
    } else {
        if (isa == OKV_QMM_AVX512) { okv_qmm_f32_512(a, p0, p1); return; }
        if (isa != OKV_QMM_SCALAR) { okv_qmm_f32_avx2(a, p0, p1); return; }
    }
#else
    (void)isa;
#endif
    if (int8) okv_qmm_i8_scalar(a, p0, p1);
    else okv_qmm_f32_scalar(a, p0, p1);
}

/* One product shared by a thread team through okv_claim_run (claim.h): the units are panels. */
typedef struct {
    const okv_qmm *a;
    int int8, isa;
} okv_qmm_work;

static void okv_qmm_work_range(void *ctx, int64_t lo, int64_t hi) {
    const okv_qmm_work *w = (const okv_qmm_work *)ctx;
    okv_qmm_range(w->a, w->int8, lo, hi, w->isa);
}

/* Thread t of nt takes its panels of the product (ranges set by okv_claim_setup over a->P panels). */
static int64_t okv_qmm_claim(const okv_qmm *a, int int8, int isa, uint64_t *ranges, int nt, int t, int64_t chunk) {
    okv_qmm_work w;
    w.a = a; w.int8 = int8; w.isa = isa;
    return okv_claim_run(ranges, nt, t, chunk, okv_qmm_work_range, &w);
}

#endif /* ONNXKV_QMATMUL_H */
