/* onnxkv/_kernels/qmatmul_x86.h -- the x86 SIMD paths of qmatmul.h (AVX2, AVX-VNNI, AVX-512 VNNI).
 *
 * Included by qmatmul.h only, after the argument struct, the scalar kernels
 * and the activation helpers it uses; qmatmul.h holds the arithmetic
 * contract every path here follows and the dispatch (okv_qmm_range).  Each
 * function carries its target attribute: nothing is built with -mavx2, and a
 * path runs only when the CPU checks of qmatmul.h say it can.
 */
#ifndef ONNXKV_QMATMUL_X86_H
#define ONNXKV_QMATMUL_X86_H
#if OKV_X86_SIMD

/* ------------------------------------------------------------------ */
/* 8-column paths (AVX2 and AVX-VNNI)                                   */
/* ------------------------------------------------------------------ */

static inline int32_t okv_qmm_x4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* One 8-column tile body: MR rows x NH half-panels (8 columns each; half h is
 * columns 8 (h & 1).. of panel p + (h >> 1)), int8 path.  DOT(acc, w_u8, x_s8)
 * adds the 4-way dot products of every int32 lane to acc: of w or, OFF = 128, of
 * w - 128, whose block sums get OFF * xsum back (exact int32: |xsum| <= 256 * 127). */
#define OKV_QMM_I8_256_BODY(DOT, OFF)                                                                        \
    const int64_t LB = okv_qmm_lb(a), ldq = a->nblk * a->bs, pstride = a->nblk * LB;                               \
    const __m256i nib = _mm256_set1_epi8(0x0F);                                                                    \
    __m256 accf[2][4];                                                                                             \
    int64_t b, j;                                                                                                  \
    int r, h;                                                                                                      \
    for (r = 0; r < MR; r++)                                                                                       \
        for (h = 0; h < NH; h++) accf[r][h] = _mm256_setzero_ps();                                                 \
    for (b = 0; b < a->nblk; b++) {                                                                                \
        __m256i acc[2][4];                                                                                         \
        const uint8_t *w0 = a->qw + p * pstride + b * LB;                                                          \
        for (r = 0; r < MR; r++)                                                                                   \
            for (h = 0; h < NH; h++) acc[r][h] = _mm256_setzero_si256();                                           \
        for (j = 0; j < a->bs / 4; j += 2) {                                                                       \
            __m256i xa[2], xb[2];                                                                                  \
            for (r = 0; r < MR; r++) {                                                                             \
                const int8_t *xr = a->xq + (m0 + r) * ldq + b * a->bs + 4 * j;                                     \
                xa[r] = _mm256_set1_epi32(okv_qmm_x4(xr));                                                         \
                xb[r] = _mm256_set1_epi32(okv_qmm_x4(xr + 4));                                                     \
            }                                                                                                      \
            for (h = 0; h < NH; h++) {                                                                             \
                const uint8_t *wl = w0 + (h >> 1) * pstride + 32 * (h & 1);                                        \
                __m256i wa, wb;                                                                                    \
                if (a->bits == 4) {                                                                                \
                    const __m256i L = _mm256_loadu_si256((const __m256i *)(wl + 32 * j));                          \
                    wa = _mm256_and_si256(L, nib);                                                                 \
                    wb = _mm256_and_si256(_mm256_srli_epi16(L, 4), nib);                                           \
                } else {                                                                                           \
                    wa = _mm256_loadu_si256((const __m256i *)(wl + 64 * j));                                       \
                    wb = _mm256_loadu_si256((const __m256i *)(wl + 64 * j + 64));                                  \
                }                                                                                                  \
                for (r = 0; r < MR; r++) {                                                                         \
                    acc[r][h] = DOT(acc[r][h], wa, xa[r]);                                                         \
                    acc[r][h] = DOT(acc[r][h], wb, xb[r]);                                                         \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (h = 0; h < NH; h++) {                                                                                 \
            const int64_t o = ((p + (h >> 1)) * a->nblk + b) * 16 + 8 * (h & 1);                                  \
            const __m256 s = _mm256_loadu_ps(a->sc + o);                                                           \
            const __m256 z = a->zp ? _mm256_loadu_ps(a->zp + o) : _mm256_set1_ps(a->zconst);                       \
            for (r = 0; r < MR; r++) {                                                                             \
                const int64_t mb = (m0 + r) * a->nblk + b;                                                         \
                const __m256i d = OFF ? _mm256_add_epi32(acc[r][h], _mm256_set1_epi32(OFF * (int32_t)a->xsum[mb])) \
                                      : acc[r][h];                                                                 \
                const __m256 t = _mm256_fnmadd_ps(z, _mm256_set1_ps(a->xsum[mb]), _mm256_cvtepi32_ps(d));          \
                accf[r][h] = _mm256_fmadd_ps(t, _mm256_mul_ps(s, _mm256_set1_ps(a->xs[mb])), accf[r][h]);          \
            }                                                                                                      \
        }                                                                                                          \
    }                                                                                                              \
    for (h = 0; h < NH; h++) okv_qmm_store8(a, m0, MR, p * 16 + 8 * h, accf, h);

/* Stores accf[r][h] for rows m0..m0+MR-1 at columns n0..n0+7 (fewer at N), plus bias. */
OKV_AVX2 static inline __attribute__((always_inline)) void
okv_qmm_store8(const okv_qmm *a, int64_t m0, const int MR, int64_t n0, __m256 accf[2][4], int h) {
    float tmp[8];
    int r, c;
    for (r = 0; r < MR; r++) {
        __m256 v = accf[r][h];
        if (n0 + 8 <= a->N) {
            if (a->bias) v = _mm256_add_ps(v, _mm256_loadu_ps(a->bias + n0));
            _mm256_storeu_ps(a->out + (m0 + r) * a->N + n0, v);
        } else {
            _mm256_storeu_ps(tmp, v);
            for (c = 0; n0 + c < a->N; c++) okv_qmm_store_col(a, m0 + r, n0 + c, tmp[c]);
        }
    }
}

/* VPMADDUBSW pairs into int16 (no saturation: |q x| <= 15 * 127 or, signed, 128 * 127), VPMADDWD into int32. */
#define OKV_QMM_DOT_MADDUBS(acc, w, x) \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((w), (x)), _mm256_set1_epi16(1)))
/* 8-bit weights, by the sign trick on w - 128 (as s8): VPMADDUBSW of |w - 128| (u8, up to 128) and x with the
 * sign of w - 128 (x in [-127, 127]: pairs <= 2 * 128 * 127, no saturation); the caller adds 128 * xsum. */
#define OKV_QMM_DOT_SIGNED(acc, w, x)                                                                              \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16(                                              \
                                                  _mm256_abs_epi8(_mm256_xor_si256((w), _mm256_set1_epi8(-128))), \
                                                  _mm256_sign_epi8((x), _mm256_xor_si256((w), _mm256_set1_epi8(-128)))), \
                                              _mm256_set1_epi16(1)))

