"""Streaming attention over FLOAT16 and BFLOAT16 (and FLOAT) K/V caches.

The compiled kernel converts K/V to float32 in its load step; the reference
converts the whole cache first (reference.kv_to_f32) and then does float64
math, so both see exactly the same (converted) values and must agree to float32
rounding (~1e-5 relative).  BFLOAT16 caches are uint16 bit patterns passed with
kv_dtype="bfloat16".
"""

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import rand
from .test_attention import COMBOS, LEVELS, reset_level, set_level

VECTOR = LEVELS[:-1]  # the SIMD levels (all but scalar)
LONG_COMBOS = [(2, level) for level in VECTOR] + [(1, "scalar")]  # long caches: fewer scalar runs
HEADS = {"mha": (8, 8), "gqa": (32, 8), "mqa": (8, 1)}
DTYPES = ["float32", "float16", "bfloat16"]


def to_cache(x, dtype):
    """float32 array -> cache storage of `dtype` (bf16: uint16 bit patterns)."""
    if dtype == "float32":
        return np.ascontiguousarray(x, np.float32)
    if dtype == "float16":
        return np.ascontiguousarray(x.astype(np.float16))
    return R.bf16_from_f32(x)


def kvd(dtype):
    return "bfloat16" if dtype == "bfloat16" else None


def make(rng, dtype, B, Hq, Hkv, Sq, Cap, D, qscale=1.0, kscale=1.0):
    q = rand(rng, (B, Hq, Sq, D), scale=qscale)
    k = to_cache(rand(rng, (B, Hkv, Cap, D), scale=kscale), dtype)
    v = to_cache(rand(rng, (B, Hkv, Cap, D)), dtype)
    return q, k, v


def check(
    dtype, q, k, v, kv_len, q_pos, scale, softcap=0.0, window=-1, kv_start=None, combos=COMBOS, rtol=1e-5, atol=1e-5
):
    want = np.empty_like(q)
    R.attention(q, k, v, kv_len, q_pos, scale, softcap, window, want, kv_start=kv_start, kv_dtype=kvd(dtype))
    old = K.get_num_threads()
    try:
        for threads, level in combos:
            K.set_num_threads(threads)
            set_level(level)
            out = np.full_like(q, np.nan)
            K.attention(q, k, v, kv_len, q_pos, scale, softcap, window, out, kv_start=kv_start, kv_dtype=kvd(dtype))
            np.testing.assert_allclose(
                out, want, rtol=rtol, atol=atol, err_msg=f"dtype={dtype} threads={threads} simd={level}"
            )
    finally:
        K.set_num_threads(old)
        reset_level()
    return want


def decode_positions(kv_len, Sq):
    return (kv_len[:, None] - Sq + np.arange(Sq)[None, :]).astype(np.int32)


# The full grid is dtypes x {MHA, GQA, MQA} x D {64, 80, 128} x ctx {1, 17, 1000, 8192}.
# Contexts 1/17/1000 run the whole grid; 8192 (the slow reference) runs every
# dtype with each head layout once, rotating the head size.
GRID = [(dt, h, D, c) for dt in DTYPES for h in HEADS for D in (64, 80, 128) for c in (1, 17, 1000)]
GRID += [
    ("float32", "gqa", 128, 8192),
    ("float32", "mha", 64, 8192),
    ("float32", "mqa", 80, 8192),
    ("float16", "mha", 128, 8192),
    ("float16", "mqa", 64, 8192),
    ("float16", "gqa", 80, 8192),
    ("bfloat16", "mqa", 128, 8192),
    ("bfloat16", "gqa", 64, 8192),
    ("bfloat16", "mha", 80, 8192),
]


