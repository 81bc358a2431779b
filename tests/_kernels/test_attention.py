import sys

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import rand

A = sys.modules["onnxkv._kernels.attention"]
# instruction sets of the attention kernels: every one this process can run, widest first
LEVELS = K.simd_levels()[::-1]
AVX512 = "avx512" in LEVELS
COMBOS = [(threads, level) for level in LEVELS for threads in (1, 2)]


def set_level(level):
    """Make the attention kernels run `level` ("avx512", "avx2" or "scalar");
    returns the level actually in use (a level this process cannot run falls
    back to the next narrower one)."""
    K.set_simd_enabled(level != "scalar")
    A.set_attention_avx512(level == "avx512")
    return A.attention_simd_level()


def reset_level():
    """Back to the default: the widest instruction set this process runs."""
    K.set_simd_enabled(True)
    A.set_attention_avx512(True)


HEADS = {"mha": (8, 8), "gqa": (32, 8), "mqa": (8, 1)}


def make(rng, B, Hq, Hkv, Sq, Cap, D, qscale=1.0, kscale=1.0):
    q = rand(rng, (B, Hq, Sq, D), scale=qscale)
    k = rand(rng, (B, Hkv, Cap, D), scale=kscale)
    v = rand(rng, (B, Hkv, Cap, D))
    return q, k, v


def check(q, k, v, kv_len, q_pos, scale, softcap=0.0, window=-1, kv_start=None, combos=COMBOS, atol=1e-5, rtol=1e-5):
    want = np.empty_like(q)
    R.attention(q, k, v, kv_len, q_pos, scale, softcap, window, want, kv_start=kv_start)
    old = K.get_num_threads()
    try:
        for threads, level in combos:
            K.set_num_threads(threads)
            set_level(level)
            out = np.full_like(q, np.nan)
            K.attention(q, k, v, kv_len, q_pos, scale, softcap, window, out, kv_start=kv_start)
            np.testing.assert_allclose(out, want, rtol=rtol, atol=atol, err_msg=f"threads={threads} simd={level}")
    finally:
        K.set_num_threads(old)
        reset_level()
    return want


def test_simd_level_switches():
    """set_simd_enabled / set_attention_avx512 select the level attention_simd_level names."""
    try:
        assert set_level("scalar") == "scalar"
        assert set_level("avx2") == ("avx2" if K.cpu_features()["simd_usable"] else "scalar")
        # "avx512+amx" where the AVX-512 tiles score quantized keys on AMX (test_attention_amx.py)
        assert (set_level("avx512").split("+")[0] == "avx512") == AVX512
        assert not A.set_attention_avx512(False) and not A.attention_simd_level().startswith("avx512")
    finally:
        reset_level()
    assert A.attention_simd_level().split("+")[0] == LEVELS[0]


def decode_positions(kv_len, Sq):
    return (kv_len[:, None] - Sq + np.arange(Sq)[None, :]).astype(np.int32)


