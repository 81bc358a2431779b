"""MatMulInteger and DynamicQuantizeLinear through Session: ONNX Runtime's results on the same file bit
for bit (constant and run-time weights, every zero-point form, batched and 1-D A), the weight packed
once and absorbed, and errors naming the node for inputs the operator does not take."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxkv import Session
from onnxkv.errors import ModelError, OperatorError
from onnxkv.plan.ops.matmul_integer import MatMulInteger

ort = pytest.importorskip("onnxruntime")

_ELEM = {np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int8): TensorProto.INT8}


def _ints(rng, dtype, shape):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


def integer_model(a_shape, b, az=None, bz=None, *, b_const=True, bz_const=True, adt=np.uint8) -> onnx.ModelProto:
    """y = MatMulInteger(a, B, a_zero_point, b_zero_point): a (and a_zero_point) fed; B and b_zero_point
    initializers or fed."""
    inits, feeds = [], [helper.make_tensor_value_info("a", _ELEM[np.dtype(adt)], list(a_shape))]
    names = ["a", "B", "", ""]
    if b_const:
        inits.append(numpy_helper.from_array(b, "B"))
    else:
        feeds.append(helper.make_tensor_value_info("B", _ELEM[b.dtype], list(b.shape)))
    if az is not None:
        names[2] = "az"
        feeds.append(helper.make_tensor_value_info("az", _ELEM[az.dtype], list(az.shape)))
    if bz is not None:
        names[3] = "bz"
        if bz_const:
            inits.append(numpy_helper.from_array(bz, "bz"))
        else:
            feeds.append(helper.make_tensor_value_info("bz", _ELEM[bz.dtype], list(bz.shape)))
    while not names[-1]:
        names.pop()
    node = helper.make_node("MatMulInteger", names, ["y"], name="mmi")
    graph = helper.make_graph([node], "g", feeds, [helper.make_tensor_value_info("y", TensorProto.INT32, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _ort(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    s = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)[0]


CASES = [  # (A shape, N, a dtype, b dtype, a zero point kind, b zero point kind)
    ((1, 64), 40, np.uint8, np.int8, "one", "one"),
    ((3, 37), 17, np.uint8, np.int8, "none", "each"),
    ((5, 128), 64, np.uint8, np.uint8, "one", "each"),
    ((2, 4, 33), 16, np.uint8, np.int8, "row", "one"),
    ((7, 19), 5, np.int8, np.int8, "one", "none"),
    ((19,), 9, np.uint8, np.int8, "one", "one"),
]


def _zp(rng, dtype, kind, rows, cols):
    return {
        "none": None,
        "one": _ints(rng, dtype, ()),
        "row": _ints(rng, dtype, (rows,)),
        "each": _ints(rng, dtype, (cols,)),
    }[kind]


@pytest.mark.parametrize("b_const", [True, False], ids=["packed", "runtime_B"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"A{list(c[0])}xN{c[1]}")
def test_equals_onnxruntime(case, b_const):
    a_shape, N, adt, bdt, az_kind, bz_kind = case
    rng = np.random.default_rng(len(a_shape) * 100 + N)
    K = a_shape[-1]
    rows = a_shape[-2] if len(a_shape) >= 2 else 1
    a, b = _ints(rng, adt, a_shape), _ints(rng, bdt, (K, N))
    az, bz = _zp(rng, adt, az_kind, rows, N), _zp(rng, bdt, bz_kind, rows, N)
    model = integer_model(a_shape, b, az, bz, b_const=b_const, adt=adt)
    feeds = {"a": a} | ({"az": az} if az is not None else {}) | ({} if b_const else {"B": b})
    session = Session(model, threads=1)
    (k,) = [k for k in session.plan.kernels if isinstance(k, MatMulInteger)]
    assert (k.weight is not None) == b_const
    got = session.run(feeds)["y"]
    # ONNX Runtime takes one a_zero_point only, and onnx.reference subtracts a 1-D one along K: per-row zero
    # points (as the ONNX specification defines them) are checked against the definition in int64
    if az_kind == "row":
        a64 = a.astype(np.int64) - az.astype(np.int64)[:, None]
        want = (a64 @ (b.astype(np.int64) - (0 if bz is None else bz.astype(np.int64)))).astype(np.int32)
    else:
        want = _ort(model, feeds)
    assert got.dtype == np.int32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert session.fallback_nodes == []


def test_weight_absorbed():
    rng = np.random.default_rng(1)
    b, bz = _ints(rng, np.int8, (64, 48)), _ints(rng, np.int8, (48,))
    session = Session(integer_model((1, 64), b, None, bz), threads=1)
    (k,) = [k for k in session.plan.kernels if isinstance(k, MatMulInteger)]
    assert set(k.absorbed_inputs) == {1, 3} and k.weight.wq.shape == (3, 64 * 16)
    assert all(session.plan._template[session.plan.slot_of[n]] is None for n in ("B", "bz"))


def test_runtime_zero_point_of_a_constant_weight_is_exact():
    """b_zero_point fed at run time: the weight is not packed, and the product is still ONNX Runtime's."""
    rng = np.random.default_rng(2)
    b, bz = _ints(rng, np.uint8, (20, 6)), _ints(rng, np.uint8, (6,))
    model = integer_model((2, 20), b, None, bz, bz_const=False)
    feeds = {"a": _ints(rng, np.uint8, (2, 20)), "bz": bz}
    session = Session(model, threads=1)
    (k,) = [k for k in session.plan.kernels if isinstance(k, MatMulInteger)]
    assert k.weight is None
    np.testing.assert_array_equal(session.run(feeds)["y"], _ort(model, feeds))


