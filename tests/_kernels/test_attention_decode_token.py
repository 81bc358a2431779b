"""decode_token: rotary + cache append + attention of one decode token in one call.

Bit for bit the unfused compiled calls (rotary_embedding, the row writes,
attention) and within float32 tolerance of the NumPy twin, on random data over
MHA / GQA / MQA, head sizes, rotary widths, interleaving, softcap and window,
1 and 2 threads, SIMD and scalar.  Arguments it does not take are declined
(False) with nothing written.
"""

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import rand

SHAPES = [(4, 4, 64), (8, 2, 80), (4, 1, 128), (6, 3, 16)]  # (Hq, Hkv, D): MHA, GQA, MQA, small


def _case(rng, hq, hkv, d, cap, rot_half, max_pos=64):
    q, k, v = rand(rng, (1, 1, hq * d)), rand(rng, (1, 1, hkv * d)), rand(rng, (1, 1, hkv * d))
    kc, vc = rand(rng, (1, hkv, cap, d)), rand(rng, (1, hkv, cap, d))
    if rot_half:
        ang = rng.uniform(-3, 3, (max_pos, rot_half))
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    else:
        cos = sin = None
    return q, k, v, cos, sin, kc, vc


def _unfused(*args):
    """The unfused compiled calls: the twin's composition with the compiled rotary and attention kernels."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(R, "rotary_embedding", K.rotary_embedding)
        m.setattr(R, "attention", K.attention)
        R.decode_token(*args)


@pytest.mark.parametrize("hq, hkv, d", SHAPES)
@pytest.mark.parametrize("rot", ["none", "full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("softcap, window", [(0.0, -1), (3.0, -1), (0.0, 5)], ids=["plain", "softcap", "window"])
def test_equals_unfused_calls_and_twin(hq, hkv, d, rot, interleaved, softcap, window, threads, simd):
    rng = np.random.default_rng([hq, hkv, d, len(rot), interleaved, int(softcap), window + 1])
    half = {"none": 0, "full": d // 2, "partial": d // 4}[rot]
    for pos in (0, 1, 37):
        q, k, v, cos, sin, kc, vc = _case(rng, hq, hkv, d, 48, half)
        scale = float(d**-0.5)
        got_k, got_v, got = kc.copy(), vc.copy(), np.full((1, 1, hq * d), np.nan, np.float32)
        assert K.decode_token(q, k, v, cos, sin, interleaved, got_k, got_v, pos, scale, softcap, window, got)
        want_k, want_v, want = kc.copy(), vc.copy(), np.full_like(got, np.nan)
        _unfused(q, k, v, cos, sin, interleaved, want_k, want_v, pos, scale, softcap, window, want)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got_k, want_k)
        np.testing.assert_array_equal(got_v, want_v)
        twin_k, twin_v, twin = kc.copy(), vc.copy(), np.empty_like(got)
        R.decode_token(q, k, v, cos, sin, interleaved, twin_k, twin_v, pos, scale, softcap, window, twin)
        np.testing.assert_allclose(got, twin, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_k, twin_k, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got_v, twin_v)


def test_long_cache_splits_like_attention(threads):
    """A cache long enough for the thread split (2 KV heads, 3000 keys): still the unfused result bit for bit."""
    rng = np.random.default_rng(11)
    q, k, v, cos, sin, kc, vc = _case(rng, 8, 2, 64, 3100, 32, max_pos=3100)
    got_k, got_v, got = kc.copy(), vc.copy(), np.empty((1, 1, 8 * 64), np.float32)
    assert K.decode_token(q, k, v, cos, sin, False, got_k, got_v, 2999, 0.125, 0.0, -1, got)
    want_k, want_v, want = kc.copy(), vc.copy(), np.empty_like(got)
    _unfused(q, k, v, cos, sin, False, want_k, want_v, 2999, 0.125, 0.0, -1, want)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_k, want_k)


def _declined_untouched(args, kc, vc, out) -> bool:
    """True when decode_token(*args) returns False and kc, vc, out keep every byte."""
    before = kc.copy(), vc.copy(), out.copy()
    declined = K.decode_token(*args) is False
    return declined and all(np.array_equal(a, b) for a, b in zip((kc, vc, out), before))


def test_declines_what_it_does_not_take_and_writes_nothing():
    rng = np.random.default_rng(12)
    q, k, v, cos, sin, kc, vc = _case(rng, 8, 2, 64, 16, 32)
    out = rand(rng, (1, 1, 8 * 64))

    def call(**change):
        a = dict(
            q=q,
            k=k,
            v=v,
            cos=cos,
            sin=sin,
            interleaved=False,
            k_cache=kc,
            v_cache=vc,
            pos=3,
            scale=0.125,
            softcap=0.0,
            window=-1,
            out=out,
        )
        a.update(change)
        return list(a.values())

    for change in (
        dict(pos=16),
        dict(pos=-1),  # outside the capacity
        dict(q=q.astype(np.float64)),
        dict(q=q.reshape(1, 8, 64)),  # dtype, shape
        dict(q=rand(rng, (1, 1, 6 * 64))),  # Hq not a multiple of Hkv
        dict(k=rand(rng, (1, 1, 3 * 64))),
        dict(v=v[:, :, :100].copy()),
        dict(sin=None),
        dict(cos=cos[:, :8].copy()),  # rotary tables disagree
        dict(cos=cos[:3].copy(), sin=sin[:3].copy()),  # pos past the tables
        dict(cos=rand(rng, (64, 40)), sin=rand(rng, (64, 40))),  # rotary wider than the head
        dict(v_cache=vc[:, :, :8].copy()),  # caches differ
        dict(k_cache=np.asfortranarray(kc)),  # not C-contiguous
        dict(out=out.astype(np.float64)),
        dict(out=kc.reshape(-1)[: 8 * 64].reshape(1, 1, -1)),  # out in the cache
        dict(scale=np.float32(0.125)),
        dict(softcap=-1.0),
        dict(window=-2),
    ):
        assert _declined_untouched(call(**change), kc, vc, out), change
    ro = kc.copy()
    ro.flags.writeable = False
    assert _declined_untouched(call(k_cache=ro), kc, vc, out)
