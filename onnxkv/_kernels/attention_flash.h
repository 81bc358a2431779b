/* onnxkv/_kernels/attention_flash.h -- the prefill work unit of one
 * instruction set: tiled (flash) attention with the query rows in the vector
 * lanes.
 *
 * Included by attention_unit.h only, at one level (OKV_ATTR, OKV_I; OKV_SIMD512
 * for AVX-512, OKV_SIMD256 for AVX2, neither for scalar; compiled alone, the
 * scalar level).  Used for work units with several
 * query tokens over native K/V (float32, float16, bfloat16; contiguous or
 * paged, a->k_fmt == NULL) that write their output (no partial state):
 * prefill and chunked prefill.  Semantics are those of attention.h; only the
 * float32 rounding differs from the streaming unit (the scale is folded into
 * the query rows, sums run in another order).
 *
 * One KV head hk of batch b, query tokens [t0, t1): its R = G*(t1-t0) rows
 * are taken in row blocks of RB = RV*W rows (W lanes per vector, RV vectors),
 * lane i of a block being row (token t = i / G, head g = i % G): the G heads
 * of a token share its visible key range, so the lanes of a vector see
 * nearly the same keys and most tiles need no mask.  Per row block:
 *   Qt [D][RB]   the block's query rows times scale, transposed;
 *   Ot [D][RB]   the unnormalised output, transposed;
 *   m, l [RB]    the running max and sum.
 * The block streams the keys its rows see in tiles of up to OKV_BK keys that
 * never straddle a page (float16 / bfloat16 tiles converted once into float
 * rows Kf, Vf [n][D]).  Per tile:
 *   S[j][RB] = sum_d K[j][d] * Qt[d][RB]    (KJ keys x RV vectors of
 *            accumulators: one broadcast key element times RV query vectors),
 *   softcap, the visibility mask of key j per lane (only where some row of
 *   the block does not see the whole tile), the lanes' tile max, the
 *   rescale of l and Ot by exp(m_old - m_new), P = exp(S - m_new),
 *   Ot[d][RB] += sum_j V[j][d] * P[j][RB]   (DB value elements x RV vectors).
 * Every softmax step is lane-wise, across the rows of the block.  A lane that
 * met a NaN or +inf visible score is marked and its row written as NaN; a
 * row that sees no key, or whose visible scores are all -inf, gets zeros.
 */

#include <math.h>
#include <string.h>

#include "attention_kv.h"
#include "attention_softmax.h"
#include "attention_types.h"
#include "bf16_round.h"

#ifndef OKV_I   /* compiled alone: the scalar level */
#define OKV_FL_ALONE 1
#define OKV_I(name) name##_scalar
#define OKV_ATTR
#endif

#if defined(OKV_SIMD512)
typedef __m512 okv_fv;
typedef __m512i okv_iv;
#define OKV_FL_W 16
#define OKV_FL_RV 2
#define OKV_FL_KJ 8
#define OKV_FL_DB 8
#define FV_LD(p) _mm512_loadu_ps(p)
#define FV_ST(p, x) _mm512_storeu_ps(p, x)
#define FV_SET(x) _mm512_set1_ps(x)
#define FV_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define FV_MUL(a, b) _mm512_mul_ps(a, b)
#define FV_ADD(a, b) _mm512_add_ps(a, b)
#define FV_SUB(a, b) _mm512_sub_ps(a, b)
#define FV_MAX(a, b) _mm512_max_ps(a, b)
#define FV_ZERO() _mm512_setzero_ps()
#define FV_EXP(x) okv_exp512_nonpos(x, (__mmask16)0xFFFF)
#define IV_LD(p) _mm512_loadu_si512((const void *)(p))
/* lanes of s whose key j lies in [lo, hi), -inf elsewhere */
#define FV_VIS(s, j, lo, hi)                                                                                  \
    _mm512_mask_blend_ps(_mm512_cmp_epi32_mask(_mm512_set1_epi32((int)(j)), lo, _MM_CMPINT_NLT) &           \
                             _mm512_cmp_epi32_mask(_mm512_set1_epi32((int)(j)), hi, _MM_CMPINT_LT),          \
                         _mm512_set1_ps(-INFINITY), s)
