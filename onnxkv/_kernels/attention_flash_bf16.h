/* onnxkv/_kernels/attention_flash_bf16.h -- the prefill unit on AVX-512-BF16
 * dot products (prefill_precision="bf16": a->bf16), declared by and
 * dispatched from attention_flash.h at the AVX-512 level.
 *
 * Included by attention_unit.h after attention_flash.h at the AVX-512 level
 * (OKV_SIMD512) of a build with OKV_HAVE_BF16 (the setting is on only where
 * okv_cpu_bf16_ok); compiled alone, it instantiates that level of
 * attention_flash.h first.  The structure, row blocks, masks and softmax steps are those of
 * okv_fl_head (the shared okv_fl_lanes / okv_fl_softmax / okv_fl_out); the two
 * products take pairs of bfloat16 operands, each VDPBF16PS adding two exact
 * products to a float32 lane (module comment of matmul_bf16.h):
 *   Qb [D2][RB]  pairs (q[2i], q[2i+1]) * scale of each row (lane), rounded
 *                in place from the float Qt (D2 = ceil(D / 2), 0-padded);
 *   Kb [n][D2]   each key row rounded in order (a row's pairs are its
 *                consecutive elements);
 *   S  [n][RB]   scores sum_i Kb[j][i] . Qb[i][RB] (a broadcast key pair
 *                times RV lane vectors), then the probabilities;
 *   Pb [n2][RB]  pairs (p[2j], p[2j+1]) of each row, rounded in place in S
 *                (n2 = ceil(n / 2), 0-padded);
 *   Vb [n2][D]   pairs (v[2j][d], v[2j+1][d]) of the tile's values;
 *   Ot[d][RB]   += sum_j2 Vb[j2][d] . Pb[j2][RB].
 * Rounding is that of bf16_round.h, so the portable twin (okv_fl_head with
 * a->bf16) rounds the same operands to the same values; the sums differ in
 * order only. */

#if !defined(OKV_I) && OKV_X86_SIMD && OKV_HAVE_BF16 /* compiled alone */
#include "simd.h"
#define OKV_FLB_ALONE 1
#define OKV_I(name) name##_avx512
#define OKV_ATTR OKV_AVX512BW
#define OKV_SIMD512 1
#include "attention_flash.h"
#endif

#if defined(OKV_SIMD512) && OKV_HAVE_BF16
/* 16 elements of a K/V row of format fmt from element i (masked to m) as floats. */
OKV_INLINE OKV_BF16 __m512 okv_flb_ld16(const char *p, int64_t i, __mmask16 m, const int fmt) {
    if (fmt == OKV_FMT_F32) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    if (fmt == OKV_FMT_F16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i)), 16));
}

/* The first min(left, 16) lanes (none for left <= 0). */
static inline __mmask16 okv_flb_mask(int64_t left) {
    return (__mmask16)(left >= 16 ? 0xFFFFu : (left <= 0 ? 0u : (1u << left) - 1u));
}

/* S[kk][RB] = sum_i Kb[kk][i] . Qb[i][RB] for KJ keys. */
OKV_INLINE OKV_BF16 void okv_flb_qk(const uint32_t *Qb, const uint32_t *Kb, int64_t D2, float *S, const int KJ) {
    __m512 acc[8][2];
    int64_t i;
    int kk, v;
    for (kk = 0; kk < KJ; kk++)
        for (v = 0; v < 2; v++) acc[kk][v] = _mm512_setzero_ps();
    for (i = 0; i < D2; i++) {
        const __m512bh q0 = (__m512bh)_mm512_loadu_si512((const void *)(Qb + i * 32));
        const __m512bh q1 = (__m512bh)_mm512_loadu_si512((const void *)(Qb + i * 32 + 16));
        for (kk = 0; kk < KJ; kk++) {
            const __m512bh kb = (__m512bh)_mm512_set1_epi32((int)Kb[kk * D2 + i]);
            acc[kk][0] = _mm512_dpbf16_ps(acc[kk][0], kb, q0);
            acc[kk][1] = _mm512_dpbf16_ps(acc[kk][1], kb, q1);
        }
    }
    for (kk = 0; kk < KJ; kk++)
        for (v = 0; v < 2; v++) _mm512_storeu_ps(S + kk * 32 + v * 16, acc[kk][v]);
}

