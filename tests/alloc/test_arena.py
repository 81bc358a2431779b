"""ArenaAllocator: alignment, reuse, coalescing, OutOfMemory, fragmentation, threads."""

from __future__ import annotations

import gc
import random
import subprocess
import sys
import textwrap
import threading
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import onnxkv.alloc
from onnxkv.alloc import ArenaAllocator, OutOfMemory

G = 64  # default granule


def block_bytes(nbytes: int, granule: int = G) -> int:
    """Bytes an arena block takes for a request of ``nbytes``."""
    return max(1, -(-nbytes // granule)) * granule


def fill_random(arena: ArenaAllocator, rng: np.random.Generator) -> list:
    """Allocate until the arena is full, writing random bytes into every buffer."""
    bufs = []
    while True:
        n = int(rng.integers(1, 700))
        try:
            buf = arena.allocate(n)
        except OutOfMemory:
            return bufs
        buf.view(np.uint8, n)[:] = rng.integers(0, 256, n, dtype=np.uint8)
        bufs.append(buf)


def snapshot(bufs) -> list[bytes]:
    return [buf.view(np.uint8, buf.nbytes).tobytes() for buf in bufs]


@pytest.mark.parametrize(
    "capacity, alignment, error",
    [
        (0, 64, "positive multiple"),
        (1000, 64, "multiple of 64"),
        (4096, 32, ">= 64"),
        (4096, 96, "power of two"),
        (-64, 64, ">= 0"),
    ],
)
def test_construction_checks(capacity, alignment, error):
    with pytest.raises(ValueError, match=error):
        ArenaAllocator(capacity, alignment)


@pytest.mark.parametrize("granule", [64, 128, 4096])
@pytest.mark.parametrize("alignment", [1 << k for k in range(15)])
def test_addresses_are_aligned(granule, alignment):
    arena = ArenaAllocator(1 << 20, granule)
    bufs = [arena.allocate(n, alignment) for n in (0, 1, 100, 64, 3000, 7)]
    for buf in bufs:
        assert buf.address % max(alignment, granule) == 0
        assert buf.offset % granule == 0
        assert buf.address == arena._core.address + buf.offset
    for buf in bufs:
        arena.free(buf)
    assert arena.largest_free_block == arena.capacity


def test_views_are_writable_and_independent():
    arena = ArenaAllocator(1 << 16)
    bufs = [arena.allocate(n) for n in (1, 63, 64, 65, 200, 1000)]
    for i, buf in enumerate(bufs):
        buf.view(np.uint8, buf.nbytes)[:] = i + 1
    for i, buf in enumerate(bufs):
        v = buf.view(np.uint8, buf.nbytes)
        assert v.flags.writeable and v.flags.c_contiguous
        assert np.all(v == i + 1)
    spans = sorted((b.offset, b.offset + block_bytes(b.nbytes)) for b in bufs)
    assert all(end <= start for (_, end), (start, _) in pairwise(spans))


def test_stats_count_block_bytes():
    arena = ArenaAllocator(4096)
    assert arena.capacity == 4096 and arena.alignment == 64
    s = arena.stats()
    assert (s.committed, s.live, s.peak, s.allocations, s.frees) == (4096, 0, 0, 0, 0)
    a = arena.allocate(100)  # 128 bytes
    b = arena.allocate(0)  # one granule
    c = arena.allocate(640)
    s = arena.stats()
    assert (s.committed, s.live, s.peak, s.allocations, s.frees) == (4096, 832, 832, 3, 0)
    arena.free(c)
    arena.free(a)
    s = arena.stats()
    assert (s.committed, s.live, s.peak, s.allocations, s.frees) == (4096, 64, 832, 3, 2)
    arena.free(b)
    assert arena.stats().live == 0
    assert arena.largest_free_block == 4096


def test_first_allocations_are_packed_from_offset_zero():
    arena = ArenaAllocator(4096)
    offsets = [arena.allocate(n).offset for n in (64, 1, 128, 65)]
    assert offsets == [0, 64, 128, 256]


def test_reuse_after_free_gives_same_offset():
    arena = ArenaAllocator(1 << 16)
    a, b, c = arena.allocate(256), arena.allocate(512), arena.allocate(256)
    assert (a.offset, b.offset, c.offset) == (0, 256, 768)
    off = b.offset
    arena.free(b)
    again = arena.allocate(512)
    assert again.offset == off
    arena.free(again)
    assert arena.allocate(500).offset == off  # same block size class


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_coalescing_two_neighbours(order):
    arena = ArenaAllocator(1 << 16)
    pair = [arena.allocate(320), arena.allocate(192)]
    guard = arena.allocate(64)  # keeps the pair from merging with the tail
    first = pair[0].offset
    for i in order:
        arena.free(pair[i])
    merged = arena.allocate(512)
    assert merged.offset == first
    assert guard.offset == 512


def test_coalescing_on_both_sides():
    arena = ArenaAllocator(1024)
    a, b, c, d = (arena.allocate(256) for _ in range(4))
    arena.free(a)
    arena.free(c)
    assert arena.largest_free_block == 256
    assert arena._core.stats()["free_blocks"] == 2
    arena.free(b)  # merges with a and c
    assert arena.largest_free_block == 768
    assert arena._core.stats()["free_blocks"] == 1
    whole = arena.allocate(768)
    assert whole.offset == 0
    arena.free(d)
    arena.free(whole)
    assert arena.largest_free_block == 1024
    assert arena.allocate(1024).offset == 0


def test_alignment_pad_stays_free_and_is_reused():
    arena = ArenaAllocator(1 << 16)
    small = arena.allocate(64)
    big = arena.allocate(100, 4096)
    assert big.address % 4096 == 0
    assert big.offset == 4096  # the region starts 4096-aligned, so offsets follow addresses
    pad_user = arena.allocate(64)
    assert pad_user.offset == 64  # the pad in front of `big` was left free
    for buf in (small, big, pad_user):
        arena.free(buf)
    assert arena.largest_free_block == arena.capacity


def test_out_of_memory_is_deterministic_and_changes_nothing():
    rng = np.random.default_rng(7)
    arena = ArenaAllocator(1 << 14)
    bufs = fill_random(arena, rng)
    contents = snapshot(bufs)
    stats = arena.stats()
    largest = arena.largest_free_block
    request = largest + 1
    messages = []
    for _ in range(3):
        with pytest.raises(OutOfMemory) as info:
            arena.allocate(request)
        messages.append(str(info.value))
    assert len(set(messages)) == 1
    msg = messages[0]
    assert f"{request} bytes" in msg
    assert f"{stats.live} bytes live" in msg
    assert f"capacity {arena.capacity}" in msg
    assert f"largest free block {largest} bytes" in msg
    assert snapshot(bufs) == contents
    assert arena.stats() == stats
    assert arena.largest_free_block == largest
    # a request that fits still works afterwards, at the place a fresh replay gives
    if largest:
        assert arena.allocate(largest).nbytes == largest


@pytest.mark.parametrize(
    "nbytes, alignment", [((1 << 14) + 1, 64), (1 << 40, 64), (1 << 80, 64), (64, 1 << 40), (64, 1 << 90)]
)
def test_out_of_memory_for_requests_beyond_capacity(nbytes, alignment):
    arena = ArenaAllocator(1 << 14)
    keep = arena.allocate(100)
    keep.view(np.uint8, 100)[:] = 9
    before = arena.stats()
    with pytest.raises(OutOfMemory, match=f"cannot allocate {nbytes} bytes aligned to {alignment}"):
        arena.allocate(nbytes, alignment)
    assert arena.stats() == before
    assert np.all(keep.view(np.uint8, 100) == 9)


def test_out_of_memory_same_on_a_replayed_arena():
    def run() -> tuple[list[int], str]:
        arena = ArenaAllocator(1 << 13)
        bufs = fill_random(arena, np.random.default_rng(3))
        for buf in bufs[::3]:
            arena.free(buf)
        try:
            arena.allocate(arena.largest_free_block + 64)
        except OutOfMemory as exc:
            return [b.offset for b in bufs], str(exc)
        raise AssertionError("expected OutOfMemory")

    assert run() == run()


def test_fragmentation():
    arena = ArenaAllocator(16 * 256)
    bufs = [arena.allocate(256) for _ in range(16)]
    with pytest.raises(OutOfMemory):
        arena.allocate(1)
    for buf in bufs[::2]:
        arena.free(buf)
    s = arena.stats()
    assert s.live == 8 * 256
    assert arena.largest_free_block == 256  # half the arena is free, in 8 holes
    assert arena._core.stats()["free_blocks"] == 8
    with pytest.raises(OutOfMemory, match="largest free block 256 bytes"):
        arena.allocate(257)
    holes = sorted(arena.allocate(200).offset for _ in range(8))
    assert holes == [b.offset for b in bufs[::2]]
    with pytest.raises(OutOfMemory):
        arena.allocate(64)


def test_determinism_fresh_and_after_reset():
    def sequence(arena: ArenaAllocator) -> list[int]:
        rng = random.Random(99)
        live, offsets = [], []
        for _ in range(500):
            if live and rng.random() < 0.4:
                arena.free(live.pop(rng.randrange(len(live))))
            else:
                try:
                    buf = arena.allocate(rng.randrange(0, 2000), 1 << rng.randrange(0, 8))
                except OutOfMemory:
                    offsets.append(-1)
                    continue
                live.append(buf)
                offsets.append(buf.offset)
        for buf in live:
            arena.free(buf)
        return offsets

    arena = ArenaAllocator(1 << 15)
    first = sequence(arena)
    assert -1 in first  # the sequence does run out of memory
    assert sequence(ArenaAllocator(1 << 15)) == first
    arena.reset()
    assert arena.stats().allocations == 0
    assert sequence(arena) == first


def test_reset_refuses_live_buffers():
    arena = ArenaAllocator(4096)
    buf = arena.allocate(10)
    with pytest.raises(RuntimeError, match="1 live blocks"):
        arena.reset()
    arena.free(buf)
    arena.reset()
    s = arena.stats()
    assert (s.live, s.peak, s.allocations, s.frees) == (0, 0, 0, 0)
    with pytest.raises(ValueError, match="double free"):
        arena.free(buf)  # a handle from before the reset stays dead


def test_stale_buffer_cannot_free_the_block_reusing_its_offset():
    arena = ArenaAllocator(4096)
    old = arena.allocate(128)
    arena.free(old)
    new = arena.allocate(128)
    assert new.offset == old.offset
    with pytest.raises(ValueError, match="double free"):
        arena.free(old)
    assert arena.stats().live == 128
    arena.free(new)


def test_views_keep_the_region_alive():
    arena = ArenaAllocator(4096)
    view = arena.allocate(256).view(np.uint16, 128)
    del arena
    gc.collect()
    view[:] = 513
    assert np.all(view == 513)


class ArenaMachine(RuleBasedStateMachine):
    """Random allocate/free against a model: no overlap, contents kept, stats exact."""

    CAPACITY = 1 << 14

    def __init__(self) -> None:
        super().__init__()
        self.arena = ArenaAllocator(self.CAPACITY)
        self.live: dict[int, tuple] = {}  # token -> (buffer, fill byte)
        self.next_token = 0
        self.model_live = self.model_peak = self.allocations = self.frees = 0

    @rule(nbytes=st.integers(0, 3000), alignment=st.sampled_from([1, 8, 64, 128, 512, 4096]))
    def allocate(self, nbytes: int, alignment: int) -> None:
        before = self.arena.stats()
        largest = self.arena.largest_free_block
        try:
            buf = self.arena.allocate(nbytes, alignment)
        except OutOfMemory:
            assert self.arena.stats() == before
            if alignment <= G:  # granule-aligned requests fail only when nothing fits
                assert largest < block_bytes(nbytes)
            return
        if alignment <= G:
            assert largest >= block_bytes(nbytes)
        assert buf.address % alignment == 0
        fill = self.next_token % 251 + 1
        buf.view(np.uint8, nbytes)[:] = fill
        self.live[self.next_token] = (buf, fill)
        self.next_token += 1
        self.model_live += block_bytes(nbytes)
        self.model_peak = max(self.model_peak, self.model_live)
        self.allocations += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        token = data.draw(st.sampled_from(sorted(self.live)))
        buf, _ = self.live.pop(token)
        self.arena.free(buf)
        self.model_live -= block_bytes(buf.nbytes)
        self.frees += 1
        with pytest.raises(ValueError, match="double free"):
            self.arena.free(buf)

    @invariant()
    def no_overlap_and_contents_kept(self) -> None:
        spans = sorted((b.offset, b.offset + block_bytes(b.nbytes)) for b, _ in self.live.values())
        assert all(end <= start for (_, end), (start, _) in pairwise(spans))
        assert all(0 <= start and end <= self.CAPACITY for start, end in spans)
        for buf, fill in self.live.values():
            assert np.all(buf.view(np.uint8, buf.nbytes) == fill)

    @invariant()
    def stats_match_model(self) -> None:
        s = self.arena.stats()
        assert (s.committed, s.live, s.peak, s.allocations, s.frees) == (
            self.CAPACITY,
            self.model_live,
            self.model_peak,
            self.allocations,
            self.frees,
        )
        assert self.arena.largest_free_block <= self.CAPACITY - self.model_live
        core = self.arena._core.stats()
        assert core["live_blocks"] == len(self.live)
        assert core["free_blocks"] <= core["live_blocks"] + 1  # no two free blocks are adjacent

    def teardown(self) -> None:
        for buf, _ in self.live.values():
            self.arena.free(buf)
        assert self.arena.largest_free_block == self.CAPACITY  # fully coalesced


ArenaMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
TestArenaMachine = ArenaMachine.TestCase


def test_two_threads_no_corruption():
    arena = ArenaAllocator(1 << 16)
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def work(seed: int) -> None:
        try:
            rng = random.Random(seed)
            mine: list = []
            barrier.wait()
            for i in range(3000):
                if mine and (rng.random() < 0.5 or len(mine) > 20):
                    buf, fill = mine.pop(rng.randrange(len(mine)))
                    assert np.all(buf.view(np.uint8, buf.nbytes) == fill)
                    arena.free(buf)
                    continue
                try:
                    buf = arena.allocate(rng.randrange(0, 1500), rng.choice([64, 256]))
                except OutOfMemory:
                    continue
                fill = (seed * 100 + i) % 255 + 1
                buf.view(np.uint8, buf.nbytes)[:] = fill
                mine.append((buf, fill))
            for buf, fill in mine:
                assert np.all(buf.view(np.uint8, buf.nbytes) == fill)
                arena.free(buf)
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = arena.stats()
    assert s.live == 0 and s.allocations == s.frees > 2000
    assert arena.largest_free_block == arena.capacity


CHURN_PYX = textwrap.dedent(
    """
    # cython: language_level=3
    from libc.stdint cimport uint64_t
    from libc.string cimport memset
    from onnxkv.alloc._arena cimport ARENA_OK, ArenaCore, ArenaHandle, arena_allocate, arena_free

    def churn(ArenaCore core, uint64_t seed, Py_ssize_t steps):
        # Allocate, fill, check and free through the C API without the GIL; return the error count.
        cdef ArenaHandle held[16]
        cdef unsigned char fills[16]
        cdef Py_ssize_t count = 0, k, i, bad = 0
        cdef uint64_t state = seed, alignment
        cdef size_t b
        cdef unsigned char* base = <unsigned char*>core.arena.base
        with nogil:
            for i in range(steps + 16):
                state = state * 6364136223846793005ULL + 1442695040888963407ULL
                if count > 0 and (count == 16 or i >= steps or (state >> 33) & 1):
                    k = <Py_ssize_t>((state >> 40) % <uint64_t>count)
                    for b in range(held[k].size):
                        bad += base[held[k].offset + b] != fills[k]
                    bad += arena_free(&core.arena, held[k]) != ARENA_OK
                    count -= 1
                    held[k] = held[count]
                    fills[k] = fills[count]
                elif i < steps:
                    alignment = 64 << ((state >> 50) & 3)
                    if arena_allocate(&core.arena, (state >> 20) % 2000, alignment, &held[count]) == ARENA_OK:
                        fills[count] = <unsigned char>((seed * 31 + i) | 1)
                        memset(base + held[count].offset, fills[count], held[count].size)
                        count += 1
        return bad
    """
)

BUILD_PY = textwrap.dedent(
    """
    import sys
    from Cython.Build import cythonize
    from setuptools import setup
    setup(ext_modules=cythonize(["churn.pyx"], include_path=[sys.argv[1]], quiet=True),
          script_args=["build_ext", "--inplace", "-q"])
    """
)


@pytest.fixture(scope="module")
def churn(tmp_path_factory):
    """A small Cython module driving the arena through its nogil C API (``_arena.pxd``)."""
    pytest.importorskip("Cython")
    pytest.importorskip("setuptools")
    where = tmp_path_factory.mktemp("churn")
    (where / "churn.pyx").write_text(CHURN_PYX)
    (where / "build.py").write_text(BUILD_PY)
    include = Path(onnxkv.alloc.__file__).parents[2]  # the folder holding onnxkv/alloc/_arena.pxd
    subprocess.run([sys.executable, "build.py", str(include)], cwd=where, check=True, capture_output=True)
    sys.path.insert(0, str(where))
    try:
        import churn as module
    finally:
        sys.path.remove(str(where))
    return module.churn


def test_two_threads_through_the_nogil_c_api(churn):
    arena = ArenaAllocator(1 << 16)
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda s=s: results.append(churn(arena._core, s, 200_000)), daemon=True) for s in (1, 2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "C API threads hung: free lists corrupted?"
    assert results == [0, 0]  # no byte of a held block was overwritten, every free succeeded
    s = arena.stats()
    assert s.live == 0 and s.allocations == s.frees > 100_000
    assert arena.largest_free_block == arena.capacity