/* bit per lane: NaN or +inf */
#define FV_BAD(s) \
    ((unsigned)(_mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(s, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ)))
/* bit per lane: a != 1 */
#define FV_NOT1(a) ((unsigned)_mm512_cmp_ps_mask(a, _mm512_set1_ps(1.f), _CMP_NEQ_UQ))
/* m, or 0 in the lanes where m is -inf */
#define FV_FINITE_OR0(m) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), m, \
                                              _mm512_setzero_ps())
#elif defined(OKV_SIMD256)
typedef __m256 okv_fv;
typedef __m256i okv_iv;
#define OKV_FL_W 8
#define OKV_FL_RV 2
#define OKV_FL_KJ 4
#define OKV_FL_DB 4
#define FV_LD(p) _mm256_loadu_ps(p)
#define FV_ST(p, x) _mm256_storeu_ps(p, x)
#define FV_SET(x) _mm256_set1_ps(x)
#define FV_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define FV_MUL(a, b) _mm256_mul_ps(a, b)
#define FV_ADD(a, b) _mm256_add_ps(a, b)
#define FV_SUB(a, b) _mm256_sub_ps(a, b)
#define FV_MAX(a, b) _mm256_max_ps(a, b)
#define FV_ZERO() _mm256_setzero_ps()
#define FV_EXP(x) okv_exp256(x)
#define IV_LD(p) _mm256_loadu_si256((const __m256i *)(p))
#define FV_VIS(s, j, lo, hi)                                                                                  \
    _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s,                                                          \
                     _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(lo, _mm256_set1_epi32((int)(j))), \
                                                             _mm256_cmpgt_epi32(hi, _mm256_set1_epi32((int)(j))))))
#define FV_BAD(s)                                                                                             \
    ((unsigned)_mm256_movemask_ps(                                                                            \
        _mm256_or_ps(_mm256_cmp_ps(s, s, _CMP_UNORD_Q), _mm256_cmp_ps(s, _mm256_set1_ps(INFINITY), _CMP_EQ_OQ))))
#define FV_NOT1(a) ((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(1.f), _CMP_NEQ_UQ)))
#define FV_FINITE_OR0(m) \
    _mm256_blendv_ps(m, _mm256_setzero_ps(), _mm256_cmp_ps(m, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ))
#else
typedef float okv_fv;
typedef int32_t okv_iv;
#define OKV_FL_W 1
#define OKV_FL_RV 8
#define OKV_FL_KJ 2
#define OKV_FL_DB 2
#define FV_LD(p) (*(p))
#define FV_ST(p, x) (*(p) = (x))
#define FV_SET(x) (x)
#define FV_FMA(a, b, c) ((a) * (b) + (c))
#define FV_MUL(a, b) ((a) * (b))
#define FV_ADD(a, b) ((a) + (b))
#define FV_SUB(a, b) ((a) - (b))
#define FV_MAX(a, b) ((a) > (b) ? (a) : (b))
#define FV_ZERO() 0.f
#define FV_EXP(x) expf(x)
#define IV_LD(p) (*(p))
#define FV_VIS(s, j, lo, hi) ((j) >= (lo) && (j) < (hi) ? (s) : -INFINITY)
#define FV_BAD(s) ((unsigned)((s) != (s) || (s) == INFINITY))
#define FV_NOT1(a) ((unsigned)((a) != 1.f))
#define FV_FINITE_OR0(m) ((m) == -INFINITY ? 0.f : (m))
#endif
#define OKV_FL_RB (OKV_FL_RV * OKV_FL_W)
#if OKV_FL_RB > OKV_FLASH_RB
#error "attention_flash.h: a row block wider than the workspace of okv_attn_flash_ws_floats"
#endif

