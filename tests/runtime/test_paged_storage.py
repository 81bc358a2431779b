"""Where a paged state's pages live: slab storage by default (one lane per plane), an explicit allocator
when given, adjacent pages per plane, and every slot returned by every operation."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

import onnxkv
from onnxkv import CacheConfig
from onnxkv.alloc import ArenaAllocator, SlabAllocator, SlabLane, SystemAllocator
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.zoo.builders import MICRO, build_model

BS = 4
PAGE = MICRO.num_kv_heads * BS * (MICRO.hidden_size // MICRO.num_heads) * 4  # one float32 page of one plane


@pytest.fixture(scope="module")
def gqa():
    return onnxkv.Session(build_model("gqa", MICRO, seed=11), threads=1, events=True)


def _decode(session, state, prompt, steps, rng):
    """Prefill ``prompt`` [B, S], then ``steps`` random tokens per row; returns the feed builder and outputs."""
    b = FeedBuilder(
        session.plan.inputs, session.model, prompt, np.full(prompt.shape[0], prompt.shape[1]), 0, thread_cache=False
    )
    feeds, _ = b.first()
    out = state.run(feeds, ["logits"])
    for _ in range(steps):
        out = state.run(b.next(rng.integers(0, MICRO.vocab_size, prompt.shape[0]), out), ["logits"])
    return b, out


def test_paged_state_uses_slab_lanes_by_default(gqa):
    rng = np.random.default_rng(0)
    with gqa.new_state(cache=CacheConfig("paged", block_size=BS)) as st:
        slab = st.allocator
        assert isinstance(slab, SlabAllocator) and st.pool.allocator is slab
        assert all(
            isinstance(a, SlabLane) and a.parent is slab and a.index == i for i, a in enumerate(st.pool.allocators)
        )
        assert len(st.pool.allocators) == 2 * MICRO.num_layers
        _decode(gqa, st, rng.integers(0, MICRO.vocab_size, (2, 9)), 5, rng)
        s = slab.stats()
        assert s.live == st.pool.committed_bytes == st.committed_bytes > 0  # 512-byte pages: slot == page
        assert s.committed == 2 * MICRO.num_layers * slab.first_chunk_bytes  # one small first chunk per lane
        writes = [e for e in gqa.events if e.action == "cache_write"]
        assert writes and max(e.live for e in writes) <= s.peak  # the event log reports the slab's figures
    assert slab.stats().live == 0
    with gqa.new_state() as contiguous:
        assert isinstance(contiguous.allocator, SystemAllocator)


@pytest.mark.parametrize("make", [lambda: ArenaAllocator(1 << 20), SystemAllocator], ids=["arena", "system"])
def test_an_explicit_allocator_serves_every_plane(gqa, make):
    rng = np.random.default_rng(1)
    alloc = make()
    with gqa.new_state(allocator=alloc, cache=CacheConfig("paged", block_size=BS)) as st:
        assert st.allocator is alloc and st.pool.allocator is alloc
        assert all(a is alloc for a in st.pool.allocators)
        _decode(gqa, st, rng.integers(0, MICRO.vocab_size, (1, 6)), 3, rng)
        assert alloc.stats().live == st.committed_bytes > 0
    assert alloc.stats().live == 0


def test_an_explicit_slab_allocator_gets_one_lane_per_plane(gqa):
    rng = np.random.default_rng(2)
    slab = SlabAllocator(1 << 16, huge_pages=False)
    with gqa.new_state(allocator=slab, cache=CacheConfig("paged", block_size=BS)) as st:
        assert st.allocator is slab and [a.index for a in st.pool.allocators] == list(range(2 * MICRO.num_layers))
        _decode(gqa, st, rng.integers(0, MICRO.vocab_size, (1, 10)), 2, rng)
        assert slab.stats().live == st.committed_bytes
        firsts = [int(st.pool.ptrs[i][st.page_tables[0, 0]]) for i in range(len(st.pool.planes))]
        assert all(a % (1 << 16) == 0 for a in firsts) and len(set(firsts)) == len(firsts)  # a chunk per plane
    assert slab.stats().live == 0


@pytest.mark.parametrize("prompt_len, steps", [(1, 30), (13, 19), (32, 0)])
def test_successive_pages_of_a_plane_are_adjacent(gqa, prompt_len, steps):
    rng = np.random.default_rng(prompt_len)
    with gqa.new_state(cache=CacheConfig("paged", block_size=BS)) as st:
        _decode(gqa, st, rng.integers(0, MICRO.vocab_size, (1, prompt_len)), steps, rng)
        table = st.page_tables[0]
        blocks = -(-(prompt_len + steps) // BS)
        assert (table[:blocks] >= 0).all()
        for plane in range(len(st.pool.planes)):
            addresses = st.pool.ptrs[plane][table[:blocks]].astype(np.int64)
            assert all(b - a == PAGE for a, b in pairwise(addresses.tolist())), (plane, addresses)


def test_batch_rows_interleave_page_ids_but_each_plane_stays_in_its_lane(gqa):
    rng = np.random.default_rng(3)
    with gqa.new_state(cache=CacheConfig("paged", block_size=BS)) as st:
        _decode(gqa, st, rng.integers(0, MICRO.vocab_size, (3, 8)), 6, rng)
        pool, table = st.pool, st.page_tables
        chunk = st.allocator.chunk_bytes
        for plane in range(len(pool.planes)):
            addresses = pool.ptrs[plane][table[table >= 0]].astype(np.int64)
            assert len({a - a % chunk for a in addresses.tolist()}) == 1  # one chunk per plane
            spans = np.sort(addresses)
            assert (np.diff(spans) == PAGE).all()  # the plane's pages fill its chunk without holes


def test_every_operation_returns_its_slots(gqa):
    rng = np.random.default_rng(4)
    st = gqa.new_state(cache=CacheConfig("paged", block_size=BS))
    slab = st.allocator
    b, out = _decode(gqa, st, rng.integers(0, MICRO.vocab_size, (1, 17)), 2, rng)
    cp = st.checkpoint()
    forks = st.fork(2)
    feeds = b.next(rng.integers(0, MICRO.vocab_size, 1), out)
    for f in forks:  # copy-on-write: each fork's first write copies the shared partial page
        f.run(feeds, ["logits"])
    st.quantize_pages([0, 2], "int8", "int4")  # shared with the forks and the checkpoint: copied, then converted
    assert slab.stats().live >= st.pool.committed_bytes  # slots of quantized pages are rounded up
    st.truncate(9)
    forks[0].reset()
    forks[1].close()
    saved = st.save_cache()
    cp.release()
    st.reset()
    st.load_cache(saved)  # restored pages (quantized ones too) come from the lanes again
    assert st.length == 9 and slab.stats().live >= st.committed_bytes > 0
    st.restore(st.checkpoint())
    st.close()
    forks[0].close()
    s = slab.stats()
    assert s.live == 0 and s.allocations == s.frees > 0
    assert st.pool.live_pages == 0
    # what stays mapped: a small first chunk per lane and page size (float32, int8, int4), the spares
    assert s.committed == slab.chunk_count * slab.first_chunk_bytes <= 3 * len(st.pool.planes) * slab.first_chunk_bytes
