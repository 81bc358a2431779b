"""States and sessions given allocators that break their contract: every buffer is rejected before a kernel
writes to it, the state is unchanged and goes on with a good allocator; a failing free leaves it whole."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hostile_allocators import MODES, TYPED_ONLY, Hostile
from state_steps import assert_same_values, last_logits, step_feeds, values_copy

import onnxkv
from onnxkv import CacheConfig
from onnxkv.alloc import SlabAllocator
from onnxkv.cache.page_set import PageSet
from onnxkv.errors import OutOfMemory
from onnxkv.zoo.builders import MICRO, build_model
from onnxkv.zoo.paged import PagedConfig, build_paged_model

ALL = {**MODES, **TYPED_ONLY}


@pytest.fixture(scope="module")
def session():
    return onnxkv.Session(build_model("gqa", MICRO, seed=5), threads=1)


def _reject(alloc, mode, call):
    """Run ``call`` with ``alloc`` broken the ``mode`` way: it must fail with the mode's error; then heal."""
    error, fragment = ALL[mode]
    alloc.mode = mode
    try:
        with pytest.raises(error, match=fragment) as e:
            call()
    finally:
        alloc.mode = None
    assert f"Hostile({mode!r})" in str(e.value)


GUARDED = textwrap.dedent("""
    import ctypes, mmap
    import numpy as np
    import onnxkv
    from onnxkv.alloc import AllocatorStats
    from onnxkv.generate.feeds import FeedBuilder
    from onnxkv.zoo.builders import MICRO, build_model

    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    class Reversed:
        # nbytes ending right before an inaccessible page; view() walks the heads backwards
        def __init__(self, nbytes):
            body = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
            self.region = mmap.mmap(-1, body + mmap.PAGESIZE)
            raw = np.frombuffer(self.region, np.uint8)
            assert libc.mprotect(raw.__array_interface__["data"][0] + body, mmap.PAGESIZE, 0) == 0
            self.raw, self.nbytes = raw[body - nbytes: body], nbytes
            self.address = self.raw.__array_interface__["data"][0]

        def view(self, dtype, shape):
            return self.raw.view(dtype).reshape(shape)[::-1]

    class Reversing:
        def allocate(self, nbytes, alignment=64):
            return Reversed(nbytes)

        def free(self, buffer):
            pass

        def stats(self):
            return AllocatorStats(0, 0, 0, 0, 0)

    sess = onnxkv.Session(build_model("gqa", MICRO, seed=1), threads=1)
    state = sess.new_state(cache="paged", allocator=Reversing())
    feeds, _ = FeedBuilder(sess.plan.inputs, sess.model, np.array([[1, 2, 3, 4, 5]]), np.array([5]), 0,
                           thread_cache=False).first()
    try:
        state.run(feeds)
    except onnxkv.InputError as e:
        print("rejected:", e)
""")


