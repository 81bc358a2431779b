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
 * straddle a page, one page lookup per page (attention_unit.h); a work unit
 * covers hpu KV heads (paged decode: all of them, so that it reads each page
 * front to back).
 * Query token t of batch b at absolute position p = q_pos[b, t] sees keys j with
 *   max(kv_start[b], p - window (if window >= 0)) <= j <= p  and  j < kv_len[b].
 * Scores: s = scale * dot(q, k_j); if softcap > 0: s = softcap * tanh(s / softcap).
 * A row with no visible key outputs zeros.
 * NaN and infinities follow the dense softmax (NumPy, onnx.reference): a query
 * row one of whose visible scores is NaN or +inf outputs NaN (whatever the
 * other scores), a row whose visible scores are all -inf outputs zeros, -inf
 * scores get weight 0, and a NaN or infinite value of a key the row sees
 * reaches its output through p * v (IEEE rules: a weight of 0 times an
 * infinity is NaN).  Neither the scores nor the values of keys a row does not
 * see enter its output, not even as 0 * NaN: the tiles a group of rows shares
 * along the causal diagonal or a window edge take such values row by row
 * (test_attention_unseen_values.py).  (Quantized keys scored on the AMX tiles: a query
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
 *
 * A work unit is (batch b, kv heads [hk0, hk0+nh), query tokens [t0, t1), keys
 * [c0, c1)).  Per KV head hk, the G = Hq/Hkv query heads of the group and the
 * nt = t1-t0 query tokens form R = G*nt rows (r = g*nt + t); the heads are
 * taken one after the other inside each block (a multi-head unit reads a
 * page's heads in memory order, front to back).  Keys are streamed in blocks
 * (tiles) of up to OKV_BK keys that never straddle a page (okv_attn_page: one
 * page lookup per page; a contiguous cache is one page) and start at a key
 * some token of the unit sees, so keys and pages no token sees are skipped and
 * their page table entries never read.  Inside a block the rows are taken in
 * row groups (up to OKV_RG = 8 rows for decode, a->prefill_rg rows when the
 * unit has several query tokens), and for each row group every K row and
 * every V row of the block is loaded (and converted to float32) exactly once
 * in registers and used by all rows of the group (the tiles).  Decode (Sq =
 * 1) with G <= 8 is one row group, so each K/V byte is read from memory and
 * converted once per token; with G > 8 or in prefill, further row groups
 * re-read the block from L1.  The next block is software-prefetched (into L2
 * by default, through its own page) while the current one is scored; with
 * AMX key scores, which take a fraction of the time of the others, only the
 * first a->pf_qk_lines cache lines of each item's share go with its key
 * tiles, the rest spread over the p*v of the item before (a burst of
 * prefetches stalls the loads behind it).  Online softmax per row (running
 * max, sum and accumulator in float32); a NaN or +inf visible score sets the
 * row's max and sum to NaN, which the final normalisation (and
 * okv_attn_merge) turn into a NaN row.
 */
#ifndef ONNXKV_ATTENTION_H
#define ONNXKV_ATTENTION_H

#include <stdlib.h>

#include "attention_amx.h"
#include "attention_softmax.h"
#include "attention_types.h"

/* The work units of each instruction set, compiled once per level in a
 * translation unit of its own (attention_unit_<level>.c). */
#include "attention_units.h"

/* Floats of the AMX scratch (attention_amx.h) a work unit of nt <= tq query
 * tokens needs after its okv_attn_ws_floats (0 unless a->amx with per-page
 * formats): B tiles of every (head, row group) item, for either row-group
 * width the unit may pick (attention_unit.h). */
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

/* Whether a work unit takes the prefill unit (attention_flash.h): a->flash, native K/V, the output written
 * (no partial state), every key (c0 = 0, c1 = Cap), and at least OKV_FLASH_MIN_ROWS query rows of
 * OKV_FLASH_MIN_TOKENS tokens (fewer fill too few lanes of its row blocks: 4 tokens of 4 heads, half an
 * AVX-512 block, ran 20% slower than the streaming unit over a 1,000-key past; 6 tokens, 25% faster). */
#define OKV_FLASH_MIN_TOKENS 4
#define OKV_FLASH_MIN_ROWS 24
static inline int okv_attn_flash_unit(const okv_attn_args *a, int64_t t0, int64_t t1, int64_t c0, int64_t c1,
                                      const float *part) {
    return a->flash && !a->k_fmt && !part && c0 == 0 && c1 >= a->Cap && t1 - t0 >= OKV_FLASH_MIN_TOKENS &&
           a->Hq / a->Hkv * (t1 - t0) >= OKV_FLASH_MIN_ROWS;
}

/* Floats of workspace a work unit of tq query tokens needs, whichever unit it takes. */
static inline int64_t okv_attn_unit_ws_floats(const okv_attn_args *a, int64_t tq) {
    const int64_t w = okv_attn_ws_floats(a->hpu * (a->Hq / a->Hkv) * tq, a->D) + okv_attn_amx_ws_floats(a, tq);
    const int64_t f = okv_attn_flash_ws_floats(a->D);
    return w > f ? w : f;
}

/* Work unit (b, KV heads [hk0, hk0+a->hpu), query tokens [t0, t1), keys [c0, c1)); see attention_unit.h.
 * ws: okv_attn_ws_floats(hpu*G*(t1-t0), D) floats.  part (or NULL): head hk0+h's
 * partial state block at part + h*pstride.  Returns the bytes of quantized
 * codes and header entries it loaded (0 without per-page formats). */
/* simd: OKV_ATTN_SCALAR, OKV_ATTN_AVX2 or OKV_ATTN_AVX512 (the caller has checked the CPU). */
static int64_t okv_attn_unit(const okv_attn_args *a, int64_t b, int64_t hk0, int64_t t0, int64_t t1, int64_t c0,
                             int64_t c1, float *ws, float *part, int64_t pstride, int simd) {
    const int64_t nh = a->hpu;
    if (okv_attn_flash_unit(a, t0, t1, c0, c1, part)) {
#if OKV_X86_SIMD
        if (simd == OKV_ATTN_AVX512) okv_attn_unit_flash_avx512(a, b, hk0, nh, t0, t1, ws);
        else if (simd) okv_attn_unit_flash_avx2(a, b, hk0, nh, t0, t1, ws);
        else
#endif
        okv_attn_unit_flash_scalar(a, b, hk0, nh, t0, t1, ws);
        return 0;
    }
#if OKV_X86_SIMD
    if (simd == OKV_ATTN_AVX512)
        return a->k_fmt ? okv_attn_unit_mixed_avx512(a, b, hk0, nh, t0, t1, c0, c1, ws, part, pstride)
                        : okv_attn_unit_native_avx512(a, b, hk0, nh, t0, t1, c0, c1, ws, part, pstride);
    if (simd)
        return a->k_fmt ? okv_attn_unit_mixed_avx2(a, b, hk0, nh, t0, t1, c0, c1, ws, part, pstride)
                        : okv_attn_unit_native_avx2(a, b, hk0, nh, t0, t1, c0, c1, ws, part, pstride);
#endif
    (void)simd;
    return a->k_fmt ? okv_attn_unit_mixed_scalar(a, b, hk0, nh, t0, t1, c0, c1, ws, part, pstride)
                    : okv_attn_unit_native_scalar(a, b, hk0, nh, t0, t1, c0, c1, ws, part, pstride);
}

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
            nan |= m != m;   /* a chunk that met a NaN or +inf score (attention_unit.h): the row is NaN */
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
