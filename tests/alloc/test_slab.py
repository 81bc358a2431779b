"""SlabAllocator: size classes, adjacency, reuse order, chunk release, lanes, stats, errors, threads."""

from __future__ import annotations

import gc
import mmap
import random
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from onnxkv.alloc import ArenaAllocator, OutOfMemory, SlabAllocator, SlabLane, SystemAllocator
from onnxkv.alloc.chunk_reserve import set_chunk_reserve_limit

CHUNK = 64 << 10  # small chunks keep the tests light; the default is 2 MiB (64 KiB first chunks: all chunks equal)
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def slot_of(nbytes: int, alignment: int = 64) -> int:
    a = max(alignment, 64)
    return -(-max(nbytes, 1) // a) * a


def fill(buf, value: int) -> None:
    buf.view(np.uint8, buf.nbytes)[:] = value


def test_defaults():
    slab = SlabAllocator()
    assert (slab.chunk_bytes, slab.first_chunk_bytes, slab.granule) == (2 << 20, 64 << 10, 64)
    assert slab.huge_pages == hasattr(mmap, "MADV_HUGEPAGE")
    bufs = [slab.allocate(16448) for _ in range(3)]  # the first chunk of the class: 64 KiB, 3 slots
    assert bufs[0].address % (64 << 10) == 0
    assert slab.stats().committed == 64 << 10
    more = slab.allocate(16448)  # then full chunks, aligned to 2 MiB
    assert more.address % (2 << 20) == 0
    assert slab.stats().committed == (64 << 10) + (2 << 20)
    for b in bufs + [more]:
        slab.free(b)
    assert not SlabAllocator(huge_pages=False).huge_pages


def test_first_chunk_of_a_class_is_small_then_chunks_are_full_size():
    slab = SlabAllocator(1 << 20, first_chunk_bytes=16 << 10)
    small = [slab.allocate(4096) for _ in range(4)]
    assert all(b - a == 4096 for a, b in pairwise(x.address for x in small))
    assert slab.stats().committed == 16 << 10 and slab.chunk_count == 1
    full = slab.allocate(4096)
    assert full.address % (1 << 20) == 0 and slab.stats().committed == (16 << 10) + (1 << 20)
    wide = slab.allocate(40000)  # a slot above first_chunk_bytes: a first chunk of the slot's power of two
    assert wide.address % 65536 == 0 and slab.stats().committed == (16 << 10) + (1 << 20) + 65536
    for b in small:
        slab.free(b)
    slab.free(full)  # two empty chunks of the class: one stays, the class never starts small again
    assert slab.chunk_count == 2
    again = [slab.allocate(4096) for _ in range(300)]
    assert slab.stats().committed in ((16 << 10) + (2 << 20) + 65536, (2 << 20) + 65536)
    for b in again + [wide]:
        slab.free(b)


@pytest.mark.skipif(not THP.exists() or not hasattr(mmap, "MADV_HUGEPAGE"), reason="no transparent huge pages")
def test_full_chunks_are_advised_huge_pages_and_first_chunks_are_not():
    def flags(address: int) -> set[str]:
        with open("/proc/self/smaps", encoding="ascii") as f:
            inside = False
            for line in f:
                head = line.split()[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and line.startswith("VmFlags:"):
                    return set(line.split()[1:])
        raise AssertionError(f"no mapping holds {address:#x}")

    slab = SlabAllocator()
    first = slab.allocate(32 << 10)
    full = [slab.allocate(32 << 10) for _ in range(2)][-1]  # the second one starts a 2 MiB chunk
    assert "hg" not in flags(first.address)
    assert "hg" in flags(full.address)
    assert "hg" not in flags(SlabAllocator(huge_pages=False, first_chunk_bytes=2 << 20).allocate(64).address)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"chunk_bytes": 3 << 20}, "power of two"),
        ({"chunk_bytes": 2048}, "chunk_bytes must be a power of two >= the page size"),
        ({"chunk_bytes": 4096, "granule": 32}, "granule must be a power of two in"),
        ({"chunk_bytes": 4096, "granule": 8192}, "granule must be a power of two in"),
        ({"granule": 96}, "power of two"),
        ({"first_chunk_bytes": 2048}, "first_chunk_bytes must be a power of two in"),
        ({"chunk_bytes": 1 << 16, "first_chunk_bytes": 1 << 17}, "first_chunk_bytes must be a power of two in"),
    ],
)
def test_construction_checks(kwargs, error):
    with pytest.raises(ValueError, match=error):
        SlabAllocator(**kwargs)


