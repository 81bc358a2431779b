"""Automatic prefix caching of a batched engine: full prompt pages keyed by (previous key, token ids, page
format), shared by reference with later requests whose prompts start the same way, kept after their
requests end until the pool needs room; tokens as each request alone with ``generate``."""

from __future__ import annotations

import numpy as np
import pytest

import onnxkv
from onnxkv.errors import InputError
from onnxkv.zoo import embedded

MODEL = str(embedded.embedded_model_dir())
PAGED = onnxkv.CacheConfig("paged", block_size=16)
SYSTEM = "You answer in Python. Keep functions short and name them well. " * 2  # 128+ tokens with BOS
TAILS = ["def add(a, b):\n", "class Queue:\n", "x = [", "import os\n"]


@pytest.fixture(scope="module")
def session():
    return onnxkv.Session(MODEL, threads=1, events=True)


def _ids(text: str) -> np.ndarray:
    return np.array(embedded.encode(text), np.int64)


def _alone(session, r) -> list[int]:
    out = onnxkv.generate(session, r.prompt[None], r.max_new_tokens, cache=PAGED, eos_token_id=r.eos)
    return out.tokens[0].tolist()


def test_requests_sharing_a_prefix_take_its_pages_and_compute_only_the_rest(session):
    engine = onnxkv.Engine(session, cache=PAGED)
    first = engine.add_request(_ids(SYSTEM + TAILS[0]), 12)
    assert first.prefix_hit_tokens == 0
    engine.step()  # its prompt has run: its full prompt pages are cached
    shared = len(_ids(SYSTEM)) // 16 * 16
    cached = engine.describe()["prefix_cached_pages"]
    assert cached == len(first.prompt) // 16
    session.events.clear()
    others = [engine.add_request(_ids(SYSTEM + t), 12) for t in TAILS[1:]]
    lookups = [e for e in session.events if e.action == "prefix_lookup"]
    assert [e.extra["prefix_hit_tokens"] for e in lookups] == [r.prefix_hit_tokens for r in others]
    for r in others:
        assert r.prefix_hit_tokens == shared and r.prompt_done == shared
        assert r.next_tokens == min(r.chunk, r.prompt.size - shared)  # the budget counts only the rest
    pool = first.state.pool
    before = pool.live_pages
    engine.step()  # their prompts: only the tails run
    own = sum(-(-r.prompt.size // 16) - shared // 16 for r in others)
    assert pool.live_pages <= before + own  # the shared pages once, each request's own pages besides
    engine.run()
    for r in [first, *others]:
        assert r.tokens == _alone(session, r)
    pool.audit()
    engine.close()
    assert pool.live_pages == 0


def test_a_prompt_seen_before_runs_only_its_last_token(session):
    engine = onnxkv.Engine(session, cache=PAGED)
    a = engine.add_request(_ids(SYSTEM), 6)
    engine.run()
    b = engine.add_request(_ids(SYSTEM), 6)
    n = b.prompt.size
    assert b.prefix_hit_tokens == (n - 1) // 16 * 16 and b.next_tokens == n - b.prefix_hit_tokens
    engine.run()
    assert b.tokens == a.tokens == _alone(session, a)


def test_a_full_pool_evicts_unreferenced_cached_pages_first(session):
    need = -(-(len(_ids(SYSTEM)) + 20) // 16)  # pages of one request
    engine = onnxkv.Engine(session, cache=PAGED, max_pages=need + 2)
    a = engine.add_request(_ids(SYSTEM + TAILS[0]), 8)
    engine.run()
    cached = engine.describe()["prefix_cached_pages"]
    assert cached > 2
    session.events.clear()
    free = need + 2 - engine._batch.pool.live_pages
    b = engine.add_request(_ids("z" * 16 * (free + 1) + TAILS[1]), 8)  # shares nothing, needs the cached room
    engine.run()
    assert b.finished == "length" and b.tokens == _alone(session, b)
    evicted = sum(e.extra["evictions"] for e in session.events if e.action == "prefix_evict")
    assert evicted > 0 and engine.describe()["prefix_evictions"] == evicted
    assert a.tokens == _alone(session, a)
    engine._batch.pool.audit()


def test_the_cache_keeps_at_most_prefix_pages_and_can_be_off(session):
    engine = onnxkv.Engine(session, cache=PAGED, prefix_pages=3)
    for t in TAILS:
        engine.add_request(_ids(t * 20), 2)
    engine.run()
    assert engine.describe()["prefix_cached_pages"] <= 3
    off = onnxkv.Engine(session, cache=PAGED, prefix_caching=False)
    r = off.add_request(_ids(SYSTEM), 3)
    off.run()
    again = off.add_request(_ids(SYSTEM), 3)
    assert again.prefix_hit_tokens == 0 and off.describe()["prefix_cached_pages"] == 0
    off.run()
    assert again.tokens == r.tokens
    with pytest.raises(InputError, match="prefix_caching must be a bool"):
        onnxkv.Engine(session, cache=PAGED, prefix_caching=1)
    with pytest.raises(InputError, match="contradicts"):
        onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", max_pages=10), max_pages=20)


def _count_runs(monkeypatch, fail_at: int | None = None) -> dict:
    runs = {"n": 0}
    real = onnxkv.State.run

    def counted(self, feeds, output_names=None, cancel=None, logits_at=None, **kw):
        runs["n"] += 1
        if runs["n"] == fail_at:
            raise MemoryError("State.run: no memory")
        return real(self, feeds, output_names, cancel, logits_at, **kw)

    monkeypatch.setattr(onnxkv.State, "run", counted)
    return runs


TAIL_SAME = ["a = 1\n", "b = 2\n", "c = 3\n"]  # one length each


@pytest.mark.parametrize("segmented", [True, False])
def test_last_prompt_chunks_at_one_position_run_as_one_batch(session, monkeypatch, segmented):
    """Prompts of one length arriving together, and prefix hits of one tail length, each run as one run of
    their rows (separate runs: the decode rows' run, then the tails'; a run of segments: one run for all);
    the tokens stay those of each request alone."""
    engine = onnxkv.Engine(session, cache=PAGED)
    assert engine._segmented
    engine._segmented = segmented
    fresh = [engine.add_request(_ids(t + "x" * 40), 7) for t in TAIL_SAME]  # no page in common
    runs = _count_runs(monkeypatch)
    engine.step()
    assert runs["n"] == 1 and all(len(r.tokens) == 1 for r in fresh)
    assert engine.describe()["decode_rows"] == 3
    hits = [engine.add_request(_ids(t + "x" * 40 + "yy"), 7) for t in TAIL_SAME]
    assert all(r.prefix_hit_tokens == 32 for r in hits)
    runs["n"] = 0
    engine.step()  # the decode rows, then the three tails together
    assert runs["n"] == (1 if segmented else 2) and engine.describe()["decode_rows"] == 6
    monkeypatch.undo()
    engine.run()
    for r in fresh + hits:
        assert r.tokens == _alone(session, r)
    engine.close()


@pytest.mark.parametrize("hit", [False, True])
def test_a_failed_batched_prompt_run_leaves_its_requests_as_before(session, monkeypatch, hit):
    engine = onnxkv.Engine(session, cache=PAGED)
    if hit:
        engine.add_request(_ids("x" * 40), 1)
        engine.run()
    group = [engine.add_request(_ids("x" * 40 + t), 5) for t in TAIL_SAME]
    before = [(r.prompt_done, r.state.lengths.tolist() if r.state is not None else None) for r in group]
    assert all((p == 32) == hit for p, _ in before)
    with monkeypatch.context() as m:
        _count_runs(m, fail_at=1)
        with pytest.raises(MemoryError):
            engine.step()
    assert [(r.prompt_done, r.state.lengths.tolist() if r.state is not None else None) for r in group] == before
    assert all(r.tokens == [] for r in group)
    engine.run()
    for r in group:
        assert r.tokens == _alone(session, r)
    engine._batch.pool.audit()


LONG = "Return the sum of the squares of the items, skipping None. " * 5  # 300 tokens: several chunks of 128


def test_requests_arriving_together_compute_a_shared_prefix_once(session):
    """Prompts sharing a long prefix, all added before the first step: the first computes it chunk by chunk
    (its full pages cached after each chunk), the others wait for those pages and compute only their tails;
    the pool never holds the prefix twice; tokens as each alone."""
    engine = onnxkv.Engine(session, cache=PAGED, max_batch_tokens=128)
    reqs = [engine.add_request(_ids(LONG + t), 6, eos_token_id=[]) for t in TAILS]
    shared = len(_ids(LONG)) // 16
    session.events.clear()
    peak = 0
    while engine.active:
        engine.step()
        peak = max(peak, engine._batch.pool.live_pages)
    assert [r.prefix_hit_tokens for r in reqs] == [0] + [shared * 16] * (len(TAILS) - 1)
    fed = sum(e.extra["tokens_fed"] for e in session.events if e.action == "engine_step")
    decode = sum(len(r.tokens) - 1 for r in reqs)
    assert fed == reqs[0].prompt.size + sum(r.prompt.size - shared * 16 for r in reqs[1:]) + decode
    own = sum(-(-(r.prompt.size + 6) // 16) - shared for r in reqs)
    assert peak <= shared + own
    for r in reqs:
        assert r.tokens == _alone(session, r)
    engine._batch.pool.audit()
    engine.close()


def test_requests_waiting_for_an_aborted_prompt_compute_it_themselves(session):
    engine = onnxkv.Engine(session, cache=PAGED, max_batch_tokens=128)
    reqs = [engine.add_request(_ids(LONG + t), 5, eos_token_id=[]) for t in TAILS[:3]]
    engine.step()  # the first runs its first chunk; the others wait for its pages
    assert reqs[0].prompt_done == 128 and all(r.prompt_done == 0 for r in reqs[1:])
    engine.abort(reqs[0])
    engine.run()
    assert reqs[0].finished == "aborted"
    assert reqs[1].prefix_hit_tokens == 128  # the pages the aborted request cached stay usable
    for r in reqs[1:]:
        assert r.finished == "length" and r.tokens == _alone(session, r)
    engine._batch.pool.audit()
    engine.close()


@pytest.mark.parametrize("budget", [1, 4])
def test_prefix_hits_never_start_more_requests_than_a_step_runs_decode_rows_for(session, budget):
    """A prefix hit gave a request its state (so a decode row) without the room check a prompt's first
    run has: with more decode rows than max_batch_tokens no step ran them, and run() never returned."""
    engine = onnxkv.Engine(session, cache=PAGED, max_batch_tokens=budget)
    system = np.arange(40, 80, dtype=np.int64)  # 40 tokens: two full pages to share
    first = engine.add_request(np.concatenate([system, [90]]), 6)
    while first.prompt_done < 32:
        engine.step()
    others = [engine.add_request(np.concatenate([system, [91 + i]]), 6) for i in range(5)]
    for _ in range(500):
        if not engine.active:
            break
        engine.step()
    assert not engine.active
    assert any(r.prefix_hit_tokens for r in others)
    for r in [first, *others]:
        assert r.tokens == _alone(session, r)
    engine.close()
