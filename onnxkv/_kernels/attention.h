/* onnxkv/_kernels/attention.h -- streaming (online-softmax) attention over a
 * contiguous or a paged KV cache.
 *
 * Layouts (C-contiguous):
 *   q, out [B, Hq, Sq, D] float32;  kv_len, kv_start [B] int32;  q_pos [B, Sq] int32.
 *   K/V elements are float32, float16 or bfloat16 (kv_type; K and V share it).
 *   Contiguous (block_tables == NULL): k, v [B, Hkv, Cap, D].
 *   Paged (block_tables != NULL): logical block i of batch b (keys [i*bs, (i+1)*bs))
 *     lives in page block_tables[b*M + i]; k_pages[id] / v_pages[id] are the
 *     addresses of that page's K / V data [Hkv, bs, D] (head-major).  Cap = M*bs.
 *     Only the entries of blocks holding a key visible to some query of the
 *     call are read (the caller checks them).
 * Key addressing is by page (okv_kv_page, okv_attn_page): a contiguous cache is
 * one page [0, Cap) per (b, hk).  Work units stream keys in tiles that never
 * straddle a page, one page lookup per page (attention_impl.h); a work unit
 * covers hpu KV heads (paged decode: all of them, so that it reads each page
 * front to back).
 * Query token t of batch b at absolute position p = q_pos[b, t] sees keys j with
 *   max(kv_start[b], p - window (if window >= 0)) <= j <= p  and  j < kv_len[b].
 * Scores: s = scale * dot(q, k_j); if softcap > 0: s = softcap * tanh(s / softcap).
 * A row with no visible key outputs zeros.
 * NaN and infinities follow the dense softmax (NumPy, onnx.reference): a query
 * row one of whose visible scores is NaN or +inf outputs NaN (whatever the
 * other scores), a row whose visible scores are all -inf outputs zeros, -inf
 * scores get weight 0, and a NaN or infinite value of a key with a nonzero
 * weight reaches the output through p * v.  Scores of keys a row does not see
 * never enter its softmax.  (Quantized keys scored on the AMX tiles: a query
 * row holding a NaN or an infinity -- whose fixed-point form cannot hold it --
 * scores NaN.)
 *
 * FLOAT16 / BFLOAT16 elements are converted to float32 in the load step of the
 * inner loops (vcvtph2ps / zero-extend + shift left 16 on the AVX2 and AVX-512
 * paths, the bit-exact scalar conversions of simd.h on the scalar path); all
 * math (scores, running max, sum, accumulator) is float32.
 *
 * Instruction sets (okv_attn_unit's simd): OKV_ATTN_SCALAR, OKV_ATTN_AVX2
 * (8-lane tiles) or OKV_ATTN_AVX512 (16-lane tiles and softmax steps; only
 * when okv_cpu_avx512_ok(); float32 K/V keep the AVX2 tiles, which are as
 * fast on this memory-bound stream).  With a->amx (okv_cpu_amx_ok(), per-page
 * formats) the AVX-512 unit scores the keys of quantized pages with per-head
 * key scales, and 8-bit keys with per-channel scales, on the AMX-INT8 tiles
 * (attention_amx.h); a work unit then needs okv_attn_amx_ws_floats more
 * workspace.
 *
 * Per-page formats (paged only, k_fmt / v_fmt != NULL): page id p of the K
 * (V) plane has the format k_fmt[p] (v_fmt[p]), an ONNX element type code of
 * the quantized page layout (float32, float16, bfloat16, uint8, int8, uint4,
 * int4, uint2, int2; attention_quant.h), with kG (vG) scale groups per head.
 * Quantized K pages carry the float32 header, or with k_compact != 0 the
 * compact one (quant.h; kG <= OKV_Q_COMPACT_MAX_G), decoded per page and head.
 * Each tile is loaded by its page's format: codes are dequantized,
 * (q - zp) * scale, in the load step -- no float copy of a page exists.
 */
#ifndef ONNXKV_ATTENTION_H
#define ONNXKV_ATTENTION_H

#include "simd.h"
#include <stdlib.h>

#define OKV_BK 32      /* keys per streamed block */
#define OKV_MAX_TQ 64  /* max query tokens per work unit */
#define OKV_RG 8       /* query rows sharing one K/V row load (one row group) */

#define OKV_KV_F32 0
#define OKV_KV_F16 1
#define OKV_KV_BF16 2