/* S[kk][RB] = sum_d k[kk*ks + d] * Qt[d][RB] for KJ keys (ks floats apart). */
OKV_INLINE OKV_ATTR void OKV_I(okv_fl_qk_kj)(const float *Qt, const float *k, int64_t ks, int64_t D, float *s,
                                             const int KJ) {
    okv_fv acc[OKV_FL_KJ][OKV_FL_RV];
    int64_t d;
    int kk, v;
    for (kk = 0; kk < KJ; kk++)
        for (v = 0; v < OKV_FL_RV; v++) acc[kk][v] = FV_ZERO();
    for (d = 0; d < D; d++) {
        okv_fv q[OKV_FL_RV];
        for (v = 0; v < OKV_FL_RV; v++) q[v] = FV_LD(Qt + d * OKV_FL_RB + v * OKV_FL_W);
        for (kk = 0; kk < KJ; kk++) {
            const okv_fv kb = FV_SET(k[kk * ks + d]);
            for (v = 0; v < OKV_FL_RV; v++) acc[kk][v] = FV_FMA(kb, q[v], acc[kk][v]);
        }
    }
    for (kk = 0; kk < KJ; kk++)
        for (v = 0; v < OKV_FL_RV; v++) FV_ST(s + kk * OKV_FL_RB + v * OKV_FL_W, acc[kk][v]);
}

/* Ot[dd][RB] += sum_j v[j*vs + dd] * P[j][RB] for DB value elements. */
OKV_INLINE OKV_ATTR void OKV_I(okv_fl_pv_db)(const float *P, int64_t n, const float *vv, int64_t vs, float *Ot,
                                             const int DB) {
    okv_fv acc[OKV_FL_DB][OKV_FL_RV];
    int64_t j;
    int dd, v;
    for (dd = 0; dd < DB; dd++)
        for (v = 0; v < OKV_FL_RV; v++) acc[dd][v] = FV_LD(Ot + dd * OKV_FL_RB + v * OKV_FL_W);
    for (j = 0; j < n; j++) {
        okv_fv p[OKV_FL_RV];
        for (v = 0; v < OKV_FL_RV; v++) p[v] = FV_LD(P + j * OKV_FL_RB + v * OKV_FL_W);
        for (dd = 0; dd < DB; dd++) {
            const okv_fv vb = FV_SET(vv[j * vs + dd]);
            for (v = 0; v < OKV_FL_RV; v++) acc[dd][v] = FV_FMA(vb, p[v], acc[dd][v]);
        }
    }
    for (dd = 0; dd < DB; dd++)
        for (v = 0; v < OKV_FL_RV; v++) FV_ST(Ot + dd * OKV_FL_RB + v * OKV_FL_W, acc[dd][v]);
}

/* n rows of format fmt, rs bytes apart, as float rows dst [n][D]; rounded to bfloat16 if rnd. */
OKV_INLINE OKV_ATTR void OKV_I(okv_fl_rows)(const char *src, int64_t n, int64_t rs, int64_t D, float *dst,
                                            const int fmt, int rnd) {
    int64_t j, d;
    for (j = 0; j < n; j++) {
        const char *p = src + j * rs;
        float *o = dst + j * D;
        d = 0;
        if (fmt == OKV_FMT_F32) {
            memcpy(o, p, (size_t)D * sizeof(float));
        } else {
#if defined(OKV_SIMD512) || defined(OKV_SIMD256)
            for (; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, okv_kv_ld8(p, d, fmt, 0, NULL, NULL));
#endif
            for (; d < D; d++) o[d] = okv_kv_ld1(p, d, fmt, 0, NULL, NULL);
        }
        if (rnd && fmt != OKV_FMT_BF16)
            for (d = 0; d < D; d++) o[d] = okv_bf16_rounded(o[d]);
    }
}

/* The lanes of the row block of rows [rb0, rb0 + nr) of KV head hk (token t0 + r / G, head r % G): Qt
 * [D][RB] their query rows times scale (rounded to bfloat16 if rnd), lo / hi the key range each sees
 * (empty: 0, 0), m = -inf, l = 0.  rng: the union [0], [1] and intersection [2], [3] of the ranges. */
