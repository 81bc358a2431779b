"""Fixtures for the kernel tests: thread count (1, 2) and instruction-set level
(every level of the kernels), set in the test thread's kernel settings and
restored after the test.

A level this process cannot run -- the build has the scalar path only
(``-Dsimd=disabled``), the CPU lacks it, or ``ONNXKV_MAX_SIMD`` caps it -- is
skipped with the reason the kernel settings give.  CI (.ci/levels) runs the
kernel tests once more under ``ONNXKV_MAX_SIMD`` for each narrower level, and
on the ``-Dsimd=disabled`` build, so that what a narrower machine runs by
default (tests without this fixture, the defaults a module reads at import) is
tested on a wider one too.  ``ONNXKV_TEST_LEVELS`` (comma-separated levels)
narrows the levels this fixture runs: CI's main run forces every level, its
instrumented run takes fewer, and its capped runs none (empty: the tests of
this fixture are skipped there, since they would run what the main run ran)."""

import os

import numpy as np
import pytest

import onnxkv._kernels as K


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def threads(request):
    with K.use_settings(K.current_settings().replace(threads=request.param)):
        yield request.param


#: Every instruction-set level of the kernels, widest first (or those ONNXKV_TEST_LEVELS names).
LEVELS = tuple(x for x in os.environ.get("ONNXKV_TEST_LEVELS", "avx512,avx2,scalar").split(",") if x)


@pytest.fixture(params=LEVELS)
def simd(request):
    """The instruction-set level of the test thread's kernels for one test
    (yields its name); skipped, naming why, where this process cannot run it."""
    try:
        settings = K.current_settings().replace(simd=request.param)
    except ValueError as e:  # "KernelSettings: simd='avx512' is not available: <why> (levels available: ...)"
        pytest.skip(str(e))
    with K.use_settings(settings):
        yield request.param


def rand(rng, shape, dtype=np.float32, scale=1.0):
    """Seeded normal data, never zeros."""
    a = rng.standard_normal(shape) * scale
    return np.ascontiguousarray(a.astype(dtype))


TOL = {np.dtype(np.float32): dict(rtol=1e-5, atol=1e-5), np.dtype(np.float64): dict(rtol=1e-12, atol=1e-12)}


def assert_close(got, want, dtype=None, scale=1.0):
    tol = dict(TOL[np.dtype(dtype or got.dtype)])
    tol["atol"] = tol["atol"] * scale
    np.testing.assert_allclose(got, want, **tol)


@pytest.fixture
def python_checks(monkeypatch):
    """List of the argument names passed to the Python array check
    (``_validate.array``) by kernel wrappers while the test runs: empty when a
    call was fully checked at C speed."""
    from onnxkv._kernels import _validate as V

    names = []
    check = V.array

    def counting(name, *args, **kwargs):
        names.append(name)
        return check(name, *args, **kwargs)

    monkeypatch.setattr(V, "array", counting)
    return names


def assert_refused(call, message, *untouched):
    """``call()`` raises ValueError with exactly ``message`` and leaves the arrays ``untouched`` as they were."""
    before = [a.copy() for a in untouched]
    with pytest.raises(ValueError) as err:
        call()
    assert str(err.value) == message
    for a, b in zip(untouched, before):
        np.testing.assert_array_equal(a, b)
