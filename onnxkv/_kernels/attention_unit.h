/* onnxkv/_kernels/attention_unit.h -- the attention work units of one
 * instruction set (the work unit: attention.h), and the per-page-format tile
 * dispatchers they use.
 *
 * Included once, by the C file of one level (attention_unit_<level>.c), with
 * OKV_SFX (_scalar, _avx2 or _avx512: the suffix of every function here and
 * of the level's tiles okv_qk_rows<SFX> / okv_pv_rows<SFX>), OKV_ATTR (the
 * level's target attribute) and, for AVX-512, OKV_SIMD512 (the interleaved
 * 4-bit order, the AMX key scores when the build has them); it undefines
 * them (without OKV_SFX, compiled alone, it instantiates the scalar level).
 * The level is the one axis instantiated textually (a function with a target attribute cannot be inlined
 * into one without it); element formats and unit families are constant arguments of inlined functions.
 *
 * The two external units of a level (attention_units.h):
 *   okv_attn_unit_native<SFX>: every page (or the contiguous cache) holds
 *     a->kv_type elements;
 *   okv_attn_unit_mixed<SFX>: per-page formats (a->k_fmt / a->v_fmt), read
 *     once per page by okv_attn_qpage, select the page's tiles
 *     (okv_qk_fmt<SFX> / okv_pv_fmt<SFX>).
 * ws: okv_attn_ws_floats(nh*R, D) floats, plus okv_attn_amx_ws_floats with
 * AMX key scores.  part == NULL: normalise and write out[b, hk*G+g, t, :];
 * else write the unnormalised state per row of head hk0+h as part[h*pstride
 * + r*(D+2) + 0] = running max, [1] = sum, [2..] = acc.
 */
#ifndef OKV_SFX
#define OKV_SFX _scalar
#define OKV_ATTR
#endif

#include "attention_quant.h"
#include "attention_softmax.h"
#include "attention_units.h"
#include "attention_tiles_avx512.h"
#include "attention_tiles_scalar.h"

#if OKV_HAVE_AMX && defined(OKV_SIMD512)
#include "attention_amx.h"
#define OKV_UNIT_AMX 1   /* this level may score quantized keys on the AMX tiles */
#endif

#define OKV_CAT_(a, b) a##b
#define OKV_CAT(a, b) OKV_CAT_(a, b)
/* name + instruction set */
#define OKV_I(name) OKV_CAT(name, OKV_SFX)
/* The parameters of a work unit (attention_units.h), and passing them on. */
#define OKV_UNIT_ARGS                                                                                        \
    const okv_attn_args *a, int64_t b, int64_t hk0, int64_t nh, int64_t t0, int64_t t1, int64_t c0, int64_t c1, \
        float *ws, float *part, int64_t pstride
#define OKV_UNIT_PASS a, b, hk0, nh, t0, t1, c0, c1, ws, part, pstride

#include "attention_flash.h"
#include "attention_flash_bf16.h"

/* Formats whose raw-code tiles work in the interleaved order (AVX-512 4-bit),
 * and the query rows / accumulator rows the dispatchers pass them. */
#ifdef OKV_SIMD512
#define OKV_ILV_FMT(f) ((f) == OKV_FMT_U4 || (f) == OKV_FMT_I4)
#else
#define OKV_ILV_FMT(f) 0
#endif

#include "attention_fmt.h"

