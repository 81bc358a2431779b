"""The ONNX Runtime GenAI model-builder form (``com.microsoft.GroupQueryAttention``).

Graph inputs / outputs (float32)::

    input_ids                     int64 [batch_size, sequence_length]
    attention_mask                int64 [batch_size, total_sequence_length]
    past_key_values.{i}.key/value float [batch_size, num_kv_heads, past_sequence_length, head_size]
    logits                        float [batch_size, sequence_length, vocab_size]
    present.{i}.key/value         float [batch_size, num_kv_heads, total_sequence_length, head_size]

Node and initializer names follow ``onnxruntime_genai/models/builders/base.py`` (0.18) for
an fp32 CPU Llama with unpacked Q/K/V projections (the builder's ``disable_qkv_fusion``
form). As there, the first input norm is ``SimplifiedLayerNormalization`` in the default
ONNX domain (an ONNX Runtime contrib op that ``onnx.checker`` does not know) and every
other norm is ``com.microsoft.SkipSimplifiedLayerNormalization``. ``seqlens_k`` and
``total_sequence_length`` are derived from ``attention_mask``; position ids are computed
inside ``GroupQueryAttention`` (``do_rotary=1``), so there is no ``position_ids`` input.
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx

from ._graph import FLOAT, INT32, INT64, GraphBuilder
from .config import DecoderConfig
from .weights import DecoderWeights, random_weights, rotary_cache

__all__ = ["build_gqa_model", "save_genai_folder", "genai_config"]

OPSET = 22  # what the GenAI builder imports for the default domain


def build_gqa_model(cfg: DecoderConfig, weights: DecoderWeights | None = None, seed: int = 0) -> onnx.ModelProto:
    """Build the GroupQueryAttention decoder (weights default to ``random_weights(cfg, seed)``)."""
    w = weights if weights is not None else random_weights(cfg, seed)
    g = GraphBuilder("main_graph")
    kv_shape = ["batch_size", cfg.num_kv_heads, "past_sequence_length", cfg.head_size]
    input_ids = g.input("input_ids", INT64, ["batch_size", "sequence_length"])
    mask = g.input("attention_mask", INT64, ["batch_size", "total_sequence_length"])
    for i in range(cfg.num_layers):
        g.input(f"past_key_values.{i}.key", FLOAT, kv_shape)
        g.input(f"past_key_values.{i}.value", FLOAT, kv_shape)

    # attention_mask -> seqlens_k = ReduceSum(mask, 1) - 1 (int32), total_seq_len = Shape(mask)[1] (int32)
    base = "/model/attn_mask_reformat/attn_mask_subgraph"
    one_1d = g.constant([1])
    reduced = g.node("ReduceSum", [mask, one_1d], f"{base}/ReduceSum", keepdims=0)
    sub = g.node("Sub", [reduced, one_1d], f"{base}/Sub")
    seqlens_k = g.node("Cast", [sub], f"{base}/Sub/Cast", to=INT32)
    shape = g.node("Shape", [mask], f"{base}/Shape")
    total = g.node("Gather", [shape, g.constant(1)], f"{base}/Gather", axis=0)
    total_seq_len = g.node("Cast", [total], f"{base}/Gather/Cast", to=INT32)

    cos, sin = rotary_cache(cfg)
    cos_cache = g.initializer("cos_cache", cos)
    sin_cache = g.initializer("sin_cache", sin)
    embed = g.initializer("model.embed_tokens.weight", w.embed)
    hidden = g.node("Gather", [embed, input_ids], "/model/embed_tokens/Gather")

    def matmul(x: str, weight: np.ndarray, prefix: str, output: str | None = None) -> str:
        name = g.initializer(prefix[1:].replace("/", ".") + ".MatMul.weight", weight)
        return g.node("MatMul", [x, name], f"{prefix}/MatMul", outputs=[output] if output else 1)

    def norm(
        i: int, where: str, weight: np.ndarray, root: str, skip: str | None, last: bool = False
    ) -> tuple[str, str]:
        """Returns (normalized, residual sum); the first norm has no skip input."""
        wname = g.initializer(f"model.layers.{i}.{where}_layernorm.weight", weight)
        out0, out3 = f"/model/layers.{i}/{where}_layernorm/output_0", f"/model/layers.{i}/{where}_layernorm/output_3"
        if skip is None:
            g.node(
                "SimplifiedLayerNormalization",
                [root, wname],
                f"/model/layers.{i}/{where}_layernorm/LayerNorm",
                outputs=[out0],
                epsilon=cfg.rms_norm_eps,
                axis=-1,
                stash_type=1,
            )
            return out0, root
        outs = [out0] if last else [out0, "", "", out3]
        g.node(
            "SkipSimplifiedLayerNormalization",
            [root, skip, wname],
            f"/model/layers.{i}/{where}_layernorm/SkipLayerNorm",
            outputs=outs,
            domain="com.microsoft",
            epsilon=cfg.rms_norm_eps,
        )
        return out0, (root if last else out3)

    residual, skip = hidden, None
    for i, lw in enumerate(w.layers):
        x, residual = norm(i, "input", lw.input_norm, residual, skip)
        attn = f"/model/layers.{i}/attn"
        q = matmul(x, lw.q_proj, f"{attn}/q_proj")
        k = matmul(x, lw.k_proj, f"{attn}/k_proj")
        v = matmul(x, lw.v_proj, f"{attn}/v_proj")
        y = g.node(
            "GroupQueryAttention",
            [
                q,
                k,
                v,
                f"past_key_values.{i}.key",
                f"past_key_values.{i}.value",
                seqlens_k,
                total_seq_len,
                cos_cache,
                sin_cache,
            ],
            f"{attn}/GroupQueryAttention",
            outputs=[f"{attn}/GroupQueryAttention/output_0", f"present.{i}.key", f"present.{i}.value"],
            domain="com.microsoft",
            num_heads=cfg.num_heads,
            kv_num_heads=cfg.num_kv_heads,
            scale=float(1.0 / np.sqrt(cfg.head_size)),
            local_window_size=-1,
            softcap=0.0,
            do_rotary=1,
            rotary_interleaved=0,
        )[0]
        o = matmul(y, lw.o_proj, f"{attn}/o_proj")
        x, residual = norm(i, "post_attention", lw.post_attn_norm, residual, o)
        mlp = f"/model/layers.{i}/mlp"
        gate = matmul(x, lw.gate_proj, f"{mlp}/gate_proj")
        up = matmul(x, lw.up_proj, f"{mlp}/up_proj")
        sig = g.node("Sigmoid", [gate], f"{mlp}/act_fn/Sigmoid")
        act = g.node("Mul", [gate, sig], f"{mlp}/act_fn/Mul")
        skip = matmul(g.node("Mul", [act, up], f"{mlp}/Mul"), lw.down_proj, f"{mlp}/down_proj")

    x, _ = norm(cfg.num_layers, "final_norm", w.final_norm, residual, skip, last=True)
    matmul(x, w.lm_head, "/lm_head", output="logits")

    g.output("logits", FLOAT, ["batch_size", "sequence_length", cfg.vocab_size])
    present_shape = ["batch_size", cfg.num_kv_heads, "total_sequence_length", cfg.head_size]
    for i in range(cfg.num_layers):
        g.output(f"present.{i}.key", FLOAT, present_shape)
        g.output(f"present.{i}.value", FLOAT, present_shape)
    return g.model({"": OPSET, "com.microsoft": 1})


def genai_config(cfg: DecoderConfig, filename: str = "model.onnx") -> dict:
    """The ``genai_config.json`` content the GenAI builder writes for this model."""
    return {
        "model": {
            "bos_token_id": cfg.bos_token_id,
            "context_length": cfg.max_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": cfg.head_size,
                "hidden_size": cfg.hidden_size,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": cfg.num_heads,
                "num_hidden_layers": cfg.num_layers,
                "num_key_value_heads": cfg.num_kv_heads,
            },
            "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id,
            "type": "llama",
            "vocab_size": cfg.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": cfg.max_length,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
        },
    }


def save_genai_folder(model: onnx.ModelProto, cfg: DecoderConfig, path: str | os.PathLike) -> None:
    """Write ``model.onnx`` (weights in ``model.onnx.data``, as the GenAI builder does) and
    ``genai_config.json`` into the folder ``path`` (created if needed).  ``model`` is not modified."""
    os.makedirs(path, exist_ok=True)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save(
        copy,
        os.path.join(path, "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx.data",
        size_threshold=1024,
    )
    with open(os.path.join(path, "genai_config.json"), "w", encoding="utf-8") as f:
        json.dump(genai_config(cfg), f, indent=4)
        f.write("\n")
