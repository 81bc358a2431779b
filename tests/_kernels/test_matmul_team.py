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
    x, w = rand(rng, (M, 256)), rand(rng, (256, 600))  # large enough for a team of two (M*K*N >= 2 * 2**16)
    wp = MM.pack_weight(w)
    team = np.full((M, 600), np.nan, np.float32)
    MM._set_adaptive(False)
    MM.matmul_packed(x, wp, team)
    MM._set_adaptive(True, solo=3)
    for left in (2, 1, 0):
        solo = np.full((M, 600), np.nan, np.float32)
        MM.matmul_packed(x, wp, solo)
        np.testing.assert_array_equal(solo, team)
        assert MM._set_adaptive(True, solo=left) == (True, left)
    want = np.empty_like(team)
    R.matmul_packed(x, R.pack_weight(w), want)
    np.testing.assert_allclose(team, want, rtol=1e-5, atol=1e-4)  # K = 256 sums in another order


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


@pytest.mark.parametrize("nt", [1, 2, 3, 4])
@pytest.mark.parametrize("M, Kd, N", [(1, 64, 16), (1, 300, 1000), (3, 129, 5000), (7, 40, 333), (13, 17, 900)])
def test_claimed_panels_equal_one_thread(nt, M, Kd, N):
    """Threads claim chunks of panels (their own range from the front, then
    the others' from the back): any thread count gives the one-thread result
    bit for bit, also with more threads than cores and fewer panels than
    threads x chunks."""
    rng = np.random.default_rng([53, nt, M, N])
    x, w, b = rand(rng, (M, Kd)), rand(rng, (Kd, N)), rand(rng, (N,))
    wp = MM.pack_weight(w)
    outs = []
    old = K.get_num_threads()
    try:
        for t in (1, nt):
            K.set_num_threads(t)
            o = np.full((M, N), np.nan, np.float32)
            MM.matmul_packed(x, wp, o, b)
            outs.append(o)
    finally:
        K.set_num_threads(old)
    np.testing.assert_array_equal(outs[1], outs[0])
    want = np.empty_like(outs[0])
    R.matmul_packed(x, R.pack_weight(w), want, b)
    np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5 * np.sqrt(Kd))


@pytest.mark.parametrize("nt, order", [(2, [0, 1]), (2, [1, 0]), (3, [2, 0, 1]), (4, [1, 3, 0, 2])])
@pytest.mark.parametrize("N", [16 * 5, 1000, 16 * 301])
def test_first_thread_takes_every_panel_of_a_late_team(nt, order, N):
    """A team member that arrives after the others' ranges are done finds no
    panel left: the first thread took every range, each panel exactly once."""
    rng = np.random.default_rng([54, nt, N])
    M, Kd = 2, 70
    x, w = rand(rng, (M, Kd)), rand(rng, (Kd, N))
    wp = MM.pack_weight(w)
    P = wp.shape[0]
    if nt > P:
        pytest.skip("fewer panels than threads")
    out = np.full((M, N), np.nan, np.float32)
    assert MM._claim_in_turn(x, wp, out, nt, order) == [P] + [0] * (nt - 1)
    want = np.full((M, N), np.nan, np.float32)
    MM.matmul_packed(x, wp, want)
    np.testing.assert_array_equal(out, want)


def test_solo_spans_double_while_the_team_stays_late_and_restart_once_it_is_on_time(two_threads):
    """Each time the team is late twice in a row the products left to run alone are set to the solo span,
    which then doubles (64 up to 8192) until 4096 team products in a row were on time; a late one in
    between starts that count again."""
    from onnxkv._kernels._runtime import _team_report

    MM._set_adaptive(True)
    _team_report(False, 4096)  # a span at its start, whatever ran before
    assert _team_report(True) == MM._set_adaptive(True, solo=0)[1]  # one late product alone starts nothing
    spans = [_team_report(True, 2) for _ in range(9)]
    assert spans == [64, 128, 256, 512, 1024, 2048, 4096, 8192, 8192]
    _team_report(False, 4095)
    _team_report(True)  # late once: the on-time count starts again
    _team_report(False, 4095)
    assert _team_report(True, 2) == 8192
    _team_report(False, 4096)
    assert _team_report(True, 2) == 64
    MM._set_adaptive(False)  # (sets the products left to 0)
    assert _team_report(True, 4) == 0  # switched off: late products start nothing