#ifdef OKV_UNIT_AMX
/* okv_qk_fmt for quantized keys of format fmt on the AMX tiles (a->amx): n
 * keys at k, kst bytes apart, scored for the nr rows qr of work item w (a
 * (head, row group) of the unit) into s.  Per-head scales (pc == 0): item w's
 * B tiles are built from qr at its first page of this code order and kept
 * (x->tag[w]); the head's scale and zero point fold in as in okv_qk_fmt.
 * Per-channel scales (pc != 0; 8-bit codes only, the caller's choice): the B
 * tiles are rebuilt from the rows folded with the page's scales, per page
 * (okv_amx_build_pc against the rows' maxima, okv_amx_row_max, found once per
 * item), the zero points' share subtracted as the scores are stored (none for
 * signed codes with a compact header, whose zero points are 0).  A
 * channel-zero-point header (dq->zo): per-head scores, its zero points'
 * share on the tiles too (8-bit codes, nr <= OKV_AMX_RPT) or by okv_qk_czp.
 * 4- and 2-bit per-channel keys keep the AVX-512 tiles: their code order
 * needs okv_amx_build's planes, which per page cost more than the scores
 * they replace. */
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
        if (dq->zo) OKV_I(okv_qk_czp)(qr, nr, n, D, scale * dq->s1 * dq->zw, dq->zo, x->qp, s);
    }
    if (dq->z1 != 0.f) okv_qk_zp(qsum, nr, n, scale * dq->s1 * dq->z1, s);
}
#endif

/* The work unit (see the top of this file) of K/V element format fmt (a
 * constant: OKV_FMT_F32, F16 or BF16) or, with mixed, of per-page formats. */
