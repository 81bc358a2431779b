"""A value at a key a query row does not see never reaches that row, not even as 0 * NaN.

A prefill work unit takes its query rows in groups (row blocks of the tiled
unit, row groups of the streaming one) that share each key tile; the rows of
a group see different keys on the tiles along the causal diagonal or a window
edge.  A NaN or infinite value at such a key must reach the rows that see it
(p * v by IEEE rules) and nothing else: the probabilities of the other rows
are exactly 0 there, and 0 * NaN is NaN.  The NumPy twin states the same
rule (reference.attention sums over the keys each row sees).

Every path: the tiled and the streaming unit over float32, float16 and
bfloat16 caches, paged caches, quantized pages with float pages between them,
and prefill_precision="bf16"; causal and windowed; every SIMD level and both
thread counts.
"""

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import rand
from .test_attention_flash import unit
from .test_attention_nan import assert_same
from .test_paged_attention import Paged, kvd, to_cache
from .test_quant_attention import QPaged, chooser

#: One row of 40 causal query tokens, 8 query heads on 2 KV heads, D = 64: the poisoned key 21 is on the
#: diagonal of the row blocks and row groups that hold tokens 16..31.
B, HQ, HKV, SQ, D, KEY, ELEM = 1, 8, 2, 40, 64, 21, 5


def _data(seed, poison, dtype="float32"):
    rng = np.random.default_rng(seed)
    q, k, v = rand(rng, (B, HQ, SQ, D)), rand(rng, (B, HKV, SQ, D)), rand(rng, (B, HKV, SQ, D))
    v[0, 0, KEY, ELEM] = poison
    kv_len = np.array([SQ], np.int32)
    q_pos = np.arange(SQ, dtype=np.int32)[None]
    return q, to_cache(k, dtype), to_cache(v, dtype), kv_len, q_pos


def _twin(q, k, v, kv_len, q_pos, window, dtype="float32", bf16=False):
    want = np.full_like(q, 42.0)
    with np.errstate(invalid="ignore", over="ignore"):
        R.attention(q, k, v, kv_len, q_pos, D**-0.5, 0.0, window, want, kv_dtype=kvd(dtype), bf16=bf16)
    return want


def _check(got, want, window, poison):
    """The twin's result, and the rule itself: the query heads of KV head 0 (0..3) are non-finite at the
    poisoned element exactly at the tokens that see key 21; every other value is finite."""
    assert_same(got, want)
    sees = (np.arange(SQ) >= KEY) & ((np.arange(SQ) - KEY <= window) if window >= 0 else True)
    bad = ~np.isfinite(got)
    assert not bad[0, 4:].any() and not bad[..., :ELEM].any() and not bad[..., ELEM + 1 :].any()
    for h in range(4):
        np.testing.assert_array_equal(bad[0, h, :, ELEM], sees)
    if poison == np.inf:  # positive probabilities times +inf
        assert (got[0, :4, sees, ELEM] == np.inf).all()


@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("window", [-1, 6])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("flash", [True, False], ids=["tiled", "streaming"])
def test_contiguous(flash, dtype, window, poison, threads, simd):
    q, k, v, kv_len, q_pos = _data(1, poison, dtype)
    got = np.full_like(q, 42.0)
    with unit(flash):
        K.attention(q, k, v, kv_len, q_pos, D**-0.5, 0.0, window, got, kv_dtype=kvd(dtype))
    _check(got, _twin(q, k, v, kv_len, q_pos, window, dtype), window, poison)


@pytest.mark.parametrize("window", [-1, 6])
@pytest.mark.parametrize("flash", [True, False], ids=["tiled", "streaming"])
def test_paged(flash, window, threads, simd):
    q, k, v, kv_len, q_pos = _data(2, np.nan)
    pg = Paged(np.random.default_rng(3), k, v, 16)
    got = np.full_like(q, 42.0)
    with unit(flash):
        K.paged_attention(q, pg.k_addr, pg.v_addr, pg.table, 16, HKV, kv_len, q_pos, D**-0.5, 0.0, window, got)
    _check(got, _twin(q, k, v, kv_len, q_pos, window), window, np.nan)


@pytest.mark.parametrize("window", [-1, 6])
@pytest.mark.parametrize("vG", [1, D])
@pytest.mark.parametrize("vfmt", [3, 22, 26], ids=["i8", "i4", "i2"])
def test_quantized_pages(vfmt, vG, window, threads, simd):
    """Pages of 16 keys: key 21 sits in the second page, kept float32 (a NaN has no quantized form);
    the others hold 8-, 4- or 2-bit values (per-head or per-channel scales) and 8-bit keys."""
    q, k, v, kv_len, q_pos = _data(4, 0.0)
    pid = int(QPaged(np.random.default_rng(5), k, v, 16, chooser(3, 0), chooser(vfmt, 0), 1, vG).table[0, KEY // 16])
    pg = QPaged(np.random.default_rng(5), k, v, 16, chooser(3, 0), lambda p: 1 if p == pid else vfmt, 1, vG)
    assert int(pg.table[0, KEY // 16]) == pid and pg.formats["v"][pid] == 1
    pg.pages["v"][pid][0, KEY % 16, ELEM] = np.nan
    want, got = np.full_like(q, 42.0), np.full_like(q, 42.0)
    with np.errstate(invalid="ignore", over="ignore"):
        pg.twin(q, HKV, kv_len, q_pos, D**-0.5, 0.0, window, want)
    pg.kernel(q, HKV, kv_len, q_pos, D**-0.5, 0.0, window, got)
    _check(got, want, window, np.nan)


@pytest.mark.skipif(not K.bf16_available(), reason="this CPU has no AVX-512-BF16")
@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("window", [-1, 6])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_bf16_precision(dtype, window, poison, threads, simd):
    """prefill_precision="bf16" (40 query tokens: at least BF16_MIN_ROWS)."""
    q, k, v, kv_len, q_pos = _data(6, poison, dtype)
    got = np.full_like(q, 42.0)
    with K.use_settings(K.current_settings().replace(prefill_precision="bf16")):
        K.attention(q, k, v, kv_len, q_pos, D**-0.5, 0.0, window, got, kv_dtype=kvd(dtype))
    want = _twin(q, k, v, kv_len, q_pos, window, dtype, bf16=True)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=0, atol=4e-3)
    _check(got, got, window, poison)


def test_twin_sums_over_the_keys_each_row_sees():
    """reference.attention: the rows before key 21 are those of the unpoisoned data."""
    q, k, v, kv_len, q_pos = _data(7, np.nan)
    clean = v.copy()
    clean[0, 0, KEY, ELEM] = 0.0
    got, want = _twin(q, k, v, kv_len, q_pos, -1), _twin(q, k, clean, kv_len, q_pos, -1)
    np.testing.assert_array_equal(got[:, :, :KEY], want[:, :, :KEY])
    assert np.isnan(got[0, :4, KEY:, ELEM]).all()
