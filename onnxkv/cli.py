"""The ``onnxkv`` command: ``generate``, ``inspect``, ``report`` and ``config``.

With no MODEL, ``generate`` and ``inspect`` use the embedded default model (a
tiny byte-level Llama trained on English text), so ``onnxkv generate
--prompt "The "`` prints readable text on a fresh install.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from onnx import helper

import onnxkv
from onnxkv.zoo import embedded

__all__ = ["main"]


class _UsageError(Exception):
    """Arguments that do not go together or cannot be used: one line on stderr and exit status 2, as
    argparse's own usage errors."""


def _model_arg(value: str | None) -> str:
    return str(embedded.embedded_model_dir()) if value is None else value


def _prompt_ids(args, model) -> tuple[np.ndarray, bool]:
    """Prompt ids and whether the model is treated as byte-level (for printing text)."""
    byte_level = model.vocab_size is not None and model.vocab_size >= 256 and (args.model is None or args.byte_level)
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            ids = None
        if ids is None or any(not -(2**63) <= i < 2**63 for i in ids):
            raise _UsageError(f"--prompt-ids must be comma-separated token ids, got {args.prompt_ids!r:.80}")
        return np.array([ids], dtype=np.int64), byte_level
    text = args.prompt if args.prompt is not None else "The "
    if model.vocab_size is not None and model.vocab_size < 256:
        raise _UsageError("--prompt needs a byte-level model (vocabulary ≥ 256); use --prompt-ids")
    bos = model.bos_token_id is not None and model.bos_token_id >= 256
    ids = [model.bos_token_id] if bos else []
    ids += list(os.fsencode(text))  # the bytes given, also where they are not UTF-8
    return np.array([ids], dtype=np.int64), True


class _Progress:
    """Progress on stderr for runs of 16 tokens or more.

    On a terminal one line is rewritten every few tokens; otherwise (logs,
    pipes) a line is printed at each quarter of the run.
    """

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled and total >= 16
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.next_quarter = 1

    def __call__(self, step: int, tokens: np.ndarray) -> None:
        if not self.enabled:
            return
        done = step + 1
        rate = done / max(time.perf_counter() - self.t0, 1e-9)
        text = f"  generating {done}/{self.total} tokens ({rate:.1f} tok/s)"
        if self.tty:
            if step % 4 == 0 or done == self.total:
                print("\r" + text, end="", file=sys.stderr, flush=True)
        elif done * 4 >= self.next_quarter * self.total:
            print(text, file=sys.stderr, flush=True)
            while done * 4 >= self.next_quarter * self.total:
                self.next_quarter += 1

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


#: --weights choice -> bits of the MatMulNBits weights.
_WEIGHT_BITS = {"int4": 4, "int8": 8}


def _cmd_generate(args) -> int:
    """Generate with MODEL, or with a copy quantized by ``onnxkv.quantize_weights`` into a temporary folder
    (removed afterwards) when ``--weights`` is given.  A model file's ``genai_config.json`` (which
    ``onnxkv.load`` reads beside it) is copied beside the quantized file."""
    if args.prompt_ids is not None and args.prompt is not None:
        raise _UsageError("give --prompt or --prompt-ids, not both")
    _check_sampling(args)
    _check_events_path(args)
    path = _model_arg(args.model)
    if args.weights is None:
        return _generate(args, path)
    with tempfile.TemporaryDirectory(prefix="onnxkv-weights-") as tmp:
        source = Path(path)
        out = Path(tmp) / ("model" if source.is_dir() else source.name)
        report = onnxkv.quantize_weights(source, out, bits=_WEIGHT_BITS[args.weights])
        if source.is_file() and (source.parent / "genai_config.json").is_file():
            shutil.copyfile(source.parent / "genai_config.json", out.parent / "genai_config.json")
        print(f"weights: {report}")
        return _generate(args, str(out))


def _cache_config(args) -> onnxkv.CacheConfig | None:
    """The ``cache=`` of ``generate`` that --cache, --block-size and --kv-format ask for.

    ``--cache auto`` (the default) leaves the kind to ``generate``, except that
    --block-size and --kv-format imply ``--cache paged`` there.
    """
    kind = None if args.cache == "auto" else args.cache
    if kind is None and (args.block_size is not None or args.kv_format is not None):
        kind = "paged"
    if kind is None:
        return None
    return onnxkv.CacheConfig(kind, block_size=args.block_size, kv_format=args.kv_format)


def _check_sampling(args) -> None:
    """--temperature, --top-k, --top-p and --seed act only with --do-sample: refused without it."""
    given = [
        f"--{n.replace('_', '-')}" for n in ("temperature", "top_k", "top_p", "seed") if getattr(args, n) is not None
    ]
    if given and not args.do_sample:
        raise _UsageError(f"{', '.join(given)} need --do-sample (greedy decoding ignores them)")


