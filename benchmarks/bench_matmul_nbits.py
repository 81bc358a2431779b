"""Benchmark ``com.microsoft::MatMulNBits`` at decode shapes: onnxkv vs ONNX Runtime on the same file.

For each (K x N, bits) a small model holds ``--nodes`` MatMulNBits nodes with
distinct random weights (block 32, ``accuracy_level`` 4 by default, no zero
points: what the GenAI builder's ``-p int4 -e cpu`` emits) that all read one
x [M, K]; each engine runs the whole model per call through its public API
(``onnxkv.Session.run``, ``onnxruntime.InferenceSession.run``), so dispatch
counts.  Each (engine, threads) runs in its own subprocess (their thread
pools would fight otherwise), ``--inner`` calls per round after warm-up, and
``--rounds`` rounds alternate the engines.

Prints one JSON document: machine, versions, per case the raw samples
(seconds per model call), medians, per-node time, weight bytes read per node
and GB/s, the ratio ORT / onnxkv (pooled and per round), and the max abs
difference between the two outputs.  ``bench_matmul.py --nbits`` runs the
same cases (``run``) inside its own document.

    python benchmarks/bench_matmul_nbits.py [--shapes 1024x1024 1024x2816 1024x8000 2816x1024] [--bits 4 8]
                                            [--M 1] [--threads 2] [--nodes 4] [--rounds 3] [--inner 50] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit, machine, median, run_worker, versions  # noqa: E402

ENGINES = ["onnxkv", "onnxruntime"]


def nbits_model(K: int, N: int, bits: int, nodes: int, block: int, level: int, seed: int):
    """The benchmark model: ``nodes`` MatMulNBits(x, B_i, scales_i) -> y_i, x [M, K] (M symbolic)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nblk = -(-K // block)
    inits, graph_nodes, outputs = [], [], []
    for i in range(nodes):
        B = rng.integers(0, 256, (N, nblk, block * bits // 8), dtype=np.uint8)
        s = (rng.random((N * nblk,), dtype=np.float32) * 0.02 + 1e-3).astype(np.float32)
        inits += [numpy_helper.from_array(B, f"B{i}"), numpy_helper.from_array(s, f"s{i}")]
        graph_nodes.append(
            helper.make_node(
                "MatMulNBits",
                ["x", f"B{i}", f"s{i}"],
                [f"y{i}"],
                name=f"mnb{i}",
                domain="com.microsoft",
                K=K,
                N=N,
                bits=bits,
                block_size=block,
                accuracy_level=level,
            )
        )
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["M", N]))
    graph = helper.make_graph(
        graph_nodes, "nbits", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])], outputs, inits
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    return model


