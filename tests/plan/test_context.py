"""RunContext: deferred work (commits after success, rollbacks newest first after a failure) and scratch."""

from __future__ import annotations

import numpy as np
import pytest

from onnxkv.plan.context import RunContext


def context(caches=None) -> RunContext:
    return RunContext(lambda _rt, _i, shape, dtype: np.empty(shape, dtype), False, 0, caches)


def test_rollbacks_run_newest_first_and_all_of_them_even_after_one_raised():
    rt = context()
    calls = []

    def broken():
        calls.append("broken")
        raise KeyError("rollback failed")

    rt.defer(lambda: calls.append("commit 1"), lambda: calls.append("rollback 1"))
    rt.defer(None, broken)
    rt.defer(lambda: calls.append("commit 3"), None)
    with pytest.raises(KeyError, match="rollback failed"):
        rt.finish(False)
    assert calls == ["broken", "rollback 1"] and rt.deferred == []
    rt.defer(lambda: calls.append("commit"), lambda: calls.append("rollback"))
    rt.defer(None, lambda: calls.append("never"))
    rt.finish(True)
    assert calls[-1] == "commit"


@pytest.mark.parametrize("index", [np.s_[:, 1:3], np.s_[[0, 2], 1]], ids=["slice", "fancy"])
def test_preserve_saves_exactly_a_held_array_and_restores_it(index):
    held = np.arange(24, dtype=np.float32).reshape(3, 8)
    original = held.copy()
    rt = context({"past": held})
    rt.preserve(held, index)
    held[index] = -1
    rt.finish(False)
    np.testing.assert_array_equal(held, original)
    rt.preserve(held, index)
    held[index] = -1
    rt.finish(True)  # a success keeps the write
    assert (held[index] == -1).all()


def test_preserve_leaves_a_caller_array_alone():
    caller = np.zeros((2, 4), np.float32)
    for rt in (context(), context({"past": np.zeros((2, 4), np.float32)})):
        assert not rt.holds(caller)
        rt.preserve(caller, np.s_[0])
        assert rt.deferred == []
    assert not context({"past": caller}).holds(caller[:1])  # part of a held value is not the value


def test_a_nested_context_allocates_on_its_own_and_shares_everything_the_run_owns():
    token = object()
    caches = {"past": np.zeros(2, np.float32)}
    rt = RunContext(lambda _rt, _i, shape, dtype: np.zeros(shape, dtype), True, 7, caches, "cache allocator", token)
    rt._node = 3
    inner = rt.nested(lambda _rt, _i, shape, dtype: np.ones(shape, dtype))
    assert (inner.recording, inner.step, inner.caches, inner.cache_allocator, inner.cancel) == (
        True,
        7,
        caches,
        "cache allocator",
        token,
    )
    assert inner._node == 0 and inner.empty(0, (2,), np.float32).tolist() == [1, 1]
    calls = []
    inner.defer(None, lambda: calls.append("inner rollback"))
    inner.count(allocations=2)
    inner.cache_events.append(("past", "cost"))
    assert rt.counters == {"allocations": 2} and rt.cache_events == [("past", "cost")]
    rt.finish(False)
    assert calls == ["inner rollback"]


def test_scratch_comes_from_the_runs_buffers_or_numpy_without_them():
    from onnxkv import SystemAllocator
    from onnxkv.plan.buffers import RunBuffers, slot_allocator
    from onnxkv.plan.context import SCRATCH_POOLED

    alloc = SystemAllocator()
    bufs = RunBuffers(alloc)
    rt = RunContext(slot_allocator(bufs, [False], [(0,)]), False, 0)
    a = rt.scratch((SCRATCH_POOLED // 64, 16), np.float32)
    b = rt.scratch([0, 3], np.float16)  # empty, and small ones: NumPy arrays, no buffer leased
    small = rt.scratch((SCRATCH_POOLED // 4 - 1,), np.float32)
    assert a.shape == (SCRATCH_POOLED // 64, 16) and a.dtype == np.float32
    assert b.shape == (0, 3) and b.dtype == np.float16 and small.nbytes < SCRATCH_POOLED
    assert alloc.stats().allocations == 1
    rt.unscratch(a, b, small)
    c = rt.scratch((SCRATCH_POOLED // 4,), np.float32)
    assert c.__array_interface__["data"][0] == a.__array_interface__["data"][0] and alloc.stats().allocations == 1
    rt.unscratch(c)
    body = rt.nested(lambda _rt, _i, shape, dtype: np.empty(shape, dtype))  # a fused node's body
    e = body.scratch((SCRATCH_POOLED // 4,), np.float32)
    assert e.__array_interface__["data"][0] == a.__array_interface__["data"][0] and alloc.stats().allocations == 1
    body.unscratch(e)
    bufs.close()
    assert alloc.stats().live == 0
    plain = context()  # a context made by hand: NumPy arrays, nothing to hand back
    d = plain.scratch((SCRATCH_POOLED,), np.int32)
    assert d.shape == (SCRATCH_POOLED,) and d.dtype == np.int32
    plain.unscratch(d)
