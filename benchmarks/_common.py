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
import time


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

    out = {
        "onnxkv": onnxkv.__version__,
        "numpy": numpy.__version__,
        "onnx": onnx.__version__,
        "simd": onnxkv.config()["simd"],
        "openmp": onnxkv.config()["openmp"],
    }
    for name in extra:
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except ImportError:
            out[name] = None
    return out


def gqa_decode_model(hq: int, hkv: int, d: int, scale: float) -> bytes:
    """A one-node ``com.microsoft.GroupQueryAttention`` model (the ONNX Runtime peer of
    the attention benchmarks): query/key/value [B, S, H*D], past/present [B, Hkv, *, D]."""
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    node = helper.make_node(
        "GroupQueryAttention",
        ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"],
        ["output", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=hq,
        kv_num_heads=hkv,
        scale=scale,
    )
    graph = helper.make_graph(
        [node],
        "gqa_decode",
        [
            helper.make_tensor_value_info("query", f, ["B", "S", hq * d]),
            helper.make_tensor_value_info("key", f, ["B", "S", hkv * d]),
            helper.make_tensor_value_info("value", f, ["B", "S", hkv * d]),
            helper.make_tensor_value_info("past_key", f, ["B", hkv, "P", d]),
            helper.make_tensor_value_info("past_value", f, ["B", hkv, "P", d]),
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
            helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        ],
        [
            helper.make_tensor_value_info("output", f, ["B", "S", hq * d]),
            helper.make_tensor_value_info("present_key", f, ["B", hkv, "T", d]),
            helper.make_tensor_value_info("present_value", f, ["B", hkv, "T", d]),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    return model.SerializeToString()


def run_worker(script: str, args: list, threads: int) -> dict:
    """Run ``script --worker *args`` in a fresh process (OMP_NUM_THREADS=threads) and return the
    JSON object on its last stdout line, or ``{"error": [last stderr line]}`` if it failed."""
    import subprocess

    cmd = [sys.executable, script, "--worker", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: ``--allocator`` choices of the paged benchmarks; the first is what a paged state uses by default.
PAGE_ALLOCATORS = ("slab", "system")


def kv_page_allocators(kind: str) -> tuple:
    """(key plane allocator, value plane allocator) for benchmark pages, placed the way ``kind`` places them.

    "slab": lanes 0 and 1 of a new :class:`onnxkv.alloc.SlabAllocator`, as a
    paged state's :class:`onnxkv.cache.paged.BlockPool` does by default (each
    plane's pages adjacent, in huge-page backed chunks, in allocation order).
    "system": one :class:`onnxkv.alloc.SystemAllocator` for both (one NumPy
    array per page, what an explicit ``allocator=SystemAllocator()`` gives).
    """
    from onnxkv.alloc import SlabAllocator, SystemAllocator

    if kind == "slab":
        slab = SlabAllocator()
        return slab.lane(0), slab.lane(1)
    if kind == "system":
        system = SystemAllocator()
        return system, system
    raise ValueError(f"kv_page_allocators: kind must be one of {PAGE_ALLOCATORS}, got {kind!r}")


def median(xs) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def emit(doc: dict, path: str | None, summary=(), loadavg: bool = False) -> None:
    """Print ``doc`` as JSON (and write it to ``path``), then the ``summary`` lines on stderr.

    ``loadavg``: first record the load average at the end in ``doc["machine"]``.
    """
    if loadavg and hasattr(os, "getloadavg"):
        doc.setdefault("machine", {})["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(doc, indent=1)
    print(text)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    for line in summary:
        print(line, file=sys.stderr)


def read_rate(nbytes: int, threads: int, runs: int = 5) -> float:
    """Best-of-``runs`` read rate (bytes/s) of a float32 array of about ``nbytes`` (at least 256 KiB) with
    onnxkv's compiled reader (``onnxkv._kernels.read_sum``) on ``threads`` threads: a large array gives the
    memory read bandwidth, a small one read again and again the rate of the cache that holds it."""
    import numpy as np

    import onnxkv._kernels as K

    a = np.ones(max(nbytes // 4, 1 << 16), np.float32)
    with K.use_settings(K.current_settings().replace(threads=threads)):
        K.read_sum(a)
        best = float("inf")
        for _ in range(runs):
            t = time.perf_counter()
            K.read_sum(a)
            best = min(best, time.perf_counter() - t)
    return a.nbytes / best