OKV_INLINE OKV_ATTR int64_t OKV_I(okv_attn_unit_body)(OKV_UNIT_ARGS, const int fmt, const int mixed) {
    const int64_t D = a->D, G = a->Hq / a->Hkv, nt = t1 - t0, R = G * nt, RT = nh * R;
    const int64_t kvl = a->kv_len[b], kvs = a->kv_start ? a->kv_start[b] : 0;
#define OKV_PAGE_AT(j) (mixed ? okv_attn_qpage(a, b, hk0, j) : okv_attn_page(a, b, hk0, j, fmt == OKV_FMT_F32 ? 4 : 2))
    int64_t nbytes = 0;               /* mixed: quantized codes and header entries loaded */
    okv_kv_page pg, pf;               /* page of the current tile, page of the prefetched tile */
    float *acc = ws;                  /* RT*D */
    float *sc = acc + RT * D;         /* 2*OKV_RG*OKV_BK: two score slots (work items w, w+1) */
    float *mx = sc + 2 * OKV_RG * OKV_BK;   /* RT */
    float *sm = mx + RT;              /* RT */
    float *qsum = sm + RT;            /* mixed: RT sums of the query rows (per-head key zero points) */
    float *zc = qsum + RT;            /* RT: per-head value zero-point correction of each row */
    float *qb = zc + RT;              /* OKV_RG*D: query rows with per-channel key scales folded in */
    float *qi = qb + OKV_RG * D;      /* RT*D: query rows in the interleaved order (4-bit keys, AVX-512) */
    float *acci = qi + RT * D;        /* RT*D: accumulators in that order (4-bit values, AVX-512) */
    int acci_used = 0;                /* set at the first tile that needs them */
#ifdef OKV_SIMD512
    int qi_ready = 0;
#endif
#ifdef OKV_UNIT_AMX
    okv_amx_ws ax;                    /* a->amx: scratch and B tiles of the AMX key scores */
    const int amx = mixed && a->amx;
#endif
    int64_t lo[OKV_MAX_TQ], hi[OKV_MAX_TQ];
    int64_t jlo = INT64_MAX, jhi = INT64_MIN, t, g, r, j0, j1, j, h;
    const float scale = a->scale, softcap = a->softcap;
    /* Row-group width: decode shares each K/V load among up to 8 query heads;
     * prefill (compute bound, K/V blocks already in L1) uses groups of 4 rows,
     * which need fewer loads per multiply-add (2 K + 4 q loads per 8 FMAs). */
    const int64_t rgw = nt > 1 && R > 4 ? a->prefill_rg : OKV_RG;

    for (t = 0; t < nt; t++) {
        int64_t p = a->q_pos[b * a->Sq + t0 + t];
        int64_t l = kvs > c0 ? kvs : c0;
        int64_t e = p + 1;
        if (a->window >= 0 && p - a->window > l) l = p - a->window;
        if (kvl < e) e = kvl;
        if (c1 < e) e = c1;
        lo[t] = l; hi[t] = e;
        if (l < e) {
            if (l < jlo) jlo = l;
            if (e > jhi) jhi = e;
        }
    }
    memset(acc, 0, (size_t)(RT * D) * sizeof(float));
    for (r = 0; r < RT; r++) { mx[r] = -INFINITY; sm[r] = 0.f; }
    if (mixed)
        for (r = 0; r < RT; r++) {   /* state row r = h*R + g*nt + t */
            const int64_t rh = r / R, rg = r % R;
            qsum[r] = okv_sum8_f32(a->q + ((b * a->Hq + (hk0 + rh) * G + rg / nt) * a->Sq + t0 + rg % nt) * D, D);
            zc[r] = 0.f;
        }
#ifdef OKV_UNIT_AMX
    if (amx) {   /* B tiles per (head, row group) item, after the float workspace; tiles configured */
        okv_amx_ws_init(&ax, (char *)(ws + okv_attn_ws_floats(RT, D)), D, nh * ((R + rgw - 1) / rgw),
                        R < rgw ? R : rgw);
        okv_amx_begin();
    }
#endif
    pg.start = pg.end = pf.start = pf.end = INT64_MIN;
    /* Tiles of up to OKV_BK keys inside one page, each starting at a key some
     * token sees: keys (and pages) no token sees are skipped. */
    for (j0 = okv_next_seen(lo, hi, nt, jlo); j0 < jhi; j0 = okv_next_seen(lo, hi, nt, j1)) {
        okv_pf pft = {NULL, NULL, 0, 0, 0, a->prefetch};   /* the next tile's rows */
        const char *kt, *vt;
        if (j0 >= pg.end || j0 < pg.start) {
            pg = j0 >= pf.start && j0 < pf.end ? pf : OKV_PAGE_AT(j0);
            if (mixed) nbytes += nh * (pg.khb + pg.vhb);
        }
        j1 = j0 + OKV_BK;
        if (j1 > pg.end) j1 = pg.end;
        if (j1 > jhi) j1 = jhi;
        kt = pg.k + (j0 - pg.start) * pg.kst;    /* head hk0, key j at kt + (j - j0)*kst */
        vt = pg.v + (j0 - pg.start) * pg.vst;
        if (mixed) nbytes += nh * (j1 - j0) * ((pg.ksc ? pg.kst : 0) + (pg.vsc ? pg.vst : 0));
        if (a->prefetch) {   /* the tile pfd tiles ahead, if some token sees its first key */
            const int64_t pfd = a->prefetch >= 3 ? a->prefetch - 1 : 1, p0 = j1 + (pfd - 1) * OKV_BK;
            if (p0 < jhi && okv_next_seen(lo, hi, nt, p0) == p0) {
                if (p0 >= pf.end || p0 < pf.start) {
                    pf = p0 >= pg.start && p0 < pg.end ? pg : OKV_PAGE_AT(p0);
#if OKV_X86_SIMD
                    if (mixed) okv_pf_header(a, &pf, nh);
#endif
                }
                pft.n = OKV_BK;
                if (pft.n > pf.end - p0) pft.n = pf.end - p0;
                if (pft.n > jhi - p0) pft.n = jhi - p0;
                pft.k = pf.k + (p0 - pf.start) * pf.kst;
                pft.v = pf.v + (p0 - pf.start) * pf.vst;
                pft.ks = pf.kst;
                pft.vs = pf.vst;
            }
        }
#ifdef OKV_UNIT_AMX
        /* rows of an item's prefetch issued with AMX key tiles (a->pf_qk_lines; see pend below) */
        const int64_t pf_nq = a->pf_qk_lines && pft.n
                                  ? a->pf_qk_lines / (2 * (((pft.ks > pft.vs ? pft.ks : pft.vs) + 63) / 64))
                                  : OKV_BK;
#endif
        /* Work items (head h, row group rg), heads in memory order: in a page,
         * head hk0+h+1's rows follow head hk0+h's, so a multi-head unit reads
         * each page front to back.  The scores of item w are computed before
         * the softmax and p*v of item w-1 (two score slots, item w in slot
         * w & 1): the latency chain of one item's softmax overlaps the next
         * item's score tile instead of stalling the p*v behind it.  While head
         * h is scored, head h+1's rows of this tile are prefetched (after the
         * last head: the next tile's). */
        {
            const int64_t ngr = (R + rgw - 1) / rgw, nw = nh * ngr;
            const okv_pf nopf = {NULL, NULL, 0, 0, 0, 0};
            struct {
                int64_t h, rg, u0, u1;
                int nr;
                float *accr[OKV_RG];
                float *accir[OKV_RG];   /* mixed */
            } it[2];
            int64_t w;
            for (w = 0; w <= nw; w++) {
#ifdef OKV_SIMD512
                okv_pf pend = nopf;   /* item w's prefetch rows left to item w - 1's p*v (AMX keys; see the top) */
#endif
                if (w < nw) {   /* item w: its rows, visible keys and scores */
                    const int64_t hw = w / ngr, rg = (w % ngr) * rgw, hk = hk0 + hw;
                    const char *kh = kt + hw * pg.khs;
                    const int nr = (int)(R - rg < rgw ? R - rg : rgw);
                    const float *qr[OKV_RG];
                    const float *qir[OKV_RG];   /* mixed */
                    int64_t u0 = j1, u1 = j0;
                    int i;
                    for (i = 0; i < nr; i++) {
                        int64_t rr = rg + i, tt = rr % nt, a0 = lo[tt] > j0 ? lo[tt] : j0;
                        int64_t a1 = hi[tt] < j1 ? hi[tt] : j1;
                        g = rr / nt;
                        qr[i] = a->q + ((b * a->Hq + hk * G + g) * a->Sq + t0 + tt) * D;
                        it[w & 1].accr[i] = acc + (hw * R + rr) * D;
                        if (mixed) {
                            qir[i] = qi + (hw * R + rr) * D;
                            it[w & 1].accir[i] = acci + (hw * R + rr) * D;
                        }
                        if (a0 < a1) {
                            if (a0 < u0) u0 = a0;
                            if (a1 > u1) u1 = a1;
                        }
                    }
                    it[w & 1].h = hw;
                    it[w & 1].rg = rg;
                    it[w & 1].nr = nr;
                    it[w & 1].u0 = u0;
                    it[w & 1].u1 = u1;
                    if (u0 < u1) {
                        /* the prefetch by the first row group only: head h+1's rows of this tile (after
                         * the last head: head hk0's of the next tile); AMX key scores (a->amx, several
                         * times faster per head) prefetch head h's rows of the next tile instead */
                        const okv_pf pfh = {kh + pg.khs, vt + (hw + 1) * pg.vhs, pg.kst, pg.vst,
                                            a->prefetch ? j1 - j0 : 0, a->prefetch};
#ifdef OKV_SIMD512
                        const okv_pf pfn = {pft.k ? pft.k + hw * pf.khs : NULL, pft.v ? pft.v + hw * pf.vhs : NULL,
                                            pft.ks, pft.vs, pft.n, pft.hint};
                        const okv_pf *pfp = rg != 0                  ? &nopf
                                            : mixed && a->amx       ? &pfn
                                            : hw + 1 == nh          ? &pft
                                                                    : &pfh;
#else
                        const okv_pf *pfp = rg != 0 ? &nopf : hw + 1 == nh ? &pft : &pfh;
#endif
                        float *sw = sc + (w & 1) * OKV_RG * OKV_BK;
                        if (!mixed) {
                            OKV_I(okv_qk_rows)(qr, nr, kh + (u0 - j0) * pg.kst, u1 - u0, D, scale, sw, pfp, fmt);
                        } else {
                            const okv_dq dk = okv_dq_head(a, &pg, 1, hw);
#ifdef OKV_SIMD512
                            if (!qi_ready && a->kG == 1 && OKV_ILV_FMT(pg.kf)) {   /* every row of the unit, once */
                                for (r = 0; r < RT; r++) {
                                    const int64_t rh = r / R, rq = r % R;
                                    okv_q4_to_ilv(
                                        a->q + ((b * a->Hq + (hk0 + rh) * G + rq / nt) * a->Sq + t0 + rq % nt) * D,
                                        qi + r * D, D);
                                }
                                qi_ready = 1;
                            }
#endif
#ifdef OKV_UNIT_AMX
                            /* AMX key scores: per-head key scales, or per-channel ones of 8-bit codes */
                            if (amx && okv_q_bits(pg.kf) && (a->kG == 1 || okv_q_bits(pg.kf) == 8)) {
                                okv_pf pfa = *pfp;
                                if (pfa.n > pf_nq) {
                                    pend = pfa;
                                    pend.k += pf_nq * pend.ks;
                                    pend.v += pf_nq * pend.vs;
                                    pend.n -= pf_nq;
                                    pfa.n = pf_nq;
                                }
                                okv_qk_amx(&ax, w, pg.kf, a->kG > 1, qr, nr, kh + (u0 - j0) * pg.kst, pg.kst,
                                           u1 - u0, D, scale, sw, &dk, &pfa, qsum + hw * R + rg);
                                /* a query row with a NaN or an infinity (its sum is not finite) has no
                                 * fixed-point form: its scores are NaN, as its float dot products would be */
                                for (i = 0; i < nr; i++)
                                    if (!isfinite(qsum[hw * R + rg + i]))
                                        for (j = 0; j < u1 - u0; j++) sw[i * OKV_BK + j] = NAN;
                            } else
#endif
                            OKV_I(okv_qk_fmt)(pg.kf, a->kG > 1, qr, qir, nr, kh + (u0 - j0) * pg.kst, u1 - u0, D,
                                              scale, sw, &dk, pfp, qb, qsum + hw * R + rg);
                        }
                    }
                }
                if (w > 0 && it[(w - 1) & 1].u0 < it[(w - 1) & 1].u1) {   /* item w-1: softmax, p*v */
                    const int64_t hw = it[(w - 1) & 1].h, rg = it[(w - 1) & 1].rg;
                    const int64_t u0 = it[(w - 1) & 1].u0, u1 = it[(w - 1) & 1].u1, n = u1 - u0;
                    const int nr = it[(w - 1) & 1].nr;
                    float *const *accr = it[(w - 1) & 1].accr;
                    float *sw = sc + ((w - 1) & 1) * OKV_RG * OKV_BK;
                    float *mxh = mx + hw * R, *smh = sm + hw * R;
                    const char *vh = vt + hw * pg.vhs;
                    float *const *accir = it[(w - 1) & 1].accir;   /* mixed */
                    int64_t va0[OKV_RG], va1[OKV_RG];   /* the keys [va0, va1) of the tile each row sees */
                    int i, c, part = 0;
                    for (i = 0; i < nr; i++) {
                        int64_t rr = rg + i, tt = rr % nt, a0 = lo[tt] > u0 ? lo[tt] : u0;
                        int64_t a1 = hi[tt] < u1 ? hi[tt] : u1;
                        float *s = sw + i * OKV_BK, bm, mnew;
                        va0[i] = a0;
                        va1[i] = a1;
                        part |= a0 != u0 || a1 != u1;
                        if (a0 >= a1) {               /* nothing visible in this block: p = 0 */
                            memset(s, 0, (size_t)n * sizeof(float));
                            continue;
                        }
                        for (j = u0; j < a0; j++) s[j - u0] = -INFINITY;
                        for (j = a1; j < u1; j++) s[j - u0] = -INFINITY;
                        if (softcap > 0.f)
                            for (j = a0 - u0; j < a1 - u0; j++) s[j] = softcap * tanhf(s[j] / softcap);
                        bm = OKV_I(okv_attn_max)(s + (a0 - u0), a1 - a0);
                        if (!(bm < INFINITY) || mxh[rr] != mxh[rr]) {
                            /* a NaN or +inf score, now or before: the row's softmax is NaN (as NumPy's) */
                            mxh[rr] = smh[rr] = NAN;
                            memset(s, 0, (size_t)n * sizeof(float));
                            continue;
                        }
                        mnew = bm > mxh[rr] ? bm : mxh[rr];
                        if (mnew == -INFINITY) {      /* every visible score so far is -inf: weights 0 */
                            memset(s, 0, (size_t)n * sizeof(float));
                            continue;
                        }
                        if (mnew > mxh[rr]) {
                            if (mxh[rr] != -INFINITY) {
                                float alpha = expf(mxh[rr] - mnew);
                                OKV_I(okv_scal_f32)(alpha, accr[i], D);
                                smh[rr] *= alpha;
                                if (mixed) {
                                    zc[hw * R + rr] *= alpha;
                                    if (acci_used) OKV_I(okv_scal_f32)(alpha, accir[i], D);
                                }
                            }
                            mxh[rr] = mnew;
                        }
                        smh[rr] += OKV_I(okv_exp_sub_sum_f32)(s, mnew, n);   /* -inf -> 0 */
                    }
                    /* p * v over the whole tile for every row at once, or, where some row does not see
                     * every key of it, row by row over the keys that row sees: a key a row does not see adds
                     * nothing to it, not even 0 * NaN (a value NaN or infinite).  The whole-tile call is a
                     * branch of its own, not the row loop's single pass: GCC compiles the unit worse around
                     * that form (benchmarks/README.md, Kernel design measurements). */
                    if (!mixed) {
                        if (!part)
                            OKV_I(okv_pv_rows)(sw, nr, vh + (u0 - j0) * pg.vst, n, D, accr, NULL, NULL, fmt, 0);
                        else
                            for (c = 0; c < nr; c++)
                                if (va0[c] < va1[c])
                                    OKV_I(okv_pv_rows)(sw + c * OKV_BK + (va0[c] - u0), 1,
                                                       vh + (va0[c] - j0) * pg.vst, va1[c] - va0[c], D, accr + c,
                                                       NULL, NULL, fmt, 0);
                    } else {
                        const okv_dq dv = okv_dq_head(a, &pg, 0, hw);
                        if (!acci_used && a->vG == 1 && OKV_ILV_FMT(pg.vf)) {
                            memset(acci, 0, (size_t)(RT * D) * sizeof(float));
                            acci_used = 1;
                        }
#ifdef OKV_SIMD512
                        const okv_pf *pvp = pend.n ? &pend : NULL;
#else
                        const okv_pf *pvp = NULL;
#endif
                        if (!part)
                            OKV_I(okv_pv_fmt)(pg.vf, a->vG > 1, sw, nr, vh + (u0 - j0) * pg.vst, n, D, accr, accir,
                                              &dv, zc + hw * R + rg, pvp);
                        else
                            for (c = 0; c < nr; c++)
                                if (va0[c] < va1[c])
                                    OKV_I(okv_pv_fmt)(pg.vf, a->vG > 1, sw + c * OKV_BK + (va0[c] - u0), 1,
                                                      vh + (va0[c] - j0) * pg.vst, va1[c] - va0[c], D, accr + c,
                                                      accir + c, &dv, zc + hw * R + rg + c, c == 0 ? pvp : NULL);
#ifdef OKV_SIMD512
                        pend.n = 0;
#endif
                        /* The value zero points' share at once, into the accumulators the tile summed
                         * into (4-bit per-head tiles: the interleaved ones on [0, D & ~15), where a
                         * constant is the same in either order), not at the end of the work unit:
                         * over thousands of keys the sums of p s c and of p s z grow far past their
                         * difference and cancel in float32. */
                        for (i = 0; i < nr; i++) {
                            float *zr = zc + hw * R + rg + i;
                            if (*zr != 0.f) {
                                const float zv = *zr;
                                int64_t e = 0;
                                if (a->vG == 1 && OKV_ILV_FMT(pg.vf))
                                    for (; e < (D & ~(int64_t)15); e++) accir[i][e] -= zv;
                                for (; e < D; e++) accr[i][e] -= zv;
                                *zr = 0.f;
                            }
                        }
                    }
                }
#ifdef OKV_SIMD512
                okv_pf_rows(&pend, 0, (int)pend.n);   /* no p*v of item w - 1 took them */
#endif
            }
        }
    }

    if (mixed) {
#ifdef OKV_UNIT_AMX
        if (amx) okv_amx_end();   /* the tiles released */
#endif
#ifdef OKV_SIMD512
        if (acci_used)   /* the interleaved accumulators, in natural order */
            for (r = 0; r < RT; r++) okv_q4_add_nat(acci + r * D, acc + r * D, D);
#endif
        for (r = 0; r < RT; r++)   /* the value zero points' share, once per row */
            if (zc[r] != 0.f) {
                int64_t i;
                for (i = 0; i < D; i++) acc[r * D + i] -= zc[r];
            }
    }
    for (h = 0; h < nh; h++)
        for (g = 0; g < G; g++) {
            const int64_t hq = (hk0 + h) * G + g;
            for (t = 0; t < nt; t++) {
                const int64_t rs = h * R + g * nt + t;   /* state row */
                if (part) {
                    float *pr = part + h * pstride + (g * nt + t) * (D + 2);
                    pr[0] = mx[rs];
                    pr[1] = sm[rs];
                    memcpy(pr + 2, acc + rs * D, (size_t)D * sizeof(float));
                } else {
                    float *o = a->out + ((b * a->Hq + hq) * a->Sq + t0 + t) * D;
                    if (sm[rs] != 0.f) {   /* > 0, or NaN: a NaN row */
                        float inv = 1.f / sm[rs];
                        int64_t i;
                        for (i = 0; i < D; i++) o[i] = acc[rs * D + i] * inv;
                    } else {
                        memset(o, 0, (size_t)D * sizeof(float));
                    }
                }
            }
        }
    return nbytes;
#undef OKV_PAGE_AT
}

