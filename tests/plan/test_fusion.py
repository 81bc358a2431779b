"""Plan-time fusion of the SiLU gate into the compiled silu_mul kernel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxkv import Session
from onnxkv.zoo.builders import MICRO, build_model

DATA = Path(__file__).resolve().parents[1] / "data"


def _gate_model(swap: bool, expose_sigmoid: bool = False):
    m1_inputs = ["s", "g"] if swap else ["g", "s"]
    nodes = [
        helper.make_node("Sigmoid", ["g"], ["s"]),
        helper.make_node("Mul", m1_inputs, ["m"]),
        helper.make_node("Mul", ["u", "m"] if swap else ["m", "u"], ["y"], name="gate_mul"),
    ]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 8]) for n in ("g", "u")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 8])]
    if expose_sigmoid:
        outs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, [3, 8]))
    return helper.make_model(helper.make_graph(nodes, "g", vi, outs), opset_imports=[helper.make_opsetid("", 21)])


def test_gate_is_fused_in_both_operand_orders_and_exact():
    rng = np.random.default_rng(0)
    g, u = rng.standard_normal((2, 3, 8)).astype(np.float32)
    want = g / (1 + np.exp(-g)) * u
    for swap in (False, True):
        sess = Session(_gate_model(swap), threads=1)
        assert [n.op_type for n in sess.plan.nodes] == ["SiluMul"]
        assert sess.plan.nodes[0].name == "gate_mul"
        np.testing.assert_allclose(sess.run({"g": g, "u": u})["y"], want, rtol=1e-6, atol=1e-6)


def test_float16_gate_is_computed_in_float32_and_rounded_once():
    rng = np.random.default_rng(16)
    g, u = (rng.standard_normal((2, 3, 8)) * 4).astype(np.float16)
    model = _gate_model(False)
    for vi in (*model.graph.input, *model.graph.output):
        vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    sess = Session(model, threads=1)
    assert [n.op_type for n in sess.plan.nodes] == ["SiluMul"]
    got = sess.run({"g": g, "u": u})["y"]
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    want = (g64 / (1 + np.exp(-g64)) * u64).astype(np.float16)
    assert got.dtype == np.float16
    # float32 sums rounded once: the float64 value's float16 rounding, or the neighbour at a near tie
    np.testing.assert_array_less(np.abs(got.astype(np.float64) - want), np.abs(want) * 2.0**-10 + 1e-7)


def test_observable_intermediates_block_fusion():
    sess = Session(_gate_model(False, expose_sigmoid=True), threads=1)
    assert [n.op_type for n in sess.plan.nodes] == ["Sigmoid", "Mul", "Mul"]


def test_builder_and_exported_models_fuse_every_layer():
    for model in (
        build_model("gqa", MICRO),
        build_model("concat", MICRO),
        DATA / "genai_tiny_llama",
        DATA / "torch_tiny_llama" / "model.onnx",
    ):
        nodes = list(_with_bodies(Session(model, threads=1).plan.nodes))  # a SiluMul may sit in a PrologueMatMul
        assert sum(n.op_type == "SiluMul" for n in nodes) == 2, model
        assert not any(n.op_type == "Sigmoid" for n in nodes)


def _with_bodies(nodes):
    """Plan nodes, each fused node with a body (MaskedAttention, PrologueMatMul, ...) replaced by its body's nodes."""
    for n in nodes:
        body = next((a.g for a in n.attribute if a.name == "body"), None)
        yield from (n,) if body is None else body.node


def test_repeat_kv_matmuls_are_fused_in_exported_graphs():
    for model in (build_model("concat", MICRO), DATA / "torch_tiny_llama" / "model.onnx"):
        nodes = list(_with_bodies(Session(model, threads=1).plan.nodes))
        assert sum(n.op_type == "RepeatKvMatMul" for n in nodes) == 2 * MICRO.num_layers, model
        # no node copies the cache per query head any more
        presents = {f"present.{i}.{kv}" for i in range(MICRO.num_layers) for kv in ("key", "value")}
        assert all(
            n.op_type in ("RepeatKvMatMul", "RepeatKvShape", "Shape", "Concat") or not presents & set(n.input)
            for n in nodes
        )