/* instruction sets of the work units (the simd argument of okv_attn_unit) */
#define OKV_ATTN_SCALAR 0
#define OKV_ATTN_AVX2 1
#define OKV_ATTN_AVX512 2

typedef struct {
    const float *q;
    const void *k, *v;              /* contiguous caches (block_tables == NULL) */
    const uint64_t *k_pages, *v_pages; /* paged: page addresses */
    const int32_t *block_tables;    /* paged: [B, M] page ids, NULL for contiguous */
    int64_t M, bs;                  /* paged: blocks per row, keys per block */
    float *out;
    const int32_t *kv_len, *q_pos, *kv_start;
    int64_t B, Hq, Hkv, Sq, Cap, D;
    float scale, softcap;
    int64_t window;
    int kv_type;   /* OKV_KV_F32, OKV_KV_F16 or OKV_KV_BF16 */
    int prefetch;  /* software prefetch of the next K/V block: 0 off, 1 into L1, 2 into L2 */
    int pf_qk_lines; /* AMX key scores: cache lines of that prefetch issued with them (0: all), the rest
                      * spread over the p*v of the item before (attention_impl.h) */
    int prefill_rg; /* row-group width (1..8) of work units with several query tokens */
    int64_t hpu;    /* KV heads per work unit: 1, or Hkv (paged decode: a unit reads whole pages) */
    const uint8_t *k_fmt, *v_fmt;  /* paged, per-page formats: [P] codes each, or both NULL (all kv_type) */
    int64_t kG, vG;                /* scale groups per head of quantized K / V pages: 1 or D */
    int k_compact;                 /* quantized K pages: 0 float32 header, 1 compact header (quant.h) */
    int k_czp;                     /* quantized K pages carry the channel-zero-point header (quant.h): one
                                    * scale per head (kG == 1), D zero points per head; k_compact 0 */
    int amx;                       /* nonzero: the AVX-512 unit of per-page formats scores quantized keys
                                    * (per-head key scales, or per-channel ones of 8-bit codes) on the
                                    * AMX-INT8 tiles (attention_amx.h; the caller checked okv_cpu_amx_ok()) */
} okv_attn_args;

#if defined(__GNUC__) || defined(__clang__)
#define OKV_INLINE static inline __attribute__((always_inline))
#else
#define OKV_INLINE static inline
#endif

/* The K/V data of one KV head (hk) in one page: keys [start, end), key start
 * of head hk at k (v), kst (vst) bytes from one key's row to the next, khs
 * (vhs) bytes from head hk's rows to head hk+1's.  kf, vf: the formats
 * (OKV_FMT_* codes; only set by okv_attn_qpage).  Quantized pages: ksc, kzp
 * (vsc, vzp) point at head hk's scales / zero points in the page header;
 * NULL for float pages.  A compact K header: ksc points at head hk's S, kce at
 * its exponent codes (zero-point codes Hkv*kG bytes further), kzp is NULL;
 * kce is NULL otherwise.  A channel-zero-point K header: ksc points at head
 * hk's scale s, kzw at its zero-point unit w, kzo at its D zero-point codes o
 * (kzp NULL); kzw / kzo are NULL otherwise.  khb, vhb: header bytes per head
 * (0 for float pages; set by okv_attn_qpage). */
typedef struct {
    const char *k, *v;
    int64_t start, end, kst, vst, khs, vhs;
    int kf, vf;
    const float *ksc, *kzp, *vsc, *vzp;
    const uint8_t *kce;
    const float *kzw;
    const int8_t *kzo;
    int64_t khb, vhb;
} okv_kv_page;

/* Dequantization parameters of one head of a quantized page: s, z its
 * scales / zero points (kG or vG of them); s1, z1 = s[0], z[0].  A compact
 * header: s, z NULL until decoded; cS, ce, cz the head's S, exponent codes
 * and zero-point codes (ce NULL for a float32 header).  A channel-zero-point
 * header (keys): s, z NULL, s1 the head's scale, z1 its z0 (okv_q_czp_z0),
 * zo its D zero-point codes and zw their unit, so that zero point c = z1 + zw
 * * zo[c]; zo NULL otherwise. */
typedef struct {
    const float *s, *z;
    float s1, z1;
    const uint8_t *ce, *cz;
    float cS;
    const int8_t *zo;
    float zw;
} okv_dq;