OKV_AVX2 static inline __attribute__((always_inline)) void
okv_qmm_i8_avx2_tile(const int MR, const int NH, const okv_qmm *a, int64_t p, int64_t m0) {
    if (a->bits == 4) {
        OKV_QMM_I8_256_BODY(OKV_QMM_DOT_MADDUBS, 0)
    } else {
        OKV_QMM_I8_256_BODY(OKV_QMM_DOT_SIGNED, 128)
    }
}

#if OKV_HAVE_VNNI
#define OKV_QMM_DOT_VNNI256(acc, w, x) _mm256_dpbusd_avx_epi32((acc), (w), (x))
OKV_AVXVNNI static inline __attribute__((always_inline)) void
okv_qmm_i8_avxvnni_tile(const int MR, const int NH, const okv_qmm *a, int64_t p, int64_t m0) {
    OKV_QMM_I8_256_BODY(OKV_QMM_DOT_VNNI256, 0)
}
#endif

/* lut[i] for 8 codes i (0..15) from the two halves of a 16-entry codebook. */
OKV_AVX2 static inline __attribute__((always_inline)) __m256 okv_qmm_lut8(__m256i i, __m256 lo, __m256 hi) {
    const __m256 a = _mm256_permutevar8x32_ps(lo, i), b = _mm256_permutevar8x32_ps(hi, i);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28))); /* bit 3 of i picks hi */
}

