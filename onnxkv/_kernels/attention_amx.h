/* onnxkv/_kernels/attention_amx.h -- key scores of quantized pages on the
 * AMX-INT8 tiles, for the AVX-512 unit of per-page formats
 * (okv_attn_unit_mixed_avx512 and okv_qk_amx of attention_unit.h, when
 * a->amx: okv_cpu_amx_ok() and the switches of attention.pyx).
 *
 * Scores of nr <= OKV_RG query rows against up to 16 keys at a time:
 *   A tile (tile 2): 16 keys x 64 code bytes, int8 (signed formats) or uint8
 *     (unsigned), read straight from the page (8-bit codes, D % 64 == 0, 16
 *     keys) or from a per-thread copy (okv_amx_expand: 4- and 2-bit codes
 *     widened to one byte each as code * 2^(8 - bits), i.e. the code in the
 *     byte's top bits, which is the signed code times 2^(8 - bits) as int8
 *     and the unsigned one as uint8: one shift and one mask per 64 codes;
 *     8-bit rows of other head sizes or tiles of fewer than 16 keys copied;
 *     positions past the row's codes are zero).  A row of nb code bytes is
 *     covered in P = okv_amx_positions(D, bits) code positions, nch = P / 64
 *     chunks of 64 per key.
 *   B tiles (tiles 3, 4): the query rows as 24-bit fixed point, q_int =
 *     round(q / S_r), S_r = max|q_r| / OKV_AMX_QMAX, written as three balanced
 *     signed int8 digits q_int = d2 * 2^16 + d1 * 2^8 + d0; column 3*i + d of
 *     tile t holds digit d of row 5t + i (OKV_AMX_RPT = 5 rows per tile, a
 *     second tile for rows 5..7), in the VNNI layout B[k/4][col][k%4], built
 *     once per work unit and row group (okv_amx_build) and kept in the
 *     workspace for all its pages (per-head key scales: a->kG == 1).
 *     8-bit keys with per-channel scales: the rows folded with the page's
 *     channel scales, q'_r[d] = q_r[d] s[d], against a step S_r fixed per
 *     work item (max|q_r| times the largest scale / OKV_AMX_QMAX; the page's
 *     own max|q'_r| / OKV_AMX_QMAX where that loses more than 6 bits),
 *     rebuilt for every page in one pass (okv_amx_build_pc: 4 columns per
 *     row, digit d of row 4t + i in column 4i + d of tile t), the zero
 *     points' share scale * q'_r . z subtracted from the scores.
 *   C tiles (tiles 0, 1): int32 [16 keys][16 columns] by _tile_dpbssd (signed
 *     keys) or _tile_dpbusd (unsigned keys), exact: every digit product and
 *     column sum fits in int32 (|sum| <= 128 * 255 * P < 2^31 for P < 2^16).
 *   Scores: transposed to [column][key] (okv_amx_t16), s = scale * S_r *
 *     2^(bits - 8) * ((C2 * 65536 + C1 * 256) + C0) in float32.  The only
 *     error beyond float32 rounding is q's fixed-point rounding,
 *     |q - S_r q_int| <= S_r / 2 = max|q_r| / (254 * 2^16) (6e-8 max|q_r|)
 *     per element (okv_amx_build_pc: <= 3/4 S_r <= 6e-6 max|q'_r|).  An
 *     all-zero row has S_r = 0 and scores 0.
 *
 * Code positions (the order in which the A rows hold a key's codes; the B
 * tiles hold the query elements in the same order, so the dot product is the
 * same): element e of a row with per = 8 / bits codes per byte is code h = e
 * % per of byte i = e / per, at position (i / U) * U * per + h * U + i % U,
 * U = okv_amx_unit(nb, bits) code bytes per block (the smallest of 16, 32, 64
 * that fills whole 64-position chunks and holds min(nb, 64) bytes; 8-bit: the
 * natural order; 4-bit with 64-byte blocks: each 64 bytes' low nibbles, then
 * their high nibbles), so that widening a block is one shift and one mask per
 * code of one load.
 *
 * Tile state: okv_amx_begin configures tiles 0..7 (16 rows x 64 bytes) on
 * the calling thread at the start of a work unit, okv_amx_end releases them
 * at its end; every function here runs between the two on the same thread.
 */
#ifndef ONNXKV_ATTENTION_AMX_H
#define ONNXKV_ATTENTION_AMX_H

#include "attention_softmax.h"
#include "attention_types.h"
#include "quant.h"

#if OKV_X86_SIMD && OKV_HAVE_AMX
#define OKV_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

