/* onnxkv/_kernels/attention_tiles_avx512.h -- the AVX-512 F/BW/VL/DQ tiles of
 * the attention work units (16 lanes): okv_qk_rows_avx512 and
 * okv_pv_rows_avx512, the contracts of their AVX2 counterparts
 * (attention_tiles_avx2.h).  Float32 K/V take the AVX2 tiles: streaming
 * float32 is memory bound, and 8 lanes keep up with it.
 *
 * Scores: 16 accumulators live (16/NRP keys per step for rows padded to NRP
 * in {1, 2, 4, 8}) and one transposing reduction (okv_hsum16x16) yields 16
 * dot products.  Head sizes: 16-lane chunks, one 8-lane chunk if D % 16 >=
 * 8, the last D % 8 elements scalar.  Raw 4-bit codes load in the
 * interleaved lane order on [0, D & ~15) (attention_kv.h).
 */
#ifndef ONNXKV_ATTENTION_TILES_AVX512_H
#define ONNXKV_ATTENTION_TILES_AVX512_H

#include "attention_tiles_avx2.h"

#if OKV_X86_SIMD
/* A step of the scores: 16 (W = 16) or 8 (W = 8, zero-extended to 16 lanes)
 * elements from i of NRP rows against KJ keys, into the accumulators
 * acc[kk*NRP + r]; each K chunk is loaded and converted once. */
OKV_INLINE OKV_AVX512BW void okv_qk_step_avx512(const float *const *qr, const char *const *kp, int64_t i,
                                                __m512 *acc, const int NRP, const int KJ, const int W,
                                                const int fmt) {
    __m512 qv[8];
    int kk, r;
    for (r = 0; r < NRP; r++)   /* the q chunks of all rows live, one K chunk at a time */
        qv[r] = W == 16 ? _mm512_loadu_ps(qr[r] + i) : _mm512_maskz_loadu_ps(0xFF, qr[r] + i);
    for (kk = 0; kk < KJ; kk++) {
        const __m512 kv = W == 16 ? okv_kv_ld16(kp[kk], i, fmt, 0, NULL, NULL)
                                  : _mm512_zextps256_ps512(okv_kv_ld8(kp[kk], i, fmt, 0, NULL, NULL));
        for (r = 0; r < NRP; r++) acc[kk * NRP + r] = _mm512_fmadd_ps(qv[r], kv, acc[kk * NRP + r]);
    }
}

