/* onnxkv/_kernels/attention_impl.h -- body of one attention work unit.
 *
 * Three instruction sets: scalar, AVX2+FMA+F16C (8-lane tiles) and AVX-512
 * F/BW/VL/DQ (16-lane tiles; attention.h picks one per call from the CPU check
 * and the switches of attention.pyx).  The SIMD tiles share the p*v tile and
 * the score store through the vector macros OKV_VEC / OKV_VW / ... below; the
 * score tiles differ in their reduction (AVX2: hadd tree of 8 dot products,
 * AVX-512: okv_hsum16x16 of 16).
 *
 * Included once per (instruction set, K/V element format) by attention.h and
 * attention_quant.h with
 *   OKV_SFX   _scalar | _avx2 | _avx512    OKV_ATTR  target attribute (or empty)
 *   OKV_KT    f32 | f16 | bf16 | quantized format + scale mode (attention_quant.h) | mixed
 *   OKV_KT_T  storage unit: float | uint16_t | uint8_t (packed codes)
 *   OKV_RS(D) storage units from one token's row to the next (D, or D*bits/8 bytes)
 *   OKV_LD1(p, d) element d of the row at p as float32 (dequantized with *dq)
 *   OKV_LD8(p, i) elements i..i+7 of the row at p as __m256 (AVX2 and AVX-512; i % 8 == 0)
 *   OKV_LD16(p, i) elements i..i+15 of the row at p as __m512 (AVX-512 only; i % 16 == 0)
 *   OKV_DQ_INIT   (optional) locals the loaders of a quantized format use, from dq
 *   OKV_SIMD_BODY defined for the AVX2 instantiations, OKV_SIMD512 for the AVX-512 ones
 *     (and OKV_SIMD512_AMX there when the build has the AMX tiles, OKV_HAVE_AMX).
 *   OKV_TILES_ONLY: only the tile functions (okv_qk_rows, okv_pv_rows), no unit.
 *   OKV_PV_ONLY: of the tile functions, only okv_pv_rows (per-channel quantized
 *     formats: their keys are scored by the per-head tiles, attention_quant.h).
 *   OKV_MIXED: only the unit, for per-page formats: every tile dispatches to the
 *     tile functions of its page's format (okv_qk_fmt / okv_pv_fmt of
 *     attention_quant.h) and the unit returns the bytes of quantized codes and
 *     header entries it loaded.
 *
 * A work unit is (batch b, kv heads [hk0, hk0+nh), query tokens [t0, t1), keys
 * [c0, c1)).  Per KV head hk, the G = Hq/Hkv query heads of the group and the
 * nt = t1-t0 query tokens form R = G*nt rows (r = g*nt + t); the heads are
 * taken one after the other inside each block (a multi-head unit reads a
 * page's heads in memory order, front to back).  Keys are streamed in blocks
 * (tiles) of up to OKV_BK keys that never straddle a page (okv_attn_page: one
 * page lookup per page; a contiguous cache is one page) and start at a key
 * some token of the unit sees, so keys and pages no token sees are skipped and
 * their page table entries never read.  With per-page formats (OKV_MIXED) the
 * page's format, read once per page by okv_attn_qpage, selects the tile
 * loader of every tile of that page.  Inside a block the rows are taken in row groups (up
 * to OKV_RG = 8 rows for decode, a->prefill_rg = 4 rows when the unit has
 * several query tokens), and for each
 * row group every K row and every V row of the block is loaded (and converted
 * to float32) exactly once in registers and used by all rows of the group: the
 * q.k dot products of all rows share one K load, the p*v axpys of all rows
 * share one V load.  Decode (Sq = 1) with G <= 8 is one row group, so each K/V
 * byte is read from memory and converted once per token; with G > 8 or in
 * prefill, further row groups re-read the block from L1.  The next block is
 * software-prefetched (into L2 by default, through its own page) while the
 * current one is scored; with AMX key scores, which take a fraction of the
 * time of the others, only the first a->pf_qk_lines cache lines of each
 * item's share go with its key tiles, the rest spread over the p*v of the
 * item before (a burst of prefetches stalls the loads behind it).
 * Online softmax per row (running max, sum and accumulator in float32); a
 * NaN or +inf visible score sets the row's max and sum to NaN, which the final
 * normalisation (and okv_attn_merge) turn into a NaN row (attention.h).
 *
 * K/V tile functions take dq (scale / zero point of the head in a quantized
 * page; unused for float formats) and pf (the rows to software-prefetch).
 * ws: float workspace of okv_attn_ws_floats(nh*R, D) floats (attention.h).
 * Returns the bytes of quantized codes and header entries loaded (OKV_MIXED;
 * 0 for the single-format units).
 * part == NULL: normalise and write out[b, hk*G+g, t, :].
 * part != NULL: write the unnormalised partial state per row of head hk0+h as
 *               part[h*pstride + r*(D+2) + 0] = running max, [1] = sum,
 *               [2..] = acc.
 */