def _repeat_model(transpose: bool, expand_shape, with_scale: bool, scale_shape=()):
    from onnx import numpy_helper

    nodes = [
        helper.make_node("Unsqueeze", ["k", "axes"], ["ku"]),
        helper.make_node("Expand", ["ku", "eshape"], ["ke"]),
        helper.make_node("Reshape", ["ke", "rshape"], ["kr"]),
    ]
    rhs = "kr"
    if transpose:
        nodes.append(helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]))
        rhs = "kt"
        if with_scale:
            nodes.append(helper.make_node("Mul", ["kt", "scale"], ["ks"]))
            rhs = "ks"
    nodes.append(helper.make_node("MatMul", ["a", rhs], ["y"]))
    inits = [
        numpy_helper.from_array(np.array([2], np.int64), "axes"),
        numpy_helper.from_array(np.array(expand_shape, np.int64), "eshape"),
        numpy_helper.from_array(np.array([0, 6, -1, 8], np.int64), "rshape"),
        numpy_helper.from_array(
            np.linspace(0.3, 0.9, int(np.prod(scale_shape))).reshape(scale_shape).astype(np.float32), "scale"
        ),
    ]
    a_shape = [1, 6, 5, 8] if transpose else [1, 6, 5, 7]
    vi = [
        helper.make_tensor_value_info("a", TensorProto.FLOAT, a_shape),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, 2, 7, 8]),
    ]
    g = helper.make_graph(nodes, "g", vi, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize(
    "transpose,with_scale,scale_shape",
    [(True, False, ()), (True, True, ()), (False, False, ()), (True, True, (8, 1)), (True, True, (1, 1, 1, 1, 1))],
    ids=["kt", "kt-scalar", "k", "kt-per-row", "kt-rank-5"],  # per row of Kᵀ: used to scale the product's rows
)
@pytest.mark.parametrize("expand_shape", [[1, 1, 3, 1, 1], [1, 2, 3, 7, 8]])
def test_repeat_kv_matmul_matches_the_literal_graph(transpose, with_scale, scale_shape, expand_shape):
    from onnx.reference import ReferenceEvaluator

    m = _repeat_model(transpose, expand_shape, with_scale, scale_shape)
    rng = np.random.default_rng(3)
    feeds = {
        "a": rng.standard_normal([1, 6, 5, 8] if transpose else [1, 6, 5, 7]).astype(np.float32),
        "k": rng.standard_normal((1, 2, 7, 8)).astype(np.float32),
    }
    sess = Session(m, threads=1)
    assert [n.op_type for n in sess.plan.nodes] == ["RepeatKvMatMul"]
    want = ReferenceEvaluator(m).run(None, feeds)[0]
    np.testing.assert_allclose(sess.run(feeds)["y"], want, rtol=1e-5, atol=1e-5)


def test_repeat_kv_matmul_falls_back_when_the_shapes_are_not_a_head_repeat():
    from onnx.reference import ReferenceEvaluator

    # Repeat along a different layout: reshape to [1, 6, -1, 8] after expanding the *time* axis is not a
    # head repeat; the fused node must evaluate the literal expression.
    m = _repeat_model(False, [1, 2, 3, 7, 8], False)
    m.graph.initializer[2].CopyFrom(
        __import__("onnx").numpy_helper.from_array(np.array([1, 6, 7, 8], np.int64), "rshape")
    )
    m.graph.initializer[0].CopyFrom(__import__("onnx").numpy_helper.from_array(np.array([1], np.int64), "axes"))
    m.graph.initializer[1].CopyFrom(
        __import__("onnx").numpy_helper.from_array(np.array([1, 3, 2, 7, 8], np.int64), "eshape")
    )
    rng = np.random.default_rng(4)
    feeds = {
        "a": rng.standard_normal((1, 6, 5, 7)).astype(np.float32),
        "k": rng.standard_normal((1, 2, 7, 8)).astype(np.float32),
    }
    want = ReferenceEvaluator(m).run(None, feeds)[0]
    np.testing.assert_allclose(Session(m, threads=1).run(feeds)["y"], want, rtol=1e-5, atol=1e-5)
