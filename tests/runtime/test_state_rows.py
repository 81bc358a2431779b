"""Every row of a state attends only over what it wrote; memory of an earlier request is never readable.

A batch row's claimed past (``seqlens_k``, derived from ``attention_mask`` in
the builder model) is checked against what that row has written, not the
longest row's length, and new cache storage (contiguous buffers, growth,
pages) is zero-filled.  The same feeds then give bit-identical outputs
whatever another state sharing the allocator or page pool did before.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnxkv
from onnxkv import CacheConfig
from onnxkv.alloc import SlabAllocator, SystemAllocator
from onnxkv.alloc.protocol import AllocatorStats
from onnxkv.errors import InputError
from onnxkv.zoo.builders import MICRO, build_model

KINDS = ["contiguous", "paged"]


class RecyclingAllocator:
    """Hands a freed buffer of the same size back to the next request, bytes untouched (as a malloc may)."""

    def __init__(self) -> None:
        self.inner = SystemAllocator()
        self.spare: dict[int, list] = {}
        self.live: set[int] = set()

    def allocate(self, nbytes: int, alignment: int = 64):
        spare = self.spare.get(nbytes)
        buf = spare.pop() if spare else self.inner.allocate(nbytes, alignment)
        self.live.add(id(buf))
        return buf

    def free(self, buffer) -> None:
        if id(buffer) not in self.live:
            raise ValueError(f"{self!r}: buffer is not live")
        self.live.remove(id(buffer))
        self.spare.setdefault(buffer.nbytes, []).append(buffer)

    def stats(self) -> AllocatorStats:
        return self.inner.stats()


def _feeds(ids, mask) -> dict[str, np.ndarray]:
    return {"input_ids": np.asarray(ids, np.int64), "attention_mask": np.asarray(mask, np.int64)}


#: Batch of 2: a prompt of 3 tokens, then row 1 one token behind row 0 (its mask one shorter).
ROWS_APART = [
    _feeds([[1, 2, 3], [4, 5, 6]], np.ones((2, 3))),
    _feeds([[7], [8]], [[1, 1, 1, 1], [1, 1, 1, 0]]),  # row 1 rewrites position 2: it has written 3
    _feeds([[9], [10]], [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]),  # row 1 at position 3; row 0 at 4
]
#: After ROWS_APART, row 1 claims a past of 5 positions (seqlens_k = 5) after it has written 4.
OVER_CLAIM = _feeds([[11], [12]], np.ones((2, 6)))


def _smooth_softmax(model: onnx.ModelProto) -> onnx.ModelProto:
    """The builder's GroupQueryAttention model with smooth_softmax=1: its attention reads the whole
    [0, total_sequence_length) span of every row, masked."""
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            node.attribute.append(onnx.helper.make_attribute("smooth_softmax", 1))
    return model


@pytest.fixture(scope="module")
def gqa():
    return onnxkv.Session(build_model("gqa", MICRO, seed=4), threads=1)


@pytest.fixture(scope="module")
def gqa_smooth():
    return onnxkv.Session(_smooth_softmax(build_model("gqa", MICRO, seed=4)), threads=1)


def _state(session, kind: str, allocator):
    if kind == "paged":
        return session.new_state(allocator=allocator, cache=CacheConfig("paged", block_size=4))
    return session.new_state(allocator=allocator, cache=CacheConfig(initial_capacity=8))


def _pollute(session, kind: str, allocator) -> None:
    """A request whose cache holds NaN everywhere (its buffer / pages go back to ``allocator``)."""
    st = _state(session, kind, allocator)
    nan = np.full((2, MICRO.num_kv_heads, 8, MICRO.head_size), np.nan, np.float32)
    st.reset({name: nan for name in st.bound_inputs})
    st.close()


def _outputs(session, st) -> list[np.ndarray]:
    return [st.run(f)["logits"].copy() for f in ROWS_APART]


@pytest.mark.parametrize("kind", KINDS)
def test_same_feeds_same_outputs_whatever_ran_before(gqa_smooth, kind):
    """Rows of different lengths read the whole span up to the longest row (masked): positions a row never
    wrote must not hold another request's bytes (here NaN, which a mask cannot hide)."""
    allocator = RecyclingAllocator() if kind == "contiguous" else SlabAllocator()
    _pollute(gqa_smooth, kind, allocator)
    after = _outputs(gqa_smooth, _state(gqa_smooth, kind, allocator))
    fresh = _outputs(gqa_smooth, _state(gqa_smooth, kind, RecyclingAllocator()))
    for a, f in zip(after, fresh):
        assert np.isfinite(f).all()
        np.testing.assert_array_equal(a, f)