/* Float path, 8 columns: MR rows x NH half-panels; LUT: codes stand for a->lut[q] (a constant argument). */
OKV_AVX2 static inline __attribute__((always_inline)) void
okv_qmm_f32_avx2_tile(const int MR, const int NH, const int LUT, const okv_qmm *a, int64_t p, int64_t m0) {
    const int64_t LB = okv_qmm_lb(a), ldx = a->nblk * a->bs, pstride = a->nblk * LB;
    const __m256i lowb = _mm256_set1_epi32(0xFF), nib = _mm256_set1_epi8(0x0F);
    const __m256 lut_lo = LUT ? _mm256_loadu_ps(a->lut) : _mm256_setzero_ps();
    const __m256 lut_hi = LUT ? _mm256_loadu_ps(a->lut + 8) : _mm256_setzero_ps();
    __m256 accf[2][4], bad = _mm256_setzero_ps();
    int64_t b, j;
    int r, h, kk;
    for (r = 0; r < MR; r++)
        for (h = 0; h < NH; h++) accf[r][h] = _mm256_setzero_ps();
    for (b = 0; b < a->nblk; b++) {
        __m256 d[2][4];
        const uint8_t *w0 = a->qw + p * pstride + b * LB;
        for (r = 0; r < MR; r++)
            for (h = 0; h < NH; h++) d[r][h] = _mm256_setzero_ps();
        for (j = 0; j < a->bs / 4; j += 2)
            for (h = 0; h < NH; h++) {
                const uint8_t *wl = w0 + (h >> 1) * pstride + 32 * (h & 1);
                __m256i w[2];
                if (a->bits == 4) {
                    const __m256i L = _mm256_loadu_si256((const __m256i *)(wl + 32 * j));
                    w[0] = _mm256_and_si256(L, nib);
                    w[1] = _mm256_and_si256(_mm256_srli_epi16(L, 4), nib);
                } else {
                    w[0] = _mm256_loadu_si256((const __m256i *)(wl + 64 * j));
                    w[1] = _mm256_loadu_si256((const __m256i *)(wl + 64 * j + 64));
                }
                for (kk = 0; kk < 8; kk++) {
                    const __m256i code = _mm256_and_si256(_mm256_srli_epi32(w[kk >> 2], 8 * (kk & 3)), lowb);
                    const __m256 wf = LUT ? okv_qmm_lut8(code, lut_lo, lut_hi) : _mm256_cvtepi32_ps(code);
                    for (r = 0; r < MR; r++)
                        d[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(a->x[(m0 + r) * ldx + b * a->bs + 4 * j + kk]), wf,
                                                  d[r][h]);
                }
            }
        for (h = 0; h < NH; h++) {
            const int64_t o = ((p + (h >> 1)) * a->nblk + b) * 16 + 8 * (h & 1);
            const __m256 s = _mm256_loadu_ps(a->sc + o);
            const __m256 z = a->zp ? _mm256_loadu_ps(a->zp + o) : _mm256_set1_ps(a->zconst);
            for (r = 0; r < MR; r++) {
                const __m256 t = _mm256_fnmadd_ps(z, _mm256_set1_ps(a->xsum[(m0 + r) * a->nblk + b]), d[r][h]);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(t, t), _mm256_setzero_ps(), _CMP_NEQ_UQ));
                accf[r][h] = _mm256_fmadd_ps(t, s, accf[r][h]);
            }
        }
    }
    if (_mm256_movemask_ps(bad)) { /* an inf or NaN t: the tile by the scalar contract, exact there */
        okv_qmm_f32_redo(a, p * 16, p * 16 + 8 * NH, m0, MR);
        return;
    }
    for (h = 0; h < NH; h++) okv_qmm_store8(a, m0, MR, p * 16 + 8 * h, accf, h);
}

/* ------------------------------------------------------------------ */
/* 16-column path (AVX-512 VNNI)                                         */
/* ------------------------------------------------------------------ */
#if OKV_HAVE_VNNI
/* MR rows x NP panels; the low- and high-nibble (or even- and odd-line) dot
 * products go to separate accumulators so each VPDPBUSD chain is half as long.
 * 4-bit high nibbles enter masked in place, as 16 q (no shift per line; VPDPBUSD
 * does not saturate), and their sum is divided by 16 exactly once per block. */
