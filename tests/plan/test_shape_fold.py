"""Build-time shape folding (onnxkv.plan.shape_fold): fewer nodes, identical results.

The oracle is the same model planned with ``fold_shapes=False``; results must be
bitwise equal.  Small graphs check what may and may not be folded.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_fusion_attention import _generate  # prefill + decode steps of a left-padded batch

import onnxkv
import onnxkv.runtime.session as session_module
from onnxkv.plan.plan import Plan
from onnxkv.zoo.builders import MICRO, build_model

TORCH = Path(__file__).resolve().parents[1] / "data" / "torch_tiny_llama" / "model.onnx"


def _session(model, fold: bool) -> onnxkv.Session:
    saved = session_module.Plan
    session_module.Plan = functools.partial(Plan, fold_shapes=fold)
    try:
        return onnxkv.Session(model, threads=2)
    finally:
        session_module.Plan = saved


def test_torch_export_loses_most_shape_nodes():
    folded, plain = _session(TORCH, True), _session(TORCH, False)
    ops, plain_ops = [n.op_type for n in folded.plan.nodes], [n.op_type for n in plain.plan.nodes]
    assert len(plain_ops) == 216 and len(ops) <= 39  # counts after the fusions of onnxkv.plan.fusion*
    assert ops.count("Shape") <= plain_ops.count("Shape") // 3
    assert folded.plan.shape_folded_nodes >= 90
    assert ops.count("MaskedAttention") == 2  # folding happens after fusion and keeps it


def test_builder_concat_graph_only_reads_its_two_run_time_dims_more_directly(monkeypatch):
    import onnxkv.plan.fusion_passes as fusion_passes

    # the mask chain that reads them, unfused (ExportMask reads the dims itself)
    monkeypatch.setattr(fusion_passes, "fuse_export_masks", lambda nodes, protected, constants: nodes)
    model = build_model("concat", MICRO, seed=3)
    folded, plain = _session(model, True).plan.nodes, _session(model, False).plan.nodes
    # Gather(Shape(input_ids), 1) and Gather(Shape(past), 2) become one ShapeOf each
    assert [n.op_type for n in plain[:4]] == ["Shape", "Gather", "Shape", "Gather"]
    assert [n.op_type for n in folded[:2]] == ["ShapeOf", "ShapeOf"]
    assert len(plain) - len(folded) == 2


@pytest.mark.parametrize("form", ["torch", "builder"])
@pytest.mark.parametrize("state", [False, True], ids=["tensors", "state"])
def test_results_are_bitwise_those_of_the_unfolded_plan(form, state):
    rng = np.random.default_rng(5)
    model = TORCH if form == "torch" else build_model("concat", MICRO, seed=3)
    vocab = 259 if form == "torch" else 97
    prompt = rng.integers(0, vocab, (2, 7))
    lengths = np.array([7, 4])
    tokens = rng.integers(0, vocab, (2, 3))
    got = _generate(_session(model, True), prompt, lengths, tokens, state)
    want = _generate(_session(model, False), prompt, lengths, tokens, state)
    assert len(got) == len(want) == (4 if state else 4 * (1 + 4))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_array_equal(g, w)


# -- small graphs ---------------------------------------------------------------------------------


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _reshape_by_own_dims(x_shape, value_info=()):
    """y = Reshape(x, Concat(Unsqueeze(Shape(x)[0]), Unsqueeze(Shape(x)[1]), [-1])) for x [N, 4, 6]."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["n"]),
        helper.make_node("Gather", ["s", "i1"], ["c"]),
        helper.make_node("Unsqueeze", ["n", "ax"], ["n1"]),
        helper.make_node("Unsqueeze", ["c", "ax"], ["c1"]),
        helper.make_node("Concat", ["n1", "c1", "m1"], ["target"], axis=0),
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Reshape", ["r", "target"], ["y"]),
    ]
    inits = [_ints("i0", 0), _ints("i1", 1), _ints("ax", [0]), _ints("m1", [-1])]
    graph = helper.make_graph(nodes, "g", [_vi("x", x_shape)], [_vi("y", None)], inits, value_info=list(value_info))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_static_dim_folds_and_dynamic_dim_is_rewritten_not_folded():
    model = _reshape_by_own_dims(["N", 4, 6])
    sess = _session(model, True)
    ops = [n.op_type for n in sess.plan.nodes]
    assert ops == ["Relu", "Reshape"]  # target [0 (copy N), 4, -1]: the whole shape chain is gone
    target = sess.plan._template[sess.plan.slot_of[sess.plan.nodes[1].input[1]]]
    assert target.tolist() == [0, 4, -1]
    rng = np.random.default_rng(1)
    for n in (1, 3):
        x = rng.standard_normal((n, 4, 6)).astype(np.float32)
        y = sess.run({"x": x})["y"]
        np.testing.assert_array_equal(y, np.maximum(x, 0).reshape(n, 4, 6))
    # N = 0: the run-time target was [0, 4, -1] already, which Reshape rejects either way
    empty = {"x": np.zeros((0, 4, 6), np.float32)}
    for plan in (sess, _session(model, False)):
        with pytest.raises(onnxkv.OperatorError, match="cannot reshape"):
            plan.run(empty)


