"""Engine.pool_occupancy: every live page charged to exactly one holder (a request, "shared" or "prefix
cache"), its bytes by page format summing to the pool's, and logged with every engine_step event."""

from __future__ import annotations

import numpy as np
import pytest

import onnxkv
from onnxkv.engine.occupancy import PREFIX, SHARED
from onnxkv.zoo import embedded

MODEL = str(embedded.embedded_model_dir())
PREFIX_TEXT = "import numpy as np\nimport onnx\nfrom onnxkv import Session, Engine\n"  # > 3 pages of 16


@pytest.fixture(scope="module")
def session():
    return onnxkv.Session(MODEL, threads=1, events=True)


def _ids(text: str) -> np.ndarray:
    return np.array(embedded.encode(text), np.int64)


def _check_whole(occ: dict, pool) -> None:
    """Every live page in one holder; bytes by format add up to the pool's payload bytes."""
    assert sum(h["pages"] for h in occ["holders"].values()) == occ["pages"] == pool.live_pages
    assert sum(b for h in occ["holders"].values() for b in h["bytes"].values()) == occ["committed_bytes"]
    assert occ["committed_bytes"] == pool.committed_bytes


def test_shared_prefix_pages_are_charged_to_shared_and_then_to_the_prefix_cache(session):
    engine = onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=16), max_pages=256)
    assert engine.pool_occupancy() == {}  # nothing ran yet
    first = engine.add_request(_ids(PREFIX_TEXT + "x = 1"), 6, eos_token_id=[])
    while not first.tokens:
        engine.step()
    others = [engine.add_request(_ids(PREFIX_TEXT + tail), 6, eos_token_id=[]) for tail in ("y = 2", "def g():")]
    engine.step()
    occ = engine.pool_occupancy()
    pool = engine._batch.pool
    _check_whole(occ, pool)
    shared_pages = len(_ids(PREFIX_TEXT)) // 16
    assert all(r.prefix_hit_tokens == shared_pages * 16 for r in others)
    assert occ["holders"][SHARED]["pages"] == shared_pages
    assert set(occ["holders"]) == {SHARED, *(f"request {r.id}" for r in [first, *others])}
    assert occ["holders"][SHARED]["bytes"] == {"float32": shared_pages * pool.page_bytes}
    assert occ["max_pages"] == 256 and occ["max_bytes"] is None
    engine.run()
    occ = engine.pool_occupancy()  # every request finished: only the prefix cache holds pages
    _check_whole(occ, pool)
    assert set(occ["holders"]) == {PREFIX} and occ["holders"][PREFIX]["pages"] == len(engine._prefix)
    engine.close()
    assert engine.pool_occupancy()["pages"] == 0


def test_converted_pages_show_under_their_format_and_every_step_is_logged(session):
    prompts = ["def f(x):\n    return", "class Node:\n    def __init__(self", "for i in range(10):\n", "import sys\n#"]
    new = 80
    probe = onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=16))
    probe.add_request(_ids("ab"), 1)
    probe.run()
    page_bytes = probe._batch.pool.page_bytes
    probe.close()
    budget = sum(-(-(len(embedded.encode(p)) + new) // 16) for p in prompts) * page_bytes // 2
    engine = onnxkv.Engine(
        session, cache=onnxkv.CacheConfig("paged", block_size=16), max_cache_bytes=budget, prefix_caching=False,
        preempt_formats=("int8",),
    )  # fmt: skip
    for p in prompts:
        engine.add_request(_ids(p), new, eos_token_id=[])
    session.events.clear()
    seen_int8 = False
    while engine.active:
        engine.step()
        occ = engine.pool_occupancy()
        _check_whole(occ, engine._batch.pool)
        assert occ["max_bytes"] == budget and occ["committed_bytes"] <= budget
        logged = [e for e in session.events if e.action == "engine_step"][-1].extra["pool"]
        assert logged == occ
        fmts = {f for h in occ["holders"].values() for f in h["bytes"]}
        assert fmts <= {"float32", "int8"}
        seen_int8 |= "int8" in fmts
    assert seen_int8
    assert len([e for e in session.events if e.action == "engine_step"]) == engine.steps
    engine.close()


def test_an_engine_that_does_not_batch_has_no_pool_record(session):
    engine = onnxkv.Engine(session, cache="contiguous")
    engine.add_request(_ids("ab"), 2)
    engine.run()
    assert engine.pool_occupancy() == {}
    assert [e for e in session.events if e.action == "engine_step"][-1].extra["pool"] == {}
