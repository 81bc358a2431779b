"""onnxkv.model.well_formed: names that are not text and nodes of the wrong arity are refused at load, naming
the node (both made plan passes and runs raise raw TypeError / IndexError before; found by a fuzzing
helper)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnxkv
from onnxkv import ModelError
from onnxkv.zoo.builders import MICRO, build_model


def _reloaded(model: onnx.ModelProto, old: bytes, new: bytes) -> onnx.ModelProto:
    """``model`` serialized with the bytes ``old`` replaced by ``new`` (same length), parsed again."""
    data = model.SerializeToString()
    assert data.count(old) >= 1 and len(old) == len(new)
    return onnx.ModelProto.FromString(data.replace(old, new))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("op_type", "holds b'MatMu\\\\xff', which is not UTF-8 text"),
        ("value", "names a value, initializer or external-data entry b'past_key_values.0.\\\\xffey'"),
        ("node", "holds b'\\\\xffode_name'"),
    ],
)
def test_names_that_are_not_utf8_are_refused(edit, message):
    model = build_model("gqa", MICRO, seed=1)
    if edit == "op_type":
        node = next(n for n in model.graph.node if n.op_type == "MatMul")
        node.op_type = "MatMuX"
        model = _reloaded(model, b"MatMuX", b"MatMu\xff")
    elif edit == "value":
        model = _reloaded(model, b"past_key_values.0.key", b"past_key_values.0.\xffey")
    else:
        model.graph.node[0].name = "Xode_name"
        model = _reloaded(model, b"Xode_name", b"\xffode_name")
    with pytest.raises(ModelError, match=message):
        onnxkv.Session(model, threads=1)


@pytest.mark.parametrize("op_type", ["MatMul", "Mul", "Reshape", "Transpose", "Sigmoid", "Shape"])
def test_a_node_missing_an_input_is_refused_naming_it(op_type):
    for family in ("gqa", "attention", "concat"):
        model = build_model(family, MICRO, seed=1)
        node = next((n for n in model.graph.node if n.op_type == op_type), None)
        if node is not None:
            break
    assert node is not None
    del node.input[-1]
    with pytest.raises(ModelError, match=f"{op_type} node '{node.name}' lists {len(node.input)} input\\(s\\)"):
        onnxkv.Session(model, threads=1)


def test_required_inputs_need_a_name_and_outputs_a_count():
    model = build_model("gqa", MICRO, seed=1)
    node = next(n for n in model.graph.node if n.op_type == "MatMul")
    node.input[0] = ""
    with pytest.raises(ModelError, match="leaves its required input 0 \\('A'\\) empty"):
        onnxkv.Session(model, threads=1)
    model = build_model("gqa", MICRO, seed=1)
    const = next(n for n in model.graph.node if n.op_type == "Constant")
    const.output.append("extra")
    with pytest.raises(ModelError, match="lists 2 output\\(s\\); opset .* of Constant makes 1 to 1"):
        onnxkv.Session(model, threads=1)


def test_a_constant_with_an_attribute_its_schema_lacks_runs():
    """The Constant is then not folded but run, and its value (an array over the bytes of the model's
    tensor) entered a compiled step, whose walk of array bases met the bytes: AttributeError at the second
    decode step.  Tokens equal those of the model without the attribute."""
    model = build_model("gqa", MICRO, seed=1)
    want = onnxkv.generate(onnxkv.Session(model, threads=1), [[1, 2, 3]], 6, eos_token_id=[]).tokens
    const = next(n for n in model.graph.node if n.op_type == "Constant")
    const.attribute.append(onnx.helper.make_attribute("local_window_size", 2**40))
    got = onnxkv.generate(onnxkv.Session(model, threads=1), [[1, 2, 3]], 6, eos_token_id=[]).tokens
    np.testing.assert_array_equal(got, want)
