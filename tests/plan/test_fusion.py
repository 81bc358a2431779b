"""Plan-time fusion of the SiLU gate into the compiled silu_mul kernel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from onnxkv import Session
from onnxkv.models.builders import MICRO, build_model

DATA = Path(__file__).resolve().parents[1] / "data"


def _gate_model(swap: bool, expose_sigmoid: bool = False):
    m1_inputs = ["s", "g"] if swap else ["g", "s"]
    nodes = [helper.make_node("Sigmoid", ["g"], ["s"]),
             helper.make_node("Mul", m1_inputs, ["m"]),
             helper.make_node("Mul", ["u", "m"] if swap else ["m", "u"], ["y"], name="gate_mul")]
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


def test_observable_intermediates_block_fusion():
    sess = Session(_gate_model(False, expose_sigmoid=True), threads=1)
    assert [n.op_type for n in sess.plan.nodes] == ["Sigmoid", "Mul", "Mul"]


def test_builder_and_exported_models_fuse_every_layer():
    for model in (build_model("gqa", MICRO), build_model("concat", MICRO), DATA / "genai_tiny_llama",
                  DATA / "torch_tiny_llama" / "model.onnx"):
        sess = Session(model, threads=1)
        assert sum(n.op_type == "SiluMul" for n in sess.plan.nodes) == 2, model
        assert not any(n.op_type == "Sigmoid" for n in sess.plan.nodes)
