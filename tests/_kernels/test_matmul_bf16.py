"""matmul_packed with prefill_precision="bf16" (matmul_bf16.h): products of at least BF16_MIN_ROWS rows on
bfloat16-rounded operands with float32 sums, against the NumPy twin (reference.matmul_bf16: the float64
product of the rounded operands) at every level and thread count; fewer rows stay float32 bit for bit; the
hardware rounding equals the portable one bit for bit."""

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import matmul as MM
from onnxkv._kernels import reference as R

from .conftest import rand

pytestmark = pytest.mark.skipif(not K.bf16_available(), reason="this CPU has no AVX-512-BF16")


def _bf16(fn):
    with K.use_settings(K.current_settings().replace(prefill_precision="bf16")):
        return fn()


def _check(x, w, bias=None):
    M, N = x.shape[0], w.shape[1]
    wp = MM.pack_weight(w)
    out, want = np.full((M, N), np.nan, np.float32), np.empty((M, N), np.float32)
    _bf16(lambda: MM.matmul_packed(x, wp, out, bias))
    R.matmul_bf16(x, wp, want, bias)
    # float32 sums of exact bfloat16 products: the error of a float32 dot product of length K
    scale = np.abs(R.bf16_round(x)).astype(np.float64) @ np.abs(R.bf16_round(w)).astype(np.float64)
    assert np.all(np.abs(out - want) <= 4e-7 * x.shape[1] ** 0.5 * scale + 1e-6), np.abs(out - want).max()
    return out


@pytest.mark.parametrize("M", [32, 33, 45, 64, 100])
@pytest.mark.parametrize("Kd,N", [(1, 7), (7, 33), (64, 48), (67, 50), (255, 129), (2050, 100), (1024, 2816)])
def test_bf16_product_equals_its_twin(M, Kd, N, threads, simd):
    rng = np.random.default_rng([M, Kd, N])
    x, w, b = rand(rng, (M, Kd)), rand(rng, (Kd, N)), rand(rng, (N,))
    _check(x, w)
    _check(x, w, b)


def test_bf16_differs_from_float32_and_fewer_rows_stay_float32(simd):
    """The switch changes the product from BF16_MIN_ROWS rows on (the rounding shows), not below."""
    rng = np.random.default_rng(5)
    w = rand(rng, (300, 70))
    wp = MM.pack_weight(w)
    for m in (1, 16, MM.BF16_MIN_ROWS - 1, MM.BF16_MIN_ROWS):
        x = rand(rng, (m, 300))
        f32, bf = np.empty((m, 70), np.float32), np.empty((m, 70), np.float32)
        MM.matmul_packed(x, wp, f32)
        _bf16(lambda x=x, bf=bf: MM.matmul_packed(x, wp, bf))
        if m < MM.BF16_MIN_ROWS:
            np.testing.assert_array_equal(bf, f32)
        else:
            assert np.abs(bf - f32).max() > 1e-3


def test_threads_agree_bit_for_bit(simd):
    rng = np.random.default_rng(9)
    x, w = rand(rng, (77, 1030)), rand(rng, (1030, 333))
    outs = []
    for t in (1, 2):
        with K.use_settings(K.current_settings().replace(threads=t)):
            outs.append(_check(x, w))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_hardware_rounding_equals_the_portable_rounding():
    """Nearest even, subnormals to signed zero, NaN quiet, infinities kept, K odd padded with 0."""
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, (37, 301), dtype=np.uint64).astype(np.uint32)
    specials = np.array([0, 0x80000000, 1, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFF800001,
                         0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00800000], np.uint32)  # fmt: skip
    bits[0, : specials.size] = specials
    x = bits.view(np.float32)
    hw, sw = MM._bf16_pairs(x, True), MM._bf16_pairs(x, False)
    np.testing.assert_array_equal(hw, sw)
    lo = (sw & 0xFFFF).astype(np.uint16)
    hi = (sw >> 16).astype(np.uint16)
    halves = np.stack([lo, hi], axis=-1).reshape(37, -1)
    assert (halves[:, 301] == 0).all()
    want = R.bf16_round(x).view(np.uint32) >> 16
    nan = np.isnan(x)
    np.testing.assert_array_equal(halves[:, :301][~nan], want[~nan])
    assert np.isnan(R.f32_from_bf16(halves[:, :301][nan])).all()


def test_settings_name_the_precision_and_refuse_bad_values():
    s = K.KernelSettings(prefill_precision="bf16")
    assert s.prefill_precision == "bf16" and "prefill_precision='bf16'" in repr(s)
    assert s.replace(prefill_precision="float32").prefill_precision == "float32"
    assert s != s.replace(prefill_precision="float32")
    for bad in ("fp16", "BF16", None, 1):
        with pytest.raises(ValueError, match="prefill_precision must be 'float32' or 'bf16'"):
            K.KernelSettings(prefill_precision=bad)