OKV_VNNI512 static inline __attribute__((always_inline)) void
okv_qmm_i8_512_body(const int MR, const int NP, const int BITS, const int BS, const okv_qmm *a, int64_t p,
                    int64_t m0) {
    const int bits = BITS ? BITS : a->bits;
    const int64_t bs = BS ? BS : a->bs, LB = 16 * bs * bits / 8, ldq = a->nblk * bs, pstride = a->nblk * LB;
    const __m512i nib = _mm512_set1_epi8(0x0F);
    __m512 accf[4][4];
    int64_t b, j;
    int r, q;
    for (r = 0; r < MR; r++)
        for (q = 0; q < NP; q++) accf[r][q] = _mm512_setzero_ps();
    for (b = 0; b < a->nblk; b++) {
        __m512i lo[4][4], hi[4][4];
        const uint8_t *w0 = a->qw + p * pstride + b * LB;
        for (r = 0; r < MR; r++)
            for (q = 0; q < NP; q++) lo[r][q] = hi[r][q] = _mm512_setzero_si512();
        for (j = 0; j < bs / 4; j += 2) {
            __m512i xa[4], xb[4];
            for (r = 0; r < MR; r++) {
                const int8_t *xr = a->xq + (m0 + r) * ldq + b * bs + 4 * j;
                xa[r] = _mm512_set1_epi32(okv_qmm_x4(xr));
                xb[r] = _mm512_set1_epi32(okv_qmm_x4(xr + 4));
            }
            for (q = 0; q < NP; q++) {
                __m512i wa, wb;
                if (bits == 4) {
                    const __m512i L = _mm512_loadu_si512((const void *)(w0 + q * pstride + 32 * j));
                    wa = _mm512_and_si512(L, nib);
                    wb = _mm512_andnot_si512(nib, L); /* 16 x the high nibble: no shift (port 0) per line */
                } else {
                    wa = _mm512_loadu_si512((const void *)(w0 + q * pstride + 64 * j));
                    wb = _mm512_loadu_si512((const void *)(w0 + q * pstride + 64 * j + 64));
                }
                for (r = 0; r < MR; r++) {
                    lo[r][q] = _mm512_dpbusd_epi32(lo[r][q], wa, xa[r]);
                    hi[r][q] = _mm512_dpbusd_epi32(hi[r][q], wb, xb[r]);
                }
            }
        }
        for (q = 0; q < NP; q++) {
            const int64_t o = ((p + q) * a->nblk + b) * 16;
            const __m512 s = _mm512_loadu_ps(a->sc + o);
            const __m512 z = a->zp ? _mm512_loadu_ps(a->zp + o) : _mm512_set1_ps(a->zconst);
            for (r = 0; r < MR; r++) {
                const int64_t mb = (m0 + r) * a->nblk + b;
                const __m512 t = _mm512_fnmadd_ps(z, _mm512_set1_ps(a->xsum[mb]),
                                                  _mm512_cvtepi32_ps(_mm512_add_epi32(lo[r][q], bits == 4
                                                      ? _mm512_srai_epi32(hi[r][q], 4) : hi[r][q])));
                accf[r][q] = _mm512_fmadd_ps(t, _mm512_mul_ps(s, _mm512_set1_ps(a->xs[mb])), accf[r][q]);
            }
        }
    }
    for (q = 0; q < NP; q++) {
        const int64_t n0 = (p + q) * 16;
        const __mmask16 mask = n0 + 16 <= a->N ? (__mmask16)0xFFFF : (__mmask16)((1u << (a->N - n0)) - 1);
        const __m512 bv = a->bias ? _mm512_maskz_loadu_ps(mask, a->bias + n0) : _mm512_setzero_ps();
        for (r = 0; r < MR; r++)
            _mm512_mask_storeu_ps(a->out + (m0 + r) * a->N + n0, mask, _mm512_add_ps(accf[r][q], bv));
    }
}
/* The tile for the two shapes the exporters emit (4 and 8 bits, block 32) with both fixed at compile
 * time, so the line loop unrolls and no bit-width test stays inside it; any other block size reads them
 * from a. */
