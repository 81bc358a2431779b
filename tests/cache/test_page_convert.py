"""page_convert: copy-on-write conversion of a table's pages, all or nothing, other holders untouched."""

from __future__ import annotations

import numpy as np
import pytest

from onnxkv.alloc import ArenaAllocator
from onnxkv.cache.page_convert import convert_full_pages, convert_pages, quantize_blocks
from onnxkv.cache.paged import BlockPool, PagedCache, PageTable, PlaneSpec
from onnxkv.errors import InputError, OutOfMemory

H, D, BS = 2, 8, 4
INT8 = 3  # ONNX element code of int8


class _Refusing(ArenaAllocator):
    """An arena that refuses every allocation once ``budget`` (None: no limit) more have been made."""

    budget = None

    def allocate(self, nbytes, alignment=64):
        if self.budget is not None:
            if self.budget <= 0:
                raise OutOfMemory(f"test allocator: refusing {nbytes} bytes")
            self.budget -= 1
        return super().allocate(nbytes, alignment)


def _leased(pool, allocator) -> int:
    """Bytes ``allocator`` has handed out that the pool's pages hold: its live bytes less the pool's spares
    (native payloads of freed pages it keeps for the next ones)."""
    return allocator.stats().live - pool.spare_bytes


def _cache(allocator=None, blocks=3, rows=1):
    pool = BlockPool([PlaneSpec("k", H, D, "float32"), PlaneSpec("v", H, D, "float32")], BS, allocator)
    cache = PagedCache(pool, PageTable(pool, rows))
    rng = np.random.default_rng(3)
    for plane in (0, 1):
        cache.write(plane, rng.standard_normal((rows, H, blocks * BS, D)).astype(np.float32), 0, blocks * BS)
    cache.commit()
    return pool, cache


def _pool_state(pool: BlockPool, *tables: PageTable) -> tuple:
    refs = pool.core.refs()
    return (
        pool.live_pages,
        pool.committed_bytes,
        refs.tolist(),
        [f.tolist() for f in pool.formats],
        [p.tolist() for p in pool.ptrs],
        [t.tables.tolist() for t in tables],
    )


def test_a_shared_page_is_copied_for_the_table_and_the_other_holder_keeps_its_page():
    pool, cache = _cache()
    other = cache.table.share()  # a fork or checkpoint: every page held twice
    before = [cache.gather(i, 3 * BS) for i in (0, 1)]
    page = int(cache.table.tables[0, 1])
    copied, copied_bytes = convert_pages(cache.table, {page: [(0, 1)]}, [(0, "int8")])
    assert copied == 1 and copied_bytes == pool.page_bytes
    new = int(cache.table.tables[0, 1])
    assert new != page and int(other.tables[0, 1]) == page
    assert pool.refcount(page) == 1 and pool.refcount(new) == 1
    assert int(pool.formats[0][new]) == INT8 and int(pool.formats[1][new]) == 1  # only the chosen plane
    assert int(pool.formats[0][page]) == 1  # the other holder's page is untouched
    np.testing.assert_array_equal(PagedCache(pool, other).gather(0, 3 * BS), before[0])
    np.testing.assert_allclose(cache.gather(0, 3 * BS), before[0], atol=0.05)
    np.testing.assert_array_equal(cache.gather(1, 3 * BS), before[1])
    pool.audit()
    other.release()
    cache.table.release()


def test_a_page_held_only_by_the_table_is_converted_in_place():
    pool, cache = _cache()
    page = int(cache.table.tables[0, 0])
    assert convert_pages(cache.table, {page: [(0, 0)]}, [(0, "int8"), (1, "int8")]) == (0, 0)
    assert int(cache.table.tables[0, 0]) == page and pool.live_pages == 3
    assert [int(f[page]) for f in pool.formats] == [INT8, INT8]
    pool.audit()
    cache.table.release()


@pytest.mark.parametrize("shared", [True, False], ids=["copy-refused", "payload-refused"])
def test_a_refused_allocation_changes_nothing(shared):
    alloc = _Refusing(1 << 20)
    pool, cache = _cache(alloc)
    other = cache.table.share() if shared else PageTable(pool, 0)
    before, before_live = _pool_state(pool, cache.table, other), _leased(pool, alloc)
    where = {int(p): [(0, blk)] for blk, p in enumerate(cache.table.tables[0])}
    alloc.budget = 0 if shared else 3  # refuse the copies' pages, or the fourth of six payloads
    with pytest.raises(OutOfMemory):
        convert_pages(cache.table, where, [(0, "int8"), (1, "int4")])
    assert _pool_state(pool, cache.table, other) == before
    assert _leased(pool, alloc) == before_live
    pool.audit()
    alloc.budget = None
    other.release()
    cache.table.release()


def test_full_pages_stop_before_the_residual_tokens_and_skip_partial_pages():
    pool, cache = _cache(blocks=3)
    cache.table.lengths[:] = 3 * BS - 1  # the last page is partial
    assert convert_full_pages(cache.table, 0, "int8", residual_tokens=BS) == (1, 0)
    codes = [int(pool.formats[0][p]) for p in cache.table.tables[0]]
    assert codes == [INT8, 1, 1]
    assert convert_full_pages(cache.table, 0, "int8") == (1, 0)  # the converted page is not converted again
    pool.audit()
    cache.table.release()


def test_quantize_blocks_checks_indices_before_anything_changes():
    pool, cache = _cache(rows=2)
    before = _pool_state(pool, cache.table)
    for bad in ([0, 0], [3], np.array([0.5])):
        with pytest.raises(InputError, match="State.quantize_pages: indices"):
            quantize_blocks(cache.table, bad, [(0, "int8")], "State.quantize_pages")
    with pytest.raises(InputError, match="int3"):
        quantize_blocks(cache.table, [0], [(0, "int3")], "State.quantize_pages")
    assert _pool_state(pool, cache.table) == before
    assert quantize_blocks(cache.table, [0, 2], [(0, "int8"), (1, "int8")], "api") == (4, 0)
    pool.audit()
    cache.table.release()


