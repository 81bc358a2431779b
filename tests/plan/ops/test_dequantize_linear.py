"""DequantizeLinear through Session: ONNX Runtime's results for integer x with float32 scales per tensor
and per axis, at opsets with and without an onnx.reference implementation; other forms through the
fallback where it exists; errors naming the node otherwise."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxkv import Session
from onnxkv.errors import OperatorError

ort = pytest.importorskip("onnxruntime")

_ELEM = {
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
}


def dequantize_model(x_shape, x_dtype, scale, zp=None, opset=13, **attrs):
    inits = [numpy_helper.from_array(scale, "s")] + ([numpy_helper.from_array(zp, "z")] if zp is not None else [])
    node = helper.make_node(
        "DequantizeLinear", ["x", "s"] + (["z"] if zp is not None else []), ["y"], name="dq", **attrs
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", _ELEM[np.dtype(x_dtype)], list(x_shape))],
        [helper.make_tensor_value_info("y", _ELEM[scale.dtype], None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _ints(rng, dtype, shape):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


CASES = [  # (x shape, x dtype, scale shape, zero point, axis)
    ((2, 5, 8), np.uint8, (), True, 1),
    ((7, 16), np.int8, (), False, 1),
    ((3, 6), np.uint8, (6,), True, 1),
    ((4, 3, 2), np.int8, (4,), True, 0),
    ((4, 3, 5), np.uint8, (5,), False, -1),
    ((9,), np.int32, (), False, 1),
    ((1, 3), np.uint8, (1,), True, 0),
    ((4,), np.uint8, (1,), True, 1),  # one scale in a [1] array: per tensor whatever the axis
    ((4, 1), np.int8, (1,), False, -3),
]


@pytest.mark.parametrize("opset", [13, 21])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{np.dtype(c[1]).name}{list(c[0])}s{list(c[2])}")
def test_equals_onnxruntime(case, opset):
    x_shape, x_dtype, s_shape, with_zp, axis = case
    rng = np.random.default_rng(len(x_shape) * 10 + len(s_shape))
    scale = (rng.random(s_shape) + 0.01).astype(np.float32)
    zp = _ints(rng, x_dtype, s_shape) if with_zp and x_dtype != np.int32 else None
    model = dequantize_model(x_shape, x_dtype, scale, zp, opset=opset, axis=axis)
    x = _ints(rng, x_dtype, x_shape)
    session = Session(model, threads=1)
    assert session.fallback_nodes == []
    got = session.run({"x": x})["y"]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_other_forms_take_the_fallback():
    """float16 scales and blocked scales (opset 21) run through onnx.reference, as ONNX Runtime computes them."""
    rng = np.random.default_rng(3)
    x = _ints(rng, np.uint8, (4, 8))
    for model in (
        dequantize_model((4, 8), np.uint8, np.array(0.5, np.float16), np.array(3, np.uint8), opset=21),
        dequantize_model(
            (4, 8), np.uint8, (rng.random((4, 2)) + 0.1).astype(np.float32), None, opset=21, axis=1, block_size=4
        ),
    ):
        got = Session(model, threads=1).run({"x": x})["y"]
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[
            0
        ]
        np.testing.assert_allclose(got, want, rtol=1e-3)


def test_errors_name_the_node():
    model = dequantize_model((2, 3), np.uint8, np.ones(4, np.float32), np.zeros(4, np.uint8), opset=13, axis=1)
    with pytest.raises(OperatorError, match=r"DequantizeLinear node 'dq'.*axis=1 with x \[2, 3\]"):
        Session(model, threads=1).run({"x": np.ones((2, 3), np.uint8)})
    model = dequantize_model((2, 3), np.uint8, np.ones(3, np.float32), np.zeros(2, np.uint8), opset=13, axis=1)
    with pytest.raises(OperatorError, match=r"DequantizeLinear node 'dq'.*x_zero_point \[2\] must match x_scale"):
        Session(model, threads=1).run({"x": np.ones((2, 3), np.uint8)})


def test_int32_differences_wrap_as_onnxruntime_computes_them():
    model = dequantize_model((3,), np.int32, np.array(0.5, np.float32), np.array(-10, np.int32), opset=13)
    x = np.array([2**31 - 1, -(2**31), 5], np.int32)
    got = Session(model, threads=1).run({"x": x})["y"]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