#define OKV_QMM_I8_512_T4(MR, NP, a, p, m0) okv_qmm_i8_512_body(MR, NP, 4, 32, a, p, m0)
#define OKV_QMM_I8_512_T8(MR, NP, a, p, m0) okv_qmm_i8_512_body(MR, NP, 8, 32, a, p, m0)
#define OKV_QMM_I8_512_TN(MR, NP, a, p, m0) okv_qmm_i8_512_body(MR, NP, 0, 0, a, p, m0)
#endif /* OKV_HAVE_VNNI */

/* Float path, 16 columns (AVX-512 F; no VNNI needed); LUT as in the 8-column tile. */
OKV_AVX512BW static inline __attribute__((always_inline)) void
okv_qmm_f32_512_tile(const int MR, const int NP, const int LUT, const okv_qmm *a, int64_t p, int64_t m0) {
    const int64_t LB = okv_qmm_lb(a), ldx = a->nblk * a->bs, pstride = a->nblk * LB;
    const __m512i lowb = _mm512_set1_epi32(0xFF), nib = _mm512_set1_epi8(0x0F);
    const __m512 lutv = LUT ? _mm512_loadu_ps(a->lut) : _mm512_setzero_ps();
    __m512 accf[4][4];
    __mmask16 bad = 0;
    int64_t b, j;
    int r, q, kk;
    for (r = 0; r < MR; r++)
        for (q = 0; q < NP; q++) accf[r][q] = _mm512_setzero_ps();
    for (b = 0; b < a->nblk; b++) {
        __m512 d[4][4];
        const uint8_t *w0 = a->qw + p * pstride + b * LB;
        for (r = 0; r < MR; r++)
            for (q = 0; q < NP; q++) d[r][q] = _mm512_setzero_ps();
        for (j = 0; j < a->bs / 4; j += 2)
            for (q = 0; q < NP; q++) {
                __m512i w[2];
                if (a->bits == 4) {
                    const __m512i L = _mm512_loadu_si512((const void *)(w0 + q * pstride + 32 * j));
                    w[0] = _mm512_and_si512(L, nib);
                    w[1] = _mm512_and_si512(_mm512_srli_epi16(L, 4), nib);
                } else {
                    w[0] = _mm512_loadu_si512((const void *)(w0 + q * pstride + 64 * j));
                    w[1] = _mm512_loadu_si512((const void *)(w0 + q * pstride + 64 * j + 64));
                }
                for (kk = 0; kk < 8; kk++) {
                    const __m512i code = _mm512_and_si512(_mm512_srli_epi32(w[kk >> 2], 8 * (kk & 3)), lowb);
                    const __m512 wf = LUT ? _mm512_permutexvar_ps(code, lutv) : _mm512_cvtepi32_ps(code);
                    for (r = 0; r < MR; r++)
                        d[r][q] = _mm512_fmadd_ps(_mm512_set1_ps(a->x[(m0 + r) * ldx + b * a->bs + 4 * j + kk]), wf,
                                                  d[r][q]);
                }
            }
        for (q = 0; q < NP; q++) {
            const int64_t o = ((p + q) * a->nblk + b) * 16;
            const __m512 s = _mm512_loadu_ps(a->sc + o);
            const __m512 z = a->zp ? _mm512_loadu_ps(a->zp + o) : _mm512_set1_ps(a->zconst);
            for (r = 0; r < MR; r++) {
                const __m512 t = _mm512_fnmadd_ps(z, _mm512_set1_ps(a->xsum[(m0 + r) * a->nblk + b]), d[r][q]);
                bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(t, t), _mm512_setzero_ps(), _CMP_NEQ_UQ);
                accf[r][q] = _mm512_fmadd_ps(t, s, accf[r][q]);
            }
        }
    }
    if (bad) { /* an inf or NaN t: the tile by the scalar contract, exact there */
        okv_qmm_f32_redo(a, p * 16, (p + NP) * 16, m0, MR);
        return;
    }
    for (q = 0; q < NP; q++) {
        const int64_t n0 = (p + q) * 16;
        const __mmask16 mask = n0 + 16 <= a->N ? (__mmask16)0xFFFF : (__mmask16)((1u << (a->N - n0)) - 1);
        const __m512 bv = a->bias ? _mm512_maskz_loadu_ps(mask, a->bias + n0) : _mm512_setzero_ps();
        for (r = 0; r < MR; r++)
            _mm512_mask_storeu_ps(a->out + (m0 + r) * a->N + n0, mask, _mm512_add_ps(accf[r][q], bv));
    }
}

