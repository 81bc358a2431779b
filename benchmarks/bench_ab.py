"""Kernel timings of two onnxkv builds in lock-step: is one within a few percent of the other?

Issue bars such as "every benchmark within 3% of before" compare two builds of onnxkv.  Run one after the
other, two benchmark processes see different phases of a shared machine (speeds here moved by 20-40%
between runs of one script), so a 3% difference cannot be seen.  This script starts two worker processes
per build (``--before`` and ``--after``: the Python interpreters of two environments, each with its own
onnxkv installed) and alternates the builds in short bursts (about ``--burst-ms`` each, ``--rounds`` pairs
per case, the order swapped every round), so that both see the same phase; only one runs at a time.
The workers are started anew ``--restarts`` times and the rounds shared among the starts: on a cache
larger than the last-level cache a process's speed depends on where its pages landed, which changes with
every start, so a figure from one start can be several percent off either way.

The cases call kernel entry points whose signatures both builds share (32 query / 8 KV heads, head size
128, batch 1):

* ``dattn_{f32,f16}_{ctx}``: ``attention`` decode, one token over ctx keys of a contiguous cache whose
  buffers start on a cache line, as onnxkv's allocators place them;
* ``paged_{f32,f16}_bs16_{ctx}``: ``paged_attention`` decode over pages of 16 tokens, page ids shuffled,
  each plane's pages side by side in one 2 MiB-aligned buffer, as a paged state's slab chunks hold them
  (with one heap buffer per page, where the pages land depends on what each build's import left on the
  heap: the same kernel measured 7 or 9 ms per call at 16,384 keys depending on the build beside it);
* ``mm_M{M}_{K}x{N}``: ``matmul_packed`` over four distinct packed weights (1 and 8 rows: decode; 128: a
  prompt chunk);
* ``rms_norm``, ``skip_rms_norm``, ``softmax``, ``silu_mul``, ``rotary``, ``prefill_512`` (causal
  ``attention`` over a 512-token prompt): the shapes of ``bench_kernels.py``.

Per case and thread count it reports the raw samples (seconds) of both builds, the ratio after/before of the
pooled medians and of the pooled 10th percentiles, and the median over rounds of the per-round ratio of
burst medians (``paired``: two bursts of one round ran back to back, so it is the figure least moved by
the machine's phase), with that median per start beside it.  Prints one JSON document on stdout and a table on stderr.  Give the same
interpreter to both sides once (an A/A run): the spread of its ratios around 1 is the difference this
machine can resolve.

    python benchmarks/bench_ab.py --before OLD_VENV/bin/python --after NEW_VENV/bin/python
        [--cases dattn_f16,paged] [--threads 1 2] [--rounds 60] [--restarts 4] [--burst-ms 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONTEXTS = (512, 2048, 4096, 8192, 16384)
PAGED_CONTEXTS = (4096, 16384)
MATMUL_SHAPES = ((1024, 1024), (1024, 2816), (2816, 1024))
HQ, HKV, D = 32, 8, 128


def _page_addresses(a, bs: int, table, keep: list):
    """``a`` [1, HKV, ctx, D] copied into pages of bs tokens ([HKV, bs, D]), logical block i in page
    table[0, i]; the pages side by side in page id order in one 2 MiB-aligned buffer (kept alive in
    ``keep``).  Returns the addresses by page id."""
    import numpy as np

    ctx = a.shape[2]
    m = table.shape[1]
    nbytes = HKV * bs * D * a.itemsize
    raw = np.zeros(nbytes * m + (1 << 21), np.uint8)
    off = -raw.ctypes.data % (1 << 21)
    keep.append(raw)
    addr = np.zeros(m, np.uint64)
    for i in range(m):
        pid = int(table[0, i])
        page = raw[off + pid * nbytes : off + (pid + 1) * nbytes].view(a.dtype).reshape(HKV, bs, D)
        n = min(bs, ctx - i * bs)
        page[:, :n] = a[0, :, i * bs : i * bs + n]
        addr[pid] = page.ctypes.data
    return addr


def _line_aligned(a, keep: list):
    """A copy of ``a`` that starts on a cache line (its buffer kept alive in ``keep``), as onnxkv's
    allocators place a cache (64-byte alignment).  Where NumPy puts an array relative to a cache line
    depends on what the process allocated before, so it differs between builds: main's float32 decode at
    512 and 2,048 keys measured 1.13 and 1.16 times before-19's on NumPy's placement (every one of six
    starts above 1.09) and 1.00 and 0.99 on cache-line-aligned caches."""
    import numpy as np

    raw = np.empty(a.nbytes + 64, np.uint8)
    off = -raw.ctypes.data % 64
    keep.append(raw)
    out = raw[off : off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _cases(rng) -> tuple[dict, list]:
    """Every case (name -> a function making one call), and the buffers (pages, aligned caches) the cases
    read.  Only kernel entry points and NumPy: the worker runs under the other build too, so it uses neither the
    benchmark helpers nor onnxkv's allocators, whose interfaces may differ between builds."""
    import numpy as np

    import onnxkv._kernels as K
    from onnxkv._kernels import matmul as MM

    cases, keep = {}, []
    scale = D**-0.5
    q = _line_aligned(rng.standard_normal((1, HQ, 1, D)).astype(np.float32), keep)
    out = _line_aligned(np.zeros_like(q), keep)
    for ctx in CONTEXTS:
        kf = rng.standard_normal((1, HKV, ctx, D)).astype(np.float32)
        vf = rng.standard_normal((1, HKV, ctx, D)).astype(np.float32)
        kl, qp = np.array([ctx], np.int32), np.array([[ctx - 1]], np.int32)
        for dt, npdt in (("f32", np.float32), ("f16", np.float16)):
            k, v = _line_aligned(kf.astype(npdt), keep), _line_aligned(vf.astype(npdt), keep)
            cases[f"dattn_{dt}_{ctx}"] = lambda k=k, v=v, kl=kl, qp=qp: K.attention(
                q, k, v, kl, qp, scale, 0.0, -1, out
            )
            if ctx in PAGED_CONTEXTS:
                table = rng.permutation(-(-ctx // 16)).astype(np.int32)[None, :]
                ka, va = (_page_addresses(x, 16, table, keep) for x in (k, v))
                kvd = "float16" if dt == "f16" else "float32"
                cases[f"paged_{dt}_bs16_{ctx}"] = lambda ka=ka, va=va, t=table, kl=kl, qp=qp, kvd=kvd: (
                    K.paged_attention(q, ka, va, t, 16, HKV, kl, qp, scale, 0.0, -1, out, kv_dtype=kvd)
                )
                cases[f"dattn_{dt}_{ctx}"]()
                want = out.copy()
                cases[f"paged_{dt}_bs16_{ctx}"]()
                if not np.allclose(out, want, rtol=1e-5, atol=1e-6):  # the pages hold the same cache
                    raise SystemExit(f"bench_ab: paged_{dt}_bs16_{ctx} differs from the contiguous cache")
    for kd, n in MATMUL_SHAPES:
        ws = [MM.pack_weight(rng.standard_normal((kd, n), dtype=np.float32)) for _ in range(4)]
        for m in (1, 8, 128):
            x, o = rng.standard_normal((m, kd), dtype=np.float32), np.empty((m, n), np.float32)

            def mm(ws=ws, x=x, o=o):
                for wp in ws:
                    MM.matmul_packed(x, wp, o)

            cases[f"mm_M{m}_{kd}x{n}"] = mm
    f32 = np.float32
    x = rng.standard_normal((64, 4096)).astype(f32)
    g, skip = rng.standard_normal(4096).astype(f32), rng.standard_normal((64, 4096)).astype(f32)
    o1, o2 = np.empty_like(x), np.empty_like(x)
    cases["rms_norm"] = lambda: K.rms_norm(x, g, 1e-6, o1)
    cases["skip_rms_norm"] = lambda: K.skip_rms_norm(x, skip, g, g, 1e-6, o1, o2)
    s = (rng.standard_normal((32, 4096)) * 5).astype(f32)
    so = np.empty_like(s)
    cases["softmax"] = lambda: K.softmax(s, so)
    a, b, ab = (rng.standard_normal(4 * 14336).astype(f32) for _ in range(3))
    cases["silu_mul"] = lambda: K.silu_mul(a, b, ab)
    xr = rng.standard_normal((1, 128, 32, 128)).astype(f32)
    ang = rng.uniform(0, 6.28, (4096, 64))
    cos, sin = np.cos(ang).astype(f32), np.sin(ang).astype(f32)
    pos, xo = np.arange(128, dtype=np.int64)[None] + 1000, np.empty_like(xr)
    cases["rotary"] = lambda: K.rotary_embedding(xr, cos, sin, pos, False, xo)
    S = 512
    qq = rng.standard_normal((1, HQ, S, D)).astype(f32)
    kk, vv = (rng.standard_normal((1, HKV, S, D)).astype(f32) for _ in range(2))
    kl5, qp5, ao = np.array([S], np.int32), np.arange(S, dtype=np.int32)[None], np.empty_like(qq)
    cases["prefill_512"] = lambda: K.attention(qq, kk, vv, kl5, qp5, scale, 0.0, -1, ao)
    return cases, keep


def worker() -> None:
    """The worker loop (run under one build's interpreter): announce the cases, then per stdin line
    ``case threads n`` make one warm-up call and n timed calls, and print their seconds as JSON."""
    import numpy as np

    import onnxkv
    import onnxkv._kernels as K

    cases, keep = _cases(np.random.default_rng(0))
    print(json.dumps({"cases": sorted(cases), "onnxkv": os.path.dirname(onnxkv.__file__), "buffers": len(keep)}))
    sys.stdout.flush()
    for line in sys.stdin:
        name, threads, n = line.split()
        K.set_num_threads(int(threads))
        fn = cases[name]
        fn()
        ts = []
        for _ in range(int(n)):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        print(json.dumps(ts))
        sys.stdout.flush()


class _Side:
    """One build's worker process."""

    def __init__(self, python: str):
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"bench_ab: the worker of {python} did not start (see its error above)")
        self.info = json.loads(line)

    def burst(self, name: str, threads: int, n: int) -> list:
        self.proc.stdin.write(f"{name} {threads} {n}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _pct(xs: list, q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", help="Python interpreter of the environment with the 'before' build")
    ap.add_argument("--after", default=sys.executable, help="... of the 'after' build (default: this one)")
    ap.add_argument("--cases", default="", help="comma-separated name prefixes (default: every case)")
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=60, help="burst pairs per case and thread count")
    ap.add_argument(
        "--restarts", type=int, default=4, help="start the workers anew this many times, sharing the rounds"
    )
    ap.add_argument("--burst-ms", type=float, default=20.0, help="approximate length of one burst")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker()
        return
    if not args.before:
        ap.error("--before is required")
    from _common import emit, machine

    # Two workers per build, started in the order before, after, after, before: a process's speed on a
    # memory-bound case also depends on where its pages landed (the same build measured against itself in
    # one worker each differed by up to 1.4x on one case, the same way every run), so each build's samples
    # pool a first- and a last-started worker.  Where they land changes with every start: one pair of
    # builds measured 0.96-1.05 on a 67 MB cache in four runs of this script.  So the workers are started
    # anew --restarts times, the rounds shared among the starts, and the figures pool every start.
    per_start = max(2, args.rounds // args.restarts)
    acc: dict = {}
    infos: dict = {}
    for _ in range(args.restarts):
        started = [_Side(args.before), _Side(args.after), _Side(args.after), _Side(args.before)]
        sides = {"before": (started[0], started[3]), "after": (started[1], started[2])}
        infos = {k: {x: v for x, v in s[0].info.items() if x != "cases"} for k, s in sides.items()}
        names = [n for n in sides["after"][0].info["cases"] if n in sides["before"][0].info["cases"]]
        prefixes = [p for p in args.cases.split(",") if p]
        names = [n for n in names if not prefixes or any(n.startswith(p) for p in prefixes)]
        for name in names:
            for t in args.threads:
                a = acc.setdefault((name, t), {"before": [], "after": [], "paired": [], "per_start": []})
                if "n" not in a:
                    probe = sides["after"][0].burst(name, t, 3)
                    a["n"] = max(5, min(500, int(args.burst_ms / 1e3 / max(statistics.median(probe), 1e-7))))
                paired = []
                for r in range(per_start):
                    order = ("before", "after") if r % 2 == 0 else ("after", "before")
                    got = {k: sides[k][(r // 2) % 2].burst(name, t, a["n"]) for k in order}
                    for k in order:
                        a[k] += got[k]
                    paired.append(statistics.median(got["after"]) / statistics.median(got["before"]))
                a["paired"] += paired
                a["per_start"].append(statistics.median(paired))
        for side in started:
            side.close()
    results = []
    for (name, t), a in acc.items():
        row = {
            "case": name,
            "threads": t,
            "calls_per_burst": a["n"],
            "before_median_s": statistics.median(a["before"]),
            "after_median_s": statistics.median(a["after"]),
            "ratio_median": statistics.median(a["after"]) / statistics.median(a["before"]),
            "ratio_p10": _pct(a["after"], 0.1) / _pct(a["before"], 0.1),
            "ratio_paired": statistics.median(a["paired"]),
            "paired_per_start": [round(x, 4) for x in a["per_start"]],
            "paired_per_round": [round(x, 4) for x in a["paired"]],
            "samples_s": {"before": a["before"], "after": a["after"]},
        }
        results.append(row)
        print(
            f"{name:22s} t={t} before {row['before_median_s'] * 1e3:8.3f} ms  after/before: median "
            f"{row['ratio_median']:.3f} p10 {row['ratio_p10']:.3f} paired {row['ratio_paired']:.3f} "
            f"(per start {' '.join(f'{x:.3f}' for x in a['per_start'])})",
            file=sys.stderr,
            flush=True,
        )
    doc = {
        "benchmark": "ab_lockstep",
        "machine": machine(),
        "builds": {k: {"python": getattr(args, k), **info} for k, info in infos.items()},
        "config": {
            "rounds": args.rounds,
            "restarts": args.restarts,
            "burst_ms": args.burst_ms,
            "threads": args.threads,
            "heads": [HQ, HKV],
            "head_size": D,
        },
        "results": results,
    }
    emit(doc, args.out)


if __name__ == "__main__":
    main()