/* |q_int| bound: 127 * 2^16 keeps the top balanced digit d2 in [-127, 127]
 * (see okv_amx_build). */
#define OKV_AMX_QMAX 8323072.f
#define OKV_AMX_RPT 5      /* query rows per C tile: 3 digit columns each, 15 of 16 columns */
#define OKV_AMX_TILE 1024  /* bytes of one B tile: 16 rows x 64 bytes */
#define OKV_AMX_TAG_PC (-1) /* okv_amx_ws.tag: tiles of rows folded with a page's per-channel key scales */

/* The tile configuration (palette 1) of ldtilecfg. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} okv_amx_cfg;

/* Code bytes per block of a row of nb bytes of `bits`-bit codes (see the top
 * of this file): U * 8 / bits is a multiple of 64, U >= min(nb, 64). */
static inline int64_t okv_amx_unit(int64_t nb, int bits) {
    int64_t u = bits * 8;   /* 64 / per */
    while (u < 64 && u < nb) u *= 2;
    return u;
}

/* Code positions of a row of D codes of `bits` bits: per * U * ceil(nb / U)
 * (nb = D * bits / 8 bytes, U = okv_amx_unit). */
static inline int64_t okv_amx_positions(int64_t D, int bits) {
    const int64_t nb = D * bits / 8, u = okv_amx_unit(nb, bits);
    return (8 / bits) * u * ((nb + u - 1) / u);
}

/* The most code positions of any format for head size D. */
static inline int64_t okv_amx_pmax(int64_t D) {
    const int64_t p8 = okv_amx_positions(D, 8), p4 = okv_amx_positions(D, 4), p2 = okv_amx_positions(D, 2);
    return p8 > p4 ? (p8 > p2 ? p8 : p2) : (p4 > p2 ? p4 : p2);
}

/* Per-thread scratch of the AMX scores, inside the work unit's workspace
 * (okv_amx_ws_bytes bytes at a 64-byte aligned address; okv_amx_ws_init):
 *   cbuf   2 x 256 int32: the stored C tiles
 *   xs     16 x Pm bytes: widened / copied key rows of one tile (P apart)
 *   planes 3 * OKV_RG x Pm int8: the digits of the rows, plane 3 * r + d (P apart)
 *   qp     Pm floats: one query row in code position order (zero padded)
 *   bt     nitem x nchm x tpi B tiles: item w's tiles of chunk c, tile t at
 *          bt + ((w * nchm + c) * tpi + t) * OKV_AMX_TILE
 *   sr     nitem x OKV_RG floats: S_r of the rows of item w at sr + w * OKV_RG
 *          (per-channel key scales: the scores' factors of the last page built)
 *   qm     nitem x OKV_RG floats: max|q_r| of the rows of item w at qm + w *
 *          OKV_RG (okv_amx_row_max; valid while tag[w] == OKV_AMX_TAG_PC)
 *   qc     nitem x OKV_RG ints: a channel where it is reached, at qc + w * OKV_RG
 *   tag    nitem ints: bits of the code order item w's tiles hold (0: none;
 *          OKV_AMX_TAG_PC: a page's rows folded with per-channel key scales)
 * Pm = okv_amx_pmax(D) = 64 * nchm; P = okv_amx_positions(D, bits) <= Pm for
 * the format at hand; tpi = B tiles per item (1 for at most 4 rows
 * per item, else 2). */
typedef struct {
    int32_t *cbuf;
    uint8_t *xs;
    int8_t *planes;
    float *qp;
    uint8_t *bt;
    float *sr;
    float *qm;
    int *qc;
    int *tag;
    int64_t Pm, nchm, tpi, nitem;
} okv_amx_ws;

static inline int64_t okv_amx_line(int64_t n) { return (n + 63) & ~(int64_t)63; }

/* Bytes of okv_amx_ws for head size D, nitem work items (head, row group) of
 * at most rgw rows each (a multiple of 64). */
static inline int64_t okv_amx_ws_bytes(int64_t D, int64_t nitem, int64_t rgw) {
    const int64_t Pm = okv_amx_pmax(D), tpi = rgw > 4 ? 2 : 1;
    return 2 * OKV_AMX_TILE + 16 * Pm + 3 * OKV_RG * Pm + 4 * Pm + nitem * (Pm / 64) * tpi * OKV_AMX_TILE +
           3 * okv_amx_line(4 * nitem * OKV_RG) + okv_amx_line(4 * nitem);
}

/* Lay out okv_amx_ws_bytes(D, nitem, rgw) bytes at mem (64-byte aligned); no
 * B tiles built yet. */
