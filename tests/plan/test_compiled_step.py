"""Compiled steps (onnxkv.plan.compiled_step): replayed kernel calls give the node-by-node results bit for bit,
on every cache family, contiguous and paged caches, page formats, batches, and runs that change shape."""

from __future__ import annotations

import numpy as np
import pytest

import onnxkv
from onnxkv import CacheConfig
from onnxkv.alloc import SystemAllocator
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.plan.compiled_step import Segment
from onnxkv.zoo.builders import MICRO, build_model

FAMILIES = ["gqa", "attention", "concat", "tensorscatter"]
CACHES = [
    CacheConfig("contiguous"),
    CacheConfig("paged", block_size=4),
    CacheConfig("paged", block_size=4, kv_format="int8"),
]


def _steps(session, state, prompt, tokens):
    """Logits of a prompt and then of each token of ``tokens`` [steps, B] fed one by one (copies)."""
    name = session.model.io.logits
    lengths = np.full(prompt.shape[0], prompt.shape[1])
    b = FeedBuilder(session.plan.inputs, session.model, prompt, lengths, 0, thread_cache=False)
    feeds, _ = b.first()
    out = state.run(feeds, [name])
    got = [out[name]]
    for t in tokens:
        out = state.run(b.next(np.asarray(t, np.int64), out), [name])
        got.append(out[name])
    return got


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.mark.parametrize("cache", CACHES, ids=["contiguous", "paged", "paged-int8"])
@pytest.mark.parametrize("batch", [1, 2])
def test_replayed_steps_equal_node_by_node_runs(family, cache, batch):
    if cache.kind == "paged" and cache.kv_format == "int8" and family != "gqa":
        pytest.skip("page formats: GroupQueryAttention models")
    model = build_model(family, MICRO, seed=5)
    rng = np.random.default_rng(batch)
    prompt = rng.integers(1, MICRO.vocab_size, (batch, 5))
    tokens = rng.integers(1, MICRO.vocab_size, (6, batch))
    runs = {}
    for compiled in (False, True):
        session = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        with session.new_state(cache=cache) as state:
            runs[compiled] = _steps(session, state, prompt, tokens)
        if compiled:
            step = session.plan.steps.idle[0]
            assert step.compiled_nodes > 0
            assert any(isinstance(item, Segment) for item in step.items)
    for plain, replayed in zip(runs[False], runs[True]):
        np.testing.assert_array_equal(plain, replayed)


def test_tensor_runs_without_a_state_replay_too():
    model = build_model("gqa", MICRO, seed=6)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, MICRO.vocab_size, (1, 4))
    got = {}
    for compiled in (False, True):
        session = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        got[compiled] = onnxkv.generate(session, prompt, max_new_tokens=8, cache="tensor").tokens
    np.testing.assert_array_equal(got[False], got[True])


def test_returned_outputs_are_not_rewritten_by_the_next_replay():
    session = onnxkv.Session(build_model("gqa", MICRO, seed=7), threads=1)
    rng = np.random.default_rng(1)
    with session.new_state() as state:
        got = _steps(session, state, rng.integers(1, MICRO.vocab_size, (1, 4)), rng.integers(1, 50, (5, 1)))
    copies = [g.copy() for g in got]
    assert session.plan.steps.idle[0].owned_outputs  # the logits are the step's memory
    for g, c in zip(got, copies):
        np.testing.assert_array_equal(g, c)
    assert len({g.__array_interface__["data"][0] for g in got}) == len(got)


def test_a_run_of_other_shapes_falls_back_and_a_new_step_is_recorded():
    model = build_model("gqa", MICRO, seed=8)
    rng = np.random.default_rng(2)
    results = {}
    for compiled in (False, True):
        session = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        outs = []
        with session.new_state() as state:
            outs += _steps(session, state, rng.integers(1, 50, (1, 3)), [[4], [5], [6]])
        with session.new_state() as state:  # batch 2: every segment's check fails on the recorded step
            outs += _steps(session, state, rng.integers(1, 50, (2, 6)), [[1, 2], [3, 4], [5, 6]])
        results[compiled] = outs
        rng = np.random.default_rng(2)
    for plain, replayed in zip(results[False], results[True]):
        np.testing.assert_array_equal(plain, replayed)


def test_runs_with_an_event_log_or_a_callers_allocator_run_node_by_node():
    model = build_model("gqa", MICRO, seed=9)
    prompt = np.array([[3, 4, 5]])
    logged = onnxkv.Session(model, threads=1, events=True)
    onnxkv.generate(logged, prompt, max_new_tokens=4)
    assert logged.plan.steps.runs == 0 and not logged.plan.steps.idle
    assert len([e for e in logged.events if e.action == "execute"]) == 4 * len(
        logged.plan.nodes
    )  # the prompt and 3 steps
    assert onnxkv.Session(model, threads=1, allocator=SystemAllocator()).plan.steps is None
    assert onnxkv.Session(model, threads=1, compiled_steps=False).plan.steps is None


def test_every_packed_product_and_the_embedding_of_a_decode_step_are_compiled_and_stay_so():
    session = onnxkv.Session(build_model("gqa", MICRO, seed=10), threads=1)
    onnxkv.generate(session, np.array([[3, 4, 5]]), max_new_tokens=12)
    kinds = ("MatMul", "PrologueMatMul", "Gather")
    products = [k for k, op in enumerate(session.plan.kernels) if type(op).__name__ in kinds]
    assert products
    (step,) = session.plan.steps.idle
    compiled = {k for item in step.items if isinstance(item, Segment) for k in range(item.first, item.end)}
    assert compiled == set(products)
    assert not step.stale
