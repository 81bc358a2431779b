"""Snapshots of paged caches: what paged_from_snapshot checks before it takes a page, and that a refused or
failed load leaves the pool, its other tables and the allocator exactly as they were."""

from __future__ import annotations

import numpy as np
import pytest

from onnxkv.alloc import SystemAllocator
from onnxkv.cache import serialize, snapshot
from onnxkv.cache.paged import BlockPool, PagedCache, PageTable, PlaneSpec
from onnxkv.cache.snapshot import paged_from_snapshot, take_snapshot
from onnxkv.errors import InputError, OutOfMemory, SerializationError

H, D, BS = 2, 8, 4
LAYERS = [("k", "v")]


def _planes(key_header="float32", model_dtype="float32", value_heads=H, value_head_size=D, names=("k", "v")):
    groups = 1 if key_header == "float32" else D
    return [
        PlaneSpec(names[0], H, D, "float32", model_dtype, groups=groups, header=key_header),
        PlaneSpec(names[1], value_heads, value_head_size, "float32", model_dtype),
    ]


def _filled(pool, rng, tokens, rows=1):
    cache = PagedCache(pool, PageTable(pool, rows))
    for plane, spec in enumerate(pool.planes):
        cache.write(
            plane, rng.standard_normal((rows, spec.heads, tokens, spec.head_size)).astype(np.float32), 0, tokens
        )
    cache.commit()
    return cache


def _saved(tokens=9, rows=1, convert=()):
    """A valid snapshot of a ``rows`` x ``tokens`` cache; ``convert``: (plane, block, format) page conversions."""
    pool = BlockPool(_planes(), BS)
    cache = _filled(pool, np.random.default_rng(tokens), tokens, rows)
    for plane, blk, fmt in convert:
        pool.convert_page(plane, int(cache.table.tables[0, blk]), fmt, BS)
    snap = take_snapshot(cache, LAYERS, "sig")
    want = [cache.gather(i, tokens) for i in range(2)]
    cache.table.release()
    return snap, want


class CountingAllocator(SystemAllocator):
    """A SystemAllocator whose ``fail_at``-th allocation from now raises a plain RuntimeError."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.fail_at = None

    def allocate(self, nbytes, alignment=64):
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise RuntimeError("allocator refused")
        return super().allocate(nbytes, alignment)


def _pool_facts(pool, *tables):
    return (
        pool.core.refs().copy(),
        pool.live_pages,
        pool.committed_bytes,
        pool.allocator.stats().live - pool.spare_bytes,  # the pool's spares are leased, held by no page
        [f.copy() for f in pool.formats],
        [(t.tables.copy(), t.lengths.copy(), t.first.copy()) for t in tables],
    )


def _assert_unchanged(before, pool, *tables):
    after = _pool_facts(pool, *tables)
    for b, a in zip(before[:4], after[:4]):
        np.testing.assert_array_equal(a, b)
    for b, a in zip(before[4], after[4]):
        np.testing.assert_array_equal(a, b)
    for tb, ta in zip(before[5], after[5]):
        for b, a in zip(tb, ta):
            np.testing.assert_array_equal(a, b)
    pool.audit()


@pytest.fixture
def pool_with_sibling():
    """A pool of 3 page ids whose last id belongs to another table (the sibling) and whose id 0 is free."""
    pool = BlockPool(_planes(), BS, max_pages=3)
    rng = np.random.default_rng(1)
    first = _filled(pool, rng, BS)  # id 0
    sibling = _filled(pool, rng, 2 * BS)  # ids 1, 2
    first.table.release()
    assert sibling.table.tables.tolist() == [[1, 2]]
    yield pool, sibling
    sibling.table.release()


def test_blocks_below_the_first_position_never_reach_another_tables_page(pool_with_sibling):
    """A row with first_position 8 whose blocks at 0 and 4 are kept (the format allows them): the table has no
    page for them, so installing them wrote into page id -1, the sibling's last page."""
    pool, sibling = pool_with_sibling
    snap, _ = _saved(9)
    snap.sequences[0].first_position = 8
    serialize.validate(snap)
    sibling_values = [sibling.gather(i, 2 * BS) for i in range(2)]
    before = _pool_facts(pool, sibling.table)
    with pytest.raises(
        InputError,
        match="sequence 0 has first_position 8 .*attends to every position: first_position must be at most 0",
    ):
        paged_from_snapshot(snap, pool, LAYERS)
    _assert_unchanged(before, pool, sibling.table)
    for i in range(2):
        np.testing.assert_array_equal(sibling.gather(i, 2 * BS), sibling_values[i])


