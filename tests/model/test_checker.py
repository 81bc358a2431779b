"""check_model: one passing model per cache style, one failing model per rule (the message names the culprit)."""

from __future__ import annotations

import re

import pytest
from onnx import TensorProto, helper

from onnxkv.model import _wire
from onnxkv.model.checker import check_model
from onnxkv.model.contract import (
    Access,
    Contract,
    ContractError,
    OutputAlias,
    set_access,
    set_alias_of,
    set_output_alias,
    set_persistent_bindings,
)
from onnxkv.zoo.builders import MICRO, build_model

CACHE = [1, 2, 8, 4]
F32 = TensorProto.FLOAT


def vi(name, shape=CACHE, elem_type=F32):
    return helper.make_tensor_value_info(name, elem_type, shape)


def model_of(nodes, inputs, outputs, initializer=(), bindings=None):
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, initializer=list(initializer))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.onnxkv", 1)])
    if bindings:
        set_persistent_bindings(model.graph, bindings)
    return model


def value(model, name):
    graph = model.graph
    return next(v for v in [*graph.input, *graph.output, *graph.value_info] if v.name == name)


def cache_update_model(position=3, present=None, extra_nodes=(), extra_outputs=()):
    """``past -> CacheUpdate -> present -> Identity -> out`` with ``past <- present``, past READ_WRITE."""
    update = helper.make_node(
        "CacheUpdate", ["past", "new_kv", "position"], ["present"], name="update", domain="ai.onnxkv"
    )
    set_output_alias(update, [OutputAlias(0, 0)])
    nodes = [update, helper.make_node("Identity", ["present"], ["out"], name="attend"), *extra_nodes]
    model = model_of(
        nodes,
        [vi("past"), vi("new_kv", [1, 2, 1, 4])],
        [present or vi("present", None), vi("out", None), *extra_outputs],
        [helper.make_tensor("position", TensorProto.INT64, [], [position])],
        {"past": "present"},
    )
    set_access(model.graph.input[0], Access.READ_WRITE)
    set_access(model.graph.input[1], Access.READ_ONLY)
    set_alias_of(value(model, "present"), "past")
    return model


def concat_model(extra_nodes=(), extra_outputs=(), bindings=None):
    """``past -> Concat -> present`` (no alias), ``past <- present``."""
    nodes = [helper.make_node("Concat", ["past", "new_kv"], ["present"], name="append", axis=2), *extra_nodes]
    return model_of(
        nodes,
        [vi("past", [1, 2, "past_len", 4]), vi("new_kv", [1, 2, 1, 4])],
        [vi("present", [1, 2, "total_len", 4]), *extra_outputs],
        (),
        bindings or {"past": "present"},
    )


def expect_contract_error(model, message):
    with pytest.raises(ContractError, match=re.escape(message)):
        check_model(model)


# -- passing models -----------------------------------------------------------------------------


def test_cache_update_model_passes():
    contract = check_model(cache_update_model())
    assert contract == Contract(
        output_aliases={0: [OutputAlias(0, 0)]},
        access={"past": Access.READ_WRITE, "new_kv": Access.READ_ONLY},
        alias_of={"present": "past"},
        persistent_bindings={"past": "present"},
    )


def test_concat_model_passes():
    assert check_model(concat_model()).persistent_bindings == {"past": "present"}


def test_a_model_without_declarations_passes():
    model = cache_update_model()
    Contract().apply(model)
    assert check_model(model) == Contract()


def test_value_infos_and_metadata_are_not_uses():
    model = concat_model()
    model.graph.value_info.append(vi("past", [1, 2, "past_len", 4]))
    model.metadata_props.add(key="past", value="past")
    model.graph.doc_string = "past"
    check_model(model)