@pytest.mark.parametrize("dtype,heads,D,ctx", GRID, ids=lambda x: str(x))
def test_decode_dtypes(dtype, heads, D, ctx):
    Hq, Hkv = HEADS[heads]
    B = 2 if ctx < 8192 else 1
    rng = np.random.default_rng(ctx * 7 + D + Hq)
    Cap = ctx + 9  # capacity > kv_len: non-contiguous valid prefix
    q, k, v = make(rng, dtype, B, Hq, Hkv, 1, Cap, D)
    kv_len = np.array([ctx, max(1, ctx // 2 - 3)][:B], np.int32)
    combos = COMBOS if ctx < 8192 else LONG_COMBOS
    check(dtype, q, k, v, kv_len, decode_positions(kv_len, 1), D**-0.5, combos=combos)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Sq,past", [(7, 0), (33, 40), (100, 300)])
@pytest.mark.parametrize("heads", list(HEADS))
def test_prefill_dtypes(dtype, heads, Sq, past):
    Hq, Hkv = HEADS[heads]
    rng = np.random.default_rng(Sq + past + Hq)
    D = 80 if Sq == 33 else 64
    Cap = past + Sq + 5
    q, k, v = make(rng, dtype, 2, Hq, Hkv, Sq, Cap, D)
    kv_len = np.array([past + Sq, past + Sq - 2], np.int32)
    check(dtype, q, k, v, kv_len, decode_positions(kv_len, Sq), D**-0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G", [1, 2, 3, 5, 8, 9, 16])
def test_group_sizes(dtype, G):
    """Every row-group width (1..8 query rows sharing one K/V load, and more
    than one row group per KV head) for decode and a short prefill."""
    rng = np.random.default_rng(G)
    for Sq in (1, 3):
        q, k, v = make(rng, dtype, 1, 2 * G, 2, Sq, 140, 128)
        kv_len = np.array([137], np.int32)
        check(
            dtype,
            q,
            k,
            v,
            kv_len,
            decode_positions(kv_len, Sq),
            0.09,
            combos=[(1, level) for level in VECTOR] + [(2, "scalar")],
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 7, 33, 96])
def test_odd_head_sizes_dtypes(dtype, D):
    rng = np.random.default_rng(D)
    q, k, v = make(rng, dtype, 2, 6, 2, 1, 300, D)
    kv_len = np.array([300, 129], np.int32)
    check(dtype, q, k, v, kv_len, decode_positions(kv_len, 1), 0.37)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 16, 300])
@pytest.mark.parametrize("Sq", [1, 33])
def test_sliding_window_dtypes(dtype, window, Sq):
    rng = np.random.default_rng(window + Sq)
    q, k, v = make(rng, dtype, 2, 8, 2, Sq, 1100, 64)
    kv_len = np.array([1000, 700], np.int32)
    check(dtype, q, k, v, kv_len, decode_positions(kv_len, Sq), 0.125, window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [5.0, 50.0])
@pytest.mark.parametrize("Sq", [1, 9])
def test_softcap_dtypes(dtype, softcap, Sq):
    rng = np.random.default_rng(int(softcap) + Sq)
    q, k, v = make(rng, dtype, 1, 8, 4, Sq, 600, 128, qscale=10.0, kscale=3.0)
    kv_len = np.array([600], np.int32)
    check(dtype, q, k, v, kv_len, decode_positions(kv_len, Sq), 128**-0.5, softcap=softcap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("B,Hkv,Sq", [(1, 1, 1), (1, 2, 3), (3, 1, 1)])
def test_cache_split_merge_dtypes(dtype, threads, B, Hkv, Sq):
    """Fewer (batch x kv heads) than threads: split along the cache, exact merge."""
    rng = np.random.default_rng(threads * 10 + B)
    q, k, v = make(rng, dtype, B, 4 * Hkv, Hkv, Sq, 2000, 64)
    kv_len = np.array([2000, 1500, 129][:B], np.int32)
    for window in (-1, 700):
        check(
            dtype,
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_capacity_tail_not_read_dtypes(dtype):
    """NaN/Inf bit patterns beyond kv_len (Cap > kv_len) never reach the result."""
    rng = np.random.default_rng(8)
    q, k, v = make(rng, dtype, 2, 8, 2, 3, 100, 64)
    kv_len = np.array([60, 90], np.int32)
    bad = {"float32": np.float32(np.nan), "float16": np.float16(np.nan), "bfloat16": np.uint16(0x7FC0)}[dtype]
    for b, n in enumerate(kv_len):
        k[b, :, n:] = bad
        v[b, :, n:] = bad
    out = check(dtype, q, k, v, kv_len, decode_positions(kv_len, 3), 0.125)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_start_dtypes(dtype):
    rng = np.random.default_rng(5)
    q, k, v = make(rng, dtype, 3, 8, 2, 4, 200, 64)
    kv_len = np.array([150, 150, 150], np.int32)
    check(dtype, q, k, v, kv_len, decode_positions(kv_len, 4), 0.125, kv_start=np.array([0, 5, 145], np.int32))


def test_load_step_conversion_is_exact():
    """One key, one value: the output is exactly the converted value row (softmax
    of a single score is 1), so any conversion error would show bit for bit."""
    D = 128
    bits = np.arange(0, 65536, 37, dtype=np.uint32)[:D].astype(np.uint16)
    for dtype, vv, want in [
        ("float16", bits.view(np.float16), bits.view(np.float16).astype(np.float32)),
        ("bfloat16", bits, R.f32_from_bf16(bits)),
    ]:
        finite = np.isfinite(want)
        vrow = np.where(finite, vv, vv.dtype.type(0)).reshape(1, 1, 1, D)
        want = np.where(finite, want, 0).astype(np.float32)
        k = np.zeros_like(vrow)
        for level in LEVELS:
            set_level(level)
            out = np.empty((1, 1, 1, D), np.float32)
            K.attention(
                np.ones((1, 1, 1, D), np.float32),
                k,
                np.ascontiguousarray(vrow),
                np.array([1], np.int32),
                np.array([[0]], np.int32),
                1.0,
                0.0,
                -1,
                out,
                kv_dtype=kvd(dtype),
            )
            reset_level()
            np.testing.assert_array_equal(out.reshape(-1), want)


def test_dtype_arguments():
    rng = np.random.default_rng(0)
    q = rand(rng, (1, 4, 1, 8))
    kf = rand(rng, (1, 2, 10, 8))
    kl = np.array([10], np.int32)
    qp = np.array([[9]], np.int32)
    kb = R.bf16_from_f32(kf)
    cases = [
        ("k", dict(k=kb, v=kb)),  # uint16 without kv_dtype
        ("k", dict(k=kf.astype(np.float16), v=kf.astype(np.float16), kv_dtype="bfloat16")),
        ("k", dict(k=kf, v=kf, kv_dtype="float16")),
        ("k", dict(k=kf.astype(np.float64), v=kf.astype(np.float64))),
        ("v", dict(k=kf.astype(np.float16), v=kf)),  # K and V must match
        ("v", dict(k=kb, v=kf.astype(np.float16), kv_dtype="bfloat16")),
        ("kv_dtype", dict(k=kf, v=kf, kv_dtype="int8")),
    ]
    for name, kw in cases:
        out = np.full_like(q, 42.0)
        with pytest.raises(ValueError, match=name):
            K.attention(q, kw["k"], kw["v"], kl, qp, 0.3, 0.0, -1, out, kv_dtype=kw.get("kv_dtype"))
        assert np.all(out == 42.0)
    # explicit dtype names that match the arrays are accepted
    out = np.empty_like(q)
    K.attention(q, kf, kf, kl, qp, 0.3, 0.0, -1, out, kv_dtype="float32")
    K.attention(q, kf.astype(np.float16), kf.astype(np.float16), kl, qp, 0.3, 0.0, -1, out, kv_dtype=np.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_private_tuning_switches_keep_results(dtype):
    """The benchmark-only switches (prefill row-group width, prefetch mode,
    extra cache split) change the schedule, never the result."""
    import sys

    A = sys.modules["onnxkv._kernels.attention"]
    rng = np.random.default_rng(17)
    q, k, v = make(rng, dtype, 1, 12, 4, 9, 3000, 64)
    qd, kd, vd = make(rng, dtype, 1, 8, 2, 1, 3000, 80)
    kv_len = np.array([2990], np.int32)
    old = (A._set_prefill_rg(4), A._set_prefetch(2), A._set_split_tasks(0))
    try:
        for rg, pf, st in [(1, 0, 0), (3, 1, 8), (8, 3, 2)]:
            A._set_prefill_rg(rg)
            A._set_prefetch(pf)
            A._set_split_tasks(st)
            check(dtype, q, k, v, kv_len, decode_positions(kv_len, 9), 0.125, combos=LONG_COMBOS)
            check(dtype, qd, kd, vd, kv_len, decode_positions(kv_len, 1), 0.11, combos=[(2, level) for level in LEVELS])
    finally:
        A._set_prefill_rg(old[0])
        A._set_prefetch(old[1])
        A._set_split_tasks(old[2])
