"""Many requests on one engine: throughput and latency of onnxkv.Engine against ONNX Runtime GenAI.

For each concurrency N (default 1, 2, 4, 8, 16), N requests (random prompts
of ``--prompt`` tokens, ``--new-tokens`` greedy tokens each) arrive at times
drawn from a seeded Poisson process of ``--rate`` requests per second (0: all
at once) and run on one ``onnxkv.Engine`` with paged caches: decode rows of
every request in one batched run per step.  Reported per N: aggregate new
tokens per second, its ratio to one request alone on the same engine (the
N = 1 case of the same run), time-to-first-token and inter-token latency
percentiles, and what the cache holds at its peak: committed page bytes, the
bytes of the tokens they hold, internal fragmentation (the unfilled part of
the last page of each request), page-table bytes.  Once per N, untimed
(``probe_engine``): K/V bytes attention reads per decode token, the peak of
the plan's temporaries, and at the most pages held: payload bytes, the page
allocator's committed bytes, page-table and pool-metadata bytes.  The
timed runs call ``Engine.step()`` once per step (to time each token); with
requests arriving together (``--rate 0``, no shared prefix, no bounded pool)
each round also runs the same requests through ``Engine.run()``, whose decode
steps run in C once only decode rows are left
(``onnxkv_engine_run``: new tokens per second from the first ``add_request``).

The peer, side by side in the same process and run: ONNX Runtime GenAI
decoding the same N prompts as one batch (``append_tokens`` of an [N, L]
array; its static batching, all arriving at once) on the same builder-style
folder, and the same N requests one after the other.

Usage:
  python benchmarks/bench_engine.py [--model small|tiny|embedded] [--family gqa|attention|concat]
      [--concurrency 1,2,4,8,16]
      [--prompt 128] [--prompt-spread 0] [--new-tokens 64] [--threads 2] [--rate 0] [--seed 0] [--rounds 3]
      [--shared-prefix 0] [--prefix-arrivals after-first|together] [--no-peer] [--json FILE]
      [--pool-fraction 0.5] [--mixed]
  python benchmarks/bench_engine.py --churn 1000 [--model embedded]

The ratio to one request alone is taken within each round (N = 1 of the same
round) and reported per round and as the median.  Beside it, for requests
arriving together without a shared prefix, ``unbatched_prompts_vs_one_alone``:
the ratio if N prompts cost N times the lone request's prompt and a step of N
rows cost exactly one step of one row (each reads every weight once),
N (P + D) / (N P + D) with P the lone request's time to first token and D the
rest of its run.  It is what batching would give if the prompts gained nothing
from it.  The engine runs waiting prompts together (up to ``max_batch_tokens``
per run), and their products at N times the rows can run faster per token than
one prompt's: on a 2-vCPU AMD EPYC with AVX-512, three runs at N = 8 gave
medians of 4.15-4.85 against 3.39-3.64 for this figure (7 of 9 rounds above
it); on a 2-vCPU Zen 3 with AVX2 only, two runs gave 3.33 and 4.15 against
3.78 and 3.82.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine, median, versions  # noqa: E402


def _folder(tmp: Path, size: str, family: str = "gqa") -> tuple[Path, int]:
    """A model folder with genai_config.json: the embedded model's, or a built GroupQueryAttention
    (``family`` "gqa", the GenAI builder's form), opset-23 Attention ("attention") or Concat export
    ("concat") graph."""
    from dataclasses import replace

    if size == "embedded":
        from onnxkv.zoo import embedded

        return embedded.embedded_model_dir(), 256  # byte ids; the rest are special or unused
    from onnxkv.zoo.builders import SMALL, TINY, build_model, save_genai_folder

    cfg = replace({"tiny": TINY, "small": SMALL}[size], max_length=4096)
    folder = tmp / f"{size}-{family}"
    save_genai_folder(build_model(family, cfg, seed=0), cfg, folder)
    return folder, cfg.vocab_size


def _decode_phase(stamps: dict) -> float | None:
    """Tokens after each request's first per second, from the last first token to the last token."""
    firsts = [v[0] for v in stamps.values() if v]
    later = sum(max(0, len(v) - 1) for v in stamps.values())
    end = max((v[-1] for v in stamps.values() if v), default=None)
    return later / (end - max(firsts)) if firsts and end is not None and end > max(firsts) else None


def _unbatched_prompts(n: int, alone: dict) -> float:
    """The speed-up of N requests arriving together over one alone (``alone``: that request's run on the
    same engine, in the same round) if their prompts cost N times its prompt and a decode step of N rows
    cost exactly one of one row (each reads every weight once): N (P + D) / (N P + D), P its time to first
    token, D the rest of its run.  Where a prompt costs as much as many decode steps, and batching the
    prompts does not make their products faster per token, this keeps the speed-up well below N."""
    wall, prompt = alone["wall_s"], alone["ttft_each_s"][0]
    return n * wall / (n * prompt + (wall - prompt))


def _percentiles(xs) -> dict:
    if not xs:
        return {}
    a = np.asarray(xs)
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}


