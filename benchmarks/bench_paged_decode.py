"""Decode attention over a paged KV cache: onnxkv paged vs onnxkv contiguous vs
ONNX Runtime com.microsoft.GroupQueryAttention.

One new token (Sq = 1), batch 1, 32 query heads, 8 KV heads, head size 128,
contexts 4096 and 16384 (by default), threads from --threads (default 2).

* onnxkv contiguous: ``onnxkv._kernels.attention`` over K/V [1, 8, ctx, 128].
* onnxkv paged: ``onnxkv._kernels.paged_attention`` over the same values copied
  into pages of block_size tokens ([8, block_size, 128] each, block sizes 16
  (the bar), 32 and 64).  Pages are allocated the way a paged state allocates
  them by default, logical block by logical block (key page then value page)
  as decode appends them (--allocator slab: a SlabAllocator per cache, keys
  from lane 0, values from lane 1, each plane's pages adjacent in huge-page
  backed chunks; --allocator system: one NumPy array per page), and the block
  table maps the logical blocks to a shuffled order of the page ids.
* onnxkv paged, arena: the same with the pages of the first block size carved
  from one onnxkv.alloc.ArenaAllocator region (still shuffled): one region
  instead of a heap allocation per page.
* Control: onnxkv contiguous float32 on K/V placed in an anonymous mmap
  (4 KiB pages: NumPy asks for transparent huge pages only for its own large
  arrays) -- the small-page TLB cost individually allocated pages
  (--allocator system) pay.
* Both in float32 and float16.
* ONNX Runtime: the one-node GroupQueryAttention model of _common with past and
  present bound to the same float32 buffer (bench_decode_attention's shared
  buffer mode), intra_op_num_threads = threads.

All variants at all thread counts are measured interleaved, round by round
(bench_decode_attention.measure).  Prints one JSON document (machine, versions,
threads, the page allocator (config.page_allocator), shapes, raw samples in seconds, medians, paged/contiguous ratios,
speedups vs ORT, the bar) and a summary on stderr.  paged_over_contiguous
holds each paged variant's median (and best) time over the contiguous one of
the same dtype, and the float32 ones over the small-page control.  The bar:
paged (block size 16) float32 median <= 1.1x contiguous at 16384 tokens with
2 threads.

    python benchmarks/bench_paged_decode.py [--threads 2] [--contexts 4096 16384]
        [--block-sizes 16 32 64] [--repeat N] [--no-ort] [--allocator slab|system] [--out FILE]
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import PAGE_ALLOCATORS, emit, kv_page_allocators, machine, versions  # noqa: E402
from bench_decode_attention import HKV, HQ, B, D, measure, ort_decode_on_copies, ort_session  # noqa: E402

import onnxkv._kernels as K  # noqa: E402
from onnxkv.alloc import ArenaAllocator  # noqa: E402

BAR = {"ctx": 16384, "threads": 2, "block_size": 16, "dtype": "float32", "max_ratio_paged_over_contiguous": 1.1}
DTYPES = {"f32": np.float32, "f16": np.float16}


def small_page_copy(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` in an anonymous mmap (4 KiB pages, no huge-page advice)."""
    buf = mmap.mmap(-1, a.nbytes)
    out = np.frombuffer(buf, dtype=a.dtype).reshape(a.shape)
    out[...] = a
    return out


