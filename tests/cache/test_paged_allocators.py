"""BlockPool with allocators that break their contract: every payload is checked before a kernel writes to
it, a rejection changes nothing, a failing free leaves the pool whole; conversions to the native format."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hostile_allocators import MODES, TYPED_ONLY, Hostile

from onnxkv.alloc import SlabAllocator
from onnxkv.cache.paged import BlockPool, PagedCache, PageTable, PlaneSpec
from onnxkv.errors import InputError

H, D, BS = 2, 16, 4
NATIVE = H * BS * D * 4


def _pool(allocator, storage="float32", spare_pages=4):
    return BlockPool(
        [PlaneSpec("k", H, D, storage), PlaneSpec("v", H, D, storage)], BS, allocator, spare_pages=spare_pages
    )


def _cache(pool, tokens, seed=0):
    """A committed one-row cache of ``tokens`` random positions in every plane."""
    rng = np.random.default_rng(seed)
    cache = PagedCache(pool, PageTable(pool, 1))
    for i in range(len(pool.planes)):
        cache.write(i, rng.standard_normal((1, H, tokens, D)).astype(np.float32), 0, tokens)
    cache.commit()
    return cache


def _records(pool):
    """Everything the pool says about its pages (to check a failed call changed nothing)."""
    return (
        [p.copy() for p in pool.ptrs],
        [f.copy() for f in pool.formats],
        [s.copy() for s in pool.sizes],
        list(pool.converted),
        pool.live_pages,
        pool.core.refs().copy(),
    )


def _assert_same(a, b):
    for x, y in zip(a, b):
        if isinstance(x, list):
            for u, v in zip(x, y):
                np.testing.assert_array_equal(u, v)
        else:
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("mode", sorted(MODES) + sorted(TYPED_ONLY))
def test_new_pages_reject_every_broken_buffer_and_change_nothing(mode):
    alloc = Hostile()
    pool = _pool(alloc)
    cache = _cache(pool, 2 * BS)
    before, values = _records(pool), [cache.gather(i, 2 * BS) for i in range(2)]
    live = alloc.inner.stats().live
    alloc.mode = mode
    error, fragment = {**MODES, **TYPED_ONLY}[mode]
    with pytest.raises(error, match=fragment) as e:
        pool.allocate(2)
    assert "BlockPool: plane 'k'" in str(e.value) and f"Hostile({mode!r})" in str(e.value)
    _assert_same(_records(pool), before)
    pool.audit()
    assert alloc.inner.stats().live == live  # the rejected buffers went back
    alloc.mode = None  # a good allocator again: the pool goes on
    cache.write(0, np.ones((1, H, 3, D), np.float32), [2 * BS], 2 * BS + 3)
    cache.write(1, np.ones((1, H, 3, D), np.float32), [2 * BS], 2 * BS + 3)
    cache.commit()
    for i in range(2):
        np.testing.assert_array_equal(cache.gather(i, 2 * BS), values[i])
    pool.audit()
    cache.table.release()
    assert alloc.inner.stats().live == 0


@pytest.mark.parametrize("mode", sorted(MODES))
def test_conversions_reject_every_broken_payload_and_change_nothing(mode):
    alloc = Hostile()
    pool = _pool(alloc)
    cache = _cache(pool, 2 * BS)
    p = int(cache.table.tables[0, 1])
    pool.convert_page(1, p, "int8", BS)  # a quantized page too: its conversion back allocates a native page
    before, values = _records(pool), [cache.gather(i, 2 * BS) for i in range(2)]
    alloc.mode = mode
    for plane, fmt in ((0, "int8"), (0, "float16"), (1, "float32")):
        with pytest.raises(MODES[mode][0], match=MODES[mode][1]):
            pool.convert_page(plane, p, fmt, BS)
        _assert_same(_records(pool), before)
        pool.audit()
    alloc.mode = None
    for i in range(2):
        np.testing.assert_array_equal(cache.gather(i, 2 * BS), values[i])
    pool.convert_page(0, p, "int4", BS)
    cache.table.release()
    assert alloc.inner.stats().live == 0


def test_a_batch_of_built_payloads_never_shares_bytes():
    alloc = Hostile()
    pool = _pool(alloc)
    cache = _cache(pool, 2 * BS)
    a, b = (int(x) for x in cache.table.tables[0, :2])
    first = pool.build_payload(0, a, "int8", BS)
    alloc.mode = "twice"  # the next payload would be the first one again
    with pytest.raises(InputError, match="still leased"):
        pool.build_payload(0, b, "int8", BS)
    alloc.mode = None
    second = pool.build_payload(0, b, "int8", BS)
    pool.install_payload(0, a, *first, "int8")
    pool.discard_payload(second[0])
    pool.audit()
    assert pool.converted[0] == 1
    cache.table.release()
    assert alloc.inner.stats().live == 0


def test_payloads_their_builder_freed_leave_the_index_at_the_next_pool_call():
    slab = SlabAllocator(1 << 16)  # hands the lowest free slot out again: the same address
    pool = _pool(slab)
    cache = _cache(pool, 2 * BS)
    a, b = (int(x) for x in cache.table.tables[0, :2])
    buf, arr = pool.build_payload(0, a, "int8", BS)
    address = arr.__array_interface__["data"][0]
    slab.free(buf)  # what a caller abandoning its batch may do
    pool.decref(np.zeros(0, np.int32))  # any other pool call ends the batch
    buf, arr = pool.build_payload(0, b, "int8", BS)
    assert arr.__array_interface__["data"][0] == address  # no false alarm on the reused bytes
    pool.install_payload(0, b, buf, arr, "int8")
    cache.table.release()
    assert slab.stats().live == 0


def test_a_failing_free_leaves_the_pool_whole(caplog):
    alloc = Hostile()
    pool = _pool(alloc, spare_pages=0)  # every freed payload goes to the allocator's free
    cache = _cache(pool, 3 * BS)
    fork = cache.table.share()
    t = cache.table.tables[0]
    alloc.free_raises = True
    with caplog.at_level(logging.WARNING, logger="onnxkv.alloc"):
        pool.convert_page(0, int(t[0]), "int8", BS)  # the replaced native payload's free fails
        fork.release()
        cache.table.truncate(BS)  # pages 1 and 2 are dropped: their frees fail
    assert sum("hostile free refuses" in r.getMessage() for r in caplog.records) == 1 + 2 * 2
    pool.audit()
    assert pool.live_pages == 1 and pool.converted == [1, 0]
    assert pool.committed_bytes == pool.sizes[0][t[0]] + NATIVE
    alloc.free_raises = False
    cache.table.release()
    assert pool.live_pages == 0 and pool.committed_bytes == 0
    pool.audit()


@pytest.mark.parametrize("storage", ["float32", "float16", "bfloat16"])
def test_converting_to_the_native_format_gives_native_pages(storage):
    alloc = Hostile()
    pool = _pool(alloc, storage)
    cache = _cache(pool, 3 * BS)
    t = [int(x) for x in cache.table.tables[0]]
    calls, ptr = alloc.calls, int(pool.ptrs[0][t[0]])
    pool.convert_page(0, t[0], storage, BS)  # already native: nothing happens, nothing is allocated
    assert alloc.calls == calls and int(pool.ptrs[0][t[0]]) == ptr and pool.converted == [0, 0]
    other = "float16" if storage != "float16" else "float32"
    pool.convert_page(0, t[1], "int8", BS)
    pool.convert_page(1, t[1], other, BS)
    pool.convert_page(1, t[2], "int4", BS)
    assert pool.converted == [1, 2]
    quantized = [cache.gather(i, 3 * BS) for i in range(2)]
    for plane, page in ((0, t[1]), (1, t[1]), (1, t[2])):
        pool.convert_page(plane, page, storage, BS)
        arr = pool.pages[plane][page]
        assert arr.shape == (H, BS, D) and arr.dtype == pool.planes[plane].dtype
        assert not pool.quantized(plane, page) and pool.sizes[plane][page] == arr.nbytes
        assert int(pool.ptrs[plane][page]) == arr.__array_interface__["data"][0]
    assert pool.converted == [0, 0]
    pool.audit()
    for i in range(2):  # the values the converted pages held, now stored natively
        np.testing.assert_array_equal(cache.gather(i, 3 * BS), quantized[i])
    fork = cache.table.share()  # copy on write reads the pages converted back
    cache.write(0, np.zeros((1, H, 1, D), np.float32), [2 * BS + 1], 2 * BS + 2)
    cache.write(1, np.zeros((1, H, 1, D), np.float32), [2 * BS + 1], 2 * BS + 2)
    cache.commit()
    assert cache.table.tables[0, 2] != t[2] and (cache.table.tables[0, :2] == t[:2]).all()
    np.testing.assert_array_equal(cache.gather(1, 2 * BS + 1), quantized[1][:, :, : 2 * BS + 1])
    fork.release()
    cache.table.release()
    pool.audit()
    assert alloc.inner.stats().live == 0
