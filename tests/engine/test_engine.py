"""onnxkv.Engine: requests of different lengths, joining at different steps, each token for token what
``generate`` makes for it alone (greedy and sampled, contiguous and paged caches), within the per-step
token budget, with streaming, EOS, abort, and runs that fail leaving their request as before."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import onnxkv
from onnxkv.errors import InputError, StateError
from onnxkv.runtime.state import State
from onnxkv.zoo import embedded
from onnxkv.zoo.builders import build_model
from onnxkv.zoo.concat import build_concat_model
from onnxkv.zoo.config import MICRO, TINY

MODEL = str(embedded.embedded_model_dir())
PROMPTS = [
    "def main():\n    ",
    "Return the number of items in the sequence. " * 6,
    "x",
    'class Stack:\n    """A last-in, first-out container."""\n',
]


@pytest.fixture(scope="module")
def session():
    return onnxkv.Session(MODEL, threads=1, events=True)


def _ids(text: str) -> np.ndarray:
    return np.array(embedded.encode(text), np.int64)


def _count_runs(monkeypatch) -> dict:
    """Count State.run calls from now on (until monkeypatch.undo()): {"n": runs}."""
    runs = {"n": 0}
    real = State.run

    def counted(self, feeds, output_names=None, cancel=None, logits_at=None, **kw):
        runs["n"] += 1
        return real(self, feeds, output_names, cancel, logits_at, **kw)

    monkeypatch.setattr(State, "run", counted)
    return runs


def _alone(session, request, cache, **sampling) -> list[int]:
    out = onnxkv.generate(
        session, request.prompt[None], request.max_new_tokens, cache=cache, prefill_chunk=request.chunk,
        eos_token_id=request.eos, **sampling,
    )  # fmt: skip
    return out.tokens[0].tolist()


@pytest.mark.parametrize("cache", ["contiguous", onnxkv.CacheConfig("paged", block_size=16)], ids=["contig", "paged"])
@pytest.mark.parametrize("budget", [2048, 40])
def test_requests_joining_at_different_steps_equal_generate_alone(session, cache, budget):
    engine = onnxkv.Engine(session, cache=cache, max_batch_tokens=budget)
    sampling = [{}, {"do_sample": True, "temperature": 0.8, "seed": 7}, {}, {"do_sample": True, "top_k": 5, "seed": 1}]
    limits = [25, 18, 30, 12]
    requests = [engine.add_request(_ids(PROMPTS[0]), limits[0], **sampling[0])]
    engine.step()
    engine.step()
    requests.append(engine.add_request(_ids(PROMPTS[1]), limits[1], **sampling[1]))
    requests.append(engine.add_request(_ids(PROMPTS[2]), limits[2], **sampling[2]))
    for _ in range(5):
        engine.step()
    requests.append(engine.add_request(_ids(PROMPTS[3]), limits[3], **sampling[3]))
    assert engine.run() == requests
    for r, kw, n in zip(requests, sampling, limits, strict=True):
        assert r.finished in ("length", "eos") and r.state is None
        assert r.tokens == _alone(session, r, cache, **kw)
        assert len(r.tokens) == n or r.finished == "eos"
    assert requests[1].chunk == min(budget, session.prompt_chunk(cache if cache != "contiguous" else None))


def test_the_budget_bounds_each_step_and_no_prompt_waits_two_steps(session):
    engine = onnxkv.Engine(session, max_batch_tokens=24)
    session.events.clear()
    decoders = [engine.add_request(_ids("ab"), 40) for _ in range(3)]
    engine.step()  # their prompts: 3 tokens each
    long = engine.add_request(_ids(PROMPTS[1]), 5)
    assert long.chunk == 24
    last_done, waited = 0, 0
    while long.prompt_done < long.prompt.size:
        engine.step()
        waited = waited + 1 if long.prompt_done == last_done else 0
        assert waited <= 1
        last_done = long.prompt_done
    steps = [e for e in session.events if e.action == "engine_step"]
    assert steps and all(e.extra["tokens_fed"] <= 24 for e in steps)
    assert all(len(d.tokens) >= 2 for d in decoders)
    engine.run()
    assert long.tokens == _alone(session, long, None)


def test_eos_ends_a_request_with_its_eos_token(session):
    engine = onnxkv.Engine(session)
    probe = engine.add_request(_ids(PROMPTS[0]), 10)
    engine.run()
    eos = probe.tokens[4]
    r = engine.add_request(_ids(PROMPTS[0]), 10, eos_token_id=eos)
    engine.run()
    assert r.finished == "eos" and r.tokens[-1] == eos and r.tokens == probe.tokens[: probe.tokens.index(eos) + 1]


def test_stream_yields_each_token_as_it_is_made_and_steps_the_others(session):
    engine = onnxkv.Engine(session)
    a = engine.add_request(_ids(PROMPTS[0]), 12)
    b = engine.add_request(_ids(PROMPTS[3]), 30)
    got = []
    for i, token in enumerate(a.stream()):
        got.append(token)
        assert len(a.tokens) == i + 1  # one step per token
    assert got == a.tokens and a.finished == "length"
    assert len(b.tokens) == 12 and b.finished is None
    assert list(b.stream()) == b.tokens and b.finished == "length"
    assert list(b.stream()) == []  # everything was read


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_abort_releases_the_state_and_the_others_go_on(session, cache):
    engine = onnxkv.Engine(session, cache=cache)
    a = engine.add_request(_ids(PROMPTS[1]), 50)
    b = engine.add_request(_ids(PROMPTS[0]), 20)
    for _ in range(3):
        engine.step()
    state = a.state
    assert state is not None and state.committed_bytes > 0
    rows, held = state.batch, state.committed_bytes
    engine.abort(a)
    assert a.finished == "aborted" and a.state is None
    if cache == "paged":  # one batched state: a's row left it, its pages went back
        assert state is b.state and state.batch == rows - 1 == 1 and state.committed_bytes < held
    else:
        assert state.closed
    n = len(a.tokens)
    engine.run()
    assert len(a.tokens) == n and b.finished == "length"
    assert b.tokens == _alone(session, b, cache)
    engine.abort(a)  # finished: nothing to do
    assert a.finished == "aborted"
    with pytest.raises(InputError, match="Engine.abort: expected a Request of this engine"):
        onnxkv.Engine(session).abort(b)


def test_a_failed_run_leaves_its_request_as_before(session, monkeypatch):
    engine = onnxkv.Engine(session, cache="contiguous")
    a = engine.add_request(_ids(PROMPTS[0]), 15)
    b = engine.add_request(_ids(PROMPTS[3]), 15)
    for _ in range(4):
        engine.step()
    real, calls = State.run, {"n": 0}

    def fails_once(self, feeds, output_names=None, cancel=None, logits_at=None, **kw):
        calls["n"] += 1
        if calls["n"] == 2:  # b's run in this step
            raise MemoryError("State.run: no memory")
        return real(self, feeds, output_names, cancel, logits_at, **kw)

    monkeypatch.setattr(State, "run", fails_once)
    before = (len(a.tokens), len(b.tokens), b.state.length)
    with pytest.raises(MemoryError):
        engine.step()
    assert (len(a.tokens), len(b.tokens), b.state.length) == (before[0] + 1, before[1], before[2])
    engine.run()
    assert a.tokens == _alone(session, a, None) and b.tokens == _alone(session, b, None)


def test_a_failed_first_run_closes_the_new_state(session, monkeypatch):
    engine = onnxkv.Engine(session)
    r = engine.add_request(_ids(PROMPTS[0]), 5)

    def fails(self, feeds, output_names=None, cancel=None, logits_at=None, **kw):
        raise MemoryError("State.run: no memory")

    with monkeypatch.context() as m:
        m.setattr(State, "run", fails)
        with pytest.raises(MemoryError):
            engine.step()
    assert r.state is None and r.prompt_done == 0
    engine.run()
    assert r.tokens == _alone(session, r, None)


@pytest.fixture(scope="module")
def attention_session():
    """An opset-23 Attention graph: its state, not the feeds, says where a run writes."""
    return onnxkv.Session(build_model("attention", TINY, seed=11), threads=1)


@pytest.mark.parametrize("graph", ["gqa", "attention"])
@pytest.mark.parametrize("cache", ["contiguous", onnxkv.CacheConfig("paged", block_size=16)], ids=["contig", "paged"])
@pytest.mark.parametrize("fail_at", [(1,), (2, 3), (4,), (6, 7, 8), (11,)])
def test_a_token_choice_that_raises_leaves_every_request_as_before(
    session, attention_session, graph, cache, fail_at, monkeypatch
):
    """The choice after a run (a sampling kernel's MemoryError) used to leave its requests half-advanced:
    a prompt marked done with no token (its next step then failed), earlier rows of a decode run with
    their token and sampled ones' streams a draw ahead.  Now no request of the run moves on, streams go
    back, and a later step runs them again: every request ends with the tokens it makes alone.  The choice
    is made before the run is committed, which it undoes: an Attention graph's state, which places a
    run's keys after what it holds, then writes the same positions again."""
    import onnxkv.engine.request as request_module

    session = session if graph == "gqa" else attention_session

    real, calls = request_module.select_next, {"n": 0}

    def fails_at(logits, cfg):
        calls["n"] += 1
        if calls["n"] in fail_at:
            if not cfg.greedy:
                cfg.rng.random(logits.shape[0])  # as the kernel's caller draws before the kernel fails
            raise MemoryError("sample: could not allocate the workspace")
        return real(logits, cfg)

    monkeypatch.setattr(request_module, "select_next", fails_at)
    engine = onnxkv.Engine(session, cache=cache)
    sampling = [{}, {"do_sample": True, "temperature": 0.8, "seed": 3}, {}, {"do_sample": True, "top_k": 7, "seed": 5}]
    prompts = [_ids(PROMPTS[0]), _ids(PROMPTS[3]), _ids("abcd"), _ids("wxyz")]  # the last two: one group run
    prompts = [p % session.model.vocab_size for p in prompts]
    requests = [engine.add_request(p, 9, **kw) for p, kw in zip(prompts, sampling, strict=True)]
    failures = 0
    while engine.active:
        try:
            engine.step()
        except MemoryError:
            failures += 1
            # no request is left with its prompt done and no token (its next step used to fail on that)
            assert all(r.tokens or r.prompt_done < r.prompt.size for r in requests)
    assert failures == len(fail_at)
    for r, kw in zip(requests, sampling, strict=True):
        assert r.tokens == _alone(session, r, cache, **kw)
    if engine.batched:
        engine._batch.pool.audit()
    engine.close()


def test_zero_new_tokens_and_describe(session):
    engine = onnxkv.Engine(session, cache="contiguous", max_batch_tokens=100)
    r = engine.add_request(_ids("abc"), 0)
    assert r.finished == "length" and engine.active == [] and engine.step() == {}
    d = engine.describe()
    assert d["cache"] == "contiguous" and d["max_batch_tokens"] == 100 and d["requests"] == 1
    assert "not batched" in d["batching"]


def test_the_default_cache_batches_where_the_graph_takes_a_length_per_row(session, tmp_path):
    """Engine(session) with no cache: one page pool with batched decode rows and prefix caching on a
    GroupQueryAttention graph; contiguous caches, one state per request, on a past -> Concat -> present
    export, whose graph takes one length per batch."""
    import onnx

    engine = onnxkv.Engine(session)
    d = engine.describe()
    assert engine.batched and d["cache"] == "paged" and d["prefix_caching"]
    requests = [engine.add_request(_ids(p), 6) for p in PROMPTS[:2]]
    engine.run()
    assert engine._batch is not None and engine._prefix is not None
    for r in requests:
        assert r.tokens == _alone(session, r, None)
    engine.close()
    onnx.save(build_concat_model(MICRO), tmp_path / "model.onnx")
    concat = onnxkv.Engine(onnxkv.Session(str(tmp_path / "model.onnx"), threads=1))
    assert not concat.batched and concat.describe()["cache"] == "contiguous"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt_ids": [[1, 2], [3, 4]]}, "prompt_ids must be one sequence"),
        ({"prompt_ids": []}, "input_ids must be"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": 0.0, "do_sample": True}, "temperature"),
        ({"max_new_tokens": 10**6}, "exceeds the model's max_length"),
        ({"eos_token_id": -3}, "eos_token_id"),
    ],
)
def test_bad_requests_are_refused_and_nothing_is_queued(session, kwargs, message):
    engine = onnxkv.Engine(session)
    args = {"prompt_ids": [1, 2, 3], "max_new_tokens": 4, **kwargs}
    with pytest.raises(InputError, match=message):
        engine.add_request(**args)
    assert engine.requests == []