@pytest.mark.parametrize("declared", ["N", 0], ids=["symbol", "zero"])
def test_dynamic_dim_that_cannot_be_rewritten_stays_a_run_time_shape(declared):
    # the dynamic dim is used as a value (Range), not as a shape of its own data; a declared 0 is not
    # checked by bind_inputs, so it must not be trusted either
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["n"]),
        helper.make_node("Gather", ["s", "i1"], ["c"]),
        helper.make_node("Mul", ["n", "c"], ["nc"]),
        helper.make_node("Range", ["zero", "nc", "one"], ["y"]),
    ]
    inits = [_ints("i0", 0), _ints("i1", 1), _ints("zero", 0), _ints("one", 1)]
    graph = helper.make_graph(nodes, "g", [_vi("x", [declared, 4])], [_vi("y", None, TensorProto.INT64)], inits)
    sess = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), True)
    ops = [n.op_type for n in sess.plan.nodes]
    assert ops == ["ShapeOf", "Mul", "Range"]  # Gather(s, 1) = 4 folded; Gather(s, 0) read from x directly
    assert list(sess.plan.nodes[0].input) == ["x"]
    for n in (2, 5):
        y = sess.run({"x": np.ones((n, 4), np.float32)})["y"]
        np.testing.assert_array_equal(y, np.arange(4 * n))


def test_declared_intermediate_shapes_are_not_trusted():
    # value_info claims r is [2, 4, 6]; only the checked input dims may be folded
    wrong = [_vi("r", [2, 4, 6]), _vi("s", [3], TensorProto.INT64)]
    sess = _session(_reshape_by_own_dims(["N", 4, 6], wrong), True)
    x = np.random.default_rng(2).standard_normal((5, 4, 6)).astype(np.float32)
    np.testing.assert_array_equal(sess.run({"x": x})["y"], np.maximum(x, 0))