@pytest.mark.parametrize("alignment", [1 << k for k in range(0, 17, 2)])
@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 1000, 5000])
def test_addresses_are_aligned(alignment, nbytes):
    slab = SlabAllocator(CHUNK)
    bufs = [slab.allocate(nbytes, alignment) for _ in range(6)]
    for buf in bufs:
        assert buf.address % max(alignment, 64) == 0
        assert buf.nbytes == nbytes
        assert buf.slot_bytes == slot_of(nbytes, alignment)
    for buf in bufs:
        slab.free(buf)
    assert slab.stats().live == 0


def test_successive_same_size_slots_are_adjacent():
    slab = SlabAllocator(CHUNK)
    n = 4160  # 15 slots per 64 KiB chunk
    bufs = [slab.allocate(n) for _ in range(10)]
    starts = [b.address for b in bufs]
    assert all(b - a == n for a, b in pairwise(starts))
    assert starts[0] % CHUNK == 0
    other = slab.allocate(100)  # another size class: another chunk
    assert not starts[0] <= other.address < starts[0] + CHUNK
    assert slab.allocate(n).address == starts[-1] + n  # the class continues where it stopped
    assert slab.chunk_count == 2


def test_size_classes_round_to_alignment():
    slab = SlabAllocator(CHUNK)
    a = slab.allocate(100)  # class 128
    b = slab.allocate(128)  # same class: the next slot
    c = slab.allocate(100, 128)  # still 128
    d = slab.allocate(100, 256)  # class 256: a chunk of its own
    assert (b.address - a.address, c.address - b.address) == (128, 128)
    assert d.address % CHUNK == 0 and slab.chunk_count == 2
    assert [x.slot_bytes for x in (a, b, c, d)] == [128, 128, 128, 256]


def test_freed_slots_reused_lowest_address_first():
    slab = SlabAllocator(CHUNK)
    bufs = [slab.allocate(1024) for _ in range(20)]
    addresses = [b.address for b in bufs]
    order = [13, 2, 7, 19]
    for i in order:
        slab.free(bufs[i])
    again = [slab.allocate(1000).address for _ in order]
    assert again == sorted(addresses[i] for i in order)
    assert slab.allocate(1024).address == addresses[19] + 1024  # then the untouched slots, in order


def test_a_full_chunk_continues_in_a_new_chunk_and_freed_slots_come_first():
    slab = SlabAllocator(CHUNK)
    per_chunk = CHUNK // 4096
    first = [slab.allocate(4096) for _ in range(per_chunk)]
    extra = slab.allocate(4096)
    assert slab.chunk_count == 2
    assert not first[0].address <= extra.address < first[0].address + CHUNK
    freed = first[5].address
    slab.free(first[5])
    low = min(freed, extra.address + 4096)
    assert slab.allocate(4096).address == low


def test_empty_chunks_are_released_keeping_one_spare():
    slab = SlabAllocator(CHUNK)
    per_chunk = CHUNK // 8192
    bufs = [slab.allocate(8192) for _ in range(3 * per_chunk)]
    chunks = sorted({b.address - b.address % CHUNK for b in bufs})
    assert len(chunks) == 3 and slab.stats().committed == 3 * CHUNK
    by_chunk = {c: [b for b in bufs if b.address - b.address % CHUNK == c] for c in chunks}
    for b in by_chunk[chunks[2]]:
        slab.free(b)
    assert slab.chunk_count == 3  # the first empty chunk is the spare
    for b in by_chunk[chunks[0]]:
        slab.free(b)
    assert slab.chunk_count == 2 and slab.stats().committed == 2 * CHUNK  # the higher empty one went
    again = [slab.allocate(8192) for _ in range(per_chunk)]  # the spare (the lowest chunk) is filled in order
    assert [b.address for b in again] == [chunks[0] + i * 8192 for i in range(per_chunk)]
    for b in again + by_chunk[chunks[1]]:
        slab.free(b)
    s = slab.stats()
    assert slab.chunk_count == 1 and (s.committed, s.live) == (CHUNK, 0)


