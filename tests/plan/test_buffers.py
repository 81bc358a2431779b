"""RunBuffers: buffers taken per slot, recycled by size within a run, all returned on close."""

from __future__ import annotations

import numpy as np

from onnxkv import SystemAllocator
from onnxkv.plan.buffers import RunBuffers, size_class


def test_released_buffers_are_reused_by_size_and_returned_on_close():
    arena = SystemAllocator()
    bufs = RunBuffers(arena)
    rng = np.random.default_rng(3)
    a, reused = bufs.take(0, (2, 8), np.dtype(np.float32))
    assert not reused and a.shape == (2, 8) and a.dtype == np.float32 and a.flags.c_contiguous
    a[...] = rng.standard_normal((2, 8))
    address = a.__array_interface__["data"][0]
    bufs.release(0)
    b, reused = bufs.take(1, (8, 2), np.dtype(np.int32))  # same byte size: the released buffer comes back
    assert reused and b.shape == (8, 2) and b.__array_interface__["data"][0] == address
    c, reused = bufs.take(2, (3,), np.dtype(np.float64))
    assert not reused and arena.stats().live == 64 + 64  # 24 bytes take the 64-byte size class
    bufs.release(7)  # a slot without a buffer: nothing happens
    bufs.close()
    st = arena.stats()
    assert st.live == 0 and st.allocations == st.frees == 2


def test_pool_limit_sends_released_buffers_back_to_the_allocator():
    arena = SystemAllocator()
    bufs = RunBuffers(arena, pool_limit=100)
    bufs.take(0, (16,), np.dtype(np.float32))
    bufs.take(1, (16,), np.dtype(np.float32))
    bufs.release(0)  # 64 bytes pooled
    bufs.release(1)  # 128 > 100: freed at once
    st = arena.stats()
    assert st.frees == 1 and st.live == 64 and bufs.pooled == 64
    again, reused = bufs.take(2, (4, 4), np.dtype(np.float32))
    assert reused and bufs.pooled == 0
    same, reused = bufs.take(2, (16,), np.dtype(np.float32))  # a slot taken again gives its old buffer back first
    assert reused and same.__array_interface__["data"][0] == again.__array_interface__["data"][0]
    assert bufs.pooled == 0 and arena.stats().allocations == 2
    bufs.close()
    assert arena.stats().live == 0


def test_recycle_keeps_this_runs_buffers_and_frees_stale_and_viewed_ones():
    """recycle: held buffers move to the free lists, except one an output may
    view; a kept buffer the next run does not take goes back at its end."""
    alloc = SystemAllocator()
    bufs = RunBuffers(alloc)
    rng = np.random.default_rng(4)
    a, _ = bufs.take(0, (4, 4), np.dtype(np.float32))
    b, _ = bufs.take(1, (10,), np.dtype(np.float64))
    c, _ = bufs.take(2, (3,), np.dtype(np.int32))
    out = c.reshape(3, 1)  # an output viewing c's buffer
    out[...] = rng.integers(0, 9, (3, 1))
    want = out.copy()
    bufs.recycle([out, rng.standard_normal(3)])
    st = alloc.stats()
    assert st.live == 64 + 128 and st.frees == 1 and bufs.pooled == 64 + 128 and not bufs.held  # 80 -> 128
    # next run: only the 64-byte size is taken again; the 128-byte buffer is stale at its end
    again, reused = bufs.take(0, (16,), np.dtype(np.float32))
    assert reused and again.__array_interface__["data"][0] == a.__array_interface__["data"][0]
    bufs.recycle([])
    st = alloc.stats()
    assert st.live == 64 and st.frees == 2 and bufs.pooled == 64
    np.testing.assert_array_equal(out, want)
    bufs.close()
    assert alloc.stats().live == 0


def test_size_classes_round_up_by_at_most_a_sixteenth_and_to_64_bytes():
    for n in (0, 1, 63, 64, 65, 1000, 1024, 1025, 4095, 4096, 4097, 123_457, 11 << 20, (11 << 20) + 1):
        c = size_class(n)
        assert c >= n and c % 64 == 0 and c - n < max(64, n / 16 + 64)
        assert size_class(c) == c  # a class is its own class


def test_a_value_growing_by_a_column_per_run_reuses_its_buffer_and_leaves_no_empty_free_lists():
    """A mask over the cache length grows by one column per decode step: its buffer comes back for many runs
    (a new size class only every few), and recycling forgets the sizes no run holds any more."""
    alloc = SystemAllocator()
    bufs = RunBuffers(alloc)
    for t in range(600, 800):
        m, _ = bufs.take(0, (1, 1, 1, t), np.dtype(np.float32))
        m[...] = 1.0
        bufs.recycle([])
    st = alloc.stats()
    assert st.allocations <= 8 and st.live == bufs.pooled == size_class(799 * 4)
    assert list(bufs.free_lists) == [size_class(799 * 4)]
    bufs.close()
    assert alloc.stats().live == 0


def test_lent_temporaries_share_the_free_lists_and_come_back_at_the_end():
    """lend/give_back: a node's own temporary comes from the free lists of its size class and goes back to
    them; one never given back (a node that raised) goes to the allocator when the run ends, not to the
    free lists."""
    alloc = SystemAllocator()
    bufs = RunBuffers(alloc)
    a, _ = bufs.take(0, (64, 4), np.dtype(np.float32))
    address = a.__array_interface__["data"][0]
    bufs.release(0)
    t = bufs.lend((4, 64), np.dtype(np.float32))  # the released buffer's size class
    assert t.flags.c_contiguous and t.__array_interface__["data"][0] == address
    u = bufs.lend((100,), np.dtype(np.float16))
    assert u.__array_interface__["data"][0] != address and alloc.stats().allocations == 2
    t[...] = 1.0
    bufs.give_back(t)
    again, reused = bufs.take(1, (256,), np.dtype(np.float32))
    assert reused and again.__array_interface__["data"][0] == address
    bufs.recycle([])  # u was never given back: freed, not kept
    st = alloc.stats()
    assert st.frees == 1 and st.live == size_class(1024) and not bufs.lent
    w = bufs.lend((3, 5), np.dtype(np.float64))
    assert w.shape == (3, 5)
    bufs.close()  # lent and kept buffers alike
    assert alloc.stats().live == 0 and not bufs.lent
