"""ThreadControl: each session's thread count applies to its own runs, side by side in two Python threads."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from concurrency import side_by_side
from fuzzing import examples
from threadpoolctl import threadpool_info

import onnxkv
from onnxkv import InputError, _kernels
from onnxkv._threads import ThreadControl
from onnxkv.zoo.builders import MICRO, build_model


def _blas_threads():
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


class _Spy(onnxkv.SystemAllocator):
    """Records the kernel thread count the calling thread has whenever the plan allocates (during its runs)."""

    def __init__(self):
        super().__init__()
        self.threads = set()

    def allocate(self, nbytes, alignment=64):
        self.threads.add(_kernels.get_num_threads())
        return super().allocate(nbytes, alignment)


def _prompt(sess, batch=2, length=8):
    """Feeds of a prompt without a past for ``sess`` (a MICRO model)."""
    ids = np.arange(1, batch * length + 1).reshape(batch, length) % MICRO.vocab_size
    past = np.zeros((batch, MICRO.num_kv_heads, 0, MICRO.head_size), np.float32)
    return {
        "input_ids": ids.astype(np.int64),
        "attention_mask": np.ones((batch, length), np.int64),
        "position_ids": np.arange(length)[None].repeat(batch, 0).astype(np.int64),
        **{name: past for name in sess.input_names if name.startswith("past_key_values.")},
    }


def test_concurrent_sessions_keep_their_own_thread_count():
    """Two sessions with threads=1 and threads=2 run side by side: every run of
    each sees its own count, and afterwards the caller's kernel threads and the
    BLAS limits are what they were."""
    model = build_model("attention", MICRO)
    spies = [_Spy(), _Spy()]
    sessions = [onnxkv.Session(model, threads=n + 1, allocator=spies[n]) for n in range(2)]
    feeds = _prompt(sessions[0])
    threads_before, blas_before = _kernels.get_num_threads(), _blas_threads()

    def work(i, r):
        sessions[i].run(feeds)
        assert spies[i].threads == {i + 1}, f"session {i} round {r}: kernel threads {spies[i].threads}"

    side_by_side(work, examples(30))
    assert _kernels.get_num_threads() == threads_before
    assert _blas_threads() == blas_before


def test_concurrent_sessions_keep_their_own_kernel_settings_and_results():
    """Sessions with threads=1 on the scalar path and threads=2 on the widest
    level, run side by side: every run's last kernel call took its own settings
    and its outputs are bit for bit those of the same run alone."""
    from onnxkv._kernels._runtime import _settings_seen

    model = build_model("attention", MICRO)
    levels = ["scalar", _kernels.simd_levels()[-1]]
    sessions = [onnxkv.Session(model, threads=1), onnxkv.Session(model, threads=2)]
    feeds = _prompt(sessions[0])
    want = []
    for sess, level in zip(sessions, levels):
        with _kernels.use_settings(_kernels.KernelSettings(simd=level)):
            want.append(sess.run(feeds))
    if levels[1] != "scalar":  # the levels give other bits: cross-talk would show in the outputs
        assert not np.array_equal(want[0]["logits"], want[1]["logits"])

    def work(i, r):
        mine = _kernels.KernelSettings(threads=sessions[i].threads, simd=levels[i])
        with _kernels.use_settings(mine.replace(threads=3)):  # the session's threads= replace the caller's
            got = sessions[i].run(feeds)
            assert _settings_seen()[0] == mine, f"session {i} round {r}"
        for name, value in want[i].items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"session {i} round {r}: {name}")

    side_by_side(work, examples(20))


def _in_order(*steps):
    """Run the callables of ``steps`` (thread index, callable) one after the other, each in thread
    ``index`` of two threads that stay alive until every step ran."""
    turns = [threading.Event() for _ in steps] + [threading.Event()]
    turns[0].set()

    def thread(i):
        for n, (who, step) in enumerate(steps):
            if who == i:
                assert turns[n].wait(30), f"step {n} never came"
                step()
                turns[n + 1].set()
        assert turns[-1].wait(30)

    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(thread, i) for i in range(2)]:
            f.result()


def test_overlapping_runs_leave_the_blas_limit_to_the_first():
    """Runs entered A, B and left A, B: the limit A set holds until A ends
    (B's limit is not applied meanwhile), then the original comes back for
    good."""
    original = _blas_threads()
    runs = [ThreadControl(2)(1), ThreadControl(2)()]
    seen = []
    _in_order(
        (0, runs[0].__enter__),
        (1, runs[1].__enter__),
        (1, lambda: seen.append(_blas_threads())),
        (0, lambda: runs[0].__exit__(None, None, None)),
        (1, lambda: seen.append(_blas_threads())),
        (1, lambda: runs[1].__exit__(None, None, None)),
    )
    assert seen == [[1] * len(original), original]
    assert _blas_threads() == original


def test_a_run_limits_blas_after_a_run_in_another_live_thread():
    """A decode-sized run keeps BLAS to one thread in any Python thread, also
    after another, still running, thread ran one."""
    original = _blas_threads()
    seen = []

    def run():
        with ThreadControl(2)(1):
            seen.append(_blas_threads())

    _in_order((0, run), (1, run), (0, run))
    assert seen == [[1] * len(original)] * 3
    assert _blas_threads() == original


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, 1 << 20])
def test_thread_count_is_checked(bad):
    with pytest.raises(InputError, match="threads must be a positive int"):
        ThreadControl(bad)


def test_a_generation_loop_sets_the_blas_limit_once(monkeypatch):
    """generate holds BLAS at one thread for its whole decode loop: the limit is
    taken (set, then restored) by the prompt run and once by the loop, not by
    every token's run; the callback (inside the loop) sees it, and the original
    comes back after."""
    from threadpoolctl import threadpool_limits

    from onnxkv import _threads

    sess = onnxkv.Session(build_model("gqa", MICRO), threads=2)
    ids = np.arange(1, 9, dtype=np.int64)[None] % MICRO.vocab_size
    taken = []
    take = _threads._BLAS.take
    monkeypatch.setattr(_threads._BLAS, "take", lambda n: taken.append(take(n)) or taken[-1])
    with threadpool_limits(limits=2, user_api="blas"):
        original = _blas_threads()
        for tokens in (4, 16):
            taken.clear()
            onnxkv.generate(sess, ids, max_new_tokens=tokens, eos_token_id=[])
            assert taken.count(True) == 2, (tokens, taken)
            assert _blas_threads() == original
        seen = []
        onnxkv.generate(sess, ids, max_new_tokens=4, callback=lambda s, t: seen.append(_blas_threads()))
    assert seen and all(s == [1] * len(original) for s in seen)


def test_a_replayed_step_takes_no_blas_limit_and_a_python_node_does(monkeypatch):
    """A session run takes the BLAS limit only once a node runs in Python: the prompt and the recording run
    take it, a decode step replayed wholly in C does not (nor does the compiled generation loop); without
    compiled steps every run takes it."""
    from onnxkv import _threads
    from onnxkv.generate.feeds import FeedBuilder

    taken = []
    take = _threads._BLAS.take
    monkeypatch.setattr(_threads._BLAS, "take", lambda n: taken.append(n) or take(n))
    original = _blas_threads()
    for compiled in (True, False):
        sess = onnxkv.Session(build_model("gqa", MICRO, seed=10), threads=2, compiled_steps=compiled)
        prompt = np.array([[3, 4, 5]])
        builder = FeedBuilder(sess.plan.inputs, sess.model, prompt, np.array([3]), 0, thread_cache=False)
        state = sess.new_state()
        state.run(builder.first()[0])
        per_run = []
        for token in range(1, 6):
            taken.clear()
            state.run(builder.next(np.array([[token]]), None))
            per_run.append(taken.copy())
        assert per_run[-1] == ([] if compiled else [1]), per_run
        assert _blas_threads() == original
        if compiled:
            (step,) = sess.plan.steps.idle
            assert step.compiled_nodes == len(sess.plan.nodes)
            assert per_run[0] == [1]  # a node-by-node run: the limit is taken, at one thread for decode
            taken.clear()
            names = builder.decode_names
            run = state.decode_steps(builder.next(np.array([[7]]), None), 4, names)
            assert run.steps == 4 and taken == []
        state.close()
