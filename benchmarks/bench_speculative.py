"""Speculative decoding vs plain greedy generation on the embedded trained model.

Target: the embedded byte-level model (``onnxkv.zoo.embedded``); draft: the
embedded draft model (same vocabulary, trained by the same
``scripts/train_embedded.py --preset draft``).  For each prompt (a natural one
and a repetitive code snippet) it measures, in one process with one thread
setting:

* ``greedy``  -- ``onnxkv.generate`` (greedy, in-place cache): the baseline;
* ``lookup``  -- ``onnxkv.generate.speculative.speculative_generate`` with prompt lookup;
* ``draft``   -- the same with the draft model proposing,
* ``tree``    -- the draft proposing a tree (``tree=(branches, depth)``: its most likely next tokens,
  each continued greedily), verified in one run of the target forked into one row per branch
  (a paged target cache: its page tables are forked),

the first two for every ``--draft-tokens`` value, ``tree`` for every ``--trees`` value.  Every run generates
exactly ``--new-tokens`` tokens (EOS disabled) from the same prompt; a
speculative run must reproduce the baseline's tokens (``identical``).
Samples are whole-call wall times in seconds (prefill included, both sides),
taken in interleaved rounds (every case once per round) so that load from
other processes falls on all cases alike; every case has sessions of its own
(so its compiled steps are its own, as when a user runs that configuration); reported per case: acceptance rate,
proposed/accepted counts, target and draft runs, tokens/s from the median, and
the speed-up over the baseline from the medians and from the minima.

Usage: python benchmarks/bench_speculative.py [--threads 2] [--new-tokens 128]
       [--draft-tokens 2,4,8] [--trees 2x3,3x4] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine, median, versions  # noqa: E402

PROMPTS = {
    "natural": "The ",
    "repetitive": "    def __init__(self):\n        self.x = 1\n" * 5,
}


def interleaved(calls: dict, repeats: int) -> tuple[dict, dict]:
    """Wall seconds of ``repeats`` rounds, each calling every entry of ``calls`` once in turn
    (after one warm-up call each), so load from other processes spreads over all of them.

    Returns (name -> samples, name -> last result).
    """
    results = {name: fn() for name, fn in calls.items()}
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            results[name] = fn()
            samples[name].append(time.perf_counter() - t0)
    return samples, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", default="2,4,8", help="comma-separated num_draft_tokens values")
    ap.add_argument("--trees", default="2x3,3x4", help="comma-separated BRANCHESxDEPTH tree shapes ('' for none)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()

    import onnxkv
    from onnxkv.generate.speculative import speculative_generate
    from onnxkv.zoo import embedded

    ks = [int(k) for k in args.draft_tokens.split(",")]
    trees = [tuple(int(x) for x in t.split("x")) for t in args.trees.split(",") if t]
    n = args.new_tokens

    def sessions():
        """A target and a draft session of their own for one case (its compiled steps are its own, as
        for a user running that configuration)."""
        return (
            onnxkv.Session(embedded.embedded_model_dir(), threads=args.threads),
            onnxkv.Session(embedded.embedded_draft_dir(), threads=args.threads),
        )

    results = []
    for prompt_name, text in PROMPTS.items():
        ids = np.array([embedded.encode(text)], dtype=np.int64)
        target, _ = sessions()
        calls = {("greedy", 0): lambda target=target: onnxkv.generate(target, ids, n, eos_token_id=[])}
        for mode in ("lookup", "draft"):
            for k in ks:
                target, draft = sessions()
                calls[(mode, k)] = lambda mode=mode, k=k, target=target, draft=draft: speculative_generate(
                    target,
                    ids,
                    draft=draft if mode == "draft" else None,
                    num_draft_tokens=k,
                    max_new_tokens=n,
                    eos_token_id=[],
                )
        for tree in trees:
            target, draft = sessions()
            calls[("tree", "x".join(map(str, tree)))] = lambda tree=tree, target=target, draft=draft: (
                speculative_generate(target, ids, draft=draft, max_new_tokens=n, eos_token_id=[], tree=tree)
            )
        samples, last = interleaved(calls, args.repeats)
        base = last[("greedy", 0)]
        base_median, base_min = median(samples[("greedy", 0)]), min(samples[("greedy", 0)])
        for (mode, k), res in last.items():
            med, best = median(samples[(mode, k)]), min(samples[(mode, k)])
            row = {
                "prompt": prompt_name,
                "prompt_tokens": ids.shape[1],
                "mode": mode,
                "num_draft_tokens": k if mode != "tree" else int(k.split("x")[1]),
                "tree": [int(x) for x in k.split("x")] if mode == "tree" else None,
                "new_tokens": res.new_tokens,
                "samples": samples[(mode, k)],
                "median_seconds": med,
                "min_seconds": best,
                "tokens_per_second": res.new_tokens / med,
                "speedup": base_median / med,
                "speedup_min": base_min / best,
            }
            if mode != "greedy":
                row.update(
                    acceptance_rate=res.acceptance_rate,
                    proposed=res.proposed,
                    accepted=res.accepted,
                    target_runs=res.target_runs,
                    draft_runs=res.draft_runs,
                    identical=bool(np.array_equal(res.sequences, base.sequences)),
                )
            results.append(row)
    emit(
        {
            "benchmark": "speculative",
            "machine": machine(),
            "versions": versions(),
            "threads": args.threads,
            "shapes": {
                "new_tokens": n,
                "draft_tokens": ks,
                "trees": [list(t) for t in trees],
                "repeats": args.repeats,
                "target": str(embedded.embedded_model_dir()),
                "draft": str(embedded.embedded_draft_dir()),
                "vocab": sessions()[0].model.vocab_size,
            },
            "results": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
