/* onnxkv/_kernels/attention_quant.h -- per-page formats for the paged attention
 * kernel: page layout helpers, per-format tile loaders, and the work unit that
 * dispatches each tile to the loader of its page's format.
 *
 * Included by attention.h once per instruction set (OKV_SFX, OKV_ATTR, and
 * OKV_SIMD_BODY or OKV_SIMD512 set); the first part is compiled once.
 *
 * Page layout (the shared contract with the quantize kernels): a float page
 * (float32 / float16 / bfloat16) is [H, bs, D] elements, head-major.  A
 * quantized page is a header -- float32 scale[H*G] then float32
 * zero_point[H*G] (index h*G + g), zero-padded to a multiple of 64 bytes --
 * followed by the codes: for head h, token t, D codes packed low bits first
 * into D*bits/8 bytes (signed codes two's complement in their width); head h's
 * codes start at header + h*bs*D*bits/8.  Element (h, t, c) is
 * (code - zero_point[h*G + g]) * scale[h*G + g], g = 0 (G = 1, per-head) or c
 * (G = D, per-channel).  K pages may instead carry the compact header of
 * quant.h (a->k_compact): float32 S[H], uint8 e[H*G], uint8 zc[H*G], zero
 * padded to a multiple of 64 bytes, then the same codes; okv_dq_head and
 * okv_qk_chan_fold decode a head's entries (okv_q_compact_decode) where the
 * float32 header's would be read.  Or the channel-zero-point header of
 * quant.h (a->k_czp): float32 s[H], float32 w[H], int8 o[H*D], zero padded to
 * a multiple of 64 bytes, then the same codes; element (h, t, c) is (code -
 * z0 - w[h] o[h*D + c]) * s[h]: keys are scored by the per-head tiles (scale
 * s[h], zero point z0) and the zero points' share, s[h] w[h] q.o per query
 * row and page, is subtracted from the scores (okv_qk_czp; on AMX, 8-bit
 * codes: one more tile product per chunk, okv_amx_qk).
 *
 * Loaders: the code readers of quant.h (okv_q_get, okv_q_load8: 8-bit codes by
 * sign/zero extension, 4- and 2-bit codes by one broadcast word and per-lane
 * variable shifts, converted to float; okv_q_load16_ps: 16 lanes, 4- and
 * 2-bit codes by a table lookup) for a constant format.
 * Per-channel value scales and zero points are applied by the loader macros
 * of the tile instantiation (attention_qfmt.h), in registers; per-channel key
 * scales are folded into the query rows once per tile (okv_qk_chan_fold; on
 * AMX, 8-bit keys: okv_amx_build_pc), so keys are scored on their raw codes;
 * a per-head scale and zero point are folded into the scores and the
 * probabilities (okv_qk_zp, okv_pv_fold).
 *
 * AVX-512, 4-bit pages: the raw-code tiles read each 16-element chunk of a row
 * in quant.h's interleaved lane order OKV_Q4_ILV (one vector operation per 16
 * codes fewer than the natural order).  A dot product does not depend on the
 * order, so keys are scored against query rows interleaved the same way
 * (okv_q4_to_ilv, once per work unit; per-channel key scales: the folded rows,
 * once per tile); values with per-head scales accumulate into a second set of
 * accumulator rows in that order, added to the natural ones once at the end
 * of the work unit (okv_q4_add_nat).  Elements past D & ~15 (the 8-lane chunk
 * and the scalar tail) keep the natural order in both.
 */
#ifndef ONNXKV_ATTENTION_QUANT_ONCE
#define ONNXKV_ATTENTION_QUANT_ONCE

#include "quant.h"

/* ONNX TensorProto element type codes of the page formats */
#define OKV_FMT_F32 1
#define OKV_FMT_U8 2
#define OKV_FMT_I8 3
#define OKV_FMT_F16 10
#define OKV_FMT_BF16 16
#define OKV_FMT_U4 21
#define OKV_FMT_I4 22
#define OKV_FMT_U2 25
#define OKV_FMT_I2 26

/* Bits per element of a format code (the caller has checked the code):
 * quant.h's okv_q_bits for the integer formats, else 16 or 32. */
