#!/usr/bin/env python
"""Make the per-architecture exporter fixtures under tests/data/arch/ (deterministic, seeded).

For each architecture in :data:`ARCHS` a tiny random-weight Hugging Face
model (hidden 64, 2 layers, byte-level vocabulary of 259) is built in a temp
folder and exported by

* the ONNX Runtime GenAI model builder, ``-p fp32`` -> ``<arch>/genai_fp32/``,
* the same builder, ``-p int4`` -> ``<arch>/genai_int4/``,
* ``torch.onnx.export`` (TorchScript exporter, Concat cache) -> ``<arch>/torch/model.onnx``,

and transformers' references go to ``<arch>/reference.npz`` (see
tests/data/README.md).  Every export is run with onnxruntime and compared
with the references; an export whose exporter fails is not written, and the
failure is printed and recorded in ``tests/data/arch/exports.json``.

Sliding-window models get a window of :data:`WINDOW` tokens, so the prompt
and the greedy run both pass it.

Needs torch==2.13.0, transformers 5.x, onnxruntime-genai 0.18.0, onnx,
onnxruntime, onnxscript, tokenizers, safetensors.

    HF_HUB_OFFLINE=1 python scripts/make_arch_fixtures.py [--only ARCH ...] [--keep-tmp]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import warnings

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _hf_common import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    builder_error,
    copy_only,
    dir_size,  # noqa: E402
    exporter_versions,
    gqa_attributes,
    save_byte_tokenizer,
    scratch_dir,
)
from make_fixtures import export_torch  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data" / "arch"
SEED = 1234
VOCAB = 259
WINDOW = 8
PROMPT_LEN = 12
GREEDY_STEPS = WINDOW + 32 + 8  # the sequence ends 32 + 20 tokens past the window
TOL = 1e-4
QUANT_BLOCK = 32  # the builder's default int4 block size
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    use_cache=True,
)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}

#: name -> (transformers config class, model class, config keyword arguments, what the fixture exercises)
ARCHS: dict[str, tuple[str, str, dict, str]] = {
    "llama_tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=True, rms_norm_eps=1e-5),
        "Llama with tied embeddings (lm_head = embedding table)",
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(tie_word_embeddings=False, rms_norm_eps=1e-6),
        "Qwen2: q/k/v projections with bias",
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(tie_word_embeddings=False, rms_norm_eps=1e-6),
        "Qwen3: per-head RMSNorm of q and k before rotary",
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            original_max_position_embeddings=256,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
        ),
        "Phi-3: fused qkv_proj and gate_up_proj",
    ),
    "phi3_partial": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,  # ONNX Runtime's GroupQueryAttention needs a rotary width of a multiple of 16
            partial_rotary_factor=0.5,
            original_max_position_embeddings=256,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
        ),
        "Phi-3 with partial_rotary_factor 0.5 (16 of 32 dims rotated) and tied embeddings: Phi-4-mini's form",
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(tie_word_embeddings=False, rms_norm_eps=1e-5, sliding_window=WINDOW),
        f"Mistral: sliding window of {WINDOW} on every layer",
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            rms_norm_eps=1e-6,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
            hidden_activation="gelu_pytorch_tanh",
        ),
        f"Gemma 2: attention and final softcaps, window {WINDOW} on layer 0, full attention on layer 1",
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            rms_norm_eps=1e-6,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        ),
        f"Gemma 3: q/k norm, window {WINDOW} on layer 0, two rotary bases",
    ),
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            no_rope_layers=[1, 0],
            layer_types=["full_attention", "full_attention"],
        ),
        "SmolLM3: no rotary on layer 1 (no_rope_layers), tied embeddings",
    ),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            embedding_multiplier=4.0,
            logits_scaling=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
        ),
        "Granite: embedding, residual, attention and logits multipliers",
    ),
}


def int4_exact(shape, g):
    """Random weights of std ~1/sqrt(fan_in) that symmetric blockwise int4 (blocks of 32 along the last dim,
    ORT's RTN: scale = the block's largest-magnitude value / -8) represents exactly.

    Each block is ``s * q``: ``q`` uniform integers in [-8, 7] with one -8 (so the scale is ``s``), ``s`` a
    float16-exact positive number (so every ``s * q`` is a float32 without rounding).  The int4 exports then
    differ from float32 by the builder's int8 activations only, not by weight rounding.
    """
    import torch

    *lead, fan_in = shape
    blocks = fan_in // QUANT_BLOCK
    assert blocks * QUANT_BLOCK == fan_in, shape
    q = torch.randint(-8, 8, (*lead, blocks, QUANT_BLOCK), generator=g).float()
    at = torch.randint(0, QUANT_BLOCK, (*lead, blocks, 1), generator=g)
    q.scatter_(-1, at, -8.0)
    s = (0.75 + 0.5 * torch.rand((*lead, blocks, 1), generator=g)) / (4.6 * fan_in**0.5)
    return (q * s.half().float()).reshape(shape)


def build_hf(arch: str, folder: pathlib.Path):
    """The seeded tiny model of ``arch`` (eval mode, eager attention), saved with a byte tokenizer in ``folder``."""
    import torch
    import transformers

    cfg_cls, model_cls, extra, _ = ARCHS[arch]
    kwargs = dict(COMMON, **extra)
    rope = kwargs.pop("rope_parameters", None)
    config = getattr(transformers, cfg_cls)(**kwargs)
    config.rope_parameters = rope or {**(config.rope_parameters or {}), **ROPE}
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = getattr(transformers, model_cls)(config)
    # Larger-than-default random weights so logits are far from uniform (greedy choices are stable);
    # norm weights and biases random too.  Gemma's norms scale by (1 + w), so their w is centred on 0.
    gemma = arch.startswith("gemma")
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(int4_exact(p.shape, g))
            elif "norm" in name and not gemma:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    save_byte_tokenizer(folder, VOCAB)
    return model


def references(model) -> dict[str, np.ndarray]:
    """Prompt, prefill logits, greedy tokens and the logits after each greedy token (full recompute, no cache)."""
    import torch

    rng = np.random.default_rng(SEED)
    prompt = [BOS_ID] + rng.integers(32, 127, PROMPT_LEN - 1).tolist()
    seq = list(prompt)
    with torch.no_grad():
        prefill = model(input_ids=torch.tensor([seq])).logits[0].numpy()
        last, tokens, decode = prefill[-1], [], []
        for _ in range(GREEDY_STEPS):
            tokens.append(int(last.argmax()))
            seq.append(tokens[-1])
            last = model(input_ids=torch.tensor([seq])).logits[0, -1].numpy()
            decode.append(last)
        gen = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=GREEDY_STEPS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD_ID,
        )
    assert (gen[0, len(prompt) :].numpy() == tokens).all(), "generate() disagrees with full recompute"
    top2 = np.sort(np.stack([prefill[-1], *decode[:-1]]), axis=-1)[:, -2:]
    return {
        "prompt_ids": np.array(prompt, np.int64),
        "prefill_logits": prefill.astype(np.float32),
        "greedy_tokens": np.array(tokens, np.int64),
        "decode_logits": np.stack(decode).astype(np.float32),
        "greedy_margins": (top2[:, 1] - top2[:, 0]).astype(np.float32),
    }


class OrtRunner:
    """onnxruntime driver of one decoder graph, past/present threaded as ORT GenAI does (no shared buffer)."""

    def __init__(self, path: pathlib.Path):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        self.sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.sess.get_inputs()}
        self.outs = [o.name for o in self.sess.get_outputs()]
        self.past = [n for n in self.inputs if n.startswith("past_key_values.")]
        cfg_path = path.parent / "genai_config.json"
        dec = json.loads(cfg_path.read_text())["model"]["decoder"] if cfg_path.exists() else {}
        self.window = dec.get("sliding_window", {})
        self.head_size = dec.get("head_size")

    def empty_past(self) -> dict[str, np.ndarray]:
        """Empty caches; a window-sized cache (sliding_window_cache=1 layers) starts as zeros of the window."""
        past = {}
        for n in self.past:
            shape = self.inputs[n].shape
            d = shape[3] if isinstance(shape[3], int) else self.head_size
            layer = int(n.split(".")[1])
            cap = self.window["window_size"] if "sliding" in str(shape[2]) else 0
            assert cap == 0 or layer in self.window.get("layers", []), (n, shape)
            past[n] = np.zeros((1, shape[1], cap, d), np.float32)
        return past

    def run(self, prompt: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Logits of the prompt's last position, then after each of ``tokens`` fed one by one: [1 + len, V]."""
        past = self.empty_past()
        ids = prompt[None]
        total = ids.shape[1]
        out = []
        for step in range(len(tokens) + 1):
            feeds = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64), **past}
            if "position_ids" in self.inputs:
                feeds["position_ids"] = np.arange(total - ids.shape[1], total, dtype=np.int64)[None]
            res = dict(zip(self.outs, self.sess.run(None, feeds)))
            out.append(res["logits"][0, -1])
            past = {n: res[n.replace("past_key_values.", "present.")] for n in self.past}
            if step < len(tokens):
                ids = tokens[step : step + 1][None].astype(np.int64)
                total += 1
        return np.stack(out)