@pytest.mark.parametrize("D,ctx", [(D, c) for D in (64, 80, 128) for c in (1, 17, 1000)] + [(128, 8192)])
@pytest.mark.parametrize("heads", list(HEADS))
def test_decode(heads, D, ctx):
    Hq, Hkv = HEADS[heads]
    B = 2 if ctx < 8192 else 1
    rng = np.random.default_rng(ctx * 7 + D)
    Cap = ctx + 5  # kv_len < Cap
    q, k, v = make(rng, B, Hq, Hkv, 1, Cap, D)
    kv_len = np.array([ctx, max(1, ctx // 2 - 3)][:B], np.int32)
    check(q, k, v, kv_len, decode_positions(kv_len, 1), D**-0.5)


@pytest.mark.parametrize("D", [1, 7, 33, 96])
def test_decode_odd_head_sizes(D):
    rng = np.random.default_rng(D)
    q, k, v = make(rng, 2, 6, 2, 1, 300, D)
    kv_len = np.array([300, 129], np.int32)
    check(q, k, v, kv_len, decode_positions(kv_len, 1), 0.37)


@pytest.mark.parametrize("Sq,past", [(7, 0), (17, 0), (17, 40), (100, 300), (130, 0)])
@pytest.mark.parametrize("heads", list(HEADS))
def test_prefill_causal(heads, Sq, past):
    Hq, Hkv = HEADS[heads]
    rng = np.random.default_rng(Sq + past)
    D = 64
    Cap = past + Sq + 3
    q, k, v = make(rng, 2, Hq, Hkv, Sq, Cap, D)
    kv_len = np.array([past + Sq, past + Sq], np.int32)
    check(q, k, v, kv_len, decode_positions(kv_len, Sq), D**-0.5)


@pytest.mark.parametrize("window", [0, 1, 16, 300])
@pytest.mark.parametrize("Sq", [1, 33])
def test_sliding_window(window, Sq):
    rng = np.random.default_rng(window + Sq)
    q, k, v = make(rng, 2, 8, 2, Sq, 1100, 64)
    kv_len = np.array([1000, 700], np.int32)
    check(q, k, v, kv_len, decode_positions(kv_len, Sq), 0.125, window=window)


@pytest.mark.parametrize("softcap", [5.0, 30.0, 50.0])
@pytest.mark.parametrize("Sq", [1, 9])
def test_softcap_large_magnitude(softcap, Sq):
    rng = np.random.default_rng(int(softcap) + Sq)
    q, k, v = make(rng, 1, 8, 4, Sq, 600, 128, qscale=10.0, kscale=3.0)
    kv_len = np.array([600], np.int32)
    check(q, k, v, kv_len, decode_positions(kv_len, Sq), 128**-0.5, softcap=softcap)


@pytest.mark.parametrize("Sq", [1, 17])
def test_large_scores_without_softcap(Sq):
    """Scores of magnitude ~1e3: the online softmax must stay finite and exact up
    to the float32 rounding of the scores themselves (|s| * 1e-7 * sqrt(D) ~ 1e-4
    relative error on the weights), hence the looser tolerance."""
    rng = np.random.default_rng(99)
    q, k, v = make(rng, 2, 4, 2, Sq, 500, 80, qscale=20.0, kscale=5.0)
    kv_len = np.array([500, 321], np.int32)
    out = check(q, k, v, kv_len, decode_positions(kv_len, Sq), 1.0, atol=5e-4, rtol=5e-4)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("Sq", [1, 12])
def test_kv_start_left_padding(Sq):
    rng = np.random.default_rng(5)
    q, k, v = make(rng, 3, 8, 2, Sq, 200, 64)
    kv_len = np.array([150, 150, 150], np.int32)
    kv_start = np.array([0, 5, 145], np.int32)
    q_pos = decode_positions(kv_len, Sq)
    want = check(q, k, v, kv_len, q_pos, 0.125, kv_start=kv_start)
    if Sq > 1:  # query tokens before kv_start see nothing -> zeros
        q_pos2 = np.array([np.arange(Sq)] * 3, np.int32) + 140
        want = check(q, k, v, kv_len, q_pos2, 0.125, kv_start=kv_start)
        assert np.all(want[2, :, :5] == 0.0)


def test_no_visible_key_gives_zeros():
    rng = np.random.default_rng(6)
    q, k, v = make(rng, 3, 4, 4, 2, 50, 32)
    kv_len = np.array([0, 50, 20], np.int32)
    q_pos = np.array([[0, 1], [-5, -1], [3, 4]], np.int32)
    want = check(q, k, v, kv_len, q_pos, 0.2)
    assert np.all(want[0] == 0.0) and np.all(want[1] == 0.0)
    for threads, level in COMBOS:
        K.set_num_threads(threads)
        set_level(level)
        out = np.full_like(q, np.nan)
        K.attention(q, k, v, kv_len, q_pos, 0.2, 0.0, -1, out)
        assert np.all(out[0] == 0.0) and np.all(out[1] == 0.0)
    K.set_num_threads(2)
    reset_level()


@pytest.mark.parametrize("threads", [2, 3, 4, 7])
@pytest.mark.parametrize("B,Hkv,Sq", [(1, 1, 1), (1, 1, 4), (2, 1, 1), (1, 2, 3), (3, 1, 1)])
def test_cache_split_merge(threads, B, Hkv, Sq):
    """Decode with fewer (batch x kv heads) than threads splits along the cache."""
    rng = np.random.default_rng(threads * 10 + B)
    q, k, v = make(rng, B, 4 * Hkv, Hkv, Sq, 2000, 64)
    kv_len = np.array([2000, 1500, 129][:B], np.int32)
    for window in (-1, 700):
        check(
            q,
            k,
            v,
            kv_len,
            decode_positions(kv_len, Sq),
            0.125,
            window=window,
            kv_start=np.array([0, 3, 100][:B], np.int32),
            combos=[(threads, level) for level in LEVELS],
        )


def test_capacity_tail_not_read():
    """Garbage (NaN) beyond kv_len must not leak into the result."""
    rng = np.random.default_rng(8)
    q, k, v = make(rng, 2, 4, 2, 3, 100, 64)
    kv_len = np.array([60, 90], np.int32)
    for b, n in enumerate(kv_len):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    check(q, k, v, kv_len, decode_positions(kv_len, 3), 0.125)


def _bad_cases():
    rng = np.random.default_rng(0)
    q, k, v = make(rng, 2, 4, 2, 3, 10, 8)
    kl = np.array([5, 10], np.int32)
    qp = decode_positions(kl, 3)
    ok = dict(q=q, k=k, v=v, kv_len=kl, q_pos=qp, scale=0.3, softcap=0.0, window=-1)
    yield "q", dict(ok, q=q.astype(np.float64))
    yield "q", dict(ok, q=q[0])
    yield "k", dict(ok, k=k[:, :, :, :4].copy())
    k3, v3 = make(rng, 2, 3, 3, 3, 10, 8)[1:]
    yield "k", dict(ok, k=k3, v=v3)
    yield "v", dict(ok, v=v[:, :, :9].copy())
    yield "v", dict(ok, v=v[:, :, ::2])
    yield "kv_len", dict(ok, kv_len=kl.astype(np.int64))
    yield "kv_len", dict(ok, kv_len=np.array([5, 11], np.int32))
    yield "kv_len", dict(ok, kv_len=np.array([-1, 5], np.int32))
    yield "q_pos", dict(ok, q_pos=qp[:, :2].copy())
    yield "kv_start", dict(ok, kv_start=np.array([0, 11], np.int32))
    yield "kv_start", dict(ok, kv_start=np.array([0, 1, 2], np.int32))
    yield "softcap", dict(ok, softcap=-1.0)
    yield "scale", dict(ok, scale=float("nan"))
    yield "window", dict(ok, window=-2)


@pytest.mark.parametrize("case", list(range(15)))
def test_bad_arguments_raise_before_writing(case):
    name, kw = list(_bad_cases())[case]
    out = np.full((2, 4, 3, 8), 42.0, np.float32)
    with pytest.raises(ValueError, match=name):
        K.attention(out=out, **kw)
    assert np.all(out == 42.0)


def test_out_overlapping_inputs_rejected():
    rng = np.random.default_rng(1)
    q, k, v = make(rng, 1, 2, 2, 1, 4, 8)
    kl = np.array([4], np.int32)
    qp = np.array([[3]], np.int32)
    with pytest.raises(ValueError, match="out"):
        K.attention(q, k, v, kl, qp, 1.0, 0.0, -1, q)
    big = np.zeros((1, 2, 4, 8), np.float32)
    with pytest.raises(ValueError, match="out"):
        K.attention(q, big, v, kl, qp, 1.0, 0.0, -1, big[:, :, :1])


def test_empty_cache_and_empty_query():
    q = np.ones((2, 4, 3, 16), np.float32)
    k = np.empty((2, 2, 0, 16), np.float32)
    out = np.full_like(q, np.nan)
    K.attention(q, k, k.copy(), np.zeros(2, np.int32), np.zeros((2, 3), np.int32), 1.0, 0.0, -1, out)
    assert np.all(out == 0.0)
    q0 = np.empty((2, 4, 0, 16), np.float32)
    K.attention(
        q0,
        np.ones((2, 2, 5, 16), np.float32),
        np.ones((2, 2, 5, 16), np.float32),
        np.full(2, 5, np.int32),
        np.empty((2, 0), np.int32),
        1.0,
        0.0,
        -1,
        np.empty_like(q0),
    )


def test_read_only_inputs_accepted():
    """Caches and weights may be read-only (e.g. memory-mapped); only out must be writeable."""
    rng = np.random.default_rng(21)
    q, k, v = make(rng, 1, 4, 2, 2, 40, 32)
    kv_len = np.array([40], np.int32)
    q_pos = decode_positions(kv_len, 2)
    for a in (q, k, v, kv_len, q_pos):
        a.flags.writeable = False
    check(q, k, v, kv_len, q_pos, 0.3, combos=[(1, LEVELS[0])])
    x = rand(rng, (3, 8))
    g = rand(rng, (8,))
    x.flags.writeable = False
    g.flags.writeable = False
    out, want = np.empty_like(x), np.empty_like(x)
    K.rms_norm(x, g, 1e-6, out)
    R.rms_norm(x, g, 1e-6, want)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