def test_pop_finished_lets_finished_requests_go(session):
    engine = onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=16))
    short, long = engine.add_request(_ids("ab"), 1), engine.add_request(_ids("cd"), 6)
    assert engine.pop_finished() == []
    engine.step()
    assert short.finished == "length" and long.finished is None
    assert engine.pop_finished() == [short] and engine.requests == [long]
    later = engine.add_request(_ids("ef"), 2)
    assert later.id == 2 and engine.describe()["requests"] == 3
    assert engine.run() == [long, later] and engine.pop_finished() == [long, later] and engine.requests == []
    assert long.tokens == _alone(session, long, onnxkv.CacheConfig("paged", block_size=16))


def test_bad_engines_are_refused(session):
    with pytest.raises(InputError, match="Engine: session must be an onnxkv.Session"):
        onnxkv.Engine(MODEL)
    with pytest.raises(InputError, match="max_batch_tokens"):
        onnxkv.Engine(session, max_batch_tokens=0)
    with pytest.raises(InputError, match="cache"):
        onnxkv.Engine(session, cache="tensor")
    with pytest.raises(InputError, match=r"preempt_formats must step down.*\['int4', 'int8'\]"):
        onnxkv.Engine(session, preempt_formats=("int4", "int8"))
    with pytest.raises(InputError, match="preempt_formats must be a sequence of page format names, got 'int8'"):
        onnxkv.Engine(session, preempt_formats="int8")
    with pytest.raises(InputError, match="unknown page format 'int3'"):
        onnxkv.Engine(session, preempt_formats=("int3",))
    attention = onnxkv.Session(build_model("attention", TINY, seed=11), threads=1)
    with pytest.raises(InputError, match="Engine: the cache does not suit this model: .*GroupQueryAttention"):
        onnxkv.Engine(attention, cache=onnxkv.CacheConfig("paged", kv_format="fp16"))  # used to fail at every step
    for bound in (0, False, -1):  # 0 and False used to mean no bound, silently
        with pytest.raises(InputError, match="max_cache_bytes"):
            onnxkv.Engine(session, max_cache_bytes=bound)


