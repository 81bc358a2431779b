"""Greedy decode of the ``torch.onnx.export`` fixtures: ``onnxkv.generate`` vs an ONNX Runtime loop, same files.

The fixtures are the tiny random-weight exports of every architecture under
``tests/data/arch/*/torch`` (``scripts/make_fixtures.py``): Llama with tied
embeddings, Qwen2, Qwen3, Phi-3 (full and partial rotary), Mistral (window 8),
Gemma 2 and Gemma 3 (full and windowed layers), Granite, SmolLM3.  Their decode
steps hold an ``ExportMask`` node (the masks the export computes from
``attention_mask``), which the compiled generation loop writes itself, so a
whole greedy generation after the first steps runs in C.

Per fixture, in interleaved rounds (the engines' order alternating):

* ``onnxkv`` -- ``onnxkv.generate`` on a contiguous cache (``--cache paged``: a paged one, 16-token pages),
  greedy, EOS disabled; the per-token figure is ``decode_seconds / (new_tokens - 1)``;
* ``ort`` -- an ONNX Runtime ``InferenceSession`` of the same ``model.onnx``
  fed its presents back as pasts, the argmax each step (what a user's loop
  does); the per-token figure is the steps after the first, timed together.

Both take the same prompt; ``same_tokens`` says whether their greedy tokens
agree.  Samples are seconds per token.

Usage: python benchmarks/bench_exports.py [--threads 1] [--new-tokens 100] [--prompt 8] [--rounds 3]
       [--cache contiguous|paged] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine, median, versions  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "data" / "arch"


def ort_greedy(sess, ids: np.ndarray, new: int) -> tuple[list[int], float]:
    """``new`` greedy tokens from ``ids`` [1, L] through ``sess``; (tokens, seconds per token after the first)."""
    inputs = {i.name: i.shape for i in sess.get_inputs()}
    pasts = [n for n in inputs if n.startswith("past_key_values")]
    outputs = [o.name for o in sess.get_outputs()]
    length = ids.shape[1]
    feeds = {n: np.zeros((1, inputs[n][1], 0, inputs[n][3]), np.float32) for n in pasts}
    feeds.update(input_ids=ids, attention_mask=np.ones((1, length), np.int64), position_ids=np.arange(length)[None])
    tokens, t0 = [], 0.0
    for step in range(new):
        if step == 1:
            t0 = time.perf_counter()
        out = dict(zip(outputs, sess.run(None, feeds)))
        token = int(np.argmax(out["logits"][0, -1]))
        tokens.append(token)
        total = feeds["attention_mask"].shape[1] + 1
        feeds = {n: out[n.replace("past_key_values", "present")] for n in pasts}
        feeds.update(
            input_ids=np.array([[token]]),
            attention_mask=np.ones((1, total), np.int64),
            position_ids=np.array([[total - 1]]),
        )
    return tokens, (time.perf_counter() - t0) / (new - 1)


def onnxkv_greedy(sess, ids: np.ndarray, new: int, cache: str = "contiguous") -> tuple[list[int], float]:
    import onnxkv

    res = onnxkv.generate(sess, ids, new, eos_token_id=[], cache=cache)
    return res.tokens[0].tolist(), res.decode_seconds / (new - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=100)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache", choices=("contiguous", "paged"), default="contiguous")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.new_tokens < 2 or args.prompt < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--new-tokens must be >= 2, --prompt, --rounds and --threads >= 1")

    import onnxruntime as ort

    import onnxkv

    ids = np.arange(3, 3 + args.prompt, dtype=np.int64)[None]
    results, summary = [], []
    for folder in sorted(FIXTURES.glob("*/torch")):
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
        engines = {
            "onnxkv": (
                onnxkv.Session(str(folder), threads=args.threads),
                lambda sess, ids, new: onnxkv_greedy(sess, ids, new, args.cache),
            ),
            "ort": (ort.InferenceSession(str(folder / "model.onnx"), options), ort_greedy),
        }
        for sess, run in engines.values():  # warm-up: the first steps record onnxkv's compiled step
            run(sess, ids, 8)
        samples: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[int]] = {}
        for r in range(args.rounds):
            for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                sess, run = engines[name]
                tokens[name], seconds = run(sess, ids, args.new_tokens)
                samples[name].append(seconds)
        medians = {name: median(s) for name, s in samples.items()}
        arch = folder.parent.name
        results.append(
            {
                "fixture": arch,
                "samples_s_per_token": samples,
                "median_s_per_token": medians,
                "ratio_onnxkv_over_ort": medians["onnxkv"] / medians["ort"],
                "same_tokens": tokens["onnxkv"] == tokens["ort"],
            }
        )
        summary.append(
            f"{arch:14s} onnxkv {medians['onnxkv'] * 1e6:7.1f} us/token  ort {medians['ort'] * 1e6:7.1f} us/token"
            f"  ratio {medians['onnxkv'] / medians['ort']:.3f}  same tokens {tokens['onnxkv'] == tokens['ort']}"
        )
    doc = {
        "benchmark": "exports",
        "machine": machine(),
        "versions": versions("onnxruntime"),
        "threads": args.threads,
        "shapes": {"prompt": args.prompt, "new_tokens": args.new_tokens, "rounds": args.rounds},
        "cache": args.cache,
        "results": results,
    }
    emit(doc, args.out, summary, loadavg=True)


if __name__ == "__main__":
    main()
