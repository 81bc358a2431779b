"""The plain ``torch.onnx`` export form: ``past -> Concat(axis=2) -> present``.

Graph inputs / outputs (float32)::

    input_ids                     int64 [batch_size, sequence_length]
    attention_mask                int64 [batch_size, total_sequence_length]   1 = real token
    position_ids                  int64 [batch_size, sequence_length]
    past_key_values.{i}.key/value float [batch_size, num_kv_heads, past_sequence_length, head_size]
    logits                        float [batch_size, sequence_length, vocab_size]
    present.{i}.key/value         float [batch_size, num_kv_heads, total_sequence_length, head_size]

Everything is spelled with basic opset-18 ops: RMSNorm as Pow/ReduceMean/Add/Sqrt/
Reciprocal/Mul, rotary as Gather of ``[max_length, head_size]`` cos/sin tables with a
Slice/Neg/Concat ``rotate_half``, GQA ``repeat_kv`` as Unsqueeze/Expand/Reshape, attention
as MatMul/Mul/Add/Softmax/MatMul with an additive mask (``Where(mask, 0, float32 min)``, so
fully masked padding rows stay finite), SiLU as Sigmoid*Mul.
"""

from __future__ import annotations

import numpy as np
import onnx

from ._graph import FLOAT, INT64, GraphBuilder, causal_padding_mask
from .config import DecoderConfig
from .weights import DecoderWeights, random_weights, rotary_cache

__all__ = ["build_concat_model"]

OPSET = 18


