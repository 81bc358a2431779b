import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import assert_close, rand

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
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_silu_mul(n, dtype, scale, threads, simd):
    rng = np.random.default_rng(n + 1)
    gate, up = rand(rng, (n,), dtype, scale), rand(rng, (n,), dtype)
    out, want = np.full_like(gate, np.nan), np.empty_like(gate)
    K.silu_mul(gate, up, out)
    R.silu_mul(gate, up, want)
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
    with pytest.raises(ValueError, match="out"):
        K.silu(g, out[::2])
    with pytest.raises(ValueError, match="x"):
        K.sigmoid(g.astype(np.float16), out)
    with pytest.raises(ValueError, match="out"):
        K.silu_mul(g, g, np.empty(8, np.float64))
    assert np.all(out == 3.0)