@pytest.mark.parametrize("family", ["concat", "gqa", "attention", "tensorscatter"])
def test_builder_models_with_bindings_pass(family):
    model = build_model(family, MICRO)
    bindings = {
        f"past_key_values.{layer}.{kv}": f"present.{layer}.{kv}"
        for layer in range(MICRO.num_layers)
        for kv in ("key", "value")
    }
    set_persistent_bindings(model.graph, bindings)
    if family == "tensorscatter":
        for node in model.graph.node:
            if node.op_type == "TensorScatter":
                set_output_alias(node, [OutputAlias(0, 0)])
        for value_info in model.graph.input:
            if value_info.name in bindings:
                set_access(value_info, Access.READ_WRITE)
    assert check_model(model).persistent_bindings == bindings


# -- bound inputs: exactly one use --------------------------------------------------------------


def test_bound_input_with_a_second_node_use():
    expect_contract_error(
        concat_model(
            [helper.make_node("Shape", ["past"], ["past_shape"], name="peek")],
            [vi("past_shape", [4], TensorProto.INT64)],
        ),
        "persistent binding 'past' <- 'present': bound input 'past' must have exactly one use, but has 2: "
        "node 'append' (Concat) input 0, node 'peek' (Shape) input 0",
    )


def test_bound_input_used_twice_by_one_node():
    model = concat_model()
    model.graph.node[0].input.append("past")
    expect_contract_error(
        model,
        "bound input 'past' must have exactly one use, but has 2: node 'append' (Concat) input 0, "
        "node 'append' (Concat) input 2",
    )


def test_bound_input_that_is_also_a_graph_output():
    expect_contract_error(
        concat_model(extra_outputs=[vi("past", [1, 2, "past_len", 4])]),
        "bound input 'past' must have exactly one use, but has 2: node 'append' (Concat) input 0, graph output",
    )


def test_bound_input_captured_by_a_subgraph():
    branch = helper.make_graph([helper.make_node("Identity", ["past"], ["seen"])], "then", [], [vi("seen")])
    other = helper.make_graph(
        [helper.make_node("Identity", ["new_kv"], ["seen2"])], "else", [], [vi("seen2", [1, 2, 1, 4])]
    )
    cond = helper.make_tensor("cond", TensorProto.BOOL, [], [True])
    model = concat_model(
        [helper.make_node("If", ["cond"], ["picked"], name="branch", then_branch=branch, else_branch=other)]
    )
    model.graph.initializer.append(cond)
    expect_contract_error(
        model,
        "bound input 'past' must have exactly one use, but has 2: node 'append' (Concat) input 0, "
        "subgraph 'then_branch' of node 'branch' (If)",
    )


def test_bound_input_without_use():
    model = model_of(
        [helper.make_node("Identity", ["new_kv"], ["present"], name="copy")],
        [vi("past"), vi("new_kv")],
        [vi("present")],
        (),
        {"past": "present"},
    )
    expect_contract_error(
        model, "persistent binding 'past' <- 'present': bound input 'past' must have exactly one use, but has 0"
    )


# -- binding names ------------------------------------------------------------------------------


def test_binding_input_must_be_a_graph_input():
    expect_contract_error(
        concat_model(bindings={"new": "present"}), "persistent binding 'new' <- 'present': 'new' is not a graph input"
    )


def test_binding_output_must_exist():
    expect_contract_error(
        concat_model(bindings={"past": "nowhere"}),
        "persistent binding 'past' <- 'nowhere': 'nowhere' is neither a graph output nor a node output",
    )


def test_bound_input_must_not_be_an_initializer():
    model = concat_model()
    model.graph.initializer.append(helper.make_tensor("past", F32, [1, 2, 1, 4], [0.0] * 8))
    expect_contract_error(model, "persistent binding 'past' <- 'present': input 'past' is an initializer")


def test_an_output_feeds_one_input_only():
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"], name="add")]
    model = model_of(nodes, [vi("a"), vi("b")], [vi("sum")], (), {"a": "sum", "b": "sum"})
    expect_contract_error(model, "persistent binding 'b' <- 'sum': output 'sum' is already bound to input 'a'")


