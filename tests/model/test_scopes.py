"""Which names a subgraph reads from enclosing scopes."""

from __future__ import annotations

from onnx import TensorProto
from onnx import helper as h

from onnxkv.model.scopes import scope_names, subgraphs


def _vi(name: str):
    return h.make_tensor_value_info(name, TensorProto.FLOAT, None)


def test_scope_names_are_outer_reads_at_any_depth_once_each_in_order_of_first_use():
    inner = h.make_graph([h.make_node("Add", ["local", "deep"], ["z"])], "inner", [], [_vi("z")])
    graph = h.make_graph(
        [
            h.make_node("Mul", ["later", "a"], ["product"]),  # 'later' is defined below: local
            h.make_node("Neg", ["b"], ["later"]),
            h.make_node("Add", ["x", "w"], ["local"]),
            h.make_node("If", ["a"], ["picked"], then_branch=inner, else_branch=inner),
            h.make_node("Sub", ["a", ""], ["dup"]),
        ],
        "g",
        [_vi("x")],
        [_vi("product"), _vi("outer_out"), _vi("x")],
        [h.make_tensor(name="w", data_type=TensorProto.FLOAT, dims=[], vals=[1.0])],
    )
    assert scope_names(graph) == ["a", "b", "deep", "outer_out"]


def test_subgraphs_lists_the_graphs_of_every_attribute():
    g1, g2 = h.make_graph([], "one", [], []), h.make_graph([], "two", [], [])
    node = h.make_node("If", ["c"], [], then_branch=g1, else_branch=g2, other=3)
    assert sorted(g.name for g in subgraphs(node)) == ["one", "two"]
    assert subgraphs(h.make_node("Neg", ["x"], ["y"])) == []
