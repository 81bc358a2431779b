"""In-place cache bindings are never made for caches that pass through control flow."""

from __future__ import annotations

import pytest
from onnx import TensorProto
from onnx import helper as h

from onnxkv.model.convention import recognize_cache
from onnxkv.model.rewrite import inplace_bindings
from onnxkv.zoo.concat import build_concat_model
from onnxkv.zoo.config import MICRO


def _vi(name: str, elem=TensorProto.FLOAT):
    return h.make_tensor_value_info(name, elem, None)


def _with(node) -> list:
    model = build_concat_model(MICRO)
    model.graph.node.append(node)
    model.graph.output.append(_vi(node.output[0]))
    model.graph.input.append(_vi("flag", TensorProto.BOOL))
    return inplace_bindings(model, recognize_cache(model))


def test_a_decoder_without_control_flow_binds_every_pair():
    model = build_concat_model(MICRO)
    assert len(inplace_bindings(model, recognize_cache(model))) == 2 * MICRO.num_layers


def test_control_flow_elsewhere_keeps_the_bindings():
    branch = h.make_graph([h.make_node("Neg", ["input_ids"], ["n"])], "b", [], [_vi("n", TensorProto.INT64)])
    assert len(_with(h.make_node("If", ["flag"], ["picked"], then_branch=branch, else_branch=branch))) == 4


@pytest.mark.parametrize("value", ["past_key_values.1.value", "present.0.key"])
def test_a_past_or_present_read_inside_a_subgraph_binds_nothing(value):
    branch = h.make_graph([h.make_node("Identity", [value], ["seen"])], "b", [], [_vi("seen")])
    assert _with(h.make_node("If", ["flag"], ["picked"], then_branch=branch, else_branch=branch)) == []


def test_a_present_fed_to_a_loop_binds_nothing():
    body = h.make_graph(
        [h.make_node("Identity", ["c"], ["c_out"]), h.make_node("Identity", ["v"], ["v_out"])],
        "b",
        [_vi("i", TensorProto.INT64), _vi("c", TensorProto.BOOL), _vi("v")],
        [_vi("c_out", TensorProto.BOOL), _vi("v_out")],
    )
    assert _with(h.make_node("Loop", ["", "flag", "present.1.key"], ["looped"], body=body)) == []


def test_concat_pairs_keys_and_values_by_name_in_any_node_order():
    """``past_key_values.N.value`` holds values although its name has 'key' in it: with the value Concat
    before the key Concat (the node order ONNX Runtime's tools write), keys still pair with keys."""
    model = build_concat_model(MICRO)
    nodes = list(model.graph.node)
    concats = [n for n in nodes if n.op_type == "Concat" and n.output[0].startswith("present")]
    keys = [n for n in concats if n.output[0].endswith(".key")]
    values = [n for n in concats if n.output[0].endswith(".value")]
    assert len(keys) == len(values) == MICRO.num_layers
    for v in values:  # each value Concat just before its layer's key Concat
        k = next(n for n in keys if n.output[0].split(".")[1] == v.output[0].split(".")[1])
        nodes.remove(v)
        nodes.insert(nodes.index(k), v)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    conv = recognize_cache(model)
    assert [(x.past_key, x.past_value, x.present_key, x.present_value) for x in conv.layers] == [
        (f"past_key_values.{i}.key", f"past_key_values.{i}.value", f"present.{i}.key", f"present.{i}.value")
        for i in range(MICRO.num_layers)
    ]