def test_paged_decode_rows_of_every_request_run_as_one_batched_run(session, monkeypatch):
    """Paged caches on a GroupQueryAttention graph: one run per step for every decode row (rows of their
    own lengths), prompts on states of their own over the same page pool; tokens as generate alone."""
    engine = onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=16))
    assert engine.batched and "one batched run" in engine.describe()["batching"]
    requests = [engine.add_request(_ids(p), 14) for p in PROMPTS]
    engine.step()  # every prompt (one chunk each): each makes its first token and joins the batched rows
    assert engine.describe()["decode_rows"] == 4
    states = {id(r.state) for r in requests}
    assert len(states) == 1 and requests[0].state.batch == 4
    assert requests[0].state.lengths.tolist() == [r.prompt.size for r in requests]
    runs = _count_runs(monkeypatch)
    session.events.clear()
    engine.step()
    assert runs["n"] == 1 and all(len(r.tokens) == 2 for r in requests)
    (step,) = [e for e in session.events if e.action == "engine_step"]
    assert step.extra["batched_rows"] == 4 and step.extra["tokens_fed"] == 4
    monkeypatch.undo()
    late = engine.add_request(_ids(PROMPTS[1][:30]), 9)
    engine.run()
    for r in [*requests, late]:
        assert r.tokens == _alone(session, r, onnxkv.CacheConfig("paged", block_size=16))
    assert engine.describe()["decode_rows"] == 0
    pool = engine._batch.pool
    pool.audit()  # every reference held by a live table or the prefix cache
    assert pool.live_pages == engine.describe()["prefix_cached_pages"] > 0  # only cached prompt pages stay
    engine.close()
    assert pool.live_pages == 0
    pool.audit()


