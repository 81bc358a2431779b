import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import assert_close, assert_refused, rand

SIZES = [1, 7, 33, 4096, 70001]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", [1.0, 40.0])
@pytest.mark.parametrize("name", ["sigmoid", "silu"])
def test_unary(name, n, dtype, scale, threads, simd):
    rng = np.random.default_rng(n)
    x = rand(rng, (n,), dtype, scale)
    out, want = np.full_like(x, np.nan), np.empty_like(x)
    getattr(K, name)(x, out)
    getattr(R, name)(x, want)
    assert_close(out, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["sigmoid", "silu"])
def test_unary_at_the_edges_of_the_float_range(name, dtype, simd):
    """The vector paths gave sigmoid(NaN) = 1 and a floor of 4.2e-39 below x = -88.4, so silu(-3e38) was
    -1.25 and silu(-inf) -inf (the twin: NaN, 0, -0 and NaN); every lane position is tried."""
    edges = np.array([np.nan, -np.inf, np.inf, -3e38, 3e38, -1e30, -100.0, -88.5, -88.3, 0.0, -0.0, 1e-30], dtype)
    for shift in range(8):
        x = np.roll(np.concatenate([edges, np.linspace(-3, 3, 9).astype(dtype)]), shift)
        out, want = np.full_like(x, 7.0), np.empty_like(x)
        getattr(K, name)(x, out)
        with np.errstate(all="ignore"):
            getattr(R, name)(x, want)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
        np.testing.assert_allclose(np.nan_to_num(out), np.nan_to_num(want), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", [1.0, 40.0])
@pytest.mark.parametrize("name", ["silu_mul", "gelu_tanh_mul"])
def test_gated(name, n, dtype, scale, threads, simd):
    rng = np.random.default_rng(n + 1)
    gate, up = rand(rng, (n,), dtype, scale), rand(rng, (n,), dtype)
    out, want = np.full_like(gate, np.nan), np.empty_like(gate)
    getattr(K, name)(gate, up, out)
    getattr(R, name)(gate, up, want)
    assert_close(out, want, scale=scale)


def test_silu_mul_nd_and_in_place(simd):
    rng = np.random.default_rng(5)
    gate, up = rand(rng, (3, 5, 11)), rand(rng, (3, 5, 11))
    want = np.empty_like(gate)
    R.silu_mul(gate, up, want)
    K.silu_mul(gate, up, up)
    assert_close(up, want)


def test_activation_bad_args():
    g = np.ones(8, np.float32)
    out = np.full(8, 3.0, np.float32)
    with pytest.raises(ValueError, match="up"):
        K.silu_mul(g, np.ones(7, np.float32), out)
    with pytest.raises(ValueError, match="up"):
        K.silu_mul(g, np.ones(8, np.float64), out)
    for bad in (np.ones(7, np.float32), np.ones(8, np.float64)):  # add names its second addend y
        with pytest.raises(ValueError, match="y"):
            K.add(g, bad, out)
    np.testing.assert_array_equal(out, 3.0)
    with pytest.raises(ValueError, match="out"):
        K.silu(g, out[::2])
    with pytest.raises(ValueError, match="x"):
        K.sigmoid(g.astype(np.float16), out)
    with pytest.raises(ValueError, match="out"):
        K.silu_mul(g, g, np.empty(8, np.float64))
    assert np.all(out == 3.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_activation_valid_calls_skip_python_checks(dtype, python_checks):
    """Valid 1-D calls (with or without aliasing) are checked in C and give the
    reference result; N-D arrays take the Python checks."""
    rng = np.random.default_rng(41)
    gate, up = rand(rng, (50,), dtype, 4.0), rand(rng, (50,), dtype)
    for name in ("sigmoid", "silu"):
        out, want, inplace = np.empty_like(gate), np.empty_like(gate), gate.copy()
        getattr(K, name)(gate, out)
        getattr(K, name)(inplace, inplace)
        getattr(R, name)(gate, want)
        assert_close(out, want)
        assert_close(inplace, want)
    out, want, inplace = np.empty_like(gate), np.empty_like(gate), up.copy()
    K.silu_mul(gate, up, out)
    K.silu_mul(gate, inplace, inplace)
    R.silu_mul(gate, up, want)
    assert_close(out, want, scale=4.0)
    assert_close(inplace, want, scale=4.0)
    assert python_checks == []
    K.silu_mul(gate.reshape(5, 10), up.reshape(5, 10), out.reshape(5, 10))
    assert_close(out, want, scale=4.0)
    assert python_checks[0] == "gate"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_activation_fast_checks_defer_to_named_errors(dtype):
    """Every argument the C checks refuse gets today's Python error, nothing written."""
    rng = np.random.default_rng(42)
    d = np.dtype(dtype)
    swapped = d.newbyteorder()
    g, u = rand(rng, (16,), dtype), rand(rng, (16,), dtype)
    out = np.full(16, 3.0, dtype)
    readonly = out.copy()
    readonly.flags.writeable = False
    buf = rand(rng, (20,), dtype)  # x or up = buf[:16], out = buf[4:]: partial overlap
    cases = [
        (lambda: K.silu(g.astype(swapped), out), f"x: dtype {swapped} is not supported (expected float32, float64)"),
        (lambda: K.sigmoid(g.tolist(), out), "x: expected a numpy.ndarray, got list"),
        (lambda: K.silu(rand(rng, (32,), dtype)[::2], out), "x: array must be C-contiguous"),
        (lambda: K.silu_mul(g, u.astype(swapped), out), f"up: dtype {swapped} is not supported (expected {d})"),
        (lambda: K.silu_mul(g, u[:15], out), "up: expected shape (16,), got (15,)"),
        (lambda: K.silu_mul(g, u, readonly), "out: array must be writeable"),
        (lambda: K.silu_mul(g, u, memoryview(out)), "out: expected a numpy.ndarray, got memoryview"),
        (lambda: K.sigmoid(g, rand(rng, (32,), dtype)[::2]), "out: array must be C-contiguous"),
        (lambda: K.silu(g, out[:8]), "out: expected shape (16,), got (8,)"),
        (lambda: K.silu(buf[:16], buf[4:]), "out: must not overlap x (only exact aliasing is allowed)"),
        (lambda: K.silu_mul(buf[:16], u, buf[4:]), "out: must not overlap gate (only exact aliasing is allowed)"),
        (lambda: K.silu_mul(g, buf[:16], buf[4:]), "out: must not overlap up (only exact aliasing is allowed)"),
    ]
    for call, message in cases:
        assert_refused(call, message, out, buf)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", [0.3, 3.0])
def test_erf_within_an_ulp_of_the_float64_twin(n, dtype, scale, threads):
    rng = np.random.default_rng(n)
    x = rand(rng, (n,), dtype, scale)
    out, want = np.full_like(x, np.nan), np.empty_like(x)
    K.erf(x, out)
    R.erf(x, want)
    ulps = np.abs(out.astype(np.float64) - want) / np.spacing(np.abs(want))
    assert ulps.max() <= 1.0


def test_erf_edges_shapes_and_aliasing():
    x = np.array([[np.nan, -np.inf, np.inf, 0.0], [-0.0, 1e-30, 6.0, -6.0]], np.float32)
    out = np.empty_like(x)
    K.erf(x, out)
    np.testing.assert_array_equal(
        out, np.array([[np.nan, -1, 1, 0], [-0.0, np.float32(1.1283792e-30), 1, -1]], np.float32)
    )
    assert np.signbit(out[1, 0])
    y = x.copy()
    K.erf(y, y)
    np.testing.assert_array_equal(y, out)
    K.erf(np.empty(0, np.float32), np.empty(0, np.float32))
    with pytest.raises(ValueError, match="x: dtype float16"):
        K.erf(x.astype(np.float16), out)
    with pytest.raises(ValueError, match="out: expected shape"):
        K.erf(x, out[:1])
    with pytest.raises(ValueError, match="out: must not overlap x"):
        K.erf(x.reshape(-1)[1:], x.reshape(-1)[:-1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", SIZES)
def test_add_equals_its_twin_bit_for_bit_in_place_or_not(n, dtype, threads, simd):
    rng = np.random.default_rng(n + 5)
    x, y = rand(rng, (n,), dtype, 30.0), rand(rng, (n,), dtype)
    out, want = np.full_like(x, np.nan), np.empty_like(x)
    K.add(x, y, out)
    R.add(x, y, want)
    np.testing.assert_array_equal(out, want)  # one rounding per sum: exactly NumPy's
    K.add(x, y, y)  # out may be an addend
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_tanh_mul_at_the_edges_of_the_float_range(dtype, simd):
    edges = np.array([np.nan, -np.inf, np.inf, -3e38, 3e38, -1e30, -100.0, -10.0, -0.0, 0.0, 1e-30, 6.0], dtype)
    for shift in range(8):
        gate = np.roll(np.concatenate([edges, np.linspace(-4, 4, 9).astype(dtype)]), shift)
        up = np.linspace(0.5, 2.0, gate.size).astype(dtype)
        out, want = np.full_like(gate, 7.0), np.empty_like(gate)
        K.gelu_tanh_mul(gate, up, out)
        R.gelu_tanh_mul(gate, up, want)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
        np.testing.assert_allclose(np.nan_to_num(out), np.nan_to_num(want), rtol=2e-6, atol=1e-30)


def test_gelu_tanh_mul_is_replayed_by_a_compiled_step():
    from onnxkv._kernels._record import Recorder
    from onnxkv._kernels.step import Program

    rng = np.random.default_rng(9)
    gate, up, out = rand(rng, (37,)), rand(rng, (37,)), np.empty(37, np.float32)
    rec = Recorder()
    with rec:
        K.gelu_tanh_mul(gate, up, out)
    program = Program(rec.calls, [gate, up])
    g2, u2 = rand(rng, (37,)), rand(rng, (37,))
    assert program.run([g2, u2])
    want = np.empty_like(out)
    K.gelu_tanh_mul(g2, u2, want)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", ["mul_scalar", "div_scalar"])
def test_scalar_products_equal_their_twins_bit_for_bit(name, n, dtype, threads, simd):
    rng = np.random.default_rng(n + 11)
    x, c = rand(rng, (n,), dtype, 30.0), np.array([-0.37], dtype)
    out, want = np.full_like(x, np.nan), np.empty_like(x)
    getattr(K, name)(x, c, out)
    getattr(R, name)(x, c, want)
    np.testing.assert_array_equal(out, want)  # one rounding per element: exactly NumPy's
    getattr(K, name)(x, c.reshape(1, 1), x)  # out may be x; c of any shape holding one value
    np.testing.assert_array_equal(x, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("cap", [0.7, 30.0])
def test_softcap_is_close_to_its_float64_twin(n, dtype, cap, threads, simd):
    rng = np.random.default_rng(n + 13)
    x = rand(rng, (n,), dtype, 2 * cap)
    c = np.array([cap], dtype)
    out, want = np.full_like(x, np.nan), np.empty_like(x)
    K.softcap(x, c, out)
    R.softcap(x, c, want)
    tol = 4e-7 if dtype == np.float32 else 1e-15  # a few float32 ulps of the value, relative
    np.testing.assert_allclose(out, want, rtol=tol, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softcap_at_the_edges_of_the_float_range(dtype, simd):
    """NaN stays NaN, +-inf caps to +-c, signed zeros and subnormal quotients keep their sign and value, and
    the polynomial's side (|x / c| < 0.5) meets the exponential's at 0.5: at every lane position."""
    c = np.array([30.0], dtype)
    edges = np.array([np.nan, -np.inf, np.inf, -3e38, 3e38, -0.0, 0.0, 1e-30, -1e-30, 14.999, 15.0, -15.001], dtype)
    for shift in range(8):
        x = np.roll(np.concatenate([edges, np.linspace(-60, 60, 9).astype(dtype)]), shift)
        out, want = np.full_like(x, 7.0), np.empty_like(x)
        K.softcap(x, c, out)
        with np.errstate(all="ignore"):
            R.softcap(x, c, want)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
        np.testing.assert_array_equal(np.signbit(out), np.signbit(want))
        np.testing.assert_allclose(np.nan_to_num(out), np.nan_to_num(want), rtol=4e-7, atol=0)


def test_scalar_modes_name_a_bad_value():
    x, out = np.ones(8, np.float32), np.empty(8, np.float32)
    assert_refused(lambda: K.softcap(x, np.ones(2, np.float32), out), "c: must hold one value, got shape (2,)", out)
    with pytest.raises(ValueError, match="c: must not overlap|out: must not overlap c"):
        K.mul_scalar(x, out[3:4], out)  # the value inside the output: written while read
    with pytest.raises((TypeError, ValueError), match="c"):
        K.div_scalar(x, np.ones(1, np.float64), out)


@pytest.mark.parametrize("name", ["mul_scalar", "div_scalar", "softcap"])
def test_scalar_modes_are_replayed_by_a_compiled_step(name):
    from onnxkv._kernels._record import Recorder
    from onnxkv._kernels.step import Program

    rng = np.random.default_rng(17)
    x, c, out = rand(rng, (37,), np.float32, 20.0), np.array([3.5], np.float32), np.empty(37, np.float32)
    rec = Recorder()
    with rec:
        getattr(K, name)(x, c, out)
    program = Program(rec.calls, [x])
    x2 = rand(rng, (37,), np.float32, 20.0)
    assert program.run([x2])
    want = np.empty_like(out)
    getattr(K, name)(x2, c, want)
    np.testing.assert_array_equal(out, want)
    kind, arrays, ints, floats = rec.calls[0]
    # a mode beyond the kernels'; a vector mode over a one-value operand; more values than the arrays
    for bad in ((8, 37), (2, 37), (int(ints[0]), 38)):
        with pytest.raises(ValueError, match="activation call 0"):
            Program([(kind, arrays, bad, floats)], [x])
