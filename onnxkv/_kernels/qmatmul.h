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
 *    [-127, 127] (127 / amax not finite, amax 0 or below 127 / FLT_MAX: xs = 0,
 *    xq = 0; a NaN or inf in the block: xs = NaN, so the row's outputs are NaN),
 *    xsum = sum(xq).  Then per column, blocks in order: d = sum(xq * q) (exact
 *    int32), t = fl(d - zp * xsum) (one rounding), acc = fma(t, fl(sc * xs), acc);
 *    out = acc + bias.
 *  - float (accuracy_level 0..3): per block, d = sum_k x[k] * q[k] in k order
 *    (float FMA chain, per column), t = fl(d - zp * xsum) with xsum = sum of x
 *    over the block; where t is not finite (an inf in x, or x * q past FLT_MAX
 *    where x * (q - zp) is not), t = sum_k x[k] * fl(q[k] - zp) in k order
 *    (okv_qmm_f32_block), as x @ dequant(w) has it; acc = fma(t, sc, acc);
 *    out = acc + bias.  Codes next to their zero point under activations of a
 *    large mean lose precision to the cancellation in d - zp * xsum.
 * Rows past K in the last block are zero in x (the caller pads), so the
 * weight padding is never read into a result.
 *
 * Codebook weights (MatMulBnb4's FP4 and NF4): with lut set (16 floats; bits
 * 4, zp NULL, zconst 0) a code stands for lut[q] instead of q, so
 * w[k, n] = lut[q[n, k]] * sc[n, b], on the float paths only (d = sum x * lut[q],
 * t = d, acc = fma(t, sc, acc)).
 *
 * Paths (the SIMD ones in qmatmul_x86.h): scalar; AVX2 (8 columns, int8 by VPMADDUBSW; 8-bit weights as
 * w - 128 by the sign trick, the int16 pairs cannot saturate); AVX-VNNI (8 columns,
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
    const float *lut;    /* float path: 16 code values (4-bit codebook weights), or NULL (the code itself) */
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

/* The value code q stands for in the float paths: lut[q], or q itself. */
static inline float okv_qmm_wq(const okv_qmm *a, int q) { return a->lut ? a->lut[q] : (float)q; }

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

/* One int8 block (see the contract above): n <= bs values of xb into qb[bs]
 * (zero past n), *xs and *xsum. */
static void okv_qmm_quant_block(const float *xb, int64_t n, int64_t bs, int8_t *qb, float *xs, float *xsum) {
    int64_t k;
    float amax = 0.f;
    int bad = 0, sum = 0;
    for (k = 0; k < n; k++) {
        const float v = fabsf(xb[k]);
        bad |= !(v <= 3.4028234663852886e38f);
        amax = v > amax ? v : amax;
    }
    if (bad || !(127.f / amax <= 3.4028234663852886e38f)) { /* amax 0, or so small 127 / amax overflows */
        memset(qb, 0, (size_t)bs);
        *xs = bad ? NAN : 0.f;
        *xsum = 0.f;
        return;
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
        *xs = amax / 127.f;
        *xsum = (float)sum;
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

/* The float contract's t where d - zp * xsum is not finite: block b of lane c of panel p, row m, as
 * sum x * (q - zp) (an inf or a large x then gives what x @ dequant(w) gives). */
static float okv_qmm_f32_block(const okv_qmm *a, int64_t p, int64_t b, int c, int64_t m) {
    const float *xb = a->x + (m * a->nblk + b) * a->bs;
    const float z = okv_qmm_zp(a, p, b, c);
    float d = 0.f;
    int64_t k;
    for (k = 0; k < a->bs; k++) d = fmaf(xb[k], okv_qmm_wq(a, okv_qmm_q(a, p, b, c, k)) - z, d);
    return d;
}

/* The float contract's acc of lane c of panel p, row m (without bias). */
static float okv_qmm_f32_col(const okv_qmm *a, int64_t p, int c, int64_t m) {
    float acc = 0.f;
    int64_t b, k;
    for (b = 0; b < a->nblk; b++) {
        const float *xb = a->x + (m * a->nblk + b) * a->bs;
        float d = 0.f, t;
        for (k = 0; k < a->bs; k++) d = fmaf(xb[k], okv_qmm_wq(a, okv_qmm_q(a, p, b, c, k)), d);
        t = fmaf(-okv_qmm_zp(a, p, b, c), a->xsum[m * a->nblk + b], d);
        if (!(t - t == 0.f)) t = okv_qmm_f32_block(a, p, b, c, m);
        acc = fmaf(t, a->sc[(p * a->nblk + b) * 16 + c], acc);
    }
    return acc;
}

static void okv_qmm_f32_scalar(const okv_qmm *a, int64_t p0, int64_t p1) {
    int64_t p, m;
    int c;
    for (p = p0; p < p1; p++)
        for (c = 0; c < 16 && p * 16 + c < a->N; c++)
            for (m = 0; m < a->M; m++) okv_qmm_store_col(a, m, p * 16 + c, okv_qmm_f32_col(a, p, c, m));
}

/* Columns [n0, n1) (within N) of rows m0..m0+MR-1 by okv_qmm_f32_col: a SIMD tile's outputs again when one
 * of its blocks' t was not finite (the same arithmetic, with okv_qmm_f32_block where needed). */
static void __attribute__((noinline)) okv_qmm_f32_redo(const okv_qmm *a, int64_t n0, int64_t n1, int64_t m0, int MR) {
    int64_t n;
    int r;
    for (n = n0; n < n1 && n < a->N; n++)
        for (r = 0; r < MR; r++) okv_qmm_store_col(a, m0 + r, n, okv_qmm_f32_col(a, n / 16, (int)(n % 16), m0 + r));
}

/* Panels [p0, p1) dequantized into dst [p1 - p0][K][16] (the panel layout of
 * matmul_packed.h's float32 kernel): dst[p][k][c] = (q - zp) * sc (lut[q] * sc), zero for
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
                             ? (okv_qmm_wq(a, okv_qmm_q(a, p, b, c, k % a->bs)) - okv_qmm_zp(a, p, b, c)) *
                                   a->sc[(p * a->nblk + b) * 16 + c]
                             : 0.f;
        }
}

#include "qmatmul_x86.h"

/* The int8 blocks of x [M][K]: xq [M][nblk * bs] (zero past K), xs and xsum
 * [M][nblk], on isa (every path gives the same bytes: the SIMD blocks round
 * and clamp as okv_qmm_quant_block does, and amax and the sums are exact). */
static void okv_qmm_quant_rows(const float *x, int64_t M, int64_t K, int64_t bs, int64_t nblk, int8_t *xq,
                               float *xs, float *xsum, int isa) {
    int64_t m, b;
    for (m = 0; m < M; m++)
        for (b = 0; b < nblk; b++) {
            const float *xb = x + m * K + b * bs;
            const int64_t n = K - b * bs < bs ? K - b * bs : bs, i = m * nblk + b;
            int8_t *qb = xq + i * bs;
#if OKV_X86_SIMD
            if (isa == OKV_QMM_AVX512) { okv_qmm_quant_block_512(xb, n, bs, qb, xs + i, xsum + i); continue; }
            if (isa != OKV_QMM_SCALAR) { okv_qmm_quant_block_avx2(xb, n, bs, qb, xs + i, xsum + i); continue; }
#else
            (void)isa;
#endif
            okv_qmm_quant_block(xb, n, bs, qb, xs + i, xsum + i);
        }
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
#if OKV_HAVE_VNNI
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
