"""Paged states: parity with contiguous caches, copy-on-write operations, exhaustion, eviction."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import onnxkv
from onnxkv import CacheConfig
from onnxkv.errors import Cancelled, InputError, OutOfMemory, StateError
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.runtime.state import Cancellation
from onnxkv.zoo.builders import MICRO, build_model

FAMILIES = ["gqa", "attention", "concat", "tensorscatter"]
PLANES = 2 * MICRO.num_layers
PAGE_PLANE_BYTES = MICRO.num_kv_heads * MICRO.head_size * 4  # one token of one plane


@pytest.fixture(scope="module", params=FAMILIES)
def session(request):
    return onnxkv.Session(build_model(request.param, MICRO, seed=21), threads=1, events=True)


@pytest.fixture(scope="module")
def gqa():
    return onnxkv.Session(build_model("gqa", MICRO, seed=4), threads=1, events=True)


class Driver:
    """Feeds a state step by step and records the last-position logits."""

    def __init__(self, session, state, prompt):
        self.session, self.state = session, state
        self.logits_name = session.model.io.logits
        self.b = FeedBuilder(
            session.plan.inputs, session.model, prompt, np.full(prompt.shape[0], prompt.shape[1]), 0, thread_cache=False
        )
        feeds, _ = self.b.first()
        self.out = state.run(feeds, [self.logits_name])

    @property
    def last(self):
        return self.out[self.logits_name][:, -1].copy()

    def step(self, tokens):
        self.out = self.state.run(self.b.next(np.asarray(tokens, np.int64), self.out), [self.logits_name])
        return self.last

    def greedy(self, n):
        got = [self.last]
        for _ in range(n):
            got.append(self.step(np.argmax(got[-1], axis=-1)))
        return got


def _events(session, action):
    return [e for e in session.events if e.action == action]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_matches_contiguous_for_every_family(session, block_size):
    prompt = np.random.default_rng(0).integers(0, MICRO.vocab_size, (2, 7))
    with session.new_state() as ref_state, session.new_state(cache=CacheConfig("paged", block_size=block_size)) as st:
        want = Driver(session, ref_state, prompt).greedy(18)
        got = Driver(session, st, prompt).greedy(18)
        for w, g in zip(want, got):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        for name, v in ref_state.values.items():
            np.testing.assert_allclose(st.values[name], v, rtol=1e-5, atol=1e-5)
        assert st.pool.live_pages > 0
    assert st.pool.live_pages == 0


def test_paged_exports_present_like_contiguous(gqa):
    prompt = np.random.default_rng(1).integers(0, MICRO.vocab_size, (1, 5))
    present = gqa.model.convention.present_outputs[0]
    outs = []
    for cache in ("contiguous", "paged"):
        with gqa.new_state(cache=CacheConfig(cache, block_size=4) if cache == "paged" else CacheConfig(cache)) as st:
            b = FeedBuilder(gqa.plan.inputs, gqa.model, prompt, np.array([5]), 0, thread_cache=False)
            feeds, _ = b.first()
            outs.append(st.run(feeds, [present])[present])
    np.testing.assert_array_equal(outs[0], outs[1])


def test_fork_shares_pages_and_diverges_by_copy_on_write(gqa):
    prompt = np.random.default_rng(2).integers(0, MICRO.vocab_size, (1, 6))
    st = gqa.new_state(cache=CacheConfig("paged", block_size=4))
    d = Driver(gqa, st, prompt)
    live = st.pool.live_pages
    gqa.events.clear()
    forks = st.fork(2)
    assert st.pool.live_pages == live  # fork copies nothing
    (ev,) = _events(gqa, "fork")
    assert ev.cow_copied_bytes == 0 and ev.prefix_copied_bytes == 0 and ev.allocations == 0
    drivers = []
    for f, tok in zip(forks, (3, 9)):
        fd = Driver.__new__(Driver)
        fd.session, fd.state, fd.logits_name = gqa, f, d.logits_name
        fd.b = FeedBuilder(gqa.plan.inputs, gqa.model, prompt, np.array([6]), 0, thread_cache=False)
        fd.b.first()
        fd.out = d.out
        gqa.events.clear()
        fd.step([tok])
        cow = sum(e.cow_copied_bytes for e in _events(gqa, "cache_write"))
        # the shared partial page (6 % 4 = 2 valid tokens) is copied once per plane; full pages never
        assert cow == PLANES * 2 * PAGE_PLANE_BYTES
        drivers.append((fd, tok))
    # each fork equals a fresh contiguous run of the same tokens
    for fd, tok in drivers:
        with gqa.new_state() as ref:
            rd = Driver(gqa, ref, prompt)
            np.testing.assert_allclose(fd.last, rd.step([tok]), rtol=1e-5, atol=1e-5)
    # the original still sees only its prompt
    with gqa.new_state() as ref:
        rd = Driver(gqa, ref, prompt)
        np.testing.assert_allclose(d.step([5]), rd.step([5]), rtol=1e-5, atol=1e-5)
    for f in forks:
        f.close()
    st.close()
    assert st.pool.live_pages == 0


def test_reorder_expands_beams_without_copies_and_bounds_committed_bytes(gqa):
    k, bs = 4, 4
    prompt = np.random.default_rng(3).integers(0, MICRO.vocab_size, (1, 9))
    st = gqa.new_state(cache=CacheConfig("paged", block_size=bs))
    d = Driver(gqa, st, prompt)
    gqa.events.clear()
    st.reorder(np.zeros(k, np.int64))
    _permute(d.b, np.zeros(k, np.int64))
    d.out = {d.logits_name: np.repeat(d.out[d.logits_name], k, axis=0)}
    (ev,) = _events(gqa, "reorder")
    assert ev.cow_copied_bytes == 0 and ev.prefix_copied_bytes == 0
    assert st.batch == k
    rng = np.random.default_rng(4)
    generated = 0
    for _ in range(6):
        toks = rng.integers(0, MICRO.vocab_size, k)
        gqa.events.clear()
        d.step(toks)
        generated += 1
        cow = sum(e.cow_copied_bytes for e in _events(gqa, "cache_write"))
        assert cow <= k * bs * PAGE_PLANE_BYTES * PLANES  # at most one page per beam and plane
        idx = rng.integers(0, k, k)
        st.reorder(idx)
        _permute(d.b, idx)
        per_token = PAGE_PLANE_BYTES * PLANES
        assert st.committed_bytes <= (9 + k * generated + k * bs) * per_token
    st.close()


def _permute(b, idx):
    """Follow a reorder in the feed builder's per-row bookkeeping."""
    b.select_rows(idx)


