"""Spare payloads of a BlockPool: native payloads of freed pages serve the next pages without an allocator
round trip, capped per plane, cleared before a new page shows them, counted apart from live pages, and
returned when the pool holds no page."""

from __future__ import annotations

import numpy as np
import pytest

import onnxkv
from onnxkv.alloc import SystemAllocator
from onnxkv.cache.block_pool import SPARE_PAGES
from onnxkv.cache.paged import BlockPool, PagedCache, PageTable, PlaneSpec
from onnxkv.errors import InputError
from onnxkv.zoo.builders import MICRO, build_model

H, D, BS = 2, 8, 4


class Counting(SystemAllocator):
    """A SystemAllocator counting its allocate and free calls."""

    def __init__(self):
        super().__init__()
        self.allocations = self.frees = 0

    def allocate(self, nbytes, alignment=64):
        self.allocations += 1
        return super().allocate(nbytes, alignment)

    def free(self, buffer):
        self.frees += 1
        return super().free(buffer)


def _pool(allocator, spare_pages=SPARE_PAGES):
    planes = [PlaneSpec("k", H, D, "float32"), PlaneSpec("v", H, D, "float16")]
    return BlockPool(planes, BS, allocator, spare_pages=spare_pages)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_freed_page_serves_the_next_one_without_the_allocator():
    alloc = Counting()
    pool = _pool(alloc)
    keep = pool.allocate(1)  # the pool stays non-empty
    (a,) = pool.allocate(1)
    addresses = [_address(pool.pages[i][a]) for i in (0, 1)]
    calls = alloc.allocations
    pool.decref(np.array([a], np.int32))
    assert alloc.frees == 0 and pool.spare_bytes == pool.page_bytes
    assert alloc.stats().live - pool.spare_bytes == pool.committed_bytes
    (b,) = pool.allocate(1)
    assert alloc.allocations == calls and pool.spare_bytes == 0
    assert [_address(pool.pages[i][b]) for i in (0, 1)] == addresses
    pool.decref(np.array([b, *keep], np.int32))
    pool.audit()


def test_spares_are_capped_per_plane_and_go_back_when_the_pool_is_empty():
    alloc = Counting()
    pool = _pool(alloc, spare_pages=2)
    held = pool.allocate(5)
    pool.decref(held[:4])  # two kept per plane, two freed per plane
    assert pool.spare_bytes == 2 * pool.page_bytes and alloc.frees == 2 * 2
    pool.decref(held[4:])  # the last page: the pool holds none, the spares go back too
    assert pool.spare_bytes == 0 and alloc.stats().live == 0 and alloc.frees == alloc.allocations


def test_no_spares_with_spare_pages_zero_and_converted_payloads_are_not_kept():
    alloc = Counting()
    pool = _pool(alloc, spare_pages=0)
    held = pool.allocate(2)
    pool.decref(held[:1])
    assert pool.spare_bytes == 0 and alloc.frees == 2
    pool.decref(held[1:])
    pool = _pool(alloc)
    cache = PagedCache(pool, PageTable(pool, 1))
    x = np.random.default_rng(0).standard_normal((1, H, 2 * BS, D)).astype(np.float32)
    for i in (0, 1):
        cache.write(i, x, 0, 2 * BS)
    cache.commit()
    first = int(cache.table.tables[0, 0])
    pool.convert_page(0, first, "int8", BS)
    cache.table.truncate(BS)  # drops page 1 (native): kept
    assert pool.spare_bytes == pool.page_bytes
    cache.table.truncate(0)  # drops page 0 (plane 0 int8: freed; plane 1 native: but the pool is empty now)
    assert pool.spare_bytes == 0 and alloc.stats().live == 0


def test_a_spare_payload_shows_none_of_its_earlier_page():
    """A state's new page on a pool whose spares held another state's tokens reads zeros past its writes."""
    pool = _pool(SystemAllocator())
    a = PagedCache(pool, PageTable(pool, 1))
    b = PagedCache(pool, PageTable(pool, 1))
    rng = np.random.default_rng(1)
    for cache, n in ((a, 2 * BS), (b, 1)):
        for i in (0, 1):
            cache.write(i, rng.standard_normal((1, H, n, D)).astype(np.float32) + 5, 0, n)
        cache.commit()
    a.table.truncate(0)  # a's pages become spares
    assert pool.spare_bytes > 0
    for i in (0, 1):
        b.write(i, np.ones((1, H, BS, D), np.float32), 1, BS)  # b's next page: a spare
    b.commit()
    for i in (0, 1):
        page = pool.pages[i][int(b.table.tables[0, 1])]
        assert not np.any(np.asarray(page[:, 1:], np.float32) >= 4)  # nothing of a's values past b's write


def test_bad_spare_pages_is_refused():
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(InputError, match=r"BlockPool: spare_pages must be an int >= 0, got"):
            _pool(SystemAllocator(), spare_pages=bad)


def test_beam_search_steps_lease_fewer_payloads_with_spares(monkeypatch):
    """4 beams on a paged state copy a page on write most steps and free the pages dropped beams held: with
    spares the decode steps lease at most half the payloads they lease without (counted through the checked
    lease), and the tokens are the same."""
    from onnxkv.cache import plane_payloads

    session = onnxkv.Session(build_model("gqa", MICRO, seed=3), threads=1)
    prompt = np.random.default_rng(2).integers(1, MICRO.vocab_size, (1, 6))
    leases = [0]
    real_lease, real_init = plane_payloads.lease, BlockPool.__init__
    monkeypatch.setattr(plane_payloads, "lease", lambda *a: leases.__setitem__(0, leases[0] + 1) or real_lease(*a))
    runs = {}
    for spares in (SPARE_PAGES, 0):
        monkeypatch.setattr(
            BlockPool, "__init__", lambda self, *a, n=spares, **k: real_init(self, *a, **k, spare_pages=n)
        )
        per_step = []
        result = onnxkv.beam_search(
            session, prompt, 4, 32, eos_token_id=[], cache=onnxkv.CacheConfig("paged", block_size=4),
            callback=lambda *_: per_step.append(leases[0]),
        )  # fmt: skip
        runs[spares] = (result.sequences, per_step[-1] - per_step[0])
    np.testing.assert_array_equal(runs[SPARE_PAGES][0], runs[0][0])
    assert 0 < 2 * runs[SPARE_PAGES][1] <= runs[0][1], runs