OKV_INLINE OKV_ATTR void OKV_I(okv_fl_lanes)(const okv_attn_args *a, int64_t b, int64_t hk, int64_t t0, int64_t rb0,
                                             int64_t nr, float *Qt, int32_t *lo, int32_t *hi, float *mv, float *lv,
                                             int64_t *rng, int rnd) {
    const int64_t D = a->D, G = a->Hq / a->Hkv, RB = OKV_FL_RB;
    const int64_t kvl = a->kv_len[b], kvs = a->kv_start ? a->kv_start[b] : 0;
    int64_t i, d;
    rng[0] = rng[3] = INT64_MAX;
    rng[1] = rng[2] = INT64_MIN;
    for (i = 0; i < RB; i++) {
        int64_t l = 0, e = 0;
        if (i < nr) {
            const int64_t r = rb0 + i, t = t0 + r / G, g = r % G, p = a->q_pos[b * a->Sq + t];
            const float *q = a->q + ((b * a->Hq + hk * G + g) * a->Sq + t) * D;
            l = kvs;
            e = p + 1;
            if (a->window >= 0 && p - a->window > l) l = p - a->window;
            if (kvl < e) e = kvl;
            if (l < e) {
                if (l < rng[0]) rng[0] = l;
                if (e > rng[1]) rng[1] = e;
                if (l > rng[2]) rng[2] = l;
                if (e < rng[3]) rng[3] = e;
            } else {
                l = e = 0;
            }
            for (d = 0; d < D; d++) Qt[d * RB + i] = rnd ? okv_bf16_rounded(a->scale * q[d]) : a->scale * q[d];
        } else {
            for (d = 0; d < D; d++) Qt[d * RB + i] = 0.f;
        }
        lo[i] = (int32_t)l;   /* 0 <= l <= e <= kv_len: int32 */
        hi[i] = (int32_t)e;
        mv[i] = -INFINITY;
        lv[i] = 0.f;
    }
}

/* The softmax step of a tile of n keys from j0 over the scores S [n][RB]: softcap, the visibility mask (if
 * mask), the NaN / +inf marks (bad), the running max m and sum l, Ot [D][RB] rescaled where the max grew;
 * S becomes the probabilities (float32; the sums l take them unrounded). */
OKV_INLINE OKV_ATTR void OKV_I(okv_fl_softmax)(const okv_attn_args *a, float *S, int64_t n, int64_t j0, int mask,
                                               const int32_t *lo, const int32_t *hi, float *mv, float *lv,
                                               float *Ot, unsigned *bad) {
    enum { RB = OKV_FL_RB, W = OKV_FL_W, RV = OKV_FL_RV };
    const int64_t D = a->D;
    okv_fv mt[RV], mu[RV], ls[RV];
    int64_t i, j, d;
    int v;
    if (a->softcap > 0.f)
        for (i = 0; i < n * RB; i++) S[i] = a->softcap * tanhf(S[i] / a->softcap);
    /* mask, marks, tile max */
    for (v = 0; v < RV; v++) mt[v] = FV_SET(-INFINITY);
    for (j = 0; j < n; j++)
        for (v = 0; v < RV; v++) {
            okv_fv s = FV_LD(S + j * RB + v * W);
            if (mask) {
                const okv_iv lov = IV_LD(lo + v * W), hiv = IV_LD(hi + v * W);
                s = FV_VIS(s, j0 + j, lov, hiv);
                FV_ST(S + j * RB + v * W, s);
            }
            bad[v] |= FV_BAD(s);
            mt[v] = FV_MAX(mt[v], s);
        }
    /* running max: rescale l and Ot where it grew */
    for (v = 0; v < RV; v++) {
        const okv_fv mo = FV_LD(mv + v * W), mn = FV_MAX(mo, mt[v]);
        const okv_fv alpha = FV_EXP(FV_SUB(mo, FV_FINITE_OR0(mn)));
        mu[v] = FV_FINITE_OR0(mn);
        FV_ST(mv + v * W, mn);
        FV_ST(lv + v * W, FV_MUL(FV_LD(lv + v * W), alpha));
        if (FV_NOT1(alpha))
            for (d = 0; d < D; d++) FV_ST(Ot + d * RB + v * W, FV_MUL(FV_LD(Ot + d * RB + v * W), alpha));
        ls[v] = FV_ZERO();
    }
    /* probabilities, their sums */
    for (j = 0; j < n; j++)
        for (v = 0; v < RV; v++) {
            const okv_fv p = FV_EXP(FV_SUB(FV_LD(S + j * RB + v * W), mu[v]));
            FV_ST(S + j * RB + v * W, p);
            ls[v] = FV_ADD(ls[v], p);
        }
    for (v = 0; v < RV; v++) FV_ST(lv + v * W, FV_ADD(FV_LD(lv + v * W), ls[v]));
}

