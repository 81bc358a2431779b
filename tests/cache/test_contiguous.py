"""CacheTensor: per-row written lengths (staged, committed, discarded), the bound on where a row may
continue, and zero-filled storage (new buffers and growth) whatever the allocator's memory held."""

from __future__ import annotations

import numpy as np
import pytest

from onnxkv.alloc import SystemAllocator
from onnxkv.alloc.protocol import AllocatorStats
from onnxkv.cache.contiguous import CacheTensor
from onnxkv.errors import InputError

B, H, D = 2, 2, 4


class DirtyAllocator:
    """Buffers full of NaN bytes, as memory another request left behind; counts allocations."""

    def __init__(self) -> None:
        self.inner = SystemAllocator()
        self.allocations = 0

    def allocate(self, nbytes: int, alignment: int = 64):
        buf = self.inner.allocate(nbytes, alignment)
        buf.view(np.uint8, nbytes)[...] = 0xFF
        self.allocations += 1
        return buf

    def free(self, buffer) -> None:
        self.inner.free(buffer)

    def stats(self) -> AllocatorStats:
        return self.inner.stats()


def _cache(capacity=4, growable=True, storage=None):
    return CacheTensor("past", (B, H, D), np.float32, DirtyAllocator(), capacity, growable, storage=storage)


def _new(s, value=1.0):
    return np.full((B, H, s, D), value, np.float32)


@pytest.mark.parametrize("storage", [None, "float16", "bfloat16"])
def test_new_buffer_is_zero_filled(storage):
    c = _cache(storage=storage)
    assert not c.buffer.any()


def test_growth_zero_fills_past_the_copied_prefix():
    c = _cache(capacity=4)
    c.write(_new(3), 0, 3)
    c.commit()
    c.write(_new(2, 2.0), 3, 5)  # grows to 8: positions 0..2 copied, 3..4 written, 5..7 zero
    assert c.capacity == 8 and c.allocator.allocations == 2
    np.testing.assert_array_equal(c.buffer[:, :, :3], 1.0)
    np.testing.assert_array_equal(c.buffer[:, :, 3:5], 2.0)
    assert not c.buffer[:, :, 5:].any()


def test_writes_do_not_fill_per_token():
    """Zero-filling happens once per allocation: a write touches only the positions it writes."""
    c = _cache(capacity=8)
    c.buffer[...] = 7.0
    c.write(_new(1), 0, 1)
    c.commit()
    np.testing.assert_array_equal(c.buffer[:, :, 1:], 7.0)
    assert c.allocator.allocations == 1


def test_row_lengths_staged_committed_and_discarded():
    c = _cache(capacity=8)
    c.write(_new(3), 0, 3)
    assert c.lengths.tolist() == [0, 0] and c.length == 0  # staged only
    c.commit()
    assert c.lengths.tolist() == [3, 3] and c.length == 3
    c.write(_new(1), np.array([3, 2]), 4)  # row 1 rewrites position 2: it keeps its 3 written positions
    c.commit()
    assert c.lengths.tolist() == [4, 3] and c.length == 4
    c.write(_new(1), np.array([4, 3]), 5)
    c.discard()
    assert c.lengths.tolist() == [4, 3] and c.length == 4
    c.appended(1, 5, None, np.array([4, 3]))
    c.commit()
    assert c.lengths.tolist() == [5, 4] and c.length == 5


@pytest.mark.parametrize("starts,row", [(np.array([3, 4]), 1), (4, 0)])
def test_write_past_a_rows_length_raises_before_writing(starts, row):
    c = _cache(capacity=8)
    c.write(_new(3), 0, 3)
    c.commit()
    before = c.buffer.copy()
    with pytest.raises(InputError) as err:
        c.write(_new(1, 5.0), starts, 5)
    assert str(err.value) == (
        f"cache 'past': row {row} would be written at position 4 but has written only 3 "
        "positions; a row may only continue from what it wrote"
    )
    np.testing.assert_array_equal(c.buffer, before)
    assert c.staged is None and c.lengths.tolist() == [3, 3]
    c.commit()
    assert c.lengths.tolist() == [3, 3] and c.length == 3


def test_length_setter_truncates_rows_and_raising_it_fills_every_row():
    c = _cache(capacity=8)
    c.write(_new(1), 0, 1)
    c.commit()
    c.write(_new(1), np.array([1, 0]), 2)
    c.commit()
    assert c.lengths.tolist() == [2, 1]
    c.length = 1
    assert c.lengths.tolist() == [1, 1]
    static = _cache(capacity=8, growable=False)
    static.length = 8  # a static cache: the whole zero-filled buffer is valid
    assert static.lengths.tolist() == [8, 8]
    static.write(_new(1), np.array([6, 2]), 8)  # anywhere inside it
    static.commit()
    assert static.lengths.tolist() == [8, 8]


@pytest.mark.parametrize("start", [0, 5, 8])
def test_a_static_write_of_no_position_leaves_the_length(start):
    """A static cache's length is one past the highest position written: a write of none moves nothing (as a
    TensorScatter run of zero update steps at any index its linear mode allows)."""
    static = CacheTensor("past", (B, H, D), np.float32, DirtyAllocator(), 8, False, static=True)
    static.write(_new(2), 0, 8)
    static.commit()
    static.write(_new(0), start, 8)
    static.commit()
    assert static.length == 2
    static.scattered(np.full(B, start, np.int64), 0, np.zeros((B, H, 0, D), np.float32))
    static.commit()
    assert static.length == 2
