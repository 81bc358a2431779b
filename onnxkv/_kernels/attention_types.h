/* onnxkv/_kernels/attention_types.h -- the shared vocabulary of the
 * attention kernel headers: the arguments of a call (okv_attn_args), the
 * K/V data of one page (okv_kv_page) and its lookup (okv_attn_page), the
 * dequantization parameters of one head (okv_dq), the rows a tile
 * prefetches (okv_pf, okv_pf_rows), the block / row-group sizes and the
 * instruction-set codes of the work units.  The layouts and the semantics
 * of a call are described in attention.h.
 */
#ifndef ONNXKV_ATTENTION_TYPES_H
#define ONNXKV_ATTENTION_TYPES_H

#include "bf16_round.h"
#include "simd.h"

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
                      * spread over the p*v of the item before (attention_unit.h) */
    int prefill_rg; /* row-group width (1..8) of work units with several query tokens */
    int flash;      /* 1: units of several query tokens over native K/V take the prefill unit (attention_flash.h) */
    int bf16;       /* 1: the prefill unit rounds its products' operands to bfloat16 (prefill_precision="bf16",
                     * calls of at least OKV_BF16_MIN_ROWS query tokens: attention_flash.h) */
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
#define OKV_NEXT_SEEN_BODY                                        \
    int64_t best = INT64_MAX, t;                                  \
    for (t = 0; t < n; t++)                                       \
        if (hi[t] > j && lo[t] < hi[t]) {                         \
            const int64_t x = lo[t] > j ? (int64_t)lo[t] : j;     \
            if (x < best) best = x;                               \
        }                                                         \
    return best;

OKV_INLINE int64_t okv_next_seen(const int64_t *lo, const int64_t *hi, int64_t n, int64_t j) { OKV_NEXT_SEEN_BODY }

/* The same over int32 ranges (the tiled prefill unit's lanes, attention_flash.h). */
OKV_INLINE int64_t okv_next_seen32(const int32_t *lo, const int32_t *hi, int64_t n, int64_t j) { OKV_NEXT_SEEN_BODY }
#undef OKV_NEXT_SEEN_BODY

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

#endif

/* Floats of workspace one work unit of R rows needs (attention_unit.h: for
 * every row its accumulator, max, sum, query sum, zero-point correction, and,
 * with 4-bit pages on AVX-512, an interleaved query row and accumulator; two
 * score slots of OKV_RG rows; OKV_RG folded query rows), rounded up to whole
 * 64-byte lines so that per-thread workspaces never share a cache line. */
static inline int64_t okv_attn_ws_floats(int64_t R, int64_t D) {
    return (R * (3 * D + 4) + OKV_RG * (D + 2 * OKV_BK) + 15) & ~(int64_t)15;
}

/* Floats of workspace the prefill unit (attention_flash.h) needs at any level: Qt, Ot, S, Kf, Vf, m, l
 * and the lanes' key ranges of its widest row block (OKV_FLASH_RB rows), whole lines. */
#define OKV_FLASH_RB 32
static inline int64_t okv_attn_flash_ws_floats(int64_t D) {
    return (2 * D * OKV_FLASH_RB + OKV_BK * OKV_FLASH_RB + 2 * OKV_BK * D + 4 * OKV_FLASH_RB + 15) & ~(int64_t)15;
}

#endif /* ONNXKV_ATTENTION_TYPES_H */
