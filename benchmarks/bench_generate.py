"""Decode speed of onnxkv vs ONNX Runtime on the same GenAI-style model files.

For each model size (tiny, small) and prompt length (128, 1024): prefill, then
``--new-tokens`` greedy decode steps; both runtimes get identical feeds from
the same loop (KV cache threaded as tensors: past -> present), the same
thread count, and are timed per token in the same process, alternating.
Also reports onnxkv's Python dispatch overhead per node on the tiny model
(the plan loop with every kernel replaced by its recorded result).

Usage: python benchmarks/bench_generate.py [--threads 2] [--sizes tiny,small]
       [--prompts 128,1024] [--new-tokens 32] [--out result.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine, median, versions  # noqa: E402

import onnxkv  # noqa: E402
from onnxkv.generate.feeds import FeedBuilder  # noqa: E402
from onnxkv.models.builders import SMALL, TINY, build_model, save_genai_folder  # noqa: E402

SIZES = {"tiny": TINY, "small": SMALL}


def ort_session(path: Path, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def decode_samples(run, session, prompt: np.ndarray, new_tokens: int) -> tuple[float, list[float], list[int]]:
    """Prefill seconds, per-token decode seconds and greedy tokens for one runtime."""
    model = session.model
    fetch = [model.io.logits, *model.convention.present_outputs]
    b = FeedBuilder(session.plan.inputs, model, prompt, np.array([prompt.shape[1]]), 0)
    feeds, _ = b.first()
    t0 = time.perf_counter()
    out = run(feeds, fetch)
    prefill = time.perf_counter() - t0
    samples, tokens = [], []
    for _ in range(new_tokens):
        tok = np.argmax(out[model.io.logits][:, -1], axis=-1).astype(np.int64)
        tokens.append(int(tok[0]))
        feeds = b.next(tok, out)
        t0 = time.perf_counter()
        out = run(feeds, fetch)
        samples.append(time.perf_counter() - t0)
    return prefill, samples, tokens


def dispatch_overhead(session: onnxkv.Session, prompt_len: int = 16, repeats: int = 200) -> dict:
    """µs per node of the plan loop alone: kernels replaced by their recorded outputs."""
    plan = session.plan
    model = session.model
    b = FeedBuilder(plan.inputs, model, np.arange(1, prompt_len + 1)[None], np.array([prompt_len]), 0)
    feeds, _ = b.first()
    out = session.run(feeds)
    feeds = b.next(np.array([1]), out)
    recorded = []
    original = plan._steps

    def recorder(run):
        def rec(ins, rt):
            res = run(ins, rt)
            recorded.append(res)
            return res
        return rec

    plan._steps = [(recorder(r), i, o) for r, i, o in original]
    session.run(feeds)
    plan._steps = [((lambda ins, rt, _r=res: _r), i, o) for res, (_, i, o) in zip(recorded, original)]
    try:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan.run(feeds)
            times.append(time.perf_counter() - t0)
    finally:
        plan._steps = original
    n = len(plan.nodes)
    return {"nodes": n, "samples_s": times, "median_run_s": median(times), "us_per_node": median(times) / n * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--prompts", default="128,1024")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out")
    args = ap.parse_args()
    import onnxruntime

    results = []
    overhead = None
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            cfg = SIZES[size]
            folder = Path(tmp) / size
            save_genai_folder(build_model("gqa", cfg, seed=0), cfg, folder)
            kv = onnxkv.Session(folder, threads=args.threads)
            ort_sess = ort_session(folder / "model.onnx", args.threads)
            if size == "tiny":
                overhead = dispatch_overhead(kv)
            for plen in (int(p) for p in args.prompts.split(",")):
                prompt = np.random.default_rng(plen).integers(0, cfg.vocab_size, (1, plen))
                # Warm both once, then measure alternating runtimes.
                decode_samples(kv.run, kv, prompt[:, :8], 2)
                decode_samples(lambda f, o: dict(zip(o, ort_sess.run(o, f))), kv, prompt[:, :8], 2)
                p_kv, s_kv, t_kv = decode_samples(kv.run, kv, prompt, args.new_tokens)
                p_ort, s_ort, t_ort = decode_samples(lambda f, o: dict(zip(o, ort_sess.run(o, f))), kv, prompt,
                                                     args.new_tokens)
                results.append({
                    "model": size, "config": {k: getattr(cfg, k) for k in ("hidden_size", "num_layers", "num_heads",
                                                                            "num_kv_heads", "intermediate_size",
                                                                            "vocab_size")},
                    "prompt": plen, "new_tokens": args.new_tokens, "batch": 1,
                    "onnxkv": {"prefill_s": p_kv, "per_token_s": s_kv, "median_token_s": median(s_kv)},
                    "onnxruntime": {"prefill_s": p_ort, "per_token_s": s_ort, "median_token_s": median(s_ort)},
                    "ratio_onnxkv_over_ort": median(s_kv) / median(s_ort),
                    "same_tokens": t_kv == t_ort,
                })
                print(f"# {size} prompt {plen}: onnxkv {median(s_kv) * 1e3:.2f} ms/token, "
                      f"ORT {median(s_ort) * 1e3:.2f} ms/token, ratio {median(s_kv) / median(s_ort):.2f}",
                      file=sys.stderr)
    emit({"benchmark": "generate", "machine": machine(), "versions": {**versions(), "onnxruntime": onnxruntime.__version__},
          "threads": args.threads, "cache": "tensor path (past -> present)", "results": results,
          "dispatch_overhead_tiny": overhead}, args.out)


if __name__ == "__main__":
    main()