@pytest.mark.parametrize("budget", [2048, 40])
def test_decode_rows_and_prompt_chunks_run_as_one_forward_per_step(session, budget):
    """A GroupQueryAttention graph takes segments: every step is one run (decode rows and the chunks of
    prompts arriving at different steps, of different lengths, on one token axis); the tokens are those
    of each request alone, greedy and sampled; the pool holds only the prefix cache's pages at the end."""
    cache = onnxkv.CacheConfig("paged", block_size=16)
    engine = onnxkv.Engine(session, cache=cache, max_batch_tokens=budget)
    assert engine._segmented and "one run of segments" in engine.describe()["batching"]
    sampling = [
        {},
        {"do_sample": True, "temperature": 0.8, "seed": 3},
        {},
        {"do_sample": True, "top_p": 0.9, "seed": 5},
    ]
    requests, session.events.enabled = [], True
    session.events.clear()
    for i, (text, kw) in enumerate(zip(PROMPTS, sampling, strict=True)):
        requests.append(engine.add_request(_ids(text), 12 + 3 * i, **kw))
        for _ in range(i + 1):
            engine.step()
    engine.run()
    steps = [e.extra for e in session.events if e.action == "engine_step"]
    assert all(s["runs"] == 1 for s in steps)
    mixed = [s for s in steps if s["batched_rows"] and s["tokens_fed"] > s["batched_rows"]]
    assert mixed  # steps that fed decode rows and prompt tokens together: one run each
    for r, kw in zip(requests, sampling, strict=True):
        assert r.tokens == _alone(session, r, cache, **kw)
    pool = engine._batch.pool
    pool.audit()
    assert pool.live_pages == engine.describe()["prefix_cached_pages"]
    engine.close()