static inline int64_t okv_fmt_bits(int f) {
    if (okv_q_bits(f)) return okv_q_bits(f);
    return f == OKV_FMT_F16 || f == OKV_FMT_BF16 ? 16 : 32;
}

/* One plane of page address addr, format f, G groups, compact header, or
 * channel-zero-point header (czp), or neither: head hk's data at *p, *st bytes
 * per token row, *hs bytes per head; header entries of head hk at *sc / *zp
 * (float32 header), or its S at *sc and its exponent codes at *ce (compact
 * header; *zp NULL), or its s at *sc, w at *zw and D zero-point codes at *zo
 * (czp; *zp NULL); *hb header bytes per head.  All NULL / 0 for float pages. */
static inline void okv_qplane(const okv_attn_args *a, uint64_t addr, int f, int64_t G, int compact, int czp,
                              int64_t hk, const char **p, int64_t *st, int64_t *hs, const float **sc,
                              const float **zp, const uint8_t **ce, const float **zw, const int8_t **zo,
                              int64_t *hb) {
    const char *base = (const char *)(uintptr_t)addr;
    *st = a->D * okv_fmt_bits(f) / 8;
    *hs = a->bs * *st;
    *sc = *zp = *zw = NULL;
    *ce = NULL;
    *zo = NULL;
    *hb = 0;
    if (okv_q_bits(f) && czp) {
        *sc = (const float *)base + hk;
        *zw = (const float *)base + a->Hkv + hk;
        *zo = (const int8_t *)(base + 8 * a->Hkv) + hk * a->D;
        *hb = 8 + a->D;
        base += okv_q_czp_header_bytes(a->Hkv, a->D);
    } else if (okv_q_bits(f) && compact) {
        *sc = (const float *)base + hk;
        *ce = (const uint8_t *)base + 4 * a->Hkv + hk * G;
        *hb = 4 + 2 * G;
        base += okv_q_compact_header_bytes(a->Hkv, G);
    } else if (okv_q_bits(f)) {
        const float *hdr = (const float *)base;
        *sc = hdr + hk * G;
        *zp = hdr + a->Hkv * G + hk * G;
        *hb = 8 * G;
        base += okv_q_header_bytes(a->Hkv, G);
    }
    *p = base + hk * *hs;
}

/* okv_attn_page for per-page formats: the page holding key j of (b, hk),
 * its formats read once from a->k_fmt / a->v_fmt. */
static inline okv_kv_page okv_attn_qpage(const okv_attn_args *a, int64_t b, int64_t hk, int64_t j) {
    okv_kv_page pg;
    const int64_t blk = j / a->bs;
    const int32_t id = a->block_tables[b * a->M + blk];
    const uint8_t *vce;   /* V pages carry float32 headers */
    const float *vzw;
    const int8_t *vzo;
    pg.kf = a->k_fmt[id];
    pg.vf = a->v_fmt[id];
    okv_qplane(a, a->k_pages[id], pg.kf, a->kG, a->k_compact, a->k_czp, hk, &pg.k, &pg.kst, &pg.khs, &pg.ksc,
               &pg.kzp, &pg.kce, &pg.kzw, &pg.kzo, &pg.khb);
    okv_qplane(a, a->v_pages[id], pg.vf, a->vG, 0, 0, hk, &pg.v, &pg.vst, &pg.vhs, &pg.vsc, &pg.vzp, &vce, &vzw, &vzo,
               &pg.vhb);
    pg.start = blk * a->bs;
    pg.end = pg.start + a->bs;
    return pg;
}

#if OKV_X86_SIMD
/* Software prefetch of the header entries (scales, zero points) of heads hk
 * .. hk + nh - 1 of a quantized page about to be read (pg: head hk's
 * entries): the row prefetch covers the codes only, and the first read of a
 * page's header would otherwise miss the caches.  A compact K header: S and
 * the heads' exponent and zero-point codes, every line of both (nh * kG
 * bytes each; per-channel keys read them all for every page); otherwise the
 * first line of the scales and of the zero points.  A channel-zero-point K
 * header: s, w and every line of the heads' zero-point codes. */