static inline void okv_amx_ws_init(okv_amx_ws *x, char *mem, int64_t D, int64_t nitem, int64_t rgw) {
    int64_t i;
    x->Pm = okv_amx_pmax(D);
    x->nchm = x->Pm / 64;
    x->tpi = rgw > 4 ? 2 : 1;
    x->nitem = nitem;
    x->cbuf = (int32_t *)mem;
    mem += 2 * OKV_AMX_TILE;
    x->xs = (uint8_t *)mem;
    mem += 16 * x->Pm;
    x->planes = (int8_t *)mem;
    mem += 3 * OKV_RG * x->Pm;
    x->qp = (float *)mem;
    mem += 4 * x->Pm;
    x->bt = (uint8_t *)mem;
    mem += nitem * x->nchm * x->tpi * OKV_AMX_TILE;
    x->sr = (float *)mem;
    mem += okv_amx_line(4 * nitem * OKV_RG);
    x->qm = (float *)mem;
    mem += okv_amx_line(4 * nitem * OKV_RG);
    x->qc = (int *)mem;
    mem += okv_amx_line(4 * nitem * OKV_RG);
    x->tag = (int *)mem;
    for (i = 0; i < nitem; i++) x->tag[i] = 0;
}

/* Compiler barrier around the tile loads and stores: GCC's tile intrinsics
 * are asm statements that do not tell the compiler which memory they read or
 * write (_tile_loadconfig names only the first 8 bytes of the configuration),
 * so the stores they read must be complete before them and the loads of what
 * they write must not move above them. */
#define OKV_AMX_FENCE() __asm__ volatile("" ::: "memory")

/* Tiles 0..7 16 rows x 64 bytes (the scores use tiles 0..4). */
static const okv_amx_cfg okv_amx_cfg16 = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64},
                                          {16, 16, 16, 16, 16, 16, 16, 16}};

/* Configure the tiles (okv_amx_cfg16) on this thread. */
OKV_AMX static void okv_amx_begin(void) {
    OKV_AMX_FENCE();
    _tile_loadconfig(&okv_amx_cfg16);
}

/* Release the tile state of this thread. */
OKV_AMX static void okv_amx_end(void) { _tile_release(); }

