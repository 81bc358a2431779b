"""Constant folding stays within its size limit: oversized constant nodes run per call instead."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxkv import Session


def _const(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def _model(nodes, inits, out="y", inputs=()):
    g = helper.make_graph(
        nodes, "g", list(inputs), [helper.make_tensor_value_info(out, TensorProto.UNDEFINED, None)], inits
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


#: (label, nodes, initializers): each node's output is far over the limit, computed from tiny constants.
HUGE = {
    "ConstantOfShape": ([helper.make_node("ConstantOfShape", ["s"], ["y"])], [_const("s", np.array([1 << 29]))]),
    "Expand": (
        [helper.make_node("Expand", ["x", "s"], ["y"])],
        [_const("x", np.ones(1, np.float32)), _const("s", np.array([1 << 15, 1 << 15]))],
    ),
    "Tile": (
        [helper.make_node("Tile", ["x", "r"], ["y"])],
        [_const("x", np.ones((2, 2), np.float32)), _const("r", np.array([1 << 14, 1 << 14]))],
    ),
    "Range": (
        [helper.make_node("Range", ["a", "b", "c"], ["y"])],
        [_const("a", np.array(0)), _const("b", np.array(1 << 30)), _const("c", np.array(1))],
    ),
    "broadcast Add": (
        [helper.make_node("Add", ["u", "v"], ["y"])],
        [_const("u", np.ones((1 << 15, 1), np.float32)), _const("v", np.ones((1, 1 << 15), np.float32))],
    ),
    "MatMul outer product": (
        [helper.make_node("MatMul", ["u", "v"], ["y"])],
        [_const("u", np.ones((1 << 15, 1), np.float32)), _const("v", np.ones((1, 1 << 15), np.float32))],
    ),
    "overflowing Tile": (
        [helper.make_node("Tile", ["x", "r"], ["y"])],
        [_const("x", np.ones((4, 1), np.float32)), _const("r", np.array([1 << 62, 8]))],
    ),
}


@pytest.mark.parametrize("label", list(HUGE))
def test_oversized_constant_nodes_are_not_folded_and_allocate_nothing(label):
    nodes, inits = HUGE[label]
    tracemalloc.start()
    try:
        sess = Session(_model(nodes, inits), threads=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sess.plan.folded_nodes == 0
    assert [n.op_type for n in sess.plan.nodes] == [nodes[0].op_type]
    assert peak < 16 << 20


def test_constant_of_shape_just_over_the_limit_is_not_folded():
    elements = (64 << 20) // 4 + 16  # float32: just over FOLD_LIMIT_BYTES
    sess = Session(
        _model([helper.make_node("ConstantOfShape", ["s"], ["y"])], [_const("s", np.array([elements]))]), threads=1
    )
    assert sess.plan.folded_nodes == 0 and sess.plan.nodes[0].op_type == "ConstantOfShape"


def test_small_constant_nodes_still_fold():
    sess = Session(
        _model(
            [helper.make_node("ConstantOfShape", ["s"], ["c"]), helper.make_node("Neg", ["c"], ["y"])],
            [_const("s", np.array([16]))],
        ),
        threads=1,
    )
    assert sess.plan.folded_nodes == 2 and sess.plan.nodes == []
    assert sess.run({})["y"].shape == (16,)


def test_a_weight_sized_fold_over_the_limit_still_folds_and_amplifying_ones_run_per_call(monkeypatch):
    from onnxkv.plan import fold_limit

    monkeypatch.setattr(fold_limit, "FOLD_LIMIT_BYTES", 256)
    w = np.arange(128, dtype=np.float32).reshape(8, 16)
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"]),  # 512 bytes, no more elements than w
        helper.make_node("ConstantOfShape", ["s"], ["z"]),  # 512 bytes from a 2-element shape
        helper.make_node("Add", ["wt", "z"], ["y"]),
    ]
    sess = Session(_model(nodes, [_const("w", w), _const("s", np.array([16, 8]))]), threads=1)
    assert [n.op_type for n in sess.plan.nodes] == ["ConstantOfShape", "Add"]
    np.testing.assert_array_equal(sess.run({})["y"], w.T)


def test_fold_budget_refuses_outputs_over_the_limit(monkeypatch):
    from onnxkv.plan import fold_limit
    from onnxkv.plan.fold_limit import FoldBudget, FoldTooLarge

    monkeypatch.setattr(fold_limit, "FOLD_LIMIT_BYTES", 256)
    budget = FoldBudget(input_elements=100)
    assert budget(None, 0, (64,), np.dtype(np.float32)).shape == (64,)  # 256 bytes
    assert budget(None, 0, (100,), np.dtype(np.float64)).shape == (100,)  # no more elements than the inputs
    with pytest.raises(FoldTooLarge):
        budget(None, 0, (101,), np.dtype(np.float32))
    with pytest.raises(FoldTooLarge):
        budget(None, 0, (-1, 4), np.dtype(np.float32))
