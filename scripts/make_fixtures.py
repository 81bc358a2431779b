#!/usr/bin/env python
"""Make the tiny Llama test fixtures under tests/data/ (deterministic, seeded).

1. A tiny random-weight Hugging Face ``LlamaForCausalLM`` is built in a temp
   folder with an offline byte-level tokenizer.
2. The ONNX Runtime GenAI model builder (fp32, cpu) turns it into
   ``tests/data/genai_tiny_llama/`` (model.onnx, model.onnx.data, genai_config.json).
3. ``torch.onnx.export`` (TorchScript exporter, ``dynamo=False``) writes the same
   model with a KV cache in the plain "past -> Concat -> present" form to
   ``tests/data/torch_tiny_llama/model.onnx``.
4. Reference data from transformers goes to ``tests/data/tiny_llama_reference.npz``.
5. Both ONNX files are run with onnxruntime and compared with the references.

Needs torch==2.13.0, transformers 5.x, onnxruntime-genai 0.18.0, onnx,
onnxruntime, onnxscript, tokenizers, safetensors.

    python scripts/make_fixtures.py [--keep-tmp]
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
    OrtDecoder,
    copy_only,
    dir_size,
    exporter_versions,  # noqa: E402
    gqa_attributes,
    graph_io,
    op_counts,
    run_genai_builder,
    save_byte_tokenizer,
    scratch_dir,
)

REPO = pathlib.Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
SEED = 1234
VOCAB = 259
CFG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_theta=10000.0,
)
PROMPT_LEN = 12
DECODE_STEPS = 16
GREEDY_STEPS = 64
BATCH_LENS = (12, 7)
BATCH_STEPS = 16
TOL = 1e-4


def build_hf(tmp: pathlib.Path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        hidden_act="silu",
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
        use_cache=True,
        **CFG,
    )
    config.rope_parameters = {"rope_type": "default", "rope_theta": CFG["rope_theta"]}
    model = LlamaForCausalLM(config)
    # Larger-than-default random weights so logits are far from uniform (greedy
    # choices are then stable) and norm weights are not all ones.
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    model.eval()
    hf_dir = tmp / "hf"
    model.save_pretrained(hf_dir, safe_serialization=True)
    save_byte_tokenizer(hf_dir, VOCAB)
    return model, hf_dir


def full_logits(model, ids, mask=None):
    import torch

    with torch.no_grad():
        ids_t = torch.tensor(ids, dtype=torch.long)
        if mask is None:
            return model(input_ids=ids_t).logits.numpy()
        m = torch.tensor(mask, dtype=torch.long)
        pos = (m.cumsum(-1) - 1).clamp(min=0)
        return model(input_ids=ids_t, attention_mask=m, position_ids=pos).logits.numpy()


def references(model) -> dict[str, np.ndarray]:
    import torch

    rng = np.random.default_rng(SEED)
    prompt = [BOS_ID] + rng.integers(32, 127, PROMPT_LEN - 1).tolist()
    ref: dict[str, np.ndarray] = {"prompt_ids": np.array(prompt, np.int64)}
    # prefill + greedy decode, recomputing the whole sequence (no cache) each step
    seq = list(prompt)
    prefill = full_logits(model, [seq])[0]
    ref["prefill_logits"] = prefill.astype(np.float32)
    decode_logits, tokens = [], []
    last = prefill[-1]
    for step in range(GREEDY_STEPS):
        nxt = int(last.argmax())
        tokens.append(nxt)
        seq.append(nxt)
        last = full_logits(model, [seq])[0, -1]
        if step < DECODE_STEPS:
            decode_logits.append(last)
    ref["greedy_tokens"] = np.array(tokens, np.int64)
    ref["decode_logits"] = np.stack(decode_logits).astype(np.float32)  # logits after feeding greedy_tokens[i]
    # consistency with HF's own generate (uses its KV cache)
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=GREEDY_STEPS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD_ID,
        )
    hf_greedy = gen[0, len(prompt) :].numpy()
    assert (hf_greedy == ref["greedy_tokens"]).all(), "generate() disagrees with full recompute"

    # batch of two left-padded prompts
    width = max(BATCH_LENS)
    ids = np.full((2, width), PAD_ID, np.int64)
    mask = np.zeros((2, width), np.int64)
    for b, n in enumerate(BATCH_LENS):
        p = [BOS_ID] + rng.integers(32, 127, n - 1).tolist()
        ids[b, width - n :] = p
        mask[b, width - n :] = 1
    ref["batch_input_ids"] = ids
    ref["batch_attention_mask"] = mask
    ref["batch_position_ids"] = np.clip(np.cumsum(mask, -1) - 1, 0, None)
    bl = full_logits(model, ids, mask)
    ref["batch_prefill_last_logits"] = bl[:, -1].astype(np.float32)
    with torch.no_grad():
        gen = model.generate(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            max_new_tokens=BATCH_STEPS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD_ID,
            output_scores=True,
            return_dict_in_generate=True,
        )
    ref["batch_greedy_tokens"] = gen.sequences[:, width:].numpy()
    ref["batch_decode_logits"] = torch.stack(gen.scores, 1).numpy().astype(np.float32)  # [2, steps, V]

    # beam search, one prompt
    beam_prompt = ids[0, width - BATCH_LENS[0] :]
    with torch.no_grad():
        gen = model.generate(
            torch.from_numpy(beam_prompt[None].copy()),
            attention_mask=torch.ones(1, len(beam_prompt), dtype=torch.long),
            num_beams=4,
            num_return_sequences=4,
            max_new_tokens=8,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            length_penalty=1.0,
            early_stopping=False,
        )
    ref["beam_prompt_ids"] = np.array(beam_prompt, np.int64)
    ref["beam_sequences"] = gen.sequences.numpy()
    ref["beam_sequences_scores"] = gen.sequences_scores.numpy().astype(np.float32)
    ref["beam_settings"] = np.array(
        json.dumps(
            dict(
                num_beams=4,
                num_return_sequences=4,
                max_new_tokens=8,
                length_penalty=1.0,
                early_stopping=False,
                eos_token_id=EOS_ID,
                pad_token_id=PAD_ID,
            )
        )
    )
    return ref


def export_torch(model, path: pathlib.Path) -> None:
    import torch
    from transformers.cache_utils import DynamicCache, DynamicLayer

    n_layers = model.config.num_hidden_layers

    class Wrapper(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache()
            cache.layers = []
            for i in range(n_layers):
                layer = DynamicLayer()
                layer.keys, layer.values = past[2 * i], past[2 * i + 1]
                layer.is_initialized = True
                layer.device = past[2 * i].device
                layer.dtype = past[2 * i].dtype
                cache.layers.append(layer)
            out = self.m(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
            )
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    kv, hd = model.config.num_key_value_heads, model.config.head_dim
    b, s, p = 2, 3, 5
    args = [torch.randint(0, 256, (b, s)), torch.ones(b, p + s, dtype=torch.long), torch.arange(p, p + s).repeat(b, 1)]
    in_names = ["input_ids", "attention_mask", "position_ids"]
    out_names = ["logits"]
    dyn = {
        "input_ids": {0: "batch_size", 1: "sequence_length"},
        "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
        "position_ids": {0: "batch_size", 1: "sequence_length"},
        "logits": {0: "batch_size", 1: "sequence_length"},
    }
    for i in range(n_layers):
        for kind in ("key", "value"):
            args.append(torch.randn(b, kv, p, hd))
            in_names.append(f"past_key_values.{i}.{kind}")
            out_names.append(f"present.{i}.{kind}")
            dyn[in_names[-1]] = {0: "batch_size", 2: "past_sequence_length"}
            dyn[out_names[-1]] = {0: "batch_size", 2: "total_sequence_length"}
    wrapper = Wrapper(model).eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapper,
            tuple(args),
            str(path),
            input_names=in_names,
            output_names=out_names,
            dynamic_axes=dyn,
            opset_version=18,
            dynamo=False,
            do_constant_folding=True,
        )
    import onnx

    m = onnx.load(str(path))
    onnx.save(m, str(path))  # single file, weights inline


def check_onnx(name: str, path: pathlib.Path, ref: dict[str, np.ndarray]) -> dict:
    dec = OrtDecoder(path)
    res: dict = {}
    prompt = ref["prompt_ids"][None]
    mask = np.ones_like(prompt)
    logits, past = dec.step(prompt, mask, dec.empty_past(1))
    res["prefill_max_abs_diff"] = float(np.abs(logits[0] - ref["prefill_logits"]).max())
    diffs = []
    for i in range(DECODE_STEPS):
        tok = ref["greedy_tokens"][i]
        mask = np.concatenate([mask, [[1]]], 1)
        logits, past = dec.step(np.array([[tok]]), mask, past)
        diffs.append(float(np.abs(logits[0, -1] - ref["decode_logits"][i]).max()))
    res["decode_max_abs_diff"] = max(diffs)
    toks, _ = dec.greedy(ref["prompt_ids"].tolist(), GREEDY_STEPS)
    res["greedy_64_match"] = bool((np.array(toks) == ref["greedy_tokens"]).all())
    # left-padded batch
    ids, bmask = ref["batch_input_ids"], ref["batch_attention_mask"]
    logits, past = dec.step(ids, bmask, dec.empty_past(2))
    bdiff = [float(np.abs(logits[:, -1] - ref["batch_prefill_last_logits"]).max())]
    for i in range(BATCH_STEPS - 1):
        tok = ref["batch_greedy_tokens"][:, i : i + 1]
        bmask = np.concatenate([bmask, np.ones((2, 1), np.int64)], 1)
        logits, past = dec.step(tok, bmask, past)
        bdiff.append(float(np.abs(logits[:, -1] - ref["batch_decode_logits"][:, i + 1]).max()))
    res["batch_left_padded_max_abs_diff"] = max(bdiff)
    print(f"[{name}] {json.dumps(res)}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep-tmp", action="store_true")
    args = ap.parse_args()

    versions = exporter_versions()
    with scratch_dir("onnxkv_fixtures_", args.keep_tmp) as tmp:
        model, hf_dir = build_hf(tmp)
        model.config.use_cache = True

        # 1. GenAI builder
        run_genai_builder(hf_dir, tmp / "genai", tmp / "cache")
        gdst = DATA / "genai_tiny_llama"
        copy_only(tmp / "genai", gdst, ["model.onnx", "model.onnx.data", "genai_config.json"])

        # 2. torch export
        tdst = DATA / "torch_tiny_llama"
        if tdst.exists():
            shutil.rmtree(tdst)
        tdst.mkdir(parents=True)
        export_torch(model, tdst / "model.onnx")

        # 3. references
        ref = references(model)
        ref["versions"] = np.array(json.dumps(versions))
        ref["config"] = np.array(
            json.dumps(
                dict(CFG, vocab_size=VOCAB, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, seed=SEED)
            )
        )
        np.savez_compressed(DATA / "tiny_llama_reference.npz", **ref)

        # 4. verify
        ok = True
        for name, path in (("genai", gdst / "model.onnx"), ("torch", tdst / "model.onnx")):
            print(f"[{name}] ops: {op_counts(path)}")
            ins, outs = graph_io(path)
            print(f"[{name}] inputs: {ins}")
            print(f"[{name}] outputs: {outs}")
            for att in gqa_attributes(path):
                print(f"[{name}] attention node: {att}")
            res = check_onnx(name, path, ref)
            ok &= res["prefill_max_abs_diff"] < TOL and res["decode_max_abs_diff"] < TOL and res["greedy_64_match"]
        total = dir_size(gdst) + dir_size(tdst) + (DATA / "tiny_llama_reference.npz").stat().st_size
        print(f"tiny Llama fixtures: {total} bytes ({total / 2**20:.2f} MiB)")
        assert total < 5 * 2**20, "tiny Llama fixtures over 5 MB"
        if not ok:
            raise SystemExit("parity check failed")


if __name__ == "__main__":
    main()
