"""matmul_packed running alone after a late thread team (onnxkv._kernels.matmul._set_adaptive).

Whether a team is late depends on the machine's load, so the tests drive the
state directly: products left to run alone are counted down one per product,
give the team's result bit for bit, and are ignored with the switch off.
"""
import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import matmul as MM
from onnxkv._kernels import reference as R

from .conftest import rand


@pytest.fixture
def two_threads():
    old = K.get_num_threads()
    K.set_num_threads(2)
    yield
    K.set_num_threads(old)
    MM._set_adaptive(True)


@pytest.mark.parametrize("M", [1, 3])
def test_solo_products_equal_team_products(two_threads, M):
    rng = np.random.default_rng(51)
    x, w = rand(rng, (M, 256)), rand(rng, (256, 400))     # large enough for the team (M*K*N >= 2**16)
    wp = MM.pack_weight(w)
    team = np.full((M, 400), np.nan, np.float32)
    MM._set_adaptive(False)
    MM.matmul_packed(x, wp, team)
    MM._set_adaptive(True, solo=3)
    for left in (2, 1, 0):
        solo = np.full((M, 400), np.nan, np.float32)
        MM.matmul_packed(x, wp, solo)
        np.testing.assert_array_equal(solo, team)
        assert MM._set_adaptive(True, solo=left) == (True, left)
    want = np.empty_like(team)
    R.matmul_packed(x, R.pack_weight(w), want)
    np.testing.assert_allclose(team, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("enabled, k, n", [(False, 256, 400), (True, 16, 32)], ids=["switched-off", "small"])
def test_count_kept_when_not_counting_down(two_threads, enabled, k, n):
    """With the switch off (the team runs), or for a product below the parallel
    threshold (one thread anyway), the products left to run alone stay as set."""
    rng = np.random.default_rng(52)
    x, wp = rand(rng, (1, k)), MM.pack_weight(rand(rng, (k, n)))
    out = np.full((1, n), np.nan, np.float32)
    MM._set_adaptive(enabled, solo=5)
    MM.matmul_packed(x, wp, out)
    assert MM._set_adaptive(True) == (enabled, 5)
    assert np.isfinite(out).all()
