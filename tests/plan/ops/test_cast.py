"""Cast and CastLike to the float 8 types: ``saturate`` and ``round_mode`` as the operator says; to strings.

Checked against onnx.reference, and against the values the operator's tables give.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxkv import ModelError, Session

F8 = [TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ]
#: In range, beyond every float 8 range (both signs; float16 holds them), infinities, NaN, tiny, ties.
VALUES = np.array([0.0, 1.0, -2.5, 3.0, 5.0, 300.0, 6.2e4, -6.2e4, np.inf, -np.inf, np.nan, 1e-9, 0.1875], np.float32)


def _model(op: str, x: np.ndarray, like: np.ndarray | None = None, **attrs):
    inputs = {"x": x} if like is None else {"x": x, "like": like}
    node = helper.make_node(op, list(inputs), ["y"], name="n", **attrs)
    g_in = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in inputs.items()
    ]
    graph = helper.make_graph([node], "g", g_in, [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)]), inputs


def _check(op: str, x: np.ndarray, like: np.ndarray | None = None, **attrs) -> np.ndarray:
    model, feeds = _model(op, x, like, **attrs)
    got = Session(model, threads=1).run(feeds)["y"]
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    assert got.shape == want.shape
    if want.dtype.kind in "OU":  # strings: onnxkv holds them as objects, onnx.reference as NumPy str
        assert got.dtype == object
        np.testing.assert_array_equal(got.astype(str), want)
    else:
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    return got


@pytest.mark.parametrize("to", F8)
@pytest.mark.parametrize("saturate", [0, 1])
@pytest.mark.parametrize("source", [np.float32, np.float16])
def test_cast_to_float8_saturates_only_when_asked(to, saturate, source):
    x = VALUES.astype(source)
    got = _check("Cast", x, to=to, saturate=saturate).astype(np.float32)
    big = np.abs(x.astype(np.float32)) > 61440  # beyond every float 8 range, infinities included
    if saturate:
        assert np.isfinite(got[big]).all() and (np.abs(got[big]) == np.abs(got[big]).max()).all()
    else:
        assert not np.isfinite(got[big]).any()


@pytest.mark.parametrize("to", F8)
def test_castlike_to_float8_saturates_by_default(to):
    like = np.zeros(0, helper.tensor_dtype_to_np_dtype(to))
    got = _check("CastLike", VALUES, like).astype(np.float32)
    assert np.isfinite(got[[6, 7, 8, 9]]).all()
    _check("CastLike", VALUES, like, saturate=0)


@pytest.mark.parametrize("round_mode,want", [("up", [4, 8, 0.25]), ("down", [2, 4, 0.125]), ("nearest", [4, 4, 0.25])])
@pytest.mark.parametrize("saturate", [0, 1])
def test_cast_to_float8e8m0_rounds_as_round_mode_says(round_mode, want, saturate):
    got = _check(
        "Cast",
        np.array([3.0, 5.0, 0.1875], np.float32),
        to=TensorProto.FLOAT8E8M0,
        saturate=saturate,
        round_mode=round_mode,
    )
    np.testing.assert_array_equal(got.astype(np.float32), want)
    _check("Cast", VALUES, to=TensorProto.FLOAT8E8M0, saturate=saturate, round_mode=round_mode)


def test_cast_and_castlike_to_string_give_the_decimal_text():
    got = _check("Cast", VALUES, to=TensorProto.STRING)
    assert list(got[:3]) == ["0.0", "1.0", "-2.5"]
    _check("CastLike", VALUES, np.array(["a"], dtype=object))


@pytest.mark.parametrize(
    "attrs,match",
    [
        ({"saturate": 2}, r"Cast node 'n': attribute saturate must be 0 or 1, got 2"),
        (
            {"round_mode": "half"},
            r"Cast node 'n': attribute round_mode must be one of \['up', 'down', 'nearest'\], "
            r"got 'half'",
        ),
    ],
)
def test_bad_cast_attributes_are_model_errors_naming_the_node(attrs, match):
    model, _ = _model("Cast", VALUES, to=TensorProto.FLOAT8E8M0, **attrs)
    with pytest.raises(ModelError, match=match):
        Session(model, threads=1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_a_cast_to_the_inputs_own_type_is_a_copy_compilable_for_float32(dtype):
    x = (np.arange(12).reshape(3, 4) - 5).astype(dtype)
    model, feeds = _model("Cast", x, to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
    sess = Session(model, threads=1)
    y = sess.run(feeds)["y"]
    np.testing.assert_array_equal(y, x)
    assert y.dtype == x.dtype and not np.shares_memory(y, feeds["x"])
    assert sess.plan.kernels[0].compilable([x]) == (dtype == np.float32)
