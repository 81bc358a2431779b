"""Fidelity of ``prefill_precision="bf16"`` against float32: logits of the prompt and greedy agreement.

For each model and prompt, one session runs the prompt in float32 and one with
``prefill_precision="bf16"`` (the products of packed weights with at least
``BF16_MIN_ROWS`` rows on bfloat16-rounded operands, float32 sums; decode
steps float32 in both).  Reported per prompt:

* ``logits_max_abs_diff`` / ``logits_rel_diff``: the prompt's last-position
  logits, largest absolute difference and that over the largest |logit| of
  the float32 run; ``argmax_equal``;
* ``greedy_agreement``: the fraction of ``--new-tokens`` positions where the two
  free-running greedy generations (``onnxkv.generate``, prompt fed whole)
  chose the same id, ``first_divergence`` (None: none) and the float32 run's
  top-2 logit margin there (``divergence_margin``): after a first difference
  the two texts usually part ways, so one flipped near-tie costs every later
  position;
* ``forced_agreement``: teacher-forced on the float32 run's tokens (each
  session's own prompt cache, then the same float32 decode steps), the
  fraction of positions whose argmax equals the float32 token, and
  ``forced_max_logit_diff`` (as ``bench_kv_quality.py`` measures page formats).

Models: the trained embedded model (byte-level, trained on the standard
library's docstrings; prompts are docstrings of standard modules, the bar's
model) and the exporter fixtures of ``tests/data/arch`` (random weights: flat
next-token distributions, so their greedy agreement says little; their logit
differences are the figure there).

Prints JSON (machine, versions, threads, shapes, raw per-prompt figures) and a
summary.  Needs a CPU with AVX-512-BF16 (``onnxkv.kernels.bf16_available()``).

Usage: python benchmarks/bench_bf16_fidelity.py [--threads 2] [--new-tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine, versions  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODULES = ("json", "inspect", "collections", "argparse", "pathlib", "subprocess", "functools", "itertools")
LENGTHS = (64, 192, 360)  # + BOS + 128 new tokens within the embedded model's 512 positions


def forced_logits(session, ids: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Logits [1 + len(tokens), V] (float64): the prompt ``ids`` [1, L] fed whole to a new state (its last
    position), then each of ``tokens`` fed as a decode step."""
    from onnxkv.generate.feeds import FeedBuilder

    name = session.model.io.logits
    b = FeedBuilder(session.plan.inputs, session.model, ids, np.array([ids.shape[1]]), 0, thread_cache=False)
    feeds, _ = b.first()
    rows = []
    with session.new_state() as st:
        out = st.run(feeds, [name])
        rows.append(np.asarray(out[name], np.float64).reshape(-1, out[name].shape[-1])[-1])
        for t in tokens:
            out = st.run(b.next(np.array([int(t)]), out), [name])
            rows.append(np.asarray(out[name], np.float64).reshape(-1, out[name].shape[-1])[-1])
    return np.stack(rows)


def compare(path, prompts, new_tokens: int, threads: int) -> list[dict]:
    import onnxkv

    f32 = onnxkv.Session(path, threads=threads)
    bf16 = onnxkv.Session(path, threads=threads, prefill_precision="bf16")
    rows = []
    for label, ids in prompts:
        ga = onnxkv.generate(f32, ids, new_tokens, prefill_chunk=None).tokens.ravel()
        gb = onnxkv.generate(bf16, ids, new_tokens, prefill_chunk=None).tokens.ravel()
        n = min(ga.size, gb.size)
        diff = np.nonzero(ga[:n] != gb[:n])[0]
        fa, fb = forced_logits(f32, ids, ga[: n - 1]), forced_logits(bf16, ids, ga[: n - 1])
        a, b = fa[0], fb[0]
        top2 = np.sort(fa, axis=1)[:, -2:]
        rows.append(
            {
                "prompt": label,
                "prompt_tokens": int(ids.shape[1]),
                "logits_max_abs_diff": float(np.abs(a - b).max()),
                "logits_rel_diff": float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)),
                "argmax_equal": bool(a.argmax() == b.argmax()),
                "generated": int(n),
                "greedy_agreement": float((ga[:n] == gb[:n]).mean()) if n else None,
                "first_divergence": int(diff[0]) if diff.size else None,
                "divergence_margin": float(top2[diff[0], 1] - top2[diff[0], 0]) if diff.size else None,
                "forced_agreement": float((fb.argmax(axis=1) == ga[:n]).mean()) if n else None,
                "forced_max_logit_diff": float(np.abs(fa - fb).max()),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out")
    args = ap.parse_args()
    import importlib

    from onnxkv.kernels import bf16_available
    from onnxkv.zoo import embedded

    if not bf16_available():
        sys.exit("bench_bf16_fidelity: this CPU has no AVX-512-BF16 (prefill_precision='bf16' is refused)")
    prompts = []
    for mod in MODULES:
        text = importlib.import_module(mod).__doc__ or mod
        for n in LENGTHS:
            ids = np.array([embedded.encode((text * (1 + n // max(len(text), 1)))[:n])], np.int64)
            prompts.append((f"{mod}[:{n}]", ids))
    models = {"embedded": compare(str(embedded.embedded_model_dir()), prompts, args.new_tokens, args.threads)}
    arch = ROOT / "tests" / "data" / "arch"
    rng = np.random.default_rng(0)
    for folder in sorted(p for p in arch.iterdir() if p.is_dir()) if arch.is_dir() else []:
        for sub in sorted(p for p in folder.iterdir() if (p / "model.onnx").is_file()):
            try:
                import onnxkv

                vocab = onnxkv.Session(str(sub)).token_limit
                ids = rng.integers(1, min(vocab, 1000), (1, 200))
                models[f"{folder.name}/{sub.name}"] = compare(str(sub), [("random[:200]", ids)], 32, args.threads)
            except Exception as e:  # a fixture this runtime refuses is named, not fatal
                models[f"{folder.name}/{sub.name}"] = {"error": f"{type(e).__name__}: {e}"}
    emb = models["embedded"]
    summary = [
        f"embedded: greedy agreement {np.mean([r['greedy_agreement'] for r in emb]):.4f} over {len(emb)} prompts "
        f"x {args.new_tokens} tokens (min {min(r['greedy_agreement'] for r in emb):.4f}), first-token argmax equal "
        f"{sum(r['argmax_equal'] for r in emb)}/{len(emb)}, logits rel diff max "
        f"{max(r['logits_rel_diff'] for r in emb):.2e}; teacher-forced agreement "
        f"{np.mean([r['forced_agreement'] for r in emb]):.4f} (min {min(r['forced_agreement'] for r in emb):.4f}); "
        "divergence margins "
        + str([round(r["divergence_margin"], 4) for r in emb if r["divergence_margin"] is not None])
    ]
    for name, rows in models.items():
        if name != "embedded":
            if isinstance(rows, dict):
                summary.append(f"{name}: {rows['error']}")
            else:
                r = rows[0]
                summary.append(
                    f"{name}: logits rel diff {r['logits_rel_diff']:.2e}, argmax equal {r['argmax_equal']}, "
                    f"greedy agreement {r['greedy_agreement']:.3f}, teacher-forced {r['forced_agreement']:.3f}"
                )
    emit(
        {
            "benchmark": "bf16_fidelity",
            "machine": machine(),
            "versions": versions(),
            "threads": args.threads,
            "shapes": {"prompt_lengths": LENGTHS, "modules": MODULES, "new_tokens": args.new_tokens},
            "results": models,
        },
        args.out,
        summary,
    )


if __name__ == "__main__":
    main()