def worker(engine: str, threads: int, path: str, M: int, K: int, inner: int) -> dict:
    """Time ``inner`` calls of the model at ``path`` on ``engine``; returns samples and the first output."""
    x = np.random.default_rng(1).standard_normal((M, K)).astype(np.float32)
    if engine == "onnxkv":
        import onnxkv

        sess = onnxkv.Session(path, threads=threads)
        call = lambda: sess.run({"x": x})  # noqa: E731
    else:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        call = lambda: dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))  # noqa: E731
    for _ in range(max(5, inner // 5)):
        out = call()
    samples = []
    for _ in range(inner):
        t = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t)
    return {"samples": samples, "y0": np.asarray(out["y0"]).ravel()[:256].tolist()}


def add_arguments(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """The case options (``prefix`` before each name: bench_matmul.py takes them as ``--nbits-...``)."""
    ap.add_argument(f"--{prefix}shapes", nargs="*", default=["1024x1024", "1024x2816", "1024x8000", "2816x1024"])
    ap.add_argument(f"--{prefix}bits", type=int, nargs="*", default=[4, 8])
    ap.add_argument(f"--{prefix}M", type=int, nargs="*", default=[1])
    ap.add_argument(f"--{prefix}nodes", type=int, default=4, help="MatMulNBits nodes (distinct weights) per model")
    ap.add_argument(f"--{prefix}block", type=int, default=32)
    ap.add_argument(f"--{prefix}level", type=int, default=4, help="accuracy_level of the nodes")


def run(
    shapes, bits_list, Ms, threads_list, nodes: int, block: int, level: int, rounds: int, inner: int, engines=ENGINES
) -> tuple[list, list]:
    """Measures every (shape, bits, threads, M); returns (cases, one summary line per case)."""
    import onnx

    cases, summary = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            K, N = map(int, shape.split("x"))
            for bits in bits_list:
                path = os.path.join(tmp, f"nbits_{K}x{N}_{bits}.onnx")
                onnx.save(nbits_model(K, N, bits, nodes, block, level, seed=K + N + bits), path)
                weight_bytes = N * -(-K // block) * (block * bits // 8 + 4)
                for threads in threads_list:
                    for M in Ms:
                        runs = {e: [] for e in engines}
                        first = {}
                        for r in range(rounds):
                            for e in engines if r % 2 == 0 else engines[::-1]:
                                res = run_worker(__file__, [e, threads, path, M, K, inner], threads)
                                if "error" in res:
                                    runs[e] = res
                                    continue
                                if isinstance(runs[e], list):
                                    runs[e].append(res["samples"])
                                first.setdefault(e, res["y0"])
                        case = {
                            "K": K,
                            "N": N,
                            "bits": bits,
                            "M": M,
                            "threads": threads,
                            "nodes": nodes,
                            "block": block,
                            "accuracy_level": level,
                            "weight_bytes_per_node": weight_bytes,
                            "engines": {},
                        }
                        for e, rr in runs.items():
                            if isinstance(rr, dict):
                                case["engines"][e] = rr
                                continue
                            pooled = [x for r_ in rr for x in r_]
                            med = median(pooled)
                            case["engines"][e] = {
                                "samples_s": rr,
                                "median_s": med,
                                "round_medians_s": [median(r_) for r_ in rr],
                                "per_node_us": med / nodes * 1e6,
                                "gb_per_s": weight_bytes * nodes / med / 1e9,
                            }
                        kv, ort = case["engines"].get("onnxkv", {}), case["engines"].get("onnxruntime", {})
                        if "median_s" in kv and "median_s" in ort:
                            case["ort_over_onnxkv"] = ort["median_s"] / kv["median_s"]
                            case["ort_over_onnxkv_per_round"] = [
                                b / a for a, b in zip(kv["round_medians_s"], ort["round_medians_s"])
                            ]
                            a, b = np.array(first["onnxkv"]), np.array(first["onnxruntime"])
                            case["max_abs_diff_vs_ort"] = float(np.abs(a - b).max())
                            case["max_abs_ort"] = float(np.abs(b).max())
                            summary.append(
                                f"{K}x{N} int{bits} M={M} threads={threads}: onnxkv "
                                f"{kv['per_node_us']:.1f} us/node, ORT {ort['per_node_us']:.1f} us/node, "
                                f"ORT/onnxkv {case['ort_over_onnxkv']:.2f}"
                            )
                        cases.append(case)
    return cases, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--threads", type=int, nargs="*", default=[2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inner", type=int, default=50)
    ap.add_argument("--engines", nargs="*", default=ENGINES, choices=ENGINES)
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        engine, threads, path, M, K, inner = args.worker
        print(json.dumps(worker(engine, int(threads), path, int(M), int(K), int(inner))))
        return
    doc = {
        "benchmark": "matmul_nbits",
        "machine": machine(),
        "versions": versions("onnxruntime"),
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
    }
    doc["machine"]["loadavg_at_start"] = [round(v, 2) for v in os.getloadavg()]
    doc["cases"], summary = run(
        args.shapes,
        args.bits,
        args.M,
        args.threads,
        args.nodes,
        args.block,
        args.level,
        args.rounds,
        args.inner,
        args.engines,
    )
    emit(doc, args.out, summary, loadavg=True)


if __name__ == "__main__":
    main()