/* In-place transpose of the 16 x 16 int32 matrix v[row] lane col. */
OKV_INLINE OKV_AMX void okv_amx_t16(__m512i *v) {
    __m512i a[16], b[16];
    int i, k;
    for (i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (i = 0; i < 4; i++) {   /* b[4i+m], 128-bit block L: rows 4i..4i+3 of column 4L+m */
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (i = 0; i < 2; i++)
        for (k = 0; k < 4; k++) {
            a[8 * i + k] = _mm512_shuffle_i32x4(b[8 * i + k], b[8 * i + 4 + k], 0x88);
            a[8 * i + 4 + k] = _mm512_shuffle_i32x4(b[8 * i + k], b[8 * i + 4 + k], 0xDD);
        }
    for (k = 0; k < 8; k++) {
        v[k] = _mm512_shuffle_i32x4(a[k], a[k + 8], 0x88);
        v[k + 8] = _mm512_shuffle_i32x4(a[k], a[k + 8], 0xDD);
    }
}

/* The first min(n, 64) bytes. */
static inline __mmask64 okv_amx_bmask(int64_t n) { return n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1); }

/* B tiles of the nr rows qr[r] (D floats each) for codes of `bits` bits, into
 * bt (nch x tpi tiles: chunk c, tile t at bt + (c * tpi + t) * OKV_AMX_TILE)
 * and S_r into sr[r] (0 for an all-zero row, whose digits are all 0).
 * Digits: d0 = the low byte of q_int as signed, q1 = (q_int - d0) / 2^8,
 * d1 = the low byte of q1, d2 = (q1 - d1) / 2^8 (exact shifts); |q_int| <=
 * OKV_AMX_QMAX (+1 by rounding) gives |q1| <= 32513 and |d2| <= 127. */
OKV_AMX static void okv_amx_build(const float *const *qr, int nr, int64_t D, int bits, okv_amx_ws *x, uint8_t *bt,
                                  float *sr) {
    const int64_t P = okv_amx_positions(D, bits), per = 8 / bits, U = okv_amx_unit(D * bits / 8, bits);
    const int nt = (nr + OKV_AMX_RPT - 1) / OKV_AMX_RPT;
    int64_t e, p, c;
    int r, t, i;
    for (r = 0; r < nr; r++) {
        const float *q = qr[r];
        float *qp = x->qp;
        __m512 mx = _mm512_setzero_ps(), inv;
        float m;
        if (bits == 8) {
            memcpy(qp, q, (size_t)D * sizeof(float));
            for (e = D; e < P; e++) qp[e] = 0.f;
        } else {   /* byte U c + i's code h at position (c per + h) U + i, without divisions */
            int64_t i, h;
            memset(qp, 0, (size_t)P * sizeof(float));
            for (c = 0; U * c * per < D; c++)
                for (h = 0; h < per; h++)
                    for (i = 0; i < U && (U * c + i) * per + h < D; i++)
                        qp[(c * per + h) * U + i] = q[(U * c + i) * per + h];
        }
        for (p = 0; p < P; p += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(qp + p)));
        m = _mm512_reduce_max_ps(mx);
        sr[r] = m > 0.f ? m / OKV_AMX_QMAX : 0.f;
        inv = _mm512_set1_ps(m > 0.f ? OKV_AMX_QMAX / m : 0.f);
        for (p = 0; p < P; p += 16) {
            const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qp + p), inv));
            const __m512i d0 = _mm512_srai_epi32(_mm512_slli_epi32(qi, 24), 24);
            const __m512i q1 = _mm512_srai_epi32(_mm512_sub_epi32(qi, d0), 8);
            const __m512i d1 = _mm512_srai_epi32(_mm512_slli_epi32(q1, 24), 24);
            const __m512i d2 = _mm512_srai_epi32(_mm512_sub_epi32(q1, d1), 8);
            int8_t *pl = x->planes + 3 * r * P + p;
            _mm_storeu_si128((__m128i *)pl, _mm512_cvtepi32_epi8(d0));
            _mm_storeu_si128((__m128i *)(pl + P), _mm512_cvtepi32_epi8(d1));
            _mm_storeu_si128((__m128i *)(pl + 2 * P), _mm512_cvtepi32_epi8(d2));
        }
    }
    for (c = 0; c < P / 64; c++)
        for (t = 0; t < nt; t++) {   /* column i of tile t: plane 3 * OKV_AMX_RPT * t + i */
            const int ncol = 3 * ((nr - OKV_AMX_RPT * t) < OKV_AMX_RPT ? nr - OKV_AMX_RPT * t : OKV_AMX_RPT);
            uint8_t *b = bt + (c * x->tpi + t) * OKV_AMX_TILE;
            __m512i v[16];
            for (i = 0; i < 16; i++)
                v[i] = i < ncol ? _mm512_loadu_si512(x->planes + (3 * OKV_AMX_RPT * t + i) * P + 64 * c)
                                : _mm512_setzero_si512();
            okv_amx_t16(v);   /* v[k/4]: dword col = the 4 digits of column col at k .. k+3 */
            for (i = 0; i < 16; i++) _mm512_storeu_si512(b + 64 * i, v[i]);
        }
}

/* max|q_r| of the nr rows qr[r] (D floats each) into qm[r] and a channel
 * where it is reached into qc[r], once per work item (okv_qk_amx): the
 * fixed-point unit of the rows' folded copies on every page of per-channel
 * key scales (okv_amx_build_pc). */
OKV_AMX static void okv_amx_row_max(const float *const *qr, int nr, int64_t D, float *qm, int *qc) {
    int64_t p;
    int r;
    for (r = 0; r < nr; r++) {
        __m512 mx = _mm512_setzero_ps();
        float m;
        for (p = 0; p < D; p += 16)
            mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_maskz_loadu_ps(okv_mask16(D - p), qr[r] + p)));
        m = _mm512_reduce_max_ps(mx);
        qm[r] = m;
        qc[r] = 0;
        for (p = 0; p < D; p++)
            if (fabsf(qr[r][p]) == m) {
                qc[r] = (int)p;
                break;
            }
    }
}

