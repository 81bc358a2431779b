"""State.quantize_pages to the plane's native format: a no-op on native pages, a proper native page again for
converted ones (values, save_cache / load_cache, copy-on-write and attention all read it)."""

from __future__ import annotations

import numpy as np
import pytest
from state_steps import assert_same_values, last_logits, step_feeds, values_copy

import onnxkv
from onnxkv import CacheConfig
from onnxkv.zoo.builders import MICRO, build_model

BS = 4


@pytest.fixture(scope="module")
def session():
    return onnxkv.Session(build_model("gqa", MICRO, seed=9), threads=1)


def _all_native(state) -> None:
    pool, t = state.pool, state.page_tables
    ids = t[t >= 0]
    for i, spec in enumerate(pool.planes):
        assert pool.converted[i] == 0 and not any(pool.quantized(i, int(p)) for p in ids)
        for p in ids.tolist():
            assert pool.pages[i][p].shape == (spec.heads, BS, spec.head_size) and pool.pages[i][p].dtype == spec.dtype
            assert pool.sizes[i][p] == spec.page_bytes(BS)
    pool.audit()


@pytest.mark.parametrize("cache_dtype", [None, "float16"])
def test_native_pages_converted_to_their_own_format_stay_as_they_are(session, cache_dtype):
    feeds = step_feeds(session, 9, 2)
    native = cache_dtype or "float32"
    config = CacheConfig("paged", block_size=BS, kv_format={None: None, "float16": "fp16"}[cache_dtype])
    with session.new_state(cache=config) as ref, session.new_state(cache=config) as st:
        want = [last_logits(ref, f) for f in feeds]
        last_logits(st, feeds[0])
        before, saved = values_copy(st), st.save_cache()
        ptrs = [p.copy() for p in st.pool.ptrs]
        allocations = st.allocator.stats().allocations
        st.quantize_pages([0, 1], native, native)
        assert st.allocator.stats().allocations == allocations  # nothing allocated
        for a, b in zip(st.pool.ptrs, ptrs):
            np.testing.assert_array_equal(a, b)
        _all_native(st)
        assert_same_values(values_copy(st), before)
        assert st.save_cache() == saved
        for f, w in zip(feeds[1:], want[1:]):
            np.testing.assert_array_equal(last_logits(st, f), w)


@pytest.mark.parametrize("fmt", ["int8", "int4", "float16"])
def test_converted_pages_become_native_pages_again(session, fmt):
    feeds = step_feeds(session, 9, 2)
    with (
        session.new_state(cache=CacheConfig("paged", block_size=BS)) as quantized,
        session.new_state(cache=CacheConfig("paged", block_size=BS)) as st,
    ):
        for s in (quantized, st):
            last_logits(s, feeds[0])
            s.quantize_pages([0, 1], fmt, fmt)
        held = values_copy(st)  # the dequantized values the pages hold
        assert st.pool.converted == [2] * len(st.pool.planes)
        st.quantize_pages([0, 1], "float32", "float32")
        _all_native(st)
        assert_same_values(values_copy(st), held)
        restored = session.new_state(cache=CacheConfig("paged", block_size=BS))
        restored.load_cache(st.save_cache())  # save / load read and write the native pages
        _all_native(restored)
        assert_same_values(values_copy(restored), held)
        fork = st.fork()[0]
        fork.truncate(6)  # the fork's next write lands in shared block 1: copy on write reads it
        cow = values_copy(fork)
        steps = [feeds[1], feeds[2]]
        for s in (quantized, st, restored):  # attention reads the converted-back pages like the quantized ones
            got = [last_logits(s, f) for f in steps]
            if s is quantized:
                want = got
            else:
                np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        last_logits(fork, step_feeds(session, 6, 1)[1])  # a step at position 6
        for k, v in values_copy(fork).items():
            np.testing.assert_array_equal(v[:, :, :6], cow[k])
        assert st.pool.refcount(int(st.page_tables[0, 1])) == 1  # the fork has its own copy now
        for s in (fork, restored):
            s.close()
        st.pool.audit()
