"""A paged state that owns its page allocator gives its empty chunks to the process's chunk reserve when it
closes: the next state takes them (no page faults of fresh memory) and computes the same values; pages a
fork still holds stay with it."""

from __future__ import annotations

import numpy as np
import pytest
from state_steps import last_logits, step_feeds

import onnxkv
from onnxkv import CacheConfig
from onnxkv.alloc import SlabAllocator
from onnxkv.alloc.chunk_reserve import chunk_reserve_stats, set_chunk_reserve_limit
from onnxkv.zoo.builders import MICRO, build_model

PAGED = CacheConfig("paged", block_size=4)


@pytest.fixture(scope="module")
def session():
    return onnxkv.Session(build_model("gqa", MICRO, seed=5), threads=1)


@pytest.fixture
def reserve():
    """An empty reserve for the test, the process's bound restored after it."""
    old = set_chunk_reserve_limit(0)
    set_chunk_reserve_limit(64 << 20)
    yield
    set_chunk_reserve_limit(0)
    set_chunk_reserve_limit(old)


def logits_of(state, feeds: list[dict]) -> list[np.ndarray]:
    return [last_logits(state, f) for f in feeds]


def test_a_closed_state_hands_its_chunks_to_the_next(session, reserve):
    feeds = step_feeds(session, 40, 6)  # pages of 4 tokens: past each plane's small first chunk
    first = session.new_state(cache=PAGED)
    expected = logits_of(first, feeds)
    planes = len(first.pool.planes)
    first.close()
    assert first.allocator.stats().committed == 0  # every chunk released at close
    held = chunk_reserve_stats().held_bytes
    assert held > 0
    with session.new_state(cache=PAGED) as second:
        got = logits_of(second, feeds)
        assert second.allocator.reused_chunks >= planes  # each plane's chunks came from the reserve
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a, b)


def test_pages_a_fork_holds_stay_when_the_original_closes(session, reserve):
    feeds = step_feeds(session, 40, 4)
    with session.new_state(cache=PAGED) as ref:
        expected = logits_of(ref, feeds)
    original = session.new_state(cache=PAGED)
    logits_of(original, feeds[:2])
    (fork,) = original.fork()
    original.close()  # the fork's pages are still leased: only empty chunks leave
    assert original.allocator.stats().live > 0
    other = session.new_state(cache=PAGED)  # may take the released chunks; must not disturb the fork
    logits_of(other, feeds)
    got = logits_of(fork, feeds[2:])
    for a, b in zip(expected[2:], got, strict=True):
        np.testing.assert_array_equal(a, b)
    fork.close()
    other.close()


def test_a_callers_allocator_is_not_trimmed(session, reserve):
    slab = SlabAllocator()
    feeds = step_feeds(session, 40, 2)
    with session.new_state(cache=CacheConfig("paged", block_size=4), allocator=slab) as st:
        logits_of(st, feeds)
    assert slab.chunk_count > 0  # its spares stay the caller's
    assert chunk_reserve_stats().held_bytes == 0


def test_generate_on_pages_reuses_chunks(session, reserve):
    prompt = np.arange(1, 30)[None] % session.model.vocab_size
    a = onnxkv.generate(session, prompt, max_new_tokens=5, cache="paged")
    hits = chunk_reserve_stats().hits
    b = onnxkv.generate(session, prompt, max_new_tokens=5, cache="paged")
    assert chunk_reserve_stats().hits > hits
    np.testing.assert_array_equal(a.sequences, b.sequences)
