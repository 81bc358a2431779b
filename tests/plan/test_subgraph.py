"""A subgraph wrapped as a model of its own: its scope, constants held outside the proto, declared types."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx import helper as h

from onnxkv.errors import ModelError
from onnxkv.plan.subgraph import subgraph_model


def _body(inputs=None, outputs=None):
    inputs = inputs or [h.make_tensor_value_info("i", TensorProto.INT64, [1, 2])]
    nodes = [
        h.make_node("Add", ["w", "d"], ["s"]),
        h.make_node("Add", ["s", "x"], ["t"]),
        h.make_node("Cast", ["i"], ["y"], to=TensorProto.FLOAT),
        h.make_node("Add", ["y", "t"], ["out"]),
    ]
    return h.make_graph(nodes, "body", inputs, outputs or [h.make_tensor_value_info("out", TensorProto.FLOAT, None)])


def test_known_scope_values_become_initializers_held_outside_and_the_rest_is_fed():
    w = np.arange(3, dtype=np.float32)
    constants = {"w": w, "d": np.ones(3, np.float32), "x": None}
    model, external, scope = subgraph_model(_body(), {"": 17}, constants, {"d"}, "Loop node 'l': attribute 'body'")
    assert scope == ["d", "x"]  # 'd' may be overridden by a feed, 'x' is not known at build time
    assert external == {"w": w} and external["w"] is w  # no copy
    (init,) = model.graph.initializer
    assert (init.name, list(init.dims), init.data_type, init.data_location) == (
        "w",
        [3],
        TensorProto.FLOAT,
        TensorProto.EXTERNAL,
    )
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]


def test_declared_input_shapes_are_dropped_and_the_subgraph_itself_is_left_alone():
    graph = _body()
    model, _, _ = subgraph_model(graph, {"": 17}, {}, set(), "where")
    assert not model.graph.input[0].type.tensor_type.HasField("shape")
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.INT64
    assert graph.input[0].type.tensor_type.HasField("shape") and len(graph.initializer) == 0


@pytest.mark.parametrize(
    "kind, value, what",
    [
        ("input", onnx.helper.make_tensor_sequence_value_info("i", TensorProto.FLOAT, None), "a sequence"),
        (
            "output",
            onnx.helper.make_value_info(
                "out", onnx.helper.make_optional_type_proto(onnx.helper.make_tensor_type_proto(TensorProto.FLOAT, None))
            ),
            "an optional",
        ),
    ],
)
def test_values_that_are_not_tensors_are_model_errors_naming_them(kind, value, what):
    graph = _body(inputs=[value]) if kind == "input" else _body(outputs=[value])
    with pytest.raises(
        ModelError,
        match=rf"If node 'n': attribute 'then_branch': subgraph {kind} "
        rf"'{value.name}' is {what}; onnxkv runs tensor values only",
    ):
        subgraph_model(graph, {"": 17}, {}, set(), "If node 'n': attribute 'then_branch'")


def test_untyped_inputs_are_tensors_of_any_element_type():
    untyped = onnx.ValueInfoProto(name="i")
    model, _, _ = subgraph_model(_body(inputs=[untyped]), {"": 17}, {}, set(), "where")
    assert model.graph.input[0].name == "i"