class PagedCopy:
    """K/V [1, Hkv, ctx, D] copied into individually allocated pages of bs tokens,
    allocated in logical block order (key page from ``allocators[0]``, value page
    from ``allocators[1]``), page ids a random permutation of the logical blocks."""

    def __init__(self, k, v, bs, rng, allocators):
        _, hkv, ctx, d = k.shape
        m = -(-ctx // bs)
        self.table = rng.permutation(m).astype(np.int32)[None, :]
        self.buffers = []
        addrs = {"k": np.zeros(m, np.uint64), "v": np.zeros(m, np.uint64)}
        for i in range(m):  # logical block i lives in page table[0, i]
            pid = int(self.table[0, i])
            n = min(bs, ctx - i * bs)
            for name, src, alloc in (("k", k, allocators[0]), ("v", v, allocators[1])):
                buf = alloc.allocate(hkv * bs * d * src.itemsize, 64)
                page = buf.view(src.dtype, (hkv, bs, d))
                page[:, :n] = src[0, :, i * bs : i * bs + n]
                page[:, n:] = 0
                addrs[name][pid] = buf.address
                self.buffers.append(buf)
        self.k_addr, self.v_addr, self.bs = addrs["k"], addrs["v"], bs


def run_context(ctx, threads_list, block_sizes, repeat, sessions, rng, kind) -> dict:
    """All variants at all thread counts, interleaved; returns {threads: case}."""
    scale = D**-0.5
    q = rng.standard_normal((B, HQ, 1, D)).astype(np.float32)
    kf = rng.standard_normal((B, HKV, ctx, D)).astype(np.float32)
    vf = rng.standard_normal((B, HKV, ctx, D)).astype(np.float32)
    kv_len = np.array([ctx], np.int32)
    q_pos = np.array([[ctx - 1]], np.int32)
    out = np.empty_like(q)
    caches, paged = {}, {}
    bs0 = block_sizes[0]
    for dt, npdt in DTYPES.items():
        caches[dt] = (kf.astype(npdt), vf.astype(npdt))
        for bs in block_sizes:
            paged[(dt, bs)] = PagedCopy(*caches[dt], bs, rng, kv_page_allocators(kind))
        page_bytes = HKV * bs0 * D * np.dtype(npdt).itemsize
        arena = ArenaAllocator(2 * -(-ctx // bs0) * -(-page_bytes // 64) * 64)
        paged[(dt, "arena")] = PagedCopy(*caches[dt], bs0, rng, (arena, arena))
    kv_bytes = {dt: 2 * HKV * ctx * D * np.dtype(npdt).itemsize for dt, npdt in DTYPES.items()}

    caches["f32_small_pages"] = (small_page_copy(kf), small_page_copy(vf))

    def contiguous(dt):
        k, v = caches[dt]
        return lambda: K.attention(q, k, v, kv_len, q_pos, scale, 0.0, -1, out)

    def paged_call(dt, bs):
        pc = paged[(dt, bs)]
        kvd = "float16" if dt == "f16" else "float32"
        return lambda: K.paged_attention(
            q, pc.k_addr, pc.v_addr, pc.table, pc.bs, HKV, kv_len, q_pos, scale, 0.0, -1, out, kv_dtype=kvd
        )

    def on(t, fn):
        def run():
            K.set_num_threads(t)
            fn()

        return run

    cases, variants = {}, {}
    for t in threads_list:
        case = {
            "threads": t,
            "shapes": {
                "B": B,
                "Hq": HQ,
                "Hkv": HKV,
                "D": D,
                "Sq": 1,
                "ctx": ctx,
                "block_sizes": block_sizes,
                "contiguous_layout": "[B, Hkv, ctx, D]",
                "page_layout": f"[Hkv, block_size, D], one aligned allocation per page ({kind}), page ids shuffled",
            },
            "max_abs_diff_paged_vs_contiguous": {},
        }
        K.set_num_threads(t)
        for dt in DTYPES:
            want = np.empty_like(q)
            contiguous(dt)()
            want[...] = out
            variants[(t, f"onnxkv_contiguous_{dt}")] = on(t, contiguous(dt))
            for bs in block_sizes + ["arena"]:
                name = f"{dt}_bs{bs}" if bs != "arena" else f"arena_{dt}_bs{bs0}"
                paged_call(dt, bs)()
                case["max_abs_diff_paged_vs_contiguous"][name] = float(np.max(np.abs(out - want)))
                variants[(t, f"onnxkv_paged_{name}")] = on(t, paged_call(dt, bs))
        variants[(t, "onnxkv_contiguous_f32_small_pages")] = on(t, contiguous("f32_small_pages"))
        sess = sessions.get(t)
        if sess is not None:
            ort_call, ref = ort_decode_on_copies(sess, q, kf, vf, ctx)
            contiguous("f32")()
            case["max_abs_diff_onnxkv_vs_ort"] = float(np.max(np.abs(ref - out)))
            variants[(t, "ort_gqa_shared_buffer_f32")] = ort_call
        cases[t] = case

    loadavg = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    results = measure(variants, repeat)
    for t, case in cases.items():
        case["loadavg_before"] = loadavg
        res = case["results"] = {name: r for (tt, name), r in results.items() if tt == t}
        ratios, ort = {}, res.get("ort_gqa_shared_buffer_f32")
        for name, r in res.items():
            dt = "f16" if "_f16" in name else "f32"
            r["kv_bytes"] = kv_bytes[dt]
            r["kv_read_GBps"] = kv_bytes[dt] / r["median_s"] / 1e9
            if ort is not None and name.startswith("onnxkv"):
                r["speedup_vs_ort_shared_buffer"] = ort["median_s"] / r["median_s"]
        for dt in DTYPES:
            for name in [f"{dt}_bs{bs}" for bs in block_sizes] + [f"arena_{dt}_bs{bs0}"]:
                p, c = res[f"onnxkv_paged_{name}"], res[f"onnxkv_contiguous_{dt}"]
                ratios[name] = {"median": p["median_s"] / c["median_s"], "best": p["min_s"] / c["min_s"]}
        c4 = res["onnxkv_contiguous_f32_small_pages"]
        for name in [f"f32_bs{bs}" for bs in block_sizes]:
            p = res[f"onnxkv_paged_{name}"]
            ratios[f"{name}_vs_contiguous_small_pages"] = {
                "median": p["median_s"] / c4["median_s"],
                "best": p["min_s"] / c4["min_s"],
            }
        case["paged_over_contiguous"] = ratios
    return cases


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="*", default=[2])
    ap.add_argument("--contexts", type=int, nargs="*", default=[4096, 16384])
    ap.add_argument("--block-sizes", type=int, nargs="*", default=[16, 32, 64])
    ap.add_argument("--repeat", type=int, default=21, help="timed rounds per context")
    ap.add_argument("--no-ort", action="store_true", help="skip the ONNX Runtime peer")
    ap.add_argument(
        "--allocator",
        choices=PAGE_ALLOCATORS,
        default=PAGE_ALLOCATORS[0],
        help="page storage: slab (a paged state's default: a SlabAllocator, one lane per plane) or "
        "system (one NumPy array per page)",
    )
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)

    doc = {
        "benchmark": "paged_decode_attention",
        "machine": machine(),
        "versions": versions("onnxruntime"),
        "config": {
            "Hq": HQ,
            "Hkv": HKV,
            "D": D,
            "B": B,
            "Sq": 1,
            "contexts": args.contexts,
            "block_sizes": args.block_sizes,
            "threads": args.threads,
            "repeat": args.repeat,
            "dtypes": list(DTYPES),
            "bar": BAR,
            "page_allocator": args.allocator,
            "peer": "onnxruntime com.microsoft.GroupQueryAttention, CPUExecutionProvider, past/present "
            "bound to the same float32 buffer via IOBinding",
        },
        "runs": [],
    }
    rng = np.random.default_rng(0)
    old = K.get_num_threads()
    try:
        runs = {t: {"threads": t, "cases": []} for t in args.threads}
        sessions = {}
        for t in args.threads:
            if args.no_ort:
                continue
            try:
                sessions[t] = ort_session(t, D**-0.5, False)
            except Exception as e:  # onnxruntime missing or the op unsupported
                runs[t]["ort_error"] = f"{type(e).__name__}: {e}"
        for ctx in args.contexts:
            for t, case in run_context(
                ctx, args.threads, args.block_sizes, args.repeat, sessions, rng, args.allocator
            ).items():
                runs[t]["cases"].append(case)
            print(f"  done ctx={ctx}", file=sys.stderr)
        doc["runs"] = [runs[t] for t in args.threads]
    finally:
        K.set_num_threads(old)

    lines = []
    for run in doc["runs"]:
        for case in run["cases"]:
            res = case["results"]
            parts = [f"{name}={r['median_s'] * 1e3:.3f}ms" for name, r in res.items()]
            ratios = [f"{k}={v['median']:.3f}" for k, v in case["paged_over_contiguous"].items()]
            lines.append(
                f"threads={run['threads']} ctx={case['shapes']['ctx']}: "
                + ", ".join(parts)
                + "\n  paged/contiguous (median): "
                + ", ".join(ratios)
            )
            if case["threads"] == BAR["threads"] and case["shapes"]["ctx"] == BAR["ctx"]:
                ratio = case["paged_over_contiguous"]["f32_bs16"]["median"]
                doc["bar_result"] = {
                    **BAR,
                    "ratio_median": ratio,
                    "ratio_best": case["paged_over_contiguous"]["f32_bs16"]["best"],
                    "met": ratio <= BAR["max_ratio_paged_over_contiguous"],
                }
                lines.append(
                    f"BAR paged/contiguous f32 bs16 ctx={BAR['ctx']} threads={BAR['threads']}: "
                    f"{ratio:.3f} (need <= {BAR['max_ratio_paged_over_contiguous']}) -> "
                    + ("MET" if doc["bar_result"]["met"] else "NOT MET")
                )
    emit(doc, args.out, lines, loadavg=True)


if __name__ == "__main__":
    main()
