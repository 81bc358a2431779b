"""Feeds bound to a run's graph inputs (onnxkv.plan.inputs): strided feeds copied C-contiguous, and one whose
copy cannot be allocated refused with OutOfMemory before anything runs."""

from __future__ import annotations

import numpy as np
import pytest

import onnxkv
from onnxkv import CacheConfig
from onnxkv.errors import OutOfMemory
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.zoo.builders import TINY, build_model


@pytest.fixture(scope="module")
def session():
    return onnxkv.Session(build_model("gqa", TINY, seed=1), threads=1)


def _state(session, cache):
    st = session.new_state(cache=cache)
    b = FeedBuilder(session.plan.inputs, session.model, np.arange(1, 4)[None], np.array([3]), 0, thread_cache=False)
    feeds, _ = b.first()
    st.run(feeds, [])
    return st, b


def test_a_strided_feed_runs_as_its_contiguous_copy(session):
    st, b = _state(session, "contiguous")
    other, _ = _state(session, "contiguous")
    feeds = b.next(np.array([[5]]), None)
    strided = {k: np.repeat(v, 2, axis=-1)[..., ::2] for k, v in feeds.items()}
    assert not all(v.flags.c_contiguous for v in strided.values() if v.size > 1)
    name = session.model.io.logits
    np.testing.assert_array_equal(st.run(strided, [name])[name], other.run(feeds, [name])[name])


@pytest.mark.parametrize("cache", [CacheConfig("paged", block_size=4, max_pages=8), CacheConfig(capacity=64)])
def test_a_strided_feed_too_large_to_copy_is_refused_with_out_of_memory(session, cache):
    """A zero-stride broadcast of 2**36 mask columns costs no memory, its contiguous copy 512 GiB: NumPy's
    MemoryError escaped before any check (found by a fuzzing helper).  Now OutOfMemory names the input, and
    the state is as it was."""
    st, b = _state(session, cache)
    io = session.model.io
    feeds = {io.input_ids: np.array([[5]]), io.attention_mask: np.broadcast_to(np.int64(1), (1, 2**36))}
    with pytest.raises(OutOfMemory, match="input 'attention_mask' of shape \\(1, 68719476736\\) .* not C-contiguous"):
        st.run(feeds, [])
    assert st.lengths.tolist() == [3]
    st.run(b.next(np.array([[5]]), None), [])
    assert st.lengths.tolist() == [4]
