"""Operator implementations; importing this package registers them all."""

from onnxkv.plan.ops import (  # noqa: F401
    activation,
    attention_gqa,
    attention_onnx,
    cache_update,
    gather_block_quantized,
    masked_attention,
    paged,
    prologue_matmul,
    quantize_paged_cache,
    repeat_kv_matmul,
    elementwise,
    matmul,
    norm,
    reduce,
    rotary,
    shape,
    sibling_matmul,
    tensor_scatter,
    view_chain,
)
