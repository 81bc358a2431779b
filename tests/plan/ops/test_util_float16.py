"""The float16 conversions of the plan's float16 paths (onnxkv.plan.ops._util): widened and round_into give
NumPy's casts bit for bit -- subnormals, overflow to infinity, signed zeros, NaN staying NaN -- on C-contiguous
arrays (the F16C kernel) and on views (NumPy)."""

from __future__ import annotations

import numpy as np
import pytest

from onnxkv.plan.ops._util import round_into, widened


def _values(rng) -> np.ndarray:
    x = (rng.standard_normal(4096) * rng.choice([1e-7, 1e-5, 1.0, 300.0, 7e4], 4096)).astype(np.float32)
    x[:6] = [0.0, -0.0, np.inf, -np.inf, 65519.0, 65520.0]  # 65520 rounds to infinity, 65519 to 65504
    return x


@pytest.mark.parametrize("view", [False, True], ids=["contiguous", "strided"])
def test_round_into_is_numpys_cast(view):
    wide = _values(np.random.default_rng(1)).reshape(64, 64)
    src = wide[:, ::2] if view else wide
    out = np.empty(src.shape, np.float16)
    with np.errstate(over="ignore"):
        want = src.astype(np.float16)
    np.testing.assert_array_equal(round_into(out, src).view(np.uint16), want.view(np.uint16))


def test_round_into_keeps_nan_and_other_dtypes():
    wide = np.array([np.nan, 1.0, -np.nan], np.float32)
    out = round_into(np.empty(3, np.float16), wide)
    assert np.isnan(out[[0, 2]]).all() and out[1] == 1.0
    as_float32 = round_into(np.empty(3, np.float32), wide)  # not float16: NumPy's copy
    np.testing.assert_array_equal(as_float32, wide)


@pytest.mark.parametrize("view", [False, True], ids=["contiguous", "strided"])
def test_widened_is_exact(view):
    with np.errstate(over="ignore"):
        half = _values(np.random.default_rng(2)).astype(np.float16).reshape(64, 64)
    src = half[::2] if view else half
    got = widened(src)
    assert got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, src.astype(np.float32))


@pytest.mark.parametrize("threads", [1, 2])
def test_add_float16_is_numpys_float16_add(threads):
    """add_float16 (the float32 sum of the widenings, rounded once) gives NumPy's float16 add bit for bit:
    cancellation, subnormal sums, overflow to infinity, infinities and NaN (any NaN for NaN)."""
    from onnxkv import _kernels as K
    from onnxkv.plan.ops._util import add_float16, float16_pair

    rng = np.random.default_rng(2)
    with np.errstate(over="ignore"):
        a, b = _values(rng).astype(np.float16), _values(rng).astype(np.float16)
    b[:8] = [-a[8], 65504, -65504, np.nan, 6e-8, -6e-8, 1e-4, 32768]  # cancellation, overflow, NaN, subnormals
    a[:8] = [1.0, 32.0, -32.0, 1.0, 6e-8, 1.2e-7, -1e-4, 32768]
    a, b = a.reshape(64, 64), b.reshape(64, 64)
    assert float16_pair(a, b) and not float16_pair(a, b[:, :32]) and not float16_pair(a[:, ::2], b[:, ::2])
    out = np.empty_like(a)
    with K.use_settings(K.current_settings().replace(threads=threads)), np.errstate(over="ignore", invalid="ignore"):
        add_float16(a, b, out)
        want = a + b
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out[~nan].view(np.uint16), want[~nan].view(np.uint16))
