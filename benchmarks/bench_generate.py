"""End-to-end decode speed and memory: onnxkv vs ONNX Runtime (and ONNX Runtime GenAI).

Models are built by ``onnxkv.zoo`` (random weights, same weights in every
graph form) into a temporary folder; every engine reads the same files.
Engines, each measured in its own subprocess (so peak RSS is its own), one
after the other in the same run, with the same thread count (``--rounds N``
repeats the engines of a case N times, in alternating order, so that a slow
minute of a shared machine falls on all of them):

* ``onnxkv``         -- in-place persistent cache (``Session.new_state``), prompt
                        fed in chunks of 512 tokens like ``onnxkv.generate``, one
                        ``State.run`` per token;
* ``onnxkv-generate`` -- ``onnxkv.generate`` itself (greedy): its decode steps run
                        back to back in C where the model's step is compiled whole
                        (``State.decode_steps``); a sample is one step as the
                        generation reports it (``step_seconds``), and
                        ``decode_wall_per_token_s`` is the whole decode's wall time
                        per token;
* ``onnxkv-f16``     -- the same with the cache stored as float16 (``kv_format="fp16"``;
                        GroupQueryAttention models, opt-in: not in the default set);
* ``onnxkv-paged``   -- the same loop as ``onnxkv`` on a paged cache (``CacheConfig("paged")``, 16-token
                        pages: the cache of beam search and of the engine; opt-in);
* ``onnxkv-paged-f16`` -- ``onnxkv-paged`` with every page stored as float16 (``kv_format="fp16"``, as
                        ``--kv-format fp16`` gives; GroupQueryAttention models, opt-in);
* ``onnxkv-generate-paged`` -- ``onnxkv-generate`` on that paged cache (its steps run in C a page's worth
                        and more per call; opt-in);
* ``onnxkv-tensor``  -- onnxkv with the cache threaded as tensors (past -> present);
* ``ort``            -- ``onnxruntime.InferenceSession`` on the same file, cache
                        threaded as tensors by the same loop;
* ``ort-genai``      -- ONNX Runtime GenAI with ``past_present_share_buffer``
                        (GroupQueryAttention models only; skipped if not installed).

A per-token sample is one decode step as ONNX Runtime GenAI's
``generate_next_token`` does it: choosing the (greedy) token from the last
logits, building the step's feeds and running it (GenAI: the whole call).

Prints JSON: machine, versions, threads, shapes, raw per-token samples,
medians, peak RSS, onnxkv's event-log totals, ratios to each peer.  With
several rounds an engine's ``per_token_s`` pools the samples of every round
(``median_token_s`` is their median, ``peak_rss_bytes`` the largest), its
``rounds`` list keeps each round's median, prefill and peak RSS, and each
ratio also comes per round (``ratio_onnxkv_over_<peer>_per_round``).  Also
reports onnxkv's Python dispatch overhead per node on the tiny model (and with
``--dispatch-model FILE`` on that file too, per plan node and per graph node:
e.g. the ``torch.onnx.export`` of the tiny model, ``scripts/export_torch_small.py
--size tiny``, whose 688 nodes besides Constants the plan folds to 115).

``--torch-model FILE`` runs the ``concat`` cases on that file instead of the
builder's Concat graph: a real ``torch.onnx.export`` of the same model, made by
``scripts/export_torch_small.py`` (its vocabulary is read from the file).

``export-NAME:N`` runs the ``torch.onnx.export`` fixture of transformers' NAME
shipped under ``tests/data/arch/NAME/torch`` (``llama_tied``, ``mistral``,
``qwen2``, ``qwen3``, ``phi3``, ``phi3_partial``, ``smollm3``, ``granite``,
``gemma2``, ``gemma3``; ``export-tiny_llama:N``: ``tests/data/torch_tiny_llama``, an
export of an older transformers), 2-layer random-weight models whose decode
step is mostly per-node work: the graphs users get from the exporter.

``--builder-folder DIR`` enables the cases ``builder-int4:N`` and
``builder-fp32:N``: the ONNX Runtime GenAI model builder's exports of the
small model (``-p int4 -e cpu``: MatMulNBits, block 32, accuracy_level 4;
``-p fp32``), made by ``scripts/export_builder_small.py DIR`` (which needs
torch; the files are not made at run time).  Each is copied into the
temporary folder with the benchmark's thread count and a shared past/present
buffer in its genai_config.json; the case also reports the bytes of weights
read per token (the initializers of the decoder, all read once per step),
each engine's weight bytes per second, and that rate as a fraction of the
machine's read bandwidth measured just before and after the case (best of five
reads of a 256 MiB array with onnxkv's compiled reader, same threads:
``read_bandwidth_gb_per_s``, ``weight_read_fraction``).
``--background-load`` runs every engine of a case once more while one other
process spins on a core (a Python busy loop, started before the engine's
process and stopped after it) and reports that run's per-token samples with
their median, 90th percentile and ``p90_over_quiet_median``: the loaded 90th
percentile over the median of the quiet rounds.
``embedded-gqa:N`` runs the embedded model (``onnxkv.zoo.embedded``, 4 layers,
hidden 128), whose per-token time is mostly per-step overhead.
``small-int8:N`` / ``small-int4:N`` run the small GroupQueryAttention model
after ``onnxkv.quantize_weights`` (8 or 4 bits, block 32, symmetric,
accuracy_level 4): MatMulNBits files ONNX Runtime (GenAI) runs as well.
``small-q4:N`` runs it with 4-bit weights and accuracy_level 0 (float32 activations), as the
``model_q4.onnx`` of Transformers.js repositories (ONNX Runtime's ``MatMul4BitsQuantizer``, symmetric,
blocks of 32, no accuracy level).
``small-dq8:N`` runs it after ONNX Runtime's ``quantize_dynamic`` (int8 weights; DynamicQuantizeLinear,
MatMulInteger and a quantized embedding read through DequantizeLinear).
``small-bnb4:N`` runs it after ONNX Runtime's ``MatMulBnb4Quantizer`` (NF4, blocks of 64: the
``model_bnb4.onnx`` of Transformers.js repositories; float32 activations in both runtimes).
``small-fp16:N`` runs it after ONNX Runtime's float16 converter with float32 inputs and outputs
(``keep_io_types``), as the ``model_fp16.onnx`` of Transformers.js repositories (``small-concatfp16:N``: the
Concat-cache export, the form of those repositories' exports, converted the same way); ``small-q4f16:N`` after
4-bit quantization as ``small-q4`` and then that converter, as their ``model_q4f16.onnx``.
``--batch N`` decodes N prompt rows of the same length together in every engine (one run per step for all
rows; GenAI: ``batch_size`` N, ``append_tokens`` of the [N, L] prompt): the batched decode of ``generate``
and ``State.run`` on contiguous and paged caches; tokens and gaps are row 0's.  With ``--padded`` the rows
are prompts of different lengths: row ``b`` left-padded by ``b * L // (2 N)`` pad ids (ids of the prompt
itself drawn from 1 up, so that no prompt id is the pad id 0), as a batch of real prompts comes;
``onnxkv-generate`` and ``ort`` take it with an ``attention_mask`` whose zeros mark the padding, GenAI as
the padded ids (its batch API takes no mask).  The tokens kept are then the most padded row's (the last), and each
engine also decodes that row alone: ``padded_row_equals_alone`` says whether the batch gave it the row's
own tokens.  (ONNX Runtime GenAI 0.18 does not: on these folders it reads the pad ids as tokens, so its
timing is of the same work but its padded rows' tokens are not the prompt's.)  Only those engines (and
``onnxkv-generate-paged``) run such a batch.
``same_tokens_as_PEER`` compares the first 8 greedy tokens; when they differ,
``first_difference_PEER`` gives the step and onnxkv's top-1 minus top-2 logit
at that step over the standard deviation of its logits (``gap_over_std``).
With int8 activations (accuracy_level 4) the two runtimes round differently,
so a near tie (a gap of a few thousandths of the spread) may go either way;
a large gap there would be a wrong result.

Usage: python benchmarks/bench_generate.py [--threads 2] [--new-tokens 32]
       [--cases small-gqa:128,...,small-int8:128,builder-int4:128,export-qwen2:64] [--engines onnxkv,ort,ort-genai]
       [--torch-model FILE] [--dispatch-model FILE] [--builder-folder DIR] [--rounds 1] [--background-load]
       [--batch 1] [--padded] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine, median, read_rate, run_worker, versions  # noqa: E402

DEFAULT_CASES = (
    "tiny-gqa:128,tiny-gqa:1024,tiny-concat:128,tiny-attention:128,small-gqa:128,small-gqa:1024,small-gqa:4096,"
    "small-concat:4096"
)
DEFAULT_ENGINES = "onnxkv,onnxkv-tensor,ort,ort-genai"
#: onnxkv's in-place engine feeds long prompts in chunks, as onnxkv.generate does by default.
PREFILL_CHUNK = 512
#: The engines whose loop runs a state (warm-up on a state of their own, the prompt in chunks).
STATE_ENGINES = ("onnxkv", "onnxkv-f16", "onnxkv-paged", "onnxkv-paged-f16")


# -- worker side ---------------------------------------------------------------------------------
def peak_rss() -> int:
    """This process's peak resident set (VmHWM; unlike ru_maxrss it is not inherited across fork+exec)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _feed_loop(
    session, prompt: np.ndarray, new_tokens: int, run, thread_cache: bool, chunk: int | None = None, lengths=None,
    row: int = 0,
):  # fmt: skip
    """Prefill (in chunks of ``chunk`` tokens when given, as onnx.generate does) then greedy decode; ``lengths``
    (with no ``chunk``): each row's own length of a left-padded ``prompt``, fed with an attention mask whose
    zeros mark the padding.

    Returns (prefill seconds, per-token seconds, tokens, gaps): row ``row``'s tokens; gaps[i] is its top-1
    minus top-2 logit over the standard deviation of its logits at step i, taken outside the timed part."""
    from onnxkv.generate.feeds import FeedBuilder

    model = session.model
    fetch = [model.io.logits] + (model.convention.present_outputs if thread_cache else [])
    first = prompt.shape[1] if chunk is None else min(chunk, prompt.shape[1])
    lengths = np.full(prompt.shape[0], first) if lengths is None else np.asarray(lengths)
    b = FeedBuilder(session.plan.inputs, model, prompt[:, :first], lengths, 0, thread_cache=thread_cache)
    feeds, _ = b.first()
    t0 = time.perf_counter()
    out = run(feeds, fetch)
    for c0 in range(first, prompt.shape[1], first):
        out = run(b.next(prompt[:, c0 : c0 + first], out), fetch)
    prefill = time.perf_counter() - t0
    samples, tokens, gaps = [], [], []
    for _ in range(new_tokens):
        gaps.append(_top2_gap(out[model.io.logits][row, -1]))
        # timed as GenAI's generate_next_token: choose the token (greedy), build the feeds, run the step
        t0 = time.perf_counter()
        tok = np.argmax(out[model.io.logits][:, -1], axis=-1).astype(np.int64)
        out = run(b.next(tok, out), fetch)
        samples.append(time.perf_counter() - t0)
        tokens.append(int(tok[row]))
    return prefill, samples, tokens, gaps


