"""Resident memory of a loaded model: inline weights (one .onnx file) against external data, onnxkv against
ONNX Runtime on the same files.

Each measurement runs in a fresh process: RSS (psutil) before loading, after ``onnxkv.Session`` (or
``onnxruntime.InferenceSession``) is built, and after a prompt of 16 tokens and 16 greedy tokens (onnxkv) or
one forward pass of the prompt (ONNX Runtime).  ``onnxkv-parsed`` is onnxkv with
``onnxkv.model.inline_data.read_model`` disabled, so the file is parsed whole by ``onnx.load`` (what onnxkv
did before large inline tensors stayed in the file).  The model is the zoo's builder graph (``--model``,
``--family``), saved once inline and once with external data; ``--dq8`` runs ONNX Runtime's
``quantize_dynamic`` on it first (the ``model_quantized.onnx`` of model repositories, written inline).

    python benchmarks/bench_load_memory.py [--model small] [--family gqa] [--dq8] [--threads 2] [--out F]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from _common import machine, run_worker, versions

ENGINES = ("onnxkv", "onnxkv-parsed", "ort")


def worker(engine: str, path: str, threads: int) -> dict:
    import numpy as np
    import psutil

    proc = psutil.Process()
    rss = lambda: proc.memory_info().rss  # noqa: E731
    before = rss()
    if engine == "ort":
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        built = rss()
        feeds = {}
        for i in session.get_inputs():
            shape = [d if isinstance(d, int) else 1 for d in i.shape]
            if i.name.startswith("past"):
                shape[2] = 0
            if i.name in ("input_ids", "attention_mask", "position_ids"):
                shape[-1] = 16
            dtype = np.int32 if "int32" in i.type else np.int64 if "int64" in i.type else np.float32
            feeds[i.name] = np.ones(shape, dtype) if "int" in i.type else np.zeros(shape, dtype)
        if "position_ids" in feeds:
            feeds["position_ids"] = np.arange(16, dtype=feeds["position_ids"].dtype)[None]
        session.run(None, feeds)
    else:
        import onnxkv

        if engine == "onnxkv-parsed":
            import importlib

            importlib.import_module("onnxkv.model.load").read_model = lambda file: None
        session = onnxkv.Session(path, threads=threads)
        built = rss()
        onnxkv.generate(session, [list(range(1, 17))], max_new_tokens=16, eos_token_id=[], temperature=0)
    return {"rss_built_bytes": built - before, "rss_after_run_bytes": rss() - before, "peak_rss_bytes": _peak()}


def _peak() -> int:
    """The process's peak resident bytes (VmHWM: unlike ru_maxrss, not inherited across exec)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="zoo size (onnxkv.zoo.builders: MICRO, TINY, SMALL, ...)")
    ap.add_argument("--family", default="gqa")
    ap.add_argument("--dq8", action="store_true", help="quantize_dynamic (QInt8) the model first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--worker", nargs=3)
    args = ap.parse_args()
    if args.worker:
        engine, path, threads = args.worker
        print(json.dumps(worker(engine, path, int(threads))))
        return

    import onnx

    from onnxkv.zoo import builders

    result = {
        "benchmark": "load_memory",
        "machine": machine(),
        "versions": versions("onnxruntime"),
        "threads": args.threads,
        "model": args.model,
        "family": args.family,
        "dq8": args.dq8,
        "files": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        proto = builders.build_model(args.family, getattr(builders, args.model.upper()), seed=1)
        if args.dq8:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            onnx.save(proto, str(tmp / "float.onnx"))
            quantize_dynamic(
                str(tmp / "float.onnx"),
                str(tmp / "q.onnx"),
                weight_type=QuantType.QInt8,
                op_types_to_quantize=["MatMul", "Gather"],
                extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
            )
            proto = onnx.load(str(tmp / "q.onnx"))
        (tmp / "inline").mkdir()
        (tmp / "external").mkdir()
        onnx.save(proto, str(tmp / "inline" / "model.onnx"))
        onnx.save(proto, str(tmp / "external" / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
        del proto
        for kind in ("inline", "external"):
            path = tmp / kind / "model.onnx"
            entry = {"file_bytes": sum(f.stat().st_size for f in path.parent.iterdir()), "engines": {}}
            for engine in ENGINES:
                if engine == "onnxkv-parsed" and kind == "external":
                    continue
                r = run_worker(__file__, [engine, path, args.threads], args.threads)
                entry["engines"][engine] = r
                if "error" not in r:
                    print(
                        f"# {kind} {engine}: built {r['rss_built_bytes'] / 2**20:.0f} MiB, after a run "
                        f"{r['rss_after_run_bytes'] / 2**20:.0f} MiB, peak {r['peak_rss_bytes'] / 2**20:.0f} MiB",
                        file=sys.stderr,
                    )
                else:
                    print(f"# {kind} {engine}: FAILED {r['error']}", file=sys.stderr)
            result["files"][kind] = entry
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
