"""The serialised contract: wire format, setters/getters, file round trips, ONNX and ONNX Runtime compatibility."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from onnxkv.errors import ModelError
from onnxkv.model import _wire
from onnxkv.model.contract import (
    Access,
    Contract,
    ContractError,
    OutputAlias,
    get_access,
    get_alias_of,
    get_output_alias,
    get_persistent_bindings,
    set_access,
    set_alias_of,
    set_output_alias,
    set_persistent_bindings,
)


def standard_model() -> onnx.ModelProto:
    """``present = past + delta`` with a weight initializer, every contract field declared (standard ops only)."""
    shape = [1, 2, 4, 3]
    scale = numpy_helper.from_array(np.full(shape, 0.5, np.float32), "scale")
    nodes = [
        helper.make_node("Add", ["past", "delta"], ["present"], name="update"),
        helper.make_node("Mul", ["present", "scale"], ["scaled"], name="scale_it"),
    ]
    graph = helper.make_graph(
        nodes,
        "decoder",
        [
            helper.make_tensor_value_info("past", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("delta", TensorProto.FLOAT, shape),
        ],
        [
            helper.make_tensor_value_info("present", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("scaled", TensorProto.FLOAT, shape),
        ],
        initializer=[scale],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    declare_all(model)
    return model


def declare_all(model: onnx.ModelProto) -> None:
    graph = model.graph
    set_output_alias(graph.node[0], [OutputAlias(0, 0)])
    set_access(graph.input[0], Access.READ_WRITE)
    set_access(graph.input[1], "READ_ONLY")
    set_alias_of(graph.output[0], "past")
    set_persistent_bindings(graph, {"past": "present"})


EXPECTED = Contract(
    output_aliases={0: [OutputAlias(0, 0)]},
    access={"past": Access.READ_WRITE, "delta": Access.READ_ONLY},
    alias_of={"present": "past"},
    persistent_bindings={"past": "present"},
)


# -- wire format --------------------------------------------------------------------------------

field_numbers = st.integers(1, (1 << 29) - 1)
fields = st.one_of(
    st.builds(_wire.Field, field_numbers, st.just(_wire.VARINT), st.integers(0, (1 << 64) - 1)),
    st.builds(_wire.Field, field_numbers, st.just(_wire.LEN), st.binary(max_size=300)),
    st.builds(_wire.Field, field_numbers, st.just(_wire.I64), st.binary(min_size=8, max_size=8)),
    st.builds(_wire.Field, field_numbers, st.just(_wire.I32), st.binary(min_size=4, max_size=4)),
)


@given(st.lists(fields, max_size=20))
def test_wire_encode_decode_round_trip(items):
    assert _wire.decode_fields(_wire.encode_fields(items)) == items


@given(st.lists(fields, max_size=20), st.frozensets(field_numbers, max_size=3))
def test_strip_fields_removes_exactly_the_given_numbers(items, numbers):
    items += [_wire.Field(number, _wire.VARINT, 1) for number in numbers]
    stripped = _wire.decode_fields(_wire.strip_fields(_wire.encode_fields(items), numbers))
    assert stripped == [item for item in items if item.number not in numbers]


@given(st.integers(0, (1 << 64) - 1))
def test_varint_round_trip(value):
    encoded = _wire.encode_varint(value)
    assert _wire.decode_varint(encoded, 0) == (value, len(encoded))


def test_groups_are_skipped_whole():
    group = (
        _wire.encode_varint(7 << 3 | 3)
        + _wire.encode_fields([_wire.Field(1, _wire.VARINT, 5)])
        + _wire.encode_varint(7 << 3 | 4)
    )
    data = group + _wire.encode_fields([_wire.Field(2, _wire.VARINT, 9)])
    assert [f.number for f in _wire.decode_fields(data)] == [7, 2]
    assert _wire.decode_fields(_wire.strip_fields(data, frozenset({7}))) == [_wire.Field(2, _wire.VARINT, 9)]


def test_deeply_nested_groups_do_not_recurse():
    depth = 5000
    data = _wire.encode_varint(5 << 3 | 3) * depth + _wire.encode_varint(5 << 3 | 4) * depth
    assert [f.number for f in _wire.decode_fields(data + b"\x10\x01")] == [5, 2]


@pytest.mark.parametrize(
    "data",
    [
        b"\x08",
        b"\x12\x05ab",
        b"\x0f",
        b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
        b"\x1b\x08\x01",
        b"\x1c",
        b"\x1b\x24",
    ],
)
def test_malformed_wire_data_is_rejected(data):
    with pytest.raises(ValueError):
        _wire.decode_fields(data)


# -- setters and getters ------------------------------------------------------------------------


@given(
    st.lists(
        st.builds(OutputAlias, st.integers(0, 1 << 40), st.integers(0, 1 << 40)),
        max_size=6,
        unique_by=lambda a: a.output_index,
    )
)
def test_output_alias_round_trip(aliases):
    node = helper.make_node("Add", ["a", "b"], ["c"], name="n")
    set_output_alias(node, [OutputAlias(9, 9)])
    set_output_alias(node, aliases)
    assert get_output_alias(onnx.NodeProto.FromString(node.SerializeToString())) == aliases
    assert node.op_type == "Add" and list(node.input) == ["a", "b"]


names = st.text(min_size=1, max_size=20)


@given(st.dictionaries(names, names, max_size=6))
def test_persistent_bindings_round_trip(bindings):
    graph = helper.make_graph([], "g", [], [])
    set_persistent_bindings(graph, {"old": "binding"})
    set_persistent_bindings(graph, bindings)
    assert get_persistent_bindings(onnx.GraphProto.FromString(graph.SerializeToString())) == bindings


@given(st.sampled_from([None, *Access]), st.one_of(st.none(), names))
def test_value_fields_round_trip(access, alias_of):
    value_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    set_access(value_info, Access.READ_ONLY)
    set_alias_of(value_info, "old")
    set_access(value_info, access)
    set_alias_of(value_info, alias_of)
    parsed = onnx.ValueInfoProto.FromString(value_info.SerializeToString())
    assert (get_access(parsed), get_alias_of(parsed)) == (access, alias_of)
    assert parsed.type == helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]).type


def test_absent_fields_read_as_empty():
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [], []))
    assert Contract.from_model(model) == Contract()


def test_foreign_unknown_fields_are_kept():
    node = helper.make_node("Relu", ["x"], ["y"])
    foreign = _wire.encode_fields([_wire.Field(1500, _wire.LEN, b"theirs")])
    node.MergeFromString(foreign)
    set_output_alias(node, [OutputAlias(0, 0)])
    set_output_alias(node, [OutputAlias(0, 0)])
    assert node.SerializeToString().count(foreign) == 1
    assert get_output_alias(node) == [OutputAlias(0, 0)]


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: OutputAlias(-1, 0), "OutputAlias: output_index must be a non-negative int, got -1"),
        (lambda: OutputAlias(0, True), "OutputAlias: input_index must be a non-negative int, got True"),
        (lambda: OutputAlias(0, 0, "MAY_ALIAS"), "OutputAlias: unknown kind 'MAY_ALIAS'"),
        (lambda: set_output_alias(onnx.NodeProto(), [(0, 0)]), "set_output_alias: expected OutputAlias entries"),
        (
            lambda: set_output_alias(onnx.NodeProto(), [OutputAlias(0, 0), OutputAlias(0, 1)]),
            "set_output_alias: output index 0 is declared twice",
        ),
        (lambda: set_access(onnx.ValueInfoProto(), "WRITE"), "set_access: unknown access 'WRITE'"),
        (lambda: set_alias_of(onnx.ValueInfoProto(), ""), "set_alias_of: expected a non-empty value name, got ''"),
        (
            lambda: set_persistent_bindings(onnx.GraphProto(), {"past": ""}),
            "set_persistent_bindings: expected non-empty value names, got ''",
        ),
    ],
)
def test_invalid_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def stored(message, *items):
    message.MergeFromString(_wire.encode_fields(items))
    return message


def alias_entry(*items):
    return _wire.Field(1000, _wire.LEN, _wire.encode_fields(items))


@pytest.mark.parametrize(
    "read,message",
    [
        (
            lambda: get_output_alias(
                stored(
                    helper.make_node("Relu", ["x"], ["y"], name="relu"),
                    alias_entry(_wire.Field(1, 0, 0), _wire.Field(2, 0, 0), _wire.Field(3, 0, 7)),
                )
            ),
            "node 'relu' (Relu): output_alias kind 7 is unknown",
        ),
        (
            lambda: get_output_alias(
                stored(helper.make_node("Relu", ["x"], ["y"], name="relu"), alias_entry(_wire.Field(1, 0, 0)))
            ),
            "node 'relu' (Relu): output_alias entry lacks its output or input index",
        ),
        (
            lambda: get_output_alias(
                stored(helper.make_node("Relu", ["x"], ["y"], name="relu"), _wire.Field(1000, _wire.LEN, b"\x08"))
            ),
            "node 'relu' (Relu): malformed output_alias: truncated varint",
        ),
        (
            lambda: get_output_alias(
                stored(helper.make_node("Relu", ["x"], ["y"], name="relu"), _wire.Field(1000, _wire.VARINT, 1))
            ),
            "node 'relu' (Relu): output_alias has wire type 0, expected 2",
        ),
        (
            lambda: get_access(stored(onnx.ValueInfoProto(name="past"), _wire.Field(1000, 0, 9))),
            "value 'past': access 9 is unknown",
        ),
        (
            lambda: get_alias_of(stored(onnx.ValueInfoProto(name="present"), _wire.Field(1001, 2, b"\xff"))),
            "value 'present': alias_of is not valid UTF-8",
        ),
        (
            lambda: get_persistent_bindings(stored(onnx.GraphProto(name="g"), alias_entry(_wire.Field(1, 2, b"past")))),
            "graph 'g': persistent binding 'past' <- '' lacks a name",
        ),
        (
            lambda: get_persistent_bindings(
                stored(
                    onnx.GraphProto(name="g"),
                    alias_entry(_wire.Field(1, 2, b"p"), _wire.Field(2, 2, b"a")),
                    alias_entry(_wire.Field(1, 2, b"p"), _wire.Field(2, 2, b"b")),
                )
            ),
            "graph 'g': input 'p' is bound twice",
        ),
    ],
)
def test_malformed_stored_fields_raise_contract_error(read, message):
    with pytest.raises(ContractError, match=re.escape(message)):
        read()


def test_contract_error_is_a_model_error():
    assert issubclass(ContractError, ModelError)


# -- whole models -------------------------------------------------------------------------------


def test_contract_from_model_and_apply():
    model = standard_model()
    assert Contract.from_model(model) == EXPECTED
    bare = standard_model()
    Contract().apply(bare)
    assert Contract.from_model(bare) == Contract()
    EXPECTED.apply(bare)
    assert Contract.from_model(bare) == EXPECTED
    assert bare.SerializeToString() == model.SerializeToString()


def test_apply_declares_unlisted_values_in_value_info():
    model = standard_model()
    Contract(access={"scaled_copy": Access.READ_ONLY}).apply(model)
    assert model.graph.value_info[-1].name == "scaled_copy"
    assert Contract.from_model(model) == Contract(access={"scaled_copy": Access.READ_ONLY})


def test_conflicting_duplicate_declarations_are_rejected():
    model = standard_model()
    value_info = model.graph.value_info.add()
    value_info.CopyFrom(model.graph.output[0])
    set_alias_of(value_info, "delta")
    with pytest.raises(
        ContractError, match="value 'present': alias_of is 'past' in graph.output but 'delta' in graph.value_info"
    ):
        Contract.from_model(model)


def test_apply_rejects_a_missing_node():
    with pytest.raises(ValueError, match="Contract.apply: node index 5 out of range"):
        Contract(output_aliases={5: [OutputAlias(0, 0)]}).apply(standard_model())


def test_fields_survive_serialisation_of_the_model():
    model = onnx.load_from_string(standard_model().SerializeToString())
    assert Contract.from_model(model) == EXPECTED


def test_onnx_checker_accepts_the_fields():
    onnx.checker.check_model(standard_model(), full_check=True)


def test_onnx_shape_inference_keeps_the_fields():
    assert Contract.from_model(onnx.shape_inference.infer_shapes(standard_model())) == EXPECTED


def test_save_and_load_file(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(standard_model(), path)
    assert Contract.from_model(onnx.load(path)) == EXPECTED


@pytest.mark.parametrize("load_external_data", [True, False])
def test_save_and_load_with_external_data(tmp_path, load_external_data):
    path = tmp_path / "model.onnx"
    onnx.save(
        standard_model(),
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.bin",
        size_threshold=0,
    )
    assert (tmp_path / "weights.bin").exists()
    loaded = onnx.load(path, load_external_data=load_external_data)
    assert loaded.graph.initializer[0].data_location == (
        TensorProto.DEFAULT if load_external_data else TensorProto.EXTERNAL
    )
    assert Contract.from_model(loaded) == EXPECTED


def test_onnxruntime_loads_and_runs_a_model_carrying_every_field(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(standard_model(), path, save_as_external_data=True, location="weights.bin", size_threshold=0)
    rng = np.random.default_rng(0)
    past, delta = (rng.standard_normal((1, 2, 4, 3)).astype(np.float32) for _ in range(2))
    for source in (standard_model().SerializeToString(), str(path)):
        session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
        present, scaled = session.run(None, {"past": past, "delta": delta})
        np.testing.assert_allclose(present, past + delta, rtol=1e-6)
        np.testing.assert_allclose(scaled, (past + delta) * 0.5, rtol=1e-6)