/* Rows a tile function software-prefetches while it works: n rows of K at k
 * (ks bytes apart) and of V at v (vs bytes apart); hint 2: into L2, else L1. */
typedef struct {
    const char *k, *v;
    int64_t ks, vs, n;
    int hint;
} okv_pf;

/* The page holding key j of (b, hk); esz: bytes per element.  Contiguous caches
 * are one page [0, Cap).  Paged: reads one block table entry (that of key j). */
OKV_INLINE okv_kv_page okv_attn_page(const okv_attn_args *a, int64_t b, int64_t hk, int64_t j, size_t esz) {
    okv_kv_page pg;
    if (a->block_tables) {
        const int64_t blk = j / a->bs;
        const int32_t id = a->block_tables[b * a->M + blk];
        const size_t off = (size_t)(hk * a->bs * a->D) * esz;
        pg.k = (const char *)(uintptr_t)a->k_pages[id] + off;
        pg.v = (const char *)(uintptr_t)a->v_pages[id] + off;
        pg.start = blk * a->bs;
        pg.end = pg.start + a->bs;
        pg.khs = pg.vhs = a->bs * a->D * (int64_t)esz;
    } else {
        const size_t off = (size_t)((b * a->Hkv + hk) * a->Cap * a->D) * esz;
        pg.k = (const char *)a->k + off;
        pg.v = (const char *)a->v + off;
        pg.start = 0;
        pg.end = a->Cap;
        pg.khs = pg.vhs = a->Cap * a->D * (int64_t)esz;
    }
    pg.kst = pg.vst = a->D * (int64_t)esz;
    return pg;
}

/* Smallest key >= j that some of the n query tokens sees (token t sees
 * [lo[t], hi[t])); INT64_MAX if none.  Keys no token sees are skipped, so the
 * pages (and block table entries) holding only such keys are never read. */
OKV_INLINE int64_t okv_next_seen(const int64_t *lo, const int64_t *hi, int64_t n, int64_t j) {
    int64_t best = INT64_MAX, t;
    for (t = 0; t < n; t++)
        if (hi[t] > j && lo[t] < hi[t]) {
            const int64_t x = lo[t] > j ? lo[t] : j;
            if (x < best) best = x;
        }
    return best;
}

#if OKV_X86_SIMD
/* Software prefetch, by a tile function, of rows j..j+nk-1 (those < pf->n) of
 * the next block's K and V: the streams cross a 4 KiB page every few rows,
 * where the hardware prefetcher restarts.  K and V rows interleaved; rows of
 * different lengths (per-page formats) are prefetched over the longer length
 * (a prefetch past a row is harmless); hint >= 2 into L2, else L1. */
OKV_INLINE void okv_pf_rows(const okv_pf *pf, int64_t j, int nk) {
    const int64_t rowb = pf->ks > pf->vs ? pf->ks : pf->vs;
    int kk;
    for (kk = 0; kk < nk; kk++)
        if (j + kk < pf->n) {
            const char *pk = pf->k + (j + kk) * pf->ks, *pv = pf->v + (j + kk) * pf->vs;
            int64_t o;
            if (pf->hint >= 2)
                for (o = 0; o < rowb; o += 64) {
                    _mm_prefetch(pk + o, _MM_HINT_T1);
                    _mm_prefetch(pv + o, _MM_HINT_T1);
                }
            else
                for (o = 0; o < rowb; o += 64) {
                    _mm_prefetch(pk + o, _MM_HINT_T0);
                    _mm_prefetch(pv + o, _MM_HINT_T0);
                }
        }
}

/* The 16 horizontal sums of a[0..15] in one vector, by a transposing tree of
 * 128-bit block and in-block shuffles (45 operations): the sum of a[s] lands
 * in lane OKV_HSUM16_LANE(s). */
#define OKV_HSUM16_LANE(s) ((((s) & 3) << 2) | ((s) >> 2))
OKV_INLINE OKV_AVX512BW __m512 okv_hsum16x16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    int p;
    for (p = 0; p < 8; p++)   /* 256-bit halves folded: [a(2p) 8 lanes | a(2p+1) 8 lanes] */
        b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
    for (p = 0; p < 4; p++)   /* block k: a(4p+k) folded to 4 lanes */
        c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0xDD));
    for (p = 0; p < 2; p++)   /* block k: 2 lanes each of a(8p+k), a(8p+4+k) */
        d[p] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * p], c[2 * p + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * p], c[2 * p + 1], 0xEE));
    /* block k: a(k), a(4+k), a(8+k), a(12+k) */
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

