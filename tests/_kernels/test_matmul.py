import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import matmul as MM
from onnxkv._kernels import reference as R

from .conftest import rand

MS = [1, 2, 3, 8, 17]
KN = [(1, 1), (7, 33), (33, 7), (256, 1024), (1024, 256), (33, 2816), (1024, 2816), (2816, 65), (256, 1)]


def check(x, w, bias=None):
    M, Kd = x.shape
    N = w.shape[1]
    out, want = np.full((M, N), np.nan, np.float32), np.empty((M, N), np.float32)
    K.matmul_rows(x, w, out, bias)
    R.matmul_rows(x, w, want, bias)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.sqrt(max(Kd, 1)))


@pytest.mark.parametrize("kn", KN, ids=lambda kn: f"K{kn[0]}xN{kn[1]}")
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_matmul_rows(M, kn, with_bias, threads, simd):
    Kd, N = kn
    rng = np.random.default_rng(M * 100003 + Kd * 101 + N)
    x, w = rand(rng, (M, Kd)), rand(rng, (Kd, N))
    bias = rand(rng, (N,)) if with_bias else None
    check(x, w, bias)


@pytest.mark.parametrize("M", [4, 5, 6, 7, 9, 16, 31, 64, 70])
@pytest.mark.parametrize("N", [8, 63, 64, 65, 129, 200, 1025, 2049])
def test_matmul_rows_row_groups_and_tails(M, N, threads, simd):
    """Odd and even row counts (row pairs + a single row), column tails, one or
    several column segments (segment width depends on M and the thread count)."""
    rng = np.random.default_rng(M * 1000 + N)
    Kd = 299  # 4-row k steps plus a remainder
    check(rand(rng, (M, Kd)), rand(rng, (Kd, N)), rand(rng, (N,)))


def test_matmul_rows_exact_small_integers(simd):
    """Small integers sum exactly in float32 whatever the order: bit-exact result."""
    rng = np.random.default_rng(7)
    x = rng.integers(-3, 4, (5, 515)).astype(np.float32)
    w = rng.integers(-3, 4, (515, 77)).astype(np.float32)
    b = rng.integers(-3, 4, 77).astype(np.float32)
    out = np.empty((5, 77), np.float32)
    K.matmul_rows(x, w, out, b)
    np.testing.assert_array_equal(out, x.astype(np.float64) @ w + b)


def test_matmul_rows_threads_agree(simd):
    """1 and 2 threads split columns, not sums: identical results."""
    # (segment widths differ between 1 and 2 threads; each column's sum order does not)
    rng = np.random.default_rng(3)
    x, w, b = rand(rng, (3, 1024)), rand(rng, (1024, 1000)), rand(rng, (1000,))
    one, two = outputs_by_threads(lambda o: K.matmul_rows(x, w, o, b), (3, 1000))
    np.testing.assert_array_equal(one, two)


def outputs_by_threads(call, shape):
    """[out with 1 thread, out with 2 threads] of call(out) for a fresh float32 out each time."""
    outs = []
    old = K.get_num_threads()
    try:
        for nt in (1, 2):
            K.set_num_threads(nt)
            o = np.empty(shape, np.float32)
            call(o)
            outs.append(o)
    finally:
        K.set_num_threads(old)
    return outs


def test_matmul_rows_readonly_inputs_and_empty():
    rng = np.random.default_rng(1)
    x, w, b = rand(rng, (2, 9)), rand(rng, (9, 5)), rand(rng, (5,))
    for a in (x, w, b):
        a.flags.writeable = False
    check(x, w, b)
    # K == 0: out = bias (or 0); M == 0 / N == 0: nothing to do
    out = np.full((2, 5), np.nan, np.float32)
    K.matmul_rows(np.empty((2, 0), np.float32), np.empty((0, 5), np.float32), out, b)
    np.testing.assert_array_equal(out, np.broadcast_to(b, (2, 5)))
    K.matmul_rows(np.empty((2, 0), np.float32), np.empty((0, 5), np.float32), out)
    np.testing.assert_array_equal(out, 0)
    K.matmul_rows(np.empty((0, 9), np.float32), w, np.empty((0, 5), np.float32))
    K.matmul_rows(x, np.empty((9, 0), np.float32), np.empty((2, 0), np.float32))


