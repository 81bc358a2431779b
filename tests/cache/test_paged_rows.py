"""PagedCache writes: a row continues only from what it wrote, and every page a run stages is zero-filled
(fresh and copy-on-write pages alike) whatever the allocator's memory held."""

from __future__ import annotations

import numpy as np
import pytest
from test_contiguous import DirtyAllocator

from onnxkv.cache.paged import BlockPool, PagedCache, PageTable, PlaneSpec
from onnxkv.errors import InputError

H, D, BS = 2, 8, 4


def _cache(batch=2, static_length=None):
    pool = BlockPool([PlaneSpec("k", H, D, "float32"), PlaneSpec("v", H, D, "float32")], BS, DirtyAllocator())
    return PagedCache(pool, PageTable(pool, batch), static_length=static_length)


def _write(cache, starts, s, value=1.0):
    new = np.full((cache.table.batch, H, s, D), value, np.float32)
    for plane in cache.planes.values():
        plane.write(new, np.asarray(starts, np.int64), 0)


def _page(cache, plane, row, block):
    return cache.pool.pages[plane][int(cache.tables[row, block])]


def test_fresh_pages_are_zero_filled():
    c = _cache()
    _write(c, [0, 0], 1)
    c.commit()
    for plane in range(2):
        for row in range(2):
            page = _page(c, plane, row, 0)
            np.testing.assert_array_equal(page[:, :1], 1.0)
            assert not page[:, 1:].any()


def test_copy_on_write_pages_are_zero_filled_past_the_copy():
    c = _cache(batch=1)
    _write(c, [0], 2)
    c.commit()
    other = c.table.share()  # page shared: the next write copies it
    _page(c, 0, 0, 0)[:, 3] = 9.0  # a byte past the valid tokens of the shared page
    _write(c, [2], 1, 2.0)
    c.commit()
    page = _page(c, 0, 0, 0)
    np.testing.assert_array_equal(page[:, :2], 1.0)
    np.testing.assert_array_equal(page[:, 2], 2.0)
    assert not page[:, 3].any()
    other.release()
    c.pool.audit()


def test_write_past_a_rows_length_raises_before_staging():
    c = _cache()
    _write(c, [0, 0], 3)
    c.commit()
    live, tables, lengths = c.pool.live_pages, c.table.tables.copy(), c.table.lengths.copy()
    with pytest.raises(InputError) as err:
        _write(c, [3, 5], 1)
    assert str(err.value) == (
        "paged cache: row 1 would be written at position 5 but has written only 3 "
        "positions; a row may only continue from what it wrote"
    )
    assert c.pool.live_pages == live and c.tables is c.table.tables
    np.testing.assert_array_equal(c.table.tables, tables)
    np.testing.assert_array_equal(c.table.lengths, lengths)
    c.discard()
    c.pool.audit()
    _write(c, [3, 2], 1)  # each row from what it wrote (row 1 rewrites position 2)
    c.commit()
    assert c.table.lengths.tolist() == [4, 3]


def test_static_cache_writes_anywhere():
    c = _cache(static_length=8)
    _write(c, [0, 0], 8, 0.0)
    c.commit()
    _write(c, [5, 2], 1)
    c.commit()
    assert c.table.lengths.tolist() == [8, 8]


def test_gather_reads_each_row_only_up_to_its_length():
    """Bytes past a row's length in its last page (a page filled by a restore, or left by a rewind) are
    never copied out: the gathered positions a row does not hold are zero."""
    c = _cache()
    _write(c, [0, 0], 3)
    c.commit()
    _write(c, [3, 1], 1, 2.0)  # row 1 rewinds: it holds 2 positions
    c.commit()
    for plane in range(2):
        _page(c, plane, 1, 0)[:, 2:] = np.nan
    for plane in c.planes.values():
        got = plane.gather()
        assert got.shape == (2, H, 4, D)
        np.testing.assert_array_equal(got[0, :, :3], 1.0)
        np.testing.assert_array_equal(got[0, :, 3], 2.0)
        np.testing.assert_array_equal(got[1, :, 0], 1.0)
        np.testing.assert_array_equal(got[1, :, 1], 2.0)
        assert not got[1, :, 2:].any()
