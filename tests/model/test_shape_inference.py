"""Alias-aware shape inference: equivalence classes, conflicts and the CacheUpdate capacity check."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxkv.model.contract import ContractError, OutputAlias, set_alias_of, set_output_alias, set_persistent_bindings
from onnxkv.model.shape_inference import infer_shapes

F32 = TensorProto.FLOAT


def vi(name, shape, elem_type=F32):
    return helper.make_tensor_value_info(name, elem_type, shape)


def update_model(
    past_shape=(1, 2, 8, 4),
    new_shape=(1, 2, 1, 4),
    present=None,
    position=None,
    extra_nodes=(),
    extra_inputs=(),
    alias=True,
    imports=("ai.onnxkv",),
):
    """``past -> CacheUpdate(past, new_kv, position) -> present -> Identity -> out``."""
    update = helper.make_node(
        "CacheUpdate", ["past", "new_kv", "position"], ["present"], name="update", domain="ai.onnxkv"
    )
    if alias:
        set_output_alias(update, [OutputAlias(0, 0)])
    initializer = [] if position is None else [numpy_helper.from_array(np.asarray(position, np.int64), "position")]
    graph = helper.make_graph(
        [*extra_nodes, update, helper.make_node("Identity", ["present"], ["out"], name="attend")],
        "decoder",
        [vi("past", past_shape), vi("new_kv", new_shape), *extra_inputs],
        [present or vi("present", None), vi("out", None)],
        initializer=initializer,
    )
    opsets = [helper.make_opsetid("", 21)] + [helper.make_opsetid(domain, 1) for domain in imports]
    return helper.make_model(graph, opset_imports=opsets)


def test_output_learns_the_shape_of_its_aliased_input_and_consumers_follow():
    shapes = infer_shapes(update_model(position=0))
    assert shapes["present"] == (1, 2, 8, 4)
    assert shapes["out"] == (1, 2, 8, 4)


def test_without_an_alias_nothing_is_learned():
    shapes = infer_shapes(update_model(position=0, alias=False))
    assert "present" not in shapes and "out" not in shapes


def test_custom_domains_without_an_opset_import_are_tolerated():
    assert infer_shapes(update_model(position=0, imports=()))["out"] == (1, 2, 8, 4)


def test_symbolic_dims_propagate():
    shapes = infer_shapes(update_model(past_shape=("batch", 2, "capacity", 4), new_shape=("batch", 2, "new", 4)))
    assert shapes["present"] == shapes["out"] == ("batch", 2, "capacity", 4)


def test_a_known_dim_on_either_side_holds_for_both():
    shapes = infer_shapes(update_model(past_shape=("batch", 2, "capacity", 4), present=vi("present", [1, 2, 8, None])))
    assert shapes["past"] == shapes["present"] == shapes["out"] == (1, 2, 8, 4)


def test_differing_symbols_are_left_alone():
    graph = helper.make_graph(
        [helper.make_node("Concat", ["past", "new_kv"], ["present"], axis=2)],
        "g",
        [vi("past", [1, 2, "past_len", 4]), vi("new_kv", [1, 2, 1, 4])],
        [vi("present", [None, 2, "total_len", 4])],
    )
    set_persistent_bindings(graph, {"past": "present"})
    shapes = infer_shapes(helper.make_model(graph))
    assert shapes["past"] == (1, 2, "past_len", 4)
    assert shapes["present"] == (1, 2, "total_len", 4)


def test_a_persistent_binding_links_its_input_and_output():
    graph = helper.make_graph(
        [helper.make_node("Relu", ["state"], ["next_state"])], "g", [vi("state", None)], [vi("next_state", [3, 5])]
    )
    set_persistent_bindings(graph, {"state": "next_state"})
    assert infer_shapes(helper.make_model(graph))["state"] == (3, 5)


def test_alias_of_links_its_values():
    model = update_model(position=0, alias=False)
    set_alias_of(model.graph.output[0], "past")
    assert infer_shapes(model)["present"] == (1, 2, 8, 4)


def test_conflicting_dims_name_both_values():
    with pytest.raises(
        ContractError,
        match=re.escape(
            "values 'past' and 'present' alias each other (alias class ['past', 'present']) but dim 3 is 4 vs 5"
        ),
    ):
        infer_shapes(update_model(present=vi("present", [1, 2, 8, 5])))


def test_conflicting_element_types_name_both_values():
    with pytest.raises(ContractError, match="values 'past' and 'present' .* element types FLOAT and INT8"):
        infer_shapes(update_model(present=vi("present", None, TensorProto.INT8)))


def test_missing_alias_output_is_reported():
    model = update_model()
    set_output_alias(model.graph.node[0], [OutputAlias(2, 0)])
    with pytest.raises(
        ContractError, match=re.escape("node 'update' (ai.onnxkv::CacheUpdate): output_alias names output 2")
    ):
        infer_shapes(model)


@pytest.mark.parametrize("position", [0, 7, [7], [3, 7]])
def test_updates_that_fit_pass(position):
    shapes = infer_shapes(update_model(position=position))
    assert shapes["present"] == (1, 2, 8, 4)


@pytest.mark.parametrize(
    "position,new_length,message",
    [
        (8, 1, "position 8 + update length 1 of 'new_kv' exceeds the capacity 8 of cache 'past'"),
        (6, 3, "position 6 + update length 3 of 'new_kv' exceeds the capacity 8 of cache 'past'"),
        ([0, 8], 1, "position 8 + update length 1"),
    ],
)
def test_capacity_overflow_names_the_node(position, new_length, message):
    with pytest.raises(ContractError, match=re.escape("node 'update' (ai.onnxkv::CacheUpdate): " + message)):
        infer_shapes(update_model(new_shape=(1, 2, new_length, 4), position=position))


def test_capacity_check_reads_constant_nodes():
    constant = helper.make_node("Constant", [], ["position"], value_int=9)
    with pytest.raises(ContractError, match="position 9 \\+ update length 1"):
        infer_shapes(update_model(extra_nodes=[constant]))


@pytest.mark.parametrize(
    "model",
    [
        update_model(past_shape=(1, 2, "capacity", 4), position=100),
        update_model(new_shape=(1, 2, "new", 4), position=100),
        update_model(extra_inputs=[vi("position", [], TensorProto.INT64)]),
    ],
)
def test_capacity_check_skips_unknown_dims_and_positions(model):
    infer_shapes(model)


def test_external_weights_are_typed_without_being_read(tmp_path):
    weight = numpy_helper.from_array(np.ones((64, 48), np.float32), "weight")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "weight"], ["y"])],
        "g",
        [vi("x", ["n", 64])],
        [vi("y", None)],
        initializer=[weight],
    )
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph), path, save_as_external_data=True, location="w.bin", size_threshold=0)
    for loaded in (onnx.load(path, load_external_data=False), onnx.load(path)):
        shapes = infer_shapes(loaded)
        assert shapes["y"] == ("n", 48) and shapes["weight"] == (64, 48)


def test_an_overridable_initializer_is_not_a_constant_position():
    model = update_model(position=100)
    model.graph.input.append(vi("position", [], TensorProto.INT64))
    assert infer_shapes(model)["present"] == (1, 2, 8, 4)