def test_a_step_whose_single_run_would_not_fit_makes_its_runs_one_by_one(session):
    """A pool too small for the decode rows and a prompt chunk together: the step does not try the run of
    segments (it would fail at its first cache write) but makes its runs one by one, which pause the later
    request; every token as generate alone."""
    cache = onnxkv.CacheConfig("paged", block_size=16)
    engine = onnxkv.Engine(session, cache=cache, max_batch_tokens=32, max_pages=10, prefix_caching=False)
    first = engine.add_request(_ids(PROMPTS[0]), 40)
    engine.step()
    late = engine.add_request(_ids(PROMPTS[1][:132]), 10)
    session.events.enabled = True
    session.events.clear()
    engine.run()
    runs = [e.extra["runs"] for e in session.events if e.action == "engine_step"]
    assert 2 in runs and max(runs) == 2  # one by one, never a run of segments that failed first
    assert late.preemptions == 1
    for r in (first, late):
        assert r.tokens == _alone(session, r, cache)
    engine.close()


@pytest.mark.parametrize("segmented", [True, False])
@pytest.mark.parametrize("budget", [1, 2, 3])
def test_decode_rows_never_outnumber_the_budget(session, budget, segmented):
    """Prompts left waiting a step go first in the next and may take its whole budget: the prompts a step
    starts never make more decode rows than ``max_batch_tokens`` (rows that could never run again: every
    later step produced nothing and run() never returned)."""
    cache = onnxkv.CacheConfig("paged", block_size=4)
    engine = onnxkv.Engine(session, cache=cache, max_batch_tokens=budget)
    engine._segmented = segmented
    requests = [engine.add_request(np.array([10]), 6, eos_token_id=[])]
    engine.step()
    requests += [engine.add_request(np.array([11 + i]), 6, eos_token_id=[]) for i in range(3)]
    for _ in range(100):
        engine.step()
        assert engine.describe()["decode_rows"] <= budget
        if not engine.active:
            break
    assert not engine.active
    for r in requests:
        assert r.tokens == _alone(session, r, cache)
    engine.close()


def test_a_graph_whose_logits_are_the_last_position_only_runs_its_steps_one_by_one():
    """A GroupQueryAttention graph that gathers its logits at the last position (one row, whatever the
    tokens fed): its first run of segments is undone and the engine runs its steps one by one from then
    on; every token as generate alone."""
    from onnx import helper as oh
    from onnx import numpy_helper as nh

    model = build_model("gqa", MICRO, seed=3)
    graph = model.graph
    head = next(n for n in graph.node if "logits" in n.output)
    head.output[list(head.output).index("logits")] = "logits_all"
    graph.initializer.append(nh.from_array(np.array([-1], np.int64), "last"))
    graph.node.append(oh.make_node("Gather", ["logits_all", "last"], ["logits"], axis=1))
    sess = onnxkv.Session(model, threads=1, events=True)
    cache = onnxkv.CacheConfig("paged", block_size=16)
    engine = onnxkv.Engine(sess, cache=cache, max_batch_tokens=24)
    assert engine._segmented
    requests = [engine.add_request(np.arange(3, 3 + n) % 50 + 2, 6, eos_token_id=[]) for n in (9, 30)]
    engine.run()
    assert not engine._segmented and "logits are not one row per token" in engine.describe()["batching"]
    for r in requests:
        assert r.tokens == _alone(sess, r, cache)
    engine.close()