static inline void okv_pf_header(const okv_attn_args *a, const okv_kv_page *pg, int64_t nh) {
    if (pg->kzo) {
        const char *o = (const char *)pg->kzo;
        int64_t i;
        _mm_prefetch((const char *)pg->ksc, _MM_HINT_T0);
        _mm_prefetch((const char *)pg->kzw, _MM_HINT_T0);
        for (i = -(int64_t)((uintptr_t)o & 63); i < nh * a->D; i += 64) _mm_prefetch(o + i, _MM_HINT_T0);
    } else if (pg->kce) {
        const int64_t n = nh * a->kG;
        const char *e = (const char *)pg->kce, *z = e + a->Hkv * a->kG;
        int64_t i;
        _mm_prefetch((const char *)pg->ksc, _MM_HINT_T0);
        for (i = -(int64_t)((uintptr_t)e & 63); i < n; i += 64) _mm_prefetch(e + i, _MM_HINT_T0);
        for (i = -(int64_t)((uintptr_t)z & 63); i < n; i += 64) _mm_prefetch(z + i, _MM_HINT_T0);
    } else if (pg->ksc) {
        _mm_prefetch((const char *)pg->ksc, _MM_HINT_T0);
        _mm_prefetch((const char *)pg->kzp, _MM_HINT_T0);
    }
    if (pg->vsc) {
        _mm_prefetch((const char *)pg->vsc, _MM_HINT_T0);
        _mm_prefetch((const char *)pg->vzp, _MM_HINT_T0);
    }
}
#endif

/* Dequantization parameters of head hk0+h of the K (key != 0) or V plane of
 * page pg (head hk0's entries); zeros for a float page.  A compact K header:
 * the head's codes, and s1 / z1 decoded (s / z stay NULL: okv_qk_chan_fold
 * decodes them). */
static inline okv_dq okv_dq_head(const okv_attn_args *a, const okv_kv_page *pg, int key, int64_t h) {
    const float *sc = key ? pg->ksc : pg->vsc, *zp = key ? pg->kzp : pg->vzp;
    const int64_t G = key ? a->kG : a->vG;
    okv_dq d = {NULL, NULL, 0.f, 0.f, NULL, NULL, 0.f, NULL, 0.f};
    if (key && pg->kzo) {
        d.s1 = sc[h];
        d.z1 = okv_q_czp_z0(pg->kf);
        d.zo = pg->kzo + h * a->D;
        d.zw = pg->kzw[h];
    } else if (key && pg->kce) {
        d.cS = sc[h];
        d.ce = pg->kce + h * G;
        d.cz = d.ce + a->Hkv * G;
        okv_q_compact_decode_scalar(d.cS, d.ce, d.cz, &d.s1, &d.z1, 1);
    } else if (sc) {
        d.s = sc + h * G;
        d.z = zp + h * G;
        d.s1 = d.s[0];
        d.z1 = d.z[0];
    }
    return d;
}

/* s[r*OKV_BK + j] -= zc[r] for the nr rows, j < n. */
static inline void okv_qk_sub_rows(float *s, int nr, int64_t n, const float *zc) {
    int r;
    int64_t j;
    for (r = 0; r < nr; r++)
        if (zc[r] != 0.f)
            for (j = 0; j < n; j++) s[r * OKV_BK + j] -= zc[r];
}

/* sum of x[0..n) in 8 independent partial sums (one vector add per 8
 * elements once inlined into a SIMD tile dispatcher, instead of a serial
 * chain of n dependent adds). */
static inline float okv_sum8_f32(const float *x, int64_t n) {
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, t;
    int64_t i;
    int k;
    for (i = 0; i + 8 <= n; i += 8)
        for (k = 0; k < 8; k++) a[k] += x[i + k];
    t = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    for (; i < n; i++) t += x[i];
    return t;
}

/* Per-head zero point of keys: s[r*OKV_BK + j] -= c * qsum[r], j < n
 * (qsum[r] = sum of q row r, computed once per work unit). */
static inline void okv_qk_zp(const float *qsum, int nr, int64_t n, float c, float *s) {
    float x[OKV_RG];
    int r;
    for (r = 0; r < nr; r++) x[r] = c * qsum[r];
    okv_qk_sub_rows(s, nr, n, x);
}

