"""Plan-time fusion of sibling MatMuls (one input, several constant weights) into ai.onnxkv::SiblingMatMul.

The oracle is the same model planned without this fusion, and NumPy's matmul for small graphs.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_fusion_attention import MODELS, _generate, left_padded_batch  # the Concat-cache fixtures, generation

import onnxkv
import onnxkv.plan.fusion_passes as fusion_passes
from onnxkv.zoo.builders import MICRO, build_model

FORMS = {**MODELS, "gqa": lambda: build_model("gqa", MICRO, seed=3)}


def _unfused(model, monkeypatch) -> onnxkv.Session:
    with monkeypatch.context() as m:
        m.setattr(fusion_passes, "fuse_sibling_matmuls", lambda nodes, constants: nodes)
        return onnxkv.Session(model, threads=2)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_qkv_and_gate_up_projections_are_fused(form, monkeypatch):
    monkeypatch.setattr(fusion_passes, "fuse_prologue_matmuls", lambda nodes, protected, constants: nodes)
    fused = [n.op_type for n in onnxkv.Session(FORMS[form](), threads=1).plan.nodes]
    unfused = [n.op_type for n in _unfused(FORMS[form](), monkeypatch).plan.nodes]
    # two layers, each with q/k/v (3 -> 1) and gate/up (2 -> 1)
    assert fused.count("SiblingMatMul") == 4
    assert unfused.count("MatMul") - fused.count("MatMul") == 2 * (3 + 2)
    assert len(unfused) - len(fused) == 2 * (2 + 1)


@pytest.mark.parametrize("form", sorted(MODELS))
@pytest.mark.parametrize("state", [False, True], ids=["tensors", "state"])
def test_left_padded_batch_matches_the_unfused_plan(form, state, monkeypatch):
    prompt, lengths, tokens = left_padded_batch(form, 44, padding=3, steps=3)
    got = _generate(onnxkv.Session(MODELS[form](), threads=2), prompt, lengths, tokens, state)
    want = _generate(_unfused(MODELS[form](), monkeypatch), prompt, lengths, tokens, state)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def _three_projections(weight_input: bool = False):
    """y1, y2, y3 = x @ w1, x @ w2, x @ w3 for x [B, S, 32]; w2 a graph input when ``weight_input``."""
    rng = np.random.default_rng(6)
    ws = {f"w{i}": rng.standard_normal((32, n)).astype(np.float32) for i, n in ((1, 48), (2, 16), (3, 20))}
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in (1, 2, 3)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 32])]
    inits = [numpy_helper.from_array(w, name) for name, w in ws.items() if not (weight_input and name == "w2")]
    if weight_input:
        inputs.append(helper.make_tensor_value_info("w2", TensorProto.FLOAT, [32, 16]))
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in (1, 2, 3)]
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs, inits), opset_imports=[helper.make_opsetid("", 18)]
    )
    return model, ws


@pytest.mark.parametrize("rows", [1, 5, 300], ids=["decode", "kernel", "blas"])
def test_products_equal_numpy_for_every_row_count(rows):
    model, ws = _three_projections()
    sess = onnxkv.Session(model, threads=2)
    assert [n.op_type for n in sess.plan.nodes] == ["SiblingMatMul"]
    # the plan dropped its own copies of the packed weights
    assert all(sess.plan._template[sess.plan.slot_of[name]] is None for name in ws)
    x = np.random.default_rng(rows).standard_normal((1, rows, 32)).astype(np.float32)
    out = sess.run({"x": x})
    for i in (1, 2, 3):
        y = out[f"y{i}"]
        assert y.shape == (1, rows, ws[f"w{i}"].shape[1]) and y.flags.c_contiguous
        np.testing.assert_allclose(y, x @ ws[f"w{i}"], rtol=1e-5, atol=1e-5)


def test_run_time_weights_are_left_alone():
    model, ws = _three_projections(weight_input=True)
    sess = onnxkv.Session(model, threads=1)
    fused = [n for n in sess.plan.nodes if n.op_type == "SiblingMatMul"]
    assert len(fused) == 1 and list(fused[0].input) == ["x", "w1", "w3"]
    assert [n.op_type for n in sess.plan.nodes].count("MatMul") == 1
    x = np.random.default_rng(2).standard_normal((2, 3, 32)).astype(np.float32)
    out = sess.run({"x": x, "w2": ws["w2"]})
    for i in (1, 2, 3):
        np.testing.assert_allclose(out[f"y{i}"], x @ ws[f"w{i}"], rtol=1e-5, atol=1e-5)


def test_wrong_input_width_is_an_operator_error():
    model = _three_projections()[0]
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "K"  # not checked when the input is bound
    sess = onnxkv.Session(model, threads=1)
    with pytest.raises(onnxkv.OperatorError, match="SiblingMatMul node .* float32 \\[\\.\\.\\., 32\\]"):
        sess.plan.run({"x": np.ones((1, 2, 31), np.float32)})


@pytest.mark.parametrize("widths", [(48, 16, 20), (40, 16)], ids=["panel-aligned", "unaligned"])
@pytest.mark.parametrize("rows", [2, 5, 16])
def test_several_rows_equal_the_column_blocks_of_the_one_product_bit_for_bit(widths, rows):
    """Panel-aligned outputs take one product each (a replayable kernel call per output: compilable); others
    are copies of the one product's column blocks (not compilable).  The values are the same either way."""
    from onnxkv._kernels.matmul import matmul_packed

    from onnxkv.plan.context import RunContext

    rng = np.random.default_rng(rows)
    ws = [rng.standard_normal((32, n)).astype(np.float32) for n in widths]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(len(ws))]
    model = helper.make_model(
        helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 32])],
            [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(len(ws))],
            [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(ws)],
        ),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    sess = onnxkv.Session(model, threads=2)
    (op,) = sess.plan.kernels
    x = rng.standard_normal((1, rows, 32)).astype(np.float32)
    assert op.compilable([x]) == (widths == (48, 16, 20))
    full = np.empty((rows, sum(widths)), np.float32)
    matmul_packed(x.reshape(rows, 32), op.packed, full)
    outs = op.run([x], RunContext(lambda rt, i, shape, dtype: np.empty(shape, dtype), False, 0))
    for (n0, n1), y in zip(op.bounds, outs, strict=True):
        assert y.shape == (1, rows, n1 - n0) and y.flags.c_contiguous
        np.testing.assert_array_equal(y.reshape(rows, -1), full[:, n0:n1])