def test_a_run_conversion_counts_the_references_its_commit_drops():
    """Two rows holding a partly filled page both fill it in one run: one keeps the page, the other copies
    it.  Built on the staged run, the conversion sees the kept page held once after the commit (the copy's
    reference to it is dropped then) and converts it in place, needing no free page."""
    pool = BlockPool([PlaneSpec("k", H, D, "float32"), PlaneSpec("v", H, D, "float32")], BS, max_pages=3)
    rng = np.random.default_rng(5)
    one = PagedCache(pool, PageTable(pool, 1))
    for plane in (0, 1):
        one.write(plane, rng.standard_normal((1, H, 6, D)).astype(np.float32), 0, 6)
    one.commit()
    cache = PagedCache(pool, one.table.share(np.array([0, 0])))  # a beam of two rows over both pages
    one.table.release()
    tail = rng.standard_normal((2, H, 2, D)).astype(np.float32)
    for plane in (0, 1):
        cache.write(plane, tail, 6, 2)
    assert pool.live_pages == 3  # one row copied page 1; the other writes into it
    want = [cache.gather(i, 2 * BS) for i in (0, 1)]
    conversion = cache.full_pages_conversion([(0, "int8"), (1, "int8")])
    assert conversion.shared == [] and conversion.pages == 3
    cache.commit()
    conversion.install(cache.table)
    assert pool.live_pages == 3
    assert {int(pool.formats[i][p]) for i in (0, 1) for p in cache.table.tables.ravel()} == {INT8}
    for i in (0, 1):
        np.testing.assert_allclose(cache.gather(i, 2 * BS), want[i], atol=0.05)
    pool.audit()
    cache.table.release()


def test_an_abandoned_conversion_frees_its_copies_and_payloads():
    alloc = ArenaAllocator(1 << 20)
    pool, cache = _cache(alloc)
    other = cache.table.share()
    before, live = _pool_state(pool, cache.table, other), _leased(pool, alloc)
    conversion = cache.full_pages_conversion([(0, "int8"), (1, "int4")])
    assert len(conversion.shared) == 3 and conversion.copied == 3 * pool.page_bytes
    assert pool.live_pages == 6
    conversion.abandon()
    assert _pool_state(pool, cache.table, other) == before and _leased(pool, alloc) == live
    pool.audit()
    other.release()
    cache.table.release()


def test_full_pages_are_those_of_each_row_between_its_first_kept_block_and_its_length():
    """Rows of different lengths, the first evicted past a window, a residual, pages shared between rows
    and one already converted: the places chosen are those a per-block walk of each row gives."""
    pool, cache = _cache(blocks=6, rows=3)
    table = cache.table
    table.lengths[:] = [6 * BS, 4 * BS + 1, 2 * BS - 1]
    table.first[:] = [2 * BS, 0, 0]
    for blk in range(2):  # row 2 shares row 1's first two pages (a fork's)
        pool.decref(np.array([table.tables[2, blk]], np.int32))
        table.tables[2, blk] = table.tables[1, blk]
        pool.incref(np.array([table.tables[1, blk]], np.int32))
    pool.decref(np.array([table.tables[0, 5]], np.int32))
    table.tables[0, 5] = -1  # a block the row never got
    table.lengths[2] = 2 * BS
    done = int(table.tables[0, 2])
    assert convert_pages(table, {done: [(0, 2)]}, [(1, "int8")]) == (0, 0)  # its values plane converted already
    want: dict[int, list] = {}
    for b in range(3):
        for blk in range(int(table.first[b]) // BS, max(0, int(table.lengths[b]) - 1) // BS):
            p = int(table.tables[b, blk])
            if p >= 0 and int(pool.formats[0][p]) == 1:
                want.setdefault(p, []).append((b, blk))
    conversion = cache.full_pages_conversion([(0, "int8"), (1, "int4")], residual_tokens=1)
    assert conversion.where == want and done in want
    assert conversion.shared == [int(table.tables[1, 1])]  # row 2 holds it too, not yet full there
    built = sorted((plane, page) for plane, page, *_ in conversion.built)
    into = dict(zip(conversion.shared, conversion.fresh.tolist()))  # a shared page's payloads go to its copy
    assert built == sorted([(0, into.get(p, p)) for p in want] + [(1, into.get(p, p)) for p in want if p != done])
    conversion.abandon()
    pool.audit()
    table.release()


def test_a_published_conversion_undone_leaves_table_payloads_and_counts_as_they_were():
    alloc = ArenaAllocator(1 << 20)
    pool, cache = _cache(alloc)
    other = cache.table.share()  # pages 0 and 1 shared: copied; page 2 ours alone: converted in place
    pool.decref(np.array([other.tables[0, 2]], np.int32))
    other.tables[0, 2] = -1
    before, live = _pool_state(pool, cache.table, other), _leased(pool, alloc)
    values = [cache.gather(i, 3 * BS) for i in (0, 1)]
    conversion = cache.full_pages_conversion([(0, "int8"), (1, "int4")])
    conversion.publish(cache.table)
    assert int(pool.formats[0][cache.table.tables[0, 2]]) == INT8 and len(conversion.shared) == 2
    conversion.undo()
    assert _pool_state(pool, cache.table, other) == before and _leased(pool, alloc) == live
    for i in (0, 1):
        np.testing.assert_array_equal(cache.gather(i, 3 * BS), values[i])
    pool.audit()
    other.release()
    cache.table.release()
