"""Page formats: cache bytes held vs greedy agreement and KL divergence, per page-format policy.

A paged state stores every full page in the format its ``kv_format`` policy
picks (float16, bfloat16, int8, int4, ...).  Each policy is passed as its
policy object, ``onnxkv.cache.policy.POLICIES[name]``, so ``fp16`` and ``bf16``
convert full pages and keep the last page native as the quantized policies do
(the name ``"fp16"`` in a ``CacheConfig`` would store every page fp16 from its
first token).  For each policy and prompt, on the embedded model:

* **agreement**: a paged state with ``CacheConfig("paged", kv_format=POLICIES[policy])`` decodes
  ``--new-tokens`` greedy tokens, one run per token (as ``onnxkv.generate``
  does); agreement is the fraction equal to the float32 pages' tokens at the
  same position (after a first difference the texts usually part, so one
  flipped near-tie costs every later position);
* **KL**: the float32 tokens are fed one at a time to a state of that policy
  (teacher forcing), and the next-token distributions are compared position
  by position: mean KL(p_float32 || p_policy) in nats;
* **bytes held**: the state's ``committed_bytes`` after the last token, and the
  bytes the attention kernel dequantized (``dequantized_bytes`` of the event log).

Prints a table, writes ``page_formats.json`` and draws ``page_formats.png``
(bytes held against agreement and against KL, one point per policy).

Usage: python examples/page_formats.py [--policies fp32,fp16,bf16,int8,int8-kivi,int4] [--new-tokens 64]
       [--prompts 2] [--block-size 16] [--threads 2] [--out DIR]
"""

from __future__ import annotations

import numpy as np
from _report import new_figure, parser, save, table

import onnxkv
from onnxkv.cache.policy import POLICIES
from onnxkv.zoo import embedded

PROMPTS = (
    "The context manager is used to ",
    "def read_file(path):\n    ",
    "Return the number of items in ",
    "class Node:\n    def __init__(self",
)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of float logits [..., V]."""
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def decode(
    session: onnxkv.Session,
    ids: np.ndarray,
    new_tokens: int,
    policy: str | None,
    block_size: int,
    forced: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Greedy decoding of ``new_tokens`` tokens after ``ids`` on a paged state of ``policy``'s page formats,
    or, given ``forced`` tokens, teacher forcing: those tokens are fed whatever the model prefers.

    One token per run after the prompt, so every page is converted when it is full, as in generation.
    Returns (int64 [new_tokens] tokens, float32 [new_tokens, V] logits that chose or predicted each token,
    committed cache bytes after the last token, bytes dequantized by the attention kernel).  The session's
    event log must be on.
    """
    # the policy object (not its name): "fp16" / "bf16" convert full pages only, like the quantized policies
    kv_format = None if policy is None else POLICIES.get(policy, policy)
    state = session.new_state(cache=onnxkv.CacheConfig("paged", block_size=block_size, kv_format=kv_format))
    session.events.clear()
    tokens, logits = [], []
    try:
        out = state.run({"input_ids": ids, "attention_mask": np.ones_like(ids)}, ["logits"])
        for i in range(new_tokens):
            logits.append(out["logits"][0, -1].copy())
            tokens.append(int(forced[i]) if forced is not None else int(np.argmax(logits[-1])))
            if i + 1 < new_tokens:
                feeds = {
                    "input_ids": np.array([[tokens[-1]]], np.int64),
                    "attention_mask": np.ones((1, state.length + 1), np.int64),
                }
                out = state.run(feeds, ["logits"])
        return (
            np.array(tokens),
            np.stack(logits),
            int(state.committed_bytes),
            session.events.totals()["dequantized_bytes"],
        )
    finally:
        state.close()


