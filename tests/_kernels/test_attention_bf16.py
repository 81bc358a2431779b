"""The prefill unit with prefill_precision="bf16" (attention_flash_bf16.h on AVX-512-BF16, the portable
twin okv_fl_head with a->bf16 at the other levels) against the NumPy twin reference.attention(bf16=True):
q * scale, k, v and the probabilities rounded to bfloat16, float32 sums.  The kernel rounds each
probability against its running max, the twin against the row's final max: they agree within 4e-3 on
N(0, 1) data, where float32 attention is 3e-3 to 1e-2 away.  Every level agrees with the portable twin
within 1e-3; calls of fewer than BF16_MIN_ROWS query tokens stay float32 bit for bit."""

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import matmul as MM
from onnxkv._kernels import reference as R

from .conftest import rand
from .test_attention_flash import PAGED, case_arrays, paged_arrays
from .test_attention_nan import _poison
from .test_paged_attention import kvd

pytestmark = pytest.mark.skipif(not K.bf16_available(), reason="this CPU has no AVX-512-BF16")

# (B, Hq, Hkv, Sq, past, D, window, softcap, kv_start)
CASES = [
    (1, 16, 4, 64, 0, 64, -1, 0.0, None),  # the small model's heads
    (2, 6, 2, 37, 21, 40, -1, 0.0, (0, 5)),  # rows cut short, a past, left padding
    (1, 4, 4, 45, 0, 63, 9, 0.0, None),  # MHA, a window, odd head size (a padded pair)
    (1, 8, 1, 70, 30, 17, 20, 30.0, None),  # MQA, odd head size, softcap
    (1, 3, 1, 33, 100, 128, -1, 5.0, None),  # G = 3, odd tokens in the last tile, long past
]


def _attention(q, k, v, kv_len, q_pos, D, softcap, window, kv_start, dtype, precision, simd=None):
    out = np.full_like(q, 42.0)
    settings = K.current_settings().replace(prefill_precision=precision)
    with K.use_settings(settings if simd is None else settings.replace(simd=simd)):
        K.attention(q, k, v, kv_len, q_pos, D**-0.5, softcap, window, out, kv_start, kv_dtype=kvd(dtype))
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_contiguous(case, dtype, threads, simd):
    D, window, softcap = CASES[case][5:8]
    q, k, v, kv_len, q_pos, kv_start = case_arrays(CASES[case], case, dtype)
    want = np.empty_like(q)
    R.attention(q, k, v, kv_len, q_pos, D**-0.5, softcap, window, want, kv_start, kv_dtype=kvd(dtype), bf16=True)
    args = (q, k, v, kv_len, q_pos, D, softcap, window, kv_start, dtype)
    got = _attention(*args, "bf16")
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-3)
    np.testing.assert_allclose(got, _attention(*args, "bf16", "scalar"), rtol=0, atol=1e-3)
    assert np.abs(got - _attention(*args, "float32")).max() > 1e-3  # the rounding ran


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bs", [16, 48])
def test_paged(bs, dtype, threads, simd):
    Hkv, D = PAGED[2], PAGED[5]
    q, k, v, paged, kv_len, q_pos = paged_arrays(bs, dtype)
    want = np.empty_like(q)
    R.attention(q, k, v, kv_len, q_pos, D**-0.5, 0.0, -1, want, kv_dtype=kvd(dtype), bf16=True)
    outs = {}
    for precision in ("bf16", "float32"):
        out = np.full_like(q, 42.0)
        with K.use_settings(K.current_settings().replace(prefill_precision=precision)):
            paged.kernel(q, Hkv, kv_len, q_pos, D**-0.5, 0.0, -1, out, dtype)
        outs[precision] = out
    np.testing.assert_allclose(outs["bf16"], want, rtol=0, atol=4e-3)
    assert np.abs(outs["bf16"] - outs["float32"]).max() > 1e-3


def test_fewer_query_tokens_stay_float32(simd):
    """Decode steps and speculative verifications (< BF16_MIN_ROWS tokens) are float32 attention."""
    rng = np.random.default_rng(4)
    B, Hq, Hkv, D, Cap = 1, 16, 4, 64, 200
    k, v = rand(rng, (B, Hkv, Cap, D)), rand(rng, (B, Hkv, Cap, D))
    for Sq in (1, 4, 16, MM.BF16_MIN_ROWS - 1):
        q = rand(rng, (B, Hq, Sq, D))
        kv_len = np.array([Cap], np.int32)
        q_pos = np.arange(Cap - Sq, Cap, dtype=np.int32)[None]
        args = (q, k, v, kv_len, q_pos, D, 0.0, -1, None, "float32")
        np.testing.assert_array_equal(_attention(*args, "bf16"), _attention(*args, "float32"))


@pytest.mark.parametrize("case", ["q-nan", "q-inf", "k-nan", "k-inf", "v-nan", "k-all-neg-inf"])
def test_nan_and_infinities(case, simd):
    """The rules of attention.h hold in bfloat16 too (rounding keeps NaN and infinities): a NaN or +inf
    visible score makes the row NaN, all -inf visible scores give zeros, a NaN value reaches the output."""
    rng = np.random.default_rng(3)
    B, Hq, Hkv, Sq, Cap, D = 2, 8, 2, 40, 100, 64
    q, k, v = rand(rng, (B, Hq, Sq, D)), rand(rng, (B, Hkv, Cap, D)), rand(rng, (B, Hkv, Cap, D))
    kv_len = np.array([Cap, Cap - 10], np.int32)  # every query of row 1 sees key 50, the poisoned one
    q_pos = (kv_len[:, None] - Sq + np.arange(Sq)[None, :]).astype(np.int32)
    _poison(case, q, k, v)
    want = np.full_like(q, 42.0)
    with np.errstate(invalid="ignore", over="ignore"):
        R.attention(q, k, v, kv_len, q_pos, D**-0.5, 0.0, -1, want, bf16=True)
    got = _attention(q, k, v, kv_len, q_pos, D, 0.0, -1, None, "float32", "bf16")
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=4e-3)
    if case == "k-all-neg-inf":
        assert (got[0] == 0).all() and np.isfinite(got[1]).all()
    elif case != "v-nan":
        assert np.isnan(got).any()