def test_checkpoint_restore_replays_identically(session):
    prompt = np.random.default_rng(5).integers(0, MICRO.vocab_size, (1, 5))
    st = session.new_state(cache=CacheConfig("paged", block_size=4))
    d = Driver(session, st, prompt)
    cp = st.checkpoint()
    total = d.b.total
    first = [d.step([t]) for t in (1, 2, 3)]
    st.restore(cp)
    assert st.length == 5  # a static cache's length too: the positions written
    d.b.rewind(total)
    again = [d.step([t]) for t in (1, 2, 3)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    cp.release()
    with pytest.raises(StateError, match="released"):
        st.restore(cp)
    st.close()


def test_truncate_paged_frees_pages_and_copies_nothing(gqa):
    prompt = np.random.default_rng(6).integers(0, MICRO.vocab_size, (1, 15))
    st = gqa.new_state(cache=CacheConfig("paged", block_size=4))
    d = Driver(gqa, st, prompt)
    total = d.b.total
    want = d.step([7])
    assert st.pool.live_pages == 4
    gqa.events.clear()
    st.truncate(6)
    (ev,) = _events(gqa, "truncate")
    assert ev.cow_copied_bytes == 0 and ev.prefix_copied_bytes == 0 and ev.extra["pages_freed"] == 2
    assert st.pool.live_pages == 2 and st.length == 6
    st.close()
    # replay after truncation matches: truncate to the prompt and feed the same token
    st = gqa.new_state(cache=CacheConfig("paged", block_size=4))
    d = Driver(gqa, st, prompt)
    d.step([9])
    st.truncate(15)
    d.b.rewind(total)
    np.testing.assert_allclose(d.step([7]), want, rtol=1e-5, atol=1e-5)
    st.close()


def test_pool_exhaustion_leaves_the_state_unchanged(gqa):
    prompt = np.random.default_rng(7).integers(0, MICRO.vocab_size, (1, 8))
    st = gqa.new_state(cache=CacheConfig("paged", block_size=4, max_pages=2))
    d = Driver(gqa, st, prompt)  # exactly 2 pages
    before = {k: v.copy() for k, v in st.values.items()}
    feeds = d.b.next(np.array([1]), d.out)
    with pytest.raises(OutOfMemory, match="max_pages=2"):
        st.run(feeds, [d.logits_name])
    assert st.length == 8 and st.pool.live_pages == 2
    for k, v in st.values.items():
        np.testing.assert_array_equal(v, before[k])
    st.close()


def test_cancelled_run_leaves_the_paged_state_unchanged(gqa):
    prompt = np.random.default_rng(8).integers(0, MICRO.vocab_size, (1, 8))
    st = gqa.new_state(cache=CacheConfig("paged", block_size=4))
    d = Driver(gqa, st, prompt)
    live = st.pool.live_pages
    before = {k: v.copy() for k, v in st.values.items()}
    c = Cancellation()
    c.cancel()
    with pytest.raises(Cancelled):
        st.run(d.b.next(np.array([1]), d.out), [d.logits_name], cancel=c)
    assert st.pool.live_pages == live and st.length == 8
    for k, v in st.values.items():
        np.testing.assert_array_equal(v, before[k])
    st.close()


def _windowed(window):
    model = build_model("gqa", MICRO, seed=9)
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            for a in node.attribute:
                if a.name == "local_window_size":
                    a.i = window
    return onnxkv.Session(onnxkv.load(model), threads=1, events=True)


def test_sliding_window_evicts_pages_and_keeps_outputs():
    s = _windowed(6)
    prompt = np.random.default_rng(9).integers(0, MICRO.vocab_size, (1, 10))
    with s.new_state() as ref, s.new_state(cache=CacheConfig("paged", block_size=2)) as st:
        want = Driver(s, ref, prompt).greedy(20)
        d = Driver(s, st, prompt)
        got = d.greedy(20)
        for w, g in zip(want, got):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        # 30 tokens, window 6: only the pages that may still be read are held
        assert st.pool.live_pages <= 6 // 2 + 2
        assert any(e.action == "evict" for e in s.events)
        with pytest.raises(StateError, match="evicted"):
            st.truncate(3)


def test_a_padded_batch_under_a_sliding_window_keeps_each_rows_visible_pages():
    """Rows padded to one prompt width hold their own positions only: the window evicts from each row's
    length, not from the padded width (a shorter row's next query used to find its visible keys'
    pages evicted: OperatorError in generate with paged caches)."""
    s = _windowed(4)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, MICRO.vocab_size, n) for n in (13, 9, 4)]
    ids, mask = np.zeros((3, 13), np.int64), np.zeros((3, 13), np.int64)
    for i, p in enumerate(prompts):
        ids[i, 13 - p.size :], mask[i, 13 - p.size :] = p, 1
    paged = CacheConfig("paged", block_size=3)
    got = onnxkv.generate(s, ids, attention_mask=mask, max_new_tokens=6, cache=paged, eos_token_id=[])
    for row, p in zip(got.tokens.tolist(), prompts):
        assert row == onnxkv.generate(s, [p], max_new_tokens=6, cache=paged, eos_token_id=[]).tokens[0].tolist()
    with s.new_state(cache=paged) as st:
        feeds = {"input_ids": ids[:, ::-1].copy(), "attention_mask": mask[:, ::-1].copy()}  # right padded
        feeds = {k: v for k, v in feeds.items() if k in {i.name for i in s.plan.inputs}}
        for i, p in enumerate(prompts):
            feeds["input_ids"][i, : p.size] = p
        st.run(feeds)
        assert st.lengths.tolist() == [13, 9, 4]


