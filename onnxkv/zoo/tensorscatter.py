"""The static-cache form: opset-24 ``TensorScatter`` + ``Attention`` with ``nonpad_kv_seqlen``.

Graph inputs / outputs (float32, ``C = cfg.max_length``)::

    input_ids                     int64 [batch_size, sequence_length]
    attention_mask                int64 [batch_size, C]   1 = cache slot j holds a real token
    position_ids                  int64 [batch_size, sequence_length]
    write_indices                 int64 [batch_size]   cache slot of this step's first token
    past_key_values.{i}.key/value float [batch_size, num_kv_heads, C, head_size]
    logits                        float [batch_size, sequence_length, vocab_size]
    present.{i}.key/value         float [batch_size, num_kv_heads, C, head_size]

Per layer the new K/V ([batch, kv_heads, seq, head]) are written with
``TensorScatter(past, new, write_indices, axis=2, mode="linear")`` and attention reads the
whole cache: ``Attention(Q, present_key, present_value, attn_mask, nonpad_kv_seqlen,
is_causal=1)`` with ``nonpad_kv_seqlen = write_indices + sequence_length``. The operator's
causal band is bottom-right aligned (``offset = nonpad_kv_seqlen - seq``), so query ``i``
sits at cache slot ``write_indices + i``; slots at or after ``nonpad_kv_seqlen`` are
ignored. ``attn_mask`` is ``attention_mask`` as a boolean [batch, 1, seq, C] and removes
(left) padding. The ONNX spec lets the mask be shorter than the cache, but ONNX Runtime
1.32 requires its last axis to equal the cache length, so ``attention_mask`` has ``C``
columns.
"""

from __future__ import annotations

import numpy as np
import onnx

from ._graph import BOOL, FLOAT, INT64, GraphBuilder
from .attention23 import standard_decoder
from .config import DecoderConfig
from .weights import DecoderWeights, random_weights

__all__ = ["build_tensorscatter_model"]

OPSET = 24


def build_tensorscatter_model(
    cfg: DecoderConfig, weights: DecoderWeights | None = None, seed: int = 0
) -> onnx.ModelProto:
    """Build the fixed-capacity (``cfg.max_length``) TensorScatter decoder."""
    w = weights if weights is not None else random_weights(cfg, seed)
    g = GraphBuilder("main_graph")
    cache_shape = ["batch_size", cfg.num_kv_heads, cfg.max_length, cfg.head_size]
    input_ids = g.input("input_ids", INT64, ["batch_size", "sequence_length"])
    mask = g.input("attention_mask", INT64, ["batch_size", cfg.max_length])
    position_ids = g.input("position_ids", INT64, ["batch_size", "sequence_length"])
    write_indices = g.input("write_indices", INT64, ["batch_size"])
    for i in range(cfg.num_layers):
        g.input(f"past_key_values.{i}.key", FLOAT, cache_shape)
        g.input(f"past_key_values.{i}.value", FLOAT, cache_shape)

    base = "/model/attn_mask"
    seq = g.node(
        "Slice", [g.node("Shape", [input_ids], f"{base}/Shape"), g.constant([1]), g.constant([2])], f"{base}/Slice_seq"
    )  # [1] = [S]
    nonpad = g.node("Add", [write_indices, seq], f"{base}/nonpad_kv_seqlen")  # [B]
    padding = g.node(
        "Unsqueeze", [g.node("Cast", [mask], f"{base}/Cast", to=BOOL), g.constant([1, 2])], f"{base}/Unsqueeze"
    )  # [B, 1, 1, C]
    expand_to = g.node("Concat", [g.constant([1, 1]), seq, g.constant([1])], f"{base}/Concat", axis=0)
    attn_mask = g.node("Expand", [padding, expand_to], f"{base}/Expand")  # [B, 1, S, C]

    def to_heads(x: str, heads: int, prefix: str) -> str:
        """[B, S, N*D] -> [B, N, S, D]"""
        x = g.node("Reshape", [x, g.constant([0, 0, heads, cfg.head_size])], f"{prefix}/Reshape")
        return g.node("Transpose", [x], f"{prefix}/Transpose", perm=[0, 2, 1, 3])

    def attend(i: int, q: str, k: str, v: str) -> str:
        attn = f"/model/layers.{i}/self_attn"
        keys = g.node(
            "TensorScatter",
            [f"past_key_values.{i}.key", to_heads(k, cfg.num_kv_heads, f"{attn}/k"), write_indices],
            f"{attn}/TensorScatter_key",
            outputs=[f"present.{i}.key"],
            axis=2,
            mode="linear",
        )
        values = g.node(
            "TensorScatter",
            [f"past_key_values.{i}.value", to_heads(v, cfg.num_kv_heads, f"{attn}/v"), write_indices],
            f"{attn}/TensorScatter_value",
            outputs=[f"present.{i}.value"],
            axis=2,
            mode="linear",
        )
        y = g.node(
            "Attention",
            [to_heads(q, cfg.num_heads, f"{attn}/q"), keys, values, attn_mask, "", "", nonpad],
            f"{attn}/Attention",
            is_causal=1,
            scale=float(1.0 / np.sqrt(cfg.head_size)),
        )
        y = g.node("Transpose", [y], f"{attn}/Transpose_out", perm=[0, 2, 1, 3])
        return g.node("Reshape", [y, g.constant([0, 0, cfg.q_size])], f"{attn}/Reshape_out")

    standard_decoder(g, cfg, w, input_ids, position_ids, attend)
    for i in range(cfg.num_layers):
        g.output(f"present.{i}.key", FLOAT, cache_shape)
        g.output(f"present.{i}.value", FLOAT, cache_shape)
    return g.model({"": OPSET}, ir_version=11)