# -- output_alias -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "alias,message",
    [
        (
            OutputAlias(1, 0),
            "node 'update' (ai.onnxkv::CacheUpdate): output_alias names output 1, but the node has "
            "no such output (outputs: ['present'])",
        ),
        (
            OutputAlias(0, 5),
            "node 'update' (ai.onnxkv::CacheUpdate): output_alias names input 5, but the node has no such input",
        ),
    ],
)
def test_alias_indices_must_exist(alias, message):
    model = cache_update_model()
    set_output_alias(model.graph.node[0], [alias])
    set_alias_of(value(model, "present"), None)
    expect_contract_error(model, message)


def test_alias_input_must_not_be_empty():
    model = cache_update_model()
    model.graph.node[0].input[0] = ""
    expect_contract_error(
        model, "output_alias names input 0, but the node has no such input (inputs: ['', 'new_kv', 'position'])"
    )


def test_an_output_is_aliased_once():
    model = cache_update_model()
    entry = _wire.encode_fields([_wire.Field(1, 0, 0), _wire.Field(2, 0, 1), _wire.Field(3, 0, 1)])
    model.graph.node[0].MergeFromString(_wire.encode_fields([_wire.Field(1000, _wire.LEN, entry)]))
    expect_contract_error(model, "node 'update' (ai.onnxkv::CacheUpdate): output 0 is declared in output_alias twice")


def test_an_input_backs_one_output_only():
    split = helper.make_node("KvSplit", ["kv"], ["k", "v"], name="split", domain="ai.onnxkv")
    set_output_alias(split, [OutputAlias(0, 0), OutputAlias(1, 0)])
    expect_contract_error(
        model_of([split], [vi("kv")], [vi("k"), vi("v")]),
        "node 'split' (ai.onnxkv::KvSplit): outputs 0 and 1 both alias input 0",
    )


def test_alias_input_must_not_be_an_initializer():
    node = helper.make_node("Relu", ["weight"], ["activated"], name="inplace_relu")
    set_output_alias(node, [OutputAlias(0, 0)])
    model = model_of([node], [], [vi("activated", [2])], [helper.make_tensor("weight", F32, [2], [1.0, -1.0])])
    expect_contract_error(model, "node 'inplace_relu' (Relu): MUST_ALIAS input 'weight' is an initializer")


def test_alias_input_must_not_be_read_only():
    model = cache_update_model()
    set_access(model.graph.input[0], Access.READ_ONLY)
    expect_contract_error(
        model, "node 'update' (ai.onnxkv::CacheUpdate): MUST_ALIAS input 'past' is a READ_ONLY graph input"
    )


def test_alias_input_must_not_be_shared():
    model = cache_update_model(extra_nodes=[helper.make_node("Shape", ["past"], ["past_shape"], name="peek")])
    expect_contract_error(
        model,
        "node 'update' (ai.onnxkv::CacheUpdate): MUST_ALIAS input 'past' is shared; the aliasing node must "
        "be its only use, but it has 2: node 'update' (ai.onnxkv::CacheUpdate) input 0, node 'peek' (Shape) "
        "input 0",
    )


def test_unnamed_nodes_are_named_by_position_and_outputs():
    model = cache_update_model()
    model.graph.node[0].name = ""
    set_access(model.graph.input[0], Access.READ_ONLY)
    expect_contract_error(
        model, "node #0 (ai.onnxkv::CacheUpdate -> ['present']): MUST_ALIAS input 'past' is a READ_ONLY graph input"
    )


# -- alias_of -----------------------------------------------------------------------------------


def test_alias_of_must_agree_with_output_alias():
    model = cache_update_model()
    set_alias_of(value(model, "present"), "new_kv")
    expect_contract_error(
        model,
        "value 'present' declares alias_of 'new_kv', but the output_alias of node 'update' "
        "(ai.onnxkv::CacheUpdate) links it to input 'past'",
    )


def test_alias_of_needs_an_output_alias():
    model = cache_update_model()
    model.graph.value_info.append(vi("out", None))
    set_alias_of(model.graph.value_info[0], "present")
    expect_contract_error(
        model,
        "value 'out' declares alias_of 'present', but node 'attend' (Identity) declares no output_alias "
        "for its output 0",
    )