def check(path: pathlib.Path, ref: dict[str, np.ndarray], against: np.ndarray | None = None) -> dict:
    """Max |logits - reference| over the prompt's last position and every greedy step, and token agreement."""
    logits = OrtRunner(path).run(ref["prompt_ids"], ref["greedy_tokens"][:-1])
    want = np.concatenate([ref["prefill_logits"][-1:], ref["decode_logits"][:-1]]) if against is None else against
    return {
        "max_abs_diff": float(np.abs(logits - want).max()),
        "tokens_equal": bool((logits.argmax(-1) == ref["greedy_tokens"]).all()),
        "logits": logits,
    }


def export_arch(arch: str, tmp: pathlib.Path, versions: dict) -> dict:
    """Build, export and check one architecture; write what succeeded under DATA/arch. Returns its report."""
    hf_dir = tmp / arch / "hf"
    model = build_hf(arch, hf_dir)
    ref = references(model)
    dst = DATA / arch
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    report: dict = {"what": ARCHS[arch][3], "exports": {}}
    fp32_logits = None
    for precision in ("fp32", "int4"):
        name = f"genai_{precision}"
        out = tmp / arch / name
        err = builder_error(hf_dir, out, tmp / arch / "cache", precision)
        if err is None:
            copy_only(out, dst / name, ["model.onnx", "model.onnx.data", "genai_config.json"])
            try:
                res = check(dst / name / "model.onnx", ref, None if precision == "fp32" else fp32_logits)
            except Exception as e:  # onnxruntime cannot run what the builder wrote
                shutil.rmtree(dst / name)
                err = f"onnxruntime: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        if err is not None:
            report["exports"][name] = {"exported": False, "error": err}
            print(f"[{arch}] {name} FAILED: {err}")
            continue
        if precision == "fp32":
            fp32_logits = res["logits"]
        report["exports"][name] = {
            "exported": True,
            "attention": gqa_attributes(dst / name / "model.onnx"),
            **{k: v for k, v in res.items() if k != "logits"},
        }
        print(f"[{arch}] {name}: diff {res['max_abs_diff']:.2e} tokens_equal {res['tokens_equal']}")
    tdir = dst / "torch"
    tdir.mkdir()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export_torch(model, tdir / "model.onnx")
        res = check(tdir / "model.onnx", ref)
        report["exports"]["torch"] = {"exported": True, **{k: v for k, v in res.items() if k != "logits"}}
        print(f"[{arch}] torch: diff {res['max_abs_diff']:.2e} tokens_equal {res['tokens_equal']}")
    except Exception as e:
        shutil.rmtree(tdir)
        report["exports"]["torch"] = {"exported": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"[{arch}] torch FAILED: {e}")
    cfg = json.loads((hf_dir / "config.json").read_text())
    np.savez_compressed(
        dst / "reference.npz",
        **ref,
        config=np.array(json.dumps(cfg, sort_keys=True)),
        versions=np.array(json.dumps(versions)),
    )
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=sorted(ARCHS), help="architectures to (re)make")
    ap.add_argument("--keep-tmp", action="store_true")
    args = ap.parse_args()

    versions = exporter_versions()
    manifest_path = DATA / "exports.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    with scratch_dir("onnxkv_arch_", args.keep_tmp) as tmp:
        for arch in args.only or ARCHS:
            manifest[arch] = export_arch(arch, tmp, versions)
            ordered = {k: manifest[k] for k in ARCHS if k in manifest}
            manifest_path.write_text(
                json.dumps({"versions": versions, "window": WINDOW, **ordered}, indent=1, default=str) + "\n"
            )
    total = dir_size(DATA)
    print(f"tests/data/arch total {total} bytes ({total / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