/* A key a lane does not see adds nothing to it, not even 0 * NaN (attention.h).  In a masked tile (keys [j0,
 * j0 + n), not every lane seeing each), an element of its value rows (n rows of format fmt at v, vst bytes
 * apart; rounded to bfloat16 if rnd) that is NaN or infinite, at a key outside the intersection [rng[2],
 * rng[3]) of the lanes' ranges, is added here to the lanes that see that key (Ot[d][i] += p * v, p from S,
 * rounded if rnd); the caller then leaves it out of the tile's product.  Returns how many
 * such elements there are (none in all but hostile or overflowing inputs). */
OKV_INLINE OKV_ATTR int64_t OKV_I(okv_fl_vpartial)(const char *v, int64_t vst, const int fmt, int rnd, int64_t n,
                                                   int64_t j0, int64_t D, const int64_t *rng, const float *S,
                                                   const int32_t *lo, const int32_t *hi, float *Ot) {
    enum { RB = OKV_FL_RB };
    int64_t j, d, i, found = 0;
    for (j = 0; j < n; j++) {
        const int64_t key = j0 + j;
        if (key >= rng[2] && key < rng[3]) continue; /* every lane sees it */
        for (d = 0; d < D; d++) {
            float x = okv_kv_ld1(v + j * vst, d, fmt, 0, NULL, NULL);
            if (rnd) x = okv_bf16_rounded(x);
            if (isfinite(x)) continue;
            found++;
            for (i = 0; i < RB; i++)
                if (lo[i] <= key && key < hi[i])
                    Ot[d * RB + i] += (rnd ? okv_bf16_rounded(S[j * RB + i]) : S[j * RB + i]) * x;
        }
    }
    return found;
}

/* The rows [rb0, rb0 + nr) of KV head hk normalised into out: NaN rows where marked, zeros where no key
 * is visible or the sum is 0. */
OKV_INLINE OKV_ATTR void OKV_I(okv_fl_out)(const okv_attn_args *a, int64_t b, int64_t hk, int64_t t0, int64_t rb0,
                                           int64_t nr, const float *Ot, const float *lv, const int32_t *lo,
                                           const int32_t *hi, const unsigned *bad) {
    const int64_t D = a->D, G = a->Hq / a->Hkv, RB = OKV_FL_RB, W = OKV_FL_W;
    int64_t i, d;
    for (i = 0; i < nr; i++) {
        const int64_t r = rb0 + i, t = t0 + r / G, g = r % G;
        float *o = a->out + ((b * a->Hq + hk * G + g) * a->Sq + t) * D;
        if (lo[i] < hi[i] && ((bad[i / W] >> (i % W)) & 1u)) {
            for (d = 0; d < D; d++) o[d] = NAN;
        } else if (lo[i] >= hi[i] || lv[i] == 0.f) {
            memset(o, 0, (size_t)D * sizeof(float));
        } else {
            const float inv = 1.f / lv[i];
            for (d = 0; d < D; d++) o[d] = Ot[d * RB + i] * inv;
        }
    }
}

/* The prefill unit of one KV head (see the top of this file) for K/V elements of format fmt (a constant:
 * OKV_FMT_F32, F16 or BF16).  a->bf16: the query rows (times scale), keys, probabilities and values are
 * rounded to bfloat16 before their products, which sum in float32 (the portable twin of
 * attention_flash_bf16.h). */
