/* onnxkv/_kernels/attention_units.h -- the attention work units of every
 * instruction set, declared: each level's units are compiled once, in a
 * translation unit of their own (attention_unit_<level>.c instantiates
 * attention_unit.h at that level), and linked into the attention module.
 *
 * okv_attn_unit_native<level>: every page (or the contiguous cache) holds
 *   a->kv_type elements; returns 0.
 * okv_attn_unit_mixed<level>: per-page formats (a->k_fmt / a->v_fmt); returns
 *   the bytes of quantized codes and header entries it loaded.
 * okv_attn_unit_flash<level>: the prefill unit (attention_flash.h) of native
 *   K/V: every key its query tokens see, output written.
 * Arguments (attention.h, okv_attn_unit): batch b, KV heads [hk0, hk0+nh),
 * query tokens [t0, t1), keys [c0, c1), workspace ws, partial state part (or
 * NULL) with stride pstride.  Callers pick a level the CPU runs (simd_cpu.h);
 * the AVX2 and AVX-512 units exist only where the build has those paths
 * (OKV_X86_SIMD).
 */
#ifndef ONNXKV_ATTENTION_UNITS_H
#define ONNXKV_ATTENTION_UNITS_H

#include "attention_types.h"

#define OKV_UNIT_DECLARE(sfx)                                                                                  \
    int64_t okv_attn_unit_native##sfx(const okv_attn_args *a, int64_t b, int64_t hk0, int64_t nh, int64_t t0,    \
                                      int64_t t1, int64_t c0, int64_t c1, float *ws, float *part,                \
                                      int64_t pstride);                                                          \
    int64_t okv_attn_unit_mixed##sfx(const okv_attn_args *a, int64_t b, int64_t hk0, int64_t nh, int64_t t0,     \
                                     int64_t t1, int64_t c0, int64_t c1, float *ws, float *part, int64_t pstride); \
    void okv_attn_unit_flash##sfx(const okv_attn_args *a, int64_t b, int64_t hk0, int64_t nh, int64_t t0,        \
                                  int64_t t1, float *ws);

OKV_UNIT_DECLARE(_scalar)
#if OKV_X86_SIMD
OKV_UNIT_DECLARE(_avx2)
OKV_UNIT_DECLARE(_avx512)
#endif
#undef OKV_UNIT_DECLARE

#endif /* ONNXKV_ATTENTION_UNITS_H */
