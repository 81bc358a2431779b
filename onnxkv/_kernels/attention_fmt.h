/* onnxkv/_kernels/attention_fmt.h -- the per-page-format tile dispatchers
 * of one instruction set: a quantized page's scales and zero points folded
 * into the query rows or the probabilities around the level's tiles
 * okv_qk_rows<SFX> / okv_pv_rows<SFX>, and okv_qk_fmt<SFX> / okv_pv_fmt<SFX>,
 * which pick the tiles of a page format.
 *
 * Included by attention_unit.h only, at one level (OKV_I, OKV_ATTR,
 * OKV_ILV_FMT; OKV_SIMD512 for AVX-512); compiled alone, the scalar level.
 */

#include "attention_quant.h"
#include "attention_softmax.h"
#include "attention_tiles_scalar.h"

#ifndef OKV_I /* compiled alone: the scalar level */
#define OKV_FMT_ALONE 1
#define OKV_I(name) name##_scalar
#define OKV_ATTR
#define OKV_ILV_FMT(f) 0
#endif

/* Per-channel key scales s[c] and zero points z[c] folded into the nr query
 * rows: qs[r] = qb + r*D with qs[r][c] = q[r][c] * s[c], and zc[r] = scale *
 * sum_c qs[r][c] z[c], so that scale * q.((code - z) s) = scale * qs.code -
 * zc[r]: per-channel keys are scored on their raw codes by the per-head tiles
 * (one multiply per query element and tile instead of two per key element).
 * ilv (AVX-512 only): qs[r] then in the interleaved order of 4-bit tiles. */
OKV_INLINE OKV_ATTR void OKV_I(okv_qk_chan_fold)(const float *const *qr, int nr, int64_t D, float scale,
                                                 const okv_dq *dq, float *qb, const float **qs, float *zc, int ilv) {
    float cs[OKV_Q_COMPACT_MAX_G], cz[OKV_Q_COMPACT_MAX_G];
    okv_dq cd;
    int r;
    if (dq->ce) {   /* compact header: the head's D scales and zero points, decoded here */
        OKV_I(okv_q_cdec)(dq->cS, dq->ce, dq->cz, cs, cz, D);
        cd = *dq;
        cd.s = cs;
        cd.z = cz;
        dq = &cd;
    }
    for (r = 0; r < nr; r++) {
        float *q = qb + r * D;
        OKV_I(okv_scale_mul_f32)(qr[r], 1.f, dq->s, q, D);
        qs[r] = q;
        zc[r] = scale * OKV_I(okv_dot_f32)(q, dq->z, D);
#ifdef OKV_SIMD512
        if (ilv) okv_q4_to_ilv(q, q, D);
#endif
    }
}

/* Channel-zero-point keys (dq->zo): s[r*OKV_BK + j] -= f * q_r.zo, j < n, for
 * the nr rows qr (D floats each, natural order; f = scale * s * w); zo
 * decoded into qb (D floats of scratch). */
OKV_INLINE OKV_ATTR void OKV_I(okv_qk_czp)(const float *const *qr, int nr, int64_t n, int64_t D, float f,
                                           const int8_t *zo, float *qb, float *s) {
    float zc[OKV_RG];
    int64_t c;
    int r;
    for (c = 0; c < D; c++) qb[c] = (float)zo[c];
    for (r = 0; r < nr; r++) zc[r] = f * OKV_I(okv_dot_f32)(qr[r], qb, D);
    okv_qk_sub_rows(s, nr, n, zc);
}

/* Scores of quantized keys of format fmt (arguments as okv_qk_fmt): per-channel scales (pc) folded into the
 * query rows (okv_qk_chan_fold); per-head scales score the raw codes c: scale q.((c - z) s) = (scale s) q.c -
 * (scale s z) sum(q). */
OKV_INLINE OKV_ATTR void OKV_I(okv_qk_quant)(int pc, const float *const *qr, const float *const *qi, int nr,
                                             const char *k, int64_t n, int64_t D, float scale, float *s,
                                             const okv_dq *dq, const okv_pf *pf, float *qb, const float *qsum,
                                             const int fmt) {
    if (pc) {
        const float *qs[OKV_RG] = {NULL};
        float zc[OKV_RG];
        OKV_I(okv_qk_chan_fold)(qr, nr, D, scale, dq, qb, qs, zc, OKV_ILV_FMT(fmt));
        OKV_I(okv_qk_rows)(qs, nr, k, n, D, scale, s, pf, fmt);
        okv_qk_sub_rows(s, nr, n, zc);
    } else {
        OKV_I(okv_qk_rows)(OKV_ILV_FMT(fmt) ? qi : qr, nr, k, n, D, scale * dq->s1, s, pf, fmt);
        if (dq->z1 != 0.f) okv_qk_zp(qsum, nr, n, scale * dq->s1 * dq->z1, s);
        if (dq->zo) OKV_I(okv_qk_czp)(qr, nr, n, D, scale * dq->s1 * dq->zw, dq->zo, qb, s);
    }
}