/* Dequantized panel rows (okv_qmm_dequant): line by line, each k row of 16
 * (AVX-512) or 8 (AVX2) columns converted (CVT: the code, or lut[code]), shifted by zp and scaled at once. */
#define OKV_QMM_DEQ_BODY(VEC, W, LOADI, LOADF, SET1I, SET1F, AND, SRLI16, SRLI32, CVT, SUB, MUL, STORE)             \
    const int64_t LB = okv_qmm_lb(a), pstride = a->nblk * LB;                                                       \
    int64_t p, b, j, k;                                                                                             \
    int h, kk;                                                                                                      \
    for (p = p0; p < p1; p++)                                                                                       \
        for (b = 0; b < a->nblk; b++)                                                                               \
            for (h = 0; h < 16 / W; h++) {                                                                          \
                const int64_t o = (p * a->nblk + b) * 16 + W * h;                                                   \
                const VEC s = LOADF(a->sc + o);                                                                     \
                const VEC z = a->zp ? LOADF(a->zp + o) : SET1F(a->zconst);                                          \
                const uint8_t *wl = a->qw + p * pstride + b * LB + 4 * W * h;                                       \
                for (j = 0; j < a->bs / 4; j += 2) {                                                                \
                    VEC##i w[2];                                                                                    \
                    if (a->bits == 4) {                                                                             \
                        const VEC##i L = LOADI(wl + 32 * j);                                                        \
                        w[0] = AND(L, SET1I(0x0F0F0F0F));                                                           \
                        w[1] = AND(SRLI16(L, 4), SET1I(0x0F0F0F0F));                                                \
                    } else {                                                                                        \
                        w[0] = LOADI(wl + 64 * j);                                                                  \
                        w[1] = LOADI(wl + 64 * j + 64);                                                             \
                    }                                                                                               \
                    for (kk = 0; kk < 8; kk++) {                                                                    \
                        k = b * a->bs + 4 * j + kk;                                                                 \
                        if (k >= a->K) break;                                                                       \
                        STORE(dst + ((p - p0) * a->K + k) * 16 + W * h,                                             \
                              MUL(SUB(CVT(AND(SRLI32(w[kk >> 2], 8 * (kk & 3)), SET1I(0xFF))), z), s));             \
                    }                                                                                               \
                }                                                                                                   \
            }

OKV_AVX2 static void okv_qmm_dequant_avx2(const okv_qmm *a, int64_t p0, int64_t p1, float *dst) {
#define OKV_QMM_LDI256(ptr) _mm256_loadu_si256((const __m256i *)(ptr))
#define OKV_QMM_ST256(ptr, v) _mm256_storeu_ps((ptr), (v))
#define OKV_QMM_CVT256(code) \
    (a->lut ? okv_qmm_lut8((code), _mm256_loadu_ps(a->lut), _mm256_loadu_ps(a->lut + 8)) : _mm256_cvtepi32_ps(code))
    OKV_QMM_DEQ_BODY(__m256, 8, OKV_QMM_LDI256, _mm256_loadu_ps, _mm256_set1_epi32, _mm256_set1_ps, _mm256_and_si256,
                     _mm256_srli_epi16, _mm256_srli_epi32, OKV_QMM_CVT256, _mm256_sub_ps, _mm256_mul_ps,
                     OKV_QMM_ST256)
}

OKV_AVX512BW static void okv_qmm_dequant_512(const okv_qmm *a, int64_t p0, int64_t p1, float *dst) {
#define OKV_QMM_LDI512(ptr) _mm512_loadu_si512((const void *)(ptr))
#define OKV_QMM_CVT512(code) (a->lut ? _mm512_permutexvar_ps((code), _mm512_loadu_ps(a->lut)) : _mm512_cvtepi32_ps(code))
    OKV_QMM_DEQ_BODY(__m512, 16, OKV_QMM_LDI512, _mm512_loadu_ps, _mm512_set1_epi32, _mm512_set1_ps, _mm512_and_si512,
                     _mm512_srli_epi16, _mm512_srli_epi32, OKV_QMM_CVT512, _mm512_sub_ps, _mm512_mul_ps,
                     _mm512_storeu_ps)
}

