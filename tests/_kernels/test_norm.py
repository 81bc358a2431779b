import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import assert_close, assert_refused, rand

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


@pytest.mark.parametrize("n", [7, 64, 1000])
def test_rms_norm_of_rows_whose_float32_sum_of_squares_overflows(n, simd):
    """Values near 1e19 overflow a float32 sum of squares: the row came out all zeros (1 / sqrt(inf))."""
    rng = np.random.default_rng(n)
    x = (rand(rng, (3, n), np.float32) * np.float32(1e19)).astype(np.float32)
    x[1] = rand(rng, (n,), np.float32)  # an ordinary row beside them
    x[2, 0] = np.nan
    g = rand(rng, (n,), np.float32)
    out, want = np.full_like(x, 7.0), np.empty_like(x)
    K.rms_norm(x, g, 1e-6, out)
    with np.errstate(all="ignore"):
        R.rms_norm(x, g, 1e-6, want)
    assert np.isnan(out[2]).all() and np.isnan(want[2]).all()
    assert_close(out[:2], want[:2])
    assert np.abs(out[0]).max() > 0.1


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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_norm_valid_calls_skip_python_checks(dtype, python_checks, tmp_path):
    """Valid calls (in place, aliasing, ndarray subclasses) are checked in C and
    give the reference result; an int eps or a 0-row x takes the Python checks."""
    rng = np.random.default_rng(21)
    x, skip, g, b = (
        rand(rng, (3, 40), dtype),
        rand(rng, (3, 40), dtype),
        rand(rng, (40,), dtype),
        rand(rng, (40,), dtype),
    )
    mapped = np.memmap(tmp_path / "x.bin", dtype=dtype, mode="w+", shape=x.shape)
    mapped[...] = x
    out, want = np.empty_like(x), np.empty_like(x)
    K.rms_norm(mapped, g, 1e-5, out)
    R.rms_norm(x, g, 1e-5, want)
    assert_close(out, want)
    s_out, s_want, inplace = np.empty_like(x), np.empty_like(x), skip.copy()
    K.skip_rms_norm(x, inplace, g, b, 1e-5, inplace, s_out)
    R.skip_rms_norm(x, skip, g, b, 1e-5, want, s_want)
    assert_close(inplace, want)
    assert_close(s_out, s_want)
    assert python_checks == []
    K.rms_norm(x, g, 1, out)
    R.rms_norm(x, g, 1.0, want)
    assert_close(out, want)
    assert python_checks[0] == "x"
    python_checks.clear()
    K.skip_rms_norm(x[:0], skip[:0], g, None, 1e-5, out[:0], None)
    assert python_checks[0] == "x"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_norm_fast_checks_defer_to_named_errors(dtype):
    """Every argument the C checks refuse gets today's Python error, nothing written."""
    rng = np.random.default_rng(22)
    d = np.dtype(dtype)
    x, skip, g, b = rand(rng, (4, 8), dtype), rand(rng, (4, 8), dtype), rand(rng, (8,), dtype), rand(rng, (8,), dtype)
    out, s_out = np.full((4, 8), 3.0, dtype), np.full((4, 8), 5.0, dtype)
    swapped = d.newbyteorder()
    readonly = out.copy()
    readonly.flags.writeable = False
    fortran = np.asfortranarray(rand(rng, (4, 8), dtype))
    buf = rand(rng, (5, 8), dtype)  # out = buf[1:] overlaps x = buf[:4] partially
    flat = rand(rng, (40,), dtype)  # out = flat[:32] holds flat[24:32] (gamma / bias)
    shared_out, shared_vec = flat[:32].reshape(4, 8), flat[24:32]
    rms = [
        (
            lambda: K.rms_norm(x.astype(swapped), g, 1e-6, out),
            f"x: dtype {swapped} is not supported (expected float32, float64)",
        ),
        (lambda: K.rms_norm(x.tolist(), g, 1e-6, out), "x: expected a numpy.ndarray, got list"),
        (lambda: K.rms_norm(fortran, g, 1e-6, out), "x: array must be C-contiguous"),
        (
            lambda: K.rms_norm(x, g.astype(swapped), 1e-6, out),
            f"gamma: dtype {swapped} is not supported (expected {d})",
        ),
        (lambda: K.rms_norm(x, g[:7], 1e-6, out), "gamma: expected shape (8,), got (7,)"),
        (lambda: K.rms_norm(x, g, 1e-6, readonly), "out: array must be writeable"),
        (lambda: K.rms_norm(x, g, 1e-6, memoryview(out)), "out: expected a numpy.ndarray, got memoryview"),
        (lambda: K.rms_norm(x, g, 1e-6, np.asfortranarray(out)), "out: array must be C-contiguous"),
        (lambda: K.rms_norm(x, g, 1e-6, out[:, :4]), "out: expected shape (4, 8), got (4, 4)"),
        (lambda: K.rms_norm(buf[:4], g, 1e-6, buf[1:]), "out: must not overlap x (only exact aliasing is allowed)"),
        (lambda: K.rms_norm(x, shared_vec, 1e-6, shared_out), "out: must not overlap gamma"),
        (lambda: K.rms_norm(x, g, float("nan"), out), "eps: must be >= 0, got nan"),
        (lambda: K.rms_norm(x, g, -1e-6, out), "eps: must be >= 0, got -1e-06"),
    ]
    skip_rms = [
        (
            lambda: K.skip_rms_norm(x, skip.astype(swapped), g, b, 1e-6, out, s_out),
            f"skip: dtype {swapped} is not supported (expected {d})",
        ),
        (lambda: K.skip_rms_norm(x, fortran, g, b, 1e-6, out, s_out), "skip: array must be C-contiguous"),
        (lambda: K.skip_rms_norm(x, skip, g, b[:7], 1e-6, out, s_out), "bias: expected shape (8,), got (7,)"),
        (lambda: K.skip_rms_norm(x, skip, g, b.tolist(), 1e-6, out, s_out), "bias: expected a numpy.ndarray, got list"),
        (lambda: K.skip_rms_norm(x, skip, g, b, 1e-6, out, readonly), "sum_out: array must be writeable"),
        (lambda: K.skip_rms_norm(x, skip, g, b, 1e-6, out, out), "sum_out: must not overlap out"),
        (
            lambda: K.skip_rms_norm(buf[:4], skip, g, b, 1e-6, out, buf[1:]),
            "sum_out: must not overlap x (only exact aliasing is allowed)",
        ),
        (
            lambda: K.skip_rms_norm(x, buf[:4], g, b, 1e-6, out, buf[1:]),
            "sum_out: must not overlap skip (only exact aliasing is allowed)",
        ),
        (lambda: K.skip_rms_norm(x, skip, shared_vec, b, 1e-6, out, shared_out), "sum_out: must not overlap gamma"),
        (lambda: K.skip_rms_norm(x, skip, g, shared_vec, 1e-6, out, shared_out), "sum_out: must not overlap bias"),
        (
            lambda: K.skip_rms_norm(x, buf[:4], g, None, 1e-6, buf[1:], None),
            "out: must not overlap skip (only exact aliasing is allowed)",
        ),
        (
            lambda: K.skip_rms_norm(buf[:4], skip, g, None, 1e-6, buf[1:], s_out),
            "out: must not overlap x (only exact aliasing is allowed)",
        ),
        (lambda: K.skip_rms_norm(x, skip, g, shared_vec, 1e-6, shared_out, None), "out: must not overlap bias"),
        (lambda: K.skip_rms_norm(x, skip, g, b, -1.0, out, s_out), "eps: must be >= 0, got -1.0"),
    ]
    for call, message in rms + skip_rms:
        assert_refused(call, message, out, s_out, buf, flat)
