"""lease / release: every buffer an allocator returns is checked, and the allocator's free may fail."""

from __future__ import annotations

import gc
import logging
import weakref

import numpy as np
import pytest
from fuzzing import hypothesis_settings
from hostile_allocators import MODES, TYPED_ONLY, Hostile
from hypothesis import given
from hypothesis import strategies as st

from onnxkv.alloc import ArenaAllocator, SlabAllocator, SystemAllocator
from onnxkv.alloc.checked import forget, lease, release, tracked
from onnxkv.errors import InputError, OutOfMemory, StateError


@pytest.mark.parametrize(
    "make",
    [SystemAllocator, lambda: ArenaAllocator(1 << 16), lambda: SlabAllocator(1 << 16)],
    ids=["system", "arena", "slab"],
)
def test_builtin_allocators_pass_and_leases_are_tracked_until_released(make):
    alloc = make()
    a, x = lease(alloc, 4 * 6 * 8, 64, np.float32, (6, 8), "test")
    b, y = lease(alloc, 0, 64, np.uint8, (0,), "test")  # an empty lease holds no bytes: not indexed
    assert type(x) is np.ndarray and x.shape == (6, 8) and x.dtype == np.float32 and x.flags.writeable
    assert x.__array_interface__["data"][0] == a.address and a.address % 64 == 0
    assert tracked(alloc) == 1
    release(alloc, [a, None, b], "test")
    assert tracked(alloc) == 0 and alloc.stats().live == 0


def test_lanes_of_a_slab_share_one_index():
    slab = SlabAllocator(1 << 16)
    bufs = [lease(slab.lane(i), 256, 64, np.uint8, (256,), "test")[0] for i in range(3)]
    assert tracked(slab) == tracked(slab.lane(7)) == 3
    release(slab, bufs, "test")  # the parent frees any lane's buffer
    assert tracked(slab) == 0 and slab.stats().live == 0


@pytest.mark.parametrize("mode", sorted(MODES) + sorted(TYPED_ONLY))
def test_every_broken_buffer_is_rejected_and_given_back(mode):
    alloc = Hostile(mode)
    if mode in ("twice", "overlap"):  # needs a live lease to collide with
        alloc.mode = None
        first, _ = lease(alloc, 256, 64, np.float32, (4, 16), "test")
        alloc.mode = mode
    error, fragment = {**MODES, **TYPED_ONLY}[mode]
    with pytest.raises(error, match=fragment) as e:
        lease(alloc, 256, 64, np.float32, (4, 16), "the test's cache")
    msg = str(e.value)
    assert msg.startswith("the test's cache: Hostile(") and "allocate(256, 64) for float32[4, 16]" in msg
    if mode.startswith("raise"):
        assert type(e.value.__cause__) is {"raise-type": TypeError, "raise-memory": MemoryError}[mode]
    live = 1 if mode in ("twice", "overlap") else 0
    assert tracked(alloc) == live and alloc.inner.stats().live == 256 * live  # nothing else stays leased
    if live:
        release(alloc, [first], "test")
        alloc.mode = None
        again, _ = lease(alloc, 256, 64, np.float32, (4, 16), "test")  # the bytes are free again: no false alarm
        release(alloc, [again], "test")
    assert tracked(alloc) == 0 and alloc.inner.stats().live == 0


def test_out_of_memory_of_the_allocator_passes_through():
    class Full(SystemAllocator):
        def allocate(self, nbytes, alignment=64):
            raise OutOfMemory("Full: no room")

    with pytest.raises(OutOfMemory, match="^Full: no room$"):
        lease(Full(), 64, 64, np.uint8, (64,), "test")


def test_a_rejected_buffer_whose_free_raises_is_logged_and_the_rejection_raised(caplog):
    alloc = Hostile("negative")
    alloc.free_raises = True
    with caplog.at_level(logging.WARNING, logger="onnxkv.alloc"), pytest.raises(InputError, match="negative"):
        lease(alloc, 64, 64, np.float32, (4, 4), "test")
    assert "hostile free refuses" in caplog.text and tracked(alloc) == 0


def test_release_frees_every_buffer_whatever_free_raises(caplog):
    alloc = Hostile()
    bufs = [lease(alloc, 64, 64, np.uint8, (64,), "test")[0] for _ in range(3)]
    calls = []

    def free(buffer):
        calls.append(buffer)
        if len(calls) == 1:
            raise RuntimeError("first free fails")
        Hostile.free(alloc, buffer)

    alloc.free = free
    with caplog.at_level(logging.WARNING, logger="onnxkv.alloc"):
        release(alloc, bufs[:2], "test")  # logged, not raised
    assert calls == bufs[:2] and "first free fails" in caplog.text
    calls.clear()
    with pytest.raises(StateError, match=r"the pool: Hostile\(None\)\.free raised RuntimeError: first free") as e:
        release(alloc, [bufs[2], bufs[0]], "the pool", strict=True)
    assert calls == [bufs[2], bufs[0]] and isinstance(e.value.__cause__, RuntimeError)
    assert tracked(alloc) == 0  # every lease is forgotten whatever free did


