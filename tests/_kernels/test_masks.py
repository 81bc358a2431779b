"""masks.causal_mask against its NumPy twin: windows, offsets, padding holes, both output types, bad arguments."""

import numpy as np
import pytest
from onnxkv._kernels.masks import causal_mask

from onnxkv._kernels import reference as R


@pytest.mark.parametrize("dtype", [np.float32, np.bool_])
@pytest.mark.parametrize("seed", range(12))
def test_causal_mask_equals_its_twin(dtype, seed):
    rng = np.random.default_rng(seed)
    rows, nq, nk = int(rng.integers(1, 4)), int(rng.integers(0, 6)), int(rng.integers(0, 40))
    q0, window = int(rng.integers(-3, 40)), int(rng.choice([0, 1, 5, 8]))
    padded = rng.random() < 0.7
    mask = (rng.random((rows + int(rng.integers(0, 2)), nk + int(rng.integers(0, 3)))) < 0.8).astype(np.int64)
    mask = mask if padded else None
    out = np.full((rows, 1, nq, nk), 7, dtype)
    want = np.empty_like(out)
    causal_mask(mask, rows, nq, nk, q0, window, out, 0.0, -3.4028234663852886e38)
    R.causal_mask(mask, rows, nq, nk, q0, window, want, 0.0, -3.4028234663852886e38)
    np.testing.assert_array_equal(out, want)


def test_causal_mask_names_bad_arguments():
    out = np.empty((1, 1, 2, 5), np.float32)
    with pytest.raises(ValueError, match="window = -1"):
        causal_mask(None, 1, 2, 5, 3, -1, out)
    with pytest.raises(ValueError, match="out: expected shape"):  # not [rows, 1, nq, nk]
        causal_mask(None, 1, 2, 3, 3, 0, out)
    with pytest.raises(ValueError, match="mask: shape"):
        causal_mask(np.ones((1, 4), np.int64), 1, 2, 5, 3, 0, out)
    with pytest.raises(ValueError, match="mask: dtype"):
        causal_mask(np.ones((1, 5), np.int32), 1, 2, 5, 3, 0, out)
    with pytest.raises(ValueError, match="out: dtype"):
        causal_mask(None, 1, 2, 5, 3, 0, out.astype(np.float64))
    with pytest.raises(ValueError, match="q0"):
        causal_mask(None, 1, 2, 5, 2**63 - 1, 0, out)