/* Per-head zero point of values: zc[r] += s z sum_j p_j (the correction the
 * work unit subtracts from every element of accumulator row r at its end,
 * rescaled with the row; rows r*OKV_BK, j < n). */
static inline void okv_pv_zc(const float *p, int nr, int64_t n, float *zc, const okv_dq *dq) {
    int r;
    if (dq->z1 != 0.f)
        for (r = 0; r < nr; r++) zc[r] += dq->s1 * dq->z1 * okv_sum8_f32(p + r * OKV_BK, n);
}

/* Per-head scale and zero point of values: okv_pv_zc, then p_j *= s. */
static inline void okv_pv_fold(float *p, int nr, int64_t n, float *zc, const okv_dq *dq) {
    int r;
    int64_t j;
    okv_pv_zc(p, nr, n, zc, dq);
    for (r = 0; r < nr; r++)
        for (j = 0; j < n; j++) p[r * OKV_BK + j] *= dq->s1;
}

#if OKV_X86_SIMD
/* y = x (D floats; y == x allowed) with every 16-element chunk of [0, D & ~15)
 * in the interleaved order OKV_Q4_ILV. */
OKV_AVX512BW static inline void okv_q4_to_ilv(const float *x, float *y, int64_t D) {
    const __m512i idx = okv_q4_ilv_idx();
    const int64_t D16 = D & ~(int64_t)15;
    int64_t i;
    for (i = 0; i < D16; i += 16) _mm512_storeu_ps(y + i, _mm512_permutexvar_ps(idx, _mm512_loadu_ps(x + i)));
    for (; i < D; i++) y[i] = x[i];
}

/* acc += y (D floats) where y holds its 16-element chunks of [0, D & ~15) in
 * the interleaved order OKV_Q4_ILV (the rest in natural order). */
OKV_AVX512BW static inline void okv_q4_add_nat(const float *y, float *acc, int64_t D) {
    const __m512i idx = okv_q4_nat_idx();
    const int64_t D16 = D & ~(int64_t)15;
    int64_t i;
    for (i = 0; i < D16; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i),
                                                _mm512_permutexvar_ps(idx, _mm512_loadu_ps(y + i))));
    for (; i < D; i++) acc[i] += y[i];
}
#endif

/* Codes of a packed row as float: element d, (AVX2) elements i..i+7 and
 * (AVX-512) elements i..i+15 (quant.h's okv_q_get / okv_q_load8 /
 * okv_q_load16_ps for a constant format). */
#define OKV_QCODE1(p, fmt, d) ((float)okv_q_get(p, fmt, d))
#if OKV_X86_SIMD
#define OKV_QCODE8(p, fmt, i) _mm256_cvtepi32_ps(okv_q_load8(p, fmt, i))
#define OKV_QCODE16(p, fmt, i) okv_q_load16_ps(p, fmt, i)
#endif
#endif /* ONNXKV_ATTENTION_QUANT_ONCE */

/* ---- per instruction set: tile functions of every quantized format, with
 * per-head (suffix h) and per-channel (suffix c) scales */
#define OKV_QN u8
#define OKV_QFMT OKV_FMT_U8
#include "attention_qfmt.h"
#define OKV_QN i8
#define OKV_QFMT OKV_FMT_I8
#include "attention_qfmt.h"
#define OKV_QN u4
#define OKV_QFMT OKV_FMT_U4
#include "attention_qfmt.h"
#define OKV_QN i4
#define OKV_QFMT OKV_FMT_I4
#include "attention_qfmt.h"
#define OKV_QN u2
#define OKV_QFMT OKV_FMT_U2
#include "attention_qfmt.h"
#define OKV_QN i2
#define OKV_QFMT OKV_FMT_I2
#include "attention_qfmt.h"

#define OKV_QX(name) OKV_CAT(name, OKV_SFX)

/* Formats whose raw-code tiles work in the interleaved order (AVX-512 4-bit),
 * and the query rows / accumulator rows the dispatchers pass them. */
#ifdef OKV_SIMD512
#define OKV_ILV_FMT(f) ((f) == OKV_FMT_U4 || (f) == OKV_FMT_I4)
#else
#define OKV_ILV_FMT(f) 0
#endif

