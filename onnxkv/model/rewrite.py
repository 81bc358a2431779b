"""Deciding which past/present pairs run in place on a persistent cache.

For every layer of a recognised :class:`~onnxkv.model.convention.CacheConvention`
the node that joins ``past`` and ``present`` can write the new positions
straight into the state's cache instead of building a new present tensor:

* ``GroupQueryAttention``: ORT GenAI's shared-buffer mode (new K/V written at
  each row's ``seqlens_k`` position);
* ``Attention`` (23/24): the new K/V appended after the past;
* ``Concat`` (``past -> Concat -> present``): becomes an append, and readers of
  ``present`` get a zero-copy view of the valid prefix;
* ``TensorScatter``: the update is written into the static cache in place.

A pair is bound only when that is provably invisible: the present is produced
by the joining node itself, and for GroupQueryAttention (which may overwrite
padding positions inside the past of shorter rows) the past has no other
reader.  A cache is never served inside control flow: when any past or
present is an input of a node with subgraphs (``If``, ``Loop``, ``Scan``) or
is read inside one, nothing is bound.  Otherwise the standard tensor path
stays; outputs are identical either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from onnxkv.model.convention import CacheConvention
from onnxkv.model.scopes import scope_names, subgraphs

__all__ = ["CacheBinding", "inplace_bindings"]

_JOINERS = {
    "group_query_attention": ("GroupQueryAttention",),
    "attention": ("Attention",),
    "concat": ("Concat",),
    "tensor_scatter": ("TensorScatter",),
}


@dataclass(frozen=True)
class CacheBinding:
    """One loop-carried cache value bound to a persistent cache.

    ``past`` (graph input) is fed from the cache, ``present`` (graph output) is
    produced by ``node`` writing in place; ``role`` is ``"key"`` or ``"value"``.
    """

    layer: int
    role: str
    past: str
    present: str
    node: str
    kind: str


def _node_key(node: onnx.NodeProto) -> str:
    return node.name or node.output[0]


def _control_flow_reads(graph: onnx.GraphProto) -> set[str]:
    """Values that nodes with subgraphs read: their inputs and the names their subgraphs read from outside."""
    reads: set[str] = set()
    for n in graph.node:
        inner = subgraphs(n)
        if inner:
            reads.update(n.input)
            reads.update(name for g in inner for name in scope_names(g))
    return reads


def inplace_bindings(model: onnx.ModelProto, convention: CacheConvention) -> list[CacheBinding]:
    """The cache bindings of ``model`` that can run in place (possibly empty)."""
    if convention.kind not in _JOINERS or not _control_flow_reads(model.graph).isdisjoint(
        [*convention.past_inputs, *convention.present_outputs]
    ):
        return []
    readers: dict[str, list[onnx.NodeProto]] = {}
    producer: dict[str, onnx.NodeProto] = {}
    for n in model.graph.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
        for o in n.output:
            producer[o] = n
    out: list[CacheBinding] = []
    for layer in convention.layers:
        for role, past, present in (
            ("key", layer.past_key, layer.present_key),
            ("value", layer.past_value, layer.present_value),
        ):
            node = producer.get(present)
            if node is None or node.op_type not in _JOINERS[convention.kind] or past not in node.input:
                return []
            if convention.kind == "group_query_attention" and any(r is not node for r in readers.get(past, [])):
                return []
            if convention.kind == "tensor_scatter":
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                mode = attrs.get("mode", b"linear")
                if node.input[0] != past or attrs.get("axis", -2) not in (2, -2) or mode not in (b"linear", "linear"):
                    return []
            if convention.kind in ("group_query_attention", "attention"):
                pos = {"group_query_attention": (3, 4, 1, 2), "attention": (4, 5, 1, 2)}[convention.kind]
                ins, outs = list(node.input) + [""] * 6, list(node.output) + [""] * 3
                if (
                    past != ins[pos[0] if role == "key" else pos[1]]
                    or present != outs[pos[2] if role == "key" else pos[3]]
                ):
                    return []
            if convention.kind == "concat":
                axis = next((a.i for a in node.attribute if a.name == "axis"), None)
                if len(node.input) != 2 or node.input[0] != past or axis not in (2, -2):
                    return []
            out.append(CacheBinding(layer.index, role, past, present, _node_key(node), convention.kind))
    return out
