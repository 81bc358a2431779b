/* onnxkv/_kernels/attention_qfmt.h -- the tile functions (okv_qk_rows,
 * okv_pv_rows of attention_impl.h) of one quantized page format, twice:
 * on raw codes (OKV_KT = <fmt>h: for per-head scales, the head's one scale and
 * zero point folded into scores and probabilities by the dispatchers of
 * attention_quant.h; also the scores of per-channel keys, whose channel scales
 * the dispatcher folds into the query rows) and, for values with per-channel
 * scales, okv_pv_rows only (<fmt>c: (code - zp[c]) * scale[c] in the load
 * step, with the head's header vectors).
 *
 * Included by attention_quant.h per instruction set with OKV_QN (name: u8,
 * i8, u4, i4, u2, i2) and OKV_QFMT (its format code) defined; undefines both.
 *
 * AVX-512, 4-bit formats: the 16-lane loader of the raw-code tiles yields
 * each 16-element chunk of a row in quant.h's interleaved order OKV_Q4_ILV
 * (okv_q4_load16_ilv_ps), so their callers pass query rows and take
 * accumulators in that order on [0, D & ~15); the 8-lane chunk and the
 * scalar tail past D & ~15 stay in natural order (attention_quant.h).
 */
#define OKV_QRAW1(p, d) OKV_QCODE1(p, OKV_QFMT, d)
#define OKV_QRAW8(p, i) OKV_QCODE8(p, OKV_QFMT, i)
#define OKV_QRAW16(p, i) OKV_QCODE16(p, OKV_QFMT, i)
#define OKV_KT_T uint8_t
#define OKV_RS(D) okv_q_row_bytes(OKV_QFMT, D)
#define OKV_TILES_ONLY

/* per-head scales: the loaders yield the raw codes; okv_qk_fmt / okv_pv_fmt
 * apply the head's scale and zero point to the scores / probabilities */
#define OKV_KT OKV_CAT(OKV_QN, h)
#define OKV_LD1(p, d) OKV_QRAW1(p, d)
#define OKV_LD8(p, i) OKV_QRAW8(p, i)
#if defined(OKV_SIMD512) && (OKV_QFMT == OKV_FMT_U4 || OKV_QFMT == OKV_FMT_I4)
#define OKV_LD16(p, i) okv_q4_load16_ilv_ps(p, OKV_QFMT, i)
#else
#define OKV_LD16(p, i) OKV_QRAW16(p, i)
#endif
#include "attention_impl.h"
#undef OKV_KT
#undef OKV_LD1
#undef OKV_LD8
#undef OKV_LD16

/* per-channel scales: values only (keys: the per-head tiles on the codes, with
 * the channel scales folded into the query rows by okv_qk_fmt) */
#define OKV_KT OKV_CAT(OKV_QN, c)
#define OKV_PV_ONLY
#define OKV_DQ_INIT const float *dqs = dq->s, *dqz = dq->z;
#define OKV_LD1(p, d) ((OKV_QRAW1(p, d) - dqz[d]) * dqs[d])
#define OKV_LD8(p, i) _mm256_mul_ps(_mm256_sub_ps(OKV_QRAW8(p, i), _mm256_loadu_ps(dqz + (i))), _mm256_loadu_ps(dqs + (i)))
#define OKV_LD16(p, i) _mm512_mul_ps(_mm512_sub_ps(OKV_QRAW16(p, i), _mm512_loadu_ps(dqz + (i))), _mm512_loadu_ps(dqs + (i)))
#include "attention_impl.h"
#undef OKV_KT
#undef OKV_LD1
#undef OKV_LD8
#undef OKV_LD16
#undef OKV_DQ_INIT
#undef OKV_PV_ONLY

#undef OKV_TILES_ONLY
#undef OKV_RS
#undef OKV_KT_T
#undef OKV_QRAW1
#undef OKV_QRAW8
#undef OKV_QRAW16
#undef OKV_QN
#undef OKV_QFMT
