"""onnxkv._kernels.gather.gather_rows against np.take, its checks, and its replay in a compiled step."""

from __future__ import annotations

import numpy as np
import pytest
from onnxkv._kernels._record import Recorder
from onnxkv._kernels.gather import gather_rows
from onnxkv._kernels.step import Program

from .conftest import assert_refused, rand


@pytest.mark.parametrize("n,d,m", [(1, 1, 1), (7, 5, 3), (259, 128, 1), (300, 64, 40)])
def test_rows_equal_np_take_with_negative_indices(n, d, m):
    rng = np.random.default_rng(n + d + m)
    table = rand(rng, (n, d))
    idx = rng.integers(-n, n, m).astype(np.int64)
    out = np.full((m, d), np.nan, np.float32)
    gather_rows(table, idx, out)
    np.testing.assert_array_equal(out, np.take(table, idx, axis=0))


def test_an_index_out_of_range_is_refused_before_any_row_is_written():
    rng = np.random.default_rng(0)
    table, out = rand(rng, (4, 3)), rand(rng, (3, 3))
    for bad, shown in (([0, 4, 1], "indices[1] = 4"), ([1, 2, -5], "indices[2] = -5")):
        assert_refused(
            lambda bad=bad: gather_rows(table, np.array(bad, np.int64), out),
            f"indices: {shown} is out of range [-4, 4)",
            out,
        )
    with pytest.raises(ValueError, match="indices"):
        gather_rows(table, np.array([0, 1, 2], np.int32), out)
    with pytest.raises(ValueError, match="out"):
        gather_rows(table, np.array([0, 1], np.int64), out)


def test_replay_reads_the_indices_of_the_run_and_refuses_bad_ones():
    rng = np.random.default_rng(1)
    table = rand(rng, (10, 8))
    idx, out = np.array([3, -1], np.int64), np.empty((2, 8), np.float32)
    rec = Recorder()
    with rec:
        gather_rows(table, idx, out)
    program = Program(rec.calls, [idx])
    assert program.run([np.array([0, 9], np.int64)])
    np.testing.assert_array_equal(out, table[[0, 9]])
    out_before = out.copy()
    assert not program.run([np.array([10, 0], np.int64)])
    np.testing.assert_array_equal(out, out_before)


def test_without_wrap_only_rows_from_zero_are_taken_and_a_negative_index_is_refused():
    rng = np.random.default_rng(2)
    table, out = rand(rng, (6, 4)), np.empty((3, 4), np.float32)
    gather_rows(table, np.array([5, 0, 2], np.int64), out, wrap=False)
    np.testing.assert_array_equal(out, table[[5, 0, 2]])
    before = out.copy()
    assert_refused(
        lambda: gather_rows(table, np.array([1, -1, 2], np.int64), out, wrap=False),
        "indices: indices[1] = -1 is out of range [0, 6)",
        out,
    )
    np.testing.assert_array_equal(out, before)


def test_a_replay_without_wrap_refuses_a_negative_index_the_wrapping_one_takes():
    rng = np.random.default_rng(3)
    table = rand(rng, (10, 8))
    for wrap in (True, False):
        idx, out = np.array([3, 4], np.int64), np.empty((2, 8), np.float32)
        rec = Recorder()
        with rec:
            gather_rows(table, idx, out, wrap=wrap)
        program = Program(rec.calls, [idx])
        assert program.run([np.array([1, 9], np.int64)])
        np.testing.assert_array_equal(out, table[[1, 9]])
        assert bool(program.run([np.array([-1, 0], np.int64)])) == wrap
        np.testing.assert_array_equal(out, table[[-1, 0]] if wrap else table[[1, 9]])


def test_a_gather_call_with_a_wrap_flag_other_than_0_or_1_is_refused_when_built():
    rng = np.random.default_rng(4)
    table, idx, out = rand(rng, (4, 2)), np.array([1], np.int64), np.empty((1, 2), np.float32)
    rec = Recorder()
    with rec:
        gather_rows(table, idx, out)
    kind, arrays, ints, floats = rec.calls[0]
    for bad in ((4, 2, 1), (4, 2, 1, 2)):
        with pytest.raises(ValueError, match="gather call 0"):
            Program([(kind, arrays, bad, floats)], [idx])