def test_repeated_shape_chains_are_merged():
    # two readers compute Shape(x)[0] separately, and a third reads it through Relu(x) (same dim symbol)
    nodes = [
        helper.make_node("Shape", ["x"], ["s1"]),
        helper.make_node("Gather", ["s1", "i0"], ["n1"]),
        helper.make_node("Shape", ["x"], ["s2"]),
        helper.make_node("Gather", ["s2", "i0"], ["n2"]),
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Shape", ["r"], ["s3"]),
        helper.make_node("Gather", ["s3", "i0"], ["n3"]),
        helper.make_node("Add", ["n1", "n2"], ["a"]),
        helper.make_node("Add", ["a", "n3"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [_vi("x", ["N", 3])], [_vi("y", None, TensorProto.INT64)], [_ints("i0", 0)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    sess, plain = _session(model, True), _session(model, False)
    # one ShapeOf (x's dim 0) left; Relu, whose shape is all y read of it, is dropped as no output needs it
    assert [n.op_type for n in sess.plan.nodes] == ["ShapeOf", "Add", "Add"]
    assert len(plain.plan.nodes) == 9
    for n in (1, 6):
        assert int(sess.run({"x": np.zeros((n, 3), np.float32)})["y"]) == 3 * n


def test_repeated_compute_nodes_are_merged():
    # the same Mul twice (its scalars equal by value under two names) and a Sigmoid reading each copy
    nodes = [
        helper.make_node("Mul", ["x", "c1"], ["m1"]),
        helper.make_node("Mul", ["x", "c2"], ["m2"]),
        helper.make_node("Sigmoid", ["m1"], ["s1"]),
        helper.make_node("Sigmoid", ["m2"], ["s2"]),
        helper.make_node("Add", ["s1", "s2"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.float32(0.7), "c1"), numpy_helper.from_array(np.float32(0.7), "c2")]
    graph = helper.make_graph(nodes, "g", [_vi("x", ["N", 3])], [_vi("y", None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    sess = _session(model, True)
    assert [n.op_type for n in sess.plan.nodes] == ["Mul", "Sigmoid", "Add"]
    assert list(sess.plan.nodes[2].input) == ["s1", "s1"]
    x = np.random.default_rng(4).standard_normal((5, 3)).astype(np.float32)
    np.testing.assert_array_equal(sess.run({"x": x})["y"], _session(model, False).run({"x": x})["y"])


def test_torch_export_builds_the_mask_once(monkeypatch):
    import onnxkv.plan.fusion_passes as fusion_passes

    def mask_wheres(sess):  # Where(causal & padding, 0, -inf), the additive mask of each layer
        return [n for n in sess.plan.nodes if n.op_type == "Where" and n.input[0] == "/m/model/Expand_output_0"]

    with monkeypatch.context() as m:  # the mask chain as the export wrote it
        m.setattr(fusion_passes, "fuse_export_masks", lambda nodes, protected, constants: nodes)
        assert len(mask_wheres(_session(TORCH, False))) == 2  # one per layer in the export
        kept = mask_wheres(_session(TORCH, True))
        assert len(kept) == 1
        readers = [n for n in _session(TORCH, True).plan.nodes if n.op_type == "MaskedAttention"]
        assert [n.input[3] for n in readers] == [kept[0].output[0]] * 2
    # fused: one ExportMask node makes every layer's mask
    nodes = _session(TORCH, True).plan.nodes
    (mask,) = [n for n in nodes if n.op_type == "ExportMask"]
    assert {n.input[3] for n in nodes if n.op_type == "MaskedAttention"} <= set(mask.output)


def test_graph_outputs_are_never_folded_away():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Shape", ["x"], ["t"])]
    graph = helper.make_graph(
        nodes, "g", [_vi("x", ["N", 3])], [_vi("s", None, TensorProto.INT64), _vi("t", None, TensorProto.INT64)]
    )
    sess = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), True)
    assert len(sess.plan.nodes) == 2
    out = sess.run({"x": np.zeros((4, 3), np.float32)})
    assert out["s"].tolist() == out["t"].tolist() == [4, 3]


def test_same_declared_symbol_on_two_inputs_is_not_trusted():
    # both inputs declare dim 0 as "N", but bind_inputs does not check that; the dims must stay apart
    nodes = [
        helper.make_node("Shape", ["x"], ["sx"]),
        helper.make_node("Gather", ["sx", "i0"], ["nx"]),
        helper.make_node("Shape", ["z"], ["sz"]),
        helper.make_node("Gather", ["sz", "i0"], ["nz"]),
        helper.make_node("Add", ["nx", "nz"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [_vi("x", ["N", 3]), _vi("z", ["N", 3])], [_vi("y", None, TensorProto.INT64)], [_ints("i0", 0)]
    )
    sess = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), True)
    assert [(n.op_type, list(n.input)) for n in sess.plan.nodes] == [
        ("ShapeOf", ["x"]),
        ("ShapeOf", ["z"]),
        ("Add", ["nx", "nz"]),
    ]
    out = sess.run({"x": np.zeros((2, 3), np.float32), "z": np.zeros((5, 3), np.float32)})
    assert int(out["y"]) == 7


def test_a_dim_onnx_leaves_unknown_is_read_from_its_own_tensor():
    # r = Reshape(x, [-1, 4]) has a dim ONNX cannot name; Shape(r)[0] and Concat(Shape(r)[0], 2, 2) become
    # ShapeOf(r) nodes (the Reshape by that target copies r's dim instead)
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["r"]),
        helper.make_node("Shape", ["r"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["n"]),
        helper.make_node("Unsqueeze", ["n", "ax"], ["n1"]),
        helper.make_node("Concat", ["n1", "two", "two"], ["target"], axis=0),
        helper.make_node("Reshape", ["r", "target"], ["y"]),
        helper.make_node("ConstantOfShape", ["target"], ["z"]),
        helper.make_node("Add", ["n", "n"], ["twice"]),
    ]
    inits = [_ints("flat", [-1, 4]), _ints("i0", 0), _ints("ax", [0]), _ints("two", [2])]
    graph = helper.make_graph(
        nodes,
        "g",
        [_vi("x", ["N", 12])],
        [_vi("y", None), _vi("z", None), _vi("twice", None, TensorProto.INT64)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    sess, plain = _session(model, True), _session(model, False)
    ops = [(n.op_type, list(n.input)) for n in sess.plan.nodes]
    assert [op for op, _ in ops] == ["Reshape", "ShapeOf", "ShapeOf", "Reshape", "ConstantOfShape", "Add"]
    assert ops[1][1] == ops[2][1] == ["r"]
    assert len(plain.plan.nodes) == 8
    rng = np.random.default_rng(6)
    for n in (1, 3):
        x = rng.standard_normal((n, 12)).astype(np.float32)
        got, want = sess.run({"x": x}), plain.run({"x": x})
        np.testing.assert_array_equal(got["y"], x.reshape(3 * n, 2, 2))
        for name in ("y", "z"):
            assert got[name].shape == want[name].shape == (3 * n, 2, 2)
            np.testing.assert_array_equal(got[name], want[name])
        assert got["twice"].shape == () and int(got["twice"]) == int(want["twice"]) == 6 * n


@pytest.mark.parametrize(
    "attrs",
    [
        dict(sources=[0, 1], values=[0, 2]),
        dict(sources=[0], values=[0, 1]),
        dict(sources=[0, -1], values=[1, 3], rank=0),
    ],
)
def test_shape_of_rejects_attributes_that_describe_no_value(attrs):
    from onnxkv.plan.ops.shape import ShapeOf
    from onnxkv.plan.registry import BuildContext

    node = helper.make_node("ShapeOf", ["x"], ["y"], name="bad", domain="ai.onnxkv", **attrs)
    with pytest.raises(onnxkv.ModelError, match="ShapeOf node 'bad'"):
        ShapeOf(node, BuildContext({"": 21}))


def test_shape_values_through_a_view_chain_still_fold():
    # Squeeze -> Unsqueeze of Shape(x)[0:1] fuse into a ViewChain; its value is still x's dim 0, so the Reshape
    # target [n, 4, -1] becomes [0, 4, -1] and nothing but the Reshape is left
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Slice", ["s", "i0", "i1"], ["n1"]),
        helper.make_node("Squeeze", ["n1", "ax"], ["n"]),
        helper.make_node("Unsqueeze", ["n", "ax"], ["n2"]),
        helper.make_node("Concat", ["n2", "four", "m1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [_ints("i0", [0]), _ints("i1", [1]), _ints("ax", [0]), _ints("four", [4]), _ints("m1", [-1])]
    graph = helper.make_graph(nodes, "g", [_vi("x", ["N", 4, 6])], [_vi("y", None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    sess, plain = _session(model, True), _session(model, False)
    assert "ViewChain" in [n.op_type for n in plain.plan.nodes]
    assert [n.op_type for n in sess.plan.nodes] == ["Reshape"]
    x = np.random.default_rng(9).standard_normal((3, 4, 6)).astype(np.float32)
    np.testing.assert_array_equal(sess.run({"x": x})["y"], plain.run({"x": x})["y"])
