"""Plan-time fusion of view/layout operator chains into ai.onnxkv::ViewChain nodes, on the torch export
fixture and on small graphs.

The oracle is the same model planned without this fusion; the chain's kernels run unchanged, so results are
bitwise equal.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxkv
import onnxkv.plan.plan as plan_module
from onnxkv.plan.ops.view_chain import ViewChain
from onnxkv.plan.registry import BuildContext
from test_fusion_attention import TORCH, torch_batch_runs


def _unfused(model, monkeypatch, threads: int = 2) -> onnxkv.Session:
    with monkeypatch.context() as m:
        m.setattr(plan_module, "fuse_view_chains", lambda nodes, protected: nodes)
        return onnxkv.Session(model, threads=threads)


def _body_ops(node: onnx.NodeProto) -> list[str]:
    body = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "body")
    return [n.op_type for n in body.node]


def test_head_split_and_merge_of_the_torch_export_are_fused(monkeypatch):
    nodes = onnxkv.Session(TORCH, threads=1).plan.nodes
    unfused = _unfused(TORCH, monkeypatch, 1).plan.nodes
    chains = [_body_ops(n) for n in nodes if n.op_type == "ViewChain"]
    # per layer: q, k and v split into heads, and the attention output merged back
    assert chains.count(["Reshape", "Transpose"]) == 2 * 3
    assert chains.count(["Reshape", "Transpose", "Reshape"]) == 2
    # plus, once per run, the mask construction's three Unsqueeze triples and a Reshape pair
    assert chains.count(["Unsqueeze"] * 3) == 3 and chains.count(["Reshape", "Reshape"]) == 1 and len(chains) == 12
    assert len(unfused) - len(nodes) == sum(len(c) - 1 for c in chains) == 2 * (3 * 1 + 2) + 3 * 2 + 1
    assert not {"Transpose"} & {n.op_type for n in nodes}


@pytest.mark.parametrize("state", [False, True], ids=["tensors", "state"])
def test_left_padded_batch_is_bitwise_the_unfused_plan(state, monkeypatch):
    got, want = torch_batch_runs(onnxkv.Session(TORCH, threads=2), _unfused(TORCH, monkeypatch), 29, 5, state)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# -- small graphs ---------------------------------------------------------------------------------------------------
def _ints(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _model(nodes, outputs=("y",)) -> onnx.ModelProto:
    """x [N, S, 8] -> nodes; ``target`` (a graph input) and a few constant shapes available."""
    inits = [_ints("split", [0, 0, 2, 4]), _ints("merge", [0, 0, -1]), _ints("axis0", [0])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "S", 8]),
              helper.make_tensor_value_info("target", TensorProto.INT64, [3])]
    graph = helper.make_graph(nodes, "views", inputs,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _split_merge(extra_transpose: bool = False) -> list[onnx.NodeProto]:
    """Relu, then split 8 into 2 heads of 4, swap S and heads, [swap back,] merge with a run-time target."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Reshape", ["r", "split"], ["heads"]),
             helper.make_node("Transpose", ["heads"], ["swapped"], perm=[0, 2, 1, 3])]
    last = "swapped"
    if extra_transpose:
        nodes.append(helper.make_node("Transpose", ["swapped"], ["back"], perm=[0, 2, 1, 3]))
        last = "back"
    nodes.append(helper.make_node("Reshape", [last, "target"], ["y"]))
    return nodes


@pytest.mark.parametrize("n", [2, 1, 0])
def test_split_and_merge_chain_matches_the_unfused_plan(n, monkeypatch):
    model = _model(_split_merge())
    sess = onnxkv.Session(model, threads=1)
    assert [x.op_type for x in sess.plan.nodes] == ["Relu", "ViewChain"]
    assert _body_ops(sess.plan.nodes[1]) == ["Reshape", "Transpose", "Reshape"]
    x = np.random.default_rng(n).standard_normal((n, 3, 8)).astype(np.float32)
    feeds = {"x": x, "target": np.array([n, 2, 12], np.int64)}
    got = sess.run(feeds)["y"]
    want = _unfused(model, monkeypatch, 1).run(feeds)["y"]
    assert got.shape == want.shape == (n, 2, 12)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, np.maximum(x, 0).reshape(n, 3, 2, 4).transpose(0, 2, 1, 3).reshape(n, 2, 12))


