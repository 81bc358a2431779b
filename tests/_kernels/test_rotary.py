import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import assert_close, assert_refused, rand


def _tables(rng, max_pos, half):
    ang = rng.uniform(0, 2 * np.pi, (max_pos, half))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    "B,S,H,D,rot",
    [
        (1, 1, 1, 2, 2),
        (2, 7, 3, 64, 64),
        (1, 33, 4, 128, 64),
        (3, 5, 2, 80, 80),
        (1, 4, 8, 96, 26),
        (2, 17, 32, 128, 128),
    ],
)
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


def test_rotary_valid_calls_skip_python_checks(python_checks):
    """Valid calls (in place or not) are checked in C and give the reference
    result; empty tables (copy only) take the Python checks."""
    rng = np.random.default_rng(31)
    x = rand(rng, (2, 3, 4, 32))
    cos, sin = _tables(rng, 12, 12)
    pos = rng.integers(0, 12, (2, 3)).astype(np.int64)
    for interleaved in (False, True):
        out, want, inplace = np.empty_like(x), np.empty_like(x), x.copy()
        K.rotary_embedding(x, cos, sin, pos, interleaved, out)
        K.rotary_embedding(inplace, cos, sin, pos, interleaved, inplace)
        R.rotary_embedding(x, cos, sin, pos, interleaved, want)
        assert_close(out, want)
        assert_close(inplace, want)
    assert python_checks == []
    out = np.empty_like(x)
    K.rotary_embedding(x, cos[:, :0], sin[:, :0], pos, False, out)
    np.testing.assert_array_equal(out, x)
    assert python_checks[0] == "x"


def test_rotary_fast_checks_defer_to_named_errors():
    """Every argument the C checks refuse gets today's Python error, nothing written."""
    rng = np.random.default_rng(32)
    x = rand(rng, (1, 3, 2, 16))
    cos, sin = _tables(rng, 10, 8)
    pos = np.array([[0, 4, 9]], np.int64)
    out = np.full_like(x, 9.0)
    readonly = out.copy()
    readonly.flags.writeable = False
    buf = rand(rng, (2, 3, 2, 16))  # x = buf[:1], out = buf.reshape(-1)[8:104]: partial overlap
    table = rand(rng, (10 * 8 + 96,))  # cos or sin = table[:80], out = table[80 - 8:]
    shared_out, shared_tab = table[72:168].reshape(x.shape), table[:80].reshape(10, 8)
    narrow, narrow_out = rand(rng, (1, 3, 2, 8)), np.full((1, 3, 2, 8), 9.0, np.float32)
    cases = [
        (
            lambda: K.rotary_embedding(x.astype(">f4"), cos, sin, pos, False, out),
            "x: dtype >f4 is not supported (expected float32)",
        ),
        (lambda: K.rotary_embedding(x.tolist(), cos, sin, pos, False, out), "x: expected a numpy.ndarray, got list"),
        (lambda: K.rotary_embedding(np.asfortranarray(x), cos, sin, pos, False, out), "x: array must be C-contiguous"),
        (
            lambda: K.rotary_embedding(x, cos.astype(">f4"), sin, pos, False, out),
            "cos: dtype >f4 is not supported (expected float32)",
        ),
        (
            lambda: K.rotary_embedding(x, cos, np.asfortranarray(sin), pos, False, out),
            "sin: array must be C-contiguous",
        ),
        (
            lambda: K.rotary_embedding(x, cos, sin, pos.astype(">i8"), False, out),
            "positions: dtype >i8 is not supported (expected int64)",
        ),
        (
            lambda: K.rotary_embedding(x, cos, sin, np.array([[0, 10, 2]]), False, out),
            "positions: values must be in [0, 10), got range [0, 10]",
        ),
        (
            lambda: K.rotary_embedding(x, cos, sin, np.array([[0, -3, 2]]), False, out),
            "positions: values must be in [0, 10), got range [-3, 2]",
        ),
        (lambda: K.rotary_embedding(x, cos, sin, pos, False, readonly), "out: array must be writeable"),
        (
            lambda: K.rotary_embedding(x, cos, sin, pos, False, memoryview(out)),
            "out: expected a numpy.ndarray, got memoryview",
        ),
        (
            lambda: K.rotary_embedding(buf[:1], cos, sin, pos, False, buf.reshape(-1)[8:104].reshape(x.shape)),
            "out: must not overlap x (only exact aliasing is allowed)",
        ),
        (lambda: K.rotary_embedding(x, shared_tab, sin, pos, False, shared_out), "out: must not overlap cos"),
        (lambda: K.rotary_embedding(x, cos, shared_tab, pos, False, shared_out), "out: must not overlap sin"),
        (
            lambda: K.rotary_embedding(narrow, cos, sin, pos, False, narrow_out),
            "cos: rotary_dim 2*8 exceeds head_size 8",
        ),
    ]
    for call, message in cases:
        assert_refused(call, message, out, buf, table, narrow_out)