/* Ot[dd][RB] += sum_j2 Vb[j2][dd] . Pb[j2][RB] for DB value elements (Vb rows D apart). */
OKV_INLINE OKV_BF16 void okv_flb_pv(const uint32_t *Pb, int64_t n2, const uint32_t *Vb, int64_t D, float *Ot,
                                    const int DB) {
    __m512 acc[8][2];
    int64_t j;
    int dd, v;
    for (dd = 0; dd < DB; dd++)
        for (v = 0; v < 2; v++) acc[dd][v] = _mm512_loadu_ps(Ot + dd * 32 + v * 16);
    for (j = 0; j < n2; j++) {
        const __m512bh p0 = (__m512bh)_mm512_loadu_si512((const void *)(Pb + j * 32));
        const __m512bh p1 = (__m512bh)_mm512_loadu_si512((const void *)(Pb + j * 32 + 16));
        for (dd = 0; dd < DB; dd++) {
            const __m512bh vb = (__m512bh)_mm512_set1_epi32((int)Vb[j * D + dd]);
            acc[dd][0] = _mm512_dpbf16_ps(acc[dd][0], vb, p0);
            acc[dd][1] = _mm512_dpbf16_ps(acc[dd][1], vb, p1);
        }
    }
    for (dd = 0; dd < DB; dd++)
        for (v = 0; v < 2; v++) _mm512_storeu_ps(Ot + dd * 32 + v * 16, acc[dd][v]);
}

/* The float rows X [rows][32] as ceil(rows / 2) rows of pairs, in place: pair row i holds rows 2i (low
 * halves) and 2i + 1 (high halves; 0 past the last row).  Row i is written after rows 2i, 2i + 1 were read,
 * and every row below 2i already was. */
OKV_INLINE OKV_BF16 void okv_flb_pair_rows(float *X, int64_t rows) {
    const int64_t n2 = (rows + 1) / 2;
    int64_t i;
    int v;
    for (i = 0; i < n2; i++)
        for (v = 0; v < 2; v++) {
            const __m512 lo = _mm512_loadu_ps(X + 2 * i * 32 + v * 16);
            const __m512 hi = 2 * i + 1 < rows ? _mm512_loadu_ps(X + (2 * i + 1) * 32 + v * 16) : _mm512_setzero_ps();
            _mm512_storeu_si512((void *)(X + i * 32 + v * 16), okv_bf16_pairs16(lo, hi));
        }
}

