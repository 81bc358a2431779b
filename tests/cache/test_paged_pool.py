"""BlockPool / PageTable / PagedCache: reference counts, copy-on-write, exhaustion."""

from __future__ import annotations

import numpy as np
import pytest
from onnxkv.cache._pagecore import PageCore

from onnxkv.alloc import ArenaAllocator
from onnxkv.cache import formats
from onnxkv.cache.page_convert import convert_full_pages
from onnxkv.cache.paged import BlockPool, PagedCache, PageTable, PlaneSpec, live_pools
from onnxkv.errors import InputError, OutOfMemory

H, D = 2, 8


def _pool(block_size=4, max_pages=None, storage="float32", allocator=None):
    planes = [PlaneSpec("k", H, D, storage), PlaneSpec("v", H, D, storage)]
    return BlockPool(planes, block_size, allocator, max_pages)


def _rand(rng, b, s):
    return rng.standard_normal((b, H, s, D)).astype(np.float32)


def test_core_reserve_incref_decref_and_free_list():
    core = PageCore(4, None)
    ids = core.reserve(6)  # grows past the initial 4 ids
    assert len(set(ids.tolist())) == 6 and core.capacity >= 6 and core.live_pages == 6
    core.incref(ids[:2])
    freed = core.decref(ids)
    assert sorted(freed.tolist()) == sorted(ids[2:].tolist())
    assert core.live_pages == 2
    assert (core.refs()[ids[:2]] == 1).all()
    again = core.reserve(4)  # recycled ids come back from the free list
    assert set(again.tolist()) == set(ids[2:].tolist())


def test_core_bounded_pool_refuses_without_change():
    core = PageCore(4, 5)
    assert core.reserve(6) is None
    assert core.live_pages == 0 and core.free_pages == 5
    assert core.reserve(5) is not None and core.free_pages == 0


def test_core_rejects_bad_ids():
    core = PageCore(4, None)
    ids = core.reserve(1)
    with pytest.raises(ValueError, match="out of range"):
        core.incref(np.array([99], np.int32))
    with pytest.raises(ValueError, match="fewer than"):
        core.decref(np.array([ids[0], ids[0]], np.int32))
    with pytest.raises(ValueError, match="free"):
        core.incref(np.array([3], np.int32))


def test_core_pages_needed_marks_fresh_and_shared():
    core = PageCore(8, None)
    ids = core.reserve(3)
    core.incref(ids[1:2])  # page ids[1] is shared
    row = np.array([ids[0], ids[1], -1, ids[2]], np.int32)
    action, n = core.pages_needed(row, 0, 4)
    assert action.tolist() == [0, 2, 1, 0] and n == 2


def test_core_appends_in_place_only_when_every_row_appends_into_its_own_page():
    core = PageCore(8, None)
    a, b, c = core.reserve(3).tolist()
    core.incref(np.array([b], np.int32))  # page b is shared
    tables = np.array([[a, c], [a, -1]], np.int32)
    lengths = np.array([5, 3], np.int64)

    def end(starts, tables=tables, lengths=lengths, bs=4):
        return core.appends_in_place(tables, np.array(starts, np.int64), lengths, bs)

    assert end([5, 3]) == 6  # rows 0 and 1 append into their own pages c and a
    assert end([5, 3], lengths=np.array([6, 3], np.int64)) == -1  # a row that does not append at its length
    assert end([5, 2], lengths=np.array([5, 2], np.int64)) == 6
    assert end([4, 4], lengths=np.array([4, 4], np.int64)) == -1  # row 1's block 1 has no page yet
    assert end([8, 3], lengths=np.array([8, 3], np.int64)) == -1  # block 2: past the rows of the table
    assert end([-1, 3], lengths=np.array([-1, 3], np.int64)) == -1
    assert end([5, 3], tables=np.array([[a, b], [a, c]], np.int32)) == -1  # a shared page: copy on write
    assert end([5, 3], tables=np.array([[a, 7], [a, c]], np.int32)) == -1  # page 7 is free
    assert end([5, 3], tables=np.array([[a, 99], [a, c]], np.int32)) == -1  # out of range
    assert end([5, 3], bs=0) == -1
    assert end([5], lengths=np.array([5], np.int64)) == -1  # fewer starts than rows
    assert end([], tables=np.zeros((0, 2), np.int32), lengths=np.zeros(0, np.int64)) == 0


