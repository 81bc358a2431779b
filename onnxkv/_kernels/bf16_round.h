/* onnxkv/_kernels/bf16_round.h -- the bfloat16 rounding of prefill_precision="bf16"
 * (matmul_bf16.h, attention_flash.h): nearest even, a subnormal float32 to a
 * zero of its sign, a NaN to a quiet NaN -- the rounding of VCVTNEPS2BF16,
 * so the portable code and the AVX-512-BF16 conversions give the same bits. */
#ifndef ONNXKV_BF16_ROUND_H
#define ONNXKV_BF16_ROUND_H

#include <stdint.h>
#include <string.h>

#include "simd.h"

/* Products (matmul_packed rows) and attention calls (query tokens) of at
 * least this many rows round to bfloat16 when the setting is on: decode
 * steps and speculative verifications (<= 16 rows) stay float32, and a chunk
 * of this many rows pays for rounding its weights. */
#define OKV_BF16_MIN_ROWS 32

/* bfloat16 bits of v. */
static inline uint16_t okv_bf16_round(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u >> 16) & 0x8000u);     /* zero, subnormal */
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN: quiet */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float okv_bf16_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float v;
    memcpy(&v, &u, 4);
    return v;
}

/* v rounded to bfloat16, as a float. */
static inline float okv_bf16_rounded(float v) { return okv_bf16_float(okv_bf16_round(v)); }

#if OKV_X86_SIMD && OKV_HAVE_BF16
/* 16 pairs of rounded elements: 32-bit lane c holds lo[c] (low half) and hi[c] (high half), the operand
 * order of VDPBF16PS for sums over the pair. */
OKV_BF16 static inline __attribute__((always_inline)) __m512i okv_bf16_pairs16(__m512 lo, __m512 hi) {
    const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(ilv, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
#endif

#endif /* ONNXKV_BF16_ROUND_H */
