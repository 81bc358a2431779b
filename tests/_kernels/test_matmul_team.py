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


def test_switched_off_keeps_the_team(two_threads):
    rng = np.random.default_rng(52)
    x, wp = rand(rng, (1, 256)), MM.pack_weight(rand(rng, (256, 400)))
    out = np.empty((1, 400), np.float32)
    MM._set_adaptive(False, solo=5)
    MM.matmul_packed(x, wp, out)
    assert MM._set_adaptive(True) == (False, 5)      # nothing counted down: the team ran


def test_small_products_do_not_count_down(two_threads):
    """Products below the parallel threshold run alone anyway and leave the count as it is."""
    rng = np.random.default_rng(53)
    x, wp = rand(rng, (1, 16)), MM.pack_weight(rand(rng, (16, 32)))
    out = np.empty((1, 32), np.float32)
    MM._set_adaptive(True, solo=4)
    MM.matmul_packed(x, wp, out)
    assert MM._set_adaptive(True) == (True, 4)
