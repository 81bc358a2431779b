"""paged_attention with ``kv_start`` per row (an attention mask's ranges: left padding, a sliding start).

Compared with the NumPy twin (reference.paged_attention with kv_start) and with
the contiguous kernel (attention with kv_start) at every SIMD level and thread
count.  Blocks wholly before a row's kv_start are mapped to -1 or to NaN pages:
the kernel must not read them, and the fast (C) argument checks must accept
such tables exactly when the Python checks do.
"""

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R
from onnxkv._kernels._validate import paged_blocks_read

from .conftest import rand
from .test_paged_attention import Paged, kvd, to_cache


def _case(seed, dtype, Hq, Hkv, D, bs, kv_len, kv_start, Sq=1, window=-1, skip=True):
    rng = np.random.default_rng(seed)
    kv_len = np.array(kv_len, np.int32)
    kv_start = np.array(kv_start, np.int32)
    B, Cap = len(kv_len), int(kv_len.max()) + 3
    q = rand(rng, (B, Hq, Sq, D))
    k = to_cache(rand(rng, (B, Hkv, Cap, D)), dtype)
    v = to_cache(rand(rng, (B, Hkv, Cap, D)), dtype)
    q_pos = (kv_len[:, None] - Sq + np.arange(Sq)[None, :]).astype(np.int32)
    read = paged_blocks_read(kv_len, q_pos, window, bs, -(-Cap // bs), kv_start) if skip else None
    pg = Paged(rng, k, v, bs, read, nan_pages=skip)
    return q, k, v, kv_len, q_pos, kv_start, pg


@pytest.mark.parametrize(
    "dtype,Hq,Hkv,D,bs,kv_len,kv_start,Sq,window",
    [
        ("float32", 32, 8, 128, 16, [300, 90], [0, 37], 1, -1),
        ("float32", 8, 8, 64, 4, [70, 70], [64, 5], 1, -1),  # row 0 sees its last 6 keys only
        ("float16", 8, 1, 80, 24, [1000, 333], [500, 333], 1, -1),  # row 1 sees no key: zeros
        ("bfloat16", 32, 8, 64, 16, [2000, 64], [17, 1], 3, 100),
        ("float32", 4, 2, 64, 16, [3000], [1200], 1, -1),  # one row: split across threads
        ("float32", 8, 2, 64, 8, [40, 41], [3, 9], 7, -1),  # prefill rows
    ],
)
def test_kv_start_matches_twin_and_contiguous(dtype, Hq, Hkv, D, bs, kv_len, kv_start, Sq, window, threads, simd):
    q, k, v, kv_len, q_pos, kv_start, pg = _case(sum(kv_len) + bs, dtype, Hq, Hkv, D, bs, kv_len, kv_start, Sq, window)
    scale = D**-0.5
    want, got, contig = (np.full_like(q, np.nan) for _ in range(3))
    R.paged_attention(
        q,
        pg.k_pages,
        pg.v_pages,
        pg.table,
        bs,
        Hkv,
        kv_len,
        q_pos,
        scale,
        0.0,
        window,
        want,
        kv_start=kv_start,
        kv_dtype=kvd(dtype),
    )
    K.paged_attention(
        q,
        pg.k_addr,
        pg.v_addr,
        pg.table,
        bs,
        Hkv,
        kv_len,
        q_pos,
        scale,
        0.0,
        window,
        got,
        kv_start=kv_start,
        kv_dtype=kvd(dtype),
    )
    K.attention(q, k, v, kv_len, q_pos, scale, 0.0, window, contig, kv_start, kv_dtype=kvd(dtype))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, contig, rtol=1e-5, atol=1e-5)
    for b in range(len(kv_len)):
        seen = (kv_start[b] <= q_pos[b]) & (np.maximum(kv_start[b], 0) < kv_len[b])
        assert np.isfinite(got[b]).all() and (got[b][:, ~seen] == 0).all()


def test_kv_start_int64_and_python_checks_agree(python_checks):
    """int64 kv_start takes the Python checks; the result equals the int32 call's (C checks only)."""
    q, k, v, kv_len, q_pos, kv_start, pg = _case(5, "float32", 8, 2, 64, 16, [200, 150], [40, 100])
    a, b = np.empty_like(q), np.empty_like(q)
    K.paged_attention(q, pg.k_addr, pg.v_addr, pg.table, 16, 2, kv_len, q_pos, 0.125, 0.0, -1, a, kv_start=kv_start)
    assert python_checks == []
    K.paged_attention(
        q, pg.k_addr, pg.v_addr, pg.table, 16, 2, kv_len, q_pos, 0.125, 0.0, -1, b, kv_start=kv_start.astype(np.int64)
    )
    assert "kv_start" in python_checks
    np.testing.assert_array_equal(a, b)


def test_blocks_before_kv_start_need_no_page():
    """The -1 entries (and NaN pages) before kv_start are legal; without kv_start the same table is refused."""
    q, k, v, kv_len, q_pos, kv_start, pg = _case(7, "float32", 8, 2, 64, 16, [200, 150], [40, 100], skip=True)
    assert pg.table[0, 0] == -1 and pg.table[1, 1] == -1 and pg.table[1, 0] >= 0
    out = np.full_like(q, np.nan)
    K.paged_attention(q, pg.k_addr, pg.v_addr, pg.table, 16, 2, kv_len, q_pos, 0.125, 0.0, -1, out, kv_start=kv_start)
    assert np.isfinite(out).all()
    with pytest.raises(ValueError, match=r"block_tables: row 0, block 0 .* entry is -1"):
        K.paged_attention(q, pg.k_addr, pg.v_addr, pg.table, 16, 2, kv_len, q_pos, 0.125, 0.0, -1, out)


@pytest.mark.parametrize(
    "bad,message",
    [
        (np.array([0, 209], np.int32), r"kv_start: values must be in \[0, 208\], got range \[0, 209\]"),
        (np.array([-1, 0], np.int32), r"kv_start: values must be in \[0, 208\], got range \[-1, 0\]"),
        (np.array([0], np.int32), r"kv_start: expected shape \(2,\)"),
        (np.array([0.0, 1.0], np.float32), "kv_start"),
    ],
)
def test_bad_kv_start_raises_before_writing(bad, message):
    q, k, v, kv_len, q_pos, kv_start, pg = _case(9, "float32", 8, 2, 64, 16, [200, 150], [0, 0], skip=False)
    out = np.full_like(q, 42.0)
    with pytest.raises(ValueError, match=message):
        K.paged_attention(q, pg.k_addr, pg.v_addr, pg.table, 16, 2, kv_len, q_pos, 0.125, 0.0, -1, out, kv_start=bad)
    assert (out == 42.0).all()
