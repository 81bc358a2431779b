import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import assert_close, rand


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 33), (2, 4096), (64, 1000)])
@pytest.mark.parametrize("scale", [1.0, 50.0])
def test_softmax(shape, dtype, scale, threads, simd):
    rng = np.random.default_rng(11)
    x = rand(rng, shape, dtype, scale)
    out, want = np.full_like(x, np.nan), np.empty_like(x)
    K.softmax(x, out)
    R.softmax(x, want)
    assert_close(out, want)
    np.testing.assert_allclose(out.sum(axis=-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("empty_row", [0.0, np.nan, -2.5])
def test_softmax_neg_inf(dtype, empty_row, threads, simd):
    rng = np.random.default_rng(12)
    x = rand(rng, (6, 37), dtype, scale=5.0)
    x[0, ::3] = -np.inf  # some masked entries
    x[1, :] = -np.inf  # fully masked row -> empty_row (0 by default; ONNX's Softmax: NaN)
    x[2, 1:] = -np.inf  # a single survivor -> one-hot
    out, want = np.full_like(x, 7.0), np.empty_like(x)
    K.softmax(x, out, empty_row=empty_row)
    R.softmax(x, want, empty_row=empty_row)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    assert_close(np.nan_to_num(out), np.nan_to_num(want))
    assert np.all(out[0, ::3] == 0.0)
    np.testing.assert_array_equal(out[1], np.full(37, empty_row, dtype))
    assert out[2, 0] == 1.0 and np.all(out[2, 1:] == 0.0)


@pytest.mark.parametrize("n", [9, 37, 262_144])
def test_softmax_of_a_row_holding_nan_is_nan_and_long_rows_stay_accurate(n, threads, simd):
    """The vector paths dropped a NaN (maxps) and gave the rest of its row finite values; the scalar
    path summed a vocabulary-sized row in one float and drifted 1.4e-5 off the largest output."""
    rng = np.random.default_rng(n)
    x = rand(rng, (3, n), np.float32, scale=3.0)
    x[1, n // 2] = np.nan
    out, want = np.full_like(x, 7.0), np.empty_like(x)
    K.softmax(x, out)
    with np.errstate(all="ignore"):
        R.softmax(x, want)
    assert np.isnan(out[1]).all() and np.isnan(want[1]).all()
    rows = [0, 2]
    np.testing.assert_allclose(out[rows], want[rows], rtol=0, atol=1e-5 * float(want[rows].max()))


def test_softmax_in_place(simd):
    rng = np.random.default_rng(13)
    x = rand(rng, (3, 100))
    want = np.empty_like(x)
    R.softmax(x, want)
    K.softmax(x, x)
    assert_close(x, want)


def test_softmax_bad_args():
    x = np.ones((2, 5), np.float32)
    out = np.full((2, 5), 7.0, np.float32)
    with pytest.raises(ValueError, match="out"):
        K.softmax(x, out[:, :4])
    with pytest.raises(ValueError, match="out"):
        K.softmax(x, out.astype(np.float64))
    with pytest.raises(ValueError, match="x"):
        K.softmax(np.ones(5, np.float32), out)
    with pytest.raises(ValueError, match="out"):
        K.softmax(x, np.full((2, 5), 7.0, np.float32).T.copy().T)
    assert np.all(out == 7.0)