#define OKV_CAT_(a, b) a##b
#define OKV_CAT(a, b) OKV_CAT_(a, b)
#define OKV_CAT3_(a, b, c) a##_##b##c
#define OKV_CAT3(a, b, c) OKV_CAT3_(a, b, c)
/* name + instruction set (dtype independent primitives of simd.h) */
#define OKV_I(name) OKV_CAT(name, OKV_SFX)
/* name + element type + instruction set */
#define OKV_F(name) OKV_CAT3(name, OKV_KT, OKV_SFX)

#ifndef OKV_MIXED
#ifndef OKV_DQ_INIT
#define OKV_DQ_DEFAULT
#define OKV_DQ_INIT (void)dq;
#endif
#if defined(OKV_SIMD512) || defined(OKV_SIMD_BODY)
/* The vector of this instruction set: OKV_VW float lanes of OKV_VEC, loaded /
 * stored / broadcast / multiply-added by OKV_VLD / OKV_VST / OKV_VSET1 /
 * OKV_VFMA; OKV_LDV(p, i) the elements i..i+OKV_VW-1 of a K/V row.  After a
 * score reduction, the dot product of accumulator a sits in lane
 * OKV_QK_LANE(a).  OKV_PV_NC(nr): vector chunks per p*v pass for nr rows. */
#ifdef OKV_SIMD512
#define OKV_VW 16
#define OKV_VEC __m512
#define OKV_VLD _mm512_loadu_ps
#define OKV_VST _mm512_storeu_ps
#define OKV_VSET1 _mm512_set1_ps
#define OKV_VFMA _mm512_fmadd_ps
#define OKV_LDV OKV_LD16
#define OKV_QK_LANE(a) OKV_HSUM16_LANE(a)
#define OKV_PV_NC(nr) ((nr) <= 4 ? 4 : 2)
#else
#define OKV_VW 8
#define OKV_VEC __m256
#define OKV_VLD _mm256_loadu_ps
#define OKV_VST _mm256_storeu_ps
#define OKV_VSET1 _mm256_set1_ps
#define OKV_VFMA _mm256_fmadd_ps
#define OKV_LDV OKV_LD8
#define OKV_QK_LANE(a) (a)
#define OKV_PV_NC(nr) ((nr) == 1 ? 8 : (nr) == 2 ? 4 : (nr) <= 4 ? 2 : 1)
#endif

#ifndef OKV_PV_ONLY
/* Scores of keys j..j+KJ-1 (those < n) of a tile step for the nr rows, from
 * the reduced dot products tmp (accumulator kk*NRP + r in lane
 * OKV_QK_LANE(kk*NRP + r), elements 0..Dv-1, Dv = D rounded down to 8) plus the
 * elements Dv..D-1, times scale. */
OKV_INLINE OKV_ATTR void OKV_F(okv_qk_store)(const float *tmp, const float *const *qr, int nr,
                                             const OKV_KT_T *const *kp, int64_t j, int64_t n, int64_t D,
                                             float scale, float *s, const okv_dq *dq, const int NRP, const int KJ) {
    const int64_t Dv = D & ~(int64_t)7;
    int64_t d;
    int kk, r;
    OKV_DQ_INIT
    if (Dv == D && j + KJ <= n) {   /* common case: constant-trip scatter of the scaled sums */
        for (kk = 0; kk < KJ; kk++)
            for (r = 0; r < NRP; r++)
                if (r < nr) s[r * OKV_BK + j + kk] = tmp[OKV_QK_LANE(kk * NRP + r)] * scale;
        return;
    }
    for (kk = 0; kk < KJ; kk++) {
        if (j + kk >= n) break;
        for (r = 0; r < nr; r++) {
            float x = tmp[OKV_QK_LANE(kk * NRP + r)];
            for (d = Dv; d < D; d++) x += qr[r][d] * OKV_LD1(kp[kk], d);
            s[r * OKV_BK + j + kk] = x * scale;
        }
    }
}