/* okv_q_compact_decode of this instruction set (AVX-512: the AVX2 decoder; a
 * 16-lane one showed no difference within the noise of a shared machine) */
#ifndef OKV_CDEC_ONCE
#define OKV_CDEC_ONCE
#define okv_q_cdec_scalar okv_q_compact_decode_scalar
#if OKV_X86_SIMD
#define okv_q_cdec_avx2 okv_q_compact_decode_avx2
#define okv_q_cdec_avx512 okv_q_compact_decode_avx2
#endif
#endif

/* Per-channel key scales s[c] and zero points z[c] folded into the nr query
 * rows: qs[r] = qb + r*D with qs[r][c] = q[r][c] * s[c], and zc[r] = scale *
 * sum_c qs[r][c] z[c], so that scale * q.((code - z) s) = scale * qs.code -
 * zc[r]: per-channel keys are scored on their raw codes by the per-head tiles
 * (one multiply per query element and tile instead of two per key element).
 * ilv (AVX-512 only): qs[r] then in the interleaved order of 4-bit tiles. */
OKV_INLINE OKV_ATTR void OKV_QX(okv_qk_chan_fold)(const float *const *qr, int nr, int64_t D, float scale,
                                                  const okv_dq *dq, float *qb, const float **qs, float *zc,
                                                  int ilv) {
    float cs[OKV_Q_COMPACT_MAX_G], cz[OKV_Q_COMPACT_MAX_G];
    okv_dq cd;
    int r;
    if (dq->ce) {   /* compact header: the head's D scales and zero points, decoded here */
        OKV_QX(okv_q_cdec)(dq->cS, dq->ce, dq->cz, cs, cz, D);
        cd = *dq;
        cd.s = cs;
        cd.z = cz;
        dq = &cd;
    }
    for (r = 0; r < nr; r++) {
        float *q = qb + r * D;
        OKV_QX(okv_scale_mul_f32)(qr[r], 1.f, dq->s, q, D);
        qs[r] = q;
        zc[r] = scale * OKV_QX(okv_dot_f32)(q, dq->z, D);
#ifdef OKV_SIMD512
        if (ilv) okv_q4_to_ilv(q, q, D);
#endif
    }
#ifndef OKV_SIMD512
    (void)ilv;
#endif
}

/* Channel-zero-point keys (dq->zo): s[r*OKV_BK + j] -= f * q_r.zo, j < n, for
 * the nr rows qr (D floats each, natural order; f = scale * s * w); zo
 * decoded into qb (D floats of scratch). */
OKV_INLINE OKV_ATTR void OKV_QX(okv_qk_czp)(const float *const *qr, int nr, int64_t n, int64_t D, float f,
                                            const int8_t *zo, float *qb, float *s) {
    float zc[OKV_RG];
    int64_t c;
    int r;
    for (c = 0; c < D; c++) qb[c] = (float)zo[c];
    for (r = 0; r < nr; r++) zc[r] = f * OKV_QX(okv_dot_f32)(qr[r], qb, D);
    okv_qk_sub_rows(s, nr, n, zc);
}

/* Quantized tile of format F: per-channel key scales folded into the query
 * rows (okv_qk_chan_fold), per-channel value scales dequantize in the load
 * step; per-head scales (s, z) score the raw codes c and fold the rest in:
 * scale * q.((c - z) s) = (scale s) q.c - (scale s z) sum(q), and
 * sum_j p_j (c_j - z) s = sum_j (s p_j) c_j - s z sum_j p_j. */
