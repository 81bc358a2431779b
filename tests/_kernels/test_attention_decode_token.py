"""decode_token: rotary + cache append + attention of one decode token in one call.

Bit for bit the unfused compiled calls (rotary_embedding, the row writes,
attention) and within float32 tolerance of the NumPy twin (float16 tokens and
float16 / bfloat16 caches: within their rounding), on random data over
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


def _unfused(*args, **kwargs):
    """The unfused compiled calls: the twin's composition with the compiled rotary and attention kernels (and
    the compiled bfloat16 rounding, which the twin's equals)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(R, "rotary_embedding", K.rotary_embedding)
        m.setattr(R, "attention", K.attention)
        R.decode_token(*args, **kwargs)


def decode_matrix(test):
    """The parameters of a fused decode kernel's comparison test: shapes, rotary widths (none, every
    dimension, a quarter), interleaving, and plain / softcap / window attention."""
    for mark in (
        pytest.mark.parametrize(
            "softcap, window", [(0.0, -1), (3.0, -1), (0.0, 5)], ids=["plain", "softcap", "window"]
        ),
        pytest.mark.parametrize("interleaved", [False, True]),
        pytest.mark.parametrize("rot", ["none", "full", "partial"]),
        pytest.mark.parametrize("hq, hkv, d", SHAPES),
    ):
        test = mark(test)
    return test


@decode_matrix
def test_equals_unfused_calls_and_twin(hq, hkv, d, rot, interleaved, softcap, window, threads, simd):
    rng = np.random.default_rng([hq, hkv, d, len(rot), interleaved, int(softcap), window + 1])
    half = {"none": 0, "full": d // 2, "partial": d // 4}[rot]
    for pos in (0, 1, 37):
        q, k, v, cos, sin, kc, vc = _case(rng, hq, hkv, d, 48, half)
        _check(q, k, v, cos, sin, interleaved, kc, vc, pos, float(d**-0.5), softcap, window)


def _check(q, k, v, cos, sin, interleaved, kc, vc, pos, scale, softcap, window, kv_dtype=None):
    """decode_token on copies of the caches equals the unfused calls bit for bit, the twin within float32
    tolerance (float16 tokens: float16's; caches of float16 or bfloat16 (kv_dtype): within a rounding of
    their type), and writes no cache row past its tokens."""
    n = q.shape[1]
    got_k, got_v, got = kc.copy(), vc.copy(), np.full(q.shape[:2] + (q.shape[2],), np.nan, q.dtype)
    args = (cos, sin, interleaved)
    assert K.decode_token(q, k, v, *args, got_k, got_v, pos, scale, softcap, window, got, kv_dtype=kv_dtype)
    want_k, want_v, want = kc.copy(), vc.copy(), np.full_like(got, np.nan)
    _unfused(q, k, v, *args, want_k, want_v, pos, scale, softcap, window, want, kv_dtype=kv_dtype)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)
    assert np.array_equal(got_k[:, :, pos + n :], kc[:, :, pos + n :])
    twin_k, twin_v, twin = kc.copy(), vc.copy(), np.empty_like(got)
    R.decode_token(q, k, v, *args, twin_k, twin_v, pos, scale, softcap, window, twin, kv_dtype=kv_dtype)
    narrow = q.dtype == np.float16
    tol = 2e-3 if narrow else 1e-5
    np.testing.assert_allclose(got.astype(np.float32), twin.astype(np.float32), rtol=tol, atol=tol)
    cache_tol = 1e-6 if kc.dtype == np.float32 else 8e-3 if kv_dtype == "bfloat16" else 1e-3
    got_kf, twin_kf = R.kv_to_f32(got_k, kv_dtype), R.kv_to_f32(twin_k, kv_dtype)
    np.testing.assert_allclose(got_kf, twin_kf, rtol=cache_tol, atol=cache_tol)
    np.testing.assert_array_equal(got_v, twin_v)