def test_a_windowed_load_drops_the_blocks_below_the_first_position(pool_with_sibling):
    pool, sibling = pool_with_sibling
    snap, want = _saved(9, convert=[(0, 0, "int8"), (1, 1, "float16")])
    snap.sequences[0].first_position = 8
    sibling_values = [sibling.gather(i, 2 * BS) for i in range(2)]
    cache = paged_from_snapshot(snap, pool, LAYERS, window=1)
    assert cache.table.tables.tolist() == [[-1, -1, 0]]
    assert (cache.table.lengths.tolist(), cache.table.first.tolist()) == ([9], [8])
    assert pool.converted == [0, 0]  # the converted blocks were below the first position: not installed
    for i in range(2):
        np.testing.assert_array_equal(cache.gather(i, 9)[:, :, 8:], want[i][:, :, 8:])
        np.testing.assert_array_equal(sibling.gather(i, 2 * BS), sibling_values[i])
    pool.audit()
    cache.table.release()


@pytest.mark.parametrize("window, first, lowest", [(None, 4, 0), (3, 7, 6), (20, 4, 0)])
def test_the_first_position_must_leave_every_position_the_window_reads(window, first, lowest):
    snap, _ = _saved(9)
    snap.sequences[0].first_position = first
    pool = BlockPool(_planes(), BS)
    with pytest.raises(InputError, match=f"first_position {first} .*must be at most {lowest}"):
        paged_from_snapshot(snap, pool, LAYERS, window=window)
    assert pool.live_pages == 0 and pool.allocator.stats().allocations == 0
    snap.sequences[0].first_position = lowest
    paged_from_snapshot(snap, pool, LAYERS, window=window).table.release()


@pytest.mark.parametrize("length", [2**27, 2**31, 2**36, 2**62, 2**63 - 1])
@pytest.mark.parametrize("window", [None, 0])
def test_positions_a_file_declares_without_payload_are_refused_before_any_allocation(length, window):
    """A row whose first position is its length holds no block, whatever the length: it used to cost a page
    table of length / block_size entries (MemoryError or ValueError after the other rows' pages were taken)."""
    snap, _ = _saved(9, rows=2)
    snap.sequences.append(serialize.SequenceRecord(length, [], length))
    serialize.validate(snap)
    allocator = CountingAllocator()
    pool = BlockPool(_planes(), BS, allocator)
    expected = (
        "attends to every position"
        if window is None
        else f"declares rows of up to {-(-length // BS) * BS} positions, a page table of 3 x {-(-length // BS)}"
    )
    with pytest.raises(InputError, match=expected):
        paged_from_snapshot(snap, pool, LAYERS, window=window)
    assert pool.live_pages == 0 and allocator.calls == 0
    pool.audit()


def test_a_row_past_the_capacity_is_refused():
    snap, _ = _saved(9)
    pool = BlockPool(_planes(), BS)
    with pytest.raises(InputError, match="sequence 0 holds 9 positions, the state's capacity is 8"):
        paged_from_snapshot(snap, pool, LAYERS, max_tokens=8)
    assert pool.live_pages == 0
    paged_from_snapshot(snap, pool, LAYERS, max_tokens=9).table.release()


@pytest.mark.parametrize(
    "planes, layers, pattern",
    [
        (_planes(), [("k", "v"), ("k2", "v2")], "the saved cache has 1 layers, the model has 2"),
        (
            _planes(names=("k2", "v")),
            [("k2", "v")],
            r"\('k', 'v', 2, 8, 'float32'\) does not match the model's "
            r"\('k2', 'v', 2, 8, 'float32'\)",
        ),
        (
            [PlaneSpec("k", H + 1, D, "float32"), PlaneSpec("v", H + 1, D, "float32")],
            LAYERS,
            r"does not match the model's \('k', 'v', 3, 8, 'float32'\)",
        ),
        (
            [PlaneSpec("k", H, 2 * D, "float32"), PlaneSpec("v", H, 2 * D, "float32")],
            LAYERS,
            r"does not match the model's \('k', 'v', 2, 16, 'float32'\)",
        ),
        (
            _planes(value_heads=H + 1),
            LAYERS,
            r"layer 0 has keys of \(heads, head_size, dtype\) \(2, 8, 'float32'\) and "
            r"values of \(3, 8, 'float32'\); a saved cache holds one geometry per layer",
        ),
        (_planes(value_head_size=2 * D), LAYERS, r"values of \(2, 16, 'float32'\)"),
        (_planes(model_dtype="float16"), LAYERS, r"does not match the model's \('k', 'v', 2, 8, 'float16'\)"),
    ],
)
def test_a_snapshot_of_another_geometry_is_refused(planes, layers, pattern):
    snap, _ = _saved(9)
    if len(layers) == 2:
        planes = planes + [PlaneSpec("k2", H, D, "float32"), PlaneSpec("v2", H, D, "float32")]
    pool = BlockPool(planes, BS)
    with pytest.raises(InputError, match=pattern):
        paged_from_snapshot(snap, pool, layers)
    assert pool.live_pages == 0 and pool.allocator.stats().allocations == 0


