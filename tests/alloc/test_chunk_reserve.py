"""The chunk reserve: released slab chunks zeroed and reused by the next allocator, within a bound."""

from __future__ import annotations

import gc
import sys
import threading

import numpy as np
import pytest

from onnxkv.alloc import SlabAllocator
from onnxkv.alloc.chunk_reserve import (
    DEFAULT_LIMIT_BYTES,
    chunk_reserve_limit,
    chunk_reserve_stats,
    set_chunk_reserve_limit,
)

CHUNK = 64 << 10  # every chunk of these allocators is 64 KiB (first chunks too)


@pytest.fixture
def reserve():
    """An empty reserve of 16 chunks for the test; the process's bound restored after it."""
    old = set_chunk_reserve_limit(0)
    set_chunk_reserve_limit(16 * CHUNK)
    yield
    set_chunk_reserve_limit(0)
    set_chunk_reserve_limit(old)


def written_chunks(slab: SlabAllocator, n: int, value: int = 0xA5) -> list:
    """``n`` whole chunks of 4 KiB slots, every byte written ``value``; returns the buffers."""
    bufs = [slab.allocate(4096) for _ in range(n * CHUNK // 4096)]
    for b in bufs:
        b.view(np.uint8, 4096)[:] = value
    return bufs


def chunk_bases(bufs) -> set[int]:
    return {b.address - b.address % CHUNK for b in bufs}


def test_default_bound():
    assert DEFAULT_LIMIT_BYTES == 128 << 20
    assert chunk_reserve_limit() == chunk_reserve_stats().limit_bytes


def test_trimmed_chunks_are_reused_zeroed_by_the_next_allocator(reserve):
    first = SlabAllocator(CHUNK)
    bufs = written_chunks(first, 2)
    bases = chunk_bases(bufs)
    for b in bufs:
        first.free(b)
    assert first.chunk_count == 1  # one empty chunk kept as the spare, the other released to the reserve
    assert first.trim() == CHUNK and first.chunk_count == 0 and first.stats().committed == 0
    before = chunk_reserve_stats()
    assert (before.held_bytes, before.regions) == (2 * CHUNK, 2)
    second = SlabAllocator(CHUNK)
    again = [second.allocate(4096) for _ in range(2 * CHUNK // 4096)]
    assert second.reused_chunks == 2 and chunk_bases(again) == bases  # no new mapping
    assert second.stats().committed == 2 * CHUNK
    assert all(not b.view(np.uint8, 4096).any() for b in again)  # nothing of the first owner's bytes
    after = chunk_reserve_stats()
    assert after.hits == before.hits + 2 and after.held_bytes == 0
    for b in again:
        second.free(b)


def test_a_trimmed_allocator_stays_usable_and_starts_its_classes_small(reserve):
    slab = SlabAllocator(1 << 20, first_chunk_bytes=CHUNK)
    buf = slab.allocate(4096)
    address = buf.address
    slab.free(buf)
    assert slab.trim() == CHUNK
    again = slab.allocate(4096)  # the class's first chunk again: 64 KiB, taken from the reserve
    assert slab.stats().committed == CHUNK and slab.reused_chunks == 1
    assert again.address == address and not again.view(np.uint8, 4096).any()
    slab.free(again)


def test_leased_buffers_stay_through_trim(reserve):
    slab = SlabAllocator(CHUNK)
    keep = written_chunks(slab, 1, 7)
    loose = written_chunks(slab, 1, 9)
    for b in loose:
        slab.free(b)
    assert slab.trim() == CHUNK and slab.chunk_count == 1
    assert all(np.all(b.view(np.uint8, 4096) == 7) for b in keep)
    for b in keep:
        slab.free(b)


def test_a_collected_allocator_offers_its_empty_chunks(reserve):
    slab = SlabAllocator(CHUNK)
    bufs = written_chunks(slab, 3)
    bases = chunk_bases(bufs)
    for b in bufs:
        slab.free(b)
    del slab, bufs, b  # the last buffer holds its allocator too
    gc.collect()
    assert chunk_reserve_stats().held_bytes == 3 * CHUNK
    nxt = SlabAllocator(CHUNK)
    again = [nxt.allocate(CHUNK // 2) for _ in range(6)]
    assert chunk_bases(again) == bases and nxt.reused_chunks == 3
    assert all(not b.view(np.uint8, CHUNK // 2).any() for b in again)
    for b in again:
        nxt.free(b)


def test_the_bound_drops_what_does_not_fit(reserve):
    set_chunk_reserve_limit(CHUNK)
    slab = SlabAllocator(CHUNK)
    bufs = written_chunks(slab, 3)
    for b in bufs:
        slab.free(b)
    before = chunk_reserve_stats()
    slab.trim()
    s = chunk_reserve_stats()
    assert s.held_bytes <= CHUNK and s.regions == 1
    assert s.kept + s.dropped == before.kept + before.dropped + 1  # the spare trimmed: the reserve was full
    assert set_chunk_reserve_limit(0) == CHUNK and chunk_reserve_stats().held_bytes == 0  # lowered: dropped
    fresh = SlabAllocator(CHUNK)
    buf = fresh.allocate(64)
    assert fresh.reused_chunks == 0
    fresh.free(buf)


def test_chunks_are_reused_only_alike(reserve):
    """Size, alignment and huge-page advice all match, or the allocator maps its own chunk."""
    huge = SlabAllocator(CHUNK, first_chunk_bytes=CHUNK // 2)  # first chunks 32 KiB, then advised 64 KiB
    bufs = [huge.allocate(4096) for _ in range(8 + 16)]
    for b in bufs:
        huge.free(b)
    huge.trim()
    assert chunk_reserve_stats().regions == 2
    plain = SlabAllocator(CHUNK, huge_pages=False, first_chunk_bytes=CHUNK)  # unadvised 64 KiB chunks
    b = plain.allocate(4096)
    assert plain.reused_chunks == (0 if huge.huge_pages else 1)
    plain.free(b)
    small = SlabAllocator(CHUNK // 2, huge_pages=False)  # 32 KiB chunks, unadvised: like the first one
    b = small.allocate(4096)
    assert small.reused_chunks == 1 and b.address % (CHUNK // 2) == 0
    small.free(b)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "64"])
def test_bound_checks(bad):
    with pytest.raises(ValueError, match="limit_bytes must be an int >= 0"):
        set_chunk_reserve_limit(bad)


def test_threads_each_see_only_zeros_from_the_reserve(reserve):
    """Allocators of two threads release and take chunks of one reserve: every slot a thread is handed
    reads as zeros before it writes its own pattern, and the reserve stays within its bound."""
    errors: list[str] = []

    def work(tag: int) -> None:
        for _ in range(40):
            slab = SlabAllocator(CHUNK)
            bufs = [slab.allocate(8192) for _ in range(3 * CHUNK // 8192)]
            for b in bufs:
                view = b.view(np.uint8, 8192)
                if view.any():
                    errors.append(f"thread {tag}: a slot at {b.address:#x} held earlier bytes")
                view[:] = tag
            for b in bufs:
                slab.free(b)
            slab.trim()

    threads = [threading.Thread(target=work, args=(t,)) for t in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert chunk_reserve_stats().held_bytes <= 16 * CHUNK


def test_an_owner_collected_with_its_allocator_frees_into_it_quietly(reserve, caplog):
    """In one garbage cycle the allocator's finalizer runs before its owner's ``__del__``: the owner's
    frees find the classes gone, raise nothing, and each chunk goes to the reserve once its last slot
    is freed."""

    class Owner:
        def __init__(self) -> None:
            self.slab = SlabAllocator(CHUNK)
            self.bufs = written_chunks(self.slab, 2)
            self.me = self  # a cycle: collected only by the garbage collector, allocator and all

        def __del__(self) -> None:
            for b in self.bufs:
                self.slab.free(b)

    raised = []
    old_hook, sys.unraisablehook = sys.unraisablehook, raised.append
    try:
        owner = Owner()
        bases = chunk_bases(owner.bufs)
        del owner
        gc.collect()
    finally:
        sys.unraisablehook = old_hook
    assert raised == [] and not caplog.records
    assert chunk_reserve_stats().held_bytes == 2 * CHUNK
    nxt = SlabAllocator(CHUNK)
    again = written_chunks(nxt, 2, 0)
    assert chunk_bases(again) == bases and nxt.reused_chunks == 2
    for b in again:
        nxt.free(b)
