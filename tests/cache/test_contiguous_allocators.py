"""CacheTensor storage from allocators that break their contract or whose free fails."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hostile_allocators import MODES, TYPED_ONLY, Hostile

from onnxkv.cache import bound
from onnxkv.cache.contiguous import CacheTensor
from onnxkv.errors import StateError

SHAPE = (1, 2, 8)  # batch, heads, head size
ALL = {**MODES, **TYPED_ONLY}


def _filled(alloc, capacity=4, length=3):
    c = CacheTensor("past", SHAPE, np.float32, alloc, capacity)
    new = np.random.default_rng(1).standard_normal((1, 2, length, 8)).astype(np.float32)
    c.write(new, 0, length)
    c.commit()
    return c


@pytest.mark.parametrize("mode", sorted(ALL))
def test_storage_is_checked_when_made_and_when_grown(mode):
    error, fragment = ALL[mode]
    alloc = Hostile()
    other = CacheTensor("other", SHAPE, np.float32, alloc, 8)  # a live lease the same bytes could collide with
    alloc.mode = mode
    with pytest.raises(error, match=fragment) as e:
        CacheTensor("past", SHAPE, np.float32, alloc, 4)
    assert "cache 'past': Hostile(" in str(e.value) and "for float32[1, 2, 4, 8]" in str(e.value)
    assert alloc.inner.stats().live == other.nbytes
    alloc.mode = None
    c = _filled(alloc)
    buffer, valid = c.buffer, c.view().copy()
    alloc.mode = mode
    with pytest.raises(error, match=fragment):
        c.write(np.ones((1, 2, 3, 8), np.float32), 3, 6)  # needs 6 > 4 positions: grows
    assert c.buffer is buffer and c.capacity == 4 and c.growths == 0 and c.length == 3 and c.staged is None
    np.testing.assert_array_equal(c.view(), valid)
    alloc.mode = None
    c.write(np.ones((1, 2, 3, 8), np.float32), 3, 6)
    c.commit()
    np.testing.assert_array_equal(c.view(3), valid)
    c.release()
    other.release()
    assert alloc.inner.stats().live == 0


def test_growth_frees_the_committed_storage_at_commit_and_logs_a_failing_free(caplog):
    alloc = Hostile()
    c = _filled(alloc)
    valid = c.view().copy()
    old = c.buffer
    alloc.free_raises = True
    c.reserve(6)  # the committed buffer stays until the run ends: nothing is freed yet
    assert c.capacity == 8 and c.growths == 1 and bound.is_bound(old)
    with caplog.at_level(logging.WARNING, logger="onnxkv.alloc"):
        c.commit()  # published: a failing free is logged, the cache keeps its new storage
    assert sum("hostile free refuses" in r.getMessage() for r in caplog.records) == 1
    assert c.capacity == 8 and c.length == 3
    np.testing.assert_array_equal(c.view(), valid)
    assert bound.is_bound(c.buffer) and not bound.is_bound(old)
    alloc.free_raises = False
    c.release()


def test_second_growth_in_a_run_whose_free_fails_raises_and_discard_restores(caplog):
    alloc = Hostile()
    c = _filled(alloc)
    valid = c.view().copy()
    old = c.buffer
    c.reserve(6)
    alloc.free_raises = True
    with pytest.raises(StateError, match=r"cache 'past': Hostile\(None\)\.free raised RuntimeError") as e:
        c.reserve(12)  # frees the buffer of the first growth, which only this run held
    assert isinstance(e.value.__cause__, RuntimeError)
    assert c.capacity == 16 and c.growths == 2 and bound.is_bound(c.buffer)
    with caplog.at_level(logging.WARNING, logger="onnxkv.alloc"):
        c.discard()  # the failed run: back to the committed storage
    assert c.buffer is old and c.capacity == 4 and c.length == 3 and bound.is_bound(old)
    np.testing.assert_array_equal(c.view(), valid)
    alloc.free_raises = False
    c.release()


def test_release_forgets_the_storage_whatever_free_does(caplog):
    alloc = Hostile()
    c = _filled(alloc)
    buffer = c.buffer
    alloc.free_raises = True
    with caplog.at_level(logging.WARNING, logger="onnxkv.alloc"):
        c.release()
        c.release()  # released already: nothing to do
    assert c.buffer is None and not bound.is_bound(buffer)
    assert sum("hostile free refuses" in r.getMessage() for r in caplog.records) == 1
