"""Preemption: a batched engine whose page pool cannot hold every request pauses the latest-arriving one
(its pages go back; it runs its prompt and tokens again when it resumes), so every request finishes with
the tokens it makes alone; OutOfMemory only for a request that cannot fit even alone."""

from __future__ import annotations

import numpy as np
import pytest

import onnxkv
from onnxkv.errors import OutOfMemory
from onnxkv.zoo import embedded

MODEL = str(embedded.embedded_model_dir())
PROMPTS = ["def f(x):\n    return", "class Node:\n    def __init__(self", "for i in range(10):\n", "import sys\n#"]


@pytest.fixture(scope="module")
def session():
    return onnxkv.Session(MODEL, threads=1, events=True)


def _alone(session, r) -> list[int]:
    kw = {"do_sample": True, "temperature": 0.9, "seed": r.id} if r.sampling.temperature > 0 else {}
    out = onnxkv.generate(
        session, r.prompt[None], r.max_new_tokens, cache=onnxkv.CacheConfig("paged", block_size=16),
        eos_token_id=r.eos, **kw,
    )  # fmt: skip
    return out.tokens[0].tolist()


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_pool_of_half_the_pages_finishes_every_request_as_alone(session, prefix_caching):
    new = 48
    requests_pages = [-(-(len(embedded.encode(p)) + new) // 16) for p in PROMPTS]
    engine = onnxkv.Engine(
        session, cache=onnxkv.CacheConfig("paged", block_size=16), max_pages=sum(requests_pages) // 2,
        prefix_caching=prefix_caching,
    )  # fmt: skip
    assert max(requests_pages) <= sum(requests_pages) // 2  # each fits alone
    session.events.clear()
    reqs = [
        engine.add_request(
            np.array(embedded.encode(p), np.int64),
            new,
            eos_token_id=[],
            **({"do_sample": True, "temperature": 0.9, "seed": i} if i % 2 else {}),
        )  # fmt: skip
        for i, p in enumerate(PROMPTS)
    ]
    engine.run()
    paused = [e.extra["request"] for e in session.events if e.action == "preempt"]
    assert paused and sum(r.preemptions for r in reqs) == len(paused)
    assert reqs[0].preemptions == 0  # the first to arrive is never the one paused
    for r in reqs:
        assert r.finished == "length" and r.tokens == _alone(session, r)
    engine._batch.pool.audit()
    engine.close()
    assert engine._batch.pool.live_pages == 0


def test_a_prompt_that_cannot_fit_alone_is_refused_when_it_is_added(session):
    engine = onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=16), max_pages=3)
    small = engine.add_request(np.array(embedded.encode("ab"), np.int64), 4, eos_token_id=[])
    with pytest.raises(OutOfMemory, match=r"Engine.add_request: a prompt of 81 tokens needs 6 pages .* max_pages=3"):
        engine.add_request(np.array(embedded.encode("x" * 80), np.int64), 4, eos_token_id=[])
    assert engine.requests == [small]  # nothing queued
    engine.run()
    assert small.finished == "length" and small.tokens == _alone(session, small)
    engine._batch.pool.audit()


def test_a_request_that_outgrows_the_pool_alone_is_named_and_can_be_aborted(session):
    """A request whose prompt fits but whose tokens outgrow the pool even with every later request
    paused: each step raises OutOfMemory naming it (``error.request``) and leaving it as it was; aborted,
    the others go on, token for token as alone."""
    engine = onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=16), max_pages=3)
    big = engine.add_request(np.array(embedded.encode("x" * 40), np.int64), 30, eos_token_id=[])  # 41 + 30 > 48
    small = engine.add_request(np.array(embedded.encode("ab"), np.int64), 4, eos_token_id=[])
    with pytest.raises(OutOfMemory, match=f"request {big.id} .* does not fit even alone") as caught:
        engine.run()
    assert caught.value.request is big and big.finished is None
    made = list(big.tokens)
    assert 41 + len(made) - 1 == 48  # every position of its three pages holds a token (the last made is not fed)
    with pytest.raises(OutOfMemory) as again:
        engine.step()
    assert again.value.request is big and big.tokens == made  # as it was
    engine.abort(big)
    engine.run()
    assert big.finished == "aborted" and big.tokens == made
    assert small.finished == "length" and small.tokens == _alone(session, small)
    engine._batch.pool.audit()


