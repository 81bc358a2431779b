"""Quality of quantized KV pages: greedy decoding per page-format policy vs float32 pages.

Models: the embedded **trained** byte-level model (``onnxkv.zoo.embedded``:
random-weight models have flat next-token distributions, where argmax
agreement says little) and a random-weight small GenAI-builder model
(``onnxkv.zoo.builders.SMALL``).

For every policy of ``onnxkv.cache.policy.POLICIES`` (``--policies``) it
runs, on a paged state with that ``kv_format``:

* free-running greedy decoding for ``--new-tokens`` tokens from the same
  prompt as the float32 reference: ``token_agreement`` is the fraction of
  positions whose token equals the reference's (after a first difference the
  two texts usually part ways, so one flipped near-tie costs every later
  position), ``first_divergence`` the first position that differs (None if
  none);
* teacher-forced decoding on the reference tokens, so the distributions are
  compared position by position: ``forced_argmax_agreement`` = fraction of
  positions whose argmax equals the reference's, ``mean_kl`` = mean over
  positions of KL(p_fp32 || p_policy) in nats, and ``max_logit_diff`` = max
  |logit difference|.

The float32 row lists the reference's near-ties (positions whose top-2 logit
margin is below 0.01, with the margin).

A ``-kc`` suffix on a policy name stores keys with one scale per channel
(``key_channel_scales=True``, the KIVI choice for keys; ``"int8-kivi"``
already does).  ``"int8"`` and ``"residual-int8"`` store keys with one scale
per head and one zero point per channel (``key_channel_zero_points=True``);
``"int8-head"`` is int8 with one scale per head for both planes.

Plus the committed cache bytes at the end of each run.

Free-running agreement is decided by near-ties: where the float32
reference's two best logits differ by less than the policy's logit error,
the policy may pick the other token and every later position differs.  So
each model is run on several prompts (``PROMPTS`` for the trained model,
seeded random prompts for the random model) and, per policy, the summary
gives the mean and minimum of both agreements over the prompts plus, for
every divergence, the reference's top-2 logit margin at that position
(``divergence_margins``).  Prints JSON.

Usage: python benchmarks/bench_kv_quality.py [--new-tokens 128] [--policies int8,int4,...] [--threads 2]
       [--block-size 16] [--prompts 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine, versions  # noqa: E402

DEFAULT_POLICIES = "fp16,bf16,int8,int8-kivi,int8-head,int4,int4-kc,residual-int8,residual-int4,residual-int4-kc"
#: Prompts of the trained byte-level model (the first ``--prompts`` are used).
PROMPTS = (
    "The context manager is used to ",
    "def read_file(path):\n    ",
    "In this tutorial we will learn how ",
    "import numpy as np\n\n",
    "The function returns a list of ",
    "class Node:\n    def __init__(self",
    "To install the package, run ",
    "for i in range(10):\n    ",
)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _policy(name: str | None) -> tuple:
    """(kv_format, key_channel_scales) of a policy name; a ``-kc`` suffix asks for per-channel key scales."""
    if name is not None and name.endswith("-kc"):
        return name[:-3], True
    return name, False


def decode(
    session, prompt: np.ndarray, new_tokens: int, kv_format, forced: np.ndarray | None = None, block_size: int = 16
):
    """Greedy (or teacher-forced on ``forced``) decoding on a paged state: (tokens, logits per step, bytes)."""
    import onnxkv
    from onnxkv.cache.policy import POLICIES
    from onnxkv.generate.feeds import FeedBuilder

    model = session.model
    fmt, channel = _policy(kv_format)
    # The policy objects keep every name's page-conversion meaning ("fp16": full pages converted).
    cache = onnxkv.CacheConfig(
        "paged",
        block_size=block_size,
        kv_format=None if fmt is None else POLICIES[fmt],
        key_layout=onnxkv.KeyLayout.CHANNEL if channel else None,
    )
    state = session.new_state(cache=cache)
    b = FeedBuilder(session.plan.inputs, model, prompt, np.array([prompt.shape[1]]), 0, thread_cache=False)
    feeds, _ = b.first()
    out = state.run(feeds, [model.io.logits])
    tokens, logits = [], []
    for i in range(new_tokens):
        last = out[model.io.logits][0, -1].astype(np.float32)
        logits.append(last)
        tok = int(forced[i]) if forced is not None else int(np.argmax(last))
        tokens.append(tok)
        if i + 1 < new_tokens:
            out = state.run(b.next(np.array([tok]), out), [model.io.logits])
    committed = state.committed_bytes
    state.close()
    return np.array(tokens), np.stack(logits), committed


def evaluate(session, prompt: np.ndarray, new_tokens: int, policies: list[str], block_size: int = 16) -> dict:
    """One prompt: per policy, agreements, KL, logit error and committed bytes against float32 pages."""
    ref_tokens, ref_logits, ref_bytes = decode(session, prompt, new_tokens, None, block_size=block_size)
    ref_logp = _log_softmax(ref_logits)
    top2 = np.sort(ref_logits, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    rows = {
        "fp32": {
            "token_agreement": 1.0,
            "forced_argmax_agreement": 1.0,
            "first_divergence": None,
            "divergence_margin": None,
            "mean_kl": 0.0,
            "max_logit_diff": 0.0,
            "committed_bytes": ref_bytes,
            # near-ties of the reference: positions whose top-2 margin is below 0.01 (a policy whose
            # logit error reaches the margin may flip that token, and free-running texts then part)
            "near_ties": {str(int(i)): round(float(margin[i]), 5) for i in np.flatnonzero(margin < 0.01)},
        }
    }
    for name in policies:
        tokens, _, committed = decode(session, prompt, new_tokens, name, block_size=block_size)
        same = tokens == ref_tokens
        _, forced_logits, _ = decode(session, prompt, new_tokens, name, forced=ref_tokens, block_size=block_size)
        logp = _log_softmax(forced_logits)
        kl = (np.exp(ref_logp) * (ref_logp - logp)).sum(axis=-1)
        first = None if same.all() else int(np.flatnonzero(~same)[0])
        rows[name] = {
            "token_agreement": float(same.mean()),
            "forced_argmax_agreement": float((forced_logits.argmax(-1) == ref_logits.argmax(-1)).mean()),
            "first_divergence": first,
            "divergence_margin": None if first is None else float(margin[first]),
            "mean_kl": float(kl.mean()),
            "max_logit_diff": float(np.abs(forced_logits - ref_logits).max()),
            "median_logit_diff": float(np.median(np.abs(forced_logits - ref_logits).max(axis=-1))),
            "committed_bytes": committed,
            "committed_vs_fp32": committed / ref_bytes,
        }
    return {"prompt_tokens": int(prompt.shape[1]), "new_tokens": new_tokens, "block_size": block_size, "policies": rows}


def summarize(runs: list[dict]) -> dict:
    """Per policy over the prompts of one model: mean/min of both agreements, mean KL, divergence margins."""
    out = {}
    for name in runs[0]["policies"]:
        rows = [r["policies"][name] for r in runs]
        out[name] = {
            "mean_token_agreement": float(np.mean([r["token_agreement"] for r in rows])),
            "min_token_agreement": float(min(r["token_agreement"] for r in rows)),
            "mean_forced_argmax_agreement": float(np.mean([r["forced_argmax_agreement"] for r in rows])),
            "min_forced_argmax_agreement": float(min(r["forced_argmax_agreement"] for r in rows)),
            "mean_kl": float(np.mean([r["mean_kl"] for r in rows])),
            "max_logit_diff": float(max(r["max_logit_diff"] for r in rows)),
            "divergence_margins": [r["divergence_margin"] for r in rows if r["divergence_margin"] is not None],
            "committed_vs_fp32": (
                float(np.mean([r["committed_vs_fp32"] for r in rows])) if "committed_vs_fp32" in rows[0] else None
            ),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--policies", default=DEFAULT_POLICIES)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per page")
    ap.add_argument("--prompts", type=int, default=6, help="prompts of the trained model (random model: a third)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import onnxkv
    from onnxkv.zoo import embedded
    from onnxkv.zoo.builders import SMALL, build_model, save_genai_folder

    policies = [p for p in args.policies.split(",") if p]
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be in [1, {len(PROMPTS)}], got {args.prompts}")
    results = {}
    trained = onnxkv.Session(embedded.embedded_model_dir(), threads=args.threads)
    runs = []
    for text in PROMPTS[: args.prompts]:
        prompt = np.array([embedded.encode(text)], np.int64)
        runs.append({"prompt": text, **evaluate(trained, prompt, args.new_tokens, policies, args.block_size)})
        print(f"embedded_trained: prompt {len(runs)}/{args.prompts} done", file=sys.stderr, flush=True)
    results["embedded_trained"] = {"summary": summarize(runs), "prompts": runs}
    with tempfile.TemporaryDirectory() as d:
        save_genai_folder(build_model("gqa", SMALL, seed=0), SMALL, Path(d))
        small = onnxkv.Session(d, threads=args.threads)
        runs = []
        for seed in range(max(1, args.prompts // 3)):
            prompt = np.random.default_rng(seed).integers(0, SMALL.vocab_size, (1, 64))
            runs.append({"prompt_seed": seed, **evaluate(small, prompt, args.new_tokens, policies, args.block_size)})
        results["small_random"] = {"summary": summarize(runs), "prompts": runs}
    lines = [
        f"{model} {name}: agreement mean {row['mean_token_agreement']:.3f} min {row['min_token_agreement']:.3f}, "
        f"teacher-forced mean {row['mean_forced_argmax_agreement']:.4f} min "
        f"{row['min_forced_argmax_agreement']:.4f}, mean KL {row['mean_kl']:.2e}"
        for model, res in results.items()
        for name, row in res["summary"].items()
    ]
    emit(
        {
            "benchmark": "kv_quality",
            "machine": machine(),
            "versions": versions(),
            "threads": args.threads,
            "block_size": args.block_size,
            "results": results,
        },
        args.out,
        summary=lines,
    )


if __name__ == "__main__":
    main()
