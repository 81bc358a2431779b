"""The tiled prefill unit (attention_flash.h) against the NumPy twin and the streaming unit.

Work units of at least 4 query tokens and 24 query rows over native K/V
(float32, float16, bfloat16; contiguous and paged) take the tiled unit; the
private switch ``_set_flash(0)`` sends them to the streaming unit.  Every case
runs both at every SIMD level and thread count, on random data: each must
match the twin within 1e-5, and the two must differ in their float32 rounding
(the scale is folded into the query rows), which shows that the switch chose a
different unit.  Shapes cover row blocks cut short (rows not a multiple of the
16 or 32 lanes), head sizes off the micro-kernels' multiples, GQA / MHA / MQA,
a cached past (chunked prompts), sliding windows, softcap and left padding;
the NaN and infinity rules of attention.h hold for the tiled unit as well.
"""

import contextlib
import sys

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import rand
from .test_attention_nan import _poison, assert_same
from .test_paged_attention import Paged, kvd, to_cache

A = sys.modules["onnxkv._kernels.attention"]


@contextlib.contextmanager
def unit(flash):
    """Work units of this thread take the tiled unit (flash=True) or the streaming one."""
    old = A._set_flash(flash)
    try:
        yield
    finally:
        A._set_flash(old)


# (B, Hq, Hkv, Sq, past, D, window, softcap, kv_start)
CASES = [
    (1, 16, 4, 160, 0, 64, -1, 0.0, None),  # the small model's heads: whole row blocks
    (2, 6, 2, 37, 21, 40, -1, 0.0, (0, 5)),  # rows cut short, a past, left padding
    (1, 4, 4, 45, 0, 72, 9, 0.0, None),  # MHA, a window inside the tiles
    (1, 8, 1, 70, 30, 17, 20, 30.0, None),  # MQA, odd head size, softcap
    (1, 3, 1, 24, 100, 128, -1, 5.0, None),  # G = 3, long past, large head size
]


def _run(q, k, v, kv_len, q_pos, D, softcap, window, kv_start, dtype, flash):
    out = np.full_like(q, 42.0)
    with unit(flash):
        K.attention(q, k, v, kv_len, q_pos, D**-0.5, softcap, window, out, kv_start, kv_dtype=kvd(dtype))
    return out


def case_arrays(case: tuple, seed: int, dtype: str) -> tuple:
    """Random q, k, v (caches of ``dtype``), kv_len, q_pos and kv_start of a case (B, Hq, Hkv, Sq, past, D,
    window, softcap, kv_start): the Sq tokens follow a past of ``past`` keys, three spare positions."""
    B, Hq, Hkv, Sq, past, D, window, softcap, starts = case
    rng = np.random.default_rng(seed)
    Cap = past + Sq + 3
    q = rand(rng, (B, Hq, Sq, D))
    k, v = to_cache(rand(rng, (B, Hkv, Cap, D)), dtype), to_cache(rand(rng, (B, Hkv, Cap, D)), dtype)
    kv_len = np.full(B, past + Sq, np.int32)
    q_pos = np.tile(np.arange(past, past + Sq, dtype=np.int32), (B, 1))
    return q, k, v, kv_len, q_pos, None if starts is None else np.array(starts, np.int32)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_contiguous(case, dtype, threads, simd):
    D, window, softcap = CASES[case][5:8]
    q, k, v, kv_len, q_pos, kv_start = case_arrays(CASES[case], case, dtype)
    want = np.empty_like(q)
    R.attention(q, k, v, kv_len, q_pos, D**-0.5, softcap, window, want, kv_start, kv_dtype=kvd(dtype))
    tiled = _run(q, k, v, kv_len, q_pos, D, softcap, window, kv_start, dtype, True)
    streaming = _run(q, k, v, kv_len, q_pos, D, softcap, window, kv_start, dtype, False)
    np.testing.assert_allclose(tiled, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tiled, streaming, rtol=1e-5, atol=1e-5)
    assert not np.array_equal(tiled, streaming)  # the two units ran


PAGED = (2, 8, 2, 50, 30, 64)  # B, Hq, Hkv, Sq, past, D: 50 tokens after a past of 30


def paged_arrays(bs: int, dtype: str) -> tuple:
    """q, k, v, their ``Paged`` copy in pages of ``bs`` tokens, kv_len (the second row 7 keys shorter) and
    q_pos of the PAGED case."""
    rng = np.random.default_rng(bs)
    B, Hq, Hkv, Sq, past, D = PAGED
    Cap = past + Sq
    k, v = to_cache(rand(rng, (B, Hkv, Cap, D)), dtype), to_cache(rand(rng, (B, Hkv, Cap, D)), dtype)
    paged = Paged(rng, k, v, bs)
    q = rand(rng, (B, Hq, Sq, D))
    kv_len = np.array([Cap, Cap - 7], np.int32)
    q_pos = (kv_len[:, None] - Sq + np.arange(Sq)[None, :]).astype(np.int32)
    return q, k, v, paged, kv_len, q_pos


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("bs", [16, 48])
def test_paged(bs, dtype, threads, simd):
    """Tiles never straddle a page: page sizes below and above the 32-key tile, a past in shuffled pages."""
    Hkv, D = PAGED[2], PAGED[5]
    q, k, v, paged, kv_len, q_pos = paged_arrays(bs, dtype)
    want = np.empty_like(q)
    paged.twin(q, Hkv, kv_len, q_pos, D**-0.5, 0.0, -1, want, dtype)
    outs = []
    for flash in (True, False):
        out = np.full_like(q, 42.0)
        with unit(flash):
            paged.kernel(q, Hkv, kv_len, q_pos, D**-0.5, 0.0, -1, out, dtype)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=f"flash={flash}")
        outs.append(out)
    assert not np.array_equal(*outs)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("G", [1, 6])