def _budget_engine(session, new, prefix_caching=False, **kw):
    pages = [-(-(len(embedded.encode(p)) + new) // 16) for p in PROMPTS]
    probe = onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=16))
    probe.add_request(np.array(embedded.encode("ab"), np.int64), 1)
    probe.run()
    budget = sum(pages) * probe._batch.pool.page_bytes // 2  # half the bytes the requests need native
    probe.close()
    engine = onnxkv.Engine(
        session, cache=onnxkv.CacheConfig("paged", block_size=16), max_cache_bytes=budget,
        prefix_caching=prefix_caching, **kw,
    )  # fmt: skip
    reqs = [engine.add_request(np.array(embedded.encode(p), np.int64), new, eos_token_id=[]) for p in PROMPTS]
    return engine, reqs


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_byte_budget_quantizes_cold_pages_before_pausing_anyone(session, prefix_caching):
    """Half the bytes the requests need: cold pages of the latest requests go to int8 (their last 32
    positions stay native) before any request is paused -- with prefix caching too, whose cache lets go of
    the prompt pages it holds with one request alone -- and every request finishes with the tokens it
    makes alone (greedy; int8 pages on this model)."""
    engine, reqs = _budget_engine(session, 80, prefix_caching, preempt_formats=("int8",))
    session.events.clear()
    engine.run()
    relief = [(e.action, e.extra["request"]) for e in session.events if e.action in ("preempt", "preempt_quantize")]
    assert relief and relief[0][0] == "preempt_quantize"
    first_pause = next((i for i, (a, _) in enumerate(relief) if a == "preempt"), len(relief))
    assert first_pause > 0 and all(r != 0 for _, r in relief)  # the first request is never touched
    for r in reqs:
        assert r.finished == "length" and r.tokens == _alone(session, r)
    engine._batch.pool.audit()
    engine.close()


def test_converted_pages_never_become_a_prefix_of_other_requests(session):
    """A request whose cold pages were converted mid-prompt (to make room) went on caching its prompt
    pages after each chunk: the converted ones, and the ones it computed over them, came back to a later
    request with the same prompt, whose tokens then differed from generate alone from the first one on."""
    from onnxkv.cache.plane_payloads import NATIVE_CODE

    rng = np.random.default_rng(0)
    first, second = rng.integers(3, 256, 100), rng.integers(3, 256, 200)
    engine = onnxkv.Engine(
        session, cache=onnxkv.CacheConfig("paged", block_size=16), max_batch_tokens=17,
        max_cache_bytes=13 * 32768, keep_native_tokens=0,
    )  # fmt: skip
    engine.add_request(first, 14, eos_token_id=[])
    engine.add_request(second, 2, eos_token_id=[])
    session.events.clear()
    engine.run()
    assert 1 in {e.extra["request"] for e in session.events if e.action == "preempt_quantize"}
    pool, cached = engine._batch.pool, engine._prefix.held_ids()
    for plane, spec in enumerate(pool.planes):
        assert (pool.payloads.formats[plane][cached] == NATIVE_CODE[spec.storage]).all()
    later = engine.add_request(second[:150], 5, eos_token_id=[])  # alone, after the pressure: fits native
    engine.run()
    alone = onnxkv.generate(
        session, later.prompt[None], 5, cache=onnxkv.CacheConfig("paged", block_size=16),
        prefill_chunk=later.chunk, eos_token_id=[],
    )  # fmt: skip
    assert later.tokens == alone.tokens[0].tolist()
    engine._batch.pool.audit()
    engine.close()


def test_the_formats_step_down_in_order(session):
    """With int8 then int4, no page reaches int4 before every candidate was tried in int8, and the pages
    held stay within the budget after each step."""
    engine, reqs = _budget_engine(session, 80)
    session.events.clear()
    pool = None
    while engine.active:
        engine.step()
        pool = engine._batch.pool
        assert pool.committed_bytes <= pool.max_bytes
    steps = [e.extra["format"] for e in session.events if e.action == "preempt_quantize"]
    assert "int4" in steps and steps.index("int4") > steps.index("int8")
    assert all(r.finished == "length" and len(r.tokens) == 80 for r in reqs)
    pool.audit()


def test_prompts_arriving_together_that_fit_only_one_by_one_all_finish(session):
    """Eight prompts arriving at once whose last chunks would run as one grouped run that the byte budget
    cannot hold (the pool does not exist yet, so admission cannot count it): the group splits, the first
    runs, the others wait, and every request finishes with its tokens alone."""
    prompt = np.array(embedded.encode("def area(r):\n    return 3.14159 * r * r  # circle area\n"), np.int64)
    pages = -(-(prompt.size + 24) // 16)
    probe = onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=16))
    probe.add_request(prompt[:3], 1)
    probe.run()
    page_bytes = probe._batch.pool.page_bytes
    probe.close()
    engine = onnxkv.Engine(
        session, cache=onnxkv.CacheConfig("paged", block_size=16), max_cache_bytes=3 * pages * page_bytes
    )
    reqs = [engine.add_request(prompt.copy(), 24, eos_token_id=[]) for _ in range(8)]
    engine.run()
    alone = _alone(session, reqs[0])
    assert all(r.finished == "length" and r.tokens == alone for r in reqs)
    engine._batch.pool.audit()
