"""Shape operators given hostile values: sizes asked for and indices are checked before any allocation."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxkv import InputError, OperatorError, Session


def _session(op, inputs, **attrs):
    """A session of one ``op`` node named 'n' whose inputs are the graph inputs ``inputs`` (name -> array)."""
    node = helper.make_node(op, list(inputs), ["y"], name="n", **attrs)
    g_in = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in inputs.items()
    ]
    g = helper.make_graph([node], "g", g_in, [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)])
    return Session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), threads=1)


@pytest.mark.parametrize(
    "op,inputs,match",
    [
        ("ConstantOfShape", {"s": np.array([4, -1])}, r"ConstantOfShape node 'n': shape \[4, -1\] has a negative dim"),
        (
            "ConstantOfShape",
            {"s": np.array([1 << 62, 1 << 62])},
            r"ConstantOfShape node 'n': shape .* needs "
            r"\d+ bytes, more than this machine's memory",
        ),
        ("Expand", {"x": np.ones(1, np.float32), "s": np.array([1 << 40, 1 << 30])}, r"Expand node 'n': shape .* more"),
        ("Expand", {"x": np.ones(1, np.float32), "s": np.array([-3])}, r"Expand node 'n': shape \[-3\] has a negative"),
        (
            "Tile",
            {"x": np.ones((2, 2), np.float32), "r": np.array([1 << 62, 4])},
            r"Tile node 'n': output shape .* more",
        ),
        (
            "Tile",
            {"x": np.ones((2, 2), np.float32), "r": np.array([-1, 4])},
            r"Tile node 'n': repeats \[-1, 4\] has a neg",
        ),
        ("Tile", {"x": np.ones((2, 2), np.float32), "r": np.array([2])}, r"Tile node 'n': repeats \[2\] must have one"),
        (
            "Range",
            {"a": np.array(0), "b": np.array(1 << 62), "c": np.array(1)},
            r"Range node 'n': output shape "
            r"\[4611686018427387904\].* more than",
        ),
        (
            "Range",
            {"a": np.array(0.0), "b": np.array(np.inf), "c": np.array(1.0)},
            r"Range node 'n': .*limit inf.*finite",
        ),
        ("Range", {"a": np.array(0.0), "b": np.array(4.0), "c": np.array(np.nan)}, r"Range node 'n': .*delta nan"),
        ("Range", {"a": np.array(0), "b": np.array(4), "c": np.array(0)}, r"Range node 'n': .*non-zero delta"),
    ],
)
def test_sizes_asked_for_at_run_time_are_checked_before_allocating(op, inputs, match):
    sess = _session(op, inputs)
    with pytest.raises(InputError, match=match):
        sess.run(inputs)


def test_reasonable_sizes_still_run():
    assert _session("ConstantOfShape", {"s": np.array([2, 3])}).run({"s": np.array([2, 3])})["y"].shape == (2, 3)
    feeds = {"a": np.array(10), "b": np.array(0), "c": np.array(-3)}
    np.testing.assert_array_equal(_session("Range", feeds).run(feeds)["y"], [10, 7, 4, 1])
    feeds = {"a": np.array(0.5), "b": np.array(2.0), "c": np.array(0.5)}
    np.testing.assert_array_equal(_session("Range", feeds).run(feeds)["y"], [0.5, 1.0, 1.5])


@pytest.mark.parametrize(
    "op,index,attrs",
    [
        ("Gather", np.array([0, -3]), {}),
        ("Gather", np.array([2]), {}),
        ("Gather", np.array([[0, 2]]), {"axis": 1}),
        ("GatherElements", np.array([[0, -5]]), {"axis": 1}),
        ("GatherElements", np.array([[0], [-4]]), {}),
        ("GatherND", np.array([[0, -3]]), {}),
        ("GatherND", np.array([[-5, 0]]), {}),
    ],
)
def test_indices_outside_the_axis_are_an_operator_error_naming_the_node(op, index, attrs):
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    sess = _session(op, {"x": x, "i": index}, **attrs)
    with pytest.raises(OperatorError, match=rf"{op} node 'n': indices \(input 'i'\) must be in \[-2, 1\]"):
        sess.run({"x": x, "i": index})


def test_gather_elements_indices_smaller_than_the_data_read_their_own_positions():
    x = np.arange(9, dtype=np.float32).reshape(3, 3)
    feeds = {"x": x, "i": np.array([[2, 0]])}
    np.testing.assert_array_equal(_session("GatherElements", feeds, axis=1).run(feeds)["y"], [[2, 0]])
    feeds = {"x": x, "i": np.array([[0], [1], [2], [0]])}
    with pytest.raises(OperatorError, match=r"GatherElements node 'n': indices of shape \(4, 1\) do not fit"):
        _session("GatherElements", feeds, axis=1).run(feeds)


def test_indices_at_the_ends_of_the_range_are_taken_as_onnx_says():
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    feeds = {"x": x, "i": np.array([[-2, 1]])}
    np.testing.assert_array_equal(_session("GatherElements", feeds, axis=1).run(feeds)["y"], [[0, 1]])
    feeds = {"x": x, "i": np.array([[-2, -1]])}
    np.testing.assert_array_equal(_session("GatherND", feeds).run(feeds)["y"], [1])
    feeds = {"x": x, "i": np.array([-2, 1])}
    np.testing.assert_array_equal(_session("Gather", feeds).run(feeds)["y"], x[[0, 1]])


@pytest.mark.parametrize("axis", range(-4, 5))
def test_flatten_takes_every_axis_from_minus_rank_to_rank(axis):
    """A negative axis counts from the end (-1 keeps the last dim as columns); the rank itself gives one row."""
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    got = _session("Flatten", {"x": x}, axis=axis).run({"x": x})["y"]
    rows = int(np.prod(x.shape[: axis + 4 if axis < 0 else axis]))
    assert got.shape == (rows, x.size // rows)
    np.testing.assert_array_equal(got.reshape(-1), x.reshape(-1))


@pytest.mark.parametrize("axis", [-5, 5])
def test_flatten_axis_beyond_the_rank_is_an_operator_error_naming_the_node(axis):
    x = np.zeros((2, 3, 4, 5), np.float32)
    with pytest.raises(
        OperatorError,
        match=rf"Flatten node 'n': axis {axis} must be in \[-4, 4\] for an input of "
        r"shape \(2, 3, 4, 5\)",
    ):
        _session("Flatten", {"x": x}, axis=axis).run({"x": x})


@pytest.mark.parametrize("width", [6, 7])
def test_float16_embedding_rows_are_gathered_bit_for_bit(width, monkeypatch):
    """A float16 table's rows (a float16 file's embedding): an even width through the gather kernel (the same
    bytes, NaN payloads and signed zeros included), an odd one through NumPy; both np.take's values, negative
    indices too."""
    from onnxkv.plan.ops import shape as shape_ops

    calls = []
    real = shape_ops.gather_rows
    monkeypatch.setattr(shape_ops, "gather_rows", lambda *a: calls.append(a[0].dtype) or real(*a))
    rng = np.random.default_rng(5)
    table = rng.standard_normal((9, width)).astype(np.float16)
    table.view(np.uint16)[2, :2] = [0x7E01, 0x8000]  # a NaN with a payload, -0.0
    idx = np.array([[2, -1, 0], [8, 2, -9]], np.int64)
    got = _session("Gather", {"t": table, "i": idx}).run({"t": table, "i": idx})["y"]
    np.testing.assert_array_equal(got.view(np.uint16), np.take(table, idx, axis=0).view(np.uint16))
    assert calls == ([np.float32] if width % 2 == 0 else [])


@pytest.mark.parametrize("shape,perm,view", [((1, 1, 4, 8), [0, 2, 1, 3], True), ((1, 3, 4, 8), [0, 2, 1, 3], False)])
def test_a_transpose_of_unit_axes_is_a_view_and_any_other_a_contiguous_copy(shape, perm, view):
    from onnxkv.plan.ops.shape import Transpose

    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    session = _session("Transpose", {"x": x}, perm=perm)
    op = session.plan.kernels[0]
    assert isinstance(op, Transpose)
    y = session.run({"x": x})["y"]
    np.testing.assert_array_equal(y, x.transpose(perm))
    assert y.flags.c_contiguous
    (direct,) = op.run([x], _numpy_rt())
    assert np.shares_memory(direct, x) == view


def _numpy_rt():
    from onnxkv.plan.context import RunContext

    return RunContext(lambda _rt, _i, shape, dtype: np.empty(shape, dtype), False, 0)