def _top2_gap(logits: np.ndarray) -> float:
    """Top-1 minus top-2 of a logits row, over the row's standard deviation (how near a tie the argmax is)."""
    top = np.partition(logits.astype(np.float64), -2)[-2:]
    return float((top[1] - top[0]) / max(float(logits.std()), 1e-30))


#: Engines that decode a padded batch (``--padded``).
PADDED_ENGINES = ("onnxkv-generate", "onnxkv-generate-paged", "ort", "ort-genai")


def padded_prompt(prompt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``prompt`` [N, L] (ids >= 1) with row ``b`` left-padded by ``b * L // (2 N)`` pad ids (0): the prompt
    and its attention mask (zeros on the padding)."""
    n, length = prompt.shape
    mask = np.ones_like(prompt)
    for b in range(n):
        mask[b, : b * length // (2 * n)] = 0
    return np.where(mask == 1, prompt, 0), mask


def worker(
    engine: str, path: str, prompt_len: int, vocab: int, new_tokens: int, threads: int, batch: int = 1, padded=False
) -> dict:
    import onnxkv

    prompt = np.random.default_rng(prompt_len).integers(1 if padded else 0, vocab, (batch, prompt_len))
    mask = None
    if padded:
        prompt, mask = padded_prompt(prompt)
    row = batch - 1 if padded else 0  # the row whose tokens are compared
    result: dict = {}
    if engine == "ort-genai":
        import onnxruntime_genai as og

        model = og.Model(path)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=prompt_len + new_tokens + 1, do_sample=False, batch_size=batch)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(prompt)
        prefill = time.perf_counter() - t0
        samples = []
        for _ in range(new_tokens):
            t0 = time.perf_counter()
            gen.generate_next_token()
            samples.append(time.perf_counter() - t0)
        seq = list(gen.get_sequence(row))
        tokens = [int(t) for t in seq[prompt_len : prompt_len + new_tokens + 1]]
        if padded:  # the most padded row alone
            own = prompt[row : row + 1, mask[row] == 1]
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=own.shape[1] + new_tokens + 1, do_sample=False, batch_size=1)
            gen = og.Generator(model, params)
            gen.append_tokens(own)
            for _ in range(new_tokens):
                gen.generate_next_token()
            alone = [int(t) for t in list(gen.get_sequence(0))[own.shape[1] :]]
            result["padded_row_equals_alone"] = alone[:new_tokens] == tokens[:new_tokens]
    elif engine in ("onnxkv-generate", "onnxkv-generate-paged"):
        sess = onnxkv.Session(path, threads=threads)
        if engine == "onnxkv-generate":
            cache = onnxkv.CacheConfig(initial_capacity=prompt_len + new_tokens + 2)
        else:
            cache = onnxkv.CacheConfig("paged")
        onnxkv.generate(sess, prompt[:, -8:], 4, eos_token_id=[], cache=cache)
        t0 = time.perf_counter()
        res = onnxkv.generate(sess, prompt, new_tokens + 1, eos_token_id=[], cache=cache, attention_mask=mask)
        wall = time.perf_counter() - t0
        prefill, samples = res.prefill_seconds, res.step_seconds
        tokens = [int(t) for t in res.tokens[row][:new_tokens]]
        if padded:  # the most padded row alone
            alone = onnxkv.generate(
                sess, prompt[row : row + 1, mask[row] == 1], new_tokens, eos_token_id=[], cache=cache
            )
            result["padded_row_equals_alone"] = alone.tokens[0].tolist() == tokens
        result["decode_wall_per_token_s"] = (wall - prefill) / len(samples)
    else:
        sess = onnxkv.Session(path, threads=threads)
        if engine in ("onnxkv-paged", "onnxkv-paged-f16"):
            state = sess.new_state(cache=onnxkv.CacheConfig("paged", kv_format="fp16" if "f16" in engine else None))
            run, thread_cache = state.run, False
        elif engine in ("onnxkv", "onnxkv-f16"):
            state = sess.new_state(
                cache=onnxkv.CacheConfig(
                    initial_capacity=prompt_len + new_tokens + 1, kv_format="fp16" if engine == "onnxkv-f16" else None
                )
            )
            run, thread_cache = state.run, False
        elif engine == "onnxkv-tensor":
            run, thread_cache = sess.run, True
        else:
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
            peer = ort.InferenceSession(str(sess.model.path), so, providers=["CPUExecutionProvider"])
            # feeds in the model's declared types (a float16 file's float32 pasts, held float16 by onnxkv)
            declared = sess.cast_boundary.inputs if sess.cast_boundary is not None else {}
            run = lambda f, o: dict(  # noqa: E731
                zip(
                    o, peer.run(o, {k: v.astype(declared[k], copy=False) if k in declared else v for k, v in f.items()})
                )
            )
            thread_cache = True
        _feed_loop(
            sess,
            prompt[:, :8],
            2,
            sess.new_state().run if engine in STATE_ENGINES else run,
            thread_cache,
        )
        chunk = PREFILL_CHUNK if engine in STATE_ENGINES else None
        if padded:  # the ort peer: left-padded rows with their mask, as onnxkv-generate takes them
            lengths = mask.sum(axis=1)
            prefill, samples, tokens, gaps = _feed_loop(sess, prompt, new_tokens, run, thread_cache, None, lengths, row)
            own = prompt[row : row + 1, mask[row] == 1]
            alone = _feed_loop(sess, own, new_tokens, run, thread_cache)[2]
            result["padded_row_equals_alone"] = alone == tokens
        else:
            prefill, samples, tokens, gaps = _feed_loop(sess, prompt, new_tokens, run, thread_cache, chunk)
        result["gap_over_std"] = gaps
        result["peak_rss_bytes"] = peak_rss()  # before the event-log session below maps the weights again
        if engine == "onnxkv":
            result["state_committed_bytes"] = state.committed_bytes
            state.close()
            # Event-log totals of a separate short run (recording would perturb the timing above).
            ev_sess = onnxkv.Session(path, threads=threads, events=True)
            ev_state = ev_sess.new_state(cache=onnxkv.CacheConfig(initial_capacity=prompt_len + 9))
            _feed_loop(ev_sess, prompt, 8, ev_state.run, False, PREFILL_CHUNK)
            log = ev_sess.events
            decode_steps = log.steps()[1:]
            per_step = [log.totals(s) for s in decode_steps]
            result["events_per_decode_step"] = {
                k: per_step[-1][k]
                for k in (
                    "allocations",
                    "allocated_bytes",
                    "prefix_copied_bytes",
                    "append_copied_bytes",
                    "cow_copied_bytes",
                )
            }
            cache = [e for e in log if e.action == "cache_write" and e.step == decode_steps[-1]]
            result["events_cache_writes_per_decode_step"] = {
                "allocations": sum(e.allocations for e in cache),
                "prefix_copied_bytes": sum(e.prefix_copied_bytes for e in cache),
                "append_copied_bytes": sum(e.append_copied_bytes for e in cache),
            }
        elif engine == "onnxkv-tensor":
            ev_sess = onnxkv.Session(path, threads=threads, events=True)
            _feed_loop(ev_sess, prompt, 8, ev_sess.run, True)
            t = ev_sess.events.totals(ev_sess.events.steps()[-1])
            result["events_per_decode_step"] = {
                k: t[k] for k in ("allocations", "allocated_bytes", "prefix_copied_bytes", "append_copied_bytes")
            }
    result.setdefault("peak_rss_bytes", peak_rss())
    result.update({"prefill_s": prefill, "per_token_s": samples, "median_token_s": median(samples), "tokens": tokens})
    return result


# -- orchestrator side -------------------------------------------------------------------------


def _pool_rounds(rounds: list[dict]) -> dict:
    """One engine's result over its rounds: the first round's result (event totals, tokens) with the
    per-token samples of every round pooled, their median, the largest peak RSS and a ``rounds`` list
    of each round's median, prefill and peak RSS; the first failure's error if any round failed."""
    failed = [r for r in rounds if "error" in r]
    if failed:
        return failed[0]
    if len(rounds) == 1:
        return rounds[0]
    pooled = dict(rounds[0])
    pooled["per_token_s"] = [s for r in rounds for s in r["per_token_s"]]
    pooled["median_token_s"] = median(pooled["per_token_s"])
    pooled["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in rounds)
    pooled["rounds"] = [{k: r[k] for k in ("median_token_s", "prefill_s", "peak_rss_bytes")} for r in rounds]
    return pooled


def busy_process() -> subprocess.Popen:
    """One process spinning on a core until it is killed (the background load of ``--background-load``)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def loaded_run(worker_args: list, threads: int, quiet: dict) -> dict:
    """One run of an engine (``worker_args``) beside :func:`busy_process`: its per-token samples, their
    median and 90th percentile, and that percentile over ``quiet``'s median per-token time."""
    busy = busy_process()
    try:
        time.sleep(0.2)  # the busy loop is running before the engine starts
        r = run_worker(__file__, worker_args, threads)
    finally:
        busy.kill()
        busy.wait()
    if "error" in r:
        return r
    p90 = float(np.percentile(r["per_token_s"], 90))
    return {
        "per_token_s": r["per_token_s"],
        "median_token_s": r["median_token_s"],
        "p90_token_s": p90,
        "p90_over_quiet_median": p90 / quiet["median_token_s"],
    }


def dispatch_overhead(folder: Path, threads: int, repeats: int = 200) -> dict:
    """µs per node of the Python plan loop alone (no compiled steps): kernels replaced by their recorded outputs."""
    import onnxkv
    from onnxkv.generate.feeds import FeedBuilder

    session = onnxkv.Session(folder, threads=threads, compiled_steps=False)
    plan, model = session.plan, session.model
    b = FeedBuilder(plan.inputs, model, np.arange(1, 17)[None], np.array([16]), 0)
    feeds, _ = b.first()
    out = session.run(feeds)
    feeds = b.next(np.array([1]), out)
    recorded, original = [], plan._steps

    def recorder(run):
        def rec(ins, rt):
            res = run(ins, rt)
            recorded.append(res)
            return res

        return rec

    plan._steps = [(recorder(r), i, o) for r, i, o in original]
    session.run(feeds)
    plan._steps = [((lambda ins, rt, _r=res: _r), i, o) for res, (_, i, o) in zip(recorded, original)]
    try:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan.run(feeds)
            times.append(time.perf_counter() - t0)
    finally:
        plan._steps = original
    n = len(plan.nodes)
    return {"nodes": n, "samples_s": times, "median_run_s": median(times), "us_per_node": median(times) / n * 1e6}


def build(tmp: Path, size: str, family: str, max_length: int, threads: int) -> tuple[Path, int]:
    from dataclasses import replace

    from onnxkv.zoo.builders import SMALL, TINY, build_model, save_genai_folder

    cfg = replace({"tiny": TINY, "small": SMALL}[size], max_length=max_length)
    folder = tmp / f"{size}-{family}-{max_length}"
    if folder.exists():
        return folder, cfg.vocab_size
    model = build_model(family, cfg, seed=0)
    if family == "gqa":
        save_genai_folder(model, cfg, folder)
        _genai_options(folder, threads)
    else:
        import onnx

        folder.mkdir(parents=True)
        onnx.save(model, str(folder / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    return folder, cfg.vocab_size


#: The repository root (the export fixtures live under tests/data).
REPO = Path(__file__).resolve().parents[1]


def export_fixture(name: str) -> Path:
    """The model file of the ``export-NAME`` case (see the module docstring)."""
    if name == "tiny_llama":
        return REPO / "tests" / "data" / "torch_tiny_llama" / "model.onnx"
    return REPO / "tests" / "data" / "arch" / name / "torch" / "model.onnx"


def _genai_options(folder: Path, threads: int) -> None:
    """Set the thread count and the shared past/present buffer in ``folder``'s genai_config.json."""
    cfg_path = folder / "genai_config.json"
    gc = json.loads(cfg_path.read_text())
    gc["model"]["decoder"]["session_options"] = {
        "intra_op_num_threads": threads,
        "inter_op_num_threads": 1,
        "log_id": "onnxruntime-genai",
        "provider_options": [],
    }
    gc["search"]["past_present_share_buffer"] = True
    cfg_path.write_text(json.dumps(gc, indent=1))


def builder_copy(tmp: Path, source: Path, threads: int) -> tuple[Path, int, int]:
    """A copy of the builder folder ``source`` with this run's genai options: (folder, vocabulary, weight
    bytes of the decoder file)."""
    import shutil

    import onnx

    folder = tmp / f"builder-{source.name}"
    if not folder.exists():
        shutil.copytree(source, folder)
        _genai_options(folder, threads)
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    weight_bytes = sum(
        onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize * int(np.prod(t.dims))
        for t in model.graph.initializer
    )
    return folder, exported_vocab(folder / "model.onnx"), weight_bytes


def initializer_bytes(path: Path) -> int:
    """Bytes of the initializers of the model file at ``path`` (its weights read per token)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return sum(
        onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize * int(np.prod(t.dims))
        for t in model.graph.initializer
    )


def quantized_copy(tmp: Path, folder: Path, bits: int, level: int = 4) -> tuple[Path, int]:
    """``folder`` rewritten by onnxkv.quantize_weights (bits, block 32, symmetric, ``level`` the accuracy_level):
    (folder, weight bytes)."""
    import onnxkv

    out = tmp / f"{folder.name}-int{bits}-level{level}"
    if not out.exists():
        onnxkv.quantize_weights(folder, out, bits=bits, block_size=32, accuracy_level=level)
    return out, initializer_bytes(out / "model.onnx")


def rewritten_copy(tmp: Path, folder: Path, suffix: str, write) -> tuple[Path, int]:
    """``folder``'s JSON files and ``write(source model path, new model path)``'s rewrite of its model in
    ``tmp / (folder name + suffix)`` (made once): (folder, weight bytes)."""
    import shutil

    out = tmp / f"{folder.name}{suffix}"
    if not out.exists():
        out.mkdir()
        for f in folder.iterdir():
            if f.suffix == ".json":
                shutil.copy(f, out / f.name)
        write(folder / "model.onnx", out / "model.onnx")
    return out, initializer_bytes(out / "model.onnx")


def dynamic_quantized_copy(tmp: Path, folder: Path) -> tuple[Path, int]:
    """``folder`` with its model rewritten by ONNX Runtime's ``quantize_dynamic`` (int8 weights per tensor;
    MatMul and Gather, as the model_quantized.onnx files of model repositories): (folder, weight bytes)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    def write(source: Path, out: Path) -> None:
        quantize_dynamic(
            str(source),
            str(out),
            weight_type=QuantType.QInt8,
            op_types_to_quantize=["MatMul", "Gather"],
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )

    return rewritten_copy(tmp, folder, "-dq8", write)


def bnb4_copy(tmp: Path, folder: Path) -> tuple[Path, int]:
    """``folder`` with its model's MatMuls rewritten by ONNX Runtime's ``MatMulBnb4Quantizer`` (NF4, blocks
    of 64, as Transformers.js converts its ``model_bnb4.onnx`` files): (folder, weight bytes)."""
    import onnx
    from onnxruntime.quantization.matmul_bnb4_quantizer import MatMulBnb4Quantizer

    def write(source: Path, out: Path) -> None:
        quantizer = MatMulBnb4Quantizer(onnx.load(str(source)), MatMulBnb4Quantizer.NF4, 64)
        quantizer.process()
        onnx.save(quantizer.model.model, str(out), save_as_external_data=True, location=out.name + ".data")

    return rewritten_copy(tmp, folder, "-bnb4", write)


def float16_copy(tmp: Path, folder: Path) -> tuple[Path, int]:
    """``folder`` with its model converted to float16 with float32 inputs and outputs by ONNX Runtime's
    converter (``keep_io_types=True``, as Transformers.js converts its ``model_fp16.onnx``, and its
    ``model_q4f16.onnx`` after 4-bit quantization): (folder, weight bytes)."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    def write(source: Path, out: Path) -> None:
        model = convert_float_to_float16(onnx.load(str(source)), keep_io_types=True)
        onnx.save(model, str(out), save_as_external_data=True, location=out.name + ".data")

    return rewritten_copy(tmp, folder, "-fp16", write)


def exported_vocab(path: Path) -> int:
    """Vocabulary size of a decoder file: the last dimension of its ``logits`` output."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    logits = next(o for o in graph.output if o.name == "logits")
    return logits.type.tensor_type.shape.dim[-1].dim_value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--engines", default=DEFAULT_ENGINES)
    ap.add_argument(
        "--dispatch-model",
        type=Path,
        help="also measure the dispatch overhead on this file, e.g. a torch.onnx.export of the tiny model "
        "(scripts/export_torch_small.py --size tiny): per plan node and per graph node",
    )
    ap.add_argument(
        "--torch-model",
        type=Path,
        help="run the concat cases on this torch.onnx.export file "
        "(scripts/export_torch_small.py) instead of the builder's Concat graph",
    )
    ap.add_argument(
        "--builder-folder",
        type=Path,
        help="folder with int4/ and fp32/ builder exports of the small "
        "model (scripts/export_builder_small.py): enables the builder-int4 and builder-fp32 cases",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each case's engines this many times, alternating their order (default 1)",
    )
    ap.add_argument(
        "--background-load",
        action="store_true",
        help="run each engine once more beside one busy process and report its per-token 90th percentile",
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=1,
        help="prompt rows decoded together (every engine: one run per step for all rows; default 1)",
    )
    ap.add_argument("--out")
    ap.add_argument(
        "--padded",
        action="store_true",
        help="rows of different lengths (left-padded; with --batch >= 2; engines onnxkv-generate, "
        "onnxkv-generate-paged, ort-genai)",
    )
    ap.add_argument(
        "--worker",
        nargs=8,
        metavar=("ENGINE", "PATH", "PROMPT", "VOCAB", "NEW", "THREADS", "BATCH", "PADDED"),
        help=argparse.SUPPRESS,
    )
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds: expected a positive count, got {args.rounds}")
    if args.batch < 1:
        ap.error(f"--batch: expected a positive count, got {args.batch}")
    if args.padded and (args.batch < 2 or set(args.engines.split(",")) - set(PADDED_ENGINES)):
        ap.error(f"--padded: needs --batch >= 2 and engines among {','.join(PADDED_ENGINES)}")
    if args.worker:
        e, p, n, v, new, t, b, padded = args.worker
        print(json.dumps(worker(e, p, int(n), int(v), int(new), int(t), int(b), padded == "1")))
        return
    import onnx
    import onnxruntime

    try:
        import onnxruntime_genai

        genai_version = onnxruntime_genai.__version__
    except ImportError:
        genai_version = None
    engines = args.engines.split(",")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny, _ = build(tmp, "tiny", "gqa", 2048, args.threads)
        overhead = dispatch_overhead(tiny, args.threads)
        print(
            f"# dispatch overhead: {overhead['us_per_node']:.2f} µs/node over {overhead['nodes']} nodes",
            file=sys.stderr,
        )
        dispatch_export = None
        if args.dispatch_model is not None:
            dispatch_export = dispatch_overhead(args.dispatch_model, args.threads)
            graph = onnx.load(str(args.dispatch_model), load_external_data=False).graph
            dispatch_export["file"] = str(args.dispatch_model)
            dispatch_export["graph_nodes"] = sum(n.op_type != "Constant" for n in graph.node)
            dispatch_export["us_per_graph_node"] = (
                dispatch_export["median_run_s"] / dispatch_export["graph_nodes"] * 1e6
            )
            print(
                f"# dispatch overhead of {args.dispatch_model}: {dispatch_export['us_per_node']:.2f} µs per plan node "
                f"({dispatch_export['nodes']}), {dispatch_export['us_per_graph_node']:.3f} µs per graph node "
                f"({dispatch_export['graph_nodes']} besides Constant)",
                file=sys.stderr,
            )
        for case in args.cases.split(","):
            name, plen = case.split(":")
            size, family = name.split("-")
            plen = int(plen)
            max_length = 2048 if plen + args.new_tokens + 64 <= 2048 else 8192
            exported = family == "concat" and args.torch_model is not None
            weight_bytes = None
            if size == "builder":
                if args.builder_folder is None:
                    ap.error(f"case {case}: needs --builder-folder (scripts/export_builder_small.py makes it)")
                folder, vocab, weight_bytes = builder_copy(tmp, args.builder_folder / family, args.threads)
                source = f"ONNX Runtime GenAI builder -p {family} -e cpu ({args.builder_folder / family})"
            elif size == "embedded":
                from onnxkv.zoo import embedded

                folder, vocab, weight_bytes = builder_copy(tmp, embedded.embedded_model_dir(), args.threads)
                weight_bytes = None  # cache resident: no bandwidth figures
                source = "onnxkv.zoo.embedded (the trained embedded model, a GenAI folder)"
            elif exported:
                folder, vocab = args.torch_model, exported_vocab(args.torch_model)
                source = f"torch.onnx.export ({folder})"
            elif size == "export":
                folder = export_fixture(family)
                if not folder.is_file():
                    ap.error(f"case {case}: no fixture {folder}")
                vocab = exported_vocab(folder)
                source = f"torch.onnx.export fixture ({folder.relative_to(REPO)})"
            elif family == "q4":
                base, vocab = build(tmp, size, "gqa", max_length, args.threads)
                folder, weight_bytes = quantized_copy(tmp, base, 4, level=0)
                source = "onnxkv.zoo builder, onnxkv.quantize_weights bits=4 block 32 accuracy_level 0"
            elif family in ("int8", "int4"):
                base, vocab = build(tmp, size, "gqa", max_length, args.threads)
                folder, weight_bytes = quantized_copy(tmp, base, int(family[3:]))
                source = f"onnxkv.zoo builder, onnxkv.quantize_weights bits={family[3:]} block 32 accuracy_level 4"
            elif family == "dq8":
                base, vocab = build(tmp, size, "gqa", max_length, args.threads)
                folder, weight_bytes = dynamic_quantized_copy(tmp, base)
                source = "onnxkv.zoo builder, onnxruntime.quantization.quantize_dynamic QInt8 (MatMul, Gather)"
            elif family == "bnb4":
                base, vocab = build(tmp, size, "gqa", max_length, args.threads)
                folder, weight_bytes = bnb4_copy(tmp, base)
                source = "onnxkv.zoo builder, onnxruntime.quantization MatMulBnb4Quantizer NF4 block 64"
            elif family in ("fp16", "q4f16", "concatfp16"):
                base, vocab = build(tmp, size, "concat" if family == "concatfp16" else "gqa", max_length, args.threads)
                if family == "q4f16":
                    base = quantized_copy(tmp, base, 4, level=0)[0]
                folder, weight_bytes = float16_copy(tmp, base)
                source = "onnxkv.zoo builder, " + (
                    "onnxkv.quantize_weights bits=4 block 32 accuracy_level 0, " if family == "q4f16" else ""
                )
                source += "onnxruntime.transformers.float16 keep_io_types=True"
            else:
                folder, vocab = build(tmp, size, family, max_length, args.threads)
                source = "onnxkv.zoo builder"
            entry = {
                "model": "small" if size == "builder" else size,
                "graph": family,
                "prompt": plen,
                "new_tokens": args.new_tokens,
                "batch": args.batch,
                "padded": args.padded,
                "source": source,
                "engines": {},
            }
            if weight_bytes is not None:
                entry["weight_bytes_read_per_token"] = weight_bytes
            genai_ok = family in ("gqa", "int8", "int4", "q4", "dq8", "bnb4", "fp16", "q4f16") or size == "builder"
            todo = [
                e
                for e in engines
                if not (
                    (e == "ort-genai" and genai_version is None)
                    or (e in ("ort-genai", "onnxkv-f16", "onnxkv-paged-f16") and not genai_ok)
                )
            ]
            runs: dict[str, list[dict]] = {e: [] for e in todo}
            bandwidth = [read_rate(256 << 20, args.threads) / 1e9] if weight_bytes is not None else []
            for rnd in range(args.rounds):
                for engine in todo if rnd % 2 == 0 else todo[::-1]:
                    worker_args = [engine, folder, plen, vocab, args.new_tokens, args.threads, args.batch,
                                   int(args.padded)]  # fmt: skip
                    r = run_worker(__file__, worker_args, args.threads)
                    runs[engine].append(r)
                    if "error" in r:
                        print(f"# {case} {engine}: FAILED {r['error']}", file=sys.stderr)
                        continue
                    print(
                        f"# {case} {engine} (round {rnd + 1}): {r['median_token_s'] * 1e3:.2f} ms/token, "
                        f"prefill {r['prefill_s']:.2f} s, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB",
                        file=sys.stderr,
                    )
            for engine in todo:
                entry["engines"][engine] = _pool_rounds(runs[engine])
            if args.background_load:
                for engine in todo:
                    quiet = entry["engines"][engine]
                    if "error" in quiet:
                        continue
                    loaded = loaded_run(
                        [engine, folder, plen, vocab, args.new_tokens, args.threads, args.batch, int(args.padded)],
                        args.threads,
                        quiet,
                    )
                    quiet["background_load"] = loaded
                    if "error" not in loaded:
                        print(
                            f"# {case} {engine} beside a busy process: median {loaded['median_token_s'] * 1e3:.2f} "
                            f"ms/token, p90 {loaded['p90_token_s'] * 1e3:.2f} ms "
                            f"({loaded['p90_over_quiet_median']:.2f}x the quiet median)",
                            file=sys.stderr,
                        )
            for ours in ("onnxkv", "onnxkv-generate", "onnxkv-paged", "onnxkv-paged-f16", "onnxkv-generate-paged"):
                kv = entry["engines"].get(ours, {})
                for peer in ("ort", "ort-genai", "onnxkv", "onnxkv-tensor", "onnxkv-f16"):
                    p = entry["engines"].get(peer, {})
                    if peer != ours and "median_token_s" in kv and "median_token_s" in p:
                        entry[f"ratio_{ours}_over_{peer}"] = kv["median_token_s"] / p["median_token_s"]
                        entry[f"rss_ratio_{ours}_over_{peer}"] = kv["peak_rss_bytes"] / p["peak_rss_bytes"]
                        if args.rounds > 1:
                            entry[f"ratio_{ours}_over_{peer}_per_round"] = [
                                a["median_token_s"] / b["median_token_s"] for a, b in zip(kv["rounds"], p["rounds"])
                            ]
            kv = entry["engines"].get("onnxkv", {})
            for peer in ("ort", "ort-genai"):
                if "tokens" in kv and "tokens" in entry["engines"].get(peer, {}):
                    mine, theirs = kv["tokens"][:8], entry["engines"][peer]["tokens"][:8]
                    entry[f"same_tokens_as_{peer}"] = mine == theirs
                    step = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
                    if step is not None and "gap_over_std" in kv:
                        entry[f"first_difference_{peer}"] = {"step": step, "gap_over_std": kv["gap_over_std"][step]}
            if weight_bytes is not None:
                bandwidth.append(read_rate(256 << 20, args.threads) / 1e9)
                entry["read_bandwidth_gb_per_s"] = {"before": bandwidth[0], "after": bandwidth[1]}
                for r in entry["engines"].values():
                    if "median_token_s" in r:
                        r["weight_gb_per_s"] = weight_bytes / r["median_token_s"] / 1e9
                        r["weight_read_fraction"] = r["weight_gb_per_s"] / max(bandwidth)
            results.append(entry)
    emit(
        {
            "benchmark": "generate",
            "machine": machine(),
            "versions": {**versions(), "onnxruntime": onnxruntime.__version__, "onnxruntime_genai": genai_version},
            "threads": args.threads,
            "results": results,
            "dispatch_overhead_tiny": overhead,
            "dispatch_overhead_export": dispatch_export,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
