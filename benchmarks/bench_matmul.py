"""Benchmark onnxkv's decode matmul (``onnxkv._kernels.matmul_rows``) against
NumPy's matmul (BLAS, thread count set with threadpoolctl) and ONNX Runtime's
MatMul (a one-node model, weight as initializer, intra-op threads set), for
decode-sized x [M, K] @ W [K, N].

Prints one JSON document: machine, versions, and per (threads, shape, M) the
raw samples (seconds), median and min per engine, effective GB/s (weight bytes
/ median time) and the max abs difference of each engine against the float64
reference.

Engines are measured in blocks (``--inner`` calls each) taking turns for
``--rounds`` rounds, with a pause between blocks: every engine keeps its own
busy-waiting thread pool (OpenMP, BLAS, ORT), and interleaving single calls
would measure the pools fighting for the cores rather than the kernels.  On a
shared machine medians move with the load of other jobs (load averages are
recorded at the start and end).

    python benchmarks/bench_matmul.py [--threads 1 2] [--M 1 4] [--rounds 5] [--inner 10] [--out FILE]
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit, machine  # noqa: E402

import onnxkv._kernels as K  # noqa: E402
from onnxkv._kernels import reference as R  # noqa: E402

SHAPES = [(1024, 1024), (1024, 2816), (2816, 1024), (1024, 8000)]


def versions():
    v = {"python": sys.version.split()[0], "numpy": np.__version__}
    for mod in ("onnxkv", "onnxruntime", "onnx", "threadpoolctl"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:
            v[mod] = None
    v["onnxkv_simd_path"] = K.simd_path()
    v["onnxkv_openmp"] = K.openmp_enabled()
    try:
        from threadpoolctl import threadpool_info
        v["blas"] = [{k: i.get(k) for k in ("internal_api", "version", "threading_layer", "architecture",
                                             "num_threads")} for i in threadpool_info() if i.get("user_api") == "blas"]
    except Exception:
        v["blas"] = None
    return v


def ort_session(w, threads):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    Kd, N = w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", Kd])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])],
        initializer=[numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def ort_runner(sess, x, out):
    io = sess.io_binding()
    io.bind_cpu_input("x", x)
    io.bind_output("y", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)

    def run():
        sess.run_with_iobinding(io)
    return run


def measure(variants, rounds, inner, pause):
    for fn in variants.values():
        for _ in range(3):
            fn()
    samples = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            time.sleep(pause)
            fn()  # wake this engine's pool
            for _ in range(inner):
                t = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t)
    return samples


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--M", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--shapes", nargs="*", default=[f"{k}x{n}" for k, n in SHAPES], help="KxN weight shapes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--pause", type=float, default=0.05, help="seconds between engine blocks")
    ap.add_argument("--no-ort", action="store_true")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()

    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    doc = {"benchmark": "matmul_rows", "machine": machine(), "versions": versions(),
           "cpu_features": K.cpu_features(),
           "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
           "method": {"rounds": args.rounds, "inner": args.inner, "pause_s": args.pause,
                      "gbps": "weight bytes / median seconds"},
           "cases": []}
    old_threads = K.get_num_threads()
    try:
        for threads in args.threads:
            K.set_num_threads(threads)
            for spec in args.shapes:
                Kd, N = (int(v) for v in spec.lower().split("x"))
                w = rng.standard_normal((Kd, N)).astype(np.float32)
                sess = None
                if not args.no_ort:
                    try:
                        sess = ort_session(w, threads)
                    except Exception as e:  # onnxruntime missing
                        doc.setdefault("ort_error", f"{type(e).__name__}: {e}")
                for M in args.M:
                    x = rng.standard_normal((M, Kd)).astype(np.float32)
                    outs = {name: np.empty((M, N), np.float32) for name in ("onnxkv", "numpy_blas", "onnxruntime")}

                    def blas(o=outs["numpy_blas"]):
                        np.matmul(x, w, out=o)
                    variants = {
                        "onnxkv": lambda o=outs["onnxkv"]: K.matmul_rows(x, w, o),
                        "numpy_blas": blas,
                    }
                    if sess is not None:
                        variants["onnxruntime"] = ort_runner(sess, x, outs["onnxruntime"])
                    with threadpool_limits(limits=threads, user_api="blas"):
                        samples = measure(variants, args.rounds, args.inner, args.pause)
                    want = np.empty((M, N), np.float32)
                    R.matmul_rows(x, w, want)
                    case = {"threads": threads, "shapes": {"x": [M, Kd], "w": [Kd, N], "out": [M, N]},
                            "weight_bytes": int(w.nbytes), "engines": {}}
                    for name, s in samples.items():
                        med = statistics.median(s)
                        case["engines"][name] = {
                            "samples_s": s, "median_s": med, "min_s": min(s),
                            "gbps_median": w.nbytes / med / 1e9, "gbps_best": w.nbytes / min(s) / 1e9,
                            "max_abs_err": float(np.max(np.abs(outs[name] - want))),
                        }
                    base = case["engines"]["onnxkv"]["median_s"]
                    case["speedup_vs_onnxkv"] = {n: e["median_s"] / base for n, e in case["engines"].items()}
                    doc["cases"].append(case)
                    print(f"# t{threads} {Kd}x{N} M{M}: " + "  ".join(
                        f"{n} {e['median_s'] * 1e3:.3f}ms {e['gbps_median']:.1f}GB/s"
                        for n, e in case["engines"].items()), file=sys.stderr, flush=True)
                del sess
    finally:
        K.set_num_threads(old_threads)
    doc["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    doc["summary"] = [
        {"threads": c["threads"], "M": c["shapes"]["x"][0], "KxN": "x".join(map(str, c["shapes"]["w"])),
         **{f"{n}_median_ms": round(e["median_s"] * 1e3, 4) for n, e in c["engines"].items()},
         **{f"{n}_gbps": round(e["gbps_median"], 2) for n, e in c["engines"].items()}}
        for c in doc["cases"]]
    emit(doc, args.out)


if __name__ == "__main__":
    main()
