"""Subgraphs and the names they read from enclosing scopes (``If`` branches, ``Loop``/``Scan`` bodies)."""

from __future__ import annotations

import onnx

__all__ = ["scope_names", "subgraphs"]


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """Every graph held by an attribute of ``node``."""
    out: list[onnx.GraphProto] = []
    for a in node.attribute:
        out.extend([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs))
    return out


def scope_names(graph: onnx.GraphProto) -> list[str]:
    """Names ``graph`` reads without defining them (from enclosing scopes), each once, in order of first use.

    Reads are node inputs (nested subgraphs included) and graph outputs; a
    name is defined by a graph input, an initializer or a node output.
    """
    local = (
        {i.name for i in graph.input} | {i.name for i in graph.initializer} | {o for n in graph.node for o in n.output}
    )
    out: dict[str, None] = {}
    for n in graph.node:
        reads = [x for x in n.input if x]
        for g in subgraphs(n):
            reads.extend(scope_names(g))
        out.update((x, None) for x in reads if x not in local)
    out.update((o.name, None) for o in graph.output if o.name not in local)
    return list(out)
