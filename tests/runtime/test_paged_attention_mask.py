"""Paged states of the opset-23 ``Attention`` model read the pages directly, its attention mask included.

The builder model (``onnxkv.zoo.attention23``) feeds every Attention node a
boolean ``attn_mask`` (left padding and the causal band).  The mask's row
ranges go to the paged kernel as ``kv_start`` / ``q_pos``, so no step gathers
the past (``prefix_copied_bytes`` 0 in every ``cache_write`` event); a mask
that is not a set of row ranges still works, through a counted gathered copy.
"""

from __future__ import annotations

import numpy as np
import pytest

import onnxkv
from onnxkv import CacheConfig
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.zoo.builders import MICRO, build_model


@pytest.fixture(scope="module")
def attention():
    return onnxkv.Session(build_model("attention", MICRO, seed=8), threads=1, events=True)


def _decode(session, state, prompt, lengths, steps, tokens=None):
    """Greedy decode from a left-padded prompt; returns the last logits of every run and the per-run
    ``prefix_copied_bytes`` of the cache writes."""
    logits_name = session.model.io.logits
    b = FeedBuilder(session.plan.inputs, session.model, prompt, np.asarray(lengths), 0, thread_cache=False)
    feeds, _ = b.first()
    got, copied = [], []
    for step in range(steps + 1):
        session.events.clear()
        out = state.run(feeds, [logits_name])
        copied.append(sum(e.prefix_copied_bytes for e in session.events if e.action == "cache_write"))
        got.append(out[logits_name][:, -1].copy())
        nxt = np.argmax(got[-1], axis=-1) if tokens is None else tokens[step]
        feeds = b.next(np.asarray(nxt, np.int64), out)
    return got, copied


def test_mask_read_from_pages_without_gather(attention):
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, MICRO.vocab_size, (2, 7))
    lengths = [7, 4]  # row 1 left-padded by 3: its keys start at 3
    with attention.new_state() as ref, attention.new_state(cache=CacheConfig("paged", block_size=4)) as st:
        want, _ = _decode(attention, ref, prompt, lengths, 12)
        got, copied = _decode(attention, st, prompt, lengths, 12)
    assert copied == [0] * 13
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_mask_that_is_no_set_of_ranges_is_gathered_and_counted(attention):
    """A hole in the mask (a masked key between visible ones) takes the gathered path: counted, same logits."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, MICRO.vocab_size, (1, 6))
    logits_name = attention.model.io.logits
    outs, copied = [], []
    for cache in ("contiguous", "paged"):
        config = CacheConfig(cache, block_size=4) if cache == "paged" else CacheConfig(cache)
        with attention.new_state(cache=config) as st:
            b = FeedBuilder(attention.plan.inputs, attention.model, prompt, np.array([6]), 0, thread_cache=False)
            feeds, _ = b.first()
            out = st.run(feeds, [logits_name])
            feeds = b.next(np.array([5], np.int64), out)
            feeds[attention.model.io.attention_mask][0, 2] = 0  # key 2 hidden from the new token only
            attention.events.clear()
            outs.append(st.run(feeds, [logits_name])[logits_name])
            copied.append(sum(e.prefix_copied_bytes for e in attention.events if e.action == "cache_write"))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert copied[0] == 0
    layers, planes = MICRO.num_layers, 2
    assert copied[1] == layers * planes * MICRO.num_kv_heads * 7 * MICRO.head_size * 4