/* okv_amx_build for 8-bit codes (the natural order, P = okv_amx_positions(D,
 * 8), zero past D) of keys with per-channel scales s[d] and zero points z[d]
 * (d < D; dq: the float32 header's s / z, or a compact header's S, exponent
 * and zero-point codes), in one pass over the page's channels: the rows
 * folded, q'_r[d] = qr[r][d] * f[d] with f = rel (compact header: rel[d] =
 * okv_q_steps[e & 15] * 2^-(e >> 4) <= 1, s[d] = S * rel[d] up to float32
 * rounding; zf = S) or f = s (float32 header; zf = 1), their digits those of
 * q_int = q'_r / u[r] for the caller's units u[r] (|q'_r| <= u[r] *
 * OKV_AMX_QMAX, u[r] = 0 for an all-zero row: digits 0), sr[r] = u[r] * zf
 * (scale * sr[r] * C = scale * q_r . (s * code)), zc[r] = scale * zf *
 * sum_d q'_r[d] z[d] (the zero points' share of row r's scores; 0 without
 * reading them when !zp: a compact header of signed codes, whose zero points
 * are 0) and, if track, mq[r] = max|q'_r|.  Digits: per 16
 * elements of a row, x = q_int + 0x808080 (q' / u + 0x808080 rounded by the
 * FMA, then to an integer by the conversion: |q' / u - q_int| <= 3/4 where
 * the sum is below 2^23, else 1/2) holds the balanced digits plus 128 in its
 * bytes 0..2 (|q_int| <= OKV_AMX_QMAX up to float32 rounding, a few units;
 * three balanced digits hold up to 8355711 < 0x808080), x ^ 0x808080 the
 * digits d0, d1, d2 as int8 and a zero byte 3; one in-lane byte shuffle makes
 * dword dg of each 128-bit lane L digit dg of elements 4L..4L+3 (dg = 3:
 * zero), which is the VNNI dword of column 4i + dg in tile row 4L + ... for
 * row i of a tile: so the B tiles hold 4 rows each (tile t: rows 4t..4t+3,
 * column 4i + dg digit dg of row 4t + i, columns 4i + 3 and those of missing
 * rows zero; okv_amx_qk with cpr = 4), and a 128-bit lane transpose of the
 * tile's 4 rows gives 4 tile rows. */
OKV_INLINE OKV_AMX void okv_amx_build_pc_n(const float *const *qr, const int nr, int64_t D, const okv_dq *dq,
                                           float scale, const float *u, okv_amx_ws *x, uint8_t *bt, float *sr,
                                           float *zc, float *mq, const int track, const int zp) {
    const int64_t P = okv_amx_positions(D, 8);
    const int nt = (nr + 3) / 4;
    const __m512i bias = _mm512_set1_epi32(0x808080);
    const __m512 fbias = _mm512_set1_ps((float)0x808080);
    const __m512i bsh = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    const __m512 steps = _mm512_loadu_ps(okv_q_steps);
    const float zf = dq->ce ? dq->cS : 1.f;
    __m512 inv[OKV_RG], dz[OKV_RG], mx[OKV_RG];
    __m512i z[8];
    int64_t p;
    int r, t, L;
#pragma GCC unroll 8
    for (r = 0; r < nr; r++) {
        sr[r] = u[r] * zf;
        inv[r] = _mm512_set1_ps(u[r] > 0.f ? 1.f / u[r] : 0.f);
        dz[r] = mx[r] = _mm512_setzero_ps();
    }
    for (r = nr; r < 4 * nt; r++) z[r] = _mm512_setzero_si512();
    for (p = 0; p < P; p += 16) {   /* elements p..p+15: tile rows 4 * (p % 64 / 16) .. + 3 of chunk p / 64 */
        const __mmask16 k = okv_mask16(D > p ? D - p : 0);
        __m512 sv, zv;
        if (dq->ce) {   /* rel = okv_q_steps[e & 15] * 2^-(e >> 4) */
            const __m512i e = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, dq->ce + p));
            const __m512 p2 = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(127), _mm512_srli_epi32(e, 4)), 23));
            /* the permute reads only bits 0..3 of each index: okv_q_steps[e & 15] */
            sv = _mm512_mul_ps(_mm512_permutexvar_ps(e, steps), p2);
            zv = zp ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, dq->cz + p)))
                    : _mm512_setzero_ps();
        } else {
            sv = _mm512_maskz_loadu_ps(k, dq->s + p);
            zv = _mm512_maskz_loadu_ps(k, dq->z + p);
        }
#pragma GCC unroll 8
        for (r = 0; r < nr; r++) {   /* q_int + 0x808080, rounded once (see above) */
            const __m512 q = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, qr[r] + p), sv);
            const __m512i xi = _mm512_cvtps_epi32(_mm512_fmadd_ps(q, inv[r], fbias));
            if (zp) dz[r] = _mm512_fmadd_ps(q, zv, dz[r]);
            if (track) mx[r] = _mm512_max_ps(mx[r], _mm512_abs_ps(q));
            z[r] = _mm512_shuffle_epi8(_mm512_xor_si512(xi, bias), bsh);
        }