def evaluate(
    session: onnxkv.Session, policies: list[str], prompts: list[str], new_tokens: int, block_size: int
) -> list[dict]:
    """One row per policy: mean agreement and KL over the prompts, bytes held and dequantized (means).

    The ``"fp32"`` row is the float32 reference itself (agreement 1 and KL 0 by definition).
    """
    per_policy: dict[str, list[dict]] = {p: [] for p in policies}
    for text in prompts:
        ids = np.array([embedded.encode(text)], dtype=np.int64)
        ref_tokens, ref_logits, ref_held, ref_dequantized = decode(session, ids, new_tokens, None, block_size)
        ref_logp = log_softmax(ref_logits)
        for policy in policies:
            if policy == "fp32":
                per_policy[policy].append(
                    {"agreement": 1.0, "kl": 0.0, "held": ref_held, "held_vs_fp32": 1.0, "dequantized": ref_dequantized}
                )
                continue
            tokens = decode(session, ids, new_tokens, policy, block_size)[0]
            _, logits, held, dequantized = decode(session, ids, new_tokens, policy, block_size, forced=ref_tokens)
            kl = (np.exp(ref_logp) * (ref_logp - log_softmax(logits))).sum(axis=-1)
            per_policy[policy].append(
                {
                    "agreement": float((tokens == ref_tokens).mean()),
                    "kl": float(kl.mean()),
                    "held": held,
                    "held_vs_fp32": held / ref_held,
                    "dequantized": dequantized,
                }
            )
    rows = []
    for policy, runs in per_policy.items():
        rows.append(
            {
                "policy": policy,
                "agreement": float(np.mean([r["agreement"] for r in runs])),
                "min_agreement": float(min(r["agreement"] for r in runs)),
                "mean_kl": float(np.mean([r["kl"] for r in runs])),
                "bytes_held": float(np.mean([r["held"] for r in runs])),
                "held_vs_fp32": float(np.mean([r["held_vs_fp32"] for r in runs])),
                "dequantized_bytes": float(np.mean([r["dequantized"] for r in runs])),
            }
        )
    return rows


def figure(rows: list[dict]):
    """Bytes held (KiB) against agreement and against mean KL, one labelled point per policy."""
    fig = new_figure(10, 3.8)
    axes = fig.subplots(1, 2)
    for ax, key, label in (
        (axes[0], "agreement", "greedy agreement with float32 pages"),
        (axes[1], "mean_kl", "mean KL(float32 || policy), nats"),
    ):
        for i, r in enumerate(rows):
            ax.scatter(r["bytes_held"] / 1024, r[key])
            # policies of one size often land on one point: their labels are stacked, not overprinted
            ax.annotate(
                r["policy"],
                (r["bytes_held"] / 1024, r[key]),
                textcoords="offset points",
                xytext=(4, 4 + 9 * (i % 3)),
                fontsize=8,
            )
        ax.set_xlabel("cache KiB held after the last token")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("symlog", linthresh=1e-6)
    fig.suptitle("page-format policies on the embedded model")
    return fig


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument(
        "--policies",
        default="fp32,fp16,bf16,int8,int8-kivi,int4",
        help="comma-separated kv_format policies (fp32: float32 pages, the reference)",
    )
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2, help=f"how many prompts (1..{len(PROMPTS)})")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per page")
    args = ap.parse_args()
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be in [1, {len(PROMPTS)}], got {args.prompts}")
    policies = [p for p in args.policies.split(",") if p]
    session = onnxkv.Session(embedded.embedded_model_dir(), threads=args.threads, events=True)
    rows = evaluate(session, policies, list(PROMPTS[: args.prompts]), args.new_tokens, args.block_size)
    print(table(rows, ["policy", "agreement", "min_agreement", "mean_kl", "bytes_held", "held_vs_fp32"]))
    result = {
        "example": "page_formats",
        "new_tokens": args.new_tokens,
        "prompts": list(PROMPTS[: args.prompts]),
        "block_size": args.block_size,
        "threads": args.threads,
        "rows": rows,
    }
    print("wrote", *save(args.out, "page_formats", result, figure(rows)))


if __name__ == "__main__":
    main()
