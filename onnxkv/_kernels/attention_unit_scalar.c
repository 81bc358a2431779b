/* onnxkv/_kernels/attention_unit_scalar.c -- the scalar (portable) attention work units
 * (attention_unit.h at this level; declared in attention_units.h).  A
 * translation unit of its own, so that the levels compile in parallel. */
#include "attention_types.h"

#define OKV_SFX _scalar
#define OKV_ATTR
#include "attention_unit.h"
