"""onnxkv.cache.bound: the registry of storage bound to a state."""

import gc

import numpy as np
import pytest

import onnxkv
from onnxkv.cache import bound


@pytest.fixture(autouse=True)
def _no_gc_during_test():
    """Collections happen where the test says (gc.collect), not at a random allocation."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_a_registered_range_is_bound_until_unregistered():
    memory = np.zeros(4096, np.uint8)
    view = memory[1024:2048]
    bound.register(1, view)
    assert bound.is_bound(memory) and bound.is_bound(memory[2000:2100])
    assert not bound.is_bound(memory[:1024]) and not bound.is_bound(memory[2048:])
    bound.unregister(1)
    assert not bound.is_bound(memory)


def test_a_range_is_forgotten_when_its_array_is_collected():
    """A state dropped without close frees its memory with its arrays: the range must not stay bound, or
    an unrelated caller array allocated there later would be refused as a state's storage."""
    memory = np.zeros(4096, np.uint8)
    view = memory[1024:2048]
    bound.register(2, view)
    del view
    gc.collect()
    assert not bound.is_bound(memory)


def test_a_key_registered_again_keeps_its_new_range_when_the_old_array_is_collected():
    memory = np.zeros(4096, np.uint8)
    old, new = memory[:1024], memory[2048:3072]
    bound.register(3, old)
    bound.register(3, new)  # the same key (an id reused): replaces the range
    assert not bound.is_bound(memory[:1024])
    del old
    gc.collect()
    assert bound.is_bound(memory[2048:3072])
    bound.unregister(3)
    assert not bound.is_bound(memory)


def test_a_state_dropped_without_close_leaves_nothing_bound():
    from onnxkv.generate.feeds import FeedBuilder
    from onnxkv.zoo.builders import MICRO, build_model

    sess = onnxkv.Session(build_model("gqa", MICRO, seed=1), threads=1)
    state = sess.new_state(cache=onnxkv.CacheConfig("contiguous"))
    prompt = np.arange(5, dtype=np.int64)[None]
    feeds, _ = FeedBuilder(sess.plan.inputs, sess.model, prompt, np.array([5]), 0, thread_cache=False).first()
    state.run(feeds, [sess.model.io.logits])
    spans = [bound.byte_span(v) for v in state.values.values()]
    assert spans and all(_held(span) for span in spans)
    del state
    gc.collect()
    assert not any(_held(span) for span in spans)


def _held(span) -> bool:
    """Whether the registry holds a range overlapping ``span`` (the memory itself may be gone)."""
    lo, hi = span
    with bound._lock:
        bound._drop_collected()
        return any(lo < e and s < hi for s, e, _ in bound._ranges.values())
