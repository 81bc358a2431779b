#!/usr/bin/env python
"""Export onnxkv's "small" Llama (onnxkv.zoo.config.SMALL: hidden 1024, 8 layers, 16/4 heads,
intermediate 2816, vocabulary 8000; 106M parameters) through the ONNX Runtime GenAI model builder, as a
CPU user gets it: ``-p int4 -e cpu`` (MatMulNBits, block 32, accuracy_level 4) and ``-p fp32``.

Random weights (seeded; scaled like scripts/make_fixtures.py so logits are not flat), an offline
byte-level tokenizer.  Writes OUT/int4 and OUT/fp32 (each a builder folder: model.onnx, model.onnx.data,
genai_config.json, tokenizer files) for ``benchmarks/bench_generate.py --builder-folder``; about 500 MB.
Needs torch==2.13.0, transformers 5.x, onnxruntime-genai 0.18.0 with onnx-ir (its model builder imports
it), tokenizers (not onnxkv's dependencies).

    python scripts/export_builder_small.py OUT [--precisions int4 fp32]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _hf_common import BOS_ID, EOS_ID, PAD_ID, run_genai_builder, save_byte_tokenizer  # noqa: E402

SEED = 4321


def _small_config():
    """onnxkv.zoo.config.SMALL, read from its file (this environment need not have onnxkv built)."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().parent.parent / "onnxkv" / "zoo" / "config.py"
    spec = importlib.util.spec_from_file_location("_onnxkv_model_config", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is made
    spec.loader.exec_module(module)
    return module.SMALL


def build_hf(folder: pathlib.Path) -> None:
    """The SMALL Llama as a Hugging Face folder (safetensors + tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    SMALL = _small_config()

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=SMALL.vocab_size,
        hidden_size=SMALL.hidden_size,
        intermediate_size=SMALL.intermediate_size,
        num_hidden_layers=SMALL.num_layers,
        num_attention_heads=SMALL.num_heads,
        num_key_value_heads=SMALL.num_kv_heads,
        max_position_embeddings=SMALL.max_length,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        hidden_act="silu",
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_bias=False,
        mlp_bias=False,
        use_cache=True,
    )
    config.rope_parameters = {"rope_type": "default", "rope_theta": SMALL.rope_theta}
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder, safe_serialization=True)
    save_byte_tokenizer(folder, SMALL.vocab_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--precisions", nargs="*", default=["int4", "fp32"], choices=["int4", "fp32"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf = pathlib.Path(tmp) / "hf"
        build_hf(hf)
        for precision in args.precisions:
            run_genai_builder(hf, args.out / precision, pathlib.Path(tmp) / "cache", precision)
            print(f"wrote {args.out / precision}")


if __name__ == "__main__":
    main()
