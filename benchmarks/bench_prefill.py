"""Prompt (prefill) time: onnxkv vs ONNX Runtime GenAI, per operator, with rates against a tuned BLAS GEMM.

The small GroupQueryAttention model (``onnxkv.zoo.builders.SMALL``: hidden
1024, 8 layers, 16 query and 4 KV heads, intermediate 2816, vocabulary 8000,
random weights) is saved as a GenAI folder that both engines read.  For each
prompt length (``--prompts``) each engine runs in its own process, one after
the other (``--rounds`` alternates their order), with the same thread count:

* ``onnxkv``    -- ``onnxkv.generate``'s prompt path: a persistent state fed in
                   chunks of ``Session.prompt_chunk()`` tokens (what
                   ``generate``'s ``prefill_chunk="auto"`` takes; reported as
                   ``chunk``); the time of the whole prompt.  A second, recorded run of the same prompt
                   (``events=True``) gives the seconds of every operator type
                   (``per_op_seconds``), whose timing the recording perturbs a
                   little;
* ``onnxkv-bf16`` -- the same with ``Session(prefill_precision="bf16")``:
                   the products of prompt chunks on bfloat16-rounded operands
                   with float32 sums (AVX-512-BF16; left out, named on stderr,
                   where the CPU has none);
* ``ort-genai`` -- ``Generator.append_tokens`` of the whole prompt.

Work and rates: the prompt's product FLOPs are ``2 * tokens * weights`` over
every MatMul weight of the layers and the LM head (``product_gflop``, what
GenAI computes); onnxkv asks for no output on every chunk but the last, so
those chunks skip the LM head and the last layer's work after its cache
write (``skipped_weights``), and for the last token's logits alone on the
last chunk, which runs the LM head on one row (``head_weights``;
``product_gflop_done``: the products it runs).
Its causal attention FLOPs are ``4 * layers * heads * head_size * L * (L + 1)
/ 2`` (Q·Kᵀ and P·V over the causal triangle).  onnxkv's products (MatMul,
SiblingMatMul, PrologueMatMul nodes) and attention (GroupQueryAttention)
achieve those FLOPs in the event log's seconds; each rate is given as a fraction of ``fma_peak_gflops``, the
float32 FMA throughput of this machine (``onnxkv._kernels.matmul.
fma_peak_gflops``: independent FMA chains of the widest vectors on every
thread, best of five, measured at the start of the run), and of
``blas_gemm_gflops``, the best of five float32 GEMMs of 2048³ through NumPy's
BLAS at the same thread count (what a tuned BLAS reaches here).

Prints JSON: machine, versions, threads, shapes, raw samples, per-op seconds,
rates, the ratio onnxkv / GenAI per prompt (and per round).

Usage: python benchmarks/bench_prefill.py [--threads 2] [--prompts 128,1024,4096,16384] [--rounds 1] [--out FILE]
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

PRODUCTS = ("MatMul", "SiblingMatMul", "PrologueMatMul", "MatMulNBits", "SiblingMatMulNBits")


def blas_gemm_gflops(threads: int, n: int = 2048, runs: int = 5) -> float:
    """Best GFLOP/s of a float32 n³ GEMM through NumPy's BLAS at ``threads`` threads."""
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    best = float("inf")
    with threadpool_limits(threads):
        a @ b
        for _ in range(runs):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def fma_peak(threads: int, runs: int = 5) -> float:
    """Best GFLOP/s of the FMA throughput probe at ``threads`` threads."""
    from onnxkv._kernels.matmul import fma_peak_gflops

    import onnxkv._kernels as K

    with K.use_settings(K.current_settings().replace(threads=threads)):
        return max(fma_peak_gflops(50_000_000) for _ in range(runs))


def product_weights(path: Path) -> int:
    """Elements of every 2-D float weight a MatMul of the graph multiplies by."""
    import onnx

    model = onnx.load(str(path / "model.onnx"))
    inits = {i.name: i for i in model.graph.initializer}
    total = 0
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits and len(inits[node.input[1]].dims) == 2:
            dims = inits[node.input[1]].dims
            total += dims[0] * dims[1]
    return total


def _packed_weights(kernel) -> int:
    """Weight elements of a kernel's packed product (a MatMul's, or a fused node's ``product``); 0 if none."""
    packed = getattr(kernel, "packed", None)
    if packed is None:
        packed = getattr(getattr(kernel, "product", None), "packed", None)
    return 0 if packed is None else packed.shape[0] * packed.shape[1] * packed.shape[2]