def build_concat_model(cfg: DecoderConfig, weights: DecoderWeights | None = None, seed: int = 0) -> onnx.ModelProto:
    """Build the Concat-cache decoder (weights default to ``random_weights(cfg, seed)``)."""
    w = weights if weights is not None else random_weights(cfg, seed)
    g = GraphBuilder("main_graph")
    kv_shape = ["batch_size", cfg.num_kv_heads, "past_sequence_length", cfg.head_size]
    input_ids = g.input("input_ids", INT64, ["batch_size", "sequence_length"])
    mask = g.input("attention_mask", INT64, ["batch_size", "total_sequence_length"])
    position_ids = g.input("position_ids", INT64, ["batch_size", "sequence_length"])
    for i in range(cfg.num_layers):
        g.input(f"past_key_values.{i}.key", FLOAT, kv_shape)
        g.input(f"past_key_values.{i}.value", FLOAT, kv_shape)

    allowed = causal_padding_mask(g, input_ids, mask)
    bias = g.node(
        "Where",
        [allowed, g.constant(0.0, np.float32), g.constant(np.finfo(np.float32).min, np.float32)],
        "/model/attn_mask/Where",
    )  # [B, 1, S, T]

    cos, sin = rotary_cache(cfg)
    rope = "/model/rotary_emb"
    axis1 = g.constant([1])
    cos = g.node(
        "Unsqueeze",
        [
            g.node(
                "Gather",
                [g.initializer("cos_cached", np.concatenate([cos, cos], 1)), position_ids],
                f"{rope}/Gather_cos",
            ),
            axis1,
        ],
        f"{rope}/Unsqueeze_cos",
    )
    sin = g.node(
        "Unsqueeze",
        [
            g.node(
                "Gather",
                [g.initializer("sin_cached", np.concatenate([sin, sin], 1)), position_ids],
                f"{rope}/Gather_sin",
            ),
            axis1,
        ],
        f"{rope}/Unsqueeze_sin",
    )
    half, last = g.constant([cfg.head_size // 2]), g.constant([-1])

    def rotate(x: str, prefix: str) -> str:
        """``x * cos + rotate_half(x) * sin`` on [B, N, S, D]."""
        x1 = g.node("Slice", [x, g.constant([0]), half, last], f"{prefix}/Slice_1")
        x2 = g.node("Slice", [x, half, g.constant([np.iinfo(np.int64).max]), last], f"{prefix}/Slice_2")
        rotated = g.node("Concat", [g.node("Neg", [x2], f"{prefix}/Neg"), x1], f"{prefix}/Concat", axis=-1)
        return g.node(
            "Add",
            [g.node("Mul", [x, cos], f"{prefix}/Mul_cos"), g.node("Mul", [rotated, sin], f"{prefix}/Mul_sin")],
            f"{prefix}/Add",
        )

    def matmul(h: str, weight: np.ndarray, prefix: str) -> str:
        wname = g.initializer(prefix[1:].replace("/", ".") + ".weight", weight)
        return g.node("MatMul", [h, wname], f"{prefix}/MatMul")

    def rms(h: str, weight: np.ndarray, prefix: str) -> str:
        var = g.node(
            "ReduceMean",
            [g.node("Pow", [h, g.constant(2.0, np.float32)], f"{prefix}/Pow"), last],
            f"{prefix}/ReduceMean",
            keepdims=1,
        )
        std = g.node(
            "Sqrt", [g.node("Add", [var, g.constant(cfg.rms_norm_eps, np.float32)], f"{prefix}/Add")], f"{prefix}/Sqrt"
        )
        normed = g.node("Mul", [h, g.node("Reciprocal", [std], f"{prefix}/Reciprocal")], f"{prefix}/Mul")
        return g.node(
            "Mul", [normed, g.initializer(prefix[1:].replace("/", ".") + ".weight", weight)], f"{prefix}/Mul_weight"
        )

    def split_heads(x: str, heads: int, prefix: str) -> str:
        """[B, S, N*D] -> [B, N, S, D]"""
        x = g.node("Reshape", [x, g.constant([0, 0, heads, cfg.head_size])], f"{prefix}/Reshape")
        return g.node("Transpose", [x], f"{prefix}/Transpose", perm=[0, 2, 1, 3])

    def repeat_kv(x: str, prefix: str) -> str:
        """[B, KV, T, D] -> [B, H, T, D] (each KV head repeated ``group_size`` times)."""
        x = g.node("Unsqueeze", [x, g.constant([2])], f"{prefix}/Unsqueeze")
        x = g.node("Expand", [x, g.constant([1, 1, cfg.group_size, 1, 1])], f"{prefix}/Expand")
        return g.node("Reshape", [x, g.constant([0, cfg.num_heads, -1, cfg.head_size])], f"{prefix}/Reshape")

    x = g.node("Gather", [g.initializer("model.embed_tokens.weight", w.embed), input_ids], "/model/embed_tokens/Gather")
    scale = g.constant(1.0 / np.sqrt(cfg.head_size), np.float32)
    for i, lw in enumerate(w.layers):
        base, attn = f"/model/layers.{i}", f"/model/layers.{i}/self_attn"
        h = rms(x, lw.input_norm, f"{base}/input_layernorm")
        q = rotate(split_heads(matmul(h, lw.q_proj, f"{attn}/q_proj"), cfg.num_heads, f"{attn}/q"), f"{attn}/q_rotary")
        k = rotate(
            split_heads(matmul(h, lw.k_proj, f"{attn}/k_proj"), cfg.num_kv_heads, f"{attn}/k"), f"{attn}/k_rotary"
        )
        v = split_heads(matmul(h, lw.v_proj, f"{attn}/v_proj"), cfg.num_kv_heads, f"{attn}/v")
        k = g.node(
            "Concat", [f"past_key_values.{i}.key", k], f"{attn}/Concat_key", outputs=[f"present.{i}.key"], axis=2
        )
        v = g.node(
            "Concat", [f"past_key_values.{i}.value", v], f"{attn}/Concat_value", outputs=[f"present.{i}.value"], axis=2
        )
        k_t = g.node("Transpose", [repeat_kv(k, f"{attn}/repeat_key")], f"{attn}/Transpose_key", perm=[0, 1, 3, 2])
        scores = g.node("Mul", [g.node("MatMul", [q, k_t], f"{attn}/MatMul_qk"), scale], f"{attn}/Mul_scale")
        probs = g.node("Softmax", [g.node("Add", [scores, bias], f"{attn}/Add_mask")], f"{attn}/Softmax", axis=-1)
        y = g.node("MatMul", [probs, repeat_kv(v, f"{attn}/repeat_value")], f"{attn}/MatMul_pv")
        y = g.node("Transpose", [y], f"{attn}/Transpose_out", perm=[0, 2, 1, 3])
        y = g.node("Reshape", [y, g.constant([0, 0, cfg.q_size])], f"{attn}/Reshape_out")
        x = g.node("Add", [x, matmul(y, lw.o_proj, f"{attn}/o_proj")], f"{base}/attn_residual/Add")
        h = rms(x, lw.post_attn_norm, f"{base}/post_attention_layernorm")
        gate = matmul(h, lw.gate_proj, f"{base}/mlp/gate_proj")
        act = g.node("Mul", [gate, g.node("Sigmoid", [gate], f"{base}/mlp/act_fn/Sigmoid")], f"{base}/mlp/act_fn/Mul")
        up = matmul(h, lw.up_proj, f"{base}/mlp/up_proj")
        down = matmul(g.node("Mul", [act, up], f"{base}/mlp/Mul"), lw.down_proj, f"{base}/mlp/down_proj")
        x = g.node("Add", [x, down], f"{base}/mlp_residual/Add")
    h = rms(x, w.final_norm, "/model/norm")
    g.node("MatMul", [h, g.initializer("lm_head.weight", w.lm_head)], "/lm_head/MatMul", outputs=["logits"])

    g.output("logits", FLOAT, ["batch_size", "sequence_length", cfg.vocab_size])
    present_shape = ["batch_size", cfg.num_kv_heads, "total_sequence_length", cfg.head_size]
    for i in range(cfg.num_layers):
        g.output(f"present.{i}.key", FLOAT, present_shape)
        g.output(f"present.{i}.value", FLOAT, present_shape)
    return g.model({"": OPSET})