/* Probabilities times quantized values of format fmt (arguments as okv_pv_fmt): per-channel scales (pc)
 * dequantize in the load step; per-head: sum_j p_j (c_j - z) s = sum_j (s p_j) c_j - s z sum_j p_j. */
OKV_INLINE OKV_ATTR void OKV_I(okv_pv_quant)(int pc, float *p, int nr, const char *v, int64_t n, int64_t D,
                                             float *const *accr, float *const *acci, const okv_dq *dq, float *zc,
                                             const okv_pf *pf, const int fmt) {
    if (pc) {
        OKV_I(okv_pv_rows)(p, nr, v, n, D, accr, dq, pf, fmt, 1);
    } else {
        okv_pv_fold(p, nr, n, zc, dq);
        OKV_I(okv_pv_rows)(p, nr, v, n, D, OKV_ILV_FMT(fmt) ? acci : accr, dq, pf, fmt, 0);
    }
}

/* Scores of nr rows against n keys of a tile in format fmt (see okv_qk_rows);
 * pc: per-channel scales; qi: the nr q rows in the interleaved order (read
 * only if OKV_ILV_FMT(fmt) with per-head scales); qb: nr*D floats of scratch
 * (the folded rows); qsum: the sums of the nr q rows. */
OKV_ATTR static void OKV_I(okv_qk_fmt)(int fmt, int pc, const float *const *qr, const float *const *qi, int nr,
                                       const char *k, int64_t n, int64_t D, float scale, float *s, const okv_dq *dq,
                                       const okv_pf *pf, float *qb, const float *qsum) {
#define OKV_QK_CASE(F) \
    case F: OKV_I(okv_qk_quant)(pc, qr, qi, nr, k, n, D, scale, s, dq, pf, qb, qsum, F); return
    switch (fmt) {
    case OKV_FMT_F16: OKV_I(okv_qk_rows)(qr, nr, k, n, D, scale, s, pf, OKV_FMT_F16); return;
    case OKV_FMT_BF16: OKV_I(okv_qk_rows)(qr, nr, k, n, D, scale, s, pf, OKV_FMT_BF16); return;
    OKV_QK_CASE(OKV_FMT_U8); OKV_QK_CASE(OKV_FMT_I8);
    OKV_QK_CASE(OKV_FMT_U4); OKV_QK_CASE(OKV_FMT_I4);
    OKV_QK_CASE(OKV_FMT_U2); OKV_QK_CASE(OKV_FMT_I2);
    default: OKV_I(okv_qk_rows)(qr, nr, k, n, D, scale, s, pf, OKV_FMT_F32); return;
    }
#undef OKV_QK_CASE
}

/* acc rows += p * V rows of a tile in format fmt (see okv_pv_rows); with
 * per-head scales the probabilities p are scaled in place and the zero
 * point's share is added to the rows' corrections zc (see okv_pv_fold).
 * acci: the rows' accumulators in the interleaved order, taking the tile
 * instead of accr if OKV_ILV_FMT(fmt) with per-head scales.  pf (or NULL):
 * rows to software-prefetch, spread over the tile's token loop. */
OKV_ATTR static void OKV_I(okv_pv_fmt)(int fmt, int pc, float *p, int nr, const char *v, int64_t n, int64_t D,
                                       float *const *accr, float *const *acci, const okv_dq *dq, float *zc,
                                       const okv_pf *pf) {
#define OKV_PV_CASE(F) \
    case F: OKV_I(okv_pv_quant)(pc, p, nr, v, n, D, accr, acci, dq, zc, pf, F); return
    switch (fmt) {
    case OKV_FMT_F16: OKV_I(okv_pv_rows)(p, nr, v, n, D, accr, dq, pf, OKV_FMT_F16, 0); return;
    case OKV_FMT_BF16: OKV_I(okv_pv_rows)(p, nr, v, n, D, accr, dq, pf, OKV_FMT_BF16, 0); return;
    OKV_PV_CASE(OKV_FMT_U8); OKV_PV_CASE(OKV_FMT_I8);
    OKV_PV_CASE(OKV_FMT_U4); OKV_PV_CASE(OKV_FMT_I4);
    OKV_PV_CASE(OKV_FMT_U2); OKV_PV_CASE(OKV_FMT_I2);
    default: OKV_I(okv_pv_rows)(p, nr, v, n, D, accr, dq, pf, OKV_FMT_F32, 0); return;
    }
#undef OKV_PV_CASE
}

#ifdef OKV_FMT_ALONE
#undef OKV_I
#undef OKV_ATTR
#undef OKV_ILV_FMT
#undef OKV_FMT_ALONE
#endif