def test_more_rows_than_the_pool_has_pages_are_refused():
    """Every row needs a page of its own to run: rows of length 0 are not free."""
    snap, _ = _saved(5)
    snap.sequences += [serialize.SequenceRecord(0, []) for _ in range(3)]
    pool = BlockPool(_planes(), BS, max_pages=3)
    with pytest.raises(InputError, match="the saved cache has 4 sequences, the state can hold at most 3 rows"):
        paged_from_snapshot(snap, pool, LAYERS)
    assert pool.live_pages == 0
    del snap.sequences[-1]
    paged_from_snapshot(snap, pool, LAYERS).table.release()


def test_another_block_size_is_refused():
    snap, _ = _saved(9)
    pool = BlockPool(_planes(), 2 * BS)
    with pytest.raises(InputError, match="block_size=4, the state uses 8"):
        paged_from_snapshot(snap, pool, LAYERS)


def test_an_invalid_snapshot_is_refused_before_anything_is_allocated():
    snap, _ = _saved(9)
    snap.sequences[0].blocks.append(snap.sequences[0].blocks[0])
    pool = BlockPool(_planes(), BS)
    with pytest.raises(SerializationError, match="duplicate block"):
        paged_from_snapshot(snap, pool, LAYERS)
    assert pool.live_pages == 0


def test_more_pages_than_the_pool_has_free_raise_out_of_memory_and_change_nothing(pool_with_sibling):
    pool, sibling = pool_with_sibling
    snap, _ = _saved(9)  # 3 pages; one is free
    before = _pool_facts(pool, sibling.table)
    with pytest.raises(OutOfMemory, match="the saved cache needs 3 page.s., the pool has 1 free of max_pages=3"):
        paged_from_snapshot(snap, pool, LAYERS)
    _assert_unchanged(before, pool, sibling.table)


def test_an_allocator_failing_at_any_allocation_leaves_pool_and_allocator_as_they_were():
    """Quantized and float16 payloads get their storage through formats.allocate_payload: a failure there is an
    OutOfMemory naming the API and the format, and every page and payload taken before it is returned."""
    snap, want = _saved(13, rows=2, convert=[(0, 0, "int8"), (1, 1, "uint4"), (0, 2, "float16")])
    allocator = CountingAllocator()
    pool = BlockPool(_planes(), BS, allocator, spare_pages=0)  # every payload from the allocator: each call fails once
    keep = _filled(pool, np.random.default_rng(3), 6)
    allocator.calls = 0
    cache = paged_from_snapshot(snap, pool, LAYERS)
    total = allocator.calls
    cache.table.release()
    assert total == 2 * 8 + 3  # 8 pages of 2 planes, 3 converted payloads (row 0)
    for fail_at in range(1, total + 1):
        allocator.calls, allocator.fail_at = 0, fail_at
        before = _pool_facts(pool, keep.table)
        with pytest.raises(OutOfMemory, match="allocator refused") as err:
            paged_from_snapshot(snap, pool, LAYERS)
        if fail_at > 2 * 8:
            assert str(err.value).startswith("resume: a ") and " page: " in str(err.value)
        _assert_unchanged(before, pool, keep.table)
    allocator.fail_at = None
    cache = paged_from_snapshot(snap, pool, LAYERS)
    for i in range(2):
        np.testing.assert_array_equal(cache.gather(i, 13), want[i])
    cache.table.release()
    keep.table.release()


def test_rows_of_length_zero_load_as_empty_rows():
    snap, want = _saved(5)
    snap.sequences.insert(0, serialize.SequenceRecord(0, []))
    pool = BlockPool(_planes(), BS)
    cache = paged_from_snapshot(snap, pool, LAYERS)
    assert cache.table.lengths.tolist() == [0, 5] and cache.table.tables[0].tolist() == [-1, -1]
    np.testing.assert_array_equal(cache.gather(0, 5)[1], want[0][0])
    cache.table.release()
    empty = serialize.CacheSnapshot(BS, snap.layers, [serialize.SequenceRecord(0, [])], "sig")
    cache = paged_from_snapshot(empty, pool, LAYERS)
    assert cache.table.tables.shape == (1, 0) and pool.live_pages == 0
    cache.table.release()


@pytest.mark.parametrize("fmt", [None, "int8", "float16"])
def test_a_full_pool_saves_to_a_file_within_its_file_bytes_limit(fmt):
    assert snapshot.file_bytes_limit(BlockPool(_planes(), BS)) is None
    pool = BlockPool(_planes(key_header="compact"), BS, max_pages=6)
    cache = _filled(pool, np.random.default_rng(6), 3 * BS, rows=2)
    if fmt is not None:
        for p in cache.table.tables.reshape(-1).tolist():
            pool.convert_page(0, p, fmt, BS)
    blob = serialize.encode(take_snapshot(cache, LAYERS, "s" * 64))
    limit = snapshot.file_bytes_limit(pool)
    assert len(blob) <= limit - (1 << 20)  # the pages' bound alone holds them
    per_page = sum(s.heads * s.head_size * (4 * BS + 8) + 128 for s in pool.planes)
    assert limit == 6 * per_page + (1 << 20)
    cache.table.release()
