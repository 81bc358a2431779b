"""Attention (opset 23) in a state whose rows wrote different numbers of positions (a batch of requests):
with an attn_mask that hides the positions a row never wrote, each row's new keys are stored after its own
and it attends over its own keys, as the row alone; a mask that shows them is refused before anything is
written.  ragged_mask against a direct construction on random masks."""

from __future__ import annotations

import numpy as np
import pytest

import onnxkv
from onnxkv.errors import InputError
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.plan.ops.attention_onnx import ragged_mask
from onnxkv.plan.ops.masked_attention import MASKED
from onnxkv.zoo.attention23 import build_attention_model
from onnxkv.zoo.builders import TINY, build_model

PAGED = onnxkv.CacheConfig("paged", block_size=4)


def _direct(mask: np.ndarray, written: np.ndarray, past: int, s: int) -> np.ndarray:
    """Row by row: the row's written columns, then its new ones; hidden beyond (the reference)."""
    b, total = written.size, past + s
    m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    hidden = False if m.dtype == np.bool_ else -np.inf
    full = np.full(m.shape[:3] + (total,), hidden, m.dtype)
    full[..., : m.shape[3]] = m
    full = np.broadcast_to(full, (b,) + full.shape[1:])
    width = int(written.max()) + s
    out = np.full(full.shape[:3] + (width,), hidden, m.dtype)
    for r, w in enumerate(written.tolist()):
        out[r, ..., :w] = full[r, ..., :w]
        out[r, ..., w : w + s] = full[r, ..., past:total]
    return out


@pytest.mark.parametrize("dtype", [np.bool_, np.float32])
@pytest.mark.parametrize("shape", ["b1st", "bhst", "11st", "b11t", "st", "short"])
@pytest.mark.parametrize("s", [1, 3])
def test_ragged_mask_equals_the_row_by_row_construction(dtype, shape, s):
    rng = np.random.default_rng(hash((shape, s)) % 2**32)
    b, h, past = 3, 2, 9
    written = np.array([9, 4, 6]) if shape not in ("11st", "st") else np.array([9, 9, 9])
    total = past + s
    dims = {"b1st": (b, 1, s, total), "bhst": (b, h, s, total), "11st": (1, 1, s, total), "b11t": (b, 1, 1, total),
            "st": (s, total), "short": (b, 1, s, total - 1)}[shape]  # fmt: skip
    visible = rng.random(dims) < 0.7
    cols = np.arange(dims[-1])
    gap = (cols >= written.reshape((-1,) + (1,) * (len(dims) - 1))) & (cols < past) if dims[0] == b else cols < 0
    visible &= ~gap
    mask = visible if dtype == np.bool_ else np.where(visible, rng.standard_normal(dims) * 0, -np.inf).astype(dtype)
    got = ragged_mask(mask, written, past, s)
    assert got is not None
    out, width = got
    assert width == int(written.max()) + s
    np.testing.assert_array_equal(out, _direct(mask, written, past, s))


def test_ragged_mask_refuses_a_mask_that_shows_an_unwritten_position():
    written = np.array([5, 3])
    mask = np.ones((2, 1, 1, 6), bool)
    assert ragged_mask(mask, written, 5, 1) is None  # row 1 sees positions 3 and 4
    mask[1, ..., 3:5] = False
    assert ragged_mask(mask, written, 5, 1) is not None
    fmask = np.where(mask, 0.0, -1e9).astype(np.float32)  # a finite bias is not hidden
    assert ragged_mask(fmask, written, 5, 1) is None
    fmask = np.where(mask, 0.0, MASKED).astype(np.float32)
    assert ragged_mask(fmask, written, 5, 1) is not None
    assert ragged_mask(None, written, 5, 1) is None
    assert ragged_mask(np.ones((2, 1, 1, 7), bool), written, 5, 1) is None  # wider than the keys


@pytest.fixture(scope="module", params=[1, 2], ids=["1thread", "2threads"])
def session(request):
    return onnxkv.Session(build_model("attention", TINY, seed=5), threads=request.param, events=True)


def _prompt(session, ids: np.ndarray, state=None):
    """``state`` (default: a new paged state) after one run of ``ids``; the state and its builder."""
    state = session.new_state(cache=PAGED) if state is None else state
    builder = FeedBuilder(session.plan.inputs, session.model, ids[None], np.array([ids.size]), 0, thread_cache=False)
    feeds, _ = builder.first()
    state.run(feeds, [])
    return state, builder


def test_rows_of_different_lengths_decode_as_each_row_alone(session):
    rng = np.random.default_rng(session.threads)
    prompts = [rng.integers(3, TINY.vocab_size, n) for n in (7, 13, 2)]
    alone = [_prompt(session, p) for p in prompts]
    batch = session.new_state(cache=PAGED).sibling()
    for p in prompts:  # each prompt's rows again, on states of one pool, moved into one state
        st, builder = _prompt(session, p, batch.sibling())
        batch.append_rows(st)
    name = session.model.io.logits
    tokens = [[int(p[-1])] for p in prompts]
    session.events.clear()
    for _ in range(6):  # decode steps: every row at its own length in one run
        lengths = batch.lengths.copy()
        out = batch.run(builder.ragged(np.array([t[-1] for t in tokens]), lengths), [name])[name]
        assert batch.lengths.tolist() == (lengths + 1).tolist()
        for r, (st, b) in enumerate(alone):
            own = st.run(b.next(np.array([[tokens[r][-1]]]), None), [name])[name]
            np.testing.assert_allclose(out[r, -1], own[0, -1], rtol=1e-5, atol=1e-5)
            tokens[r].append(int(np.argmax(own[0, -1])))
    assert sum(e.prefix_copied_bytes for e in session.events) == 0  # the paged kernel, no gathered past
    for r, (st, _) in enumerate(alone):
        for key, arr in st.values.items():
            np.testing.assert_allclose(batch.values[key][r, :, : st.length], arr[0], rtol=1e-6, atol=1e-6)
    batch.pool.audit()