def test_narrow_paged_cache_matches_narrow_contiguous(gqa):
    prompt = np.random.default_rng(10).integers(0, MICRO.vocab_size, (1, 6))
    for dt in ("float16", "bfloat16"):
        fmt = {"float16": "fp16", "bfloat16": "bf16"}[dt]
        with (
            gqa.new_state(cache=CacheConfig(kv_format=fmt)) as ref,
            gqa.new_state(cache=CacheConfig("paged", block_size=4, kv_format=fmt)) as st,
        ):
            want = Driver(gqa, ref, prompt).greedy(6)
            got = Driver(gqa, st, prompt).greedy(6)
            for w, g in zip(want, got):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_paged_operations_check_their_arguments(gqa):
    with gqa.new_state() as st:
        with pytest.raises(StateError, match="paged"):
            st.reorder([0])
        with pytest.raises(StateError, match="paged"):
            st.checkpoint()
    with pytest.raises(InputError, match="cache must be"):
        gqa.new_state(cache="ring")
    st = gqa.new_state(cache="paged")
    with pytest.raises(StateError, match="run it first"):
        st.fork()
    Driver(gqa, st, np.array([[1, 2, 3]]))
    with pytest.raises(InputError, match=r"in \[0, 1\)"):
        st.reorder([1])
    with pytest.raises(InputError, match="1-D int"):
        st.reorder([])
    with pytest.raises(InputError, match=r"n must be an int in \[1, 65536\], got 0"):
        st.fork(0)
    with pytest.raises(InputError, match=r"n must be an int in \[1, 65536\], got 1099511627776"):
        st.fork(2**40)  # refused at once, not 2^40 states made one by one
    assert st.pool.refcount(int(st.page_tables[0, 0])) == 1
    other = gqa.new_state(cache="paged")
    Driver(gqa, other, np.array([[1, 2, 3]]))
    with pytest.raises(InputError, match="not made by this state"):
        st.restore(other.checkpoint())
    other.close()
    st.close()


