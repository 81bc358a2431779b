"""Shared pieces of the benchmark scripts: machine facts, versions, JSON output.

Benchmarks print one JSON document (machine, versions, threads, shapes, raw
samples in seconds, medians, ratios against the peer measured in the same run).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict:
    import psutil

    return {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "python": sys.version.split()[0],
    }


def versions(*extra: str) -> dict:
    import numpy
    import onnx

    import onnxkv

    out = {"onnxkv": onnxkv.__version__, "numpy": numpy.__version__, "onnx": onnx.__version__,
           "simd": onnxkv.config()["simd"], "openmp": onnxkv.config()["openmp"]}
    for name in extra:
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except ImportError:
            out[name] = None
    return out


def median(xs) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def emit(doc: dict, path: str | None) -> None:
    text = json.dumps(doc, indent=1)
    print(text)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