/* The first min(r, 16) lanes. */
OKV_INLINE __mmask16 okv_mask16(int64_t r) { return r >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << r) - 1u); }

/* exp(x) in the lanes of k, 0 elsewhere, for x <= 0 or -inf (scores minus
 * their running max): n = round(x log2(e)), r = x - n ln(2) (ln(2) in two
 * parts), e^r by the Cephes polynomial (as okv_exp256), times 2^n by
 * vscalefps; x < -87.34 gives 0, as okv_exp256. */
OKV_INLINE OKV_AVX512BW __m512 okv_exp512_nonpos(__m512 x, __mmask16 k) {
    static const float poly[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                                  4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};
    const __m512 lo = _mm512_set1_ps(-87.3365447505531f);
    const __mmask16 keep = k & _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    __m512 n, r, y;
    int i;
    x = _mm512_max_ps(x, lo);
    n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    y = _mm512_set1_ps(poly[0]);
    for (i = 1; i < 6; i++) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(poly[i]));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, y, n);
}

/* The softmax steps of the AVX-512 unit over at most OKV_BK scores: the
 * maximum of x[0..n) (okv_attn_max: NaN when one of them is NaN), and x[i] =
 * exp(x[i] - m) (-inf -> 0) returning their sum, 16 lanes at a time. */
OKV_INLINE OKV_AVX512BW float okv_attn_max_avx512(const float *x, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    int64_t i;
    for (i = 0; i < n; i += 16) {
        const __m512 v = _mm512_mask_loadu_ps(m, okv_mask16(n - i), x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, v);
    }
    return nan ? NAN : _mm512_reduce_max_ps(m);
}

OKV_INLINE OKV_AVX512BW float okv_exp_sub_sum_f32_avx512(float *x, float m, int64_t n) {
    const __m512 vm = _mm512_set1_ps(m);
    __m512 s = _mm512_setzero_ps();
    int64_t i;
    for (i = 0; i < n; i += 16) {
        const __mmask16 k = okv_mask16(n - i);
        const __m512 e = okv_exp512_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm), k);
        _mm512_mask_storeu_ps(x + i, k, e);
        s = _mm512_add_ps(s, e);
    }
    return _mm512_reduce_add_ps(s);
}

/* The AVX-512 unit and tiles take these simd.h primitives as they are. */
#define okv_scal_f32_avx512 okv_scal_f32_avx2
#define okv_scale_mul_f32_avx512 okv_scale_mul_f32_avx2
#define okv_dot_f32_avx512 okv_dot_f32_avx2
#endif

/* The largest score of x[0..n) for a work unit's softmax, or NaN when one of
 * them is NaN: the running max of the max instructions (and of a plain
 * compare) drops NaN, which would turn a NaN score into weight 0 instead of
 * the NaN row the dense softmax gives.  The NaN test costs one compare per
 * vector of scores, none per key element. */
static inline float okv_attn_max_scalar(const float *x, int64_t n) {
    float m = -INFINITY;
    int nan = 0;
    int64_t i;
    for (i = 0; i < n; i++) {
        m = x[i] > m ? x[i] : m;
        nan |= x[i] != x[i];
    }
    return nan ? NAN : m;
}

#if OKV_X86_SIMD
OKV_AVX2 static inline float okv_attn_max_avx2(const float *x, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    float r;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, v);
    }
    r = okv_hmax256(m);
    if (_mm256_movemask_ps(nan)) return NAN;
    for (; i < n; i++) {
        if (x[i] != x[i]) return NAN;
        r = x[i] > r ? x[i] : r;
    }
    return r;
}
#endif

/* Floats of workspace one work unit of R rows needs (attention_impl.h: for
 * every row its accumulator, max, sum, query sum, zero-point correction, and,
 * with 4-bit pages on AVX-512, an interleaved query row and accumulator; two
 * score slots of OKV_RG rows; OKV_RG folded query rows), rounded up to whole
 * 64-byte lines so that per-thread workspaces never share a cache line. */
static inline int64_t okv_attn_ws_floats(int64_t R, int64_t D) {
    return (R * (3 * D + 4) + OKV_RG * (D + 2 * OKV_BK) + 15) & ~(int64_t)15;
}