#pragma GCC unroll 2
        for (t = 0; t < nt; t++) {
            const __m512i *zt = z + 4 * t;
            const __m512i a0 = _mm512_shuffle_i32x4(zt[0], zt[1], 0x44), a1 = _mm512_shuffle_i32x4(zt[0], zt[1], 0xEE);
            const __m512i a2 = _mm512_shuffle_i32x4(zt[2], zt[3], 0x44), a3 = _mm512_shuffle_i32x4(zt[2], zt[3], 0xEE);
            __m512i o[4];   /* o[L]: lane i = row i's lane L */
            uint8_t *b = bt + ((p / 64) * x->tpi + t) * OKV_AMX_TILE + 64 * (4 * (p % 64 / 16));
            o[0] = _mm512_shuffle_i32x4(a0, a2, 0x88);
            o[1] = _mm512_shuffle_i32x4(a0, a2, 0xDD);
            o[2] = _mm512_shuffle_i32x4(a1, a3, 0x88);
            o[3] = _mm512_shuffle_i32x4(a1, a3, 0xDD);
#pragma GCC unroll 4
            for (L = 0; L < 4; L++) _mm512_storeu_si512(b + 64 * L, o[L]);
        }
    }
#pragma GCC unroll 8
    for (r = 0; r < nr; r++) {
        zc[r] = zp ? scale * zf * _mm512_reduce_add_ps(dz[r]) : 0.f;
        if (track) mq[r] = _mm512_reduce_max_ps(mx[r]);
    }
}

/* okv_amx_build_pc_n, its row loops unrolled (accumulators in registers) for
 * the common row counts. */
OKV_AMX static void okv_amx_build_pc_rows(const float *const *qr, int nr, int64_t D, const okv_dq *dq, float scale,
                                          const float *u, okv_amx_ws *x, uint8_t *bt, float *sr, float *zc,
                                          float *mq, int track, int zp) {
#define OKV_PC_CASE(N)                                                                   \
    if (track) okv_amx_build_pc_n(qr, N, D, dq, scale, u, x, bt, sr, zc, mq, 1, zp);     \
    else okv_amx_build_pc_n(qr, N, D, dq, scale, u, x, bt, sr, zc, mq, 0, zp);           \
    return
    switch (nr) {
    case 1: OKV_PC_CASE(1);
    case 2: OKV_PC_CASE(2);
    case 4: OKV_PC_CASE(4);
    case 8: OKV_PC_CASE(8);
    default: OKV_PC_CASE(nr);
    }
#undef OKV_PC_CASE
}

/* A page's digits lose at most log2(OKV_AMX_PC_SLACK) bits to units fixed for
 * the work item (okv_amx_build_pc). */
#define OKV_AMX_PC_SLACK 64.f

/* The B tiles, sr and zc of a page of 8-bit keys with per-channel scales
 * (okv_amx_build_pc_n) in one pass over the page's channels, against units
 * fixed for the work item: u[r] = qm[r] * fmax / OKV_AMX_QMAX, qm[r] =
 * max|q_r| reached in channel qc[r] (okv_amx_row_max, once per item), fmax
 * the largest fold factor (compact header: 1, as rel <= 1; float32 header:
 * max s, a pass over the D scales).  Those units keep at least 24 -
 * log2(OKV_AMX_PC_SLACK) bits of each row's digits when the page's fold
 * factor of channel qc[r] is at least fmax / OKV_AMX_PC_SLACK (then max|q'_r|
 * >= qm[r] fmax / OKV_AMX_PC_SLACK); a page where it is not (the query's
 * largest element meets one of the page's smallest scales) is folded once to
 * find every max|q'_r| and built again with u[r] = max|q'_r| /
 * OKV_AMX_QMAX.  So the error of q'_r[d] is at most (3/4) u[r] <= (3/4)
 * OKV_AMX_PC_SLACK max|q'_r| / OKV_AMX_QMAX (6e-6 max|q'_r|). */