def test_spare_is_per_size_class():
    slab = SlabAllocator(CHUNK)
    a, b = slab.allocate(512), slab.allocate(2048)
    slab.free(a)
    slab.free(b)
    assert slab.chunk_count == 2 and slab.stats().committed == 2 * CHUNK


@pytest.mark.parametrize("nbytes, alignment", [(CHUNK + 1, 64), (3 * CHUNK, 64), (100, 4 * CHUNK)])
def test_oversize_requests_get_a_region_of_their_own(nbytes, alignment):
    slab = SlabAllocator(CHUNK)
    small = slab.allocate(64)
    big = slab.allocate(nbytes, alignment)
    region = -(-max(nbytes, alignment) // mmap.PAGESIZE) * mmap.PAGESIZE
    assert big.address % max(alignment, CHUNK) == 0
    assert big.slot_bytes == region
    s = slab.stats()
    assert (s.committed, s.live) == (CHUNK + region, 64 + region)
    fill(big, 7)
    assert np.all(big.view(np.uint8, nbytes) == 7)
    slab.free(big)
    s = slab.stats()
    assert (s.committed, s.live, slab.chunk_count) == (CHUNK, 64, 1)  # released at once, no spare
    slab.free(small)


def test_stats_accounting():
    slab = SlabAllocator(CHUNK)
    s = slab.stats()
    assert (s.committed, s.live, s.peak, s.allocations, s.frees) == (0, 0, 0, 0, 0)
    a = slab.allocate(100)  # 128-byte slot
    b = slab.allocate(0)  # one granule
    c = slab.allocate(640, 4096)  # 4096-byte slot
    s = slab.stats()
    assert (s.committed, s.live, s.peak, s.allocations, s.frees) == (3 * CHUNK, 4288, 4288, 3, 0)
    slab.free(c)
    slab.free(a)
    s = slab.stats()
    assert (s.committed, s.live, s.peak, s.allocations, s.frees) == (3 * CHUNK, 64, 4288, 3, 2)
    slab.free(b)
    s = slab.stats()
    assert (s.live, s.frees) == (0, 3)
    assert s.committed >= s.live


def test_random_sequence_matches_model():
    rng = random.Random(4321)
    slab = SlabAllocator(CHUNK)
    live: list = []
    classes: set[int] = set()
    model_live = model_peak = allocations = frees = 0
    for step in range(3000):
        if live and rng.random() < 0.45:
            buf, value = live.pop(rng.randrange(len(live)))
            assert np.all(buf.view(np.uint8, buf.nbytes) == value)
            slab.free(buf)
            model_live -= buf.slot_bytes
            frees += 1
        else:
            n = rng.choice([rng.randrange(0, 3000), 4160, 16448, rng.randrange(CHUNK, 2 * CHUNK)])
            buf = slab.allocate(n, 1 << rng.randrange(0, 13))
            value = step % 251 + 1
            fill(buf, value)
            live.append((buf, value))
            classes.add(buf.slot_bytes)
            model_live += buf.slot_bytes
            model_peak = max(model_peak, model_live)
            allocations += 1
        s = slab.stats()
        assert (s.live, s.peak, s.allocations, s.frees) == (model_live, model_peak, allocations, frees)
        assert s.committed >= s.live
    spans = sorted((b.address, b.address + b.nbytes) for b, _ in live)
    assert all(end <= start for (_, end), (start, _) in pairwise(spans))
    for buf, value in live:
        assert np.all(buf.view(np.uint8, buf.nbytes) == value)
        slab.free(buf)
    s = slab.stats()
    assert s.live == 0
    # oversize regions are gone, every class keeps at most its spare chunk
    assert s.committed == slab.chunk_count * CHUNK <= sum(c <= CHUNK for c in classes) * CHUNK


def test_lanes_keep_their_buffers_adjacent():
    slab = SlabAllocator(CHUNK)
    lanes = [slab.lane(i) for i in range(3)]
    assert all(isinstance(lane, SlabLane) for lane in lanes)
    bufs: list[list] = [[], [], []]
    for _ in range(10):  # interleaved, as a pool allocates one page per plane per page id
        for i, lane in enumerate(lanes):
            bufs[i].append(lane.allocate(2048))
    for lane_bufs in bufs:
        assert all(b.address - a.address == 2048 for a, b in pairwise(lane_bufs))
    assert slab.chunk_count == 3
    assert slab.allocate(2048).address == bufs[0][-1].address + 2048  # allocate() is lane 0
    s = slab.stats()
    assert (s.live, s.allocations) == (31 * 2048, 31)
    assert lanes[2].stats() == s
    lanes[1].free(bufs[2][0])  # any lane (or the parent) frees any buffer of the allocator
    slab.free(bufs[1][0])
    assert slab.stats().frees == 2
    with pytest.raises(ValueError, match="double free"):
        lanes[0].free(bufs[2][0])


@pytest.mark.parametrize("index", [-1, 1.0, True, "0"])
def test_lane_index_checks(index):
    with pytest.raises(ValueError, match="lane index must be an int >= 0"):
        SlabAllocator(CHUNK).lane(index)


def test_views_kept_past_free_and_release_stay_mapped():
    old = set_chunk_reserve_limit(0)  # released chunks unmapped, not zeroed into the reserve
    try:
        _views_stay_mapped()
    finally:
        set_chunk_reserve_limit(old)


def _views_stay_mapped():
    slab = SlabAllocator(CHUNK)
    per_chunk = CHUNK // 4096
    bufs = [slab.allocate(4096) for _ in range(2 * per_chunk)]  # two chunks of one class
    big = slab.allocate(2 * CHUNK)  # an oversize region: released on free
    views = [bufs[0].view(np.uint32, 1024), bufs[per_chunk].view(np.uint32, 1024), big.view(np.uint32, 1024)]
    for k, v in enumerate(views):
        v[:] = np.arange(1024, dtype=np.uint32) + k
    for b in bufs + [big]:
        slab.free(b)
    assert slab.chunk_count == 1  # one class chunk and the oversize region were released (never closed)
    del bufs, big, slab
    gc.collect()
    for k, v in enumerate(views):
        v[:] += 1  # each view keeps its mapping alive: no crash
        assert np.array_equal(v, np.arange(1, 1025, dtype=np.uint32) + k)


def test_views_keep_the_chunk_alive_after_the_allocator_is_gone():
    slab = SlabAllocator(CHUNK)
    big = slab.allocate(2 * CHUNK)
    view = slab.allocate(256).view(np.uint16, 128)
    big_view = big.view(np.uint8, 2 * CHUNK)
    del slab, big
    gc.collect()
    view[:] = 513
    big_view[::4096] = 9
    assert np.all(view == 513) and np.all(big_view[::4096] == 9)


@pytest.mark.parametrize("nbytes, alignment", [(1 << 60, 64), (1 << 80, 64), (64, 1 << 60)])
def test_out_of_memory_when_mapping_fails_changes_nothing(nbytes, alignment):
    slab = SlabAllocator(CHUNK)
    keep = slab.allocate(100)
    fill(keep, 9)
    before = slab.stats()
    with pytest.raises(OutOfMemory, match=f"cannot allocate {nbytes} bytes aligned to {alignment}") as info:
        slab.allocate(nbytes, alignment)
    assert repr(slab) in str(info.value)
    assert slab.stats() == before and slab.chunk_count == 1
    assert np.all(keep.view(np.uint8, 100) == 9)
    assert slab.allocate(100).address == keep.address + 128  # still works, the class unchanged


@pytest.mark.parametrize(
    "other",
    [SystemAllocator, lambda: ArenaAllocator(1 << 16), lambda: SlabAllocator(CHUNK)],
    ids=["system", "arena", "another-slab"],
)
def test_foreign_buffers_and_double_free(other):
    slab = SlabAllocator(CHUNK)
    mine = slab.allocate(64)
    foreign = other().allocate(64)
    before = slab.stats()
    with pytest.raises(ValueError, match="foreign buffer") as info:
        slab.free(foreign)
    assert repr(slab) in str(info.value)
    assert slab.stats() == before
    slab.free(mine)
    before = slab.stats()
    with pytest.raises(ValueError, match="double free") as info:
        slab.free(mine)
    assert repr(slab) in str(info.value) and slab.stats() == before
    with pytest.raises(ValueError, match="freed"):
        mine.view(np.uint8, 8)
    with pytest.raises(ValueError, match="freed"):
        _ = mine.address
    assert "freed" in repr(mine)


def test_stale_buffer_cannot_free_the_slot_reusing_its_address():
    slab = SlabAllocator(CHUNK)
    old = slab.allocate(128)
    old_address = old.address
    slab.free(old)
    new = slab.allocate(128)
    assert new.address == old_address
    with pytest.raises(ValueError, match="double free"):
        slab.free(old)
    assert slab.stats().live == 128
    fill(new, 3)
    slab.free(new)


def test_two_threads_random_interleavings():
    slab = SlabAllocator(CHUNK)
    lanes = [slab, slab.lane(1)]
    classes: set[tuple[int, int]] = set()
    barrier = threading.Barrier(2)

    def work(seed: int) -> int:
        """Random allocate / check / free through random lanes; returns the allocations made."""
        rng = random.Random(seed)
        mine: list = []
        made = 0
        barrier.wait()
        for i in range(4000):
            if mine and (rng.random() < 0.5 or len(mine) > 40):
                buf, value = mine.pop(rng.randrange(len(mine)))
                assert np.all(buf.view(np.uint8, buf.nbytes) == value)
                rng.choice(lanes).free(buf)
                continue
            lane = rng.randrange(2)
            buf = lanes[lane].allocate(
                rng.choice([rng.randrange(0, 3000), 4160, 16448, CHUNK + 1]), rng.choice([64, 256, 4096])
            )
            classes.add((lane, buf.slot_bytes))
            value = (seed * 97 + i) % 255 + 1
            fill(buf, value)
            mine.append((buf, value))
            made += 1
        while mine:
            buf, value = mine.pop()
            assert np.all(buf.view(np.uint8, buf.nbytes) == value)
            slab.free(buf)
        return made

    with ThreadPoolExecutor(2) as pool:  # a failed assertion in a worker re-raises here
        made = sum(pool.map(work, (1, 2)))
    s = slab.stats()
    assert s.live == 0 and s.allocations == s.frees == made > 3000
    # oversize regions are gone, every (lane, size) class keeps at most its spare chunk
    assert s.committed == slab.chunk_count * CHUNK <= sum(c <= CHUNK for _, c in classes) * CHUNK


COLLECTED_WHILE_LOCKED = """
import gc
from onnxkv.alloc import SlabAllocator

slab = SlabAllocator(1 << 16)


class Owner:  # frees its buffer when collected, like a state nobody closed
    def __init__(self):
        self.buf = slab.allocate(64)
        self.cycle = self

    def __del__(self):
        slab.free(self.buf)


Owner()
gc.disable()
with slab._lock:  # held while a chunk is mapped, when an allocation may collect
    gc.collect()
print("collected", slab.stats().live)
"""


def test_a_buffer_freed_by_a_collection_inside_the_lock_does_not_deadlock(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", COLLECTED_WHILE_LOCKED], capture_output=True, text=True, timeout=30, cwd=tmp_path
    )
    assert done.returncode == 0 and done.stdout.split() == ["collected", "0"], done.stderr[-2000:]


FREED_AT_EXIT = """
import atexit
from onnxkv.alloc import SlabAllocator

slab = SlabAllocator()
bufs = [slab.lane(i % 2).allocate(4096, 64) for i in range(6)]


class Owner:  # frees its buffers when collected, as a state or page pool still alive at exit does
    def __del__(self):
        for b in bufs:
            slab.free(b)
        print("freed", slab.stats().live, flush=True)


owner = Owner()
atexit.register(print, "exiting", flush=True)
"""


def test_an_owner_alive_at_interpreter_exit_frees_into_its_allocator_cleanly(tmp_path):
    # weakref.finalize runs at exit for objects still alive: the allocator's must not empty its size
    # classes there while owners (alive as well) still free their slots into them
    done = subprocess.run(
        [sys.executable, "-c", FREED_AT_EXIT], capture_output=True, text=True, timeout=30, cwd=tmp_path
    )
    assert done.returncode == 0 and done.stdout.split() == ["exiting", "freed", "0"], done.stderr[-2000:]
    assert done.stderr == ""