def test_alias_of_only_on_node_outputs():
    model = cache_update_model()
    set_alias_of(model.graph.input[1], "past")
    expect_contract_error(model, "value 'new_kv' declares alias_of 'past' but is not a node output")


def test_alias_cycles_are_rejected():
    first = helper.make_node("Identity", ["y"], ["x"], name="first")
    second = helper.make_node("Identity", ["x"], ["y"], name="second")
    for node in (first, second):
        set_output_alias(node, [OutputAlias(0, 0)])
    expect_contract_error(model_of([first, second], [], []), "alias cycle: 'x' -> 'y' -> 'x'")


# -- access -------------------------------------------------------------------------------------


def test_read_write_only_on_graph_inputs():
    model = cache_update_model()
    set_access(value(model, "out"), Access.READ_WRITE)
    expect_contract_error(model, "value 'out' is declared READ_WRITE but is not a graph input")


def test_read_write_not_on_initializers():
    model = concat_model()
    model.graph.input.append(vi("scale", [1]))
    model.graph.initializer.append(helper.make_tensor("scale", F32, [1], [1.0]))
    set_access(model.graph.input[-1], Access.READ_WRITE)
    expect_contract_error(model, "value 'scale' is declared READ_WRITE but is an initializer")


# -- types and capacity (through shape inference) -----------------------------------------------


@pytest.mark.parametrize(
    "present,message",
    [
        (
            vi("present", CACHE, TensorProto.FLOAT16),
            "values 'past' and 'present' alias each other (alias class "
            "['past', 'present']) but have element types FLOAT and FLOAT16",
        ),
        (
            vi("present", [1, 2, 8]),
            "values 'past' and 'present' alias each other (alias class ['past', 'present']) but have ranks 4 and 3",
        ),
        (
            vi("present", [1, 2, 9, 4]),
            "values 'past' and 'present' alias each other (alias class ['past', 'present']) but dim 2 is 8 vs 9",
        ),
    ],
)
def test_alias_partners_must_be_compatible(present, message):
    expect_contract_error(cache_update_model(present=present), message)


def test_capacity_overflow_names_the_node():
    expect_contract_error(
        cache_update_model(position=8),
        "node 'update' (ai.onnxkv::CacheUpdate): position 8 + update length 1 "
        "of 'new_kv' exceeds the capacity 8 of cache 'past'",
    )


# -- placement ----------------------------------------------------------------------------------


def test_declarations_inside_subgraphs_are_rejected():
    inner = helper.make_node("Identity", ["x"], ["y"], name="inner")
    set_output_alias(inner, [OutputAlias(0, 0)])
    body = helper.make_graph([inner], "body", [], [vi("y", [1])])
    plain = helper.make_graph([helper.make_node("Identity", ["x"], ["w"])], "plain", [], [vi("w", [1])])
    outer = helper.make_node("If", ["cond"], ["z"], name="branch", then_branch=body, else_branch=plain)
    model = model_of([outer], [vi("cond", [], TensorProto.BOOL), vi("x", [1])], [vi("z", [1])])
    expect_contract_error(
        model,
        "node 'inner' (Identity) in subgraph 'then_branch' of node 'branch' (If) carries onnxkv "
        "declarations; they are only allowed on the main graph",
    )


def test_foreign_fields_inside_subgraphs_are_not_declarations():
    body = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "body", [], [vi("y", [1])])
    body.node[0].MergeFromString(_wire.encode_fields([_wire.Field(1500, _wire.LEN, b"theirs")]))
    body.MergeFromString(_wire.encode_fields([_wire.Field(1001, _wire.VARINT, 1)]))
    outer = helper.make_node("If", ["cond"], ["z"], name="branch", then_branch=body, else_branch=body)
    check_model(model_of([outer], [vi("cond", [], TensorProto.BOOL), vi("x", [1])], [vi("z", [1])]))
