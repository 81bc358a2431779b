"""GeGLU gates of exports fused into ai.onnxkv::GeluTanhMul (onnxkv.plan.fusion_gelu).

The chain as torch.onnx.export writes Gemma's gelu_pytorch_tanh(gate) * up, in
several operand orders and with Pow for the cube, against onnx.reference;
chains with another constant or an observable intermediate stay unfused; the
Gemma fixtures fuse every layer's gate.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxkv
from onnxkv.plan.ops import activation

DATA = Path(__file__).resolve().parents[1] / "data" / "arch"


def _gate_model(swap: bool = False, pow_cube: bool = False, half: float = 0.5, observe: str | None = None,
                dtype=np.float32) -> onnx.ModelProto:  # fmt: skip
    """y = gelu_tanh(g) * up in the exporter's nodes; ``swap`` reverses every binary operand order."""

    def bin_(op, a, b, out):
        return helper.make_node(op, [b, a] if swap else [a, b], [out])

    consts = {"c": 0.044715, "a": float(np.sqrt(2 / np.pi)), "one": 1.0, "half": half, "three": 3.0}
    nodes = []
    if pow_cube:
        nodes.append(helper.make_node("Pow", ["g", "three"], ["g3"]))
    else:
        nodes += [bin_("Mul", "g", "g", "g2"), bin_("Mul", "g", "g2", "g3")]
    nodes += [
        bin_("Mul", "c", "g3", "t"),
        bin_("Add", "g", "t", "s"),
        bin_("Mul", "a", "s", "u"),
        helper.make_node("Tanh", ["u"], ["th"]),
        bin_("Add", "one", "th", "p"),
        bin_("Mul", "g", "p", "d"),
        bin_("Mul", "half", "d", "h"),
        bin_("Mul", "h", "up", "y"),
    ]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inputs = [helper.make_tensor_value_info(x, elem, ["N", 8]) for x in ("g", "up")]
    outputs = [helper.make_tensor_value_info("y", elem, None)]
    if observe:
        outputs.append(helper.make_tensor_value_info(observe, elem, None))
    inits = [numpy_helper.from_array(np.array(v, dtype), k) for k, v in consts.items()]
    graph = helper.make_graph(nodes, "geglu", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _run(model, dtype=np.float32):
    rng = np.random.default_rng(4)
    feeds = {"g": (rng.standard_normal((5, 8)) * 3).astype(dtype), "up": rng.standard_normal((5, 8)).astype(dtype)}
    sess = onnxkv.Session(model, threads=1)
    got = sess.run(feeds)["y"]
    want = ReferenceEvaluator(model).run(["y"], feeds)[0]
    return sess, got, want


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("pow_cube", [False, True])
def test_the_exported_chain_is_one_kernel_call(swap, pow_cube, monkeypatch):
    calls = []
    real = activation.K.gelu_tanh_mul
    monkeypatch.setattr(activation.K, "gelu_tanh_mul", lambda *a: (calls.append(1), real(*a)))
    sess, got, want = _run(_gate_model(swap, pow_cube))
    assert [n.op_type for n in sess.plan.nodes] == ["GeluTanhMul"] and calls == [1]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("case", ["other_constant", "observed"])
def test_chains_that_are_not_the_gate_stay_unfused(case):
    model = _gate_model(half=0.6) if case == "other_constant" else _gate_model(observe="th")
    sess, got, want = _run(model)
    assert "GeluTanhMul" not in [n.op_type for n in sess.plan.nodes]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_float16_gates_evaluate_the_body():
    sess, got, want = _run(_gate_model(dtype=np.float16), np.float16)
    assert [n.op_type for n in sess.plan.nodes] == ["GeluTanhMul"]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_exports_fuse_every_layers_gate(arch):
    ops = [n.op_type for n in onnxkv.Session(DATA / arch / "torch" / "model.onnx", threads=1).plan.nodes]
    assert ops.count("GeluTanhMul") == 2 and "Tanh" not in ops[: ops.index("GeluTanhMul") + 20]