def test_a_second_transpose_starts_a_new_chain():
    sess = onnxkv.Session(_model(_split_merge(extra_transpose=True)), threads=1)
    ops = [x.op_type for x in sess.plan.nodes]
    assert ops == ["Relu", "ViewChain", "ViewChain"]
    assert [_body_ops(x) for x in sess.plan.nodes[1:]] == [["Reshape", "Transpose"], ["Transpose", "Reshape"]]
    x = np.random.default_rng(3).standard_normal((2, 3, 8)).astype(np.float32)
    got = sess.run({"x": x, "target": np.array([2, 3, 8], np.int64)})["y"]
    np.testing.assert_array_equal(got, np.maximum(x, 0))


def test_an_intermediate_graph_output_or_second_reader_ends_the_chain():
    nodes = _split_merge() + [helper.make_node("Neg", ["heads"], ["neg"])]
    sess = onnxkv.Session(_model(nodes, ("y", "swapped", "neg")), threads=1)
    # heads has two readers and swapped is a graph output: no pair of view nodes may fuse
    assert "ViewChain" not in [x.op_type for x in sess.plan.nodes]
    x = np.random.default_rng(4).standard_normal((2, 3, 8)).astype(np.float32)
    out = sess.run({"x": x, "target": np.array([2, 2, 12], np.int64)})
    np.testing.assert_array_equal(out["swapped"], np.maximum(x, 0).reshape(2, 3, 2, 4).transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(out["neg"], -np.maximum(x, 0).reshape(2, 3, 2, 4))


def test_a_view_only_chain_returns_a_view_of_its_data():
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Reshape", ["r", "merge"], ["flat"]),
             helper.make_node("Unsqueeze", ["flat", "axis0"], ["u"]),
             helper.make_node("Squeeze", ["u", "axis0"], ["y"]),
             helper.make_node("Sigmoid", ["r"], ["z"])]
    sess = onnxkv.Session(_model(nodes, ("y", "z")), threads=1)
    fused = [x for x in sess.plan.nodes if x.op_type == "ViewChain"]
    assert len(fused) == 1 and _body_ops(fused[0]) == ["Reshape", "Unsqueeze", "Squeeze"]
    x = np.random.default_rng(5).standard_normal((2, 3, 8)).astype(np.float32)
    out = sess.run({"x": x, "target": np.array([1, 1, 1], np.int64)})
    np.testing.assert_array_equal(out["y"], np.maximum(x, 0))
    np.testing.assert_allclose(out["z"], 1 / (1 + np.exp(-np.maximum(x, 0))), rtol=1e-6)


def test_a_failing_step_names_its_node():
    sess = onnxkv.Session(_model(_split_merge()), threads=1)
    x = np.random.default_rng(6).standard_normal((2, 3, 8)).astype(np.float32)
    with pytest.raises(onnxkv.OperatorError, match="cannot reshape"):
        sess.run({"x": x, "target": np.array([5, 5, 5], np.int64)})


def test_a_body_that_is_not_a_chain_is_rejected():
    body = helper.make_graph([helper.make_node("Reshape", ["other", "s"], ["y"])], "b",
                             [helper.make_empty_tensor_value_info(v) for v in ("x", "s", "other")],
                             [helper.make_empty_tensor_value_info("y")])
    node = helper.make_node("ViewChain", ["x", "s", "other"], ["y"], name="vc", domain="ai.onnxkv", body=body)
    with pytest.raises(onnxkv.ModelError, match="ViewChain node 'vc'"):
        ViewChain(node, BuildContext({"": 18, "ai.onnxkv": 1}))
