"""FeedBuilder: the feeds of every step equal those made from the whole mask each step (the mask is
grown in place; rewinds, row selections and chunks keep it exact), and no feed aliases its storage."""

from __future__ import annotations

import numpy as np
import pytest

import onnxkv
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.zoo.builders import FAMILIES, MICRO, build_model


@pytest.fixture(scope="module", params=FAMILIES)
def session(request):
    return onnxkv.Session(build_model(request.param, MICRO, seed=5), threads=1)


class _Reference:
    """The mask bookkeeping a builder must match: the whole mask kept as one array, recomputed per step."""

    def __init__(self, builder: FeedBuilder) -> None:
        self.right = builder.right_padded
        self.mask = builder.mask.copy()

    def next(self, S: int) -> tuple[np.ndarray, np.ndarray]:
        B = self.mask.shape[0]
        steps = np.arange(S)[None, :]
        valid = self.mask.sum(axis=1)
        if self.right:
            self.mask = np.concatenate([self.mask, np.zeros((B, S), np.int64)], axis=1)
            self.mask[np.arange(B)[:, None], valid[:, None] + steps] = 1
        else:
            self.mask = np.concatenate([self.mask, np.ones((B, S), np.int64)], axis=1)
        return self.mask.copy(), valid[:, None] + steps


def _check(builder: FeedBuilder, ref: _Reference, feeds: dict, S: int) -> None:
    mask, pos = ref.next(S)
    np.testing.assert_array_equal(builder.mask, mask)
    io = builder.io
    if io.attention_mask and builder.kind != "tensor_scatter":
        np.testing.assert_array_equal(feeds[io.attention_mask], mask)
        assert feeds[io.attention_mask].flags.c_contiguous
        assert not np.shares_memory(feeds[io.attention_mask], builder._mbuf)
    if io.position_ids:
        np.testing.assert_array_equal(feeds[io.position_ids], pos)


@pytest.mark.parametrize("batch", [1, 3])
def test_steps_rewinds_and_row_selections_match_the_whole_mask(session, batch):
    rng = np.random.default_rng(batch)
    L = 6
    lengths = np.array([L, 4, 2][:batch])
    prompt = rng.integers(3, MICRO.vocab_size, size=(batch, L))
    builder = FeedBuilder(session.plan.inputs, session.model, prompt, lengths, 0, thread_cache=False)
    builder.first()
    ref = _Reference(builder)
    for i in range(45):  # past the first capacity (6 columns and 64 more): one growth
        S = 1 if batch > 1 else int(rng.integers(1, 3))
        tokens = rng.integers(3, MICRO.vocab_size, size=(batch, S))
        _check(builder, ref, builder.next(tokens, None), S)
        if i % 9 == 8 and batch == 1:  # speculative decoding's rollback
            back = builder.total - int(rng.integers(1, 3))
            builder.rewind(back)
            ref.mask = ref.mask[:, :back]
        if i == 30:  # beam search's reorder
            rows = rng.integers(0, batch, size=batch + 1)
            builder.select_rows(rows)
            ref.mask = ref.mask[rows]
    assert builder.total == ref.mask.shape[1]


def test_a_feed_is_unchanged_by_later_steps(session):
    prompt = np.array([[5, 6, 7, 8]])
    builder = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([4]), 0, thread_cache=False)
    builder.first()
    name = builder.io.attention_mask
    kept = builder.next(np.array([[9]]), None)[name]
    before = kept.copy()
    builder.rewind(3)
    builder.next(np.array([[9, 9, 9]]), None)
    np.testing.assert_array_equal(kept, before)
