/* onnxkv/_kernels/attention_unit_avx2.c -- the AVX2 attention work units
 * (attention_unit.h at this level; declared in attention_units.h).  A
 * translation unit of its own, so that the levels compile in parallel. */
#include "attention_types.h"

#if OKV_X86_SIMD
#define OKV_SFX _avx2
#define OKV_ATTR OKV_AVX2
#define OKV_SIMD256 1
#include "attention_unit.h"
#undef OKV_SIMD256
#endif
