"""Stored tensors and attributes: sizes, types and strings checked before any array is made."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuzzing import hypothesis_settings
from hypothesis import given
from hypothesis import strategies as st
from onnx import AttributeProto, TensorProto, helper

from onnxkv import ModelError
from onnxkv.model.tensors import check_attributes, data_nbytes, element_count, tensor_array

#: Element types of the property below, with their numpy dtypes' itemsize (packed types: bits per element).
TYPES = [
    TensorProto.FLOAT,
    TensorProto.INT64,
    TensorProto.INT8,
    TensorProto.FLOAT16,
    TensorProto.BFLOAT16,
    TensorProto.BOOL,
    TensorProto.DOUBLE,
    TensorProto.INT4,
    TensorProto.UINT4,
    TensorProto.UINT2,
    TensorProto.COMPLEX64,
    TensorProto.STRING,
    TensorProto.FLOAT6E2M3,
]


@hypothesis_settings(300)
@given(
    data_type=st.sampled_from(TYPES),
    dims=st.lists(st.integers(-3, 1 << 33), max_size=4),
    raw=st.one_of(st.none(), st.binary(max_size=64)),
    entries=st.integers(0, 40),
)
def test_any_tensor_is_an_array_of_its_dims_or_a_model_error(data_type, dims, raw, entries):
    t = TensorProto(name="t", data_type=data_type, dims=dims)
    if raw is not None:
        t.raw_data = raw
    elif data_type == TensorProto.STRING:
        t.string_data.extend([b"s"] * entries)
    else:
        getattr(t, helper.tensor_dtype_to_field(data_type)).extend([1] * entries)
    try:
        arr = tensor_array(t, "tensor 't'")
    except ModelError as e:
        assert str(e).startswith("tensor 't'")
        return
    assert list(arr.shape) == dims


def test_sizes_are_counted_in_python_ints():
    t = TensorProto(name="t", data_type=TensorProto.FLOAT, dims=[1 << 31, 1 << 31])
    assert element_count(t, "t") == 1 << 62
    assert data_nbytes(TensorProto.FLOAT, 1 << 62, "t") == 1 << 64  # past int64: no overflow
    for dims in ([1 << 40, 1 << 40], [3, 0, (1 << 63) - 1]):  # no array has such a shape, even of 0 elements
        with pytest.raises(ModelError, match="no array has that shape"):
            element_count(TensorProto(name="t", data_type=TensorProto.FLOAT, dims=dims), "t")
    assert data_nbytes(TensorProto.INT4, 3, "t") == 2 and data_nbytes(TensorProto.UINT2, 5, "t") == 2
    with pytest.raises(ModelError, match="STRING tensor"):
        data_nbytes(TensorProto.STRING, 1, "t")


def test_string_tensors_must_be_utf8():
    t = TensorProto(name="t", data_type=TensorProto.STRING, dims=[1], string_data=[b"\xff"])
    with pytest.raises(ModelError, match=r"tensor 't' cannot be read: UnicodeDecodeError"):
        tensor_array(t, "tensor 't'")


def test_unknown_element_type_and_external_data_are_model_errors():
    with pytest.raises(ModelError, match="element type 999"):
        tensor_array(TensorProto(name="t", data_type=999, dims=[1], raw_data=b"\0"), "tensor 't'")
    ext = TensorProto(name="t", data_type=TensorProto.FLOAT, dims=[1], data_location=TensorProto.EXTERNAL)
    with pytest.raises(ModelError, match="external file"):
        tensor_array(ext, "tensor 't'")


def _graph(node):
    return helper.make_graph([node], "g", [], [])


def test_attributes_of_unknown_type_or_without_value_are_rejected():
    node = helper.make_node("Custom", [], ["y"], name="c", domain="ai.onnxkv")
    node.attribute.add(name="a")  # UNDEFINED: also what an unknown type number parses to
    with pytest.raises(ModelError, match=r"Custom node 'c': attribute 'a' has type 0, which is not"):
        check_attributes(_graph(node), {})
    node = helper.make_node("Custom", [], ["y"], name="c", domain="ai.onnxkv")
    node.attribute.add(name="t", type=AttributeProto.TENSOR)
    with pytest.raises(ModelError, match=r"attribute 't' has type TENSOR but no value in its field 't'"):
        check_attributes(_graph(node), {})


def test_schema_types_are_checked_for_standard_operators_only():
    node = helper.make_node("Softmax", ["x"], ["y"], name="s", axis=1.5)
    with pytest.raises(ModelError, match=r"Softmax node 's': attribute 'axis' has type FLOAT, expected INT"):
        check_attributes(_graph(node), {"": 21})
    custom = helper.make_node("Anything", ["x"], ["y"], name="s", domain="ai.onnxkv", axis=1.5)
    check_attributes(_graph(custom), {"": 21, "ai.onnxkv": 1})


def test_subgraph_attributes_and_initializers_are_checked():
    bad = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[8], raw_data=b"\0" * 4)
    body = helper.make_graph([helper.make_node("Identity", ["w"], ["out"])], "b", [], [], [bad])
    node = helper.make_node("If", ["c"], ["y"], name="branch", then_branch=body, else_branch=body)
    with pytest.raises(
        ModelError,
        match=r"If node 'branch': attribute '\w+_branch': initializer 'w' of the subgraph "
        r"holds 4 bytes of raw_data, expected 32",
    ):
        check_attributes(_graph(node), {"": 21})
    inner = helper.make_node("Concat", ["a"], ["out"], name="inner", axis=0)
    inner.attribute[0].CopyFrom(helper.make_attribute("axis", [0, 1]))
    node = helper.make_node(
        "If",
        ["c"],
        ["y"],
        name="branch",
        then_branch=helper.make_graph([inner], "b", [], []),
        else_branch=onnx.GraphProto(),
    )
    with pytest.raises(ModelError, match=r"Concat node 'inner': attribute 'axis' has type INTS, expected INT"):
        check_attributes(_graph(node), {"": 21})


def test_well_formed_tensors_round_trip():
    for arr in (np.arange(6, dtype=np.float32).reshape(2, 3), np.array([True, False]), np.zeros((0, 4), np.int8)):
        np.testing.assert_array_equal(tensor_array(onnx.numpy_helper.from_array(arr, "t"), "t"), arr)
    typed = helper.make_tensor("t", TensorProto.FLOAT16, [2], np.array([1.0, 2.0], np.float16))
    np.testing.assert_array_equal(tensor_array(typed, "t"), [1.0, 2.0])