def _as_float16(model):
    """``model`` with float16 graph values and weights (a float16 model's projections)."""
    from onnx import numpy_helper as nh

    for vi in (*model.graph.input, *model.graph.output):
        vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    for i, init in enumerate(model.graph.initializer):
        model.graph.initializer[i].CopyFrom(nh.from_array(nh.to_array(init).astype(np.float16), init.name))
    return model


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_float16_siblings_are_one_product_of_float16_panels(rows, monkeypatch):
    """float16 weights group as float32 ones do (packed in float16); each output is what the separate
    float16 MatMul gives, bit for bit (one float32 product of the widened rows, rounded once)."""
    model = _as_float16(_three_projections()[0])
    sess = onnxkv.Session(model, threads=2)
    assert [n.op_type for n in sess.plan.nodes] == ["SiblingMatMul"]
    assert sess.plan.kernels[0].packed.dtype == np.float16
    alone = _unfused(model, monkeypatch)
    assert [n.op_type for n in alone.plan.nodes] == ["MatMul"] * 3
    x = np.random.default_rng(rows).standard_normal((1, rows, 32)).astype(np.float16)
    got, want = sess.run({"x": x}), alone.run({"x": x})
    for name in ("y1", "y2", "y3"):
        assert got[name].dtype == np.float16 and got[name].flags.c_contiguous
        np.testing.assert_array_equal(got[name], want[name])
    with pytest.raises(onnxkv.InputError, match="float16"):
        sess.run({"x": x.astype(np.float32)})


def _biased_projections(widths=(48, 16, 20), bias_shapes=None, reader=False):
    """y_i = x @ w_i + b_i for x [B, S, 32] (Qwen2's q/k/v projections); ``bias_shapes`` overrides a bias's
    shape; ``reader``: the first product is a graph output too (read outside its Add)."""
    rng = np.random.default_rng(8)
    n = len(widths)
    inits, nodes, outputs = [], [], []
    for i, width in enumerate(widths):
        shape = (bias_shapes or {}).get(i, (width,))
        inits += [
            numpy_helper.from_array(rng.standard_normal((32, width)).astype(np.float32), f"w{i}"),
            numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), f"b{i}"),
        ]
        nodes += [
            helper.make_node("MatMul", ["x", f"w{i}"], [f"p{i}"]),
            helper.make_node("Add", [f"b{i}", f"p{i}"], [f"y{i}"]),
        ]
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    if reader:
        outputs.append(helper.make_tensor_value_info("p0", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 32])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), n


@pytest.mark.parametrize("widths", [(48, 16, 20), (64,)])
@pytest.mark.parametrize("rows", [1, 5])
def test_bias_adds_after_the_products_are_taken_into_them(widths, rows):
    from onnx.reference import ReferenceEvaluator

    model, n = _biased_projections(widths)
    sess = onnxkv.Session(model, threads=2)
    (node,) = sess.plan.nodes
    assert node.op_type == "SiblingMatMul" and len(node.input) == 1 + 2 * n
    x = np.random.default_rng(rows).standard_normal((1, rows, 32)).astype(np.float32)
    got = sess.run({"x": x})
    for name, want in zip([f"y{i}" for i in range(n)], ReferenceEvaluator(model).run(None, {"x": x})):
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["broadcast_bias", "product_read_elsewhere"])
def test_biases_the_kernel_cannot_take_leave_the_adds(case):
    model, n = (
        _biased_projections(bias_shapes={1: (1, 1, 16)})
        if case == "broadcast_bias"
        else _biased_projections(reader=True)
    )
    ops = [node.op_type for node in onnxkv.Session(model, threads=1).plan.nodes]
    assert ops.count("Add") == n