def test_paged_keys_no_query_sees_between_windows_are_never_read(G, dtype, threads, simd):
    """Queries far apart under a window leave blocks between their windows that no query sees: their
    table entries may be -1.  The tiled unit walked every key from the lowest to the highest seen one and
    looked those blocks up (a segfault at every level); it now skips them, as the streaming unit does."""
    from onnxkv._kernels._validate import paged_blocks_read

    rng = np.random.default_rng(G)
    D, Hkv, bs, window, L, Sq = 8, 1, 4, 2, 401, 40  # 40 tokens: the bfloat16 unit takes them too
    q_pos = np.linspace(0, L - 1, Sq).astype(np.int32)[None, :]
    kv_len = np.array([L], np.int32)
    k, v = to_cache(rand(rng, (1, Hkv, L, D)), dtype), to_cache(rand(rng, (1, Hkv, L, D)), dtype)
    read = paged_blocks_read(kv_len, q_pos.astype(np.int64), window, bs, -(-L // bs))
    assert not read.all()
    paged = Paged(rng, k, v, bs, read=read)
    q = rand(rng, (1, Hkv * G, Sq, D))
    want = np.empty_like(q)
    paged.twin(q, Hkv, kv_len, q_pos, D**-0.5, 0.0, window, want, dtype)
    for flash in (True, False):
        out = np.full_like(q, 42.0)
        with unit(flash):
            paged.kernel(q, Hkv, kv_len, q_pos, D**-0.5, 0.0, window, out, dtype)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=f"flash={flash}")
    if K.bf16_available():  # attention_flash_bf16.h walked the keys the same way
        out = np.full_like(q, 42.0)
        with K.use_settings(K.current_settings().replace(prefill_precision="bf16")):
            paged.kernel(q, Hkv, kv_len, q_pos, D**-0.5, 0.0, window, out, dtype)
        np.testing.assert_allclose(out, want, rtol=0, atol=3e-2)


@pytest.mark.parametrize("case", ["q-nan", "q-inf", "k-nan", "k-inf", "v-nan", "k-all-neg-inf"])
def test_nan_and_infinities(case, simd):
    """The rules of attention.h in the tiled unit: a NaN or +inf visible score makes the row NaN, all -inf
    visible scores give zeros, a NaN value reaches the output through p * v."""
    rng = np.random.default_rng(3)
    B, Hq, Hkv, Sq, Cap, D = 2, 8, 2, 20, 100, 64
    q, k, v = rand(rng, (B, Hq, Sq, D)), rand(rng, (B, Hkv, Cap, D)), rand(rng, (B, Hkv, Cap, D))
    kv_len = np.array([Cap, Cap - 20], np.int32)
    q_pos = (kv_len[:, None] - Sq + np.arange(Sq)[None, :]).astype(np.int32)
    _poison(case, q, k, v)
    want = np.full_like(q, 42.0)
    with np.errstate(invalid="ignore", over="ignore"):
        R.attention(q, k, v, kv_len, q_pos, D**-0.5, 0.0, -1, want)
    got = _run(q, k, v, kv_len, q_pos, D, 0.0, -1, None, "float32", True)
    assert_same(got, want)
    if case == "k-all-neg-inf":
        assert (got[0] == 0).all() and np.isfinite(got[1]).all()
    elif case != "v-nan":
        assert np.isnan(got).any()


def test_rows_that_see_nothing_get_zeros(simd):
    """Tokens before kv_start or past kv_len see no key: zeros, as the twin (and NaN keys they do not see
    change nothing)."""
    rng = np.random.default_rng(5)
    B, Hq, Hkv, Sq, Cap, D = 1, 4, 1, 24, 40, 32
    q, k, v = rand(rng, (B, Hq, Sq, D)), rand(rng, (B, Hkv, Cap, D)), rand(rng, (B, Hkv, Cap, D))
    q_pos = np.arange(Sq, dtype=np.int32)[None]
    kv_start = np.array([10], np.int32)
    k[0, 0, :10] = np.nan  # before kv_start: never seen
    kv_len = np.array([Sq], np.int32)
    want = np.full_like(q, 42.0)
    R.attention(q, k, v, kv_len, q_pos, D**-0.5, 0.0, -1, want, kv_start)
    got = _run(q, k, v, kv_len, q_pos, D, 0.0, -1, kv_start, "float32", True)
    assert_same(got, want)
    assert (got[0, :, :10] == 0).all() and np.isfinite(got).all()
