"""Beam-search decode speed and storage: onnxkv (paged) vs copy-per-beam caches (onnxkv-tensor, ONNX Runtime GenAI).

The small GroupQueryAttention model of ``bench_generate.py`` (random weights,
built into a temporary folder by the same ``build``; ``--weights int4|int8``: its
MatMuls rewritten to MatMulNBits by ``onnxkv.quantize_weights``), one prompt row, k beams
(default 4), a fixed number of new tokens (EOS disabled: every engine runs the
same number of steps).  Engines, each in its own subprocess (peak RSS is its
own VmHWM), one after the other, with the same thread count:

* ``onnxkv``         -- ``onnxkv.beam_search(cache="paged")``: the prompt is
                        prefilled once; beams share its pages, ``State.reorder``
                        per step permutes page tables (copy-on-write of at most
                        one page per beam);
* ``onnxkv-tensor``  -- ``onnxkv.beam_search(cache="tensor")``: the Hugging Face
                        way, caches gathered per beam with ``np.take`` every step;
* ``ort-genai``      -- ONNX Runtime GenAI with ``num_beams`` (its beam search
                        keeps a cache per beam and copies it on reorder).

Per-token latency counts decode steps only, each a run over the k beams:
onnxkv's ``step_seconds`` (scoring, reorder, feeds, run), and GenAI's
``generate_next_token`` calls after the first one (the first only selects
tokens from the prompt's logits, computed by ``append_tokens``, timed as prefill).
Storage figures come from a second, event-logged onnxkv run: per step the bytes
copied (reorder + copy-on-write + prefix copies) and the committed cache
bytes, next to the copy-per-beam baseline (``k * cached tokens * bytes per
token`` gathered every step).

Usage: python benchmarks/bench_beam.py [--threads 2] [--new-tokens 16] [--beams 4]
       [--prompts 128,1024] [--model small] [--engines onnxkv,onnxkv-tensor,ort-genai] [--weights fp32|int4|int8]
       [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine, median, run_worker, versions  # noqa: E402
from bench_generate import build, peak_rss, quantized_copy  # noqa: E402

DEFAULT_ENGINES = "onnxkv,onnxkv-tensor,ort-genai"


# -- worker side ---------------------------------------------------------------------------------
def _bytes_per_token(session) -> int:
    """Cache bytes of one token of one beam: every layer's key and value (float32)."""
    conv = session.model.convention
    return 2 * len(conv.layers) * conv.kv_heads * conv.head_size * 4


def _onnxkv(engine: str, path: str, prompt: np.ndarray, new_tokens: int, beams: int, threads: int) -> dict:
    import onnxkv
    from onnxkv.generate.beam_search import beam_search

    cache = "paged" if engine == "onnxkv" else "tensor"
    kw = dict(eos_token_id=[], num_return_sequences=1, cache=cache)
    sess = onnxkv.Session(path, threads=threads)
    beam_search(sess, prompt[:, :8], beams, 2, **kw)  # warm-up
    res = beam_search(sess, prompt, beams, new_tokens, **kw)
    out = {
        "peak_rss_bytes": peak_rss(),  # before the event-log session below maps the weights again
        "prefill_s": res.prompt_seconds,
        "per_token_s": res.step_seconds,
        "tokens": res.sequences[0, prompt.shape[1] :].tolist(),
        "beam_tokens_per_s": res.tokens_per_second,
    }
    # Storage figures from a separate event-logged run (recording would perturb the timing above).
    ev = beam_search(onnxkv.Session(path, threads=threads, events=True), prompt, beams, new_tokens, **kw)
    L, per_token = prompt.shape[1], _bytes_per_token(sess)
    out.update(
        {
            "bytes_per_token": per_token,
            "copied_bytes_per_step": ev.copied_bytes,
            "reorder_copied_bytes_per_step": ev.reorder_copied_bytes,
            "cache_copied_bytes_per_step": ev.cache_copied_bytes,
            "expand_copied_bytes": ev.prompt_copied_bytes,
            "committed_cache_bytes_per_step": ev.committed_bytes,
            "copy_per_beam_baseline_bytes_per_step": [beams * (L + i) * per_token for i in range(len(ev.step_seconds))],
        }
    )
    return out


def _genai(path: str, prompt: np.ndarray, new_tokens: int, beams: int) -> dict:
    import onnxruntime_genai as og

    model = og.Model(path)
    params = og.GeneratorParams(model)
    total = prompt.shape[1] + new_tokens
    # min_length = max_length keeps EOS out, as eos_token_id=[] does for onnxkv.
    params.set_search_options(
        num_beams=beams,
        num_return_sequences=1,
        max_length=total,
        min_length=total,
        early_stopping=False,
        do_sample=False,
    )
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(prompt)
    prefill = time.perf_counter() - t0
    samples = []
    while not gen.is_done():
        t0 = time.perf_counter()
        gen.generate_next_token()
        samples.append(time.perf_counter() - t0)
    seq = list(gen.get_sequence(0))
    return {
        "peak_rss_bytes": peak_rss(),
        "prefill_s": prefill,
        "select_only_first_step_s": samples[0],
        "per_token_s": samples[1:],
        "tokens": [int(t) for t in seq[prompt.shape[1] :]],
    }


