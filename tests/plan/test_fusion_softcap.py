"""Tanh caps outside attention fused into ai.onnxkv::Softcap (onnxkv.plan.fusion_softcap).

The chain as torch.onnx.export writes Gemma 2's final logit cap, in both Mul
operand orders, against onnx.reference; caps of two values, computed caps and
observable intermediates keep the body or stay unfused; the Gemma 2 fixture's
logits are capped by one kernel call, compiled in its decode steps.
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


def _cap_model(swap: bool = False, c: float = 30.0, c2: float = 30.0, observe: str | None = None,
               dtype=np.float32, computed: bool = False) -> onnx.ModelProto:  # fmt: skip
    """y = Mul(Tanh(Div(x, c)), c2); ``swap`` puts c2 first; ``computed`` feeds c as a graph input."""
    nodes = [
        helper.make_node("Div", ["x", "c"], ["d"]),
        helper.make_node("Tanh", ["d"], ["t"]),
        helper.make_node("Mul", ["c2", "t"] if swap else ["t", "c2"], ["y"]),
    ]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inputs = [helper.make_tensor_value_info("x", elem, ["N", 50])]
    inits = [numpy_helper.from_array(np.array(c2, dtype), "c2")]
    if computed:
        inputs.append(helper.make_tensor_value_info("c", elem, []))
    else:
        inits.append(numpy_helper.from_array(np.array([c], dtype), "c"))
    outputs = [helper.make_tensor_value_info("y", elem, None)]
    if observe:
        outputs.append(helper.make_tensor_value_info(observe, elem, None))
    graph = helper.make_graph(nodes, "cap", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _run(model, dtype=np.float32, feeds=None):
    rng = np.random.default_rng(8)
    feeds = {"x": (rng.standard_normal((3, 50)) * 60).astype(dtype), **(feeds or {})}
    sess = onnxkv.Session(model, threads=1)
    got = sess.run(feeds)["y"]
    want = ReferenceEvaluator(model).run(["y"], feeds)[0]
    return sess, got, want


@pytest.mark.parametrize("swap", [False, True])
def test_the_exported_cap_is_one_kernel_call(swap, monkeypatch):
    calls = []
    real = activation.K.softcap
    monkeypatch.setattr(activation.K, "softcap", lambda *a: (calls.append(1), real(*a)))
    sess, got, want = _run(_cap_model(swap))
    assert [n.op_type for n in sess.plan.nodes] == ["Softcap"] and calls == [1]
    np.testing.assert_allclose(got, want, rtol=4e-7, atol=0)


@pytest.mark.parametrize("case", ["two_values", "computed", "float16"])
def test_caps_the_kernel_cannot_take_evaluate_the_body(case, monkeypatch):
    monkeypatch.setattr(activation.K, "softcap", lambda *a: pytest.fail("the kernel ran"))
    if case == "two_values":
        sess, got, want = _run(_cap_model(c2=20.0))
    elif case == "computed":
        sess, got, want = _run(_cap_model(computed=True), feeds={"c": np.array(30.0, np.float32)})
    else:
        sess, got, want = _run(_cap_model(dtype=np.float16), np.float16)
    assert [n.op_type for n in sess.plan.nodes] == ["Softcap"]
    np.testing.assert_array_equal(got, want)


def test_an_observed_quotient_stays_unfused():
    sess, got, want = _run(_cap_model(observe="d"))
    assert "Softcap" not in [n.op_type for n in sess.plan.nodes]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_gemma2_logits_are_capped_by_one_node():
    """The fixture's final cap (30) is one Softcap node; the attention blocks keep their own caps (the
    compiled decode steps that replay it: tests/plan/test_compiled_step_exports.py)."""
    sess = onnxkv.Session(DATA / "gemma2" / "torch" / "model.onnx", threads=1)
    ops = [n.op_type for n in sess.plan.nodes]
    assert ops.count("Softcap") == 1 and ops.count("MaskedAttention") == 2 and "Tanh" not in ops
    (cap,) = (k for k, n in zip(sess.plan.kernels, sess.plan.nodes) if n.op_type == "Softcap")
    np.testing.assert_array_equal(cap._cap, np.array([30.0], np.float32))
