"""A model's graph checked for the shape of its text and nodes before anything reads it.

* :func:`check_text`: every name, operator, domain and external-data entry of the model (subgraphs included)
  is text.  ONNX stores them as proto2 ``string`` fields, which protobuf does not check: the Python runtime
  hands invalid UTF-8 back as ``bytes``, which every later ``str`` operation trips over.
* :func:`check_arity`: every node of a standard ONNX operator lists as many inputs and outputs as its schema
  allows at the imported opset, with a name in every required input, so that plan passes may index a node's
  inputs by the operator's positions.

Both raise :class:`~onnxkv.errors.ModelError` naming the node or value.  This module imports only ``onnx``
and onnxkv's errors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import onnx
from onnx import AttributeProto

from onnxkv.errors import ModelError

__all__ = ["check_text", "check_arity"]


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for a in node.attribute:
        if a.type == AttributeProto.GRAPH:
            yield a.g
        elif a.type == AttributeProto.GRAPHS:
            yield from a.graphs


def _not_text(strings) -> object | None:
    """The first of ``strings`` that is not a ``str`` (protobuf's bytes for invalid UTF-8), or None."""
    return next((s for s in strings if not isinstance(s, str)), None)


def check_text(model: onnx.ModelProto) -> None:
    """ModelError unless every string the model's graphs name things with is UTF-8 text."""
    bad = _not_text(o.domain for o in model.opset_import)
    if bad is not None:
        raise ModelError(f"load: an opset import names the domain {bad!r}, which is not UTF-8 text")
    _check_graph_text(model.graph, "the graph")


def _check_graph_text(graph: onnx.GraphProto, where: str) -> None:
    bad = _not_text([graph.name])
    for vi in (*graph.input, *graph.output, *graph.value_info):
        bad = bad if bad is not None else _not_text([vi.name])
    for t in graph.initializer:
        bad = bad if bad is not None else _not_text([t.name, *(e.key for e in t.external_data)])
        bad = bad if bad is not None else _not_text(e.value for e in t.external_data)
    if bad is not None:
        raise ModelError(f"load: {where} names a value, initializer or external-data entry {bad!r}, not UTF-8 text")
    for node in graph.node:
        bad = _not_text([node.op_type, node.domain, node.name, *node.input, *node.output])
        bad = bad if bad is not None else _not_text(a.name for a in node.attribute)
        bad = bad if bad is not None else _not_text(a.ref_attr_name for a in node.attribute)
        if bad is not None:
            label = node.name if isinstance(node.name, str) else repr(node.name)
            raise ModelError(f"load: node '{label}' of {where} holds {bad!r}, which is not UTF-8 text")
        for g in _subgraphs(node):
            _check_graph_text(g, f"a subgraph of node '{node.name}'")


def check_arity(graph: onnx.GraphProto, opsets: Mapping[str, int]) -> None:
    """ModelError unless every node of a standard ONNX operator in ``graph`` (and its subgraphs) lists between
    the schema's least and most inputs and outputs, with a name in each required (single, non-optional) input.

    ``opsets``: domain ("" for ONNX) -> imported opset version.  Nodes of other domains are left to their
    kernels, which check what they read.
    """
    for node in graph.node:
        if node.domain in ("", "ai.onnx"):
            try:
                schema = onnx.defs.get_schema(node.op_type, opsets.get("", onnx.defs.onnx_opset_version()), "")
            except onnx.defs.SchemaError:
                schema = None
            if schema is not None:
                _check_node_arity(node, schema)
        for g in _subgraphs(node):
            check_arity(g, opsets)


def _check_node_arity(node: onnx.NodeProto, schema) -> None:
    name = f"{node.op_type} node '{node.name or (node.output[0] if node.output else '')}'"
    n_in, n_out = len(node.input), len(node.output)
    if not schema.min_input <= n_in <= schema.max_input:
        raise ModelError(
            f"load: {name} lists {n_in} input(s); opset {schema.since_version} of {node.op_type} takes "
            f"{schema.min_input} to {schema.max_input}"
        )
    if not schema.min_output <= n_out <= schema.max_output:
        raise ModelError(
            f"load: {name} lists {n_out} output(s); opset {schema.since_version} of {node.op_type} makes "
            f"{schema.min_output} to {schema.max_output}"
        )
    single = onnx.defs.OpSchema.FormalParameterOption.Single
    for i, formal in enumerate(schema.inputs[:n_in]):
        if formal.option == single and not node.input[i]:
            raise ModelError(f"load: {name} leaves its required input {i} ('{formal.name}') empty")