#ifdef OKV_SIMD512
/* ---- AVX-512: a step of the scores: 16 (W = 16) or 8 (W = 8, zero-extended
 * to 16 lanes) elements from i of NRP rows against KJ keys, into the
 * accumulators acc[kk*NRP + r]; each K chunk is loaded and converted once. */
OKV_INLINE OKV_ATTR void OKV_F(okv_qk_step)(const float *const *qr, const OKV_KT_T *const *kp, int64_t i,
                                            __m512 *acc, const okv_dq *dq, const int NRP, const int KJ,
                                            const int W) {
    __m512 qv[8];
    int kk, r;
    OKV_DQ_INIT
    for (r = 0; r < NRP; r++)   /* the q chunks of all rows live, one K chunk at a time */
        qv[r] = W == 16 ? _mm512_loadu_ps(qr[r] + i) : _mm512_maskz_loadu_ps(0xFF, qr[r] + i);
    for (kk = 0; kk < KJ; kk++) {
        const __m512 kv = W == 16 ? OKV_LD16(kp[kk], i) : _mm512_zextps256_ps512(OKV_LD8(kp[kk], i));
        for (r = 0; r < NRP; r++) acc[kk * NRP + r] = _mm512_fmadd_ps(qv[r], kv, acc[kk * NRP + r]);
    }
}

/* ---- AVX-512: scores of nr <= 8 rows against n keys (rows padded to NRP in
 * {1, 2, 4, 8}; 16/NRP keys per step so that 16 accumulators are live and one
 * transposing reduction yields 16 dot products).  Head sizes: 16-lane chunks,
 * one 8-lane chunk if D % 16 >= 8, the last D % 8 elements scalar. */
