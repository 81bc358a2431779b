/* onnxkv/_kernels/attention_unit_avx512.c -- the AVX-512 attention work units
 * (attention_unit.h at this level; declared in attention_units.h).  A
 * translation unit of its own, so that the levels compile in parallel. */
#include "attention_types.h"

#if OKV_X86_SIMD
#define OKV_SFX _avx512
#define OKV_ATTR OKV_AVX512BW
#define OKV_SIMD512 1
#include "attention_unit.h"
#endif