/* One instantiation of attention_impl.h per (instruction set, K/V element type).
 * OKV_KT: type suffix; OKV_KT_T: C element type; OKV_LD1(p, d): element d of
 * the row at p as float; OKV_LD8(p, i): elements i..i+7 as __m256 (AVX2 and
 * AVX-512); OKV_LD16(p, i): elements i..i+15 as __m512 (AVX-512 only).
 * Then attention_quant.h: the quantized formats' tile functions and the unit
 * of per-page formats. */
#define OKV_SFX _scalar
#define OKV_ATTR
#define OKV_RS(D) (D)

#define OKV_KT f32
#define OKV_KT_T float
#define OKV_LD1(p, d) ((p)[d])
#include "attention_impl.h"
#undef OKV_KT
#undef OKV_KT_T
#undef OKV_LD1

#define OKV_KT f16
#define OKV_KT_T uint16_t
#define OKV_LD1(p, d) okv_h2f_scalar((p)[d])
#include "attention_impl.h"
#undef OKV_KT
#undef OKV_KT_T
#undef OKV_LD1

#define OKV_KT bf16
#define OKV_KT_T uint16_t
#define OKV_LD1(p, d) okv_bf2f_scalar((p)[d])
#include "attention_impl.h"
#undef OKV_KT
#undef OKV_KT_T
#undef OKV_LD1
#undef OKV_RS

#include "attention_quant.h"

#undef OKV_SFX
#undef OKV_ATTR

#if OKV_X86_SIMD
#define OKV_SFX _avx2
#define OKV_ATTR OKV_AVX2
#define OKV_SIMD_BODY 1
#define OKV_RS(D) (D)

#define OKV_KT f32
#define OKV_KT_T float
#define OKV_LD1(p, d) ((p)[d])
#define OKV_LD8(p, i) _mm256_loadu_ps((p) + (i))
#include "attention_impl.h"
#undef OKV_KT
#undef OKV_KT_T
#undef OKV_LD1
#undef OKV_LD8

#define OKV_KT f16
#define OKV_KT_T uint16_t
#define OKV_LD1(p, d) okv_h2f_scalar((p)[d])
#define OKV_LD8(p, i) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((p) + (i))))
#include "attention_impl.h"
#undef OKV_KT
#undef OKV_KT_T
#undef OKV_LD1
#undef OKV_LD8

#define OKV_KT bf16
#define OKV_KT_T uint16_t
#define OKV_LD1(p, d) okv_bf2f_scalar((p)[d])
#define OKV_LD8(p, i) okv_bf16x8_to_ps((p) + (i))
#include "attention_impl.h"
#undef OKV_KT
#undef OKV_KT_T
#undef OKV_LD1
#undef OKV_LD8
#undef OKV_RS

#include "attention_quant.h"

#undef OKV_SIMD_BODY
#undef OKV_SFX
#undef OKV_ATTR

#include "attention_amx.h"

/* AVX-512 (16 lanes).  Float32 K/V take the AVX2 unit and tiles (aliases
 * below): streaming float32 is memory bound, and 16 lanes measured no faster
 * on 2 threads and ~4% slower on one (16384 keys, GQA 32/8, D 128). */
#define OKV_SFX _avx512
#define OKV_ATTR OKV_AVX512BW
#define OKV_SIMD512 1
#if OKV_HAVE_AMX
#define OKV_SIMD512_AMX 1   /* the unit of per-page formats may run the AMX tiles (attention_amx.h) */
#endif
#define OKV_RS(D) (D)
#define okv_qk_rows_f32_avx512 okv_qk_rows_f32_avx2
#define okv_pv_rows_f32_avx512 okv_pv_rows_f32_avx2

#define OKV_KT f16
#define OKV_KT_T uint16_t
#define OKV_LD1(p, d) okv_h2f_scalar((p)[d])
#define OKV_LD8(p, i) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((p) + (i))))
#define OKV_LD16(p, i) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((p) + (i))))
#include "attention_impl.h"
#undef OKV_KT
#undef OKV_KT_T
#undef OKV_LD1
#undef OKV_LD8
#undef OKV_LD16

#define OKV_KT bf16
#define OKV_KT_T uint16_t
#define OKV_LD1(p, d) okv_bf2f_scalar((p)[d])
#define OKV_LD8(p, i) okv_bf16x8_to_ps((p) + (i))
#define OKV_LD16(p, i) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((p) + (i)))), 16))
#include "attention_impl.h"
#undef OKV_KT
#undef OKV_KT_T
#undef OKV_LD1
#undef OKV_LD8
#undef OKV_LD16
#undef OKV_RS

