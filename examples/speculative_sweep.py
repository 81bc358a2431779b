"""Speculative decoding sweep: draft length x acceptance x speed-up, draft model vs prompt lookup.

On the embedded model (the target) it generates ``--new-tokens`` greedy tokens
(EOS off) after each prompt three ways: plain ``onnxkv.generate`` (the
baseline), and ``onnxkv.speculative_generate`` with the embedded draft model
proposing, or with prompt lookup (n-grams of the text so far) proposing, for
every draft length of ``--draft-tokens``.  Greedy speculative decoding gives the
baseline's tokens exactly (``identical``); what changes is how many target runs
it takes.  Per case: acceptance rate, target runs, and the speed-up over the
baseline from whole-call wall times (the fastest of ``--repeats`` calls each,
taken in turns so that other load on the machine falls on every case alike).

Prints a table, writes ``speculative_sweep.json`` and draws
``speculative_sweep.png`` (acceptance and speed-up against draft length).

Usage: python examples/speculative_sweep.py [--draft-tokens 1,2,4,8] [--new-tokens 48] [--repeats 2]
       [--threads 2] [--out DIR]
"""

from __future__ import annotations

import time

import numpy as np
from _report import new_figure, parser, save, table

import onnxkv
from onnxkv.zoo import embedded

#: A prompt in the style of the training text, and one whose continuation repeats it (prompt lookup's case).
PROMPTS = {
    "natural": "The context manager is used to ",
    "repetitive": "    def __init__(self):\n        self.x = 1\n" * 4,
}
MODES = ("draft", "lookup")


def fastest(calls: dict, repeats: int) -> tuple[dict, dict]:
    """Call every entry of ``calls`` once to warm up, then ``repeats`` rounds of each in turn.

    Returns (name -> fastest wall seconds, name -> last result).
    """
    last = {name: fn() for name, fn in calls.items()}
    best = {name: float("inf") for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            last[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best, last


def sweep(draft_tokens: list[int], new_tokens: int, repeats: int, threads: int) -> list[dict]:
    """One row per (prompt, mode, draft length): acceptance, runs, speed-up, tokens identical to greedy."""
    target = onnxkv.Session(embedded.embedded_model_dir(), threads=threads)
    draft = onnxkv.Session(embedded.embedded_draft_dir(), threads=threads)
    rows = []
    for prompt_name, text in PROMPTS.items():
        ids = np.array([embedded.encode(text)], dtype=np.int64)
        calls = {("greedy", 0): lambda ids=ids: onnxkv.generate(target, ids, new_tokens, eos_token_id=[])}
        for mode in MODES:
            for k in draft_tokens:
                calls[(mode, k)] = lambda ids=ids, mode=mode, k=k: onnxkv.speculative_generate(
                    target,
                    ids,
                    draft=draft if mode == "draft" else None,
                    num_draft_tokens=k,
                    max_new_tokens=new_tokens,
                    eos_token_id=[],
                )
        seconds, results = fastest(calls, repeats)
        base = results[("greedy", 0)]
        for (mode, k), res in results.items():
            if mode == "greedy":
                continue
            rows.append(
                {
                    "prompt": prompt_name,
                    "mode": mode,
                    "draft_tokens": k,
                    "acceptance": res.acceptance_rate,
                    "proposed": res.proposed,
                    "accepted": res.accepted,
                    "new_tokens": res.new_tokens,
                    "target_runs": res.target_runs,
                    "draft_runs": res.draft_runs,
                    "seconds": seconds[(mode, k)],
                    "greedy_seconds": seconds[("greedy", 0)],
                    "speedup": seconds[("greedy", 0)] / seconds[(mode, k)],
                    "identical": bool(np.array_equal(res.sequences, base.sequences)),
                }
            )
    return rows


def figure(rows: list[dict]):
    """Acceptance rate and speed-up against draft length, one line per (prompt, mode)."""
    fig = new_figure(10, 3.8)
    axes = fig.subplots(1, 2)
    for prompt_name in PROMPTS:
        for mode, style in zip(MODES, ("-o", "--s")):
            line = [r for r in rows if r["prompt"] == prompt_name and r["mode"] == mode]
            ks = [r["draft_tokens"] for r in line]
            label = f"{mode}, {prompt_name} prompt"
            axes[0].plot(ks, [r["acceptance"] for r in line], style, label=label)
            axes[1].plot(ks, [r["speedup"] for r in line], style, label=label)
    axes[0].set_ylabel("acceptance rate")
    axes[0].set_ylim(0, 1.05)
    axes[1].set_ylabel("speed-up over greedy generate")
    axes[1].axhline(1.0, color="grey", linewidth=0.8)
    ks = sorted({r["draft_tokens"] for r in rows})
    for ax in axes:
        ax.set_xlabel("draft tokens per step")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("speculative decoding on the embedded model")
    return fig


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--draft-tokens", default="1,2,4,8", help="comma-separated draft lengths (num_draft_tokens)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2, help="timed calls per case (the fastest counts)")
    args = ap.parse_args()
    ks = [int(k) for k in args.draft_tokens.split(",")]
    rows = sweep(ks, args.new_tokens, args.repeats, args.threads)
    print(table(rows, ["prompt", "mode", "draft_tokens", "acceptance", "target_runs", "speedup", "identical"]))
    result = {
        "example": "speculative_sweep",
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "rows": rows,
    }
    print("wrote", *save(args.out, "speculative_sweep", result, figure(rows)))


if __name__ == "__main__":
    main()