/* The prefill unit of one KV head in bfloat16 pairs (module comment); fmt: OKV_FMT_F32, F16 or BF16. */
OKV_INLINE OKV_BF16 void okv_fl_head_bf16(const okv_attn_args *a, int64_t b, int64_t hk, int64_t t0, int64_t t1,
                                          float *ws, const int fmt) {
    enum { RB = 32 };
    const int64_t D = a->D, D2 = (D + 1) / 2, R = a->Hq / a->Hkv * (t1 - t0);
    const size_t esz = fmt == OKV_FMT_F32 ? 4 : 2;
    float *Qt = ws, *Ot = Qt + D * RB, *S = Ot + D * RB, *Kf = S + OKV_BK * RB, *Vf = Kf + OKV_BK * D;
    float *mv = Vf + OKV_BK * D, *lv = mv + RB;
    int32_t *lo = (int32_t *)(lv + RB), *hi = lo + RB;
    uint32_t *Kb = (uint32_t *)Kf, *Vb = (uint32_t *)Vf;
    int64_t rb0, j, d;
    for (rb0 = 0; rb0 < R; rb0 += RB) {
        const int64_t nr = R - rb0 < RB ? R - rb0 : RB;
        int64_t rng[4], j0, j1;
        unsigned bad[2] = {0, 0};
        okv_kv_page pg;
        okv_fl_lanes_avx512(a, b, hk, t0, rb0, nr, Qt, lo, hi, mv, lv, rng, 0);
        okv_flb_pair_rows(Qt, D);
        memset(Ot, 0, (size_t)(D * RB) * sizeof(float));
        pg.start = pg.end = INT64_MIN;
        for (j0 = okv_next_seen32(lo, hi, RB, rng[0]); j0 < rng[1]; j0 = okv_next_seen32(lo, hi, RB, j1)) {
            int64_t n, n2;
            const char *kp, *vp;
            int mask;
            if (j0 >= pg.end || j0 < pg.start) pg = okv_attn_page(a, b, hk, j0, esz);
            j1 = j0 + OKV_BK;
            if (j1 > pg.end) j1 = pg.end;
            if (j1 > rng[1]) j1 = rng[1];
            n = j1 - j0;
            n2 = (n + 1) / 2;
            kp = pg.k + (j0 - pg.start) * pg.kst;
            vp = pg.v + (j0 - pg.start) * pg.vst;
            for (j = 0; j < n; j++) /* key rows, rounded in order: pairs of consecutive elements */
                for (d = 0; d < 2 * D2; d += 32) {
                    const __m512 x0 = okv_flb_ld16(kp + j * pg.kst, d, okv_flb_mask(D - d), fmt);
                    const __m512 x1 = okv_flb_ld16(kp + j * pg.kst, d + 16, okv_flb_mask(D - d - 16), fmt);
                    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
                    _mm512_mask_storeu_epi16((uint16_t *)(Kb + j * D2) + d,
                                             (__mmask32)(2 * D2 - d >= 32 ? 0xFFFFFFFFu : (1u << (2 * D2 - d)) - 1u), h);
                }
            for (j = 0; j < n2; j++) /* value pairs of keys 2j, 2j + 1 */
                for (d = 0; d < D; d += 16) {
                    const __mmask16 m = okv_flb_mask(D - d);
                    const __m512 x0 = okv_flb_ld16(vp + 2 * j * pg.vst, d, m, fmt);
                    const __m512 x1 = 2 * j + 1 < n ? okv_flb_ld16(vp + (2 * j + 1) * pg.vst, d, m, fmt)
                                                    : _mm512_setzero_ps();
                    _mm512_mask_storeu_epi32(Vb + j * D + d, m, okv_bf16_pairs16(x0, x1));
                }
            for (j = 0; j + 8 <= n; j += 8) okv_flb_qk((const uint32_t *)Qt, Kb + j * D2, D2, S + j * RB, 8);
            for (; j < n; j++) okv_flb_qk((const uint32_t *)Qt, Kb + j * D2, D2, S + j * RB, 1);
            mask = !(j0 >= rng[2] && j1 <= rng[3]);
            okv_fl_softmax_avx512(a, S, n, j0, mask, lo, hi, mv, lv, Ot, bad);
            if (mask && okv_fl_vpartial_avx512(vp, pg.vst, fmt, 1, n, j0, D, rng, S, lo, hi, Ot)) {
                /* those values, added to the lanes that see them (okv_fl_vpartial), left out of the product */
                uint16_t *vh = (uint16_t *)Vb;   /* value v[j][d]: half j % 2 of pair Vb[j / 2][d] */
                for (j = 0; j < n; j++)
                    if (!(j0 + j >= rng[2] && j0 + j < rng[3]))
                        for (d = 0; d < D; d++) {
                            uint16_t *e = vh + 2 * ((j / 2) * D + d) + (j % 2);
                            if ((*e & 0x7F80u) == 0x7F80u) *e = 0;
                        }
            }
            okv_flb_pair_rows(S, n);
            for (d = 0; d + 8 <= D; d += 8) okv_flb_pv((const uint32_t *)S, n2, Vb + d, D, Ot + d * RB, 8);
            for (; d < D; d++) okv_flb_pv((const uint32_t *)S, n2, Vb + d, D, Ot + d * RB, 1);
        }
        okv_fl_out_avx512(a, b, hk, t0, rb0, nr, Ot, lv, lo, hi, bad);
    }
}

#define OKV_FLASH_BF16_UNIT(name, fmt)                                                                     \
    OKV_NOINLINE OKV_BF16 static void name(const okv_attn_args *a, int64_t b, int64_t hk0, int64_t nh,       \
                                           int64_t t0, int64_t t1, float *ws) {                             \
        int64_t h;                                                                                          \
        for (h = 0; h < nh; h++) okv_fl_head_bf16(a, b, hk0 + h, t0, t1, ws, fmt);                          \
    }
OKV_FLASH_BF16_UNIT(okv_attn_flashb_f32, OKV_FMT_F32)
OKV_FLASH_BF16_UNIT(okv_attn_flashb_f16, OKV_FMT_F16)
OKV_FLASH_BF16_UNIT(okv_attn_flashb_bf16, OKV_FMT_BF16)
#undef OKV_FLASH_BF16_UNIT
#endif /* OKV_SIMD512 && OKV_HAVE_BF16 */

#ifdef OKV_FLB_ALONE
#undef OKV_I
#undef OKV_ATTR
#undef OKV_SIMD512
#undef OKV_FLB_ALONE
#endif