#include "attention_quant.h"

#undef OKV_SIMD512
#undef OKV_SIMD512_AMX
#undef OKV_SFX
#undef OKV_ATTR
#endif

/* Floats of the AMX scratch (attention_amx.h) a work unit of nt <= tq query
 * tokens needs after its okv_attn_ws_floats (0 unless a->amx with per-page
 * formats): B tiles of every (head, row group) item, for either row-group
 * width the unit may pick (attention_impl.h). */
static inline int64_t okv_attn_amx_ws_floats(const okv_attn_args *a, int64_t tq) {
#if OKV_HAVE_AMX
    const int64_t R = a->Hq / a->Hkv * tq, w2 = a->prefill_rg;
    int64_t b1, b2;
    if (!a->amx || !a->k_fmt) return 0;
    b1 = okv_amx_ws_bytes(a->D, a->hpu * ((R + OKV_RG - 1) / OKV_RG), R < OKV_RG ? R : OKV_RG);
    b2 = okv_amx_ws_bytes(a->D, a->hpu * ((R + w2 - 1) / w2), R < w2 ? R : w2);
    return (b1 > b2 ? b1 : b2) / 4;
#else
    (void)a;
    (void)tq;
    return 0;
#endif
}

/* Floats of one partial state block (R rows of max, sum, acc[D]), whole lines. */
static inline int64_t okv_attn_part_floats(int64_t R, int64_t D) { return (R * (D + 2) + 15) & ~(int64_t)15; }