def test_pages_viewed_with_negative_strides_are_rejected_not_written_past(tmp_path):
    done = subprocess.run([sys.executable, "-c", GUARDED], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "rejected: BlockPool: plane 'past_key_values.0.key'" in done.stdout
    assert "negative strides" in done.stdout


LEFT_OPEN = textwrap.dedent("""
    import numpy as np
    import onnxkv
    from onnxkv.generate.feeds import FeedBuilder
    from onnxkv.zoo.builders import MICRO, build_model

    sess = onnxkv.Session(build_model("gqa", MICRO, seed=1), threads=1)
    states = [sess.new_state(cache=c) for c in ("paged", "contiguous")]
    feeds, _ = FeedBuilder(sess.plan.inputs, sess.model, np.array([[1, 2, 3, 4, 5]]), np.array([5]), 0,
                           thread_cache=False).first()
    for state in states:
        state.run(feeds)
    print("left open", [s.length for s in states])
""")


def test_states_left_open_at_interpreter_exit_free_their_storage_without_errors(tmp_path):
    # their pages and buffers are freed by the states' collection at exit, into allocators still alive then
    done = subprocess.run([sys.executable, "-c", LEFT_OPEN], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.split() == ["left", "open", "[5,", "5]"], done.stderr[-2000:]
    assert "raised" not in done.stderr and "Error" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("mode", sorted(ALL))
def test_contiguous_state_rejects_broken_storage_and_goes_on(session, mode):
    feeds = step_feeds(session, 4, 3)
    with session.new_state(cache=CacheConfig(initial_capacity=4)) as ref:
        want = [last_logits(ref, f) for f in feeds]
    alloc = Hostile()
    with session.new_state(allocator=alloc, cache=CacheConfig(initial_capacity=4)) as st:
        _reject(alloc, mode, lambda: st.run(feeds[0]))  # the first caches
        assert st.length == 0 and st.values == {}
        np.testing.assert_array_equal(last_logits(st, feeds[0]), want[0])
        before = values_copy(st)
        _reject(alloc, mode, lambda: st.run(feeds[1]))  # the caches grow past 4 positions
        assert st.length == 4
        assert_same_values(values_copy(st), before)
        for f, w in zip(feeds[1:], want[1:]):
            np.testing.assert_array_equal(last_logits(st, f), w)
    assert alloc.inner.stats().live == 0


@pytest.mark.parametrize("mode", sorted(ALL))
def test_paged_state_rejects_broken_pages_and_goes_on(session, mode):
    feeds = step_feeds(session, 4, 3)
    with session.new_state(cache=CacheConfig("paged", block_size=4)) as ref:
        want = [last_logits(ref, f) for f in feeds]
    alloc = Hostile()
    with session.new_state(allocator=alloc, cache=CacheConfig("paged", block_size=4)) as st:
        np.testing.assert_array_equal(last_logits(st, feeds[0]), want[0])
        before, committed = values_copy(st), st.committed_bytes
        _reject(alloc, mode, lambda: st.run(feeds[1]))  # position 4 needs a new page
        st.pool.audit()
        assert st.length == 4 and st.committed_bytes == committed
        assert_same_values(values_copy(st), before)
        for f, w in zip(feeds[1:], want[1:]):
            np.testing.assert_array_equal(last_logits(st, f), w)
        st.pool.audit()
    assert alloc.inner.stats().live == 0


@pytest.mark.parametrize("mode", sorted(MODES))
def test_int8_policy_rejects_broken_payloads_and_the_run_changes_nothing(session, mode):
    feeds = step_feeds(session, 7, 3)  # block 0 is full after the prompt, block 1 after the first step
    with session.new_state(cache=CacheConfig("paged", block_size=4, kv_format="int8")) as ref:
        want = [last_logits(ref, f) for f in feeds]
        want_formats = [f[ref.page_tables[0]].tolist() for f in ref.pool.formats]
    alloc = Hostile()
    with session.new_state(allocator=alloc, cache=CacheConfig("paged", block_size=4, kv_format="int8")) as st:
        np.testing.assert_array_equal(last_logits(st, feeds[0]), want[0])
        before, committed = values_copy(st), st.committed_bytes
        formats = [f[st.page_tables[0]].tolist() for f in st.pool.formats]
        # converting block 1 is part of the step: its broken payload fails the step, which changes nothing
        _reject(alloc, mode, lambda: st.run(feeds[1]))
        st.pool.audit()
        assert st.length == 7 and st.committed_bytes == committed
        assert_same_values(values_copy(st), before)
        assert [f[st.page_tables[0]].tolist() for f in st.pool.formats] == formats
        for f, w in zip(feeds[1:], want[1:]):  # made again, the steps give what they give untroubled
            np.testing.assert_array_equal(last_logits(st, f), w)
        assert [f[st.page_tables[0]].tolist() for f in st.pool.formats] == want_formats
        st.pool.audit()
    assert alloc.inner.stats().live == 0


@pytest.mark.parametrize("mode", sorted(MODES))
def test_quantize_pages_rejects_broken_payloads_and_changes_nothing(session, mode):
    feeds = step_feeds(session, 9, 0)
    alloc = Hostile()
    with (
        session.new_state(allocator=alloc, cache=CacheConfig("paged", block_size=4)) as st,
        session.new_state(cache=CacheConfig("paged", block_size=4)) as ref,
    ):
        st.run(feeds[0])
        ref.run(feeds[0])
        fork = st.fork()[0]  # shared pages: the call copies them first
        before, formats = values_copy(st), [f.copy() for f in st.pool.formats]
        _reject(alloc, mode, lambda: st.quantize_pages([0, 1], "int8", "int4"))
        st.pool.audit()
        assert_same_values(values_copy(st), before)
        for a, b in zip(st.pool.formats, formats):
            np.testing.assert_array_equal(a, b)
        st.quantize_pages([0, 1], "int8", "int4")
        ref.quantize_pages([0, 1], "int8", "int4")
        assert_same_values(values_copy(st), values_copy(ref))
        assert_same_values(values_copy(fork), before)
        fork.close()
        st.pool.audit()
    assert alloc.inner.stats().live == 0


def test_quantize_pages_after_a_failed_batch_reuses_its_addresses(session):
    """The payloads a failed quantize_pages built and gave back are handed out again (a slab reuses the lowest
    free slot): they are not mistaken for live ones."""
    feeds = step_feeds(session, 9, 0)
    alloc = Hostile(inner=SlabAllocator(1 << 16))
    with session.new_state(allocator=alloc, cache=CacheConfig("paged", block_size=4)) as st:
        st.run(feeds[0])
        before = values_copy(st)
        alloc.mode, alloc.after = "raise-memory", alloc.calls + 3  # three payloads are built, the fourth fails
        with pytest.raises(OutOfMemory, match="raised MemoryError"):
            st.quantize_pages([0, 1], "int8", "int8")
        alloc.mode = None
        assert_same_values(values_copy(st), before)
        st.quantize_pages([0, 1], "int8", "int8")
        st.pool.audit()
        assert st.pool.converted == [2] * len(st.pool.planes)


def _paged_model_feeds(cfg, rng, batch=1):
    table = np.arange(cfg.max_blocks * batch, dtype=np.int32).reshape(batch, cfg.max_blocks)
    prompt = {
        "hidden": rng.standard_normal((batch, 8, cfg.hidden_size)).astype(np.float32),
        "block_table": table,
        "seqlens_k": np.zeros(batch, np.int32),
    }
    params = {
        f"{p}_scale.{i}": np.full((2, cfg.num_kv_heads), 0.05, np.float32)
        for p in ("key", "value")
        for i in range(cfg.num_layers)
    }
    params.update(
        {
            f"{p}_zero_point.{i}": np.zeros((2, cfg.num_kv_heads), np.int8)
            for p in ("key", "value")
            for i in range(cfg.num_layers)
        }
    )
    step = {
        "hidden": rng.standard_normal((batch, 1, cfg.hidden_size)).astype(np.float32),
        "block_table": table,
        "seqlens_k": np.full(batch, 8, np.int32),
        "quantize_blocks": np.array([0, 1], np.int32),
        **params,
    }
    return prompt, step


@pytest.mark.parametrize("mode", sorted(ALL))
def test_declared_binding_state_rejects_broken_storage_and_payloads(mode):
    cfg = PagedConfig(num_layers=2, key_format="int8", value_format="int8")
    sess = onnxkv.Session(build_paged_model(cfg), threads=1)
    prompt, step = _paged_model_feeds(cfg, np.random.default_rng(3))
    with sess.new_state() as ref:
        want = [ref.run(f)["output"] for f in (prompt, step)]
    alloc = Hostile()
    with sess.new_state(allocator=alloc) as st:
        _reject(alloc, mode, lambda: st.run(prompt))  # the page tensors themselves  # noqa: F821  (ruff misreads the with-target inside the lambda)
        assert st.steps == 0 and not any(v.any() for v in st.values.values())  # at most a layer's fresh zeros
        np.testing.assert_array_equal(st.run(prompt)["output"], want[0])
        storage = [st.values[f"past.{i}"] for i in range(cfg.num_layers)]  # views of the page tensors
        before = [a.copy() for a in storage]
        if mode not in TYPED_ONLY:  # the converted pages' payloads are bytes
            _reject(alloc, mode, lambda: st.run(step))  # noqa: F821
            for a, b in zip(storage, before):
                np.testing.assert_array_equal(a, b)
                assert PageSet.of(a) is None or not PageSet.of(a).any_converted
        np.testing.assert_array_equal(st.run(step)["output"], want[1])
        for a in storage:
            assert PageSet.of(a).any_converted
            PageSet.of(a).audit()
    del storage, before, a  # views over the page tensors' memory: they do not keep the tensor objects
    gc.collect()
    assert alloc.inner.stats().live == 0  # the closed state dropped its page tensors, their payloads with them


@pytest.mark.parametrize("mode", sorted(MODES))
def test_session_temporaries_reject_broken_buffers(session, mode):
    feeds = step_feeds(session, 5, 1)
    with session.new_state() as ref:
        want = [last_logits(ref, f) for f in feeds]
    alloc = Hostile()
    sess = onnxkv.Session(build_model("gqa", MICRO, seed=5), threads=1, allocator=alloc)
    with sess.new_state() as st:
        _reject(alloc, mode, lambda: st.run(feeds[0]))
        assert alloc.inner.stats().live == 0 and st.length == 0  # every temporary of the failed run went back
        for f, w in zip(feeds, want):
            np.testing.assert_array_equal(last_logits(st, f), w)
    assert alloc.inner.stats().live == 0


def test_contiguous_growth_whose_free_fails_publishes_the_run_and_logs(session, caplog):
    """A growth keeps the committed buffer until the run ends; the run's commit frees it, so a failing free
    comes after the publish: logged, and the state runs on in its new storage."""
    feeds = step_feeds(session, 4, 2)
    with session.new_state(cache=CacheConfig(initial_capacity=4)) as ref:
        want = [last_logits(ref, f) for f in feeds]
    alloc = Hostile()
    with session.new_state(allocator=alloc, cache=CacheConfig(initial_capacity=4)) as st:
        last_logits(st, feeds[0])
        alloc.free_raises = True
        with caplog.at_level(logging.WARNING, logger="onnxkv.alloc"):
            np.testing.assert_array_equal(last_logits(st, feeds[1]), want[1])
        assert any(
            "past_key_values.0.key" in r.getMessage() and "hostile free refuses" in r.getMessage()
            for r in caplog.records
        )
        assert st.length == 5  # the 4-token prompt and one step: past the initial capacity of 4
        alloc.free_raises = False
        for f, w in zip(feeds[2:], want[2:]):
            np.testing.assert_array_equal(last_logits(st, f), w)


def test_paged_state_whose_free_fails_stays_whole(session, caplog):
    feeds = step_feeds(session, 9, 2)
    with session.new_state(cache=CacheConfig("paged", block_size=4)) as ref:
        want = [last_logits(ref, f) for f in feeds]
    alloc = Hostile()
    st = session.new_state(allocator=alloc, cache=CacheConfig("paged", block_size=4))
    np.testing.assert_array_equal(last_logits(st, feeds[0]), want[0])
    fork = st.fork()[0]
    alloc.free_raises = True
    with caplog.at_level(logging.WARNING, logger="onnxkv.alloc"):
        st.quantize_pages([0], "int8", "int8")  # the copies replace native payloads: their frees fail
        np.testing.assert_allclose(last_logits(fork, feeds[1]), want[1], atol=1e-5)  # copy on write, then commit
        st.pool.audit()
        fork.truncate(4)
        fork.close()
        st.pool.audit()
        st.close()
    assert any("hostile free refuses" in r.getMessage() for r in caplog.records)
    assert st.pool.live_pages == 0 and st.pool.committed_bytes == 0
    st.pool.audit()


def test_session_temporaries_whose_free_fails_are_logged_and_the_run_succeeds(session, caplog):
    feeds = step_feeds(session, 5, 2)
    with session.new_state() as ref:
        want = [last_logits(ref, f) for f in feeds]
    alloc = Hostile()
    alloc.free_raises = True
    sess = onnxkv.Session(build_model("gqa", MICRO, seed=5), threads=1, allocator=alloc)
    with caplog.at_level(logging.WARNING, logger="onnxkv.alloc"), sess.new_state() as st:
        for f, w in zip(feeds, want):
            np.testing.assert_array_equal(last_logits(st, f), w)
    assert any("Plan temporaries: Hostile(None).free" in r.getMessage() for r in caplog.records)


def test_a_state_closes_whatever_its_allocator_free_does(session, caplog):
    alloc = Hostile()
    st = session.new_state(allocator=alloc)
    st.run(step_feeds(session, 3, 0)[0])
    alloc.free_raises = True
    with caplog.at_level(logging.WARNING, logger="onnxkv.alloc"):
        st.close()
    assert st.closed and st.values == {}
    assert sum("hostile free refuses" in r.getMessage() for r in caplog.records) == 2 * MICRO.num_layers