OKV_INLINE OKV_ATTR void OKV_I(okv_fl_head)(const okv_attn_args *a, int64_t b, int64_t hk, int64_t t0, int64_t t1,
                                            float *ws, const int fmt) {
    enum { RB = OKV_FL_RB, RV = OKV_FL_RV };
    const int64_t D = a->D, R = a->Hq / a->Hkv * (t1 - t0);
    const size_t esz = fmt == OKV_FMT_F32 ? 4 : 2;
    const int rnd = a->bf16;
    float *Qt = ws, *Ot = Qt + D * RB, *S = Ot + D * RB, *Kf = S + OKV_BK * RB, *Vf = Kf + OKV_BK * D;
    float *mv = Vf + OKV_BK * D, *lv = mv + RB;
    int32_t *lo = (int32_t *)(lv + RB), *hi = lo + RB;
    int64_t rb0, i, j, d;
    int v;
    for (rb0 = 0; rb0 < R; rb0 += RB) {
        const int64_t nr = R - rb0 < RB ? R - rb0 : RB;
        int64_t rng[4], j0, j1;
        unsigned bad[RV];
        okv_kv_page pg;
        OKV_I(okv_fl_lanes)(a, b, hk, t0, rb0, nr, Qt, lo, hi, mv, lv, rng, rnd);
        memset(Ot, 0, (size_t)(D * RB) * sizeof(float));
        for (v = 0; v < RV; v++) bad[v] = 0;
        pg.start = pg.end = INT64_MIN;
        /* keys no lane sees are skipped whole: their pages may be absent (page id -1) */
        for (j0 = okv_next_seen32(lo, hi, RB, rng[0]); j0 < rng[1]; j0 = okv_next_seen32(lo, hi, RB, j1)) {
            const float *kf, *vf;
            int64_t ks, vs, n;
            int mask;
            if (j0 >= pg.end || j0 < pg.start) pg = okv_attn_page(a, b, hk, j0, esz);
            j1 = j0 + OKV_BK;
            if (j1 > pg.end) j1 = pg.end;
            if (j1 > rng[1]) j1 = rng[1];
            n = j1 - j0;
            if (fmt == OKV_FMT_F32 && !rnd) {
                kf = (const float *)(pg.k + (j0 - pg.start) * pg.kst);
                vf = (const float *)(pg.v + (j0 - pg.start) * pg.vst);
                ks = pg.kst / 4;
                vs = pg.vst / 4;
            } else {
                OKV_I(okv_fl_rows)(pg.k + (j0 - pg.start) * pg.kst, n, pg.kst, D, Kf, fmt, rnd);
                OKV_I(okv_fl_rows)(pg.v + (j0 - pg.start) * pg.vst, n, pg.vst, D, Vf, fmt, rnd);
                kf = Kf;
                vf = Vf;
                ks = vs = D;
            }
            /* scores */
            for (j = 0; j + OKV_FL_KJ <= n; j += OKV_FL_KJ)
                OKV_I(okv_fl_qk_kj)(Qt, kf + j * ks, ks, D, S + j * RB, OKV_FL_KJ);
            for (; j < n; j++) OKV_I(okv_fl_qk_kj)(Qt, kf + j * ks, ks, D, S + j * RB, 1);
            /* some row of the block does not see every key: mask */
            mask = !(j0 >= rng[2] && j1 <= rng[3]);
            OKV_I(okv_fl_softmax)(a, S, n, j0, mask, lo, hi, mv, lv, Ot, bad);
            if (rnd)
                for (i = 0; i < n * RB; i++) S[i] = okv_bf16_rounded(S[i]);
            if (mask && OKV_I(okv_fl_vpartial)(pg.v + (j0 - pg.start) * pg.vst, pg.vst, fmt, rnd, n, j0, D, rng, S,
                                               lo, hi, Ot)) {
                /* those values, added to the lanes that see them, left out of the product: as zeros in a
                 * float copy of the tile */
                if (vf != Vf) {
                    for (j = 0; j < n; j++) memcpy(Vf + j * D, vf + j * vs, (size_t)D * sizeof(float));
                    vf = Vf;
                    vs = D;
                }
                for (j = 0; j < n; j++)
                    if (!(j0 + j >= rng[2] && j0 + j < rng[3]))
                        for (d = 0; d < D; d++)
                            if (!isfinite(Vf[j * D + d])) Vf[j * D + d] = 0.f;
            }
            /* values */
            for (d = 0; d + OKV_FL_DB <= D; d += OKV_FL_DB)
                OKV_I(okv_fl_pv_db)(S, n, vf + d, vs, Ot + d * RB, OKV_FL_DB);
            for (; d < D; d++) OKV_I(okv_fl_pv_db)(S, n, vf + d, vs, Ot + d * RB, 1);
        }
        OKV_I(okv_fl_out)(a, b, hk, t0, rb0, nr, Ot, lv, lo, hi, bad);
    }
}