/* 64-byte aligned pointer inside a block allocated with 16 spare floats. */
static inline float *okv_align64(float *p) { return (float *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

/* Work unit (b, KV heads [hk0, hk0+a->hpu), query tokens [t0, t1), keys [c0, c1)); see attention_impl.h.
 * ws: okv_attn_ws_floats(hpu*G*(t1-t0), D) floats.  part (or NULL): head hk0+h's
 * partial state block at part + h*pstride.  Returns the bytes of quantized
 * codes and header entries it loaded (0 without per-page formats). */
/* simd: OKV_ATTN_SCALAR, OKV_ATTN_AVX2 or OKV_ATTN_AVX512 (the caller has checked the CPU). */
#define OKV_ATTN_UNIT_OF(sfx)                                                                                  \
    do {                                                                                                       \
        if (a->k_fmt) return OKV_CAT(okv_attn_unit_mixed, sfx)(a, b, hk0, nh, t0, t1, c0, c1, ws, part, pstride); \
        switch (a->kv_type) {                                                                                  \
        case OKV_KV_F16: return OKV_CAT(okv_attn_unit_f16, sfx)(a, b, hk0, nh, t0, t1, c0, c1, ws, part, pstride); \
        case OKV_KV_BF16:                                                                                      \
            return OKV_CAT(okv_attn_unit_bf16, sfx)(a, b, hk0, nh, t0, t1, c0, c1, ws, part, pstride);         \
        default: return OKV_CAT(okv_attn_unit_f32, sfx)(a, b, hk0, nh, t0, t1, c0, c1, ws, part, pstride);    \
        }                                                                                                      \
    } while (0)
static int64_t okv_attn_unit(const okv_attn_args *a, int64_t b, int64_t hk0, int64_t t0, int64_t t1, int64_t c0,
                             int64_t c1, float *ws, float *part, int64_t pstride, int simd) {
    const int64_t nh = a->hpu;
#if OKV_X86_SIMD
    if (simd == OKV_ATTN_AVX512) {   /* float32 K/V: the AVX2 unit (see the AVX-512 instantiation) */
        if (a->k_fmt) return okv_attn_unit_mixed_avx512(a, b, hk0, nh, t0, t1, c0, c1, ws, part, pstride);
        if (a->kv_type == OKV_KV_F16) return okv_attn_unit_f16_avx512(a, b, hk0, nh, t0, t1, c0, c1, ws, part, pstride);
        if (a->kv_type == OKV_KV_BF16)
            return okv_attn_unit_bf16_avx512(a, b, hk0, nh, t0, t1, c0, c1, ws, part, pstride);
    }
    if (simd) OKV_ATTN_UNIT_OF(_avx2);
#endif
    (void)simd;
    OKV_ATTN_UNIT_OF(_scalar);
}
#undef OKV_ATTN_UNIT_OF

/* Union [lo, hi) of the keys visible to any query token of batch b. */
static void okv_attn_range(const okv_attn_args *a, int64_t b, int64_t *lo, int64_t *hi) {
    const int64_t kvl = a->kv_len[b], kvs = a->kv_start ? a->kv_start[b] : 0;
    int64_t L = INT64_MAX, H = INT64_MIN, t;
    for (t = 0; t < a->Sq; t++) {
        int64_t p = a->q_pos[b * a->Sq + t], l = kvs, h = p + 1;
        if (a->window >= 0 && p - a->window > l) l = p - a->window;
        if (kvl < h) h = kvl;
        if (l < h) {
            if (l < L) L = l;
            if (h > H) H = h;
        }
    }
    if (L >= H) { L = 0; H = 0; }
    *lo = L; *hi = H;
}

/* Work unit i of a cache-split run: unit u = i / nchunks (batch b, KV heads
 * [hk0, hk0 + hpu)), chunk c = i % nchunks of that batch's visible key range;
 * writes the partial state of (b, hk) to parts + ((b*Hkv + hk)*nchunks + c) *
 * okv_attn_part_floats(R, D) (R = G*Sq), the layout okv_attn_merge reads.
 * Returns okv_attn_unit's count of quantized bytes loaded. */
static int64_t okv_attn_split_task(const okv_attn_args *a, int64_t i, int64_t nchunks, float *ws, float *parts,
                                   int simd) {
    const int64_t G = a->Hq / a->Hkv, R = G * a->Sq, u = i / nchunks, c = i % nchunks, upb = a->Hkv / a->hpu;
    const int64_t b = u / upb, hk0 = (u % upb) * a->hpu, psz = okv_attn_part_floats(R, a->D);
    int64_t lo, hi, cs, c0, c1;
    okv_attn_range(a, b, &lo, &hi);
    cs = (hi - lo + nchunks - 1) / nchunks;
    c0 = lo + c * cs;
    c1 = c0 + cs;
    if (a->block_tables) {   /* inner chunk edges on page boundaries */
        if (c > 0) c0 = (c0 + a->bs - 1) / a->bs * a->bs;
        c1 = (c1 + a->bs - 1) / a->bs * a->bs;
    }
    if (c1 > hi) c1 = hi;
    if (c0 > c1) c0 = c1;
    return okv_attn_unit(a, b, hk0, 0, a->Sq, c0, c1, ws, parts + ((b * a->Hkv + hk0) * nchunks + c) * psz,
                         nchunks * psz, simd);
}

/* Merge nchunks partial states of one (b, hk) group (R = G*Sq rows) and write
 * the normalised result.  parts: nchunks blocks of okv_attn_part_floats(R, D)
 * floats, each [R][D+2] as written by okv_attn_unit. */
static void okv_attn_merge(const okv_attn_args *a, int64_t b, int64_t hk, const float *parts, int64_t nchunks) {
    const int64_t D = a->D, G = a->Hq / a->Hkv, Sq = a->Sq, R = G * Sq;
    int64_t r, c, i;
    for (r = 0; r < R; r++) {
        int64_t g = r / Sq, t = r % Sq;
        float *o = a->out + ((b * a->Hq + hk * G + g) * Sq + t) * D;
        float M = -INFINITY, L = 0.f;
        int nan = 0;
        for (c = 0; c < nchunks; c++) {
            float m = parts[c * okv_attn_part_floats(R, D) + r * (D + 2)];
            if (m > M) M = m;
            nan |= m != m;   /* a chunk that met a NaN or +inf score (attention_impl.h): the row is NaN */
        }
        if (nan) {
            for (i = 0; i < D; i++) o[i] = NAN;
            continue;
        }
        memset(o, 0, (size_t)D * sizeof(float));
        if (M == -INFINITY) continue;
        for (c = 0; c < nchunks; c++) {
            const float *pr = parts + c * okv_attn_part_floats(R, D) + r * (D + 2);
            float w;
            if (pr[0] == -INFINITY || pr[1] == 0.f) continue;
            w = expf(pr[0] - M);
            L += pr[1] * w;
            for (i = 0; i < D; i++) o[i] += w * pr[2 + i];
        }
        if (L > 0.f) {
            float inv = 1.f / L;
            for (i = 0; i < D; i++) o[i] *= inv;
        }
    }
}

#endif /* ONNXKV_ATTENTION_H */
