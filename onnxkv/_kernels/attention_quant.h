/* onnxkv/_kernels/attention_quant.h -- per-page formats for the paged attention
 * kernel: the page layout (okv_attn_qpage, okv_dq_head, the header prefetch)
 * and the instruction-set independent helpers of the quantized tiles (zero
 * point and scale folding, the interleaved 4-bit order).  The tiles are in
 * attention_tiles_*.h, the per-format dispatchers in attention_unit.h.
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
 * 2-bit codes by a table lookup) for a constant format (attention_kv.h).
 * Per-channel value scales and zero points are applied by the loaders, in
 * registers; per-channel key
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
#ifndef ONNXKV_ATTENTION_QUANT_H
#define ONNXKV_ATTENTION_QUANT_H

#include "attention_kv.h"
#include "attention_types.h"

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

/* okv_q_compact_decode of each instruction set (AVX-512: the AVX2 decoder) */
#define okv_q_cdec_scalar okv_q_compact_decode_scalar
#if OKV_X86_SIMD
#define okv_q_cdec_avx2 okv_q_compact_decode_avx2
#define okv_q_cdec_avx512 okv_q_compact_decode_avx2
#endif

#endif /* ONNXKV_ATTENTION_QUANT_H */
