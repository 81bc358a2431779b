#!/usr/bin/env python
"""Export bench_generate's small model with ``torch.onnx.export`` (the real "past -> Concat -> present" form).

The model is a Hugging Face ``LlamaForCausalLM`` with the configuration and
weights of ``onnxkv.zoo.builders.SMALL`` / ``random_weights(cfg, seed)`` (the
graphs ``benchmarks/bench_generate.py`` builds): projections are transposed
into ``torch.nn.Linear`` layout, norms and embeddings copied.  It is exported
by the same TorchScript exporter call as the test fixture
(``scripts/make_fixtures.py``: ``dynamo=False``, opset 18, transformers'
default attention, which the exporter spells as MatMul/Add/Softmax/MatMul)
and saved as ``OUT/model.onnx`` with its weights in ``OUT/model.onnx.data``.

Then the export and the builder's Concat graph of the same weights are run by
ONNX Runtime on one short prompt and the largest logits difference is printed
(the export computes its rotary angles in float32, the builder's tables in
float64, so they agree closely, not bit for bit).

Needs torch==2.13.0, transformers 5.x, onnx, onnxruntime (build-time only;
nothing is downloaded).

    python scripts/export_torch_small.py OUT [--max-length 8192] [--seed 0] [--size small|tiny]
    python benchmarks/bench_generate.py --cases small-concat:4096 --torch-model OUT/model.onnx
    python benchmarks/bench_generate.py --dispatch-model TINY_OUT/model.onnx  (``--size tiny``)
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
from dataclasses import replace

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_fixtures import export_torch  # noqa: E402


def hf_model(cfg, weights):
    """A ``LlamaForCausalLM`` holding ``weights`` (an ``onnxkv.zoo.weights.DecoderWeights``) of ``cfg``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_size,
        max_position_embeddings=cfg.max_length,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=False,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        use_cache=True,
    )
    config.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    model = LlamaForCausalLM(config)
    state = {
        "model.embed_tokens.weight": weights.embed,
        "model.norm.weight": weights.final_norm,
        "lm_head.weight": weights.lm_head.T,
    }
    for i, lw in enumerate(weights.layers):
        p = f"model.layers.{i}."
        state.update(
            {
                p + "input_layernorm.weight": lw.input_norm,
                p + "post_attention_layernorm.weight": lw.post_attn_norm,
                p + "self_attn.q_proj.weight": lw.q_proj.T,
                p + "self_attn.k_proj.weight": lw.k_proj.T,
                p + "self_attn.v_proj.weight": lw.v_proj.T,
                p + "self_attn.o_proj.weight": lw.o_proj.T,
                p + "mlp.gate_proj.weight": lw.gate_proj.T,
                p + "mlp.up_proj.weight": lw.up_proj.T,
                p + "mlp.down_proj.weight": lw.down_proj.T,
            }
        )
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=False
    )
    if unexpected or any(not k.endswith("rotary_emb.inv_freq") for k in missing):
        raise SystemExit(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    return model.eval()


def compare(export: pathlib.Path, builder: pathlib.Path, cfg, prompt_len: int = 16) -> float:
    """Largest |logits| difference of the two models on one random prompt (empty past), by ONNX Runtime."""
    import onnxruntime as ort

    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, prompt_len))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(prompt_len)[None]}
    for i in range(cfg.num_layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, cfg.num_kv_heads, 0, cfg.head_size), np.float32)
    logits = [
        ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
        for p in (export, builder)
    ]
    return float(np.abs(logits[0] - logits[1]).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=pathlib.Path, help="folder for model.onnx and model.onnx.data")
    ap.add_argument(
        "--max-length", type=int, default=8192, help="max_position_embeddings (bench: 8192 above 2048 tokens)"
    )
    ap.add_argument("--seed", type=int, default=0, help="random_weights seed (bench_generate uses 0)")
    ap.add_argument(
        "--size",
        choices=("small", "tiny"),
        default="small",
        help="the configuration: SMALL (bench_generate's small cases) or TINY (its dispatch measure)",
    )
    args = ap.parse_args()

    import onnx
    import torch

    from onnxkv.zoo.builders import SMALL, TINY, build_model, random_weights

    torch.set_num_threads(2)
    cfg = replace(SMALL if args.size == "small" else TINY, max_length=args.max_length)
    weights = random_weights(cfg, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "model.onnx"
    with tempfile.TemporaryDirectory() as tmp:
        inline = pathlib.Path(tmp) / "model.onnx"
        export_torch(hf_model(cfg, weights), inline)
        onnx.save(onnx.load(str(inline)), str(path), save_as_external_data=True, location="model.onnx.data")
        builder = pathlib.Path(tmp) / "builder.onnx"
        onnx.save(
            build_model("concat", cfg, weights=weights),
            str(builder),
            save_as_external_data=True,
            location="builder.onnx.data",
        )
        print(f"wrote {path}; max |logits - builder's Concat graph| = {compare(path, builder, cfg):.3g}")


if __name__ == "__main__":
    main()
