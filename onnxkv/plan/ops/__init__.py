"""Operator implementations; importing this package registers them all."""

from onnxkv.plan.ops import (  # noqa: F401
    activation,
    attention_gqa,
    attention_onnx,
    cache_update,
    control_flow,
    masked_attention,
    paged,
    prologue_matmul,
    quantize_paged_cache,
    repeat_kv_matmul,
    elementwise,
    matmul,
    matmul_nbits,
    norm,
    reduce,
    rotary,
    shape,
    sibling_matmul,
    tensor_scatter,
    view_chain,
)
