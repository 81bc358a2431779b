"""NaN and infinities in the attention kernels follow the dense softmax (the NumPy twin, onnx.reference).

A query row one of whose visible scores is NaN or +inf outputs NaN (a NaN in
the query, in a visible key, an infinite query element); a row whose visible
scores are all -inf outputs zeros; a NaN value of a visible key reaches the
output; a NaN key the row does not see (masked inside a tile, before kv_start)
changes nothing.  Every path: contiguous (float32, float16, bfloat16), paged,
quantized pages (with and without the AMX tiles), cache-split merges (two
threads, one long row) and the fused decode_token, at every SIMD level.
"""

import sys

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import rand
from .test_paged_attention import Paged, kvd, to_cache
from .test_quant_attention import QPaged, chooser

A = sys.modules["onnxkv._kernels.attention"]
AMX = A.set_attention_amx(True)


def assert_same(got, want):
    """NaN where the twin has NaN, equal infinities, the finite values close."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)])
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


def twin(q, k, v, kv_len, q_pos, window=-1, kv_start=None, kv_dtype=None):
    want = np.full_like(q, 42.0)
    with np.errstate(invalid="ignore", over="ignore"):
        R.attention(q, k, v, kv_len, q_pos, q.shape[-1] ** -0.5, 0.0, window, want, kv_start, kv_dtype=kv_dtype)
    return want


def _data(seed, B=2, Hq=8, Hkv=2, Sq=1, Cap=100, D=64):
    rng = np.random.default_rng(seed)
    q, k, v = rand(rng, (B, Hq, Sq, D)), rand(rng, (B, Hkv, Cap, D)), rand(rng, (B, Hkv, Cap, D))
    kv_len = np.array([Cap, Cap - 20][:B], np.int32)
    q_pos = (kv_len[:, None] - Sq + np.arange(Sq)[None, :]).astype(np.int32)
    return q, k, v, kv_len, q_pos


def _poison(case, q, k, v):
    """Put NaN / inf where ``case`` says (row 0 head 1 of the query; key 50 of row 1, KV head 0)."""
    if case == "q-nan":
        q[0, 1, :, 3] = np.nan
    elif case == "q-inf":
        q[0, 1, :, 3] = np.inf
    elif case == "k-nan":
        k[1, 0, 50, 3] = np.nan
    elif case == "k-inf":
        k[1, 0, 50, :] = np.inf  # +inf scores for queries with a positive sum, -inf for the others
    elif case == "v-nan":
        v[1, 0, 50, 3] = np.nan
    elif case == "k-all-neg-inf":  # every visible score of row 0 is -inf: zeros
        q[0] = np.abs(q[0])
        k[0] = -np.inf


CASES = ["q-nan", "q-inf", "k-nan", "k-inf", "v-nan", "k-all-neg-inf"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_contiguous(case, dtype, threads, simd):
    q, k, v, kv_len, q_pos = _data(CASES.index(case))
    _poison(case, q, k, v)
    k, v = to_cache(k, dtype), to_cache(v, dtype)
    want = twin(q, k, v, kv_len, q_pos, kv_dtype=kvd(dtype))
    got = np.full_like(q, 42.0)
    K.attention(q, k, v, kv_len, q_pos, q.shape[-1] ** -0.5, 0.0, -1, got, kv_dtype=kvd(dtype))
    assert_same(got, want)
    if case != "v-nan":
        assert np.isnan(got).any() == (case != "k-all-neg-inf")
    if case == "k-all-neg-inf":
        assert (got[0] == 0).all() and np.isfinite(got[1]).all()


@pytest.mark.parametrize("case", ["q-nan", "k-nan", "k-inf"])
def test_cache_split_merge(case, simd):
    """One long row on two threads: the chunk that meets the NaN makes the merged row NaN."""
    q, k, v, kv_len, q_pos = _data(7, B=1, Hq=4, Hkv=1, Cap=4000)
    if case == "q-nan":
        q[0, 1, 0, 3] = np.nan
    else:
        k[0, 0, 3000, :] = np.nan if case == "k-nan" else np.inf
    old = K.get_num_threads()
    try:
        K.set_num_threads(2)
        got = np.full_like(q, 42.0)
        K.attention(q, k, v, kv_len, q_pos, q.shape[-1] ** -0.5, 0.0, -1, got)
    finally:
        K.set_num_threads(old)
    assert_same(got, twin(q, k, v, kv_len, q_pos))
    assert np.isnan(got).any()


def test_keys_a_row_does_not_see_change_nothing(threads, simd):
    """A NaN key masked inside a tile (after a prefill row's position, before kv_start) is not seen."""
    q, k, v, kv_len, q_pos = _data(11, Sq=6)
    k[0, :, int(q_pos[0, 2]) + 1, :] = np.nan  # visible to query tokens 3.. of row 0 only
    v[0, :, int(q_pos[0, 2]) + 1, :] = 1.0
    kv_start = np.array([0, 30], np.int32)
    k[1, :, 29, :] = np.nan  # before row 1's kv_start
    want = twin(q, k, v, kv_len, q_pos, kv_start=kv_start)
    got = np.full_like(q, 42.0)
    K.attention(q, k, v, kv_len, q_pos, q.shape[-1] ** -0.5, 0.0, -1, got, kv_start)
    assert_same(got, want)
    assert np.isfinite(got[0, :, :3]).all() and np.isnan(got[0, :, 3:]).all() and np.isfinite(got[1]).all()


@pytest.mark.parametrize("case", CASES)
def test_paged(case, threads, simd):
    q, k, v, kv_len, q_pos = _data(20 + CASES.index(case), Hq=32, Hkv=8, D=128)
    _poison(case, q, k, v)
    pg = Paged(np.random.default_rng(1), k, v, 16)
    got = np.full_like(q, 42.0)
    K.paged_attention(q, pg.k_addr, pg.v_addr, pg.table, 16, 8, kv_len, q_pos, q.shape[-1] ** -0.5, 0.0, -1, got)
    assert_same(got, twin(q, k, v, kv_len, q_pos))


#: (case, key page formats, key scale groups): a NaN key can only sit in a float page.
QUANT_CASES = [
    (case, kspec, kG)
    for kspec, kG in [(3, 1), (22, 1), (2, "D"), ((1, 3, 21), 1)]
    for case in ("q-nan", "q-inf", "k-nan")
    if case != "k-nan" or isinstance(kspec, tuple)
]


@pytest.mark.parametrize("amx", [False, True] if AMX else [False])
@pytest.mark.parametrize("case,kspec,kG", QUANT_CASES)
def test_quantized_pages(case, kspec, kG, amx, threads, simd):
    """Keys in 8- and 4-bit pages (per-head and per-channel scales, some float pages between): a NaN or an
    infinity in a query row makes it NaN."""
    q, k, v, kv_len, q_pos = _data(31, Hq=8, Hkv=2, D=128, Cap=90)
    D = q.shape[-1]
    pg = QPaged(np.random.default_rng(2), k, v, 16, chooser(kspec, 4), chooser(3, 5), D if kG == "D" else kG, 1)
    if case == "k-nan":
        float_pages = [
            (b, i)
            for b in range(2)
            for i in range(pg.table.shape[1])
            if pg.formats["k"][pg.table[b, i]] == 1 and i * 16 < kv_len[b]
        ]
        b, i = float_pages[0]
        pg.pages["k"][int(pg.table[b, i])][0, 0, 3] = np.nan
    else:
        _poison(case, q, k, v)
    A.set_attention_amx(amx)
    try:
        want, got = np.full_like(q, 42.0), np.full_like(q, 42.0)
        with np.errstate(invalid="ignore", over="ignore"):
            pg.twin(q, 2, kv_len, q_pos, D**-0.5, 0.0, -1, want)
        pg.kernel(q, 2, kv_len, q_pos, D**-0.5, 0.0, -1, got)
    finally:
        A.set_attention_amx(True)
    if case == "q-inf" and simd.startswith("avx512") and amx:
        # on the AMX tiles a query row with an infinity scores NaN (no fixed-point form)
        np.testing.assert_array_equal(
            np.isnan(got).any(axis=(2, 3)), np.isnan(q).any(axis=(2, 3)) | np.isinf(q).any(axis=(2, 3))
        )
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    else:
        assert_same(got, want)
    assert np.isnan(got).any()


@pytest.mark.parametrize("case", ["q-nan", "k-nan"])
def test_decode_token(case, threads, simd):
    rng = np.random.default_rng(41)
    hq, hkv, d, cap, pos = 8, 2, 64, 40, 30
    q, k, v = rand(rng, (1, 1, hq * d)), rand(rng, (1, 1, hkv * d)), rand(rng, (1, 1, hkv * d))
    kc, vc = rand(rng, (1, hkv, cap, d)), rand(rng, (1, hkv, cap, d))
    if case == "q-nan":
        q[0, 0, 3] = np.nan  # query head 0
    else:
        kc[0, 1, 7, 5] = np.nan  # KV head 1: query heads 4..7
    kc2, vc2 = kc.copy(), vc.copy()
    got, want = np.full_like(q, 42.0), np.full_like(q, 42.0)
    assert K.decode_token(q, k, v, None, None, False, kc, vc, pos, d**-0.5, 0.0, -1, got)
    with np.errstate(invalid="ignore"):
        R.decode_token(q, k, v, None, None, False, kc2, vc2, pos, d**-0.5, 0.0, -1, want)
    assert_same(got, want)
    heads = np.isnan(got.reshape(hq, d)).all(axis=1)
    assert heads.tolist() == ([True] + [False] * 7 if case == "q-nan" else [False] * 4 + [True] * 4)