#define OKV_QK_Q(F)                                                                            \
    if (pc) {                                                                                  \
        const float *qs[OKV_RG] = {NULL};                                                      \
        float zc[OKV_RG];                                                                      \
        OKV_QX(okv_qk_chan_fold)(qr, nr, D, scale, dq, qb, qs, zc, OKV_ILV_FMT(fmt));         \
        OKV_QX(okv_qk_rows_##F##h)(qs, nr, c, n, D, scale, s, dq, pf);                         \
        okv_qk_sub_rows(s, nr, n, zc);                                                         \
    } else {                                                                                   \
        OKV_QX(okv_qk_rows_##F##h)(OKV_ILV_FMT(fmt) ? qi : qr, nr, c, n, D, scale * dq->s1, s, dq, pf); \
        if (dq->z1 != 0.f) okv_qk_zp(qsum, nr, n, scale * dq->s1 * dq->z1, s);                  \
        if (dq->zo) OKV_QX(okv_qk_czp)(qr, nr, n, D, scale * dq->s1 * dq->zw, dq->zo, qb, s);    \
    }                                                                                          \
    return
#define OKV_PV_Q(F)                                                                            \
    if (pc) {                                                                                  \
        OKV_QX(okv_pv_rows_##F##c)(p, nr, c, n, D, accr, dq, pf);                               \
    } else {                                                                                   \
        okv_pv_fold(p, nr, n, zc, dq);                                                         \
        OKV_QX(okv_pv_rows_##F##h)(p, nr, c, n, D, OKV_ILV_FMT(fmt) ? acci : accr, dq, pf);     \
    }                                                                                          \
    return

/* Scores of nr rows against n keys of a tile in format fmt (see okv_qk_rows);
 * pc: per-channel scales; qi: the nr q rows in the interleaved order (read
 * only if OKV_ILV_FMT(fmt) with per-head scales); qb: nr*D floats of scratch
 * (the folded rows); qsum: the sums of the nr q rows. */
OKV_ATTR static void OKV_QX(okv_qk_fmt)(int fmt, int pc, const float *const *qr, const float *const *qi, int nr,
                                        const char *k, int64_t n, int64_t D, float scale, float *s, const okv_dq *dq,
                                        const okv_pf *pf, float *qb, const float *qsum) {
    const uint8_t *c = (const uint8_t *)k;
    switch (fmt) {
    case OKV_FMT_F16: OKV_QX(okv_qk_rows_f16)(qr, nr, (const uint16_t *)k, n, D, scale, s, dq, pf); return;
    case OKV_FMT_BF16: OKV_QX(okv_qk_rows_bf16)(qr, nr, (const uint16_t *)k, n, D, scale, s, dq, pf); return;
    case OKV_FMT_U8: OKV_QK_Q(u8);
    case OKV_FMT_I8: OKV_QK_Q(i8);
    case OKV_FMT_U4: OKV_QK_Q(u4);
    case OKV_FMT_I4: OKV_QK_Q(i4);
    case OKV_FMT_U2: OKV_QK_Q(u2);
    case OKV_FMT_I2: OKV_QK_Q(i2);
    default: OKV_QX(okv_qk_rows_f32)(qr, nr, (const float *)k, n, D, scale, s, dq, pf); return;
    }
}

/* acc rows += p * V rows of a tile in format fmt (see okv_pv_rows); with
 * per-head scales the probabilities p are scaled in place and the zero
 * point's share is added to the rows' corrections zc (see okv_pv_fold).
 * acci: the rows' accumulators in the interleaved order, taking the tile
 * instead of accr if OKV_ILV_FMT(fmt) with per-head scales.  pf (or NULL):
 * rows to software-prefetch, spread over the tile's token loop. */
OKV_ATTR static void OKV_QX(okv_pv_fmt)(int fmt, int pc, float *p, int nr, const char *v, int64_t n, int64_t D,
                                        float *const *accr, float *const *acci, const okv_dq *dq, float *zc,
                                        const okv_pf *pf) {
    const uint8_t *c = (const uint8_t *)v;
    switch (fmt) {
    case OKV_FMT_F16: OKV_QX(okv_pv_rows_f16)(p, nr, (const uint16_t *)v, n, D, accr, dq, pf); return;
    case OKV_FMT_BF16: OKV_QX(okv_pv_rows_bf16)(p, nr, (const uint16_t *)v, n, D, accr, dq, pf); return;
    case OKV_FMT_U8: OKV_PV_Q(u8);
    case OKV_FMT_I8: OKV_PV_Q(i8);
    case OKV_FMT_U4: OKV_PV_Q(u4);
    case OKV_FMT_I4: OKV_PV_Q(i4);
    case OKV_FMT_U2: OKV_PV_Q(u2);
    case OKV_FMT_I2: OKV_PV_Q(i2);
    default: OKV_QX(okv_pv_rows_f32)(p, nr, (const float *)v, n, D, accr, dq, pf); return;
    }
}
#undef OKV_QK_Q
#undef OKV_PV_Q

#ifdef OKV_SIMD512_AMX
/* okv_qk_fmt for quantized keys of format fmt on the AMX tiles
 * (attention_amx.h; a->amx): n keys at k, kst bytes apart,
 * scored for the nr rows qr of work item w (a (head, row group) of the unit)
 * into s.  Per-head scales (pc == 0): item w's B tiles are built from qr at
 * its first page of this code order and kept (x->tag[w]); the head's scale
 * and zero point fold in as in okv_qk_fmt.  Per-channel scales (pc != 0;
 * 8-bit codes only, the caller's choice): the page's scales (float32 header,
 * or the compact one decoded) fold into the rows as in okv_qk_chan_fold, and
 * the B tiles are rebuilt from the folded rows for this page in one pass
 * (okv_amx_build_pc, which decodes a compact header itself, against the
 * rows' maxima found once per item: okv_amx_row_max), the zero points' share
 * subtracted from the scores as they are stored (none for signed codes with a
 * compact header, whose zero points are 0).  A channel-zero-point header
 * (dq->zo): per-head scores, and its zero points' share from the tiles too
 * (okv_amx_qk's zo: 8-bit codes, nr <= OKV_AMX_RPT) or okv_qk_czp.
 * (4- and 2-bit per-channel keys keep the AVX-512 tiles: their code order
 * needs okv_amx_build's planes, which per page cost more than the AVX-512
 * scores they replace.) */
OKV_ATTR static void okv_qk_amx(okv_amx_ws *x, int64_t w, int fmt, int pc, const float *const *qr, int nr,
                                const char *k, int64_t kst, int64_t n, int64_t D, float scale, float *s,
                                const okv_dq *dq, const okv_pf *pf, const float *qsum) {
    const int bits = okv_q_bits(fmt);
    uint8_t *bt = x->bt + w * x->nchm * x->tpi * OKV_AMX_TILE;
    float *sr = x->sr + w * OKV_RG;
    if (pc) {
        float zc[OKV_RG], *qm = x->qm + w * OKV_RG;
        int *qc = x->qc + w * OKV_RG;
        if (x->tag[w] != OKV_AMX_TAG_PC) {   /* the rows' maxima, once per item */
            okv_amx_row_max(qr, nr, D, qm, qc);
            x->tag[w] = OKV_AMX_TAG_PC;
        }
        const int zp = !(dq->ce && okv_q_signed(fmt));   /* a compact header's signed codes: zero points 0 */
        okv_amx_build_pc(qr, nr, D, dq, scale, qm, qc, x, bt, sr, zc, zp);
        okv_amx_qk((const uint8_t *)k, kst, n, fmt, D, nr, bt, sr, scale, zp ? zc : NULL, s, x, pf, 4, NULL, 0.f);
        return;
    }
    if (x->tag[w] != bits) {
        okv_amx_build(qr, nr, D, bits, x, bt, sr);
        x->tag[w] = bits;
    }
    if (dq->zo && bits == 8 && nr <= OKV_AMX_RPT) {   /* the zero points' share on the tiles too */
        okv_amx_qk((const uint8_t *)k, kst, n, fmt, D, nr, bt, sr, scale * dq->s1, NULL, s, x, pf, 3, dq->zo,
                   scale * dq->s1 * dq->zw);
    } else {
        okv_amx_qk((const uint8_t *)k, kst, n, fmt, D, nr, bt, sr, scale * dq->s1, NULL, s, x, pf, 3, NULL, 0.f);
        if (dq->zo) OKV_QX(okv_qk_czp)(qr, nr, n, D, scale * dq->s1 * dq->zw, dq->zo, x->qp, s);
    }
    if (dq->z1 != 0.f) okv_qk_zp(qsum, nr, n, scale * dq->s1 * dq->z1, s);
}
#endif

/* the work unit of per-page formats: okv_attn_unit_mixed<SFX> */
#define OKV_KT mixed
#define OKV_MIXED
#include "attention_impl.h"
#undef OKV_MIXED
#undef OKV_KT
#undef OKV_ILV_FMT
#undef OKV_QX