def test_decode_appends_stage_nothing_then_appended_stages_every_plane():
    pool = _pool(block_size=4)
    cache = PagedCache(pool, PageTable(pool, 2))
    cache.keep_written = False  # no format selector reads the writes: a kernel may append in place
    rng = np.random.default_rng(0)
    cache.write(0, _rand(rng, 2, 3), 0, 3)
    cache.write(1, _rand(rng, 2, 3), 0, 3)
    cache.commit()
    live = pool.live_pages
    starts = cache.table.lengths.copy()
    assert cache.prepare(starts, 1) == cache.prepare(starts, 1)  # nothing allocated, nothing copied
    assert pool.live_pages == live
    cache.appended([0, 1], starts, 1)
    assert cache.lengths.tolist() == [4, 4] and cache.table.lengths.tolist() == [3, 3]
    assert cache.append_cost(1, 2, 1).append_copied_bytes == 2 * H * D * 4
    with pytest.raises(InputError, match="'k', 'v': appended rows without their prepared pages"):
        cache.appended([0, 1], starts + 1, 1)
    cache.commit()
    assert cache.table.lengths.tolist() == [4, 4]
    starts = cache.table.lengths.copy()
    cost = cache.prepare(starts, 1)  # position 4 starts block 1: a fresh page per row
    assert cost.allocations == 2 * 2 and pool.live_pages == live + 2


def test_pool_allocates_and_frees_payloads_with_the_allocator():
    arena = ArenaAllocator(1 << 20)
    pool = _pool(allocator=arena)
    ids = pool.allocate(3)
    assert pool.live_pages == 3
    assert arena.stats().live == 3 * pool.page_bytes
    assert all(pool.ptrs[i][p] != 0 for i in range(2) for p in ids)
    pool.decref(ids)
    assert arena.stats().live == 0 and pool.live_pages == 0
    assert all(pool.ptrs[i][p] == 0 for i in range(2) for p in ids)


def test_pool_exhaustion_raises_out_of_memory_and_changes_nothing():
    pool = _pool(max_pages=2)
    pool.allocate(1)
    with pytest.raises(OutOfMemory, match="max_pages=2"):
        pool.allocate(2)
    assert pool.live_pages == 1