def test_fixed_capacity_caps_positions_per_sequence(gqa):
    st = gqa.new_state(cache=CacheConfig("paged", block_size=2, capacity=4))
    with pytest.raises(onnxkv.CacheCapacityError, match="fixed capacity is 4"):
        Driver(gqa, st, np.array([[1, 2, 3, 4, 5]]))
    assert st.length == 0 and st.pool.live_pages == 0
    st.close()


@pytest.mark.parametrize(
    ("rows", "length", "limits", "error", "message"),
    [
        (0, 4, {}, InputError, "hold 1 to 65536 rows, got 0"),
        (2**40, 4, {"capacity": 64}, InputError, "hold 1 to 65536 rows, got 1099511627776"),
        (1, 2**40, {"max_pages": 8}, OutOfMemory, "274877906944 page\\(s\\) needed but only 7 of max_pages=8"),
        (1, 2**40, {}, OutOfMemory, "of the int32 page ids are free"),
        (3, 8, {"max_pages": 5}, OutOfMemory, "6 page\\(s\\) needed but only 4 of max_pages=5"),
    ],
)
def test_reset_sizes_the_pages_it_needs_before_any_table(gqa, rows, length, limits, error, message):
    """Initial arrays (zero-stride broadcasts cost no memory, so their shapes are hostile) are checked
    against the row limit and the pool's room before a page table is made: numpy's MemoryError (a table of
    2**38 blocks) or ValueError (no rows) used to escape.  The state keeps what it held."""
    st = gqa.new_state(cache=CacheConfig("paged", block_size=4, **limits))
    d = Driver(gqa, st, np.array([[1, 2, 3]]))
    before = {k: v.copy() for k, v in st.values.items()}
    live = st.pool.live_pages
    conv = gqa.model.convention
    shape = (rows, conv.kv_heads, length, conv.head_size)
    initial = {b.past: np.broadcast_to(np.float32(0), shape) for b in gqa.bindings}
    with pytest.raises(error, match=message):
        st.reset(initial)
    assert st.length == 3 and st.pool.live_pages == live
    for k, v in st.values.items():
        np.testing.assert_array_equal(v, before[k])
    d.step([4])
    st.close()


