/* onnxkv/_kernels/attention_tiles_avx2.h -- the AVX2+FMA+F16C tiles of the
 * attention work units (8 lanes): the scores of up to OKV_RG query rows
 * against a tile of keys (okv_qk_rows_avx2) and the probabilities times a
 * tile of values added to their accumulators (okv_pv_rows_avx2), for K/V rows
 * of page format fmt (attention_kv.h; pc: per-channel dequantization, values
 * only).  The AVX-512 tiles take float32 K/V from here (the stream is memory
 * bound: 8 lanes keep up with it) and the 8-lane chunk of a head size with D
 * % 16 >= 8.
 *
 * Every K row and every V row of a tile is loaded (and converted to float32)
 * once per row group and used by all its rows: the q.k dot products of all
 * rows share one K load, the p*v multiply-adds of all rows share one V load.
 * The tile functions are always inlined, so that each (format, rows) case
 * is its own loop nest with a constant format and row count.
 */
#ifndef ONNXKV_ATTENTION_TILES_AVX2_H
#define ONNXKV_ATTENTION_TILES_AVX2_H

#include "attention_kv.h"
#include "attention_softmax.h"
#include "attention_types.h"

#if OKV_X86_SIMD
/* Scores of keys j..j+KJ-1 (those < n) of a tile step for the nr rows, from
 * the reduced dot products tmp (accumulator kk*NRP + r in lane kk*NRP + r,
 * or with lane16 in lane OKV_HSUM16_LANE(kk*NRP + r); elements 0..Dv-1, Dv =
 * D rounded down to 8) plus the elements Dv..D-1, times scale.  Shared by the
 * AVX2 and AVX-512 score tiles (keys load raw: fmt, no dequantization). */
OKV_INLINE void okv_qk_store(const float *tmp, const float *const *qr, int nr, const char *const *kp, int64_t j,
                             int64_t n, int64_t D, float scale, float *s, const int NRP, const int KJ,
                             const int lane16, const int fmt) {
    const int64_t Dv = D & ~(int64_t)7;
    int64_t d;
    int kk, r;
#define OKV_QK_LANE(a) (lane16 ? OKV_HSUM16_LANE(a) : (a))
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
            for (d = Dv; d < D; d++) x += qr[r][d] * okv_kv_ld1(kp[kk], d, fmt, 0, NULL, NULL);
            s[r * OKV_BK + j + kk] = x * scale;
        }
    }
#undef OKV_QK_LANE
}

/* Scores of nr <= 8 rows against n keys at k (rows padded to NRP in {1, 2,
 * 4, 8}; 8/NRP keys per step so that 8 accumulators are live and one
 * transposing reduction yields 8 dot products). */