/* okv_qmm_quant_block (qmatmul.h) on AVX2 and AVX-512 (bs a multiple of 16;
 * lanes past n load as zero, so they change neither amax nor the sum). */
OKV_AVX2 static void okv_qmm_quant_block_avx2(const float *xb, int64_t n, int64_t bs, int8_t *qb, float *xs,
                                              float *xsum) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), fmax = _mm256_set1_ps(3.4028234663852886e38f);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 vmax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    __m256i isum = _mm256_setzero_si256();
    __m128 h;
    float amax;
    int64_t k;
#define OKV_QMM_LOAD8(k_) _mm256_maskload_ps(xb + (k_), _mm256_cmpgt_epi32(_mm256_set1_epi32( \
        (int)((n - (k_)) < 8 ? ((n - (k_)) > 0 ? (n - (k_)) : 0) : 8)), lane))
    for (k = 0; k < bs; k += 8) {
        const __m256 v = _mm256_and_ps(OKV_QMM_LOAD8(k), absm);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, fmax, _CMP_NLE_UQ));
        vmax = _mm256_max_ps(vmax, v);
    }
    h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    if (_mm256_movemask_ps(bad) || !(127.f / amax <= 3.4028234663852886e38f)) {
        memset(qb, 0, (size_t)bs);
        *xs = _mm256_movemask_ps(bad) ? NAN : 0.f;
        *xsum = 0.f;
        return;
    }
    {
        const __m256 inv = _mm256_set1_ps(127.f / amax), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
        __m128i s4;
        for (k = 0; k < bs; k += 8) {
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(OKV_QMM_LOAD8(k), inv),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256i q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
            isum = _mm256_add_epi32(isum, q);
            _mm_storel_epi64((__m128i *)(qb + k), _mm_packs_epi16(w, w));
        }
        s4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        *xs = amax / 127.f;
        *xsum = (float)_mm_cvtsi128_si32(s4);
    }
#undef OKV_QMM_LOAD8
}

OKV_AVX512BW static void okv_qmm_quant_block_512(const float *xb, int64_t n, int64_t bs, int8_t *qb, float *xs,
                                                 float *xsum) {
    const __m512 fmax = _mm512_set1_ps(3.4028234663852886e38f);
    __m512 vmax = _mm512_setzero_ps();
    __m512i isum = _mm512_setzero_si512();
    __mmask16 bad = 0;
    float amax;
    int64_t k;
#define OKV_QMM_MASK16(k_) ((n - (k_)) >= 16 ? (__mmask16)0xFFFF \
                            : (n - (k_)) > 0 ? (__mmask16)((1u << (n - (k_))) - 1) : (__mmask16)0)
    for (k = 0; k < bs; k += 16) {
        const __m512 v = _mm512_abs_ps(_mm512_maskz_loadu_ps(OKV_QMM_MASK16(k), xb + k));
        bad |= _mm512_cmp_ps_mask(v, fmax, _CMP_NLE_UQ);
        vmax = _mm512_max_ps(vmax, v);
    }
    amax = _mm512_reduce_max_ps(vmax);
    if (bad || !(127.f / amax <= 3.4028234663852886e38f)) {
        memset(qb, 0, (size_t)bs);
        *xs = bad ? NAN : 0.f;
        *xsum = 0.f;
        return;
    }
    {
        const __m512 inv = _mm512_set1_ps(127.f / amax), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
        for (k = 0; k < bs; k += 16) {
            const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(OKV_QMM_MASK16(k), xb + k), inv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i q = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
            isum = _mm512_add_epi32(isum, q);
            _mm_storeu_si128((__m128i *)(qb + k), _mm512_cvtepi32_epi8(q));
        }
        *xs = amax / 127.f;
        *xsum = (float)_mm512_reduce_add_epi32(isum);
    }
#undef OKV_QMM_MASK16
}

/* Range drivers: panels [p0, p1), every row, in tiles of MR rows x NP panels
 * (16-column paths) or NH half-panels (8-column paths). */
