"""BlockPool storage: slab lanes by default, one lane per plane for native and converted payloads."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from onnxkv.alloc import ArenaAllocator, SlabAllocator
from onnxkv.cache import formats
from onnxkv.cache.paged import BlockPool, PlaneSpec

H, D, BS = 2, 32, 8
NATIVE = H * BS * D * 4


def _pool(allocator=None, planes=3):
    return BlockPool([PlaneSpec(f"p{i}", H, D, "float32") for i in range(planes)], BS, allocator)


def _fill(pool, ids, rng):
    for i in range(len(pool.planes)):
        for p in ids.tolist():
            pool.pages[i][p][...] = rng.standard_normal((H, BS, D)).astype(np.float32)


def test_default_pool_allocates_each_plane_from_its_own_lane():
    pool = _pool()
    assert isinstance(pool.allocator, SlabAllocator)
    assert [a.index for a in pool.allocators] == [0, 1, 2]
    ids = np.concatenate([pool.allocate(3), pool.allocate(1), pool.allocate(4)])
    for i in range(3):
        addresses = pool.ptrs[i][ids].astype(np.int64).tolist()
        assert all(b - a == NATIVE for a, b in pairwise(addresses))  # allocation order = address order
    assert pool.allocator.stats().live == 8 * pool.page_bytes
    pool.decref(ids)
    assert pool.allocator.stats().live == 0


@pytest.mark.parametrize("fmt", ["int8", "int4", "float16"])
def test_converted_payloads_stay_in_their_plane_lane_and_are_adjacent(fmt):
    rng = np.random.default_rng(5)
    pool = _pool()
    ids = pool.allocate(6)
    _fill(pool, ids, rng)
    want = [pool.read_page(1, p, BS) for p in ids.tolist()]
    for p in ids.tolist():
        pool.convert_page(1, p, fmt, BS)
    nbytes = formats.page_bytes(formats.page_format(fmt), H, BS, D, 1, formats.HEADER_FLOAT32)
    slot = -(-nbytes // 64) * 64
    addresses = pool.ptrs[1][ids].astype(np.int64).tolist()
    assert all(b - a == slot for a, b in pairwise(addresses))
    native = pool.ptrs[0][ids].astype(np.int64).tolist()
    assert not any(min(native) <= a < max(native) + NATIVE for a in addresses)  # not among plane 0's pages
    for p, w in zip(ids.tolist(), want):
        tol = {"int8": 0.05, "int4": 0.6, "float16": 2e-3}[fmt]
        np.testing.assert_allclose(pool.read_page(1, p, BS), w, atol=tol)
    assert pool.allocator.stats().live == 6 * (2 * NATIVE + slot)
    pool.decref(ids)
    assert pool.allocator.stats().live == 0


def test_explicit_allocator_serves_every_plane():
    arena = ArenaAllocator(1 << 20)
    pool = _pool(arena)
    assert pool.allocator is arena and all(a is arena for a in pool.allocators)
    ids = pool.allocate(2)
    addresses = sorted(int(pool.ptrs[i][p]) for i in range(3) for p in ids.tolist())
    assert all(b - a == NATIVE for a, b in pairwise(addresses))  # planes interleaved in the one arena
    pool.decref(ids)
    assert arena.stats().live == 0