def test_matmul_rows_bad_args():
    f = np.float32
    x, w = np.ones((2, 8), f), np.ones((8, 4), f)
    out = np.full((2, 4), 3.0, f)
    cases = [
        ("x", lambda: K.matmul_rows(x.astype(np.float64), w, out)),
        ("x", lambda: K.matmul_rows(np.ones(8, f), w, out)),
        ("x", lambda: K.matmul_rows(np.ones((2, 16), f)[:, ::2], w, out)),
        ("x", lambda: K.matmul_rows([[1.0] * 8] * 2, w, out)),
        ("x", lambda: K.matmul_rows(x.astype(">f4"), w, out)),
        ("w", lambda: K.matmul_rows(x, np.ones((7, 4), f), out)),
        ("w", lambda: K.matmul_rows(x, np.ones((8, 4), np.float16), out)),
        ("w", lambda: K.matmul_rows(x, np.asfortranarray(np.ones((8, 4), f)), out)),
        ("w", lambda: K.matmul_rows(x, np.ones((8, 4, 1), f), out)),
        ("bias", lambda: K.matmul_rows(x, w, out, np.ones(5, f))),
        ("bias", lambda: K.matmul_rows(x, w, out, np.ones(4, np.float64))),
        ("bias", lambda: K.matmul_rows(x, w, out, np.ones((1, 4), f))),
        ("out", lambda: K.matmul_rows(x, w, np.ones((2, 5), f))),
        ("out", lambda: K.matmul_rows(x, w, np.ones((2, 4), np.float64))),
        ("out", lambda: K.matmul_rows(x, w, np.ones((2, 8), f)[:, ::2])),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()
    assert np.all(out == 3.0)
    # overlap with each input: out left unchanged
    buf = np.arange(40, dtype=f)
    xo, oo = buf[:16].reshape(2, 8), buf[8:16].reshape(2, 4)
    before = buf.copy()
    with pytest.raises(ValueError, match="out: must not overlap x"):
        K.matmul_rows(xo, w, oo)
    wo = buf[:32].reshape(8, 4)
    with pytest.raises(ValueError, match="out: must not overlap w"):
        K.matmul_rows(x, wo, buf[24:32].reshape(2, 4))
    bo = buf[32:36]
    with pytest.raises(ValueError, match="out: must not overlap bias"):
        K.matmul_rows(x, w, buf[32:40].reshape(2, 4), bo)
    np.testing.assert_array_equal(buf, before)
    ro = np.zeros((2, 4), f)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out"):
        K.matmul_rows(x, w, ro)
    assert np.all(ro == 0)


@pytest.mark.parametrize("M", [1, 2, 5, 9])
def test_matmul_rows_wide(M, threads, simd):
    """N wider than every segment cap (several segments even on one thread)."""
    rng = np.random.default_rng(M + 11)
    N, Kd = 8197, 37
    check(rand(rng, (M, Kd)), rand(rng, (Kd, N)), rand(rng, (N,)))


# -- packed weights (pack_weight / matmul_packed) -------------------------------------------------


def check_packed(x, w, bias=None):
    M, Kd = x.shape
    N = w.shape[1]
    wp = MM.pack_weight(w)
    out, want = np.full((M, N), np.nan, np.float32), np.empty((M, N), np.float32)
    MM.matmul_packed(x, wp, out, bias)
    R.matmul_packed(x, R.pack_weight(w), want, bias)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.sqrt(max(Kd, 1)))


#: Weight dtypes of the packed products: float32 panels, and float16 panels widened in registers.
WDTYPES = [np.float32, np.float16]