/* The units.  The native unit (returns 0) calls one function per element
 * format, each inlining the body once with its format a constant (three
 * bodies in one function optimise worse); float32 at the AVX-512 level is the
 * AVX2 unit (attention_tiles_avx512.h).  The mixed unit returns the bytes of
 * quantized codes and header entries it loaded. */
#define OKV_NATIVE_UNIT(name, fmt)                                   \
    OKV_NOINLINE OKV_ATTR static int64_t OKV_I(name)(OKV_UNIT_ARGS) { \
        return OKV_I(okv_attn_unit_body)(OKV_UNIT_PASS, fmt, 0); }
OKV_NATIVE_UNIT(okv_attn_unit_f16, OKV_FMT_F16)
OKV_NATIVE_UNIT(okv_attn_unit_bf16, OKV_FMT_BF16)
#ifndef OKV_SIMD512
OKV_NATIVE_UNIT(okv_attn_unit_f32, OKV_FMT_F32)
#endif

OKV_ATTR int64_t OKV_I(okv_attn_unit_native)(OKV_UNIT_ARGS) {
    if (a->kv_type == OKV_KV_F16) return OKV_I(okv_attn_unit_f16)(OKV_UNIT_PASS);
    if (a->kv_type == OKV_KV_BF16) return OKV_I(okv_attn_unit_bf16)(OKV_UNIT_PASS);
#ifdef OKV_SIMD512
    return okv_attn_unit_native_avx2(OKV_UNIT_PASS);
#else
    return OKV_I(okv_attn_unit_f32)(OKV_UNIT_PASS);
#endif
}
OKV_ATTR int64_t OKV_I(okv_attn_unit_mixed)(OKV_UNIT_ARGS) { return OKV_I(okv_attn_unit_body)(OKV_UNIT_PASS, OKV_FMT_F32, 1); }

#undef OKV_NATIVE_UNIT
#undef OKV_UNIT_PASS
#undef OKV_UNIT_ARGS
#undef OKV_ILV_FMT
#undef OKV_I
#undef OKV_UNIT_AMX
#undef OKV_SFX
#undef OKV_ATTR
#undef OKV_SIMD512
