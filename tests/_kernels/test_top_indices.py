"""onnxkv._kernels.sampling.top_indices (beam search's candidates): the indices of each row's n largest
entries, best first, ties to the lower index, equal to the NumPy twin (reference.top_indices) at every SIMD
level, on random rows with ties, infinities and lengths around the vector width."""

from __future__ import annotations

import numpy as np
import pytest
from onnxkv._kernels.sampling import top_indices

from onnxkv._kernels import reference as R


def _rows(rng, r, n, kind):
    if kind == "normal":
        return rng.standard_normal((r, n)).astype(np.float32)
    if kind == "ties":  # few distinct values: ties at every boundary
        return rng.integers(-3, 3, (r, n)).astype(np.float32)
    x = rng.standard_normal((r, n)).astype(np.float32)  # infinities, and a row of one value
    x[rng.random((r, n)) < 0.2] = -np.inf
    x[rng.random((r, n)) < 0.02] = np.inf
    x[0] = 1.5
    return x


@pytest.mark.parametrize("length", [1, 3, 7, 8, 9, 16, 17, 100, 1000, 32001])
@pytest.mark.parametrize("kind", ["normal", "ties", "infinite"])
def test_equals_the_numpy_twin(simd, length, kind):
    rng = np.random.default_rng([length, len(kind)])
    x = _rows(rng, 3, length, kind)
    for n in sorted({1, min(2, length), min(8, length), min(12, length), min(64, length), min(65, length), length}):
        got = top_indices(x, n)
        np.testing.assert_array_equal(got, R.top_indices(x, n), err_msg=f"n={n}")
        assert got.dtype == np.int64 and got.shape == (3, n)


def test_an_increasing_row_enters_every_entry_and_keeps_the_order():
    """The worst case for the one pass: every entry beats the kept worst (an increasing row); above 64 the
    row is sorted instead, with the same indices."""
    x = np.arange(200, dtype=np.float32)[None, :]
    np.testing.assert_array_equal(top_indices(x, 10), np.arange(199, 189, -1)[None, :])
    np.testing.assert_array_equal(top_indices(-x, 10), np.arange(10)[None, :])
    x = np.arange(40000, dtype=np.float32)[None, :]
    np.testing.assert_array_equal(top_indices(x, 40000), np.arange(39999, -1, -1)[None, :])


def test_bad_arguments_are_refused():
    x = np.zeros((2, 5), np.float32)
    for bad, match in (
        ((x, 0), r"n: expected an int in \[1, 5\]"),
        ((x, 6), r"n: expected an int in \[1, 5\]"),
        ((x, 2.0), r"n: expected an int"),
        ((x, True), r"n: expected an int"),
        ((x.astype(np.float64), 2), r"x"),
        ((x[0], 2), r"x"),
        ((np.asfortranarray(np.zeros((3, 4), np.float32)), 2), r"x"),
        ((np.array([[1.0, np.nan, 0.0]], np.float32), 1), r"x: expected no NaN"),
    ):
        with pytest.raises(ValueError, match=match):
            top_indices(*bad)
    assert top_indices(np.zeros((0, 4), np.float32), 2).shape == (0, 2)