def test_forgotten_leases_leave_the_index_without_a_free():
    alloc = Hostile()
    a, _ = lease(alloc, 64, 64, np.uint8, (64,), "test")
    forget(alloc, [a, None])
    assert tracked(alloc) == 0 and alloc.inner.stats().live == 64
    alloc.mode = "twice"  # the same buffer again is no longer known as leased
    b, _ = lease(alloc, 64, 64, np.uint8, (64,), "test")
    assert b is a and tracked(alloc) == 1
    release(alloc, [b], "test")
    assert tracked(alloc) == 0 and alloc.inner.stats().live == 0


class Region:
    """An allocator handing out the bytes of one array at offsets the test queues (any overlap allowed)."""

    def __init__(self) -> None:
        self.raw = np.zeros(1 << 12, np.uint8)
        self.base = self.raw.__array_interface__["data"][0]
        self.next: list[int] = []

    def allocate(self, nbytes, alignment=64):
        off = self.next.pop()
        outer = self

        class Piece:
            address = self.base + off

            def view(self, dtype, shape):
                return outer.raw[off : off + nbytes].view(dtype).reshape(shape)

        Piece.nbytes = nbytes
        return Piece()

    def free(self, buffer):
        pass

    def stats(self):
        return None


def test_the_index_keeps_neither_allocators_nor_buffers_alive():
    region = Region()
    region.next.append(0)
    buf, arr = lease(region, 64, 16, np.uint8, (64,), "test")
    buffer_ref, region_ref = weakref.ref(buf), weakref.ref(region)
    del buf, arr  # a lease whose owner went away without giving it back: its range stays ...
    assert buffer_ref() is None and tracked(region) == 1
    region.next.append(32)
    with pytest.raises(InputError, match="still leased"):
        lease(region, 64, 16, np.uint8, (64,), "test")
    del region  # ... until its allocator goes
    gc.collect()
    assert region_ref() is None


@hypothesis_settings(60)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 63), st.integers(1, 8)), max_size=40))
def test_ownership_index_matches_a_brute_force_model(ops):
    region = Region()
    live: dict[int, tuple[int, int, object]] = {}  # start -> (start, end, buffer)
    for take, slot, length in ops:
        if take or not live:
            start, n = slot * 16, length * 16
            region.next.append(start)
            clash = any(s < start + n and start < e for s, e, _ in live.values())
            try:
                buf, _ = lease(region, n, 16, np.uint8, (n,), "test")
            except InputError as e:
                assert clash and "still leased" in str(e)
            else:
                assert not clash
                live[start] = (start, start + n, buf)
        else:
            start = sorted(live)[slot % len(live)]
            release(region, [live.pop(start)[2]], "test")
        assert tracked(region) == len(live)
    release(region, [b for _, _, b in live.values()], "test")
    assert tracked(region) == 0


@pytest.mark.parametrize("block", [1, 2, 3, 8, 512])
def test_the_ownership_index_agrees_with_a_model_of_its_ranges(block):
    """Random leases and releases in any address order (the index is kept in blocks; a split or an
    emptied block must keep every range findable): overlaps found exactly as a list of the live ranges
    finds them, ranges sorted, block starts right."""
    from onnxkv.alloc.checked import _Leases

    rng = np.random.default_rng(block)
    leases = type("Leases", (_Leases,), {"BLOCK": block})()
    live: dict[int, tuple[int, int]] = {}
    held: list[object] = []
    for _ in range(3000):
        if held and rng.random() < 0.4:
            buf = held.pop(int(rng.integers(len(held))))
            leases.remove(buf)
            del live[id(buf)]
        else:
            start = int(rng.integers(0, 20_000))
            end = start + int(rng.integers(1, 60))
            hit = leases.overlapping(start, end)
            overlaps = [r for r in live.values() if r[0] < end and start < r[1]]
            assert (hit is None) == (not overlaps)
            if hit is None:
                buf = object()
                held.append(buf)
                leases.add(start, end, buf)
                live[id(buf)] = (start, end)
            else:
                assert live[hit[2]] == hit[:2] and hit[0] < end and start < hit[1]
        assert len(leases) == len(live)
        flat = [e for b in leases.blocks for e in b]
        assert flat == sorted(flat) and leases.firsts == [b[0][0] for b in leases.blocks] and all(leases.blocks)
