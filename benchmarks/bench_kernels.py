"""Benchmark the onnxkv compiled kernels against their NumPy reference twins and
decode attention against ONNX Runtime's com.microsoft.GroupQueryAttention.

Prints one JSON document: machine, versions, threads, and per case the shapes,
raw samples (seconds) and medians, all measured side by side in this run.

    python benchmarks/bench_kernels.py [--threads N] [--repeat R] [--quick]
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_model, gqa_decode_model  # noqa: E402

import onnxkv._kernels as K
from onnxkv._kernels import reference as R


def machine():
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_features": K.cpu_features(),
    }
    if hasattr(os, "getloadavg"):
        info["loadavg_at_start"] = os.getloadavg()
    return info


def versions():
    v = {"python": sys.version.split()[0], "numpy": np.__version__}
    try:
        import onnxkv

        v["onnxkv"] = onnxkv.__version__
    except Exception:  # pragma: no cover
        pass
    for mod in ("onnxruntime", "onnx"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:
            v[mod] = None
    return v


def timeit(fn, repeat, warmup=2):
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return samples


def measure(variants, repeat):
    """variants: name -> callable.  Interleaves the variants round by round so
    that machine noise hits them alike."""
    for fn in variants.values():
        fn()
        fn()
    samples = {name: [] for name in variants}
    for _ in range(repeat):
        for name, fn in variants.items():
            t = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t)
    return {name: {"samples_s": s, "median_s": statistics.median(s)} for name, s in samples.items()}


def with_simd(flag, fn):
    def run():
        K.set_simd_enabled(flag)
        try:
            fn()
        finally:
            K.set_simd_enabled(True)

    return run


def kernel_cases(rng, quick):
    rows, n = (16, 4096) if quick else (64, 4096)
    f = np.float32
    x = rng.standard_normal((rows, n)).astype(f)
    g = rng.standard_normal(n).astype(f)
    skip = rng.standard_normal((rows, n)).astype(f)
    out, out2 = np.empty_like(x), np.empty_like(x)
    yield (
        "rms_norm",
        {"x": [rows, n], "dtype": "float32"},
        (lambda: K.rms_norm(x, g, 1e-6, out)),
        (lambda: R.rms_norm(x, g, 1e-6, out)),
    )
    yield (
        "skip_rms_norm",
        {"x": [rows, n], "dtype": "float32", "bias": True, "sum_out": True},
        (lambda: K.skip_rms_norm(x, skip, g, g, 1e-6, out, out2)),
        (lambda: R.skip_rms_norm(x, skip, g, g, 1e-6, out, out2)),
    )
    s = (rng.standard_normal((32, 4096)) * 5).astype(f)
    so = np.empty_like(s)
    yield "softmax", {"x": [32, 4096], "dtype": "float32"}, (lambda: K.softmax(s, so)), (lambda: R.softmax(s, so))
    m = 4 * 14336 if not quick else 14336
    a, b, o = (rng.standard_normal(m).astype(f) for _ in range(3))
    yield "silu_mul", {"n": m, "dtype": "float32"}, (lambda: K.silu_mul(a, b, o)), (lambda: R.silu_mul(a, b, o))
    xr = rng.standard_normal((1, 128, 32, 128)).astype(f)
    ang = rng.uniform(0, 6.28, (4096, 64))
    cos, sin = np.cos(ang).astype(f), np.sin(ang).astype(f)
    pos = np.arange(128, dtype=np.int64)[None] + 1000
    xo = np.empty_like(xr)
    yield (
        "rotary_embedding",
        {"x": [1, 128, 32, 128], "rotary_dim": 128, "interleaved": False},
        (lambda: K.rotary_embedding(xr, cos, sin, pos, False, xo)),
        (lambda: R.rotary_embedding(xr, cos, sin, pos, False, xo)),
    )
    # prefill attention (causal), one sequence
    B, Hq, Hkv, D, S = 1, 32, 8, 128, (128 if quick else 512)
    q = rng.standard_normal((B, Hq, S, D)).astype(f)
    k = rng.standard_normal((B, Hkv, S, D)).astype(f)
    v = rng.standard_normal((B, Hkv, S, D)).astype(f)
    kl = np.array([S], np.int32)
    qp = np.arange(S, dtype=np.int32)[None]
    ao = np.empty_like(q)
    yield (
        "attention_prefill",
        {"B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "Sq": S, "ctx": S},
        (lambda: K.attention(q, k, v, kl, qp, D**-0.5, 0.0, -1, ao)),
        (lambda: R.attention(q, k, v, kl, qp, D**-0.5, 0.0, -1, ao)),
    )


def decode_cases(rng, contexts, threads, repeat):
    Hq, Hkv, D, B = 32, 8, 128, 1
    scale = D**-0.5
    try:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(gqa_decode_model(Hq, Hkv, D, scale), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime missing or op unsupported
        sess, ort_error = None, f"{type(e).__name__}: {e}"
    results = []
    for ctx in contexts:
        cap = ctx
        q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
        k = rng.standard_normal((B, Hkv, cap, D)).astype(np.float32)
        v = rng.standard_normal((B, Hkv, cap, D)).astype(np.float32)
        kl = np.array([ctx], np.int32)
        qp = np.array([[ctx - 1]], np.int32)
        out = np.empty_like(q)
        variants = {
            "onnxkv_simd": with_simd(True, lambda: K.attention(q, k, v, kl, qp, scale, 0.0, -1, out)),
            "onnxkv_scalar": with_simd(False, lambda: K.attention(q, k, v, kl, qp, scale, 0.0, -1, out)),
            "numpy_reference": lambda: R.attention(q, k, v, kl, qp, scale, 0.0, -1, out),
        }
        case = {"kernel": "attention_decode", "shapes": {"B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "ctx": ctx, "Sq": 1}}
        check = {}
        if sess is not None:
            # ORT: the newest token arrives as key/value; past holds ctx-1 tokens
            # (present = past + new, copied by the op: the standard tensor path).
            feeds = {
                "query": q.transpose(0, 2, 1, 3).reshape(B, 1, Hq * D).copy(),
                "key": k[:, :, ctx - 1 : ctx].transpose(0, 2, 1, 3).reshape(B, 1, Hkv * D).copy(),
                "value": v[:, :, ctx - 1 : ctx].transpose(0, 2, 1, 3).reshape(B, 1, Hkv * D).copy(),
                "past_key": k[:, :, : ctx - 1].copy(),
                "past_value": v[:, :, : ctx - 1].copy(),
                "seqlens_k": np.array([ctx - 1], np.int32),
                "total_sequence_length": np.array(ctx, np.int32),
            }
            variants["ort_gqa_copy_past"] = lambda: sess.run(["output"], feeds)
            try:  # shared past/present buffer through IO binding (capacity = ctx)
                pk = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(k))
                pv = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v))
                ob = ort.OrtValue.ortvalue_from_numpy(np.empty((B, 1, Hq * D), np.float32))
                io = sess.io_binding()
                for name in ("query", "key", "value", "seqlens_k", "total_sequence_length"):
                    io.bind_cpu_input(name, feeds[name])
                io.bind_ortvalue_input("past_key", pk)
                io.bind_ortvalue_input("past_value", pv)
                io.bind_ortvalue_output("output", ob)
                io.bind_ortvalue_output("present_key", pk)
                io.bind_ortvalue_output("present_value", pv)
                sess.run_with_iobinding(io)
                variants["ort_gqa_shared_buffer"] = lambda: sess.run_with_iobinding(io)
            except Exception as e:
                case["ort_shared_buffer_error"] = f"{type(e).__name__}: {e}"
            K.attention(q, k, v, kl, qp, scale, 0.0, -1, out)
            o_ort = sess.run(["output"], feeds)[0].reshape(B, 1, Hq, D).transpose(0, 2, 1, 3)
            check["max_abs_diff_vs_ort"] = float(np.max(np.abs(o_ort - out)))
        else:
            case["ort_error"] = ort_error
        case["results"] = measure(variants, repeat if ctx < 16384 else max(5, repeat // 2))
        case.update(check)
        results.append(case)
    return results


def run(threads, repeat, args):
    K.set_num_threads(threads)
    try:
        from threadpoolctl import threadpool_limits

        limiter = threadpool_limits(limits=threads)
    except Exception:
        limiter = None
    rng = np.random.default_rng(0)
    res = {
        "threads": {
            "kernels": K.get_num_threads(),
            "openmp": K.openmp_enabled(),
            "simd_path": K.simd_path(),
            "blas_limit": threads if limiter is not None else None,
            "ort_intra_op": threads,
        },
        "cases": [],
    }
    if hasattr(os, "getloadavg"):
        res["loadavg_at_start"] = os.getloadavg()
    try:
        for name, shapes, kern, ref in kernel_cases(rng, args.quick):
            r = measure(
                {"onnxkv_simd": with_simd(True, kern), "onnxkv_scalar": with_simd(False, kern), "numpy_reference": ref},
                repeat,
            )
            res["cases"].append({"kernel": name, "shapes": shapes, "results": r})
        res["cases"] += decode_cases(rng, args.contexts, threads, repeat)
    finally:
        if limiter is not None:
            limiter.restore_original_limits()
    for case in res["cases"]:
        med = {k: v["median_s"] for k, v in case["results"].items()}
        case["median_summary_ms"] = {k: round(v * 1e3, 4) for k, v in med.items()}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--threads",
        type=int,
        nargs="*",
        default=sorted({1, K.get_num_threads()}),
        help="thread counts to measure, one run each (default: 1 and all cores)",
    )
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="smaller shapes, fewer repeats")
    ap.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096, 16384])
    args = ap.parse_args(argv)
    repeat = 5 if args.quick else args.repeat
    doc = {"machine": machine(), "versions": versions(), "runs": []}
    for threads in args.threads:
        doc["runs"].append(run(threads, repeat, args))
    if hasattr(os, "getloadavg"):
        doc["machine"]["loadavg_at_end"] = os.getloadavg()
    json.dump(doc, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
