import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import assert_close, rand


def _tables(rng, max_pos, half):
    ang = rng.uniform(0, 2 * np.pi, (max_pos, half))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("B,S,H,D,rot", [(1, 1, 1, 2, 2), (2, 7, 3, 64, 64), (1, 33, 4, 128, 64),
                                         (3, 5, 2, 80, 80), (1, 4, 8, 96, 26), (2, 17, 32, 128, 128)])
def test_rotary(B, S, H, D, rot, interleaved, threads, simd):
    rng = np.random.default_rng(B * 1000 + S * 10 + D)
    x = rand(rng, (B, S, H, D), scale=4.0)
    cos, sin = _tables(rng, 64, rot // 2)
    pos = rng.integers(0, 64, (B, S)).astype(np.int64)
    out, want = np.full_like(x, np.nan), np.empty_like(x)
    K.rotary_embedding(x, cos, sin, pos, interleaved, out)
    R.rotary_embedding(x, cos, sin, pos, interleaved, want)
    assert_close(out, want, scale=4.0)
    np.testing.assert_array_equal(out[..., rot:], x[..., rot:])


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_in_place(interleaved, simd):
    rng = np.random.default_rng(2)
    x = rand(rng, (2, 3, 4, 64))
    cos, sin = _tables(rng, 10, 16)
    pos = np.array([[0, 1, 2], [7, 8, 9]], np.int64)
    want = np.empty_like(x)
    R.rotary_embedding(x, cos, sin, pos, interleaved, want)
    K.rotary_embedding(x, cos, sin, pos, interleaved, x)
    assert_close(x, want)


@pytest.mark.parametrize("bad", [-1, 10, 1 << 40])
def test_rotary_position_out_of_range(bad):
    rng = np.random.default_rng(3)
    x = rand(rng, (1, 3, 2, 16))
    cos, sin = _tables(rng, 10, 8)
    pos = np.array([[0, bad, 2]], np.int64)
    out = np.full_like(x, 9.0)
    with pytest.raises(ValueError, match="positions"):
        K.rotary_embedding(x, cos, sin, pos, False, out)
    assert np.all(out == 9.0)


def test_rotary_bad_shapes():
    rng = np.random.default_rng(4)
    x = rand(rng, (1, 3, 2, 16))
    cos, sin = _tables(rng, 10, 8)
    pos = np.zeros((1, 3), np.int64)
    out = np.full_like(x, 9.0)
    cases = [
        ("sin", lambda: K.rotary_embedding(x, cos, sin[:, :4], pos, False, out)),
        ("cos", lambda: K.rotary_embedding(x, *_tables(rng, 10, 9), pos, False, out)),
        ("positions", lambda: K.rotary_embedding(x, cos, sin, pos.astype(np.int32), False, out)),
        ("positions", lambda: K.rotary_embedding(x, cos, sin, pos[:, :2], False, out)),
        ("out", lambda: K.rotary_embedding(x, cos, sin, pos, False, out[:, :2])),
        ("x", lambda: K.rotary_embedding(x[0], cos, sin, pos, False, out)),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()
    assert np.all(out == 9.0)