OKV_AMX static void okv_amx_build_pc(const float *const *qr, int nr, int64_t D, const okv_dq *dq, float scale,
                                     const float *qm, const int *qc, okv_amx_ws *x, uint8_t *bt, float *sr,
                                     float *zc, int zp) {
    float u[OKV_RG], mq[OKV_RG], fmax = 1.f;
    int r, exact = 0;
    if (!dq->ce) {
        __m512 sm = _mm512_setzero_ps();
        int64_t p;
        for (p = 0; p < D; p += 16) sm = _mm512_max_ps(sm, _mm512_maskz_loadu_ps(okv_mask16(D - p), dq->s + p));
        fmax = _mm512_reduce_max_ps(sm);
    }
    for (r = 0; r < nr; r++) {
        const int c = qc[r];   /* the fold factor of the row's largest element */
        const float f = dq->ce ? okv_q_steps[dq->ce[c] & 15] * okv_bits_f32((uint32_t)(127 - (dq->ce[c] >> 4)) << 23)
                               : dq->s[c];
        exact |= f * OKV_AMX_PC_SLACK < fmax && qm[r] > 0.f;
        u[r] = qm[r] * fmax / OKV_AMX_QMAX;
    }
    if (exact) {   /* every row's max|q'_r| first */
        okv_amx_build_pc_rows(qr, nr, D, dq, scale, u, x, bt, sr, zc, mq, 1, zp);
        for (r = 0; r < nr; r++) u[r] = mq[r] / OKV_AMX_QMAX;
    }
    okv_amx_build_pc_rows(qr, nr, D, dq, scale, u, x, bt, sr, zc, mq, 0, zp);
}

/* Rows 0..m-1 (m <= 16) of codes of format fmt (nb bytes each, kst bytes
 * apart from k) into x->xs (P = okv_amx_positions bytes apart) in code
 * position order, one byte per code holding code * 2^(8 - bits) (the code in
 * the byte's top bits), zero past the row's codes. */
OKV_AMX static void okv_amx_expand(const uint8_t *k, int64_t kst, int64_t m, int fmt, int64_t nb, int64_t P,
                                   okv_amx_ws *x) {
    const int bits = okv_q_bits(fmt), per = 8 / bits;
    const int64_t U = okv_amx_unit(nb, bits);
    const __mmask64 um = okv_amx_bmask(U);
    const __m512i top = _mm512_set1_epi8((char)(0xFF << (8 - bits)));
    int64_t j, c;
    int h;
    if (bits == 4 && U == 64 && nb % 64 == 0) {   /* the same for whole 64-byte blocks, without the masks */
        for (j = 0; j < m; j++) {
            const uint8_t *row = k + j * kst;
            uint8_t *o = x->xs + j * P;
            for (c = 0; c < nb / 64; c++) {
                const __m512i v = _mm512_loadu_si512(row + 64 * c);
                _mm512_storeu_si512(o + 128 * c, _mm512_and_si512(_mm512_slli_epi16(v, 4), top));
                _mm512_storeu_si512(o + 128 * c + 64, _mm512_and_si512(v, top));
            }
        }
        return;
    }
    for (j = 0; j < m; j++) {
        const uint8_t *row = k + j * kst;
        uint8_t *o = x->xs + j * P;
        for (c = 0; U * c < nb; c++) {   /* U code bytes -> per blocks of U positions */
            const __m512i v = _mm512_maskz_loadu_epi8(okv_amx_bmask(nb - U * c), row + U * c);
            if (bits == 8) {
                _mm512_storeu_si512(o + 64 * c, v);
                continue;
            }
            for (h = 0; h < per; h++)   /* code h: bits [h*bits, (h+1)*bits) moved to the top */
                _mm512_mask_storeu_epi8(o + U * (c * per + h), um,
                                        _mm512_and_si512(_mm512_slli_epi16(v, (unsigned)(8 - bits * (h + 1))), top));
        }
    }
}

/* Scores s[r * OKV_BK + j] = scale * q_r . code_j - zc[r] (raw codes; no
 * zc[r] term if zc is NULL) of the nr rows whose B tiles and S_r are bt / sr
 * against the n keys of format fmt at k (kst bytes apart, head size D); the
 * rows of pf are software-prefetched first.  cpr: columns per row of the B
 * tiles, 3 (okv_amx_build for the code order of fmt: OKV_AMX_RPT rows per
 * tile) or 4 (okv_amx_build_pc: 4 rows per tile).  zo (or NULL): the D int8
 * zero-point codes of a channel-zero-point header, for 8-bit codes and nr <=
 * OKV_AMX_RPT (one B tile per chunk; tiles 1 and 4 are then free) with cpr 3
 * and zc NULL: zc[r] = zf * q_r . zo instead, from one more tile product per
 * chunk on the first 16 keys (tile 4: the chunk's 64 codes in every row, by
 * a load of stride 0; tile 1: its products with the B tile, row 0 read). */