/* Scores of nr <= 8 rows against n keys (rows padded to NRP). */
OKV_INLINE OKV_AVX512BW void okv_qk_tile_avx512(const float *const *qr, int nr, const char *k, int64_t n, int64_t D,
                                                float scale, float *s, const okv_pf *pf, const int NRP,
                                                const int fmt) {
    const int KJ = 16 / NRP;
    const int64_t D16 = D & ~(int64_t)15, Dv = D & ~(int64_t)7, rb = okv_fmt_row_bytes(fmt, D);
    int64_t j, i;
    int kk, r;
    float tmp[16];
    for (j = 0; j < n; j += KJ) {
        const char *kp[16];
        __m512 acc[16], sum;
        for (kk = 0; kk < KJ; kk++) kp[kk] = k + (j + kk < n ? j + kk : n - 1) * rb;
        okv_pf_rows(pf, j, KJ);
        for (r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        for (i = 0; i < D16; i += 16) okv_qk_step_avx512(qr, kp, i, acc, NRP, KJ, 16, fmt);
        if (Dv > D16) okv_qk_step_avx512(qr, kp, D16, acc, NRP, KJ, 8, fmt);
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
        okv_qk_store(tmp, qr, nr, kp, j, n, D, scale, s, NRP, KJ, 1, fmt);
    }
}

/* okv_qk_rows_avx2 on 16 lanes (float32 keys: the AVX2 tiles). */
OKV_INLINE OKV_AVX512BW void okv_qk_rows_avx512(const float *const *qr, int nr, const char *k, int64_t n, int64_t D,
                                                float scale, float *s, const okv_pf *pf, const int fmt) {
    const float *q8[8];
    int r;
    if (fmt == OKV_FMT_F32) {
        okv_qk_rows_avx2(qr, nr, k, n, D, scale, s, pf, fmt);
        return;
    }
    for (r = 0; r < 8; r++) q8[r] = qr[r < nr ? r : 0];   /* padded rows: computed, discarded */
    if (nr == 1)      okv_qk_tile_avx512(q8, nr, k, n, D, scale, s, pf, 1, fmt);
    else if (nr == 2) okv_qk_tile_avx512(q8, nr, k, n, D, scale, s, pf, 2, fmt);
    else if (nr <= 4) okv_qk_tile_avx512(q8, nr, k, n, D, scale, s, pf, 4, fmt);
    else              okv_qk_tile_avx512(q8, nr, k, n, D, scale, s, pf, 8, fmt);
}

/* okv_pv_tile_avx2 on 16 lanes. */
OKV_INLINE OKV_AVX512BW void okv_pv_tile_avx512(const float *p, const char *v, int64_t n, int64_t D,
                                                float *const *accr, int64_t i0, int64_t i1, const okv_dq *dq,
                                                const int NR, const int NC, const okv_pf *pf, const int fmt,
                                                const int pc) {
    const int64_t rb = okv_fmt_row_bytes(fmt, D);
    const float *dqs = pc ? dq->s : NULL, *dqz = pc ? dq->z : NULL;
    int64_t i, j, pfr = 0, pfc = 0;   /* prefetch: rows issued, their error term */
    int r, c;
    for (i = i0; i + 16 * NC <= i1; i += 16 * NC) {
        const char *vi = v + i * okv_fmt_bits(fmt) / 8;   /* the chunk's column: constant offsets in the loop */
        const float *dqsi = pc ? dqs + i : NULL, *dqzi = pc ? dqz + i : NULL;
        __m512 acc[8][8];
        for (r = 0; r < NR; r++)
            for (c = 0; c < NC; c++) acc[r][c] = _mm512_loadu_ps(accr[r] + i + 16 * c);
        for (j = 0; j < n; j++) {
            const char *vj = vi + j * rb;
            __m512 vv[8];
            for (c = 0; c < NC; c++) vv[c] = okv_kv_ld16(vj, 16 * c, fmt, pc, dqsi, dqzi);
            if (pf && i == i0)   /* the m rows of pf spread over the first pass: up to row (j + 1) m / n */
                for (pfc += pf->n; pfc >= n; pfc -= n) okv_pf_rows(pf, pfr++, 1);
            for (r = 0; r < NR; r++) {
                const __m512 pr = _mm512_set1_ps(p[r * OKV_BK + j]);
                for (c = 0; c < NC; c++) acc[r][c] = _mm512_fmadd_ps(pr, vv[c], acc[r][c]);
            }
        }
        for (r = 0; r < NR; r++)
            for (c = 0; c < NC; c++) _mm512_storeu_ps(accr[r] + i + 16 * c, acc[r][c]);
    }
}

/* Whole rows: NC-chunk passes, single-chunk passes, one 8-lane pass by the
 * AVX2 tile if D % 16 >= 8, the last D % 8 elements scalar. */
OKV_INLINE OKV_AVX512BW void okv_pv_nr_avx512(const float *p, const char *v, int64_t n, int64_t D,
                                              float *const *accr, const okv_dq *dq, const int NR, const int NC,
                                              const okv_pf *pf, const int fmt, const int pc) {
    const int64_t Dn = D & ~(int64_t)15, Dv = D & ~(int64_t)7, Dw = Dn - Dn % (16 * NC);
    if (Dw == 0 && pf) okv_pf_rows(pf, 0, (int)pf->n);   /* no NC-chunk pass to spread it over */
    okv_pv_tile_avx512(p, v, n, D, accr, 0, Dw, dq, NR, NC, Dw ? pf : NULL, fmt, pc);
    if (Dw < Dn) okv_pv_tile_avx512(p, v, n, D, accr, Dw, Dn, dq, NR, 1, NULL, fmt, pc);
    if (Dn < Dv) okv_pv_tile_avx2(p, v, n, D, accr, Dn, Dv, dq, NR, 1, NULL, fmt, pc);
    if (Dv < D) okv_pv_tail(p, v, n, D, accr, dq, NR, fmt, pc);
}

/* okv_pv_rows_avx2 on 16 lanes (float32 values: the AVX2 tiles); 4 vector
 * chunks per pass for 1..4 rows, 2 beyond. */
OKV_INLINE OKV_AVX512BW void okv_pv_rows_avx512(const float *p, int nr, const char *v, int64_t n, int64_t D,
                                                float *const *accr, const okv_dq *dq, const okv_pf *pf,
                                                const int fmt, const int pc) {
    if (fmt == OKV_FMT_F32) {
        okv_pv_rows_avx2(p, nr, v, n, D, accr, dq, pf, fmt, pc);
        return;
    }
    switch (nr) {
    case 1: okv_pv_nr_avx512(p, v, n, D, accr, dq, 1, 4, pf, fmt, pc); break;
    case 2: okv_pv_nr_avx512(p, v, n, D, accr, dq, 2, 4, pf, fmt, pc); break;
    case 3: okv_pv_nr_avx512(p, v, n, D, accr, dq, 3, 4, pf, fmt, pc); break;
    case 4: okv_pv_nr_avx512(p, v, n, D, accr, dq, 4, 4, pf, fmt, pc); break;
    case 5: okv_pv_nr_avx512(p, v, n, D, accr, dq, 5, 2, pf, fmt, pc); break;
    case 6: okv_pv_nr_avx512(p, v, n, D, accr, dq, 6, 2, pf, fmt, pc); break;
    case 7: okv_pv_nr_avx512(p, v, n, D, accr, dq, 7, 2, pf, fmt, pc); break;
    default: okv_pv_nr_avx512(p, v, n, D, accr, dq, 8, 2, pf, fmt, pc); break;
    }
}
#endif /* OKV_X86_SIMD */

#endif /* ONNXKV_ATTENTION_TILES_AVX512_H */
