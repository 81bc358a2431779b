"""ONNX TensorScatter (24) against onnx.reference."""

from __future__ import annotations

import numpy as np
import pytest
from _attn_harness import build_op, make_model, run_op, run_reference

from onnxkv.errors import InputError, ModelError
from onnxkv.plan.ops.tensor_scatter import TensorScatter


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
