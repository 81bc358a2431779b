"""The standard-ONNX form: opset-23 ``Attention`` with ``past_key``/``present_key``.

Graph inputs / outputs (float32)::

    input_ids                     int64 [batch_size, sequence_length]
    attention_mask                int64 [batch_size, total_sequence_length]   1 = real token
    position_ids                  int64 [batch_size, sequence_length]
    past_key_values.{i}.key/value float [batch_size, num_kv_heads, past_sequence_length, head_size]
    logits                        float [batch_size, sequence_length, vocab_size]
    present.{i}.key/value         float [batch_size, num_kv_heads, total_sequence_length, head_size]

Norms are ``RMSNormalization``, rotary is ``RotaryEmbedding`` on the 3-D projections and
attention is ``Attention(q_num_heads, kv_num_heads)`` on 3-D Q/K/V with a boolean
``attn_mask`` [batch, 1, seq, total] built from ``attention_mask`` (padding) and a
Range/LessOrEqual causal band (ONNX Runtime 1.32 does not broadcast the query axis of
``attn_mask``, so the mask is full size and ``is_causal`` stays 0).
``present = Concat(past, new)`` happens inside the operator. ``opset=24`` builds the same
graph under opset 24: Attention-24 (spec, ONNX Runtime and ``onnx.reference``) rejects
``nonpad_kv_seqlen`` together with ``past_key``, so that input belongs to the TensorScatter
form (``tensorscatter.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx

from ._graph import FLOAT, INT64, GraphBuilder, causal_padding_mask
from .config import DecoderConfig
from .weights import DecoderWeights, random_weights, rotary_cache

__all__ = ["build_attention_model", "standard_decoder"]

Attend = Callable[[int, str, str, str], str]


def standard_decoder(
    g: GraphBuilder, cfg: DecoderConfig, w: DecoderWeights, input_ids: str, position_ids: str, attend: Attend
) -> None:
    """Add embedding, blocks, final norm and the ``logits`` output to ``g`` with opset-23 ops.

    ``attend(layer, q, k, v)`` receives rotated 3-D ``q`` [B, S, H*D], ``k`` [B, S, KV*D] and
    ``v`` [B, S, KV*D] and returns the attention output [B, S, H*D].
    """
    cos, sin = rotary_cache(cfg)
    cos_cache = g.initializer("cos_cache", cos)
    sin_cache = g.initializer("sin_cache", sin)
    x = g.node("Gather", [g.initializer("model.embed_tokens.weight", w.embed), input_ids], "/model/embed_tokens/Gather")

    def matmul(h: str, weight: np.ndarray, prefix: str) -> str:
        wname = g.initializer(prefix[1:].replace("/", ".") + ".weight", weight)
        return g.node("MatMul", [h, wname], f"{prefix}/MatMul")

    def rms(h: str, weight: np.ndarray, prefix: str) -> str:
        wname = g.initializer(prefix[1:].replace("/", ".") + ".weight", weight)
        return g.node(
            "RMSNormalization",
            [h, wname],
            f"{prefix}/RMSNormalization",
            axis=-1,
            epsilon=cfg.rms_norm_eps,
            stash_type=1,
        )

    def rotary(h: str, heads: int, prefix: str) -> str:
        return g.node(
            "RotaryEmbedding",
            [h, cos_cache, sin_cache, position_ids],
            f"{prefix}/RotaryEmbedding",
            num_heads=heads,
            interleaved=0,
        )

    for i, lw in enumerate(w.layers):
        base = f"/model/layers.{i}"
        h = rms(x, lw.input_norm, f"{base}/input_layernorm")
        q = rotary(matmul(h, lw.q_proj, f"{base}/self_attn/q_proj"), cfg.num_heads, f"{base}/self_attn/q_rotary")
        k = rotary(matmul(h, lw.k_proj, f"{base}/self_attn/k_proj"), cfg.num_kv_heads, f"{base}/self_attn/k_rotary")
        v = matmul(h, lw.v_proj, f"{base}/self_attn/v_proj")
        o = matmul(attend(i, q, k, v), lw.o_proj, f"{base}/self_attn/o_proj")
        x = g.node("Add", [x, o], f"{base}/attn_residual/Add")
        h = rms(x, lw.post_attn_norm, f"{base}/post_attention_layernorm")
        gate = matmul(h, lw.gate_proj, f"{base}/mlp/gate_proj")
        act = g.node("Mul", [gate, g.node("Sigmoid", [gate], f"{base}/mlp/act_fn/Sigmoid")], f"{base}/mlp/act_fn/Mul")
        up = matmul(h, lw.up_proj, f"{base}/mlp/up_proj")
        down = matmul(g.node("Mul", [act, up], f"{base}/mlp/Mul"), lw.down_proj, f"{base}/mlp/down_proj")
        x = g.node("Add", [x, down], f"{base}/mlp_residual/Add")
    h = rms(x, w.final_norm, "/model/norm")
    g.node("MatMul", [h, g.initializer("lm_head.weight", w.lm_head)], "/lm_head/MatMul", outputs=["logits"])
    g.output("logits", FLOAT, ["batch_size", "sequence_length", cfg.vocab_size])


def build_attention_model(
    cfg: DecoderConfig,
    weights: DecoderWeights | None = None,
    seed: int = 0,
    opset: int = 23,
    mask_bias: float | None = None,
) -> onnx.ModelProto:
    """Build the ``Attention`` (opset 23 or 24) decoder with past/present inputs and outputs.

    ``mask_bias``: None gives the nodes the boolean mask; a negative float gives them a float mask of 0
    where the boolean one is True and ``mask_bias`` elsewhere (``Where``), as exports that hide keys with a
    finite bias such as -1e9 or ``finfo(float32).min`` do.
    """
    if opset not in (23, 24):
        raise ValueError(f"opset must be 23 or 24, got {opset}")
    if mask_bias is not None and not (np.isfinite(mask_bias) and mask_bias < 0):
        raise ValueError(f"mask_bias must be a finite negative float or None, got {mask_bias!r}")
    w = weights if weights is not None else random_weights(cfg, seed)
    g = GraphBuilder("main_graph")
    kv_shape = ["batch_size", cfg.num_kv_heads, "past_sequence_length", cfg.head_size]
    input_ids = g.input("input_ids", INT64, ["batch_size", "sequence_length"])
    mask = g.input("attention_mask", INT64, ["batch_size", "total_sequence_length"])
    position_ids = g.input("position_ids", INT64, ["batch_size", "sequence_length"])
    for i in range(cfg.num_layers):
        g.input(f"past_key_values.{i}.key", FLOAT, kv_shape)
        g.input(f"past_key_values.{i}.value", FLOAT, kv_shape)

    attn_mask = causal_padding_mask(g, input_ids, mask)
    if mask_bias is not None:
        zero, bias = g.constant(0.0, np.float32), g.constant(mask_bias, np.float32)
        attn_mask = g.node("Where", [attn_mask, zero, bias], "/model/attn_mask/Where")

    def attend(i: int, q: str, k: str, v: str) -> str:
        return g.node(
            "Attention",
            [q, k, v, attn_mask, f"past_key_values.{i}.key", f"past_key_values.{i}.value"],
            f"/model/layers.{i}/self_attn/Attention",
            outputs=[f"/model/layers.{i}/self_attn/Attention/output_0", f"present.{i}.key", f"present.{i}.value"],
            q_num_heads=cfg.num_heads,
            kv_num_heads=cfg.num_kv_heads,
            scale=float(1.0 / np.sqrt(cfg.head_size)),
        )[0]

    standard_decoder(g, cfg, w, input_ids, position_ids, attend)
    present_shape = ["batch_size", cfg.num_kv_heads, "total_sequence_length", cfg.head_size]
    for i in range(cfg.num_layers):
        g.output(f"present.{i}.key", FLOAT, present_shape)
        g.output(f"present.{i}.value", FLOAT, present_shape)
    return g.model({"": opset}, ir_version=11)