def _check_events_path(args) -> None:
    """--events names a file that can be written: checked before the run, not after it."""
    if args.events is None:
        return
    path = Path(args.events)
    if not args.events or path.is_dir() or not path.parent.is_dir():
        raise _UsageError(f"--events must name a file in an existing folder, got {args.events!r}")


def _generate(args, path: str) -> int:
    import psutil

    model = onnxkv.load(path)
    sess = onnxkv.Session(model, threads=args.threads, events=True)
    ids, byte_level = _prompt_ids(args, model)
    progress = _Progress(args.max_new_tokens, not args.quiet)
    res = onnxkv.generate(
        sess,
        ids,
        args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        callback=progress,
        cache=_cache_config(args),
    )
    progress.close()
    new = res.tokens[0].tolist()
    print("ids:", " ".join(str(t) for t in new))
    if byte_level:
        prompt_text = embedded.decode(ids[0].tolist())
        print("text:", prompt_text + embedded.decode(new))
    t = sess.events.totals()
    mb = 1 / (1 << 20)
    rss = psutil.Process().memory_info().rss
    print(
        f"speed: {res.tokens_per_second:.1f} tokens/s decode, prefill {res.prefill_seconds * 1e3:.1f} ms, "
        f"{len(new)} tokens, threads {sess.threads}"
    )
    print(
        f"memory: rss {rss * mb:.1f} MB, allocated {t['allocated_bytes'] * mb:.1f} MB in {t['allocations']} "
        f"allocations, KV copied {t['prefix_copied_bytes'] * mb:.2f} MB prefix + "
        f"{t['append_copied_bytes'] * mb:.2f} MB append, {t['cow_copied_bytes'] * mb:.2f} MB copy-on-write"
    )
    if args.events:
        sess.events.to_json(args.events)
        print(f"events: {len(sess.events)} records written to {args.events}")
    return 0


def _cmd_inspect(args) -> int:
    model = onnxkv.load(_model_arg(args.model))
    sess = onnxkv.Session(model, threads=1)
    print(f"model: {model.path or '<in-memory>'}")
    print(model.convention.describe())
    g = model.proto.graph
    opsets = ", ".join(f"{o.domain or 'ai.onnx'}:{o.version}" for o in model.proto.opset_import)
    print(f"opsets: {opsets}")
    print(
        f"nodes: {len(g.node)} in the graph, {len(sess.plan.nodes)} in the plan "
        f"({sess.plan.folded_nodes} folded at build time)"
    )
    counts = collections.Counter((n.domain or "ai.onnx", n.op_type) for n in g.node)
    print("operators:")
    for (dom, op), c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {c:5d}  {dom}::{op}")
    fb = sess.fallback_nodes
    print(f"fallback nodes (onnx.reference): {len(fb)}" + ("" if not fb else ": " + ", ".join(fb[:20])))
    w = sess.weight_bytes()
    print(
        f"weights: {w.kernels / 2**20:.2f} MiB in kernel layouts, {w.mapped / 2**20:.2f} MiB read from file "
        f"mappings, {w.in_memory / 2**20:.2f} MiB other constants in memory"
    )
    declared = sess.cast_boundary.inputs if sess.cast_boundary is not None else {}
    if declared:
        print(f"cast caches: {len(declared)} float32 pasts held as float16, their Casts moved to the session")
    print("inputs:")
    for gi in sess.plan.inputs:
        held = f" (held as {gi.dtype})" if gi.name in declared else ""
        print(f"  {gi.name}: {declared.get(gi.name, gi.dtype)} {list(gi.shape) if gi.shape is not None else '?'}{held}")
    print("outputs:")
    for o in g.output:
        tt = o.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tt.shape.dim]
        print(f"  {o.name}: {np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))} {dims}")
    if model.genai_config is not None:
        print(
            f"genai_config: max_length={model.max_length} vocab={model.vocab_size} "
            f"bos={model.bos_token_id} eos={model.eos_token_id} pad={model.pad_token_id}"
        )
    return 0


