"""State.sibling, State.append_rows and State.keep_rows: rows of separate paged states over one page pool
moved into one state (how the engine batches requests), each with its own length and pages, no payload
byte copied; errors leave both states as they were."""

from __future__ import annotations

import numpy as np
import pytest

import onnxkv
from onnxkv.errors import InputError, StateError
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.zoo import embedded

PAGED = onnxkv.CacheConfig("paged", block_size=16)


@pytest.fixture(scope="module")
def session():
    return onnxkv.Session(str(embedded.embedded_model_dir()), threads=1, events=True)


def _prompt_state(state, session, n: int):
    """``state`` after one run of an n-token prompt; returns the run's builder."""
    ids = (np.arange(n, dtype=np.int64) * 7 + 3) % 200 + 10
    builder = FeedBuilder(session.plan.inputs, session.model, ids[None], np.array([n]), 0, thread_cache=False)
    feeds, _ = builder.first()
    state.run(feeds, [])
    return builder


def test_rows_move_with_their_lengths_and_pages(session):
    first = session.new_state(cache=PAGED)
    batch = first.sibling()
    assert batch.pool is first.pool and batch.batch == 0
    _prompt_state(first, session, 21)
    second = batch.sibling()
    builder = _prompt_state(second, session, 40)
    values = [first.values, second.values]
    live = first.pool.live_pages
    session.events.clear()
    batch.append_rows(first)
    batch.append_rows(second)
    assert first.closed and second.closed
    assert batch.batch == 2 and batch.lengths.tolist() == [21, 40]
    assert first.pool.live_pages == live  # references passed on, no page made or freed
    moved = [e for e in session.events if e.action == "append_rows"]
    assert len(moved) == 2 and all(e.cow_copied_bytes == 0 and e.allocations == 0 for e in moved)
    got = batch.values
    for name, arr in got.items():
        np.testing.assert_array_equal(arr[0, :, :21], values[0][name][0, :, :21])
        np.testing.assert_array_equal(arr[1, :, :40], values[1][name][0, :, :40])
    # one decode token per row, each at its own length
    out = batch.run(builder.ragged(np.array([5, 6]), batch.lengths), [session.model.io.logits])
    assert out[session.model.io.logits].shape[0] == 2 and batch.lengths.tolist() == [22, 41]
    batch.keep_rows([1])
    assert batch.batch == 1 and batch.lengths.tolist() == [41]
    batch.keep_rows([])
    assert batch.batch == 0 and batch.pool.live_pages == 0
    batch.pool.audit()


def test_bad_moves_leave_both_states_as_they_were(session):
    a = session.new_state(cache=PAGED)
    _prompt_state(a, session, 18)
    other_pool = session.new_state(cache=PAGED)
    _prompt_state(other_pool, session, 10)
    with pytest.raises(InputError, match="another pool"):
        a.append_rows(other_pool)
    with pytest.raises(InputError, match="expected another paged State"):
        a.append_rows(a)
    with pytest.raises(InputError, match="expected another paged State"):
        a.append_rows(session.new_state())
    empty = a.sibling()
    with pytest.raises(StateError, match="holds no cache yet"):
        a.append_rows(empty)
    assert not other_pool.closed and not empty.closed
    assert a.batch == 1 and a.lengths.tolist() == [18] and other_pool.lengths.tolist() == [10]
    with pytest.raises(InputError, match="distinct"):
        a.keep_rows([0, 0])
    with pytest.raises(InputError, match=r"State.keep_rows: indices must be in \[0, 1\), got \[1\]"):
        a.keep_rows([1])
    for bad in ([0.0], [0, None]):  # an object array used to reach np.unique: a raw TypeError
        with pytest.raises(InputError, match="State.keep_rows: indices must be a 1-D int array"):
            a.keep_rows(bad)
    assert a.batch == 1 and a.lengths.tolist() == [18]
    with pytest.raises(StateError, match="needs a paged state"):
        session.new_state().sibling()


def test_compress_rows_converts_only_the_cold_pages_a_row_holds_alone(session):
    first = session.new_state(cache=PAGED)
    _prompt_state(first, session, 70)  # 5 pages, 4 full
    pool = first.pool
    before, values = pool.committed_bytes, first.values
    other = first.fork(1)[0]  # shares every page: nothing may be converted
    assert first.compress_rows([0], "int8", keep_tokens=16) == 0
    other.close()
    with pytest.raises(InputError, match="rows must be in"):
        first.compress_rows([1], "int8")
    with pytest.raises(InputError, match="int9"):
        first.compress_rows([0], "int9")
    for rows in (None, 0, [None], [0.5], ["0"], [[0]]):
        with pytest.raises(InputError, match="State.compress_rows: rows must be a list or 1-D int array"):
            first.compress_rows(rows, "int8")
    for keep in (-1, -(2**63), None, "3", 2.0, True):  # a negative one reached the partly filled last page
        with pytest.raises(InputError, match="State.compress_rows: keep_tokens must be an int ≥ 0"):
            first.compress_rows([0], "int8", keep)
    assert pool.committed_bytes == before and first.compress_rows([], "int8") == 0
    freed = first.compress_rows([0], "int8", keep_tokens=16)  # blocks 0..2: the last 16 + 6 positions stay
    assert freed > 0 and pool.committed_bytes == before - freed
    assert first.compress_rows([0], "int8", keep_tokens=16) == 0  # already int8
    for name, arr in first.values.items():
        cold = values[name][0, :, :48]
        assert not np.array_equal(arr[0, :, :48], cold)  # converted: int8 steps of 1/255 of a head's range
        np.testing.assert_allclose(arr[0, :, :48], cold, atol=np.abs(cold).max() / 50)
        np.testing.assert_array_equal(arr[0, :, 48:70], values[name][0, :, 48:70])
    assert first.compress_rows([0], "int4", keep_tokens=16) > 0
    pool.audit()


def test_a_byte_budget_refuses_pages_past_it_and_converted_pages_make_room(session):
    state = session.new_state(cache=PAGED)
    _prompt_state(state, session, 64)  # 4 full pages
    pool = state.pool
    pool.max_bytes = pool.committed_bytes + pool.page_bytes // 2
    builder = _prompt_state(session.new_state(cache=PAGED), session, 3)
    with pytest.raises(onnxkv.errors.OutOfMemory, match="max_bytes"):
        state.run(builder.ragged(np.array([5]), state.lengths), [])
    assert state.lengths.tolist() == [64]  # nothing changed
    state.compress_rows([0], "int8", keep_tokens=0)
    state.run(builder.ragged(np.array([5]), state.lengths), [])
    assert state.lengths.tolist() == [65] and pool.committed_bytes <= pool.max_bytes
    pool.audit()