_OUT_OF_MEMORY = """
import resource, sys
import numpy as np, onnxkv
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.zoo.builders import TINY, build_model

s = onnxkv.Session(build_model("gqa", TINY, seed=1), threads=1)
st = onnxkv.State(s, cache="paged", block_size=4)
b = FeedBuilder(s.plan.inputs, s.model, np.arange(1, 4)[None], np.array([3]), 0, thread_cache=False)
st.run(b.first()[0], [])
conv = s.model.convention
initial = {x.past: np.broadcast_to(np.float32(0), (2**16, conv.kv_heads, 64, conv.head_size)) for x in s.bindings}
vm = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[1]) * 2**20, resource.RLIM_INFINITY))
try:
    st.reset(initial)
except onnxkv.OutOfMemory:
    pass
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
assert st.lengths.tolist() == [3] and st.pool.live_pages == 1, (st.lengths, st.pool.live_pages)
st.pool.audit()
st.run(b.next(np.array([[4]]), None), [])
st.pool.audit()
print("whole")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status: Linux")
@pytest.mark.parametrize("headroom_mb", [16, 64, 256])
def test_a_reset_that_runs_out_of_memory_leaves_the_pool_whole(headroom_mb, tmp_path):
    """A reset of 2**16 rows (a zero-stride broadcast: 2**20 pages) in a process whose address space ends
    ``headroom_mb`` past its size: the pool's id table grows, then its records, the payload leases or the
    undo run out of memory.  That used to leak the reserved ids and payloads (numpy's MemoryError from the
    records' growth and from the undo's own lists); now the call raises OutOfMemory and the pool is whole."""
    run = subprocess.run(
        [sys.executable, "-c", _OUT_OF_MEMORY, str(headroom_mb)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,  # the installed onnxkv, not a source tree's
    )
    assert run.returncode == 0 and run.stdout.strip() == "whole", run.stderr[-2000:]


def test_start_on_pages_continues_a_rows_written_pages(gqa):
    """A new row over another state's pages (a cached prefix, its last page partly written) continues as
    that state does; its first write into the shared last page copies it."""
    prompt = np.random.default_rng(3).integers(0, MICRO.vocab_size, (1, 10))
    st = gqa.new_state(cache=CacheConfig("paged", block_size=4))
    d = Driver(gqa, st, prompt)
    other = st.sibling()
    other.start_on_pages(st.page_tables[0][:3], 10)  # blocks 0 and 1 full, block 2 holding 2 positions
    assert other.lengths.tolist() == [10]
    feeds = d.b.next(np.array([5]), d.out)
    got = other.run(feeds, [d.logits_name])[d.logits_name]
    want = st.run(feeds, [d.logits_name])[d.logits_name]
    np.testing.assert_array_equal(got, want)
    st.pool.audit()


def test_start_on_pages_refuses_positions_no_row_holds_as_written(gqa):
    """A page a row truncated keeps the positions it dropped (stale values): a new row may not claim them,
    as a middle block or as more of its last block than is written.  Found by a fuzzing helper: the row read
    values no state held, so two states with one history gave different rows."""
    st = gqa.new_state(cache=CacheConfig("paged", block_size=4))
    Driver(gqa, st, np.arange(1, 9)[None])
    st.truncate(6)
    p0, p1 = (int(p) for p in st.page_tables[0][:2])  # p1 holds positions 4 and 5 of its block
    refs = st.pool.core.refs().copy()
    other = st.sibling()
    for pages, length, message in (
        (
            [p0, p1, p0],
            9,
            f"page {p1} \\(block 1\\) would hold 4 written position\\(s\\), but no row or cache holds more than 2",
        ),
        ([p0, p1], 8, f"page {p1} \\(block 1\\) would hold 4"),
        ([p1], 3, f"page {p1} \\(block 0\\) would hold 3"),
    ):
        with pytest.raises(InputError, match=message):
            other.start_on_pages(np.array(pages), length)
        np.testing.assert_array_equal(st.pool.core.refs(), refs)
        assert other.page_tables.size == 0
    other.start_on_pages(np.array([p0, p1]), 6)
    assert other.lengths.tolist() == [6]
    st.pool.audit()


def test_cache_paths_with_a_nul_byte_are_input_errors(gqa, tmp_path):
    st = gqa.new_state(cache=CacheConfig("paged", block_size=4))
    Driver(gqa, st, np.array([[1, 2, 3]]))
    bad = str(tmp_path / "x\x00y")
    with pytest.raises(InputError, match="State.save_cache: cannot write .*: a path cannot hold a NUL byte"):
        st.save_cache(bad)
    with pytest.raises(InputError, match="State.load_cache: cannot read .*a path cannot hold a NUL byte"):
        st.load_cache(bad)
    assert st.lengths.tolist() == [3] and list(tmp_path.iterdir()) == []


def test_index_arrays_of_a_hostile_count_are_refused_before_they_are_read(gqa):
    """Zero-stride broadcasts of 2**30 valid indices cost no memory; sizing a table by them, or listing them
    in a message, asked NumPy for 8-16 GiB (found by a fuzzing helper).  Each count is now checked first."""
    st = gqa.new_state(cache=CacheConfig("paged", block_size=4))
    d = Driver(gqa, st, np.array([[1, 2, 3, 4, 5, 6, 7, 8, 9]]))
    live, many = st.pool.live_pages, np.broadcast_to(np.int64(0), (2**30,))
    page = np.broadcast_to(np.int64(st.page_tables[0][0]), (2**30,))
    for call, message in (
        (lambda: st.reorder(many), "indices make 1073741824 rows, more than the 65536 a state holds"),
        (lambda: st.keep_rows(many), "indices must be distinct"),
        (lambda: st.quantize_pages(many, "int8", "int8"), "indices must be distinct ints"),
        (lambda: st.compress_rows(many, "int8"), "rows must be distinct"),
        (lambda: st.compress_rows([0, 0], "int8"), "rows must be distinct"),
        (lambda: st.sibling().start_on_pages(page, 8), "1073741824 pages given, more than the 64 ids of the pool"),
        (
            lambda: st.run(d.b.next(np.array([1]), d.out), [d.logits_name], logits_at=np.zeros((1, 2**24), np.int64)),
            "expected 1 integer positions \\(one per batch row\\), or \\[1, K\\] \\(1 <= K <= 1 per row\\)",
        ),
    ):
        with pytest.raises(InputError, match=message):
            call()
        assert st.lengths.tolist() == [9] and st.pool.live_pages == live
    st.pool.audit()


def test_a_ragged_feed_is_an_input_error(gqa):
    st = gqa.new_state(cache=CacheConfig("paged", block_size=4))
    with pytest.raises(InputError, match="State.run: input 'input_ids' must be a rectangular array, got list"):
        st.run({"input_ids": [[1, 2], [3]]}, [])
    assert st.lengths.size == 0


def test_saved_cache_resumes_with_identical_next_logits(session, tmp_path):
    prompt = np.random.default_rng(11).integers(0, MICRO.vocab_size, (2, 7))
    st = session.new_state(cache=CacheConfig("paged", block_size=4))
    d = Driver(session, st, prompt)
    d.step([3, 4])
    path = tmp_path / "cache.okvc"
    data = st.save_cache(path)
    assert path.read_bytes() == data
    saved_lengths = st.lengths.tolist()
    feeds = d.b.next(np.array([5, 6]), d.out)
    want = st.run(feeds, [d.logits_name])[d.logits_name]
    with session.new_state(cache=CacheConfig("paged", block_size=4)) as resumed:
        resumed.load_cache(path)
        assert resumed.lengths.tolist() == saved_lengths
        got = resumed.run(feeds, [d.logits_name])[d.logits_name]
        np.testing.assert_array_equal(got, want)
    st.close()


def test_load_cache_rejects_bad_input_and_leaves_the_state_unchanged(gqa):
    st = gqa.new_state(cache=CacheConfig("paged", block_size=4))
    Driver(gqa, st, np.array([[1, 2, 3, 4, 5]]))
    data = st.save_cache()
    target = gqa.new_state(cache=CacheConfig("paged", block_size=4))
    Driver(gqa, target, np.array([[7, 8]]))
    before = {k: v.copy() for k, v in target.values.items()}
    with pytest.raises(onnxkv.errors.SerializationError):
        target.load_cache(data[:-7])
    other_block = gqa.new_state(cache=CacheConfig("paged", block_size=8))
    with pytest.raises(InputError, match="block_size=4"):
        other_block.load_cache(data)
    other_model = onnxkv.Session(build_model("attention", MICRO, seed=1), threads=1).new_state(
        cache=CacheConfig("paged", block_size=4)
    )
    with pytest.raises(InputError, match="another model"):
        other_model.load_cache(data)
    for k, v in target.values.items():
        np.testing.assert_array_equal(v, before[k])
    with gqa.new_state() as contiguous:
        with pytest.raises(StateError, match="paged"):
            contiguous.load_cache(data)
    with pytest.raises(InputError, match="source must be bytes or a path, got int"):
        target.load_cache(5)
    with pytest.raises(InputError, match="cannot read '/nonexistent/cache.okvc'") as err:
        target.load_cache("/nonexistent/cache.okvc")
    assert isinstance(err.value.__cause__, FileNotFoundError)
    # save_cache used to let TypeError through and name its temporary file in FileNotFoundError
    with pytest.raises(InputError, match="State.save_cache: path must be a str or os.PathLike, got int"):
        target.save_cache(3)
    with pytest.raises(InputError, match="State.save_cache: cannot write '/nonexistent/x.okvc'") as err:
        target.save_cache("/nonexistent/x.okvc")
    assert isinstance(err.value.__cause__, FileNotFoundError)
    for k, v in target.values.items():
        np.testing.assert_array_equal(v, before[k])
    for s in (st, target, other_block, other_model):
        s.close()


def test_sliding_window_state_round_trips():
    s = _windowed(6)
    prompt = np.random.default_rng(12).integers(0, MICRO.vocab_size, (1, 10))
    paged = CacheConfig("paged", block_size=2)
    with s.new_state(cache=paged) as st, s.new_state(cache=paged) as back:
        d = Driver(s, st, prompt)
        d.greedy(8)
        assert int(st.first_positions[0]) > 0  # pages were evicted
        back.load_cache(st.save_cache())
        feeds = d.b.next(np.array([1]), d.out)
        np.testing.assert_array_equal(
            back.run(feeds, [d.logits_name])[d.logits_name], st.run(feeds, [d.logits_name])[d.logits_name]
        )


@pytest.mark.parametrize("family", ["gqa", "concat"])
def test_a_float16_files_paged_state_gathers_its_pasts_as_the_float32_files_does(family, monkeypatch):
    """The float16 converter casts each past before the attention (or the Concat) reads it; the session moves
    those Casts to its boundary, so a paged state feeds placeholders where the float32 file's does: no decode
    step copies the planes in either (a GroupQueryAttention model's attention reads the pages, and so does a
    Concat export's MaskedAttention, whose Concats hand it placeholders)."""
    pytest.importorskip("onnxruntime")
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from onnxkv.cache.paged import PagedPlane

    gathered = []
    real = PagedPlane.gather
    monkeypatch.setattr(PagedPlane, "gather", lambda self, *a: gathered.append(self.name) or real(self, *a))
    prompt = np.random.default_rng(2).integers(1, MICRO.vocab_size, (1, 9))
    counts = []
    for half in (False, True):
        proto = build_model(family, MICRO, seed=3)
        session = onnxkv.Session(convert_float_to_float16(proto, keep_io_types=True) if half else proto, threads=1)
        assert (session.planned is not session.model.proto) == half
        gathered.clear()
        with session.new_state(cache=CacheConfig("paged", block_size=4)) as st:
            b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([9]), 0, thread_cache=False)
            out = st.run(b.first()[0], ["logits"])
            gathered.clear()  # (a float16 file's prompt hides its later keys with a finite bound: copies)
            for _ in range(5):
                out = st.run(b.next(out["logits"][:, -1].argmax(-1)[:, None], out), ["logits"])
        counts.append(len(gathered))
    assert counts == [0, 0]