#: (tokens, caches) of the narrow calls: a float32 model with a float16 / bfloat16 state cache, a float16
#: model's tokens into float16 / bfloat16 caches.
NARROW = [(np.float32, "float16"), (np.float32, "bfloat16"), (np.float16, "float16"), (np.float16, "bfloat16")]
NARROW_IDS = ["f32-f16cache", "f32-bf16cache", "f16", "f16-bf16cache"]


def _narrow(x, cache):
    """float32 cache values as a cache of type ``cache`` holds them (bfloat16: uint16 bit patterns)."""
    return R.bf16_from_f32(x) if cache == "bfloat16" else x.astype(np.float16)


@decode_matrix
@pytest.mark.parametrize("tokens, cache", NARROW, ids=NARROW_IDS)
def test_narrow_tokens_and_caches_equal_unfused_calls_and_twin(
    hq, hkv, d, rot, interleaved, softcap, window, tokens, cache, threads, simd
):
    """Float16 tokens are widened before the rotary and the attention, their output rounded once; new rows
    are rounded to a 2-byte cache's type, as the general path's cache writes round them."""
    rng = np.random.default_rng([hq, hkv, d, len(rot), interleaved, int(softcap), window + 1, len(cache)])
    half = {"none": 0, "full": d // 2, "partial": d // 4}[rot]
    for pos in (0, 1, 37):
        q, k, v, cos, sin, kc, vc = _case(rng, hq, hkv, d, 48, half)
        q, k, v = (x.astype(tokens) for x in (q, k, v))
        kv_dtype = "bfloat16" if cache == "bfloat16" else None
        _check(q, k, v, cos, sin, interleaved, _narrow(kc, cache), _narrow(vc, cache), pos, float(d**-0.5),
               softcap, window, kv_dtype)  # fmt: skip


@pytest.mark.parametrize("n", [2, 5])
@pytest.mark.parametrize("tokens, cache", NARROW, ids=NARROW_IDS)
def test_several_narrow_tokens_equal_unfused_calls(n, tokens, cache, threads, simd):
    rng = np.random.default_rng([n, len(cache)])
    _, _, _, cos, sin, kc, vc = _case(rng, 4, 2, 64, 48, 16)
    q, k, v = (x.astype(tokens) for x in _tokens(rng, n, 4, 2, 64, True))
    kv_dtype = "bfloat16" if cache == "bfloat16" else None
    _check(q, k, v, cos, sin, False, _narrow(kc, cache), _narrow(vc, cache), 30, 0.125, 0.0, -1, kv_dtype)


def test_narrow_calls_decline_mismatched_types_and_write_nothing():
    rng = np.random.default_rng(14)
    q, k, v, cos, sin, kc, vc = _case(rng, 4, 2, 32, 16, 8)
    h = dict(q=q.astype(np.float16), k=k.astype(np.float16), v=v.astype(np.float16))
    kc16, vc16, out16 = kc.astype(np.float16), vc.astype(np.float16), np.zeros((1, 1, 128), np.float16)
    kcb, vcb = R.bf16_from_f32(kc), R.bf16_from_f32(vc)
    base = dict(**h, cos=cos, sin=sin, interleaved=False, k_cache=kc16, v_cache=vc16, pos=3, scale=0.125,
                softcap=0.0, window=-1, out=out16)  # fmt: skip
    for change, kv_dtype in (
        (dict(k_cache=kc, v_cache=vc), None),  # float16 tokens into float32 caches
        (dict(k=k), None),  # token types differ
        (dict(out=np.zeros((1, 1, 128), np.float32)), None),
        (dict(v_cache=vc), None),  # cache types differ
        (dict(k_cache=kcb, v_cache=vcb), None),  # uint16 caches without kv_dtype="bfloat16"
        ({}, "bfloat16"),  # float16 caches named bfloat16
        ({}, "float32"),
        (dict(k_cache=kcb, v_cache=vcb), "int8"),
        (
            dict(
                q=q.astype(np.float64),
                k=k.astype(np.float64),
                v=v.astype(np.float64),
                out=np.zeros((1, 1, 128), np.float64),
            ),
            None,
        ),
    ):
        a = {**base, **change}
        before = [x.copy() for x in (a["k_cache"], a["v_cache"], a["out"])]
        assert K.decode_token(*a.values(), kv_dtype=kv_dtype) is False, change
        assert all(np.array_equal(x, y) for x, y in zip((a["k_cache"], a["v_cache"], a["out"]), before))
    assert K.decode_token(*base.values())
    assert K.decode_token(*base.values(), kv_dtype="float16")


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
    shared = rand(rng, (1, 1, 8 * 64))

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
        dict(q=kc.reshape(-1)[3 * 64 : 11 * 64].reshape(1, 1, -1)),  # q in the cache (the row written first)
        dict(cos=vc.reshape(-1)[: cos.size].reshape(cos.shape)),  # a rotary table in a cache
        dict(k=shared[..., : 2 * 64], out=shared),  # out over k
        dict(scale=np.float32(0.125)),
        dict(softcap=-1.0),
        dict(window=-2),
    ):
        assert _declined_untouched(call(**change), kc, vc, out), change
    ro = kc.copy()
    ro.flags.writeable = False
    assert _declined_untouched(call(k_cache=ro), kc, vc, out)