def test_a_mask_showing_unwritten_positions_is_refused_and_changes_nothing(session):
    prompts = [np.arange(3, 12), np.arange(3, 8)]
    batch = session.new_state(cache=PAGED).sibling()
    for p in prompts:
        st, builder = _prompt(session, p, batch.sibling())
        batch.append_rows(st)
    before = {k: v.copy() for k, v in batch.values.items()}
    live = batch.pool.live_pages
    feeds = builder.ragged(np.array([4, 5]), batch.lengths)
    feeds["attention_mask"] = np.ones_like(feeds["attention_mask"])  # row 1 would see positions 5..8
    with pytest.raises(InputError, match="row 1 claims a past of 9 positions .* but has written only 5"):
        batch.run(feeds, [])
    assert batch.lengths.tolist() == [9, 5] and batch.pool.live_pages == live
    for k, v in batch.values.items():
        np.testing.assert_array_equal(v, before[k])
    batch.pool.audit()


def test_ragged_mask_drops_padded_gaps_whatever_the_mask_holds_there():
    """``padding`` (State.run(gaps_padding=True)): the feeds padded the positions a row never wrote, so they
    are dropped even where the graph's mask holds a finite bias or shows them."""
    written = np.array([5, 3])
    mask = np.ones((2, 1, 1, 6), bool)
    mask[1, ..., 3:5] = False
    fmask = np.where(mask, 0.0, -1e9).astype(np.float32)
    for m in (fmask, np.ones((2, 1, 1, 6), bool)):
        assert ragged_mask(m, written, 5, 1) is None
        out, width = ragged_mask(m, written, 5, 1, padding=True)
        assert width == 6
        np.testing.assert_array_equal(out, _direct(m, written, 5, 1))
    assert ragged_mask(None, written, 5, 1, padding=True) is None


def _feeds(session, ids: np.ndarray) -> dict:
    """The first run's feeds of the prompt ``ids`` on a state."""
    return FeedBuilder(
        session.plan.inputs, session.model, ids[None], np.array([ids.size]), 0, thread_cache=False
    ).first()[0]


def _two_rows(session, lengths=(9, 5)):
    """A paged state of two rows of ``lengths`` (prompts run apart, rows moved into one state) and the
    builder of the last prompt."""
    batch = session.new_state(cache=PAGED).sibling()
    for n in lengths:
        st, builder = _prompt(session, np.arange(3, 3 + n), batch.sibling())
        batch.append_rows(st)
    return batch, builder


@pytest.fixture(scope="module")
def biased():
    """The builder's Attention graph hiding keys with the finite bias -1e9 (a float attn_mask)."""
    return onnxkv.Session(build_attention_model(TINY, seed=5, mask_bias=-1e9), threads=1, events=True)


def test_a_finite_bias_mask_decodes_rows_of_different_lengths_with_padded_gaps(biased):
    """Without gaps_padding the gap a finite bias "hides" counts as shown: refused, nothing changed.  With it,
    each row decodes as the row alone (whose mask over its own keys is all 0: the streaming kernel)."""
    prompts = [np.arange(3, 12), np.arange(3, 8)]
    batch, builder = _two_rows(biased)
    alone = [_prompt(biased, p) for p in prompts]
    before = {k: v.copy() for k, v in batch.values.items()}
    feeds = builder.ragged(np.array([4, 5]), batch.lengths)
    with pytest.raises(InputError, match="row 1 claims a past of 9 positions .* but has written only 5"):
        batch.run(feeds, [])
    assert batch.lengths.tolist() == [9, 5]
    for k, v in batch.values.items():
        np.testing.assert_array_equal(v, before[k])
    name = biased.model.io.logits
    out = batch.run(feeds, [name], gaps_padding=True)[name]
    assert batch.lengths.tolist() == [10, 6]
    for r, (st, b) in enumerate(alone):
        own = st.run(b.next(np.array([[(4, 5)[r]]]), None), [name])[name]
        np.testing.assert_array_equal(out[r, -1], own[0, -1])
    batch.pool.audit()


def test_gaps_padding_is_a_bool_on_a_paged_state(biased):
    batch, builder = _two_rows(biased)
    feeds = builder.ragged(np.array([4, 5]), batch.lengths)
    with pytest.raises(InputError, match="gaps_padding must be a bool, True only on a paged state, got 1"):
        batch.run(feeds, [], gaps_padding=1)
    contiguous = biased.new_state(cache="contiguous")
    with pytest.raises(InputError, match="gaps_padding must be a bool, True only on a paged state, got True"):
        contiguous.run(_feeds(biased, np.array([3, 4])), [], gaps_padding=True)
    assert batch.lengths.tolist() == [9, 5] and contiguous.length == 0