#if defined(OKV_SIMD512) && OKV_HAVE_BF16
/* The bfloat16 prefill units (a->bf16) of this level: attention_flash_bf16.h, which attention_unit.h
 * includes after this file. */
#define OKV_FLASH_BF16_DECL(name)                                                                      \
    OKV_NOINLINE OKV_BF16 static void name(const okv_attn_args *a, int64_t b, int64_t hk0, int64_t nh, \
                                           int64_t t0, int64_t t1, float *ws);
OKV_FLASH_BF16_DECL(okv_attn_flashb_f32)
OKV_FLASH_BF16_DECL(okv_attn_flashb_f16)
OKV_FLASH_BF16_DECL(okv_attn_flashb_bf16)
#undef OKV_FLASH_BF16_DECL
#endif

/* The prefill unit of KV heads [hk0, hk0 + nh), query tokens [t0, t1) (every key the tokens see), for native
 * K/V (a->kv_type); ws: okv_attn_flash_ws_floats(a->D) floats. */
#define OKV_FLASH_UNIT(name, fmt)                                                                            \
    OKV_NOINLINE OKV_ATTR static void OKV_I(name)(const okv_attn_args *a, int64_t b, int64_t hk0, int64_t nh, \
                                                  int64_t t0, int64_t t1, float *ws) {                       \
        int64_t h;                                                                                           \
        for (h = 0; h < nh; h++) OKV_I(okv_fl_head)(a, b, hk0 + h, t0, t1, ws, fmt);                         \
    }
OKV_FLASH_UNIT(okv_attn_flash_f32, OKV_FMT_F32)
OKV_FLASH_UNIT(okv_attn_flash_f16, OKV_FMT_F16)
OKV_FLASH_UNIT(okv_attn_flash_bf16, OKV_FMT_BF16)
#undef OKV_FLASH_UNIT

OKV_ATTR void OKV_I(okv_attn_unit_flash)(const okv_attn_args *a, int64_t b, int64_t hk0, int64_t nh, int64_t t0,
                                         int64_t t1, float *ws) {
#if defined(OKV_SIMD512) && OKV_HAVE_BF16
    if (a->bf16) { /* the setting is on only where the CPU has AVX-512-BF16 */
        if (a->kv_type == OKV_KV_F16) okv_attn_flashb_f16(a, b, hk0, nh, t0, t1, ws);
        else if (a->kv_type == OKV_KV_BF16) okv_attn_flashb_bf16(a, b, hk0, nh, t0, t1, ws);
        else okv_attn_flashb_f32(a, b, hk0, nh, t0, t1, ws);
        return;
    }
#endif
    if (a->kv_type == OKV_KV_F16) OKV_I(okv_attn_flash_f16)(a, b, hk0, nh, t0, t1, ws);
    else if (a->kv_type == OKV_KV_BF16) OKV_I(okv_attn_flash_bf16)(a, b, hk0, nh, t0, t1, ws);
    else OKV_I(okv_attn_flash_f32)(a, b, hk0, nh, t0, t1, ws);
}

#undef OKV_FL_RB
#undef OKV_FL_W
#undef OKV_FL_RV
#undef OKV_FL_KJ
#undef OKV_FL_DB
#undef FV_LD
#undef FV_ST
#undef FV_SET
#undef FV_FMA
#undef FV_MUL
#undef FV_ADD
#undef FV_SUB
#undef FV_MAX
#undef FV_ZERO
#undef FV_EXP
#undef IV_LD
#undef FV_VIS
#undef FV_BAD
#undef FV_NOT1
#undef FV_FINITE_OR0
#ifdef OKV_FL_ALONE
#undef OKV_I
#undef OKV_ATTR
#undef OKV_FL_ALONE
#endif