def _tokens(rng, n, hq, hkv, d, packed, b=1):
    """q, k, v [b, n, W] of ``n`` tokens per row: separate arrays, or strided slices of packed QKV rows (the
    builder's layout)."""
    if packed:
        qkv = rand(rng, (b, n, (hq + 2 * hkv) * d))
        return qkv[..., : hq * d], qkv[..., hq * d : (hq + hkv) * d], qkv[..., (hq + hkv) * d :]
    return rand(rng, (b, n, hq * d)), rand(rng, (b, n, hkv * d)), rand(rng, (b, n, hkv * d))


@pytest.mark.parametrize("n", [2, 5, 16])
@pytest.mark.parametrize("hq, hkv, d", SHAPES[:3])
@pytest.mark.parametrize("rot", ["none", "partial"])
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("softcap, window", [(0.0, -1), (3.0, 3)], ids=["plain", "softcap-window"])
def test_several_tokens_equal_unfused_calls_and_twin(n, hq, hkv, d, rot, packed, softcap, window, threads, simd):
    """A speculative verification's tokens: each query attends causally to the past and the tokens before it."""
    rng = np.random.default_rng([n, hq, hkv, d, len(rot), packed, window + 1])
    half = {"none": 0, "partial": d // 4}[rot]
    for pos in (1, 30):
        _, _, _, cos, sin, kc, vc = _case(rng, hq, hkv, d, 48, half)
        q, k, v = _tokens(rng, n, hq, hkv, d, packed)
        _check(q, k, v, cos, sin, False, kc, vc, pos, float(d**-0.5), softcap, window)


def test_several_tokens_decline_what_they_do_not_take_and_write_nothing():
    rng = np.random.default_rng(13)
    _, _, _, cos, sin, kc, vc = _case(rng, 4, 2, 32, 16, 8, max_pos=20)
    q, k, v = _tokens(rng, 4, 4, 2, 32, True)
    out = rand(rng, (1, 4, 4 * 32))
    args = dict(q=q, k=k, v=v, cos=cos, sin=sin, interleaved=False, k_cache=kc, v_cache=vc, pos=3, scale=0.125,
                softcap=0.0, window=-1, out=out)  # fmt: skip
    wide = rand(rng, (1, 4, 2 * 4 * 32))
    for change in (
        dict(pos=13),  # the last token past the capacity
        dict(cos=cos[:6].copy(), sin=sin[:6].copy()),  # the last token past the rotary tables
        dict(k=k[:, :3]),  # token counts differ
        dict(v=v[:, :3]),
        dict(out=wide[..., ::2]),  # out strided
        dict(out=rand(rng, (1, 3, 4 * 32))),
        dict(q=q[:, ::-1]),  # rows backwards
        dict(q=np.lib.stride_tricks.as_strided(q, (1, 4, 4 * 32), (0, 64, 4))),  # rows overlapping
        dict(q=wide[..., ::2]),  # elements strided
    ):
        assert _declined_untouched(list({**args, **change}.values()), kc, vc, out), change
    assert K.decode_token(*args.values())