def test_allocator_failure_rolls_back_every_page():
    pool = _pool(allocator=ArenaAllocator(4096))  # room for a few pages only
    per = pool.page_bytes
    with pytest.raises(OutOfMemory):
        pool.allocate(4096 // per + 2)
    assert pool.live_pages == 0 and pool.allocator.stats().live == 0


def test_pool_arguments_are_checked():
    with pytest.raises(InputError, match="block_size"):
        _pool(block_size=0)
    with pytest.raises(InputError, match="max_pages"):
        _pool(max_pages=0)
    with pytest.raises(InputError, match="storage"):
        _pool(storage="int8")


def test_write_gather_round_trip_across_page_boundaries():
    rng = np.random.default_rng(0)
    pool = _pool(block_size=4)
    cache = PagedCache(pool, PageTable(pool, 2))
    a = _rand(rng, 2, 7)
    cache.write(0, a, 0, 7)
    cache.commit()
    b = _rand(rng, 2, 3)
    cache.write(0, b, np.array([7, 7]), 10)
    cache.commit()
    got = cache.gather(0, 10)
    np.testing.assert_array_equal(got, np.concatenate([a, b], axis=2))
    assert cache.table.lengths.tolist() == [10, 10]
    assert pool.live_pages == 6  # 2 rows x 3 blocks of 4 tokens
    cache.table.release()
    pool.audit()
    assert pool.live_pages == 0


def test_discard_frees_new_pages_and_keeps_committed_bytes():
    rng = np.random.default_rng(1)
    pool = _pool(block_size=4)
    cache = PagedCache(pool, PageTable(pool, 1))
    a = _rand(rng, 1, 6)
    cache.write(0, a, 0, 6)
    cache.commit()
    before = cache.gather(0, 6).copy()
    live = pool.live_pages
    cache.write(0, _rand(rng, 1, 8), 6, 14)
    assert pool.live_pages > live
    cache.discard()
    assert pool.live_pages == live
    np.testing.assert_array_equal(cache.gather(0, 6), before)
    assert cache.table.lengths.tolist() == [6]
    cache.table.release()


def test_copy_on_write_copies_only_the_shared_partial_page():
    rng = np.random.default_rng(2)
    pool = _pool(block_size=4)
    base = PagedCache(pool, PageTable(pool, 1))
    prompt = _rand(rng, 1, 10)  # blocks 0, 1 full, block 2 holds 2 tokens
    for plane in (0, 1):
        base.write(plane, prompt, 0, 10)
    base.commit()
    fork = PagedCache(pool, base.table.share())
    assert pool.live_pages == 3
    new = _rand(rng, 1, 1)
    cost = fork.write(0, new, 10, 11)
    # one page copied (its 2 valid tokens, both planes), one page allocated
    assert cost.cow_copied_bytes == 2 * H * 2 * D * 4
    assert cost.allocations == 2 and pool.live_pages == 4
    fork.write(1, new, 10, 11)
    fork.commit()
    np.testing.assert_array_equal(base.gather(0, 10), prompt)
    np.testing.assert_array_equal(fork.gather(0, 11)[:, :, :10], prompt)
    np.testing.assert_array_equal(fork.gather(0, 11)[:, :, 10:], new)
    # the full pages stay shared
    assert (base.table.tables[0, :2] == fork.table.tables[0, :2]).all()
    assert base.table.tables[0, 2] != fork.table.tables[0, 2]
    fork.table.release()
    base.table.release()
    pool.audit()
    assert pool.live_pages == 0


def _forked(rng, rows, length=6, block_size=4):
    """A cache of ``rows`` rows forked from one row of ``length`` tokens (its last page partly filled);
    the prompt."""
    pool = _pool(block_size=block_size)
    base = PagedCache(pool, PageTable(pool, 1))
    prompt = _rand(rng, 1, length)
    for plane in (0, 1):
        base.write(plane, prompt, 0, length)
    base.commit()
    fork = PagedCache(pool, base.table.share(np.zeros(rows, np.int64)))
    base.table.release()
    return fork, prompt


@pytest.mark.parametrize("rows", [2, 3])
def test_rows_forked_from_one_row_copy_their_shared_page_once_less(rows):
    # every holder of the partly filled page writes its block: the last of them keeps it, the others copy
    rng = np.random.default_rng(20)
    fork, prompt = _forked(rng, rows)
    pool, shared = fork.pool, int(fork.table.tables[0, 1])
    new = _rand(rng, rows, 1)
    cost = fork.write(0, new, 6, 7)
    assert cost.cow_copied_bytes == (rows - 1) * 2 * H * 2 * D * 4  # 2 valid tokens, both planes, per copy
    assert cost.allocations == (rows - 1) * 2
    fork.write(1, new, 6, 7)
    fork.commit()
    assert sorted(fork.table.tables[:, 1].tolist()).count(shared) == 1
    for plane in (0, 1):
        got = fork.gather(plane, 7)
        np.testing.assert_array_equal(got[:, :, :6], np.broadcast_to(prompt, (rows, H, 6, D)))
        np.testing.assert_array_equal(got[:, :, 6:], new)
    pool.audit()
    assert pool.core.refs()[shared] == 1
    fork.table.release()
    assert pool.live_pages == 0


def test_a_discarded_write_of_forked_rows_leaves_every_row_as_committed():
    rng = np.random.default_rng(21)
    fork, prompt = _forked(rng, 2)
    tables = fork.table.tables.copy()
    fork.write(0, _rand(rng, 2, 3), 6, 9)
    fork.discard()
    np.testing.assert_array_equal(fork.table.tables, tables)
    for plane in (0, 1):
        np.testing.assert_array_equal(fork.gather(plane, 6), np.broadcast_to(prompt, (2, H, 6, D)))
    fork.pool.audit()
    new = _rand(rng, 2, 1)  # the next write still sees every row as committed
    fork.write(0, new, 6, 7)
    fork.commit()
    np.testing.assert_array_equal(fork.gather(0, 7)[:, :, 6:], new)
    np.testing.assert_array_equal(fork.gather(0, 7)[:, :, :6], np.broadcast_to(prompt, (2, H, 6, D)))


def test_every_forked_row_copies_a_page_another_holder_keeps():
    rng = np.random.default_rng(22)
    fork, prompt = _forked(rng, 2)
    held = fork.table.share(np.array([0]))  # a checkpoint, another state, ...
    shared = int(held.tables[0, 1])
    cost = fork.write(0, _rand(rng, 2, 1), 6, 7)
    assert cost.cow_copied_bytes == 2 * 2 * H * 2 * D * 4
    fork.commit()
    assert shared not in fork.table.tables[:, 1].tolist()
    np.testing.assert_array_equal(fork.pool.pages[0][shared][:, :2], prompt[0, :, 4:6])
    held.release()
    fork.table.release()
    fork.pool.audit()


def test_a_row_rewriting_its_committed_tokens_never_keeps_a_shared_page():
    # row 0 (length 6) rewrites position 5 while row 1 (length 5) appends: both copy, so the other row's
    # token 5 (row 0's committed one) is never overwritten in the shared page
    rng = np.random.default_rng(23)
    fork, prompt = _forked(rng, 2)
    fork.table.lengths[1] = 5
    shared = int(fork.table.tables[0, 1])
    cost = fork.write(0, _rand(rng, 2, 1), np.array([5, 5]), 6)
    assert cost.cow_copied_bytes == (2 + 1) * H * D * 4 * 2  # row 0: 2 valid tokens; row 1: 1; both planes
    fork.discard()
    np.testing.assert_array_equal(fork.pool.pages[0][shared][:, :2], prompt[0, :, 4:6])
    fork.table.release()


def test_truncate_and_evict_release_pages():
    rng = np.random.default_rng(3)
    pool = _pool(block_size=4)
    t = PageTable(pool, 1)
    cache = PagedCache(pool, t)
    cache.write(0, _rand(rng, 1, 16), 0, 16)
    cache.commit()
    assert pool.live_pages == 4
    assert t.truncate(9) == 1  # block 3 (tokens 12..15) dropped, block 2 keeps token 8
    assert t.lengths.tolist() == [9] and pool.live_pages == 3
    assert t.evict(window=2) == 1  # next query at 9 sees >= 7: block 0 (0..3) goes, block 1 (4..7) stays
    assert t.tables[0].tolist()[0] == -1 and t.first.tolist() == [4]
    pool.audit()
    t.release()
    assert pool.live_pages == 0


def test_permute_shares_rows_and_frees_the_pages_of_rows_dropped():
    rng = np.random.default_rng(4)
    pool = _pool(block_size=4)
    cache = PagedCache(pool, PageTable(pool, 3))
    cache.write(0, _rand(rng, 3, 6), 0, 6)
    cache.commit()
    t = cache.table
    before = t.tables.copy()
    t.permute(np.array([2, 2, 0, 0]))  # row 1 dropped, rows 2 and 0 doubled, one row more
    np.testing.assert_array_equal(t.tables, before[[2, 2, 0, 0]])
    assert t.batch == 4 and t.lengths.tolist() == [6] * 4
    assert pool.live_pages == 4  # row 1's two pages freed
    assert sorted(pool.core.refs()[t.held_ids()].tolist()) == [2] * 8
    pool.audit()
    for rows, match in (
        (np.array([-1]), r"indices must be in \[0, 4\), got \[-1\]"),
        (np.array([4]), r"indices must be in \[0, 4\), got \[4\]"),
        (np.array([2**64 - 1], np.uint64), r"indices must be in \[0, 4\)"),
        (np.array([1.7]), "indices must be a non-empty 1-D int array"),
        (np.zeros((1, 1), np.int64), "indices must be a non-empty 1-D int array"),
        (np.zeros(0, np.int64), "indices must be a non-empty 1-D int array"),
    ):
        with pytest.raises(InputError, match=f"PageTable.permute: {match}"):
            t.permute(rows)
    np.testing.assert_array_equal(t.tables, before[[2, 2, 0, 0]])
    pool.audit()
    t.release()
    assert pool.live_pages == 0


def test_audit_detects_leaked_references():
    pool = _pool()
    ids = pool.allocate(2)  # held by nobody
    with pytest.raises(Exception, match="audit"):
        pool.audit()
    pool.decref(ids)
    pool.audit()
    assert pool in live_pools()


def test_per_channel_key_plane_stores_compact_headers():
    """groups == head_size, header "compact": quantized pages carry the compact header (formats.compact_params),
    cost its bytes, and read back within half a decoded scale."""
    rng = np.random.default_rng(11)
    Hk, Dk, bs = 3, 32, 8
    pool = BlockPool(
        [PlaneSpec("k", Hk, Dk, "float32", groups=Dk, header="compact"), PlaneSpec("v", Hk, Dk, "float32")], bs
    )
    assert [p.header for p in pool.planes] == ["compact", "float32"]
    cache = PagedCache(pool, PageTable(pool, 1))
    assert cache.planes["k"].header == "compact" and cache.planes["v"].header == "float32"
    k = (rng.standard_normal((1, Hk, 2 * bs, Dk)) * rng.uniform(0.1, 2, Dk) + rng.uniform(-5, 5, Dk)).astype(np.float32)
    v = rng.standard_normal((1, Hk, 2 * bs, Dk)).astype(np.float32)
    cache.write(0, k, 0, 2 * bs)
    cache.write(1, v, 0, 2 * bs)
    cache.commit()
    assert convert_full_pages(cache.table, 0, "uint8") == (2, 0) and convert_full_pages(cache.table, 1, "int8") == (
        2,
        0,
    )
    k_page, v_page = formats.page_bytes("uint8", Hk, bs, Dk, Dk, "compact"), formats.page_bytes("int8", Hk, bs, Dk)
    assert k_page == 256 + Hk * bs * Dk  # 4*3 + 2*3*32 = 204 header bytes, padded to 256
    assert pool.committed_bytes == 2 * (k_page + v_page)
    got = cache.gather(0, 2 * bs)
    for blk in range(2):
        page = int(cache.table.tables[0, blk])
        x = np.ascontiguousarray(k[0, :, blk * bs : (blk + 1) * bs])
        scale, _, header = formats.compact_params(x, "uint8")
        np.testing.assert_array_equal(pool.pages[0][page][: header.size], header)
        err = np.abs(got[0, :, blk * bs : (blk + 1) * bs] - x)
        assert (err <= scale.reshape(Hk, 1, Dk) * 0.5 * (1 + 1e-5)).all()
    cache.table.release()
    assert pool.committed_bytes == 0


def test_pool_checks_scale_groups():
    with pytest.raises(InputError, match="groups must be 1 or its head_size 8, got 4"):
        BlockPool([PlaneSpec("k", H, D, "float32", groups=4)])
    with pytest.raises(InputError, match="compact page headers hold at most 512 channels"):
        BlockPool([PlaneSpec("k", 1, 520, "float32", groups=520, header="compact")])
    with pytest.raises(InputError, match="header 'compact' needs groups 8 .one group per channel., got 1"):
        BlockPool([PlaneSpec("k", H, D, "float32", header="compact")])
    with pytest.raises(InputError, match="header 'float32' needs groups 1 .one scale per head., got 8"):
        BlockPool([PlaneSpec("k", H, D, "float32", groups=D)])
    with pytest.raises(InputError, match="header must be one of .* got 'kivi'"):
        BlockPool([PlaneSpec("k", H, D, "float32", groups=D, header="kivi")])