OKV_INLINE OKV_ATTR void OKV_F(okv_qk_tile)(const float *const *qr, int nr, const OKV_KT_T *k, int64_t n, int64_t D,
                                            float scale, float *s, const okv_dq *dq, const okv_pf *pf,
                                            const int NRP) {
    const int KJ = 16 / NRP;
    const int64_t D16 = D & ~(int64_t)15, Dv = D & ~(int64_t)7;
    int64_t j, i;
    int kk, r;
    float tmp[16];
    for (j = 0; j < n; j += KJ) {
        const OKV_KT_T *kp[16];
        __m512 acc[16], sum;
        for (kk = 0; kk < KJ; kk++) kp[kk] = k + (j + kk < n ? j + kk : n - 1) * OKV_RS(D);
        okv_pf_rows(pf, j, KJ);
        for (r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        for (i = 0; i < D16; i += 16) OKV_F(okv_qk_step)(qr, kp, i, acc, dq, NRP, KJ, 16);
        if (Dv > D16) OKV_F(okv_qk_step)(qr, kp, D16, acc, dq, NRP, KJ, 8);
        sum = okv_hsum16x16(acc);
        if (NRP == 4 && Dv == D && j + KJ <= n) {   /* lane 4r + kk: row r's 4 scores in 128-bit block r */
            sum = _mm512_mul_ps(sum, _mm512_set1_ps(scale));
            _mm_storeu_ps(s + j, _mm512_castps512_ps128(sum));
            _mm_storeu_ps(s + OKV_BK + j, _mm512_extractf32x4_ps(sum, 1));
            _mm_storeu_ps(s + 2 * OKV_BK + j, _mm512_extractf32x4_ps(sum, 2));
            if (nr > 3) _mm_storeu_ps(s + 3 * OKV_BK + j, _mm512_extractf32x4_ps(sum, 3));
            continue;
        }
        _mm512_storeu_ps(tmp, sum);
        OKV_F(okv_qk_store)(tmp, qr, nr, kp, j, n, D, scale, s, dq, NRP, KJ);
    }
}
#else
/* ---- AVX2: scores of nr <= 8 rows against n keys (rows padded to NRP in
 * {1, 2, 4, 8}; 8/NRP keys per step so that 8 accumulators are live and one
 * transposing reduction yields 8 dot products). */
OKV_INLINE OKV_ATTR void OKV_F(okv_qk_tile)(const float *const *qr, int nr, const OKV_KT_T *k, int64_t n, int64_t D,
                                            float scale, float *s, const okv_dq *dq, const okv_pf *pf,
                                            const int NRP) {
    const int KJ = 8 / NRP;
    const int64_t Dv = D & ~(int64_t)7;
    int64_t j, i;
    int kk, r;
    float tmp[8];
    OKV_DQ_INIT
    for (j = 0; j < n; j += KJ) {
        const OKV_KT_T *kp[8];
        __m256 acc[8];
        for (kk = 0; kk < KJ; kk++) kp[kk] = k + (j + kk < n ? j + kk : n - 1) * OKV_RS(D);
        okv_pf_rows(pf, j, KJ);
        for (r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        for (i = 0; i < Dv; i += 8) {
            __m256 kv[8];
            for (kk = 0; kk < KJ; kk++) kv[kk] = OKV_LD8(kp[kk], i);
            for (r = 0; r < NRP; r++) {          /* one q chunk live at a time */
                const __m256 qv = _mm256_loadu_ps(qr[r] + i);
                for (kk = 0; kk < KJ; kk++) acc[kk * NRP + r] = _mm256_fmadd_ps(qv, kv[kk], acc[kk * NRP + r]);
            }
        }
        {
            __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
            __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
            __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
            _mm256_storeu_ps(tmp, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                                _mm256_permute2f128_ps(u0, u1, 0x31)));
        }
        OKV_F(okv_qk_store)(tmp, qr, nr, kp, j, n, D, scale, s, dq, NRP, KJ);
    }
}
#endif

/* Always inlined: every unit (and the per-format dispatchers) gets its own
 * copy; one shared out-of-line copy measured ~10% slower on float32 decode. */
OKV_INLINE OKV_ATTR void OKV_F(okv_qk_rows)(const float *const *qr, int nr, const OKV_KT_T *k, int64_t n, int64_t D,
                                            float scale, float *s, const okv_dq *dq, const okv_pf *pf) {
    const float *q8[8];
    int r;
    for (r = 0; r < 8; r++) q8[r] = qr[r < nr ? r : 0];   /* padded rows: computed, discarded */
    if (nr == 1)      OKV_F(okv_qk_tile)(q8, nr, k, n, D, scale, s, dq, pf, 1);
    else if (nr == 2) OKV_F(okv_qk_tile)(q8, nr, k, n, D, scale, s, dq, pf, 2);
    else if (nr <= 4) OKV_F(okv_qk_tile)(q8, nr, k, n, D, scale, s, dq, pf, 4);
    else              OKV_F(okv_qk_tile)(q8, nr, k, n, D, scale, s, dq, pf, 8);
}
#endif /* !OKV_PV_ONLY */

/* ---- acc_r[i0:i1] += sum_j p[r*OKV_BK + j] * v_j[i0:i1] for NR rows, NC
 * vector chunks per pass: NR*NC accumulators in registers, each V chunk loaded
 * and converted once and used by every row.  pf (or NULL): its pf->n rows
 * software-prefetched along the first pass, row by row (okv_pf_rows). */
OKV_INLINE OKV_ATTR void OKV_F(okv_pv_tile)(const float *p, const OKV_KT_T *v, int64_t n, int64_t D,
                                            float *const *accr, int64_t i0, int64_t i1, const okv_dq *dq,
                                            const int NR, const int NC, const okv_pf *pf) {
    int64_t i, j, pfr = 0, pfc = 0;   /* prefetch: rows issued, their error term */
    int r, c;
    OKV_DQ_INIT
    for (i = i0; i + OKV_VW * NC <= i1; i += OKV_VW * NC) {
        OKV_VEC acc[8][8];
        for (r = 0; r < NR; r++)
            for (c = 0; c < NC; c++) acc[r][c] = OKV_VLD(accr[r] + i + OKV_VW * c);
        for (j = 0; j < n; j++) {
            const OKV_KT_T *vj = v + j * OKV_RS(D);
            OKV_VEC vv[8];
            for (c = 0; c < NC; c++) vv[c] = OKV_LDV(vj, i + OKV_VW * c);
            if (pf && i == i0)   /* the m rows of pf spread over the first pass: up to row (j + 1) m / n */
                for (pfc += pf->n; pfc >= n; pfc -= n) okv_pf_rows(pf, pfr++, 1);
            for (r = 0; r < NR; r++) {
                const OKV_VEC pr = OKV_VSET1(p[r * OKV_BK + j]);
                for (c = 0; c < NC; c++) acc[r][c] = OKV_VFMA(pr, vv[c], acc[r][c]);
            }
        }
        for (r = 0; r < NR; r++)
            for (c = 0; c < NC; c++) OKV_VST(accr[r] + i + OKV_VW * c, acc[r][c]);
    }
}

/* Whole rows: NC-chunk passes, single-chunk passes, (AVX-512) one 8-lane pass
 * by the AVX2 tile if D % 16 >= 8, the last D % 8 elements scalar. */
OKV_INLINE OKV_ATTR void OKV_F(okv_pv_nr)(const float *p, const OKV_KT_T *v, int64_t n, int64_t D,
                                          float *const *accr, const okv_dq *dq, const int NR, const int NC,
                                          const okv_pf *pf) {
    const int64_t Dn = D & ~(int64_t)(OKV_VW - 1), Dv = D & ~(int64_t)7, Dw = Dn - Dn % (OKV_VW * NC);
    int64_t j, d;
    int r;
    OKV_DQ_INIT
    if (Dw == 0 && pf) okv_pf_rows(pf, 0, (int)pf->n);   /* no NC-chunk pass to spread it over */
    OKV_F(okv_pv_tile)(p, v, n, D, accr, 0, Dw, dq, NR, NC, Dw ? pf : NULL);
    if (Dw < Dn) OKV_F(okv_pv_tile)(p, v, n, D, accr, Dw, Dn, dq, NR, 1, NULL);
#ifdef OKV_SIMD512
    if (Dn < Dv) OKV_CAT3(okv_pv_tile, OKV_KT, _avx2)(p, v, n, D, accr, Dn, Dv, dq, NR, 1, NULL);
#endif
    if (Dv < D)
        for (j = 0; j < n; j++)
            for (d = Dv; d < D; d++) {
                float x = OKV_LD1(v + j * OKV_RS(D), d);
                for (r = 0; r < NR; r++) accr[r][d] += p[r * OKV_BK + j] * x;
            }
}

OKV_INLINE OKV_ATTR void OKV_F(okv_pv_rows)(const float *p, int nr, const OKV_KT_T *v, int64_t n, int64_t D,
                                            float *const *accr, const okv_dq *dq, const okv_pf *pf) {
    switch (nr) {
    case 1: OKV_F(okv_pv_nr)(p, v, n, D, accr, dq, 1, OKV_PV_NC(1), pf); break;
    case 2: OKV_F(okv_pv_nr)(p, v, n, D, accr, dq, 2, OKV_PV_NC(2), pf); break;
    case 3: OKV_F(okv_pv_nr)(p, v, n, D, accr, dq, 3, OKV_PV_NC(3), pf); break;
    case 4: OKV_F(okv_pv_nr)(p, v, n, D, accr, dq, 4, OKV_PV_NC(4), pf); break;
    case 5: OKV_F(okv_pv_nr)(p, v, n, D, accr, dq, 5, OKV_PV_NC(5), pf); break;
    case 6: OKV_F(okv_pv_nr)(p, v, n, D, accr, dq, 6, OKV_PV_NC(6), pf); break;
    case 7: OKV_F(okv_pv_nr)(p, v, n, D, accr, dq, 7, OKV_PV_NC(7), pf); break;
    default: OKV_F(okv_pv_nr)(p, v, n, D, accr, dq, 8, OKV_PV_NC(8), pf); break;
    }
}
#undef OKV_VW
#undef OKV_VEC
#undef OKV_VLD
#undef OKV_VST
#undef OKV_VSET1
#undef OKV_VFMA
#undef OKV_LDV
#undef OKV_QK_LANE
#undef OKV_PV_NC

#else
#ifndef OKV_PV_ONLY
/* ---- scalar: each K element converted once, used by all nr rows. */
static void OKV_F(okv_qk_rows)(const float *const *qr, int nr, const OKV_KT_T *k, int64_t n, int64_t D,
                               float scale, float *s, const okv_dq *dq, const okv_pf *pf) {
    int64_t j, d;
    int r;
    (void)pf;
    OKV_DQ_INIT
    for (j = 0; j < n; j++) {
        const OKV_KT_T *kj = k + j * OKV_RS(D);
        float a0[OKV_RG], a1[OKV_RG];
        for (r = 0; r < nr; r++) { a0[r] = 0.f; a1[r] = 0.f; }
        for (d = 0; d + 2 <= D; d += 2) {
            const float x0 = OKV_LD1(kj, d), x1 = OKV_LD1(kj, d + 1);
            for (r = 0; r < nr; r++) {
                a0[r] += qr[r][d] * x0;
                a1[r] += qr[r][d + 1] * x1;
            }
        }
        if (d < D) {
            const float x0 = OKV_LD1(kj, d);
            for (r = 0; r < nr; r++) a0[r] += qr[r][d] * x0;
        }
        for (r = 0; r < nr; r++) s[r * OKV_BK + j] = (a0[r] + a1[r]) * scale;
    }
}
#endif

/* each V element converted once, used by all nr rows */
static void OKV_F(okv_pv_rows)(const float *p, int nr, const OKV_KT_T *v, int64_t n, int64_t D, float *const *accr,
                               const okv_dq *dq, const okv_pf *pf) {
    int64_t j, d;
    int r;
    (void)pf;
    OKV_DQ_INIT
    for (j = 0; j < n; j++) {
        const OKV_KT_T *vj = v + j * OKV_RS(D);
        float pj[OKV_RG];
        for (r = 0; r < nr; r++) pj[r] = p[r * OKV_BK + j];
        for (d = 0; d < D; d++) {
            const float x = OKV_LD1(vj, d);
            for (r = 0; r < nr; r++) accr[r][d] += pj[r] * x;
        }
    }
}
#endif
#endif /* !OKV_MIXED */

#ifndef OKV_TILES_ONLY
OKV_ATTR static int64_t OKV_F(okv_attn_unit)(const okv_attn_args *a, int64_t b, int64_t hk0, int64_t nh, int64_t t0,
                                          int64_t t1, int64_t c0, int64_t c1, float *ws, float *part,
                                          int64_t pstride) {
    const int64_t D = a->D, G = a->Hq / a->Hkv, nt = t1 - t0, R = G * nt, RT = nh * R;
    const int64_t kvl = a->kv_len[b], kvs = a->kv_start ? a->kv_start[b] : 0;
#ifdef OKV_MIXED
#define OKV_PAGE_AT(j) okv_attn_qpage(a, b, hk0, j)
    int64_t nbytes = 0;               /* quantized codes and header entries loaded */
#else
#define OKV_PAGE_AT(j) okv_attn_page(a, b, hk0, j, sizeof(OKV_KT_T))
#endif
    okv_kv_page pg, pf;               /* page of the current tile, page of the prefetched tile */
    float *acc = ws;                  /* RT*D */
    float *sc = acc + RT * D;         /* 2*OKV_RG*OKV_BK: two score slots (work items w, w+1) */
    float *mx = sc + 2 * OKV_RG * OKV_BK;   /* RT */
    float *sm = mx + RT;              /* RT */
#ifdef OKV_MIXED
    float *qsum = sm + RT;            /* RT: sum of each query row (per-head key zero points) */
    float *zc = qsum + RT;            /* RT: per-head value zero-point correction of each row */
    float *qb = zc + RT;              /* OKV_RG*D: query rows with per-channel key scales folded in */
    float *qi = qb + OKV_RG * D;      /* RT*D: query rows in the interleaved order (4-bit keys, AVX-512) */
    float *acci = qi + RT * D;        /* RT*D: accumulators in that order (4-bit values, AVX-512) */
    int acci_used = 0;                /* set at the first tile that needs them */
#ifdef OKV_SIMD512
    int qi_ready = 0;
#endif
#ifdef OKV_SIMD512_AMX
    okv_amx_ws ax;                    /* a->amx: scratch and B tiles of the AMX key scores */
#endif
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
#ifdef OKV_MIXED
    for (r = 0; r < RT; r++) {   /* state row r = h*R + g*nt + t */
        const int64_t rh = r / R, rg = r % R;
        qsum[r] = okv_sum8_f32(a->q + ((b * a->Hq + (hk0 + rh) * G + rg / nt) * a->Sq + t0 + rg % nt) * D, D);
        zc[r] = 0.f;
    }
#endif

#if defined(OKV_MIXED) && defined(OKV_SIMD512_AMX)
    if (a->amx) {   /* B tiles per (head, row group) item, after the float workspace; tiles configured */
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
#ifdef OKV_MIXED
            nbytes += nh * (pg.khb + pg.vhb);
#endif
        }
        j1 = j0 + OKV_BK;
        if (j1 > pg.end) j1 = pg.end;
        if (j1 > jhi) j1 = jhi;
        kt = pg.k + (j0 - pg.start) * pg.kst;    /* head hk0, key j at kt + (j - j0)*kst */
        vt = pg.v + (j0 - pg.start) * pg.vst;
#ifdef OKV_MIXED
        nbytes += nh * (j1 - j0) * ((pg.ksc ? pg.kst : 0) + (pg.vsc ? pg.vst : 0));
#endif
        if (a->prefetch) {   /* the tile pfd tiles ahead, if some token sees its first key */
            const int64_t pfd = a->prefetch >= 3 ? a->prefetch - 1 : 1, p0 = j1 + (pfd - 1) * OKV_BK;
            if (p0 < jhi && okv_next_seen(lo, hi, nt, p0) == p0) {
                if (p0 >= pf.end || p0 < pf.start) {
                    pf = p0 >= pg.start && p0 < pg.end ? pg : OKV_PAGE_AT(p0);
#if defined(OKV_MIXED) && OKV_X86_SIMD
                    okv_pf_header(a, &pf, nh);
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
#if defined(OKV_MIXED) && defined(OKV_SIMD512_AMX)
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
#ifdef OKV_MIXED
                float *accir[OKV_RG];
#endif
            } it[2];
            int64_t w;
            for (w = 0; w <= nw; w++) {
#if defined(OKV_MIXED) && defined(OKV_SIMD512)
                okv_pf pend = nopf;   /* item w's prefetch rows left to item w - 1's p*v (AMX keys; see the top) */
#endif
                if (w < nw) {   /* item w: its rows, visible keys and scores */
                    const int64_t hw = w / ngr, rg = (w % ngr) * rgw, hk = hk0 + hw;
                    const char *kh = kt + hw * pg.khs;
                    const int nr = (int)(R - rg < rgw ? R - rg : rgw);
                    const float *qr[OKV_RG];
#ifdef OKV_MIXED
                    const float *qir[OKV_RG];
#endif
                    int64_t u0 = j1, u1 = j0;
                    int i;
                    for (i = 0; i < nr; i++) {
                        int64_t rr = rg + i, tt = rr % nt, a0 = lo[tt] > j0 ? lo[tt] : j0;
                        int64_t a1 = hi[tt] < j1 ? hi[tt] : j1;
                        g = rr / nt;
                        qr[i] = a->q + ((b * a->Hq + hk * G + g) * a->Sq + t0 + tt) * D;
                        it[w & 1].accr[i] = acc + (hw * R + rr) * D;
#ifdef OKV_MIXED
                        qir[i] = qi + (hw * R + rr) * D;
                        it[w & 1].accir[i] = acci + (hw * R + rr) * D;
#endif
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
#if defined(OKV_MIXED) && defined(OKV_SIMD512)
                        const okv_pf pfn = {pft.k ? pft.k + hw * pf.khs : NULL, pft.v ? pft.v + hw * pf.vhs : NULL,
                                            pft.ks, pft.vs, pft.n, pft.hint};
                        const okv_pf *pfp = rg != 0                  ? &nopf
                                            : a->amx                ? &pfn
                                            : hw + 1 == nh          ? &pft
                                                                    : &pfh;
#else
                        const okv_pf *pfp = rg != 0 ? &nopf : hw + 1 == nh ? &pft : &pfh;
#endif
                        float *sw = sc + (w & 1) * OKV_RG * OKV_BK;
#ifdef OKV_MIXED
                        const okv_dq dk = okv_dq_head(a, &pg, 1, hw);
#ifdef OKV_SIMD512
                        if (!qi_ready && a->kG == 1 && OKV_ILV_FMT(pg.kf)) {   /* every row of the unit, once */
                            for (r = 0; r < RT; r++) {
                                const int64_t rh = r / R, rq = r % R;
                                okv_q4_to_ilv(a->q + ((b * a->Hq + (hk0 + rh) * G + rq / nt) * a->Sq + t0 + rq % nt) * D,
                                              qi + r * D, D);
                            }
                            qi_ready = 1;
                        }
#endif
#ifdef OKV_SIMD512_AMX
                        /* AMX key scores: per-head key scales, or per-channel ones of 8-bit codes */
                        if (a->amx && okv_q_bits(pg.kf) && (a->kG == 1 || okv_q_bits(pg.kf) == 8)) {
                            okv_pf pfa = *pfp;
                            if (pfa.n > pf_nq) {
                                pend = pfa;
                                pend.k += pf_nq * pend.ks;
                                pend.v += pf_nq * pend.vs;
                                pend.n -= pf_nq;
                                pfa.n = pf_nq;
                            }
                            okv_qk_amx(&ax, w, pg.kf, a->kG > 1, qr, nr, kh + (u0 - j0) * pg.kst, pg.kst, u1 - u0,
                                       D, scale, sw, &dk, &pfa, qsum + hw * R + rg);
                            /* a query row with a NaN or an infinity (its sum is not finite) has no
                             * fixed-point form: its scores are NaN, as its float dot products would be */
                            for (i = 0; i < nr; i++)
                                if (!isfinite(qsum[hw * R + rg + i]))
                                    for (j = 0; j < u1 - u0; j++) sw[i * OKV_BK + j] = NAN;
                        } else
#endif
                        OKV_I(okv_qk_fmt)(pg.kf, a->kG > 1, qr, qir, nr, kh + (u0 - j0) * pg.kst, u1 - u0, D, scale,
                                          sw, &dk, pfp, qb, qsum + hw * R + rg);
#else
                        OKV_F(okv_qk_rows)(qr, nr, (const OKV_KT_T *)(kh + (u0 - j0) * pg.kst), u1 - u0, D, scale,
                                           sw, NULL, pfp);
#endif
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
#ifdef OKV_MIXED
                    float *const *accir = it[(w - 1) & 1].accir;
                    const okv_dq dv = okv_dq_head(a, &pg, 0, hw);
#endif
                    int i;
                    for (i = 0; i < nr; i++) {
                        int64_t rr = rg + i, tt = rr % nt, a0 = lo[tt] > u0 ? lo[tt] : u0;
                        int64_t a1 = hi[tt] < u1 ? hi[tt] : u1;
                        float *s = sw + i * OKV_BK, bm, mnew;
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
#ifdef OKV_MIXED
                                zc[hw * R + rr] *= alpha;
                                if (acci_used) OKV_I(okv_scal_f32)(alpha, accir[i], D);
#endif
                            }
                            mxh[rr] = mnew;
                        }
                        smh[rr] += OKV_I(okv_exp_sub_sum_f32)(s, mnew, n);   /* -inf -> 0 */
                    }
#ifdef OKV_MIXED
                    {
                        if (!acci_used && a->vG == 1 && OKV_ILV_FMT(pg.vf)) {
                            memset(acci, 0, (size_t)(RT * D) * sizeof(float));
                            acci_used = 1;
                        }
#ifdef OKV_SIMD512
                        const okv_pf *pvp = pend.n ? &pend : NULL;
#else
                        const okv_pf *pvp = NULL;
#endif
                        OKV_I(okv_pv_fmt)(pg.vf, a->vG > 1, sw, nr, vh + (u0 - j0) * pg.vst, n, D, accr, accir,
                                          &dv, zc + hw * R + rg, pvp);
#ifdef OKV_SIMD512
                        pend.n = 0;
#endif
                        /* The value zero points' share at once, into the accumulators the tile summed
                         * into (4-bit per-head tiles: the interleaved ones on [0, D & ~15), where a
                         * constant is the same in either order), not at the end of the work unit:
                         * over thousands of keys the sums of p s c and of p s z grow far past their
                         * difference and cancel in float32 (~3e-5 from the twin over 3000 uint4 keys). */
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
#else
                    OKV_F(okv_pv_rows)(sw, nr, (const OKV_KT_T *)(vh + (u0 - j0) * pg.vst), n, D, accr, NULL, NULL);
#endif
                }
#if defined(OKV_MIXED) && defined(OKV_SIMD512)
                okv_pf_rows(&pend, 0, (int)pend.n);   /* no p*v of item w - 1 took them */
#endif
            }
        }
    }

#ifdef OKV_MIXED
#ifdef OKV_SIMD512_AMX
    if (a->amx) okv_amx_end();   /* the tiles released */
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
#endif
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
#ifdef OKV_MIXED
    return nbytes;
#else
    return 0;
#endif
}
#undef OKV_PAGE_AT
#endif /* !OKV_TILES_ONLY */

#ifdef OKV_DQ_DEFAULT
#undef OKV_DQ_DEFAULT
#undef OKV_DQ_INIT
#endif
#undef OKV_F
#undef OKV_I