def test_attention_graph_requests_batch_their_decode_rows(monkeypatch):
    """Paged caches on an opset-23 Attention graph: decode rows of different lengths in one run per step
    (the mask hides the positions a shorter row never wrote), tokens as generate alone."""
    sess = onnxkv.Session(build_model("attention", TINY, seed=11), threads=1, events=True)
    cache = onnxkv.CacheConfig("paged", block_size=16)
    engine = onnxkv.Engine(sess, cache=cache, max_batch_tokens=64)
    assert engine.batched and "one batched run" in engine.describe()["batching"]
    rng = np.random.default_rng(4)
    requests = []
    for n, new in ((5, 16), (37, 12), (20, 18)):
        requests.append(engine.add_request(rng.integers(3, TINY.vocab_size, n), new, eos_token_id=[]))
        engine.step()
    while engine.describe()["decode_rows"] < 3:
        engine.step()
    assert len(set(requests[0].state.lengths.tolist())) == 3  # rows of three lengths in one state
    runs = _count_runs(monkeypatch)
    engine.step()
    assert runs["n"] == 1
    monkeypatch.undo()
    engine.run()
    for r in requests:
        assert r.finished == "length" and r.tokens == _alone(sess, r, cache)
    engine.close()
    engine._batch.pool.audit()


def test_attention_graph_requests_share_prefix_pages_and_resume_after_a_pause():
    """The same graph with a shared prompt prefix and a pool too small for every request: hits skip the
    prefix, a request is paused and resumes, and every request's tokens are generate's alone."""
    sess = onnxkv.Session(build_model("attention", TINY, seed=11), threads=1, events=True)
    cache = onnxkv.CacheConfig("paged", block_size=16)
    engine = onnxkv.Engine(sess, cache=cache, max_batch_tokens=256, max_pages=12)
    rng = np.random.default_rng(1)
    shared = rng.integers(3, TINY.vocab_size, 50)
    first = engine.add_request(np.concatenate([shared, rng.integers(3, 500, 7)]), 20, eos_token_id=[])
    while not first.tokens:
        engine.step()
    tails = (3, 9, 9, 30)
    requests = [first] + [
        engine.add_request(np.concatenate([shared, rng.integers(3, 500, n)]), 20, eos_token_id=[]) for n in tails
    ]
    engine.run()
    assert [r.prefix_hit_tokens for r in requests[1:]] == [48] * len(tails)
    assert sum(r.preemptions for r in requests) >= 1
    for r in requests:
        assert r.tokens == _alone(sess, r, cache)
    engine._batch.pool.audit()


def test_graph_forms_with_one_length_per_batch_run_one_request_per_run(tmp_path):
    """A past -> Concat -> present export takes one length per batch: the engine runs its requests one per
    run, says so, and each request's tokens are generate's."""
    import onnx

    onnx.save(build_concat_model(MICRO), tmp_path / "model.onnx")
    sess = onnxkv.Session(str(tmp_path / "model.onnx"), threads=1)
    engine = onnxkv.Engine(sess, cache="paged")
    assert not engine.batched and "one length per batch" in engine.describe()["batching"]
    requests = [engine.add_request(np.arange(1, n + 1) % MICRO.vocab_size, 6) for n in (5, 9)]
    engine.run()
    for r in requests:
        assert r.tokens == _alone(sess, r, "paged")


def test_an_engine_dropped_unclosed_is_collected_quietly(session, caplog):
    """An engine let go mid-run without ``close`` (its pool, states and prefix cache one garbage cycle)
    is collected with no allocator warning: the states' frees that come after the allocator's finalizer
    are taken quietly."""
    import gc

    engine = onnxkv.Engine(session)
    for p in PROMPTS[:2]:
        engine.add_request(_ids(p), 15)
    for _ in range(3):
        engine.step()
    assert engine.batched and engine._batch.pool.live_pages > 0
    del engine
    with caplog.at_level("WARNING", logger="onnxkv.alloc"):
        gc.collect()
    assert not caplog.records


