"""ONNX Runtime's Gelu family (com.microsoft Gelu, BiasGelu, FastGelu: what its transformer optimizer fuses
GELUs into) through Session against ONNX Runtime on the same graphs, and the standard Gelu and Erf in
the erf kernel."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxkv import Session
from onnxkv.errors import OperatorError

ort = pytest.importorskip("onnxruntime")


def _model(op, domain, n_inputs, bias=None, opset=17, **attrs):
    names = ["x"] + (["b"] if bias is not None else [])
    node = helper.make_node(op, names[:n_inputs], ["y"], name="g", domain=domain, **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 40])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [] if bias is None else [numpy_helper.from_array(bias, "b")],
    )
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=imports)


BIAS = np.linspace(-1, 1, 40, dtype=np.float32)
CASES = {
    "ms_gelu": _model("Gelu", "com.microsoft", 1),
    "bias_gelu": _model("BiasGelu", "com.microsoft", 2, BIAS),
    "fast_gelu": _model("FastGelu", "com.microsoft", 1),
    "fast_gelu_bias": _model("FastGelu", "com.microsoft", 2, BIAS),
    "onnx_gelu": _model("Gelu", "", 1, opset=20),
    "onnx_gelu_tanh": _model("Gelu", "", 1, opset=20, approximate="tanh"),
    "erf": _model("Erf", "", 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_onnxruntime(name):
    model = CASES[name]
    x = (np.random.default_rng(len(name)).standard_normal((2, 3, 40)) * 3).astype(np.float32)
    session = Session(model, threads=1)
    assert session.fallback_nodes == []
    got = session.run({"x": x})["y"]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bias_of_another_shape_is_refused_by_name():
    session = Session(_model("BiasGelu", "com.microsoft", 2, np.ones(7, np.float32)), threads=1)
    with pytest.raises(OperatorError, match=r"BiasGelu node 'g'.*bias must be 1-D of x's last dimension \(40,\)"):
        session.run({"x": np.ones((2, 3, 40), np.float32)})


@pytest.mark.parametrize("name", ["ms_gelu", "onnx_gelu", "erf"])
def test_a_scalar_keeps_its_shape(name):
    model = onnx.ModelProto()
    model.CopyFrom(CASES[name])
    model.graph.input[0].type.tensor_type.shape.ClearField("dim")
    x = np.array(0.5, np.float32)
    got = Session(model, threads=1).run({"x": x})["y"]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.shape == want.shape == ()
    np.testing.assert_allclose(got, want, rtol=1e-6)