def skipped_weights(session) -> int:
    """Weight elements of the packed products a prompt chunk that asks for no output skips
    (``Plan.needed``): the LM head, and the last layer's work after its cache write."""
    need = session.plan.needed(())
    return sum(_packed_weights(k) for k, needed in zip(session.plan.kernels, need or ()) if not needed)


def head_weights(session) -> int:
    """Weight elements of the LM head product that a run asking for one position's logits
    (``logits_at``) runs on that row alone (:mod:`onnxkv.plan.logit_rows`); 0 where the graph has none."""
    head = session.plan.logit_head(session.model.io.logits)
    return 0 if head is None else _packed_weights(session.plan.kernels[head.node])


def worker(engine: str, path: str, prompt_len: int, vocab: int, threads: int) -> dict:
    prompt = np.random.default_rng(prompt_len).integers(0, vocab, (1, prompt_len))
    if engine == "ort-genai":
        import onnxruntime_genai as og

        model = og.Model(path)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=prompt_len + 2, do_sample=False)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(prompt)
        return {"prefill_s": time.perf_counter() - t0}
    import onnxkv
    from onnxkv.generate.feeds import FeedBuilder

    def prefill(session) -> float:
        model = session.model
        state = session.new_state(cache=onnxkv.CacheConfig(initial_capacity=prompt_len + 2))
        first = min(session.prompt_chunk(), prompt_len)
        b = FeedBuilder(session.plan.inputs, model, prompt[:, :first], np.array([first]), 0, thread_cache=False)
        feeds, _ = b.first()
        fetch = [model.io.logits]
        t0 = time.perf_counter()
        # As generate: no logits before the last chunk, and there the last token's alone (logits_at).
        whole = first >= prompt_len
        out = state.run(feeds, fetch if whole else [], logits_at=[first - 1] if whole else None)
        for c0 in range(first, prompt_len, first):
            chunk = prompt[:, c0 : c0 + first]
            last = c0 + first >= prompt_len
            out = state.run(b.next(chunk, out), fetch if last else [], logits_at=[chunk.shape[1] - 1] if last else None)
        seconds = time.perf_counter() - t0
        state.close()
        return seconds

    precision = "bf16" if engine == "onnxkv-bf16" else None
    session = onnxkv.Session(path, threads=threads, prefill_precision=precision)
    prefill(session) if prompt_len <= 1024 else None  # warm the session's buffers on short prompts only
    result = {
        "prefill_s": prefill(session),
        "chunk": session.prompt_chunk(),
        "skipped": skipped_weights(session),
        "head": head_weights(session),
    }
    logged = onnxkv.Session(path, threads=threads, events=True, prefill_precision=precision)
    prefill(logged)
    per_op: dict[str, float] = {}
    for e in logged.events:
        if e.action == "execute":
            per_op[e.op] = per_op.get(e.op, 0.0) + e.seconds
    result["per_op_seconds"] = dict(sorted(per_op.items(), key=lambda kv: -kv[1]))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", default="128,1024,4096,16384")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--engines", default="onnxkv,onnxkv-bf16,ort-genai")
    ap.add_argument("--out")
    ap.add_argument(
        "--worker", nargs=5, metavar=("ENGINE", "PATH", "PROMPT", "VOCAB", "THREADS"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.worker:
        e, p, n, v, t = args.worker
        print(json.dumps(worker(e, p, int(n), int(v), int(t))))
        return
    from bench_generate import build

    prompts = [int(x) for x in args.prompts.split(",")]
    engines = args.engines.split(",")
    try:
        import onnxruntime_genai

        genai_version = onnxruntime_genai.__version__
    except ImportError:
        genai_version = None
        engines = [e for e in engines if e != "ort-genai"]
    from onnxkv.kernels import bf16_available
    from onnxkv.zoo.builders import SMALL

    if "onnxkv-bf16" in engines and not bf16_available():
        print("# onnxkv-bf16 left out: this CPU has no AVX-512-BF16", file=sys.stderr)
        engines.remove("onnxkv-bf16")

    cfg = SMALL
    blas = blas_gemm_gflops(args.threads)
    print(f"# float32 GEMM through NumPy's BLAS (2048^3, {args.threads} threads): {blas:.1f} GFLOP/s", file=sys.stderr)
    peak = fma_peak(args.threads)
    print(f"# float32 FMA peak ({args.threads} threads): {peak:.1f} GFLOP/s", file=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder, vocab = build(Path(tmp), "small", "gqa", max(prompts) + 16, args.threads)
        weights = product_weights(folder)
        for plen in prompts:
            product_flops = 2.0 * plen * weights  # every token through every product (GenAI's work)
            head = cfg.hidden_size // cfg.num_heads
            attention_flops = 4.0 * cfg.num_layers * cfg.num_heads * head * plen * (plen + 1) / 2
            runs: dict[str, list[dict]] = {e: [] for e in engines}
            for rnd in range(args.rounds):
                for engine in engines if rnd % 2 == 0 else engines[::-1]:
                    r = run_worker(__file__, [engine, folder, plen, vocab, args.threads], args.threads)
                    runs[engine].append(r)
                    msg = r.get("error") or f"{r['prefill_s']:.3f} s"
                    print(f"# prompt {plen} {engine} (round {rnd + 1}): {msg}", file=sys.stderr)
            entry: dict = {
                "prompt": plen,
                "product_gflop": product_flops / 1e9,
                "attention_gflop": attention_flops / 1e9,
            }
            for engine, rs in runs.items():
                ok = [r for r in rs if "error" not in r]
                if not ok:
                    entry[engine] = rs[0]
                    continue
                samples = [r["prefill_s"] for r in ok]
                entry[engine] = {"samples_s": samples, "median_s": median(samples)}
                if engine.startswith("onnxkv"):
                    chunk = ok[0]["chunk"]
                    last = plen - (plen - 1) // chunk * chunk  # tokens of the last chunk: the only logits made
                    done = product_flops - 2.0 * (plen - last) * ok[0]["skipped"] - 2.0 * (last - 1) * ok[0]["head"]
                    ops = ok[0]["per_op_seconds"]
                    prod_s = sum(v for k, v in ops.items() if k in PRODUCTS)
                    attn_s = ops.get("GroupQueryAttention", 0.0)
                    entry[engine].update(
                        chunk=chunk,
                        skipped_weights=ok[0]["skipped"],
                        head_weights=ok[0]["head"],
                        product_gflop_done=done / 1e9,
                        per_op_seconds=ops,
                        product_seconds=prod_s,
                        attention_seconds=attn_s,
                        product_gflops=done / prod_s / 1e9 if prod_s else None,
                        attention_gflops=attention_flops / attn_s / 1e9 if attn_s else None,
                    )
                    for what in ("product", "attention"):
                        rate = entry[engine][f"{what}_gflops"]
                        entry[engine][f"{what}_blas_fraction"] = rate / blas if rate else None
                        entry[engine][f"{what}_peak_fraction"] = rate / peak if rate else None
            b = entry.get("ort-genai", {})
            for name in ("onnxkv", "onnxkv-bf16"):
                a = entry.get(name, {})
                if "median_s" in a and "median_s" in b:
                    entry[f"ratio_{name}_over_ort-genai"] = a["median_s"] / b["median_s"]
                    entry[f"ratio_{name}_over_ort-genai_per_round"] = [
                        x / y for x, y in zip(a["samples_s"], b["samples_s"], strict=False)
                    ]
            results.append(entry)
    summary = []
    for e in results:
        for name in ("onnxkv", "onnxkv-bf16"):
            kv = e.get(name)
            if kv is None:
                continue
            line = f"prompt {e['prompt']}: {name} {kv.get('median_s', float('nan')):.3f} s"
            if f"ratio_{name}_over_ort-genai" in e:
                line += f", GenAI {e['ort-genai']['median_s']:.3f} s, ratio {e[f'ratio_{name}_over_ort-genai']:.2f}"
            if kv.get("product_gflops") is not None:
                line += (
                    f"; products {kv['product_gflops']:.0f} GFLOP/s ({kv['product_peak_fraction']:.0%} of the FMA "
                    f"peak, {kv['product_blas_fraction']:.0%} of the BLAS GEMM), attention "
                    f"{kv.get('attention_gflops') or 0:.0f} GFLOP/s ({kv.get('attention_peak_fraction') or 0:.0%} "
                    "of the peak)"
                )
            summary.append(line)
    emit(
        {
            "benchmark": "prefill",
            "machine": machine(),
            "versions": {**versions(), "onnxruntime_genai": genai_version},
            "threads": args.threads,
            "shapes": {
                "model": "small (onnxkv.zoo.builders.SMALL, GroupQueryAttention, GenAI folder)",
                "prompts": prompts,
                "rounds": args.rounds,
                "product_weights": weights,
            },
            "blas_gemm_gflops": blas,
            "fma_peak_gflops": peak,
            "results": results,
        },
        args.out,
        summary,
    )


if __name__ == "__main__":
    main()
