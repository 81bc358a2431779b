/* onnxkv/_kernels/attention_kv.h -- the K/V element formats of the attention
 * tiles and their loaders.
 *
 * A K/V row of head size D is okv_fmt_row_bytes(fmt, D) bytes in one of the
 * page formats (ONNX TensorProto element type codes OKV_FMT_*): float32,
 * float16, bfloat16, or 8-, 4- or 2-bit codes packed low bits first (quant.h).
 * The loaders return elements of a row as float32:
 *   okv_kv_ld1   element d                          (any instruction set)
 *   okv_kv_ld8   elements i..i+7 as __m256          (AVX2; i % 8 == 0)
 *   okv_kv_ld16  elements i..i+15 as __m512         (AVX-512; i % 16 == 0)
 * Float formats convert (vcvtph2ps / zero-extend + shift left 16; the
 * bit-exact scalar conversions of simd.h).  Codes load raw (pc == 0: the
 * tiles of per-head scales, whose scale and zero point the format dispatchers
 * fold into scores and probabilities) or dequantized per channel (pc != 0:
 * (code - dqz[d]) * dqs[d] with the head's header vectors, in registers).
 * AVX-512, raw 4-bit codes: okv_kv_ld16 yields each 16-element chunk in
 * quant.h's interleaved lane order OKV_Q4_ILV (okv_q4_load16_ilv_ps); the
 * callers pass query rows and take accumulators in that order on [0, D &
 * ~15) (attention_quant.h).
 *
 * Every loader is always inlined and its fmt / pc arguments are constants
 * at every call site of the tiles: the format switch folds away and each
 * tile instantiation loads one format only.
 */
#ifndef ONNXKV_ATTENTION_KV_H
#define ONNXKV_ATTENTION_KV_H

#include "quant.h"

/* ONNX TensorProto element type codes of the page formats */
#define OKV_FMT_F32 1
#define OKV_FMT_U8 2
#define OKV_FMT_I8 3
#define OKV_FMT_F16 10
#define OKV_FMT_BF16 16
#define OKV_FMT_U4 21
#define OKV_FMT_I4 22
#define OKV_FMT_U2 25
#define OKV_FMT_I2 26

/* Bits per element of a format code (the caller has checked the code):
 * quant.h's okv_q_bits for the integer formats, else 16 or 32. */
static inline int64_t okv_fmt_bits(int f) {
    if (okv_q_bits(f)) return okv_q_bits(f);
    return f == OKV_FMT_F16 || f == OKV_FMT_BF16 ? 16 : 32;
}

/* Bytes from one token's row of head size D to the next. */
OKV_INLINE int64_t okv_fmt_row_bytes(int fmt, int64_t D) {
    switch (fmt) {
    case OKV_FMT_F32: return D * 4;
    case OKV_FMT_F16:
    case OKV_FMT_BF16: return D * 2;
    default: return okv_q_row_bytes(fmt, D);
    }
}

/* Element d of the row at p as float32 (pc: per-channel dequantization by
 * dqs / dqz). */
OKV_INLINE float okv_kv_ld1(const char *p, int64_t d, const int fmt, const int pc, const float *dqs,
                            const float *dqz) {
    switch (fmt) {
    case OKV_FMT_F32: return ((const float *)p)[d];
    case OKV_FMT_F16: return okv_h2f_scalar(((const uint16_t *)p)[d]);
    case OKV_FMT_BF16: return okv_bf2f_scalar(((const uint16_t *)p)[d]);
    default:
        if (pc) return ((float)okv_q_get((const uint8_t *)p, fmt, d) - dqz[d]) * dqs[d];
        return (float)okv_q_get((const uint8_t *)p, fmt, d);
    }
}

#if OKV_X86_SIMD
/* Elements i..i+7 of the row at p (natural order, every format). */
OKV_INLINE OKV_AVX2 __m256 okv_kv_ld8(const char *p, int64_t i, const int fmt, const int pc, const float *dqs,
                                      const float *dqz) {
    switch (fmt) {
    case OKV_FMT_F32: return _mm256_loadu_ps((const float *)p + i);
    case OKV_FMT_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    case OKV_FMT_BF16: return okv_bf16x8_to_ps((const uint16_t *)p + i);
    default: {
        const __m256 c = _mm256_cvtepi32_ps(okv_q_load8((const uint8_t *)p, fmt, i));
        if (pc) return _mm256_mul_ps(_mm256_sub_ps(c, _mm256_loadu_ps(dqz + i)), _mm256_loadu_ps(dqs + i));
        return c;
    }
    }
}

/* Elements i..i+15 of the row at p (raw 4-bit codes: interleaved order). */
OKV_INLINE OKV_AVX512BW __m512 okv_kv_ld16(const char *p, int64_t i, const int fmt, const int pc, const float *dqs,
                                           const float *dqz) {
    switch (fmt) {
    case OKV_FMT_F32: return _mm512_loadu_ps((const float *)p + i);
    case OKV_FMT_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    case OKV_FMT_BF16:
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    default:
        if (pc)
            return _mm512_mul_ps(_mm512_sub_ps(okv_q_load16_ps((const uint8_t *)p, fmt, i), _mm512_loadu_ps(dqz + i)),
                                 _mm512_loadu_ps(dqs + i));
        if (fmt == OKV_FMT_U4 || fmt == OKV_FMT_I4) return okv_q4_load16_ilv_ps((const uint8_t *)p, fmt, i);
        return okv_q_load16_ps((const uint8_t *)p, fmt, i);
    }
}
#endif

#endif /* ONNXKV_ATTENTION_KV_H */