OKV_INLINE OKV_AVX2 void okv_qk_tile_avx2(const float *const *qr, int nr, const char *k, int64_t n, int64_t D,
                                          float scale, float *s, const okv_pf *pf, const int NRP, const int fmt) {
    const int KJ = 8 / NRP;
    const int64_t Dv = D & ~(int64_t)7, rb = okv_fmt_row_bytes(fmt, D);
    int64_t j, i;
    int kk, r;
    float tmp[8];
    for (j = 0; j < n; j += KJ) {
        const char *kp[8];
        __m256 acc[8];
        for (kk = 0; kk < KJ; kk++) kp[kk] = k + (j + kk < n ? j + kk : n - 1) * rb;
        okv_pf_rows(pf, j, KJ);
        for (r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        for (i = 0; i < Dv; i += 8) {
            __m256 kv[8];
            for (kk = 0; kk < KJ; kk++) kv[kk] = okv_kv_ld8(kp[kk], i, fmt, 0, NULL, NULL);
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
        okv_qk_store(tmp, qr, nr, kp, j, n, D, scale, s, NRP, KJ, 0, fmt);
    }
}

/* s[r*OKV_BK + j] = scale * q_r . k_j for the nr <= OKV_RG rows qr and the n
 * <= OKV_BK keys at k (raw codes for quantized formats); pf: rows to
 * software-prefetch along the tile.  Always inlined: every unit (and the
 * per-format dispatchers) gets its own copy, with no call in its key loop. */
OKV_INLINE OKV_AVX2 void okv_qk_rows_avx2(const float *const *qr, int nr, const char *k, int64_t n, int64_t D,
                                          float scale, float *s, const okv_pf *pf, const int fmt) {
    const float *q8[8];
    int r;
    for (r = 0; r < 8; r++) q8[r] = qr[r < nr ? r : 0];   /* padded rows: computed, discarded */
    if (nr == 1)      okv_qk_tile_avx2(q8, nr, k, n, D, scale, s, pf, 1, fmt);
    else if (nr == 2) okv_qk_tile_avx2(q8, nr, k, n, D, scale, s, pf, 2, fmt);
    else if (nr <= 4) okv_qk_tile_avx2(q8, nr, k, n, D, scale, s, pf, 4, fmt);
    else              okv_qk_tile_avx2(q8, nr, k, n, D, scale, s, pf, 8, fmt);
}

/* acc_r[i0:i1] += sum_j p[r*OKV_BK + j] * v_j[i0:i1] for NR rows, NC vector
 * chunks per pass: NR*NC accumulators in registers, each V chunk loaded and
 * converted once and used by every row.  pf (or NULL): its pf->n rows
 * software-prefetched along the first pass, row by row (okv_pf_rows). */
OKV_INLINE OKV_AVX2 void okv_pv_tile_avx2(const float *p, const char *v, int64_t n, int64_t D, float *const *accr,
                                          int64_t i0, int64_t i1, const okv_dq *dq, const int NR, const int NC,
                                          const okv_pf *pf, const int fmt, const int pc) {
    const int64_t rb = okv_fmt_row_bytes(fmt, D);
    const float *dqs = pc ? dq->s : NULL, *dqz = pc ? dq->z : NULL;
    int64_t i, j, pfr = 0, pfc = 0;   /* prefetch: rows issued, their error term */
    int r, c;
    for (i = i0; i + 8 * NC <= i1; i += 8 * NC) {
        const char *vi = v + i * okv_fmt_bits(fmt) / 8;   /* the chunk's column: constant offsets in the loop */
        const float *dqsi = pc ? dqs + i : NULL, *dqzi = pc ? dqz + i : NULL;
        __m256 acc[8][8];
        for (r = 0; r < NR; r++)
            for (c = 0; c < NC; c++) acc[r][c] = _mm256_loadu_ps(accr[r] + i + 8 * c);
        for (j = 0; j < n; j++) {
            const char *vj = vi + j * rb;
            __m256 vv[8];
            for (c = 0; c < NC; c++) vv[c] = okv_kv_ld8(vj, 8 * c, fmt, pc, dqsi, dqzi);
            if (pf && i == i0)   /* the m rows of pf spread over the first pass: up to row (j + 1) m / n */
                for (pfc += pf->n; pfc >= n; pfc -= n) okv_pf_rows(pf, pfr++, 1);
            for (r = 0; r < NR; r++) {
                const __m256 pr = _mm256_set1_ps(p[r * OKV_BK + j]);
                for (c = 0; c < NC; c++) acc[r][c] = _mm256_fmadd_ps(pr, vv[c], acc[r][c]);
            }
        }
        for (r = 0; r < NR; r++)
            for (c = 0; c < NC; c++) _mm256_storeu_ps(accr[r] + i + 8 * c, acc[r][c]);
    }
}

/* The last D % 8 elements of the NR rows, scalar. */
OKV_INLINE void okv_pv_tail(const float *p, const char *v, int64_t n, int64_t D, float *const *accr,
                            const okv_dq *dq, const int NR, const int fmt, const int pc) {
    const int64_t Dv = D & ~(int64_t)7, rb = okv_fmt_row_bytes(fmt, D);
    const float *dqs = pc ? dq->s : NULL, *dqz = pc ? dq->z : NULL;
    int64_t j, d;
    int r;
    for (j = 0; j < n; j++)
        for (d = Dv; d < D; d++) {
            float x = okv_kv_ld1(v + j * rb, d, fmt, pc, dqs, dqz);
            for (r = 0; r < NR; r++) accr[r][d] += p[r * OKV_BK + j] * x;
        }
}

/* Whole rows: NC-chunk passes, single-chunk passes, the last D % 8 elements
 * scalar. */
OKV_INLINE OKV_AVX2 void okv_pv_nr_avx2(const float *p, const char *v, int64_t n, int64_t D, float *const *accr,
                                        const okv_dq *dq, const int NR, const int NC, const okv_pf *pf,
                                        const int fmt, const int pc) {
    const int64_t Dn = D & ~(int64_t)7, Dw = Dn - Dn % (8 * NC);
    if (Dw == 0 && pf) okv_pf_rows(pf, 0, (int)pf->n);   /* no NC-chunk pass to spread it over */
    okv_pv_tile_avx2(p, v, n, D, accr, 0, Dw, dq, NR, NC, Dw ? pf : NULL, fmt, pc);
    if (Dw < Dn) okv_pv_tile_avx2(p, v, n, D, accr, Dw, Dn, dq, NR, 1, NULL, fmt, pc);
    if (Dn < D) okv_pv_tail(p, v, n, D, accr, dq, NR, fmt, pc);
}

/* acc rows accr[r] += sum_j p[r*OKV_BK + j] * v_j for the nr <= OKV_RG rows
 * and the n <= OKV_BK values at v (dq: the head's per-channel scales and zero
 * points when pc); vector chunks per pass by the row count (8 accumulators
 * for 1..4 rows, NC = 1 beyond). */
OKV_INLINE OKV_AVX2 void okv_pv_rows_avx2(const float *p, int nr, const char *v, int64_t n, int64_t D,
                                          float *const *accr, const okv_dq *dq, const okv_pf *pf, const int fmt,
                                          const int pc) {
    switch (nr) {
    case 1: okv_pv_nr_avx2(p, v, n, D, accr, dq, 1, 8, pf, fmt, pc); break;
    case 2: okv_pv_nr_avx2(p, v, n, D, accr, dq, 2, 4, pf, fmt, pc); break;
    case 3: okv_pv_nr_avx2(p, v, n, D, accr, dq, 3, 2, pf, fmt, pc); break;
    case 4: okv_pv_nr_avx2(p, v, n, D, accr, dq, 4, 2, pf, fmt, pc); break;
    case 5: okv_pv_nr_avx2(p, v, n, D, accr, dq, 5, 1, pf, fmt, pc); break;
    case 6: okv_pv_nr_avx2(p, v, n, D, accr, dq, 6, 1, pf, fmt, pc); break;
    case 7: okv_pv_nr_avx2(p, v, n, D, accr, dq, 7, 1, pf, fmt, pc); break;
    default: okv_pv_nr_avx2(p, v, n, D, accr, dq, 8, 1, pf, fmt, pc); break;
    }
}
#endif /* OKV_X86_SIMD */

#endif /* ONNXKV_ATTENTION_TILES_AVX2_H */