@pytest.mark.parametrize("kind", KINDS)
def test_paged_and_contiguous_share_pool_runs_identically(gqa, kind):
    """Two identical requests, the second after a different one on the same allocator, agree bit for bit."""
    allocator = RecyclingAllocator() if kind == "contiguous" else SlabAllocator()
    first = _outputs(gqa, _state(gqa, kind, allocator))
    other = _state(gqa, kind, allocator)
    rng = np.random.default_rng(0)
    other.run(_feeds(rng.integers(0, MICRO.vocab_size, (2, 6)), np.ones((2, 6))))
    other.run(_feeds(rng.integers(0, MICRO.vocab_size, (2, 1)), np.ones((2, 7))))
    other.close()
    second = _outputs(gqa, _state(gqa, kind, allocator))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_over_claiming_row_raises_with_state_unchanged(gqa, kind):
    st = _state(gqa, kind, None)
    for f in ROWS_APART:
        st.run(f)
    np.testing.assert_array_equal(st.lengths, [5, 4])
    before = {name: v.copy() for name, v in st.values.items()}
    with pytest.raises(InputError) as err:
        st.run(OVER_CLAIM)
    msg = str(err.value)
    assert "GroupQueryAttention node '/model/layers.0/attn/GroupQueryAttention'" in msg
    assert "row 1 claims a past of 5 positions (seqlens_k[1]=5 with 1 new token(s)) but has written only 4" in msg
    np.testing.assert_array_equal(st.lengths, [5, 4])
    for name, v in st.values.items():
        np.testing.assert_array_equal(v, before[name])
    if kind == "paged":
        st.pool.audit()
    # the rows' own continuation still runs
    st.run(_feeds([[11], [12]], [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]))
    np.testing.assert_array_equal(st.lengths, [6, 5])


def test_contiguous_lengths_follow_rows_and_truncate(gqa):
    st = gqa.new_state(cache=CacheConfig(initial_capacity=4))
    for f in ROWS_APART:
        st.run(f)
    assert st.length == 5
    np.testing.assert_array_equal(st.lengths, [5, 4])
    st.truncate(3)
    np.testing.assert_array_equal(st.lengths, [3, 3])
    st.run(_feeds([[5], [6]], np.ones((2, 4))))
    np.testing.assert_array_equal(st.lengths, [4, 4])


@pytest.mark.parametrize(
    "family,message",
    [
        (
            "attention",
            r"Attention node '/model/layers.0/self_attn/Attention': row 1 claims a past of 6 positions "
            r"\(past_key: the state's past of 6 positions, its longest row, and an attn_mask that does not hide "
            r"the positions row 1 never wrote\) but has written only 5",
        ),
        ("concat", r"paged cache: row 1 would be written at position 6 but has written only 5 positions"),
    ],
)
def test_uniform_writers_refuse_rows_of_different_lengths(family, message):
    """Concat graphs append every row at the past length, and an Attention graph whose mask shows a row the
    positions it never wrote would read them: a paged cache whose rows differ (as a loaded cache may
    declare) is refused before anything is written, not padded with stale bytes.  (An Attention mask that
    hides them runs: tests/plan/ops/test_attention_onnx_ragged.py.)"""
    session = onnxkv.Session(build_model(family, MICRO, seed=3), threads=1)
    st = session.new_state(cache=CacheConfig("paged", block_size=4))
    ids = np.arange(1, 13, dtype=np.int64).reshape(2, 6)
    st.run(
        {
            "input_ids": ids,
            "attention_mask": np.ones((2, 6), np.int64),
            "position_ids": np.broadcast_to(np.arange(6), (2, 6)).copy(),
        }
    )
    # a ragged state, made through the store's private page table: row 1 holds one position less
    st._store.cache.table.lengths[1] = 5
    live = st.pool.live_pages
    with pytest.raises(InputError, match=message):
        st.run(
            {
                "input_ids": np.array([[13], [14]]),
                "attention_mask": np.ones((2, 7), np.int64),
                "position_ids": np.array([[6], [6]]),
            }
        )
    assert st.pool.live_pages == live
    st.pool.audit()
