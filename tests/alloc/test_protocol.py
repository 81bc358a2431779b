"""The Allocator protocol, argument checks and as_allocator, for every built-in allocator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from onnxkv.alloc import (
    Allocator,
    AllocatorStats,
    ArenaAllocator,
    Buffer,
    OutOfMemory,
    SlabAllocator,
    SystemAllocator,
    as_allocator,
    check_allocator,
)
from onnxkv.errors import OnnxkvError


def make_system() -> SystemAllocator:
    return SystemAllocator()


def make_arena() -> ArenaAllocator:
    return ArenaAllocator(1 << 16)


def make_slab() -> SlabAllocator:
    return SlabAllocator(1 << 16)


@pytest.fixture(params=[make_system, make_arena, make_slab], ids=["system", "arena", "slab"])
def allocator(request) -> Allocator:
    return request.param()


class CountingAllocator:
    """A user-defined allocator: delegates to SystemAllocator and counts calls."""

    def __init__(self) -> None:
        self.inner = SystemAllocator()
        self.calls = 0

    def allocate(self, nbytes: int, alignment: int = 64) -> Buffer:
        self.calls += 1
        return self.inner.allocate(nbytes, alignment)

    def free(self, buffer: Buffer) -> None:
        self.inner.free(buffer)

    def stats(self) -> AllocatorStats:
        return self.inner.stats()


def test_builtins_satisfy_protocols(allocator):
    buf = allocator.allocate(16)
    assert isinstance(allocator, Allocator)
    assert isinstance(buf, Buffer)
    assert isinstance(allocator.stats(), AllocatorStats)
    allocator.free(buf)


def test_out_of_memory_is_a_memory_error():
    assert issubclass(OutOfMemory, MemoryError)
    assert issubclass(OutOfMemory, OnnxkvError)


def test_stats_is_frozen():
    stats = SystemAllocator().stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.live = 3  # type: ignore[misc]


def test_as_allocator_none_gives_fresh_system_allocator():
    first, second = as_allocator(None), as_allocator(None)
    assert isinstance(first, SystemAllocator)
    assert first is not second


def test_as_allocator_passes_builtins_and_user_objects(allocator):
    assert as_allocator(allocator) is allocator
    user = CountingAllocator()
    assert as_allocator(user) is user
    assert check_allocator(user) is user
    assert isinstance(user, Allocator)
    buf = as_allocator(user).allocate(32)
    buf.view(np.uint8, 32)[:] = 7
    user.free(buf)
    assert user.calls == 1
    assert user.stats().frees == 1


def test_as_allocator_rejects_non_allocators_naming_what_is_missing():
    with pytest.raises(TypeError, match="allocate, free, stats"):
        as_allocator(object())

    class NoFree:
        def allocate(self, nbytes, alignment=64): ...

        def stats(self): ...

    with pytest.raises(TypeError, match=r"NoFree.*missing callable free$"):
        as_allocator(NoFree())

    class StatsNotCallable(NoFree):
        free = None
        stats = 3

    with pytest.raises(TypeError, match="free, stats"):
        check_allocator(StatsNotCallable())


@pytest.mark.parametrize("nbytes", [-1, -(1 << 70)])
def test_negative_nbytes(allocator, nbytes):
    with pytest.raises(ValueError, match="nbytes"):
        allocator.allocate(nbytes)


@pytest.mark.parametrize("nbytes", [1.0, "8", None, True])
def test_non_int_nbytes(allocator, nbytes):
    with pytest.raises(TypeError, match="nbytes"):
        allocator.allocate(nbytes)


@pytest.mark.parametrize("alignment", [0, -64, 3, 48, 100])
def test_alignment_must_be_power_of_two(allocator, alignment):
    with pytest.raises(ValueError, match="alignment"):
        allocator.allocate(8, alignment)


@pytest.mark.parametrize("alignment", [64.0, "64", False])
def test_alignment_must_be_int(allocator, alignment):
    with pytest.raises(TypeError, match="alignment"):
        allocator.allocate(8, alignment)


def test_numpy_integers_accepted(allocator):
    buf = allocator.allocate(np.int64(40), np.uint32(128))
    assert buf.nbytes == 40
    assert buf.address % 128 == 0
    allocator.free(buf)


def test_failed_checks_change_nothing(allocator):
    before = allocator.stats()
    for bad in (-1, 1.5):
        with pytest.raises((TypeError, ValueError)):
            allocator.allocate(bad)
    assert allocator.stats() == before


def test_zero_bytes_is_a_valid_empty_buffer(allocator):
    buf = allocator.allocate(0)
    assert buf.nbytes == 0
    assert buf.address % 64 == 0
    assert buf.view(np.float32, 0).shape == (0,)
    assert buf.view(np.float32, (3, 0)).shape == (3, 0)
    with pytest.raises(ValueError):
        buf.view(np.uint8, 1)
    allocator.free(buf)
    assert allocator.stats().frees == 1


def test_view_contract(allocator):
    buf = allocator.allocate(100)
    v = buf.view(np.float32, (5, 5))
    assert v.shape == (5, 5) and v.dtype == np.float32
    assert v.flags.c_contiguous and v.flags.writeable
    assert v.__array_interface__["data"][0] == buf.address
    assert buf.view(np.uint8, [4, 25]).shape == (4, 25)
    assert buf.view("f8", 12).shape == (12,)  # a prefix of the bytes is fine
    v[:] = 2.5
    assert np.all(buf.view(np.float32, 25) == 2.5)  # no copy
    with pytest.raises(ValueError, match="needs 104 bytes"):
        buf.view(np.float32, 26)
    with pytest.raises(ValueError):
        buf.view(np.uint8, (-1, 4))
    with pytest.raises(TypeError):
        buf.view(object, 1)
    with pytest.raises(TypeError):
        buf.view(np.uint8, 2.0)
    allocator.free(buf)


def test_view_after_free_raises(allocator):
    buf = allocator.allocate(64)
    allocator.free(buf)
    with pytest.raises(ValueError, match="freed"):
        buf.view(np.uint8, 8)
    with pytest.raises(ValueError, match="freed"):
        _ = buf.address


def test_double_free_names_the_allocator(allocator):
    buf = allocator.allocate(64)
    allocator.free(buf)
    before = allocator.stats()
    with pytest.raises(ValueError, match="double free") as info:
        allocator.free(buf)
    assert repr(allocator) in str(info.value)
    assert allocator.stats() == before


@pytest.mark.parametrize("other", [make_system, make_arena, make_slab], ids=["from-system", "from-arena", "from-slab"])
def test_foreign_buffer_names_the_allocator(allocator, other):
    foreign = other().allocate(64)
    mine = allocator.allocate(64)
    before = allocator.stats()
    with pytest.raises(ValueError, match="foreign buffer") as info:
        allocator.free(foreign)
    assert repr(allocator) in str(info.value)
    with pytest.raises(ValueError, match="foreign buffer"):
        allocator.free("not a buffer")  # type: ignore[arg-type]
    assert allocator.stats() == before
    allocator.free(mine)