@pytest.mark.parametrize("wdtype", WDTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("Kd,N", [(1, 7), (7, 1), (15, 17), (17, 15), (100, 1023), (1023, 100), (33, 16)])
def test_pack_weight(Kd, N, wdtype):
    """Same values as the NumPy twin (padding zero), in w's dtype, the array on a 64-byte boundary."""
    rng = np.random.default_rng(Kd * 7 + N)
    w = rand(rng, (Kd, N), wdtype)
    w.flags.writeable = False
    wp = MM.pack_weight(w)
    assert wp.shape == (-(-N // 16), Kd, 16) and wp.dtype == wdtype and wp.flags.c_contiguous
    assert wp.ctypes.data % 64 == 0
    np.testing.assert_array_equal(wp, R.pack_weight(w))


@pytest.mark.parametrize("wdtype", WDTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("Kd,N", [(1, 7), (7, 1), (15, 17), (17, 15), (100, 1023), (1023, 100)], ids=lambda v: str(v))
@pytest.mark.parametrize("M", range(1, 17))
def test_matmul_packed(M, Kd, N, wdtype, threads, simd):
    rng = np.random.default_rng([M, Kd, N])
    x, w, b = rand(rng, (M, Kd)), rand(rng, (Kd, N), wdtype), rand(rng, (N,))
    check_packed(x, w)
    check_packed(x, w, b)


@pytest.mark.parametrize("wdtype", WDTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("M", [9, 17, 23, 40, 70])
@pytest.mark.parametrize("Kd", [255, 600, 2100])
def test_matmul_packed_many_rows(M, Kd, wdtype, threads, simd):
    """More rows than one register tile: k-chunks (partial sums kept in out: 256 lines of one panel, 2048 of
    a multi-panel tile) and row-tile tails."""
    rng = np.random.default_rng([M, Kd])
    N = 50
    check_packed(rand(rng, (M, Kd)), rand(rng, (Kd, N), wdtype), rand(rng, (N,)))


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 12, 13, 40])
@pytest.mark.parametrize("Kd,N", [(300, 70), (1024, 1000), (2100, 33)])
def test_matmul_packed_float16_is_its_float32_widening(M, Kd, N, threads, simd):
    """float16 panels are widened exactly and summed in the float32 panels' order: bit for bit the product
    of the float32 widening of the weight (subnormal, zero, inf-free extremes included)."""
    rng = np.random.default_rng([M, Kd, N, 16])
    w = rand(rng, (Kd, N), np.float16)
    w.reshape(-1)[::97] = np.float16(6.0e-8)  # subnormal halves
    w.reshape(-1)[1::89] = np.float16(-65504.0)
    x, b = rand(rng, (M, Kd), scale=1e-3), rand(rng, (N,))
    got, want = np.empty((M, N), np.float32), np.empty((M, N), np.float32)
    MM.matmul_packed(x, MM.pack_weight(w), got, b)
    MM.matmul_packed(x, MM.pack_weight(w.astype(np.float32)), want, b)
    np.testing.assert_array_equal(got, want)


def test_matmul_packed_exact_small_integers(simd):
    """Small integers sum exactly in float32 whatever the order: bit-exact result."""
    rng = np.random.default_rng(8)
    for M in (1, 4, 19):
        x = rng.integers(-3, 4, (M, 515)).astype(np.float32)
        w = rng.integers(-3, 4, (515, 77)).astype(np.float32)
        b = rng.integers(-3, 4, 77).astype(np.float32)
        out = np.empty((M, 77), np.float32)
        MM.matmul_packed(x, MM.pack_weight(w), out, b)
        np.testing.assert_array_equal(out, x.astype(np.float64) @ w + b)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 12])
def test_matmul_packed_threads_agree(M, simd):
    """1 and 2 threads split panels, not sums: identical results, also where
    the split cuts a group of panels that one thread takes in one tile."""
    rng = np.random.default_rng([4, M])
    x, w, b = rand(rng, (M, 1024)), rand(rng, (1024, 1000)), rand(rng, (1000,))
    wp = MM.pack_weight(w)
    one, two = outputs_by_threads(lambda o: MM.matmul_packed(x, wp, o, b), (M, 1000))
    np.testing.assert_array_equal(one, two)


def test_matmul_packed_empty():
    rng = np.random.default_rng(2)
    b = rand(rng, (5,))
    out = np.full((2, 5), np.nan, np.float32)
    MM.matmul_packed(np.empty((2, 0), np.float32), MM.pack_weight(np.empty((0, 5), np.float32)), out, b)
    np.testing.assert_array_equal(out, np.broadcast_to(b, (2, 5)))
    MM.matmul_packed(np.empty((2, 0), np.float32), MM.pack_weight(np.empty((0, 5), np.float32)), out)
    np.testing.assert_array_equal(out, 0)
    wp = MM.pack_weight(rand(rng, (9, 5)))
    MM.matmul_packed(np.empty((0, 9), np.float32), wp, np.empty((0, 5), np.float32))
    MM.matmul_packed(rand(rng, (2, 9)), MM.pack_weight(np.empty((9, 0), np.float32)), np.empty((2, 0), np.float32))


def test_matmul_packed_bad_args():
    f = np.float32
    x, b = np.ones((2, 8), f), np.ones(20, f)
    wp = MM.pack_weight(np.ones((8, 20), f))
    out = np.full((2, 20), 3.0, f)
    cases = [
        ("x", lambda: MM.matmul_packed(x.astype(np.float64), wp, out)),
        ("x", lambda: MM.matmul_packed(np.ones(8, f), wp, out)),
        ("wp", lambda: MM.matmul_packed(x, np.ones((8, 20), f), out)),
        ("wp", lambda: MM.matmul_packed(x, MM.pack_weight(np.ones((7, 20), f)), out)),
        ("wp", lambda: MM.matmul_packed(x, np.ones((2, 8, 8), f), out)),
        ("out", lambda: MM.matmul_packed(x, wp, np.ones((2, 33), f))),
        ("out", lambda: MM.matmul_packed(x, wp, np.ones((2, 16), f))),
        ("out", lambda: MM.matmul_packed(x, wp, np.ones((3, 20), f))),
        ("out", lambda: MM.matmul_packed(x, wp, np.ones((2, 20), np.float64))),
        ("bias", lambda: MM.matmul_packed(x, wp, out, np.ones(21, f))),
        ("bias", lambda: MM.matmul_packed(x, wp, out, b.astype(np.float64))),
        ("w", lambda: MM.pack_weight(np.ones((8, 20), np.float64))),
        ("w", lambda: MM.pack_weight(np.ones((8, 20), ">f2"))),
        ("x", lambda: MM.matmul_packed(x.astype(np.float16), MM.pack_weight(np.ones((8, 20), np.float16)), out)),
        ("wp", lambda: MM.matmul_packed(x, wp.astype(np.float64), out)),
        ("wp", lambda: MM.matmul_packed(x, MM.pack_weight(np.ones((8, 20), np.float16)).astype(">f2"), out)),
        ("w", lambda: MM.pack_weight(np.ones(8, f))),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()
    assert np.all(out == 3.0)
    buf = np.arange(40, dtype=f)
    with pytest.raises(ValueError, match="out: must not overlap x"):
        MM.matmul_packed(buf[:16].reshape(2, 8), wp, buf[:40].reshape(2, 20))
    np.testing.assert_array_equal(buf, np.arange(40, dtype=f))
    ro = np.zeros((2, 20), f)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out"):
        MM.matmul_packed(x, wp, ro)
    assert np.all(ro == 0)


def test_matmul_packed_fast_checks_defer_to_named_errors(tmp_path):
    """Valid calls are checked in C; anything the C checks refuse gets the named Python error, nothing written."""
    f = np.float32
    rng = np.random.default_rng(11)
    x, w, b = rand(rng, (2, 8)), rand(rng, (8, 20)), rand(rng, (20,))
    wp = MM.pack_weight(w)
    out = np.full((2, 20), 3.0, f)
    big_endian = x.astype(">f4")
    cases = [
        ("x", lambda: MM.matmul_packed(big_endian, wp, out)),
        ("x", lambda: MM.matmul_packed(x.tolist(), wp, out)),
        ("x", lambda: MM.matmul_packed(np.asfortranarray(rand(rng, (2, 8))), wp, out)),
        ("out", lambda: MM.matmul_packed(x, wp, np.full((20, 2), 3.0, f).T)),
        ("bias", lambda: MM.matmul_packed(x, wp, out, b.astype(">f4"))),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()
    assert np.all(out == 3.0)
    shared = MM.pack_weight(w)
    with pytest.raises(ValueError, match="out: must not overlap wp"):
        MM.matmul_packed(x, shared, shared.reshape(-1)[:40].reshape(2, 20))
    both = np.concatenate([b, np.zeros(20, f)])
    with pytest.raises(ValueError, match="out: must not overlap bias"):
        MM.matmul_packed(x, wp, both.reshape(2, 20), both[:20])
    np.testing.assert_array_equal(both[:20], b)
    # ndarray subclasses pass the C checks: a memory-mapped x gives the same product.
    mapped = np.memmap(tmp_path / "x.bin", dtype=f, mode="w+", shape=x.shape)
    mapped[...] = x
    got, want = np.empty((2, 20), f), np.empty((2, 20), f)
    MM.matmul_packed(mapped, wp, got, b)
    R.matmul_packed(x, R.pack_weight(w), want, b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_fma_peak_probe(simd, threads):
    """The benchmarks' FMA throughput probe runs at every level and thread count and reports a finite
    positive rate; bad step counts are refused by name."""
    from onnxkv._kernels.matmul import fma_peak_gflops

    rate = fma_peak_gflops(10_000)
    assert np.isfinite(rate) and rate > 0
    for bad in (0, -1, 1.5, True, 1 << 41):
        with pytest.raises(ValueError, match="fma_peak_gflops: steps"):
            fma_peak_gflops(bad)