def _pool_bytes(session, prompts: list[np.ndarray], new_tokens: int, fraction: float | None) -> int | None:
    """``fraction`` of the float32 page bytes the requests need together (pages of 16 tokens), but at least
    what the largest needs alone (each request must fit alone), or None."""
    if not fraction:
        return None
    conv = session.model.convention
    page = 2 * len(conv.layers) * conv.kv_heads * 16 * conv.head_size * 4
    pages = [-(-(p.size + new_tokens) // 16) for p in prompts]
    return int(max(fraction * sum(pages), max(pages)) * page)


def request_options(i: int, mixed: bool, vocab: int) -> dict:
    """``add_request`` keywords of request ``i``: greedy with no end id; with ``mixed``, every other request
    samples (its own temperature, ``top_k`` and seed) and each request has an end id of its own."""
    if not mixed:
        return {"eos_token_id": []}
    own = {"eos_token_id": [vocab - 1 - i % (vocab // 2)]}
    if i % 2:
        own.update(do_sample=True, temperature=0.6 + 0.1 * (i % 7), top_k=20 + i, seed=i)
    return own


def _engine(session, prompts: list[np.ndarray], new_tokens: int, pool_fraction: float | None):
    import onnxkv

    budget = _pool_bytes(session, prompts, new_tokens, pool_fraction)
    return onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=16), max_cache_bytes=budget)


def run_engine(
    session,
    prompts: list[np.ndarray],
    arrivals: np.ndarray,
    new_tokens: int,
    after_first: bool = False,
    pool_fraction: float | None = None,
    options: list[dict] | None = None,
) -> dict:
    """The requests through one Engine, arriving at ``arrivals`` seconds from the start (``after_first``:
    every request but the first arrives once the first has its first token, its prompt cached;
    ``pool_fraction``: the pool's payload bytes bounded to that fraction of what the requests need;
    ``options``: each request's ``add_request`` keywords, default greedy with no end id)."""
    options = options or [{"eos_token_id": []} for _ in prompts]
    engine = _engine(session, prompts, new_tokens, pool_fraction)
    pending = list(range(len(prompts)))
    requests: dict[int, object] = {}
    added: dict[int, float] = {}
    stamps: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    peak = {"committed": 0, "tokens": 0, "rows": 0, "table_bytes": 0}
    t0 = time.perf_counter()
    while pending or engine.active:
        now = time.perf_counter() - t0
        while (
            pending and arrivals[pending[0]] <= now and not (after_first and pending[0] > 0 and not requests[0].tokens)
        ):
            i = pending.pop(0)
            requests[i] = engine.add_request(prompts[i], new_tokens, **options[i])
            added[i] = time.perf_counter()
        if not engine.active:
            time.sleep(max(0.0, arrivals[pending[0]] - now))
            continue
        produced = engine.step()
        t = time.perf_counter()
        for i, r in requests.items():
            if r.id in produced:
                stamps[i].append(t)
        batch = engine._batch
        if batch is not None and batch.batch:
            pool = batch.pool
            committed = pool.live_pages * pool.page_bytes
            if committed > peak["committed"]:
                held = int(batch.lengths.sum())
                peak = {
                    "committed": committed,
                    "tokens": held,
                    "rows": batch.batch,
                    "table_bytes": int(batch.page_tables.nbytes + batch.lengths.nbytes),
                    "live_pages": pool.live_pages,
                    "page_bytes": pool.page_bytes,
                    "block_size": pool.block_size,
                }
    wall = time.perf_counter() - t0
    total = sum(len(r.tokens) for r in requests.values())
    ttft = [stamps[i][0] - added[i] for i in stamps if stamps[i]]
    itl = [b - a for i in stamps for a, b in zip(stamps[i], stamps[i][1:])]
    if peak["committed"]:
        per_token = peak["page_bytes"] / peak["block_size"]
        peak["token_bytes"] = int(peak["tokens"] * per_token)
        peak["fragmentation"] = 1 - peak["token_bytes"] / peak["committed"]
    order = sorted(stamps)
    ttft_each = [stamps[i][0] - added[i] for i in order if stamps[i]]
    prefix, steps = engine.describe()["prefix_cached_pages"], engine.steps
    engine.close()  # its pages' chunks to the process's reserve now, not when the collector finds it
    return {
        "wall_s": wall,
        "new_tokens": total,
        "ttft_each_s": ttft_each,
        "prefix_hit_tokens": [requests[i].prefix_hit_tokens for i in order],
        "prefix": prefix,
        "tokens_per_s": total / wall,
        # tokens after each request's first, per second from the last first token to the end (the decode
        # phase when every request arrives at once; prompts excluded)
        "decode_phase_tokens_per_s": _decode_phase(stamps),
        "ttft_s": _percentiles(ttft),
        "inter_token_s": _percentiles(itl),
        "steps": steps,
        "preemptions": sum(r.preemptions for r in requests.values()),
        "cache_at_peak": peak,
        "tokens": {i: list(requests[i].tokens) for i in requests},
    }


def run_whole(session, prompts: list[np.ndarray], new_tokens: int, options: list[dict]) -> dict:
    """The requests (``options``: their ``add_request`` keywords) added together and run by ``Engine.run()``
    (whose decode steps run in C once only decode rows are left): wall time from the first ``add_request``
    to the end, and new tokens per second."""
    engine = _engine(session, prompts, new_tokens, None)
    t0 = time.perf_counter()
    requests = [engine.add_request(p, new_tokens, **kw) for p, kw in zip(prompts, options, strict=True)]
    engine.run()
    wall = time.perf_counter() - t0
    total = sum(len(r.tokens) for r in requests)
    engine.close()
    return {"wall_s": wall, "new_tokens": total, "tokens_per_s": total / wall, "steps": engine.steps}


def _attended_bytes(pool, tables: np.ndarray, lengths: np.ndarray) -> float:
    """Payload bytes of the first ``lengths[r]`` positions of each row's page table (every plane, each page
    in its own format; a partly filled page by its filled fraction, a page not yet allocated as native)."""
    bs, total = pool.block_size, 0.0
    per_page = pool.sizes.sum(axis=0)
    for table, n in zip(tables, lengths.tolist(), strict=True):
        full, part = divmod(int(n), bs)
        ids = table[:full]
        total += float(per_page[ids[ids >= 0]].sum())
        if part:
            page = int(table[full]) if full < table.size else -1
            total += (float(per_page[page]) if page >= 0 else pool.page_bytes) * part / bs
    return total


def probe_engine(session, prompts: list[np.ndarray], new_tokens: int, pool_fraction: float | None = None) -> dict:
    """One untimed pass of the requests (all arriving at once) with the session's event log on: what a
    cache benchmark owes its reader beyond time.

    - ``attention_bytes_per_token``: K/V payload bytes the decode runs' attention reads per decode token
      (each row's positions in its pages' formats; :func:`_attended_bytes` before each decode run);
    - ``temp_peak_bytes``: the largest live bytes of the plan's temporaries after any node of any run
      (the event log's ``temp_live_max_bytes``);
    - at the step of most live pages: payload bytes, the spare payloads of freed pages the pool keeps,
      the bytes the page allocator holds from the system, page-table and pool-metadata bytes (page
      records and reference counts);
    - the relief events of a bounded pool (``pool_fraction``): pages' conversions and pauses.
    """

    events = session.events
    was = events.enabled
    events.clear()
    events.enabled = True
    try:
        engine = _engine(session, prompts, new_tokens, pool_fraction)
        for p in prompts:
            engine.add_request(p, new_tokens, eos_token_id=[])
        read, decoded, peak = 0.0, 0, {"live_pages": 0}
        while engine.active:
            batch, rows = engine._batch, list(engine._rows)
            if batch is not None and rows:
                lengths = np.array([r._cached + 1 for r in rows])
                read += _attended_bytes(batch.pool, batch.page_tables, lengths)
                decoded += len(rows)
            engine.step()
            batch = engine._batch
            if batch is not None and batch.pool.live_pages > peak["live_pages"]:
                pool = batch.pool
                tables = [batch.page_tables] + [r._state.page_tables for r in engine.active if r._state is not None]
                peak = {
                    "live_pages": pool.live_pages,
                    "payload_bytes": pool.committed_bytes,
                    "spare_bytes": pool.spare_bytes,
                    "allocator_committed_bytes": pool.allocator.stats().committed,
                    "page_table_bytes": int(sum(t.nbytes for t in tables)),
                    "pool_metadata_bytes": int(
                        pool.ptrs.nbytes + pool.formats.nbytes + pool.sizes.nbytes + 8 * pool.core.capacity
                    ),
                }
        engine.close()
        temp = [r["temp_live_max_bytes"] for r in events.per_step() if r["temp_live_max_bytes"] is not None]
        relief = [e.action for e in events if e.action in ("preempt_quantize", "preempt")]
    finally:
        events.enabled = was
        events.clear()
    return {
        "attention_bytes_per_token": read / decoded if decoded else None,
        "decode_tokens": decoded,
        "temp_peak_bytes": max(temp) if temp else None,
        "cache_at_most_pages": peak,
        "preempt_quantize_events": relief.count("preempt_quantize"),
        "preempt_events": relief.count("preempt"),
        "first_relief": relief[0] if relief else None,
    }


def run_churn(session, vocab: int, count: int, seed: int) -> dict:
    """``count`` requests (random prompt and output lengths, 30% sampled, half sharing a 64-token prefix)
    arriving about one per step, 10% aborted at a random step, on a pool of 256 pages, finished ones let go
    after each step (Engine.pop_finished): the process's resident memory after every 100 requests, and the
    pool audit at the end."""
    import psutil

    import onnxkv

    rng = np.random.default_rng(seed)
    proc = psutil.Process()
    engine = onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=16), max_pages=256)
    shared = rng.integers(3, vocab, 64)
    added, rss, aborted, preempted = 0, [], 0, 0
    t0 = time.perf_counter()
    while added < count or engine.active:
        for _ in range(int(rng.poisson(1.0)) if added < count else 0):
            own = rng.integers(3, vocab, int(rng.integers(4, 200)))
            prompt = np.concatenate([shared, own]) if rng.random() < 0.5 else own
            kw = {"do_sample": True, "temperature": 0.8, "seed": added} if rng.random() < 0.3 else {}
            engine.add_request(prompt, int(rng.integers(1, 64)), eos_token_id=[], **kw)
            added += 1
            if added % 100 == 0:
                rss.append({"requests": added, "rss_bytes": proc.memory_info().rss})
        live = engine.active
        if live and rng.random() < 0.1:
            engine.abort(live[int(rng.integers(len(live)))])
            aborted += 1
        engine.step()
        for r in engine.pop_finished():  # a server lets finished requests go
            preempted += r.preemptions
    pool = engine._batch.pool
    pool.audit()
    engine.close()
    after = [x["rss_bytes"] for x in rss[2:]]  # after warm-up (200 requests)
    return {
        "requests": added,
        "aborted": aborted,
        "wall_s": time.perf_counter() - t0,
        "rss": rss,
        "rss_growth_after_warmup_bytes": (max(after) - after[0]) if after else None,
        "pool_audit": "whole",
        "pool_live_pages_after_close": pool.live_pages,
        "preemptions": preempted + sum(r.preemptions for r in engine.pop_finished()),
    }


def run_genai(
    folder: Path, prompts: list[np.ndarray], new_tokens: int, batched: bool, options: list[dict] | None = None
) -> dict | None:
    """ONNX Runtime GenAI on the prompts, as one batch (greedy) or one after the other (each with its
    sampling of ``options``, onnxkv's ``add_request`` keywords; its end ids are not passed)."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        return None
    model = og.Model(str(folder))
    groups = [np.stack(prompts)] if batched else [p[None] for p in prompts]
    options = [{}] if batched else (options or [{} for _ in prompts])
    t0 = time.perf_counter()
    total = 0
    for ids, kw in zip(groups, options, strict=True):
        params = og.GeneratorParams(model)
        sampling = (
            {"do_sample": True, "temperature": kw["temperature"], "top_k": kw["top_k"], "random_seed": kw["seed"]}
            if kw.get("do_sample")
            else {"do_sample": False}
        )
        params.set_search_options(max_length=ids.shape[1] + new_tokens, batch_size=ids.shape[0], **sampling)
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        while not gen.is_done():
            gen.generate_next_token()
        total += sum(len(gen.get_sequence(b)) - ids.shape[1] for b in range(ids.shape[0]))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "new_tokens": total, "tokens_per_s": total / wall}


def _genai_threads(folder: Path, threads: int) -> None:
    import json

    path = folder / "genai_config.json"
    gc = json.loads(path.read_text())
    gc["model"]["decoder"]["session_options"] = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
    gc["search"]["past_present_share_buffer"] = False
    path.write_text(json.dumps(gc, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=["small", "tiny", "embedded"])
    ap.add_argument(
        "--family",
        default="gqa",
        choices=["gqa", "attention", "concat"],
        help="graph form of a built model: GroupQueryAttention (GenAI's; the peers run it), opset-23 "
        "Attention or a past -> Concat -> present export (onnxkv only: GenAI does not run them; the engine "
        "keeps one state per request of a Concat export)",
    )
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument(
        "--prompt-spread",
        type=float,
        default=0.0,
        help="each request's own prompt length drawn (seeded) from [prompt * (1 - spread), prompt]: rows of "
        "different lengths in one batch (0: every prompt --prompt tokens; needs --no-peer, whose batch takes "
        "one length)",
    )
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="tokens every prompt starts with (then --prompt tokens of its own); see --prefix-arrivals",
    )
    ap.add_argument(
        "--pool-fraction",
        type=float,
        default=None,
        help="bound the pool's payload bytes to this fraction of the float32 pages the requests need "
        "(e.g. 0.5): cold pages are quantized, then requests paused",
    )
    ap.add_argument(
        "--prefix-arrivals",
        default="after-first",
        choices=["after-first", "together"],
        help="with --shared-prefix: the others arrive once the first has its first token (after-first), or "
        "all at the times --rate draws (together)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="every concurrency level once per round")
    ap.add_argument(
        "--churn", type=int, default=0, help="instead: this many random requests with aborts (resident memory)"
    )
    ap.add_argument(
        "--prefill-precision",
        default=None,
        choices=["float32", "bf16"],
        help="the session's prefill_precision (bf16: prompt products on bfloat16 operands where the CPU "
        "has AVX-512-BF16; decode stays float32)",
    )
    ap.add_argument(
        "--mixed",
        action="store_true",
        help="every other request samples (its own temperature, top_k and seed) and each has an end id of its "
        "own; the GenAI peer runs them one by one (its batch takes one sampling)",
    )
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not 0 <= args.prompt_spread < 1:
        ap.error(f"--prompt-spread must be in [0, 1), got {args.prompt_spread}")
    if args.prompt_spread and not args.no_peer and args.model != "embedded" and args.family == "gqa":
        ap.error("--prompt-spread needs --no-peer (the GenAI peer's batch takes prompts of one length)")

    import onnxkv

    levels = [int(x) for x in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder, vocab = _folder(Path(tmp), args.model, args.family)
        peers = not args.no_peer and args.model != "embedded" and args.family == "gqa"
        if args.model != "embedded":
            _genai_threads(folder, args.threads)
        session = onnxkv.Session(str(folder), threads=args.threads, prefill_precision=args.prefill_precision)
        rng = np.random.default_rng(args.seed)
        if args.churn:
            res = run_churn(session, vocab, args.churn, args.seed)
            doc = {"benchmark": "engine-churn", "machine": machine(), "versions": versions(), "threads": args.threads}
            growth = res["rss_growth_after_warmup_bytes"]
            emit({**doc, "model": args.model, **res}, args.json, [f"# churn: RSS growth after warm-up {growth} bytes"])
            return
        warm = rng.integers(3, vocab, args.prompt)
        run_engine(session, [warm, warm], np.zeros(2), 4)  # the step's plans, threads and pages warmed
        work = []
        for n in levels:
            shared = rng.integers(3, vocab, args.shared_prefix)
            low = max(1, round(args.prompt * (1 - args.prompt_spread)))
            lengths = rng.integers(low, args.prompt + 1, n) if args.prompt_spread > 0 else [args.prompt] * n
            prompts = [np.concatenate([shared, rng.integers(3, vocab, m)]) for m in lengths]
            gaps = rng.exponential(1 / args.rate, n) if args.rate > 0 else np.zeros(n)
            work.append((n, prompts, np.cumsum(gaps) - gaps[0]))
        cases = [{"concurrency": n, "arrivals_s": arr.tolist(), "rounds": []} for n, _, arr in work]
        options = {n: [request_options(i, args.mixed, vocab) for i in range(n)] for n in levels}
        for case, (_, prompts, _) in zip(cases, work):  # untimed, before the timed rounds
            case["memory"] = probe_engine(session, prompts, args.new_tokens, args.pool_fraction)
        for _ in range(args.rounds):  # every level once per round: a slow minute hits all levels alike
            for case, (n, prompts, arrivals) in zip(cases, work):
                res = run_engine(
                    session,
                    prompts,
                    arrivals,
                    args.new_tokens,
                    args.shared_prefix > 0 and args.prefix_arrivals == "after-first",
                    args.pool_fraction,
                    options[n],
                )
                res.pop("tokens")
                one = {"onnxkv_engine": res}
                if args.rate == 0 and not args.shared_prefix and not args.pool_fraction:
                    one["onnxkv_engine_run"] = run_whole(session, prompts, args.new_tokens, options[n])
                if args.shared_prefix and n > 1:
                    ttft, peak = res["ttft_each_s"], res["cache_at_peak"]
                    own = sum(-(-(p.size + args.new_tokens) // 16) - args.shared_prefix // 16 for p in prompts)
                    one["shared_prefix"] = {
                        "ttft_first_s": ttft[0],
                        "ttft_others_max_s": max(ttft[1:]),
                        "ttft_others_over_first_max": max(ttft[1:]) / ttft[0],
                        "committed_pages_at_peak": peak.get("live_pages"),
                        "prefix_once_plus_own_pages": args.shared_prefix // 16 + own,
                    }
                if peers:
                    if not args.mixed:
                        one["ort_genai_batch"] = run_genai(folder, prompts, args.new_tokens, batched=True)
                    one["ort_genai_one_by_one"] = run_genai(folder, prompts, args.new_tokens, False, options[n])
                case["rounds"].append(one)
        summary = []
        for case in cases:
            rounds = case["rounds"]
            tps = [r["onnxkv_engine"]["tokens_per_s"] for r in rounds]
            case["onnxkv_tokens_per_s_median"] = median(tps)
            line = f"# N={case['concurrency']}: onnxkv engine {median(tps):.1f} tok/s"
            mem = case["memory"]
            read, temp = mem["attention_bytes_per_token"], mem["temp_peak_bytes"]
            line += (  # (no pool figures for one state per request: a Concat export's contiguous caches)
                f" [attention reads {'n/a' if read is None else f'{read / 2**20:.2f}'} MiB/token, temporaries "
                f"peak {'n/a' if temp is None else f'{temp / 2**20:.1f}'} MiB, pool metadata "
                f"{mem['cache_at_most_pages'].get('pool_metadata_bytes', 0) / 2**10:.1f} KiB]"
            )
            if args.pool_fraction:
                pauses = [r["onnxkv_engine"]["preemptions"] for r in rounds]
                line += (
                    f" [pool {args.pool_fraction:g} of need: {mem['preempt_quantize_events']} conversions, "
                    f"{mem['preempt_events']} pauses, first {mem['first_relief']}; pauses per round {pauses}]"
                )
            if levels[0] == 1:  # the ratio within each round, against N = 1 of the same round
                ratios = [t / r1["onnxkv_engine"]["tokens_per_s"] for t, r1 in zip(tps, cases[0]["rounds"])]
                case["speedup_vs_one_alone"] = ratios
                line += f" ({median(ratios):.2f}x one alone; rounds {', '.join(f'{x:.2f}' for x in ratios)})"
                if case["concurrency"] > 1 and args.rate == 0 and not args.shared_prefix:
                    bounds = [_unbatched_prompts(case["concurrency"], r1["onnxkv_engine"]) for r1 in cases[0]["rounds"]]
                    case["unbatched_prompts_vs_one_alone"] = bounds
                    line += f" (unbatched prompts would give {median(bounds):.2f}x)"
                phase = [
                    (r["onnxkv_engine"]["decode_phase_tokens_per_s"], r1["onnxkv_engine"]["decode_phase_tokens_per_s"])
                    for r, r1 in zip(rounds, cases[0]["rounds"])
                ]
                if all(a and b for a, b in phase):
                    case["decode_phase_speedup_vs_one_alone"] = [a / b for a, b in phase]
                    line += f" (decode phase {median([a / b for a, b in phase]):.2f}x)"
            if "shared_prefix" in rounds[0]:
                worst = [r["shared_prefix"]["ttft_others_over_first_max"] for r in rounds]
                sp = rounds[0]["shared_prefix"]
                line += f", TTFT others/first max {', '.join(f'{x:.3f}' for x in worst)}"
                line += f", pages at peak {sp['committed_pages_at_peak']} (prefix once + own {sp['prefix_once_plus_own_pages']})"
            if rounds[0].get("onnxkv_engine_run"):
                whole = [r["onnxkv_engine_run"]["tokens_per_s"] for r in rounds]
                case["onnxkv_engine_run_tokens_per_s_median"] = median(whole)
                line += f", Engine.run() {median(whole):.1f} tok/s (rounds {', '.join(f'{x:.1f}' for x in whole)})"
                if levels[0] == 1 and cases[0]["rounds"][0].get("onnxkv_engine_run"):
                    alone = [r1["onnxkv_engine_run"]["tokens_per_s"] for r1 in cases[0]["rounds"]]
                    case["run_speedup_vs_one_alone"] = [w / a for w, a in zip(whole, alone)]
                    line += f" ({median([w / a for w, a in zip(whole, alone)]):.2f}x one alone)"
            for peer in ("ort_genai_batch", "ort_genai_one_by_one"):
                if rounds[0].get(peer):
                    v = median([r[peer]["tokens_per_s"] for r in rounds])
                    case[f"{peer}_tokens_per_s_median"] = v
                    line += f", {peer} {v:.1f} tok/s"
            summary.append(line)
        doc = {
            "benchmark": "engine",
            "machine": machine(),
            "versions": versions("onnxruntime_genai"),
            "threads": args.threads,
            "model": args.model,
            "family": args.family,
            "prompt": args.prompt,
            "prompt_spread": args.prompt_spread,
            "new_tokens": args.new_tokens,
            "rate_per_s": args.rate,
            "pool_fraction": args.pool_fraction,
            "prefix_arrivals": args.prefix_arrivals if args.shared_prefix else None,
            "prefill_precision": args.prefill_precision or "float32",
            "mixed_sampling": args.mixed,
            "seed": args.seed,
            "rounds": args.rounds,
            "cases": cases,
        }
        emit(doc, args.json, summary, loadavg=True)


if __name__ == "__main__":
    main()
