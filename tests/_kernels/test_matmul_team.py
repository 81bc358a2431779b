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
    """Two late team products in a row start a solo span of 20 ms (a time: products inside it run alone);
    when it has run out, the first team product decides alone: late, it starts the next span at once, twice
    as long (up to 2 s); on time, the team stays.  The span comes back to 20 ms once 4096 team products in a
    row were on time; a late one in between starts that count again."""
    from onnxkv._kernels._runtime import _team_expire, _team_report, _team_state

    ms = 1_000_000
    MM._set_adaptive(True)  # no products left alone, no span running
    _team_report(False, 4096)  # a span at its start, whatever ran before
    assert _team_state()["next_span_ns"] == 20 * ms
    assert _team_report(True) == 0  # one late product alone starts nothing
    assert 19 * ms < _team_report(True) <= 20 * ms  # the second in a row starts a span of 20 ms
    assert _team_report(True, 50) > 19 * ms  # inside the span products run alone: nothing reported
    assert _team_state()["late_run"] == 0
    spans = []
    for _ in range(9):
        _team_expire()
        spans.append(_team_report(True) // ms)  # a late retry: the next span at once, twice as long
    want = [40, 80, 160, 320, 640, 1280, 2000, 2000, 2000]
    assert all(w - 2 <= x <= w for x, w in zip(spans, want, strict=True)), spans
    _team_expire()
    assert _team_report(False) == 0 and not _team_state()["retrying"]  # an on-time retry: the team stays
    assert _team_report(True) == 0  # ... and one late product alone starts nothing again
    _team_report(False, 4095)
    assert _team_report(True, 2) > 1999 * ms  # the on-time count started again at the late one
    _team_expire()
    _team_report(False, 4096)
    assert 19 * ms < _team_report(True, 2) <= 20 * ms  # 4096 on time in a row: back to 20 ms
    MM._set_adaptive(False)  # (ends the span, sets the products left to 0)
    assert _team_report(True, 4) == 0  # switched off: late products start nothing


def test_a_caller_kept_off_its_core_runs_alone():
    """Once per window of 20 ms of team products the calling thread's run-queue delay (runnable, waiting
    for a core) is read: over a quarter of the window starts a solo span; less, or unknown, does not."""
    from onnxkv._kernels._runtime import _team_report, _team_state, _team_window

    ms = 1_000_000
    MM._set_adaptive(True)
    _team_report(False, 4096)  # the next span at its start, whatever ran before
    MM._set_adaptive(True)  # (also restarts the window)
    try:
        t = 10**12
        assert not _team_window(t, 0)  # the first window starts: nothing to compare yet
        assert not _team_window(t + 19 * ms, 19 * ms)  # the window still runs: not read
        assert not _team_window(t + 20 * ms, 5 * ms)  # a quarter exactly: no span
        assert _team_state()["solo_ns_left"] == 0
        assert not _team_window(t + 40 * ms, -1)  # unknown: no span, and the next window has no start value
        assert not _team_window(t + 60 * ms, 15 * ms)
        assert not _team_window(t + 80 * ms, 40 * ms, thread=2)  # another thread's delay: not compared
        assert not _team_window(t + 100 * ms, 60 * ms)  # ... nor the next window, which it started
        assert _team_window(t + 120 * ms, 65 * ms + 1)  # over a quarter of 20 ms: a span of 20 ms starts
        assert _team_state()["next_span_ns"] == 40 * ms
    finally:
        MM._set_adaptive(True)


def test_run_queue_delay_is_read_where_linux_reports_it():
    from pathlib import Path

    from onnxkv._kernels._runtime import _run_delay

    delay = _run_delay()
    if Path("/proc/thread-self/schedstat").exists():
        assert delay >= 0
    else:
        assert delay == -1