#define OKV_QMM_RANGE16(TILE, a, p0, p1)                                                   \
    do {                                                                                   \
        int64_t p_, m_;                                                                    \
        for (p_ = (p0); p_ < (p1);) {                                                      \
            const int np_ = p_ + 4 <= (p1) ? 4 : 1;                                        \
            for (m_ = 0; m_ < (a)->M;) {                                                   \
                const int64_t left_ = (a)->M - m_;                                         \
                if (np_ == 4) {                                                            \
                    if (left_ >= 2) { TILE(2, 4, (a), p_, m_); m_ += 2; }                  \
                    else { TILE(1, 4, (a), p_, m_); m_ += 1; }                             \
                } else {                                                                   \
                    if (left_ >= 4) { TILE(4, 1, (a), p_, m_); m_ += 4; }                  \
                    else if (left_ >= 2) { TILE(2, 1, (a), p_, m_); m_ += 2; }             \
                    else { TILE(1, 1, (a), p_, m_); m_ += 1; }                             \
                }                                                                          \
            }                                                                              \
            p_ += np_;                                                                     \
        }                                                                                  \
    } while (0)

#define OKV_QMM_RANGE8(TILE, a, p0, p1)                                                    \
    do {                                                                                   \
        int64_t p_, m_;                                                                    \
        for (p_ = (p0); p_ < (p1);) {                                                      \
            const int two_ = p_ + 2 <= (p1);                                               \
            for (m_ = 0; m_ < (a)->M;) {                                                   \
                if (two_ && (a)->M - m_ == 1) { TILE(1, 4, (a), p_, m_); m_ += 1; }        \
                else if ((a)->M - m_ >= 2) { TILE(2, 2, (a), p_, m_); m_ += 2; }           \
                else { TILE(1, 2, (a), p_, m_); m_ += 1; }                                 \
            }                                                                              \
            p_ += two_ && (a)->M == 1 ? 2 : 1;                                             \
        }                                                                                  \
    } while (0)

OKV_AVX2 static void okv_qmm_i8_avx2(const okv_qmm *a, int64_t p0, int64_t p1) {
    OKV_QMM_RANGE8(okv_qmm_i8_avx2_tile, a, p0, p1);
}
#define OKV_QMM_F32_256(MR, NH, a, p, m0) okv_qmm_f32_avx2_tile(MR, NH, 0, a, p, m0)
#define OKV_QMM_F32_256_LUT(MR, NH, a, p, m0) okv_qmm_f32_avx2_tile(MR, NH, 1, a, p, m0)
#define OKV_QMM_F32_512(MR, NP, a, p, m0) okv_qmm_f32_512_tile(MR, NP, 0, a, p, m0)
#define OKV_QMM_F32_512_LUT(MR, NP, a, p, m0) okv_qmm_f32_512_tile(MR, NP, 1, a, p, m0)
OKV_AVX2 static void okv_qmm_f32_avx2(const okv_qmm *a, int64_t p0, int64_t p1) {
    if (a->lut) OKV_QMM_RANGE8(OKV_QMM_F32_256_LUT, a, p0, p1);
    else OKV_QMM_RANGE8(OKV_QMM_F32_256, a, p0, p1);
}
OKV_AVX512BW static void okv_qmm_f32_512(const okv_qmm *a, int64_t p0, int64_t p1) {
    if (a->lut) OKV_QMM_RANGE16(OKV_QMM_F32_512_LUT, a, p0, p1);
    else OKV_QMM_RANGE16(OKV_QMM_F32_512, a, p0, p1);
}
#if OKV_HAVE_VNNI
OKV_AVXVNNI static void okv_qmm_i8_avxvnni(const okv_qmm *a, int64_t p0, int64_t p1) {
    OKV_QMM_RANGE8(okv_qmm_i8_avxvnni_tile, a, p0, p1);
}
OKV_VNNI512 static void okv_qmm_i8_512(const okv_qmm *a, int64_t p0, int64_t p1) {
    if (a->bs == 32 && a->bits == 4) OKV_QMM_RANGE16(OKV_QMM_I8_512_T4, a, p0, p1);
    else if (a->bs == 32 && a->bits == 8) OKV_QMM_RANGE16(OKV_QMM_I8_512_T8, a, p0, p1);
    else OKV_QMM_RANGE16(OKV_QMM_I8_512_TN, a, p0, p1);
}
#endif
#endif /* OKV_X86_SIMD */
#endif /* ONNXKV_QMATMUL_X86_H */