def test_load_errors_name_the_node():
    b = np.ones((4, 3), np.int8)
    with pytest.raises(ModelError, match="MatMulInteger node 'mmi': b_zero_point has 2 values; expected 1 or N=3"):
        Session(integer_model((1, 4), b, None, np.array([1, 2], np.int8)))
    with pytest.raises(ModelError, match="MatMulInteger node 'mmi': b_zero_point must be a scalar or 1-D array"):
        Session(integer_model((1, 4), b, None, np.array([1], np.uint8)))


def test_run_errors_name_the_node():
    b = np.ones((4, 3), np.int8)
    session = Session(integer_model(("M", "K"), b, np.zeros(3, np.uint8)), threads=1)
    with pytest.raises(OperatorError, match=r"MatMulInteger node 'mmi'.*a_zero_point must be one value or 2"):
        session.run({"a": np.ones((2, 4), np.uint8), "az": np.zeros(3, np.uint8)})
    with pytest.raises(OperatorError, match=r"MatMulInteger node 'mmi'.*A must be \[\.\.\., 4\]"):
        session.run({"a": np.ones((3, 5), np.uint8), "az": np.zeros(3, np.uint8)})


def test_dynamic_quantize_linear_node():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, 50)) * 7).astype(np.float32)
    x[1, 3] = np.nan
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"], name="dql")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 50])],
        [
            helper.make_tensor_value_info("y", TensorProto.UINT8, None),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("z", TensorProto.UINT8, None),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = Session(model, threads=1)
    got = session.run({"x": x})
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    want = ort.InferenceSession(model.SerializeToString(), options).run(None, {"x": x})
    for name, w in zip(("y", "s", "z"), want):
        assert got[name].dtype == w.dtype and got[name].shape == w.shape
        np.testing.assert_array_equal(got[name], w)
    assert session.fallback_nodes == []


def test_a_zero_point_per_column_given_as_one_row():
    """b_zero_point [1, N] (the N-D form) is one zero point per column, as ONNX Runtime takes it."""
    rng = np.random.default_rng(8)
    b, bz = _ints(rng, np.uint8, (12, 3)), _ints(rng, np.uint8, (1, 3))
    for bz_const in (True, False):
        model = integer_model((2, 12), b, None, bz, bz_const=bz_const)
        feeds = {"a": _ints(rng, np.uint8, (2, 12))} | ({} if bz_const else {"bz": bz})
        np.testing.assert_array_equal(Session(model, threads=1).run(feeds)["y"], _ort(model, feeds))


def test_dynamic_quantize_linear_of_a_scalar_keeps_its_shape():
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"], name="dql")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [])],
        [
            helper.make_tensor_value_info(n, t, None)
            for n, t in (("y", TensorProto.UINT8), ("s", TensorProto.FLOAT), ("z", TensorProto.UINT8))
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.array(3.5, np.float32)
    got = Session(model, threads=1).run({"x": x})
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for name, w in zip(("y", "s", "z"), want):
        assert got[name].shape == w.shape == ()
        np.testing.assert_array_equal(got[name], w)
