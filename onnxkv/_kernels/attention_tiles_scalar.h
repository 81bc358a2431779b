/* onnxkv/_kernels/attention_tiles_scalar.h -- the portable tiles of the
 * attention work units: okv_qk_rows_scalar and okv_pv_rows_scalar, the
 * contracts of their AVX2 counterparts (attention_tiles_avx2.h), each K / V
 * element converted once and used by all nr rows.
 */
#ifndef ONNXKV_ATTENTION_TILES_SCALAR_H
#define ONNXKV_ATTENTION_TILES_SCALAR_H

#include "attention_kv.h"
#include "attention_types.h"

/* s[r*OKV_BK + j] = scale * q_r . k_j (two partial sums per row). */
OKV_INLINE void okv_qk_rows_scalar(const float *const *qr, int nr, const char *k, int64_t n, int64_t D, float scale,
                                   float *s, const okv_pf *pf, const int fmt) {
    const int64_t rb = okv_fmt_row_bytes(fmt, D);
    int64_t j, d;
    int r;
    (void)pf;
    for (j = 0; j < n; j++) {
        const char *kj = k + j * rb;
        float a0[OKV_RG], a1[OKV_RG];
        for (r = 0; r < nr; r++) { a0[r] = 0.f; a1[r] = 0.f; }
        for (d = 0; d + 2 <= D; d += 2) {
            const float x0 = okv_kv_ld1(kj, d, fmt, 0, NULL, NULL), x1 = okv_kv_ld1(kj, d + 1, fmt, 0, NULL, NULL);
            for (r = 0; r < nr; r++) {
                a0[r] += qr[r][d] * x0;
                a1[r] += qr[r][d + 1] * x1;
            }
        }
        if (d < D) {
            const float x0 = okv_kv_ld1(kj, d, fmt, 0, NULL, NULL);
            for (r = 0; r < nr; r++) a0[r] += qr[r][d] * x0;
        }
        for (r = 0; r < nr; r++) s[r * OKV_BK + j] = (a0[r] + a1[r]) * scale;
    }
}

/* acc rows accr[r] += sum_j p[r*OKV_BK + j] * v_j. */
OKV_INLINE void okv_pv_rows_scalar(const float *p, int nr, const char *v, int64_t n, int64_t D, float *const *accr,
                                   const okv_dq *dq, const okv_pf *pf, const int fmt, const int pc) {
    const int64_t rb = okv_fmt_row_bytes(fmt, D);
    const float *dqs = pc ? dq->s : NULL, *dqz = pc ? dq->z : NULL;
    int64_t j, d;
    int r;
    (void)pf;
    for (j = 0; j < n; j++) {
        const char *vj = v + j * rb;
        float pj[OKV_RG];
        for (r = 0; r < nr; r++) pj[r] = p[r * OKV_BK + j];
        for (d = 0; d < D; d++) {
            const float x = okv_kv_ld1(vj, d, fmt, pc, dqs, dqz);
            for (r = 0; r < nr; r++) accr[r][d] += pj[r] * x;
        }
    }
}

#endif /* ONNXKV_ATTENTION_TILES_SCALAR_H */
