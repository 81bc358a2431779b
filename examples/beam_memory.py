"""Beam search memory: copy-on-write pages vs a cache copied per beam, in bytes and time per step.

Runs ``onnxkv.beam_search`` on the embedded model twice from the same prompt:

* ``cache=onnxkv.CacheConfig("paged", block_size=...)``: the prompt is
  prefilled once and its pages are shared by the beams; a beam reorder permutes
  page tables, and a beam copies a page only when it first writes into one it
  shares (copy-on-write);
* ``cache="tensor"``: the copy-per-beam baseline (as transformers does it): the
  whole cache of every beam is gathered with ``np.take`` at every step.

Bytes copied and cache bytes held per decode step come from a session with the
event log on (``BeamSearchResult.copied_bytes`` and ``committed_bytes``); time per
step comes from a second session with the log off, so recording does not
weigh on it.  Prints a table, writes ``beam_memory.json`` and draws
``beam_memory.png`` (bytes copied, bytes held and milliseconds per step).

Usage: python examples/beam_memory.py [--beams 4] [--prompt-tokens 96] [--new-tokens 24]
       [--block-size 16] [--threads 2] [--out DIR]
"""

from __future__ import annotations

import numpy as np
from _report import new_figure, parser, save, table

import onnxkv
from onnxkv.zoo import embedded

TEXT = "Return a new list of the items of the iterable, sorted by the given key function. "
MODES = {"paged": "copy-on-write pages", "tensor": "copy per beam"}


def prompt(tokens: int) -> np.ndarray:
    """int64 [1, tokens]: BOS, then the bytes of TEXT repeated."""
    ids = embedded.encode(TEXT * (tokens // len(TEXT) + 1))[:tokens]
    return np.array([ids], dtype=np.int64)


def measure(ids: np.ndarray, beams: int, new_tokens: int, block_size: int, threads: int) -> dict:
    """Per mode: bytes copied, bytes held and milliseconds of every decode step, and the best beam's tokens."""
    model = embedded.embedded_model_dir()
    logged = onnxkv.Session(model, threads=threads, events=True)
    timed = onnxkv.Session(model, threads=threads)
    kw = dict(num_beams=beams, max_new_tokens=new_tokens, eos_token_id=[])
    result = {}
    for mode in MODES:
        cache = onnxkv.CacheConfig("paged", block_size=block_size) if mode == "paged" else onnxkv.CacheConfig(mode)
        bytes_run = onnxkv.beam_search(logged, ids, cache=cache, **kw)
        onnxkv.beam_search(timed, ids[:, :8], num_beams=beams, max_new_tokens=2, eos_token_id=[], cache=mode)  # warm-up
        time_run = onnxkv.beam_search(timed, ids, cache=cache, **kw)
        result[mode] = {
            "copied_bytes": bytes_run.copied_bytes,
            "committed_bytes": bytes_run.committed_bytes,
            "step_ms": [s * 1e3 for s in time_run.step_seconds],
            "best_beam": bytes_run.sequences[0, ids.shape[1] :].tolist(),
        }
    return result


def figure(result: dict, beams: int, prompt_tokens: int):
    """Three panels over the decode steps: KiB copied, KiB held, milliseconds."""
    fig = new_figure(13, 3.8)
    axes = fig.subplots(1, 3)
    panels = (
        ("copied_bytes", "cache KiB copied per step", 1 / 1024),
        ("committed_bytes", "cache KiB held", 1 / 1024),
        ("step_ms", "ms per step", 1.0),
    )
    for ax, (key, label, scale) in zip(axes, panels):
        for mode, name in MODES.items():
            values = np.asarray(result[mode][key], dtype=float) * scale
            ax.plot(np.arange(1, values.size + 1), values, marker="o", markersize=3, label=name)
        ax.set_xlabel("decode step")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"beam search, {beams} beams, {prompt_tokens}-token prompt (embedded model)")
    return fig


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per page of the paged cache")
    args = ap.parse_args()
    ids = prompt(args.prompt_tokens)
    per_mode = measure(ids, args.beams, args.new_tokens, args.block_size, args.threads)
    rows = [
        {
            "cache": mode,
            "KiB copied": sum(m["copied_bytes"]) / 1024,
            "KiB held at end": m["committed_bytes"][-1] / 1024,
            "median ms/step": float(np.median(m["step_ms"])),
        }
        for mode, m in per_mode.items()
    ]
    print(table(rows, ["cache", "KiB copied", "KiB held at end", "median ms/step"]))
    result = {
        "example": "beam_memory",
        "beams": args.beams,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "block_size": args.block_size,
        "threads": args.threads,
        "same_best_beam": per_mode["paged"]["best_beam"] == per_mode["tensor"]["best_beam"],
        "modes": per_mode,
    }
    print("wrote", *save(args.out, "beam_memory", result, figure(per_mode, args.beams, args.prompt_tokens)))


if __name__ == "__main__":
    main()
