"""ONNX TensorScatter (24) against onnx.reference."""

from __future__ import annotations

import numpy as np
import pytest
from _attn_harness import build_op, make_model, run_op, run_reference

import onnxkv
from onnxkv.errors import InputError, ModelError
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.plan.ops.tensor_scatter import TensorScatter
from onnxkv.zoo.builders import MICRO, build_model


def _check_against_peers(past, update, indices=None, **attrs):
    ins = {"past_cache": past, "update": update, "write_indices": indices}
    model = make_model("TensorScatter", ins, ["present_cache"], {"": 24}, **attrs)
    (got,), rt = run_op(TensorScatter, model, ins)
    (want,) = run_reference(model, ins)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    assert rt.counters == {
        "allocations": 1,
        "allocated_bytes": past.nbytes,
        "prefix_copied_bytes": past.nbytes,
        "append_copied_bytes": update.nbytes,
    }
    return got


def test_prefill_without_indices():
    rng = np.random.default_rng(0)
    past = rng.standard_normal((2, 3, 8, 16)).astype(np.float32)
    _check_against_peers(past, rng.standard_normal((2, 3, 5, 16)).astype(np.float32))


def test_decode_linear_per_row_indices():
    rng = np.random.default_rng(1)
    past = rng.standard_normal((2, 2, 8, 32)).astype(np.float32)
    update = rng.standard_normal((2, 2, 1, 32)).astype(np.float32)
    _check_against_peers(past, update, np.array([7, 3], np.int64), mode="linear")


@pytest.mark.parametrize("axis", [1, 2, -3])
def test_circular_and_other_axes(axis):
    rng = np.random.default_rng(10 + axis)
    past = rng.standard_normal((2, 6, 6, 4)).astype(np.float32)
    shape = list(past.shape)
    shape[axis] = 3
    update = rng.standard_normal(shape).astype(np.float32)
    _check_against_peers(past, update, np.array([5, 1], np.int64), mode="circular", axis=axis)


def test_integer_cache_dtype():
    past = np.arange(2 * 4 * 3, dtype=np.int32).reshape(2, 4, 3)
    update = -np.ones((2, 2, 3), np.int32)
    _check_against_peers(past, update, np.array([0, 2], np.int64), axis=1)


def test_errors():
    past = np.zeros((2, 2, 4, 8), np.float32)
    update = np.ones((2, 2, 2, 8), np.float32)
    ins = {"past_cache": past, "update": update, "write_indices": np.array([3, 0], np.int64)}
    model = make_model("TensorScatter", ins, ["present_cache"], {"": 24})
    with pytest.raises(InputError, match=r"write_indices\[0\]=3 with 2 update steps exceeds"):
        run_op(TensorScatter, model, ins)
    bad = dict(ins, update=np.ones((2, 3, 2, 8), np.float32))
    with pytest.raises(InputError, match="must equal past_cache shape"):
        run_op(TensorScatter, make_model("TensorScatter", bad, ["p"], {"": 24}), bad)
    with pytest.raises(ModelError, match="axis must not be 0"):
        build_op(TensorScatter, make_model("TensorScatter", ins, ["p"], {"": 24}, axis=0))
    with pytest.raises(ModelError, match="mode must be"):
        build_op(TensorScatter, make_model("TensorScatter", ins, ["p"], {"": 24}, mode="ring"))


def _scattered(past, update, starts, circular):
    """present_cache by the spec's loop in Python integers (no width to overflow)."""
    present = past.copy()
    length, seq = past.shape[2], update.shape[2]
    for b, start in enumerate(starts):
        for s in range(seq):
            present[b, :, (int(start) + s) % length if circular else int(start) + s] = update[b, :, s]
    return present


@pytest.mark.parametrize(
    "indices",
    [
        np.array([2**63 - 1, 2**63 - 2], np.int64),  # start + s used to wrap to -2**63 (the wrong slot)
        np.array([2**64 - 1, 2**63 + 5], np.uint64),  # not wrapped to -1 and -2**63 + 5
        np.array([-(2**63), -7], np.int64),
        np.array([5, 250], np.uint8),
    ],
    ids=["int64-max", "uint64", "int64-min", "uint8"],
)
def test_circular_indices_of_every_width_are_reduced_exactly(indices):
    rng = np.random.default_rng(20)
    past = rng.standard_normal((2, 3, 6, 4)).astype(np.float32)
    update = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    ins = {"past_cache": past, "update": update, "write_indices": indices}
    (got,), _ = run_op(TensorScatter, make_model("TensorScatter", ins, ["p"], {"": 24}, mode="circular"), ins)
    np.testing.assert_array_equal(got, _scattered(past, update, indices.tolist(), circular=True))


@pytest.mark.parametrize(
    "indices, match",
    [
        (
            np.array(
                [2**63 - 1, 0], np.int64
            ),  # start + 2 used to wrap negative, pass the check and fail as IndexError
            r"write_indices\[0\]=9223372036854775807 with 2 update steps exceeds the cache: linear mode needs "
            r"0 <= index <= 2 \(index \+ 2 <= 4\)",
        ),
        (np.array([0, 2**64 - 1], np.uint64), r"write_indices\[1\]=18446744073709551615 with 2 update steps"),
        (np.array([0, 1.0]), r"write_indices must be \[2\] integers, got float64 \(2,\)"),
        (np.array([0, 1, 2], np.int64), r"write_indices must be \[2\] integers, got int64 \(3,\)"),
    ],
    ids=["int64-max", "uint64", "float", "shape"],
)
def test_linear_indices_are_checked_in_their_own_width(indices, match):
    ins = {
        "past_cache": np.zeros((2, 2, 4, 8), np.float32),
        "update": np.ones((2, 2, 2, 8), np.float32),
        "write_indices": indices,
    }
    with pytest.raises(InputError, match=match):
        run_op(TensorScatter, make_model("TensorScatter", ins, ["p"], {"": 24}), ins)


def test_a_state_refuses_an_index_near_the_int64_limit_before_writing():
    """write_indices = 2**63 - 1 passed TensorScatter's check (index + 1 wrapped) and reached the cache."""
    session = onnxkv.Session(build_model("tensorscatter", MICRO, seed=21), threads=1)
    prompt = np.random.default_rng(22).integers(0, MICRO.vocab_size, (2, 5))
    with session.new_state() as state:
        builder = FeedBuilder(session.plan.inputs, session.model, prompt, np.full(2, 5), 0, thread_cache=False)
        feeds, _ = builder.first()
        out = state.run(feeds, [session.model.io.logits])
        feeds = builder.next(np.array([1, 2]), out)
        before = {name: value.copy() for name, value in state.values.items()}
        with pytest.raises(
            InputError,
            match=r"TensorScatter_key': write_indices\[0\]=9223372036854775807 with 1 "
            r"update steps exceeds the cache",
        ):
            state.run(dict(feeds, write_indices=np.array([2**63 - 1, 5], np.int64)), [session.model.io.logits])
        for name, value in state.values.items():
            np.testing.assert_array_equal(value, before[name])
        state.run(feeds, [session.model.io.logits])  # the state still runs