def worker(engine: str, path: str, prompt_len: int, vocab: int, new_tokens: int, beams: int, threads: int) -> dict:
    prompt = np.random.default_rng(prompt_len).integers(0, vocab, (1, prompt_len))
    if engine == "ort-genai":
        result = _genai(path, prompt, new_tokens, beams)
    else:
        result = _onnxkv(engine, path, prompt, new_tokens, beams, threads)
    result["median_token_s"] = median(result["per_token_s"])
    return result


# -- orchestrator side -------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--prompts", default="128,1024")
    ap.add_argument("--model", default="small", choices=("tiny", "small"))
    ap.add_argument("--engines", default=DEFAULT_ENGINES)
    ap.add_argument(
        "--weights",
        default="fp32",
        choices=("fp32", "int4", "int8"),
        help="the model's float32 MatMuls, or rewritten by onnxkv.quantize_weights (MatMulNBits, block 32, "
        "accuracy_level 4), the file every engine runs",
    )
    ap.add_argument("--out")
    ap.add_argument(
        "--worker",
        nargs=7,
        metavar=("ENGINE", "PATH", "PROMPT", "VOCAB", "NEW", "BEAMS", "THREADS"),
        help=argparse.SUPPRESS,
    )
    args = ap.parse_args()
    if args.worker:
        e, p, n, v, new, k, t = args.worker
        print(json.dumps(worker(e, p, int(n), int(v), int(new), int(k), int(t))))
        return
    vers = versions("onnxruntime", "onnxruntime_genai")  # None for a package that is not installed
    engines = args.engines.split(",")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for plen in map(int, args.prompts.split(",")):
            max_length = 2048 if plen + args.new_tokens + 64 <= 2048 else 8192
            folder, vocab = build(Path(tmp), args.model, "gqa", max_length, args.threads)
            if args.weights != "fp32":
                folder, _ = quantized_copy(Path(tmp), folder, int(args.weights[3:]))
            entry = {
                "model": args.model,
                "graph": "gqa",
                "weights": args.weights,
                "prompt": plen,
                "new_tokens": args.new_tokens,
                "num_beams": args.beams,
                "batch": 1,
                "engines": {},
            }
            for engine in engines:
                if engine == "ort-genai" and vers["onnxruntime_genai"] is None:
                    continue
                r = run_worker(
                    __file__, [engine, folder, plen, vocab, args.new_tokens, args.beams, args.threads], args.threads
                )
                entry["engines"][engine] = r
                if "error" in r:
                    print(f"# prompt {plen} {engine}: FAILED {r['error']}", file=sys.stderr)
                    continue
                print(
                    f"# prompt {plen} {engine}: {r['median_token_s'] * 1e3:.2f} ms/step ({args.beams} beams), "
                    f"prefill {r['prefill_s']:.2f} s, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB",
                    file=sys.stderr,
                )
            kv = entry["engines"].get("onnxkv", {})
            for peer in ("onnxkv-tensor", "ort-genai"):
                p = entry["engines"].get(peer, {})
                if "median_token_s" in kv and "median_token_s" in p:
                    entry[f"speedup_onnxkv_over_{peer}"] = p["median_token_s"] / kv["median_token_s"]
                    entry[f"rss_ratio_onnxkv_over_{peer}"] = kv["peak_rss_bytes"] / p["peak_rss_bytes"]
                if "tokens" in kv and "tokens" in p:
                    entry[f"same_best_beam_as_{peer}"] = kv["tokens"] == p["tokens"]
            results.append(entry)
    emit(
        {
            "benchmark": "beam_search",
            "machine": machine(),
            "versions": vers,
            "threads": args.threads,
            "bar": "onnxkv 4-beam decode at prompt 1024 >= 4x faster per token than ONNX Runtime GenAI num_beams=4",
            "per_token": "one decode step over all beams; onnxkv: BeamSearchResult.step_seconds (scoring, reorder, "
            "feeds, run); ort-genai: generate_next_token calls after the first (the first only selects "
            "from the prompt's logits computed by append_tokens = prefill_s)",
            "genai_search_options": {
                "num_beams": args.beams,
                "num_return_sequences": 1,
                "max_length": "prompt+new",
                "min_length": "prompt+new",
                "early_stopping": False,
                "do_sample": False,
            },
            "results": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