def _cmd_report(args) -> int:
    import importlib.util

    from onnxkv.events import EventLog
    from onnxkv.occupancy import plot_pool, pool_table

    try:
        log = EventLog.from_json(Path(args.events))  # a path, even one starting with "[" or "{"
        pool = pool_table(log)
    except (OSError, ValueError, TypeError, OverflowError) as e:
        print(f"onnxkv report: error: {e}", file=sys.stderr)
        return 2
    rows = log.per_step()
    print(f"events: {len(log)} records in {len(rows)} steps from {args.events}")
    if rows:
        print(log.summary())
        t = log.totals()
        mb = 1 / (1 << 20)
        print(
            f"total: {t['allocations']} allocations, {t['allocated_bytes'] * mb:.3f} MiB allocated, copied "
            f"{t['prefix_copied_bytes'] * mb:.3f} MiB prefix + {t['append_copied_bytes'] * mb:.3f} MiB append + "
            f"{t['cow_copied_bytes'] * mb:.3f} MiB copy-on-write"
        )
    if pool:
        print(pool)
    try:
        have_mpl = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        have_mpl = False
    if args.output is None and args.pool is None:
        if not have_mpl:
            print(
                "onnxkv report: note: matplotlib is not installed, table only "
                "(pip install onnxkv[plot] to draw it with -o FILE.png)",
                file=sys.stderr,
            )
        return 0
    if args.output is not None and not rows:
        print("onnxkv report: error: the log holds no events, nothing to draw", file=sys.stderr)
        return 2
    if args.pool is not None and not pool:
        print(
            "onnxkv report: error: the log holds no engine pool records, no pool to draw (log an Engine's "
            "steps: a batched Engine over a Session built with events=True)",
            file=sys.stderr,
        )
        return 2
    for path, draw in ((args.output, log.plot), (args.pool, lambda p, title: plot_pool(log, p, title=title))):
        if path is None:
            continue
        try:
            draw(path, title=args.title)
        except (ImportError, OSError, ValueError, TypeError, OverflowError) as e:
            print(f"onnxkv report: error: cannot write {path}: {e}", file=sys.stderr)
            return 2
        print(f"figure: {path}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onnxkv", description="KV-cache runtime for ONNX decoder models.")
    p.add_argument("--version", action="version", version=f"onnxkv {onnxkv.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate tokens (default model: the embedded byte-level model)")
    g.add_argument("model", nargs="?", help=".onnx file or GenAI model folder (default: embedded model)")
    g.add_argument("--prompt", help="prompt text (byte-level models); default 'The '")
    g.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    g.add_argument("--byte-level", action="store_true", help="treat MODEL's ids 0-255 as bytes when printing text")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument(
        "--do-sample",
        action="store_true",
        help="sample (with --temperature, --top-k, --top-p, --seed); greedy without it",
    )
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (> 0; default 1.0)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--threads", type=int, default=None)
    g.add_argument(
        "--cache",
        choices=["auto", "contiguous", "paged", "tensor"],
        default="auto",
        help="KV cache kind (onnxkv.CacheConfig): in place (contiguous), paged with copy-on-write "
        "(paged), or graph tensors (tensor); auto: contiguous when the model's cache runs in place",
    )
    g.add_argument("--block-size", type=int, default=None, help="tokens per page (implies --cache paged; default 16)")
    g.add_argument(
        "--kv-format",
        default=None,
        help="cache storage (implies --cache paged unless --cache contiguous): fp32, fp16, bf16 "
        "(GroupQueryAttention models), or page formats: int8 (keys: scale per head, zero point per "
        "channel), int8-kivi "
        "(keys per channel, KIVI), int8-head, int4, residual-int8, residual-int4",
    )
    g.add_argument(
        "--weights",
        choices=sorted(_WEIGHT_BITS),
        default=None,
        help="quantize the float32 MatMul weights first (MatMulNBits, symmetric, blocks of 32), "
        "into a temporary copy of the model",
    )
    g.add_argument("--events", metavar="FILE.json", help="write the storage event log as JSON")
    g.add_argument("--quiet", action="store_true", help="no progress display")
    g.set_defaults(func=_cmd_generate)
    i = sub.add_parser("inspect", help="show the cache convention, operators, fallbacks and I/O of a model")
    i.add_argument("model", nargs="?", help=".onnx file or GenAI model folder (default: embedded model)")
    i.set_defaults(func=_cmd_inspect)
    r = sub.add_parser("report", help="per-step memory table (and figure) of a log from generate --events")
    r.add_argument("events", metavar="RUN.json", help="event log written by 'onnxkv generate --events'")
    r.add_argument(
        "-o",
        "--output",
        metavar="FIGURE",
        help="also draw the figure (.png, .svg, .pdf; needs matplotlib: pip install onnxkv[plot])",
    )
    r.add_argument(
        "--pool",
        metavar="FIGURE",
        help="draw an Engine's page pool over its steps: pages by request, bytes by page format "
        "(the log of an onnxkv.Engine whose session logged events; needs matplotlib)",
    )
    r.add_argument("--title", help="figure title (default: step and event counts and the log's file name)")
    r.set_defaults(func=_cmd_report)
    c = sub.add_parser("config", help="print version, OpenMP, threads and the SIMD level of each kernel family")
    c.set_defaults(func=lambda a: (onnxkv.show_config(), 0)[1])
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader went away (| head): no traceback, and no second error at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (_UsageError, onnxkv.OnnxkvError, OSError, UnicodeError) as e:  # files that cannot be read or written, names
        print(f"onnxkv {args.command}: error: {e!s}".encode(errors="backslashreplace").decode(), file=sys.stderr)
        return 2
