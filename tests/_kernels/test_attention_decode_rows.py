"""decode_token over B rows of a batch: each row's tokens at its own position of its own caches.

Bit for bit the unfused compiled calls (rotary_embedding, the row writes, attention over the B rows with
kv_len = pos + S) and within float32 tolerance of the NumPy twin, on random data with rows of different
lengths, separate and packed Q/K/V, float16 tokens and 2-byte caches, 1 and 2 threads, every SIMD level.
Arguments it does not take (a position array of another type or length, an int position for several rows,
rows whose tokens do not follow one another) are declined with nothing written.
"""

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import rand
from .test_attention_decode_token import NARROW, NARROW_IDS, _narrow, _tokens, _unfused


def _rows(rng, b, n, hq, hkv, d, packed):
    """q, k, v [B, n, W] (test_attention_decode_token's tokens, B rows of them)."""
    return _tokens(rng, n, hq, hkv, d, packed, b)


def _tables(rng, rows, half):
    if not half:
        return None, None
    ang = rng.uniform(-3, 3, (rows, half))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _check(q, k, v, cos, sin, kc, vc, pos, softcap, window, kv_dtype=None):
    """decode_token of the B rows on copies of the caches equals the unfused calls bit for bit and the twin
    within tolerance, and writes no cache position outside each row's tokens."""
    b, n = q.shape[:2]
    d = kc.shape[3]
    scale = float(d**-0.5)
    got_k, got_v, got = kc.copy(), vc.copy(), np.full((b, n, q.shape[2]), np.nan, q.dtype)
    assert K.decode_token(q, k, v, cos, sin, False, got_k, got_v, pos, scale, softcap, window, got, kv_dtype=kv_dtype)
    want_k, want_v, want = kc.copy(), vc.copy(), np.full_like(got, np.nan)
    _unfused(q, k, v, cos, sin, False, want_k, want_v, pos, scale, softcap, window, want, kv_dtype=kv_dtype)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)
    for r in range(b):
        for x, y in ((got_k, kc), (got_v, vc)):
            assert np.array_equal(x[r, :, : pos[r]], y[r, :, : pos[r]])
            assert np.array_equal(x[r, :, pos[r] + n :], y[r, :, pos[r] + n :])
    twin = np.empty_like(got)
    R.decode_token(q, k, v, cos, sin, False, kc.copy(), vc.copy(), pos, scale, softcap, window, twin,
                   kv_dtype=kv_dtype)  # fmt: skip
    tol = 2e-3 if q.dtype == np.float16 else 1e-5
    np.testing.assert_allclose(got.astype(np.float32), twin.astype(np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("b, n", [(2, 1), (3, 1), (5, 1), (2, 3), (4, 2)])
@pytest.mark.parametrize("hq, hkv, d", [(8, 2, 32), (4, 4, 64), (6, 3, 16)])
@pytest.mark.parametrize("rot", ["none", "full", "partial"])
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("softcap, window", [(0.0, -1), (3.0, 5)], ids=["plain", "softcap-window"])
def test_rows_equal_unfused_calls_and_twin(b, n, hq, hkv, d, rot, packed, softcap, window, threads, simd):
    rng = np.random.default_rng([b, n, hq, hkv, d, len(rot), packed, window + 1])
    half = {"none": 0, "full": d // 2, "partial": d // 4}[rot]
    cos, sin = _tables(rng, 64, half)
    kc, vc = rand(rng, (b, hkv, 48, d)), rand(rng, (b, hkv, 48, d))
    q, k, v = _rows(rng, b, n, hq, hkv, d, packed)
    pos = rng.integers(0, 48 - n, b).astype(np.int64)  # rows of different lengths
    pos[0] = 0
    _check(q, k, v, cos, sin, kc, vc, pos, softcap, window)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("tokens, cache", NARROW, ids=NARROW_IDS)
def test_narrow_rows_equal_unfused_calls(n, tokens, cache, threads, simd):
    rng = np.random.default_rng([n, len(cache), tokens == np.float16])
    cos, sin = _tables(rng, 64, 16)
    kc, vc = rand(rng, (3, 2, 40, 64)), rand(rng, (3, 2, 40, 64))
    q, k, v = (x.astype(tokens) for x in _rows(rng, 3, n, 4, 2, 64, True))
    kv_dtype = "bfloat16" if cache == "bfloat16" else None
    pos = np.array([5, 0, 31], np.int64)
    _check(q, k, v, cos, sin, _narrow(kc, cache), _narrow(vc, cache), pos, 0.0, -1, kv_dtype)


def test_long_rows_split_like_attention(threads):
    """Rows long enough for the thread split (2 rows, 1 KV head, 2,600 and 3,000 keys): the unfused result."""
    rng = np.random.default_rng(31)
    cos, sin = _tables(rng, 3100, 16)
    kc, vc = rand(rng, (2, 1, 3100, 64)), rand(rng, (2, 1, 3100, 64))
    q, k, v = _rows(rng, 2, 1, 4, 1, 64, False)
    _check(q, k, v, cos, sin, kc, vc, np.array([2599, 2999], np.int64), 0.0, -1)


def test_an_int_position_is_one_row():
    """An int position takes a single row as before; the same call as an int64 [1] array gives the same bytes."""
    rng = np.random.default_rng(32)
    cos, sin = _tables(rng, 64, 16)
    kc, vc = rand(rng, (1, 2, 40, 32)), rand(rng, (1, 2, 40, 32))
    q, k, v = _rows(rng, 1, 1, 4, 2, 32, False)
    outs = []
    for pos in (7, np.array([7], np.int64)):
        gk, gv, out = kc.copy(), vc.copy(), np.empty((1, 1, 128), np.float32)
        assert K.decode_token(q, k, v, cos, sin, False, gk, gv, pos, 0.1, 0.0, -1, out)
        outs.append((gk, gv, out))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def test_rows_decline_what_they_do_not_take_and_write_nothing():
    rng = np.random.default_rng(33)
    cos, sin = _tables(rng, 64, 16)
    kc, vc = rand(rng, (3, 2, 40, 32)), rand(rng, (3, 2, 40, 32))
    q, k, v = _rows(rng, 3, 1, 4, 2, 32, False)
    out = rand(rng, (3, 1, 128))
    pos = np.array([1, 2, 3], np.int64)
    _, k2, v2 = _rows(rng, 3, 2, 4, 2, 32, False)
    out2 = rand(rng, (3, 2, 128))
    base = dict(q=q, k=k, v=v, cos=cos, sin=sin, interleaved=False, k_cache=kc, v_cache=vc, pos=pos, scale=0.1,
                softcap=0.0, window=-1, out=out)  # fmt: skip
    for change in (
        dict(pos=pos.astype(np.int32)),
        dict(pos=pos[:2].copy()),
        dict(pos=np.array([1, 2, 40], np.int64)),  # a row past the capacity
        dict(pos=np.array([1, -1, 3], np.int64)),
        dict(pos=np.array([1, 2, 3], np.int64)[::-1]),  # not C-contiguous
        dict(pos=2),  # an int for several rows
        dict(pos=True),
        dict(pos=2**64),
        dict(k_cache=kc[:2].copy(), v_cache=vc[:2].copy()),  # caches of fewer rows
        dict(q=q[:2].copy()),
        dict(out=out[:2].copy()),
        dict(cos=cos[:3].copy(), sin=sin[:3].copy()),  # a row past the rotary tables
        # two tokens per row whose rows do not follow one another
        dict(q=rand(rng, (3, 3, 128))[:, :2], k=k2, v=v2, out=out2),
        dict(out=kc.reshape(-1)[: out.size].reshape(out.shape)),  # out in a cache
    ):
        a = {**base, **change}
        before = [x.copy() for x in (kc, vc, a["out"])]
        assert K.decode_token(*a.values()) is False, change
        assert all(np.array_equal(x, y) for x, y in zip((kc, vc, a["out"]), before)), change
    assert K.decode_token(*base.values())