def test_a_closed_engine_gives_its_page_chunks_to_the_reserve(session):
    """The pool's page allocator is the engine's: close releases its chunks to the process's reserve at
    once (the next engine's pages come from there, not from fresh mappings), not when it is collected."""
    from onnxkv.alloc.chunk_reserve import chunk_reserve_stats

    engine = onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=16))
    engine.add_request(_ids(PROMPTS[1]), 4)
    engine.run()
    allocator = engine._batch.allocator
    assert allocator.stats().committed > 0
    before = chunk_reserve_stats()
    engine.close()
    after = chunk_reserve_stats()
    assert allocator.stats().committed == 0
    assert after.kept + after.dropped > before.kept + before.dropped


def test_a_closed_engine_takes_no_request(session):
    engine = onnxkv.Engine(session)
    engine.add_request(_ids(PROMPTS[0]), 3)
    engine.close()
    with pytest.raises(StateError, match="Engine.add_request: the engine is closed"):
        engine.add_request(_ids(PROMPTS[0]), 3)
    assert engine.step() == {} and len(engine.requests) == 1


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_a_request_past_a_fixed_capacity_is_named_and_can_be_aborted(session, kind):
    """Every step raised CacheCapacityError without naming the request, so the documented way on
    (abort(error.request)) was impossible."""
    engine = onnxkv.Engine(session, cache=onnxkv.CacheConfig(kind, capacity=40), max_batch_tokens=64)
    a = engine.add_request(np.arange(40, 45, dtype=np.int64), 10, eos_token_id=[])
    b = engine.add_request(np.arange(40, 75, dtype=np.int64), 10, eos_token_id=[])  # 35 + 10 > 40
    with pytest.raises(onnxkv.CacheCapacityError, match=r"request 1 \(35 prompt tokens, \d+ made\)") as err:
        for _ in range(20):
            engine.step()
    assert err.value.request is b
    engine.abort(b)
    engine.run()
    assert a.finished == "length" and a.tokens == _alone(session, a, onnxkv.CacheConfig(kind, capacity=40))
    engine.close()


def test_a_request_past_the_rotary_table_is_refused_when_it_is_added():
    """A model without max_length (no genai_config.json): its rotary table bounds prompt + new tokens, and
    the request that would pass it is refused by add_request, naming the table (before: the step's run
    raised, naming positions but not the request)."""
    session = onnxkv.Session(build_model("gqa", dataclasses.replace(MICRO, max_length=24), seed=0), threads=1)
    assert session.model.max_length is None
    engine = onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=4))
    with pytest.raises(
        InputError,
        match=r"prompt length 20 \+ max_new_tokens 5 exceeds the 24 positions of the model's cos_cache 'cos_cache' of GroupQueryAttention",
    ):
        engine.add_request(np.arange(20) % MICRO.vocab_size, 5)
    assert engine.requests == []
    fits = engine.add_request(np.arange(20) % MICRO.vocab_size, 4, eos_token_id=[])
    engine.run()
    assert fits.finished == "length" and len(fits.tokens) == 4
    with pytest.raises(InputError, match="exceeds the 24 positions"):
        onnxkv.generate(session, np.arange(20)[None] % MICRO.vocab_size, max_new_tokens=5)


