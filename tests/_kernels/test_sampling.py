"""onnxkv._kernels.sampling.sample: temperature, top-k and top-p draws equal the NumPy twin (reference.sample)
on random logits of both float widths, ties and every vocabulary size class of the pairwise sums."""

from __future__ import annotations

import numpy as np
import pytest
from onnxkv._kernels.sampling import sample

from onnxkv._kernels import reference as R

from .conftest import rand

SETTINGS = [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.9), (0.8, 40, 0.95), (2.0, 1, 0.5), (1.0, 10**6, 1.0)]


@pytest.mark.parametrize("v", [1, 7, 8, 9, 127, 128, 129, 264, 1000, 32000])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
def test_draws_equal_the_numpy_twin(v, dtype, temperature, top_k, top_p):
    rng = np.random.default_rng([v, len(str(dtype)), int(temperature * 10)])
    logits = rand(rng, (3, v), dtype, scale=3.0)
    u = rng.random(3)
    got_p, want_p = np.full((3, v), np.nan), np.full((3, v), np.nan)
    got = sample(logits, temperature, top_k, top_p, u, got_p)
    want = R.sample(logits, temperature, top_k, top_p, u, want_p)
    np.testing.assert_allclose(got_p, want_p, rtol=1e-14, atol=1e-300)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int64 and ((got >= 0) & (got < v)).all()


@pytest.mark.parametrize("top_k, top_p", [(3, None), (None, 0.6), (4, 0.7)])
def test_ties_keep_every_tied_token_and_sort_lower_ids_first(top_k, top_p):
    """Few distinct values: top-k keeps the ties of its k-th value, top-p's stable order puts lower ids
    first; every u of a fine grid draws the twin's token."""
    rng = np.random.default_rng(4)
    logits = rng.integers(0, 4, (2, 50)).astype(np.float32)
    for u in np.linspace(0.0, 0.999, 101):
        uu = np.array([u, 1 - u - 1e-3])
        got_p, want_p = np.empty((2, 50)), np.empty((2, 50))
        np.testing.assert_array_equal(
            sample(logits, 1.0, top_k, top_p, uu, got_p), R.sample(logits, 1.0, top_k, top_p, uu, want_p)
        )
        np.testing.assert_allclose(got_p, want_p, rtol=1e-14)


def test_a_nan_logit_gives_the_twins_draw():
    logits = np.array([[0.5, np.nan, 1.0, -2.0]], np.float32)
    for top_k, top_p in ((None, None), (2, None), (None, 0.5)):
        u = np.array([0.3])
        with np.errstate(invalid="ignore"):
            want = R.sample(logits, 1.0, top_k, top_p, u)
        assert sample(logits, 1.0, top_k, top_p, u).tolist() == want.tolist()


@pytest.mark.parametrize("temperature", [1e-300, 1e-308, 5e-324])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_tiny_temperature_draws_the_argmax(temperature, dtype):
    """A temperature whose inverse overflows float64 (the logits' spread over it passes 1.8e308) draws the
    argmax, as the limit means, at every u: dividing before subtracting the max made the largest logits +inf,
    exp(inf - inf) NaN, and every draw id 0 (found by a fuzzing helper)."""
    rng = np.random.default_rng(9)
    logits = rand(rng, (4, 300), dtype, scale=3.0)
    best = logits.argmax(axis=-1)
    for u in (0.0, 0.5, 0.999999):
        uu = np.full(4, u)
        got_p, want_p = np.empty((4, 300)), np.empty((4, 300))
        got = sample(logits, temperature, 7, 0.9, uu, got_p)
        np.testing.assert_array_equal(got, best)
        np.testing.assert_array_equal(R.sample(logits, temperature, 7, 0.9, uu, want_p), best)
        np.testing.assert_array_equal(got_p, want_p)
        assert (got_p.sum(axis=-1) == 1.0).all()


def test_a_draw_never_takes_a_token_of_probability_zero():
    """u = 0 drew token 0 whatever its probability (the count of sums below u was 0): with top-k or top-p
    excluding it, a token outside them.  The first token whose cumulative sum passes u is drawn now; u above a
    total that rounding left below 1 draws the last token of nonzero probability."""
    logits = np.array([[0.0, 5.0, 1.0, 4.0, -1.0], [3.0, 0.0, 0.0, 0.0, 2.0]], np.float32)
    for top_k, top_p in ((2, None), (None, 0.5), (None, None)):
        for u in (0.0, 1.0 - 2**-53):
            uu = np.full(2, u)
            probs = np.empty((2, 5))
            got = sample(logits, 1.0, top_k, top_p, uu, probs)
            assert (probs[np.arange(2), got] > 0).all(), (top_k, top_p, u, got)
            np.testing.assert_array_equal(got, R.sample(logits, 1.0, top_k, top_p, uu))
    assert sample(logits, 1.0, 2, None, np.zeros(2)).tolist() == [1, 0]


def test_a_top_k_past_int64_keeps_every_id():
    x, u = rand(np.random.default_rng(4), (3, 50), np.float32), np.array([0.1, 0.5, 0.9])
    assert sample(x, 0.8, 2**63, None, u).tolist() == sample(x, 0.8, None, None, u).tolist()


def test_bad_arguments_raise_naming_them():
    x, u = np.zeros((2, 5), np.float32), np.full(2, 0.5)
    for args, match in (
        ((x.astype(np.float16), 1.0, None, None, u), "logits: dtype float16"),
        ((x[:, :0].copy(), 1.0, None, None, u), "at least one column"),
        ((x, 0.0, None, None, u), "temperature"),
        ((x, float("inf"), None, None, u), "temperature"),
        ((x, 1.0, 0, None, u), "top_k"),
        ((x, 1.0, None, 0.0, u), "top_p"),
        ((x, 1.0, None, 1.5, u), "top_p"),
        ((x, 1.0, None, None, u[:1]), "u: expected shape"),
        ((x, 1.0, None, None, np.array([0.5, 1.0])), r"u: expected values in \[0, 1\)"),
    ):
        with pytest.raises(ValueError, match=match):
            sample(*args)
    with pytest.raises(ValueError, match="probs: expected shape"):
        sample(x, 1.0, None, None, u, np.empty((2, 4)))


def test_exp_gives_the_same_bits_at_every_level():
    """The sampler's exp (sampling_exp.h) runs the same fused operations on every level: scalar, AVX2 and
    AVX-512 probabilities are bit for bit equal, each within a few ulp of NumPy's, also with the tails
    of the range (underflow to 0, -inf dropped by top-k) and vocabularies off the vector widths."""
    import onnxkv._kernels as K

    rng = np.random.default_rng(12)
    logits = np.concatenate([rand(rng, (2, 1003), np.float64, scale=40.0), np.full((2, 5), -800.0)], axis=1)
    logits[0, 3] = 750.0  # every other entry of row 0 then lies far below the max: exp underflows
    u = rng.random(2)
    got = {}
    for level in K.simd_levels():
        with K.use_settings(K.current_settings().replace(simd=level)):
            for top_k in (None, 50):
                p = np.empty(logits.shape)
                sample(logits, 1.0, top_k, None, u, p)
                got[level, top_k] = p
    for (level, top_k), p in got.items():
        np.testing.assert_array_equal(p, got["scalar", top_k], err_msg=f"{level} top_k={top_k}")
        want = np.empty(logits.shape)
        R.sample(logits, 1.0, top_k, None, u, want)
        np.testing.assert_allclose(p, want, rtol=1e-14, atol=1e-300)
