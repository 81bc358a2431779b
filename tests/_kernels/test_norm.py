import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import assert_close, rand

SHAPES = [(1, 1), (3, 7), (5, 33), (2, 4096), (64, 1000)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_rms_norm(shape, dtype, scale, threads, simd):
    rng = np.random.default_rng(hash((shape, scale)) % 2**32)
    x = rand(rng, shape, dtype, scale)
    g = rand(rng, shape[1:], dtype)
    out, want = np.full_like(x, np.nan), np.empty_like(x)
    K.rms_norm(x, g, 1e-6, out)
    R.rms_norm(x, g, 1e-6, want)
    assert_close(out, want)


def test_rms_norm_in_place(threads, simd):
    rng = np.random.default_rng(1)
    x = rand(rng, (9, 257))
    g = rand(rng, (257,))
    want = np.empty_like(x)
    R.rms_norm(x, g, 1e-5, want)
    K.rms_norm(x, g, 1e-5, x)
    assert_close(x, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_sum", [False, True])
def test_skip_rms_norm(shape, dtype, with_bias, with_sum, threads, simd):
    rng = np.random.default_rng(7)
    x, skip = rand(rng, shape, dtype), rand(rng, shape, dtype, 3.0)
    g = rand(rng, shape[1:], dtype)
    bias = rand(rng, shape[1:], dtype) if with_bias else None
    out, want = np.full_like(x, np.nan), np.empty_like(x)
    s_out = np.full_like(x, np.nan) if with_sum else None
    s_want = np.empty_like(x) if with_sum else None
    K.skip_rms_norm(x, skip, g, bias, 1e-6, out, s_out)
    R.skip_rms_norm(x, skip, g, bias, 1e-6, want, s_want)
    assert_close(out, want)
    if with_sum:
        assert_close(s_out, s_want)


def test_skip_rms_norm_out_is_x(threads, simd):
    rng = np.random.default_rng(3)
    x, skip, g, b = rand(rng, (4, 96)), rand(rng, (4, 96)), rand(rng, (96,)), rand(rng, (96,))
    want, s_want = np.empty_like(x), np.empty_like(x)
    R.skip_rms_norm(x, skip, g, b, 1e-6, want, s_want)
    s_out = np.empty_like(x)
    K.skip_rms_norm(x, skip, g, b, 1e-6, x, s_out)
    assert_close(x, want)
    assert_close(s_out, s_want)


def _bad_calls():
    rng = np.random.default_rng(0)
    x = rand(rng, (4, 8))
    g = rand(rng, (8,))
    yield "gamma", lambda out: K.rms_norm(x, rand(rng, (7,)), 1e-6, out)
    yield "gamma", lambda out: K.rms_norm(x, g.astype(np.float64), 1e-6, out)
    yield "x", lambda out: K.rms_norm(x[:, ::2], g[:4], 1e-6, out[:, :4])
    yield "x", lambda out: K.rms_norm(x.astype(np.int32), g, 1e-6, out)
    yield "x", lambda out: K.rms_norm(x.reshape(2, 2, 8), g, 1e-6, out)
    yield "out", lambda out: K.rms_norm(x, g, 1e-6, out[:3])
    yield "eps", lambda out: K.rms_norm(x, g, -1.0, out)
    yield "skip", lambda out: K.skip_rms_norm(x, x[:2], g, None, 1e-6, out, None)
    yield "bias", lambda out: K.skip_rms_norm(x, x, g, g[:3], 1e-6, out, None)
    yield "sum_out", lambda out: K.skip_rms_norm(x, x, g, None, 1e-6, out, out)


@pytest.mark.parametrize("case", list(range(10)))
def test_bad_arguments_raise_before_writing(case):
    name, call = list(_bad_calls())[case]
    out = np.full((4, 8), 12345.0, np.float32)
    with pytest.raises(ValueError, match=name):
        call(out)
    assert np.all(out == 12345.0)


def test_readonly_out_rejected():
    x = np.ones((2, 3), np.float32)
    out = np.full_like(x, 5.0)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out"):
        K.rms_norm(x, np.ones(3, np.float32), 1e-6, out)


def test_empty_is_noop():
    x = np.empty((0, 8), np.float32)
    out = np.empty_like(x)
    K.rms_norm(x, np.ones(8, np.float32), 1e-6, out)
    assert out.shape == (0, 8)