@pytest.mark.parametrize(
    "sampling",
    [
        [{}, {}, {}],
        [{"do_sample": True, "temperature": 0.8, "top_k": 20, "seed": s} for s in (1, 2, 3)],
        [{}, {"do_sample": True, "temperature": 0.8, "seed": 2}, {}],  # greedy and sampled rows in one loop
    ],
    ids=["greedy", "sampled", "mixed"],
)
@pytest.mark.parametrize("graph", ["gqa", "attention"])
def test_run_decodes_rows_in_c_each_with_its_sampling(sampling, graph, monkeypatch):
    """Engine.run: once only decode rows are left and they share their end ids, their steps run in C
    (State.decode_steps over the batched rows of their own lengths), greedy rows taking their argmax and
    sampled rows drawing from their own streams, together; a row that reaches an end id stops there.
    Every request's tokens are generate's alone.  An opset-23 Attention graph's rows too: the loop writes
    its ExportMask's masks with the keys each row never wrote hidden, and the Attention nodes read each
    row's own pages."""
    session = onnxkv.Session(MODEL if graph == "gqa" else build_model("attention", TINY, seed=11), threads=2)
    vocab = session.model.vocab_size
    cache = onnxkv.CacheConfig("paged", block_size=16)
    probe = onnxkv.Engine(session, cache=cache)
    free = probe.add_request(_ids(PROMPTS[1]) % vocab, 30, eos_token_id=[], **sampling[1])
    probe.run()
    eos = [free.tokens[9]]  # request 1 ends at its tenth token, inside a loop
    ran: list[tuple[int, int, int]] = []  # steps run in C, the sampling kinds and the number of active requests
    real = State.decode_steps
    requests: list = []

    def counting(self, *args, **kwargs):
        kinds = len({r.sampling.greedy for r in requests if r.finished is None})
        active = sum(r.finished is None for r in requests)
        run = real(self, *args, **kwargs)
        ran.append((0 if run is None else run.steps, kinds, active))
        return run

    monkeypatch.setattr(State, "decode_steps", counting)
    engine = onnxkv.Engine(session, cache=cache)
    requests += [
        engine.add_request(_ids(p) % vocab, n, eos_token_id=eos, **kw)
        for p, n, kw in zip(PROMPTS[:3], (24, 30, 40), sampling, strict=True)
    ]
    engine.run()
    monkeypatch.undo()
    for r, kw in zip(requests, sampling, strict=True):
        assert r.tokens == _alone(session, r, cache, **kw), r
    assert requests[1].finished == "eos" and requests[1].tokens == free.tokens[: free.tokens.index(eos[0]) + 1]
    steps = sum(n for n, _, _ in ran)
    assert steps >= 3 and engine.steps < sum(len(r.tokens) for r in requests)
    assert max(kinds for n, kinds, _ in ran if n) == len({not kw for kw in sampling})  # mixed rows loop together
    assert max(active for n, _, active in ran if n) == 3  # rows of three lengths in one loop


def test_attention_rows_of_different_lengths_replay_their_attention_in_c(monkeypatch):
    """An opset-23 Attention graph's decode rows of different lengths, stepped one by one (no loop): the
    compiled step replays every Attention node over each row's own pages (no node but the ExportMask runs in
    Python), and every request's tokens are generate's alone."""
    from onnxkv.engine.batched import BatchedSteps
    from onnxkv.plan.compiled_step import Segment

    monkeypatch.setattr(BatchedSteps, "_decode_loop", lambda self: 0)
    session = onnxkv.Session(build_model("attention", TINY, seed=11), threads=1)
    cache = onnxkv.CacheConfig("paged", block_size=16)
    engine = onnxkv.Engine(session, cache=cache)
    vocab = session.model.vocab_size
    requests = [engine.add_request(_ids(p) % vocab, 12, eos_token_id=[]) for p in PROMPTS]
    engine.run()
    python = {
        session.plan.nodes[i].op_type
        for step in session.plan.steps.idle
        if step.signature[0][1][0] == len(PROMPTS)  # the decode steps of every row
        for i in step.items
        if not isinstance(i, Segment)
    }
    assert python == {"ExportMask"}
    for r in requests:
        assert r.tokens == _alone(session, r, cache)


def test_run_steps_one_by_one_where_the_loops_pages_do_not_fit(monkeypatch):
    """The loop stages the pages of its steps before it runs: in a pool too small for the rows' last steps
    that fails with nothing changed, and run() takes the steps one by one (which pause a request to make
    room; the loop is tried again only once the rows change), every request's tokens still generate's
    alone."""
    failed: list[list[int]] = []
    real = State.decode_steps

    def spying(self, *args, **kwargs):
        try:
            return real(self, *args, **kwargs)
        except onnxkv.errors.OutOfMemory:
            failed.append([r.id for r in engine._rows])
            raise

    monkeypatch.setattr(State, "decode_steps", spying)
    session = onnxkv.Session(MODEL, threads=2)
    engine = onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=16, max_pages=7))
    requests = [engine.add_request(_ids(p)[:20], 44, eos_token_id=[]) for p in PROMPTS[:2]]
    engine.run()
    monkeypatch.undo()
    assert failed and failed[0] == [0, 1] and len(failed) == len({tuple(f) for f in failed})
    assert sum(r.preemptions for r in requests) > 0
    for r in requests:
        assert len(r.tokens) == 44 and r.tokens == _alone(session, r, onnxkv.CacheConfig("paged", block_size=16))
