"""Benchmark onnxkv's decode matmuls against NumPy's matmul (BLAS, thread
count set with threadpoolctl) and ONNX Runtime's MatMul (MatMul nodes with
initializer weights, intra-op threads set), for decode-sized x [M, K] @ W
[K, N] on the weight shapes of the SMALL decoder (onnxkv.zoo.config).

Engines: ``onnxkv_packed`` (``matmul_packed`` on ``pack_weight`` panels, what
a MatMul with an initializer weight runs; AVX-512 tiles where the CPU has
them), ``onnxkv_packed_avx2`` (the same, AVX2 tiles only), ``onnxkv_packed_team``
(the same, never running alone after a late thread team: see matmul.pyx;
opt-in, not in the default set), ``onnxkv_rows``
(``matmul_rows`` on the row-major weight, the path of run-time weights),
``numpy_blas`` and ``onnxruntime``.

Prints one JSON document: machine, versions, and per (threads, shape, M) the
raw samples (seconds), median and min per engine, effective GB/s (weight bytes
/ median time) and the max abs difference of each engine against the float64
reference.  The "step" case times every weight product of one SMALL decode
step (per layer q, k, v, o, gate, up, down; then lm_head) back to back on
distinct weights (~400 MB: they stream from memory, as in a real step; ONNX
Runtime runs them as one model).  ``step_estimate`` adds up, per (threads, M,
engine), the single-shape medians of the same products (weights hot in cache).

Every engine keeps its own busy-waiting thread pool (OpenMP, OpenBLAS, ORT);
measured in one process, the pool of the engine timed last keeps spinning
and fights the next engine for the cores.  So each (engine, threads) runs in
its own subprocess, ``--inner`` back-to-back calls per case after warm-up, and
``--rounds`` rounds alternate the engines so machine noise hits them alike.  On
a shared machine medians move with the load of other jobs (load averages are
recorded at the start and end).

``--nbits`` also measures ``com.microsoft::MatMulNBits`` against ONNX Runtime's
node on the same file (bench_matmul_nbits.py's cases: 1 x 1024 x {1024, 2816,
8000} and 1 x 2816 x 1024, 4 and 8 bits, block 32, accuracy_level 4, a graph
of ``--nbits-nodes`` such nodes run through each engine's public API), under
``matmul_nbits`` in the same document.

    python benchmarks/bench_matmul.py [--threads 1 2] [--M 1 2 4 8 16] [--shapes 1024x1024 ... step]
                                      [--rounds 3] [--inner 20] [--nbits [--nbits-shapes ...]] [--out FILE]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_matmul_nbits  # noqa: E402
from _common import emit, machine  # noqa: E402

import onnxkv._kernels as K  # noqa: E402
from onnxkv._kernels import matmul as MM  # noqa: E402
from onnxkv._kernels import reference as R  # noqa: E402
from onnxkv.zoo.config import SMALL  # noqa: E402

_H, _KV, _I = (
    SMALL.hidden_size,
    SMALL.num_kv_heads * (SMALL.head_size or SMALL.hidden_size // SMALL.num_heads),
    SMALL.intermediate_size,
)
#: (K, N) -> how many products of that shape one SMALL decode step runs.
STEP = {
    (_H, _H): 2 * SMALL.num_layers,
    (_H, _KV): 2 * SMALL.num_layers,
    (_H, _I): 2 * SMALL.num_layers,
    (_I, _H): SMALL.num_layers,
}
STEP[(_H, SMALL.vocab_size)] = STEP.get((_H, SMALL.vocab_size), 0) + 1
SHAPES = list(STEP)
ENGINES = ["onnxkv_packed", "onnxkv_packed_avx2", "onnxkv_rows", "numpy_blas", "onnxruntime"]
OPT_IN = ["onnxkv_packed_team"]


def versions():
    v = {"python": sys.version.split()[0], "numpy": np.__version__}
    for mod in ("onnxkv", "onnxruntime", "onnx", "threadpoolctl"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:
            v[mod] = None
    v["onnxkv_simd_path"] = K.simd_path()
    v["onnxkv_packed_avx512"] = MM.set_packed_avx512(True)
    v["onnxkv_openmp"] = K.openmp_enabled()
    try:
        from threadpoolctl import threadpool_info

        v["blas"] = [
            {k: i.get(k) for k in ("internal_api", "version", "threading_layer", "architecture", "num_threads")}
            for i in threadpool_info()
            if i.get("user_api") == "blas"
        ]
    except Exception:
        v["blas"] = None
    return v


def weight_shapes(spec):
    """[(K, N), ...] of a case: one product for "KxN"; for "step", every weight
    product of one SMALL decode step (per layer q, k, v, o, gate, up, down, then
    lm_head)."""
    if spec == "step":
        return [shape for shape, n in STEP.items() for _ in range(n)]
    return [tuple(int(v) for v in spec.lower().split("x"))]


def ort_session(ws, threads):
    """One MatMul node per weight (initializers), input x<K> per distinct K, output y<i>."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    ks = sorted({w.shape[0] for w in ws})
    graph = helper.make_graph(
        [helper.make_node("MatMul", [f"x{w.shape[0]}", f"w{i}"], [f"y{i}"]) for i, w in enumerate(ws)],
        "matmul",
        [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["M", k]) for k in ks],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["M", w.shape[1]]) for i, w in enumerate(ws)],
        initializer=[numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(ws)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def ort_runner(sess, xs, outs):
    io = sess.io_binding()
    for k, x in xs.items():
        io.bind_cpu_input(f"x{k}", x)
    for i, out in enumerate(outs):
        io.bind_output(f"y{i}", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)

    def run():
        sess.run_with_iobinding(io)

    return run


def runner(engine, threads, ws, xs, outs, prepared):
    """A function computing outs[i] = xs[K] @ ws[i] for every weight with ``engine``."""
    if engine.startswith("onnxkv_packed"):
        MM.set_packed_avx512(engine != "onnxkv_packed_avx2")
        MM._set_adaptive(engine != "onnxkv_packed_team")

        def fn():
            for wp, out in zip(prepared, outs):
                MM.matmul_packed(xs[wp.shape[1]], wp, out)
    elif engine == "onnxkv_rows":

        def fn():
            for w, out in zip(ws, outs):
                K.matmul_rows(xs[w.shape[0]], w, out)
    elif engine == "numpy_blas":

        def fn():
            for w, out in zip(ws, outs):
                np.matmul(xs[w.shape[0]], w, out=out)
    else:
        fn = ort_runner(prepared, xs, outs)
    return fn


def worker(engine, threads, specs, Ms, inner, seed):
    """Runs in a subprocess: one engine, one thread count, every case; returns
    {case_key: {"samples_s": [...], "max_abs_err": e}}.  A case's weights are
    distinct arrays (a "step" case holds ~400 MB, more than the caches, so its
    weights stream from memory as in a real decode step)."""
    from threadpoolctl import threadpool_limits

    K.set_num_threads(threads)
    res = {}
    with threadpool_limits(limits=threads, user_api="blas"):
        for spec in specs:
            shapes = weight_shapes(spec)
            rng = np.random.default_rng([seed, len(shapes), *shapes[0]])
            ws = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
            if engine == "onnxruntime":
                prepared = ort_session(ws, threads)
            elif engine.startswith("onnxkv_packed"):
                prepared = [MM.pack_weight(w) for w in ws]
            else:
                prepared = None
            for M in Ms:
                xs = {k: rng.standard_normal((M, k), dtype=np.float32) for k in sorted({w.shape[0] for w in ws})}
                outs = [np.empty((M, w.shape[1]), np.float32) for w in ws]
                fn = runner(engine, threads, ws, xs, outs, prepared)
                for _ in range(3):
                    fn()
                s = []
                for _ in range(inner):
                    t = time.perf_counter()
                    fn()
                    s.append(time.perf_counter() - t)
                err = 0.0
                for w, out in zip(ws, outs):
                    want = np.empty_like(out)
                    R.matmul_rows(xs[w.shape[0]], w, want)
                    err = max(err, float(np.max(np.abs(out - want))))
                res[f"{spec}/{M}"] = {"samples_s": s, "max_abs_err": err}
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--M", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument(
        "--shapes",
        nargs="*",
        default=[f"{k}x{n}" for k, n in SHAPES] + ["step"],
        help="KxN weight shapes, or 'step' (all weights of one SMALL decode step)",
    )
    ap.add_argument("--engines", nargs="*", default=ENGINES, choices=ENGINES + OPT_IN)
    ap.add_argument("--rounds", type=int, default=3, help="subprocess rounds per engine and thread count")
    ap.add_argument("--nbits", action="store_true", help="also the MatMulNBits cases (see above)")
    bench_matmul_nbits.add_arguments(ap, "nbits-")
    ap.add_argument("--inner", type=int, default=20, help="timed calls per case per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()

    if args.worker:
        json.dump(worker(args.worker, args.threads[0], args.shapes, args.M, args.inner, args.seed), sys.stdout)
        return

    doc = {
        "benchmark": "matmul",
        "machine": machine(),
        "versions": versions(),
        "cpu_features": K.cpu_features(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "method": {
            "rounds": args.rounds,
            "inner": args.inner,
            "isolation": "each engine runs in its own subprocess (its thread pool alone in the "
            "process); rounds alternate engines; calls back to back after 3 warm-up calls",
            "gbps": "weight bytes / median seconds",
        },
        "errors": [],
        "cases": [],
    }
    samples = {}  # (threads, case, engine) -> list
    errs = {}
    for _ in range(args.rounds):
        for threads in args.threads:
            for engine in args.engines:
                cmd = [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--worker",
                    engine,
                    "--threads",
                    str(threads),
                    "--inner",
                    str(args.inner),
                    "--seed",
                    str(args.seed),
                    "--M",
                    *map(str, args.M),
                    "--shapes",
                    *args.shapes,
                ]
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode != 0:
                    doc["errors"].append({"engine": engine, "threads": threads, "stderr": p.stderr[-2000:]})
                    continue
                for key, r in json.loads(p.stdout).items():
                    samples.setdefault((threads, key, engine), []).extend(r["samples_s"])
                    errs[(threads, key, engine)] = max(errs.get((threads, key, engine), 0.0), r["max_abs_err"])
    for threads in args.threads:
        for spec in args.shapes:
            shapes = weight_shapes(spec)
            nbytes = sum(k * n * 4 for k, n in shapes)
            for M in args.M:
                key = f"{spec}/{M}"
                if spec == "step":
                    desc = {"x": [M, "K"], "products": {f"{k}x{n}": c for (k, n), c in STEP.items()}}
                else:
                    desc = {"x": [M, shapes[0][0]], "w": list(shapes[0]), "out": [M, shapes[0][1]]}
                case = {"threads": threads, "case": spec, "M": M, "shapes": desc, "weight_bytes": nbytes, "engines": {}}
                for engine in args.engines:
                    s = samples.get((threads, key, engine))
                    if not s:
                        continue
                    med = statistics.median(s)
                    case["engines"][engine] = {
                        "samples_s": s,
                        "median_s": med,
                        "min_s": min(s),
                        "gbps_median": nbytes / med / 1e9,
                        "gbps_best": nbytes / min(s) / 1e9,
                        "max_abs_err": errs[(threads, key, engine)],
                    }
                if args.engines[0] in case["engines"]:
                    base = case["engines"][args.engines[0]]["median_s"]
                    case[f"time_ratio_vs_{args.engines[0]}"] = {
                        n: e["median_s"] / base for n, e in case["engines"].items()
                    }
                doc["cases"].append(case)
                print(
                    f"# t{threads} {spec} M{M}: "
                    + "  ".join(
                        f"{n} {e['median_s'] * 1e3:.3f}ms {e['gbps_median']:.1f}GB/s"
                        for n, e in case["engines"].items()
                    ),
                    file=sys.stderr,
                    flush=True,
                )
    doc["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    doc["summary"] = [
        {
            "threads": c["threads"],
            "M": c["M"],
            "case": c["case"],
            **{f"{n}_median_ms": round(e["median_s"] * 1e3, 4) for n, e in c["engines"].items()},
            **{f"{n}_gbps": round(e["gbps_median"], 2) for n, e in c["engines"].items()},
        }
        for c in doc["cases"]
    ]
    doc["step_estimate"] = step_estimate(doc["cases"], args)
    for row in doc["step_estimate"]:
        print(
            f"# step t{row['threads']} M{row['M']}: "
            + "  ".join(f"{n} {ms:.2f}ms" for n, ms in row["median_ms"].items()),
            file=sys.stderr,
            flush=True,
        )
    if args.nbits:
        cases, lines = bench_matmul_nbits.run(
            args.nbits_shapes,
            args.nbits_bits,
            args.nbits_M,
            args.threads,
            args.nbits_nodes,
            args.nbits_block,
            args.nbits_level,
            args.rounds,
            args.inner,
        )
        doc["matmul_nbits"] = cases
        for line in lines:
            print(f"# MatMulNBits {line}", file=sys.stderr, flush=True)
    emit(doc, args.out)


def step_estimate(cases, args):
    """Per (threads, M): sum over the shapes of one SMALL decode step of count x median, per engine."""
    measured = {(c["threads"], c["M"], c["case"]): c["engines"] for c in cases}
    rows = []
    for threads in args.threads:
        for M in args.M:
            per = {}
            for engine in args.engines:
                parts = [measured.get((threads, M, f"{k}x{n}"), {}).get(engine) for k, n in STEP]
                if all(parts):
                    per[engine] = sum(n * p["median_s"] for n, p in zip(STEP.values(), parts)) * 1e3
            if per:
                rows.append(
                    {
                        "threads": threads,
                        "M": M,
                        "products": {"x".join(map(str, k)): n for k, n in STEP.items()},
                        "median_ms": per,
                    }
                )
    return rows


if __name__ == "__main__":
    main()