OKV_AMX static void okv_amx_qk(const uint8_t *k, int64_t kst, int64_t n, int fmt, int64_t D, int nr,
                               const uint8_t *bt, const float *sr, float scale, const float *zc, float *s,
                               okv_amx_ws *x, const okv_pf *pf, int cpr, const int8_t *zo, float zf) {
    const int rpt = 16 / cpr, sgn = okv_q_signed(fmt), nt = (nr + rpt - 1) / rpt;
    const int bits = okv_q_bits(fmt);
    const int64_t nb = okv_q_row_bytes(fmt, D), direct = bits == 8 && D % 64 == 0, P = okv_amx_positions(D, bits);
    const float unit = (float)(1 << bits) / 256.f;   /* the widened codes' factor 2^(8 - bits), undone */
    const __m512 f16 = _mm512_set1_ps(65536.f), f8 = _mm512_set1_ps(256.f);
    float zz[OKV_AMX_RPT];
    int64_t j0, c;
    int t, i;
    for (j0 = 0; j0 < n; j0 += 16) {
        const int64_t m = n - j0 < 16 ? n - j0 : 16;
        const uint8_t *src = k + j0 * kst;
        const int zt = zo && j0 == 0;   /* the zero-point codes' tile products, on the first keys */
        int64_t st = kst;
        OKV_AMX_FENCE();   /* the B tiles are in memory */
        _tile_zero(0);
        if (nt > 1 || zt) _tile_zero(1);
        _tile_loadd(3, bt, 64);   /* the first chunk's B tile loads while the keys are widened */
        if (!direct || m < 16) {
            okv_amx_expand(src, kst, m, fmt, nb, P, x);
            src = x->xs;
            st = P;
        }
        OKV_AMX_FENCE();   /* the widened rows are in memory */
        for (c = 0; c < P / 64; c++) {
            _tile_loadd(2, src + 64 * c, st);
            if (c > 0) _tile_loadd(3, bt + c * x->tpi * OKV_AMX_TILE, 64);
            if (sgn) _tile_dpbssd(0, 2, 3);
            else _tile_dpbusd(0, 2, 3);
            if (zt) {   /* every row of tile 4 holds the 64 zero-point codes of the chunk */
                _tile_loadd(4, zo + 64 * c, 0);
                _tile_dpbssd(1, 4, 3);
            }
            if (nt > 1) {
                _tile_loadd(4, bt + (c * x->tpi + 1) * OKV_AMX_TILE, 64);
                if (sgn) _tile_dpbssd(1, 2, 4);
                else _tile_dpbusd(1, 2, 4);
            }
        }
        okv_pf_rows(pf, j0, 8);   /* the prefetch in two halves, issued while the tiles compute */
        _tile_stored(0, x->cbuf, 64);
        if (nt > 1) _tile_stored(1, x->cbuf + 256, 64);
        okv_pf_rows(pf, j0 + 8, 8);
        if (zt) _tile_stored(1, x->cbuf + 256, 64);
        OKV_AMX_FENCE();   /* C is in memory before it is read */
        if (zt) {   /* row 0 of tile 1: column 3i + d = sum_c o[c] * digit d of row i's q_int[c] */
            const int32_t *cz = x->cbuf + 256;
            for (i = 0; i < nr; i++)
                zz[i] = zf * sr[i] * (((float)cz[3 * i + 2] * 65536.f + (float)cz[3 * i + 1] * 256.f) + (float)cz[3 * i]);
            zc = zz;
        }
        for (t = 0; t < nt; t++) {
            const int rows = nr - rpt * t < rpt ? nr - rpt * t : rpt;
            __m512i v[16];
            for (i = 0; i < 16; i++) v[i] = _mm512_loadu_si512(x->cbuf + 256 * t + 16 * i);
            okv_amx_t16(v);   /* v[col]: the 16 keys' sums of column col */
            for (i = 0; i < rows; i++) {
                const int r = rpt * t + i;
                __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v[cpr * i + 2]), f16,
                                           _mm512_mul_ps(_mm512_cvtepi32_ps(v[cpr * i + 1]), f8));
                y = _mm512_add_ps(y, _mm512_cvtepi32_ps(v[cpr * i]));
                y = _mm512_mul_ps(y, _mm512_set1_ps(scale * unit * sr[r]));
                if (zc) y = _mm512_sub_ps(y, _mm512_set1_ps(zc[r]));
                _mm512_mask_storeu_ps(s + r * OKV_BK + j0, okv_mask16(m), y);
            }
        }
    }
    if (pf->n > j0) okv_pf_rows(pf, j0, (int)(pf->n - j0));   /* rows of a longer next tile */
}

#endif /* OKV_X86_SIMD && OKV_HAVE_AMX */
#endif /* ONNXKV_ATTENTION_AMX_H */
