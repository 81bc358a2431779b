"""Checking a model's alias and persistence contract.

:func:`check_model` reads the declarations (:mod:`onnxkv.model.contract`)
and enforces, raising :class:`ContractError` naming the node or value:

* declarations sit on the main graph only (not inside subgraphs);
* a ``MUST_ALIAS`` entry names an existing, non-empty node output and input;
  a node aliases each output at most once and each input at most once;
* no alias cycles (edges output -> input of ``output_alias`` and ``alias_of``);
* ``alias_of`` agrees with ``output_alias``: a value declaring ``alias_of = x``
  is the output of a node whose ``output_alias`` links that output to input ``x``;
* a ``MUST_ALIAS`` input is not an initializer, not a ``READ_ONLY`` graph
  input, and not shared: the aliasing node is its only use;
* ``READ_WRITE`` is declared on graph inputs only (not on initializers);
* a persistent binding ``input <- output`` names a graph input that is not an
  initializer and a graph output or node output; an output feeds one input;
* a bound input has exactly one use;
* alias partners have compatible element types, ranks and dims, and every
  ``CacheUpdate`` fits its cache (:func:`onnxkv.model.shape_inference.infer_shapes`).

A *use* is a node input position, a graph output, or a reference from inside
a subgraph (a capture, counted per position); value infos and metadata are
not uses.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx

from onnxkv.model.contract import (
    Access,
    Contract,
    ContractError,
    alias_value_names,
    describe_node,
    has_declarations,
)
from onnxkv.model.shape_inference import infer_shapes

__all__ = ["check_model", "value_uses"]


def check_model(model: onnx.ModelProto) -> Contract:
    """Check every contract rule of ``model``; return its :class:`Contract`.

    Raises ContractError (a ModelError) at the first violation.
    """
    graph = model.graph
    _check_no_subgraph_declarations(graph)
    contract = Contract.from_model(model)
    uses = value_uses(graph)
    initializers = {tensor.name for tensor in graph.initializer} | {t.values.name for t in graph.sparse_initializer}
    inputs = {value_info.name for value_info in graph.input}
    aliased = _check_output_aliases(graph, contract)
    _check_cycles(aliased, contract.alias_of)
    _check_alias_of(graph, contract, aliased)
    for (node_index, _), (_, input_name) in aliased.items():
        label = describe_node(graph.node[node_index], node_index)
        if input_name in initializers:
            raise ContractError(
                f"{label}: MUST_ALIAS input {input_name!r} is an initializer; an aliased input must be writable"
            )
        if input_name in inputs and contract.access.get(input_name) is Access.READ_ONLY:
            raise ContractError(
                f"{label}: MUST_ALIAS input {input_name!r} is a READ_ONLY graph input; declare it READ_WRITE"
            )
        if len(uses[input_name]) != 1:
            raise ContractError(
                f"{label}: MUST_ALIAS input {input_name!r} is shared; the aliasing node must be "
                f"its only use, but it has {len(uses[input_name])}: {_list(uses[input_name])}"
            )
    for name, access in contract.access.items():
        if access is Access.READ_WRITE and (name not in inputs or name in initializers):
            what = "an initializer" if name in initializers else "not a graph input"
            raise ContractError(
                f"value {name!r} is declared READ_WRITE but is {what}; READ_WRITE is allowed on graph inputs only"
            )
    _check_bindings(graph, contract, uses, inputs, initializers)
    infer_shapes(model)
    return contract


def _list(items: Iterable[str]) -> str:
    return ", ".join(items)


def _check_no_subgraph_declarations(graph: onnx.GraphProto) -> None:
    for node_index, node in enumerate(graph.node):
        for attribute in node.attribute:
            for subgraph in _subgraphs(attribute):
                messages = [("graph", subgraph)]
                messages += [(describe_node(inner), inner) for inner in subgraph.node]
                messages += [
                    (f"value {vi.name!r}", vi) for vi in [*subgraph.input, *subgraph.output, *subgraph.value_info]
                ]
                for what, message in messages:
                    if has_declarations(message):
                        raise ContractError(
                            f"{what} in subgraph {attribute.name!r} of "
                            f"{describe_node(node, node_index)} carries onnxkv declarations; "
                            "they are only allowed on the main graph"
                        )
                _check_no_subgraph_declarations(subgraph)


def value_uses(graph: onnx.GraphProto) -> dict[str, list[str]]:
    """Value name -> a description of each of its uses in ``graph`` (see the module docstring)."""
    uses: dict[str, list[str]] = {}
    for node_index, node in enumerate(graph.node):
        label = describe_node(node, node_index)
        for position, name in enumerate(node.input):
            if name:
                uses.setdefault(name, []).append(f"{label} input {position}")
        for attribute in node.attribute:
            for subgraph in _subgraphs(attribute):
                for name, count in _captures(subgraph).items():
                    uses.setdefault(name, []).extend([f"subgraph {attribute.name!r} of {label}"] * count)
    for value_info in graph.output:
        uses.setdefault(value_info.name, []).append("graph output")
    return uses


def _subgraphs(attribute: onnx.AttributeProto) -> list[onnx.GraphProto]:
    if attribute.type == onnx.AttributeProto.GRAPH:
        return [attribute.g]
    if attribute.type == onnx.AttributeProto.GRAPHS:
        return list(attribute.graphs)
    return []


def _captures(graph: onnx.GraphProto) -> dict[str, int]:
    """Outer-scope names referenced inside ``graph`` (nested subgraphs included), with their counts."""
    defined = {value_info.name for value_info in graph.input}
    defined |= {tensor.name for tensor in graph.initializer} | {t.values.name for t in graph.sparse_initializer}
    defined |= {name for node in graph.node for name in node.output if name}
    refs: dict[str, int] = {}

    def add(name: str, count: int = 1) -> None:
        if name and name not in defined:
            refs[name] = refs.get(name, 0) + count

    for node in graph.node:
        for name in node.input:
            add(name)
        for attribute in node.attribute:
            for subgraph in _subgraphs(attribute):
                for name, count in _captures(subgraph).items():
                    add(name, count)
    for value_info in graph.output:
        add(value_info.name)
    return refs


def _check_output_aliases(graph: onnx.GraphProto, contract: Contract) -> dict[tuple[int, int], tuple[str, str]]:
    """Validate each node's MUST_ALIAS entries; return (node index, output index) -> (output, input) names."""
    aliased = {}
    for node_index, aliases in contract.output_aliases.items():
        node = graph.node[node_index]
        label = describe_node(node, node_index)
        by_input: dict[int, int] = {}
        for alias in aliases:
            if (node_index, alias.output_index) in aliased:
                raise ContractError(f"{label}: output {alias.output_index} is declared in output_alias twice")
            if alias.input_index in by_input:
                raise ContractError(
                    f"{label}: outputs {by_input[alias.input_index]} and {alias.output_index} "
                    f"both alias input {alias.input_index}; an input can back one output only"
                )
            by_input[alias.input_index] = alias.output_index
            aliased[node_index, alias.output_index] = alias_value_names(node, alias, node_index)
    return aliased


def _check_cycles(aliased: dict[tuple[int, int], tuple[str, str]], alias_of: dict[str, str]) -> None:
    edges: dict[str, set[str]] = {}
    for output_name, input_name in [*aliased.values(), *alias_of.items()]:
        edges.setdefault(output_name, set()).add(input_name)
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(edges.get(name, ())):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                raise ContractError(f"alias cycle: {' -> '.join(repr(n) for n in cycle)}")
            if target not in state:
                visit(target, path)
        path.pop()
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [])


def _check_alias_of(
    graph: onnx.GraphProto, contract: Contract, aliased: dict[tuple[int, int], tuple[str, str]]
) -> None:
    producers = {
        name: (node_index, output_index)
        for node_index, node in enumerate(graph.node)
        for output_index, name in enumerate(node.output)
        if name
    }
    for name, target in sorted(contract.alias_of.items()):
        if name not in producers:
            raise ContractError(
                f"value {name!r} declares alias_of {target!r} but is not a node output; "
                "only a MUST_ALIAS node output can alias an input"
            )
        node_index, output_index = producers[name]
        label = describe_node(graph.node[node_index], node_index)
        if (node_index, output_index) not in aliased:
            raise ContractError(
                f"value {name!r} declares alias_of {target!r}, but {label} declares no "
                f"output_alias for its output {output_index}"
            )
        declared = aliased[node_index, output_index][1]
        if declared != target:
            raise ContractError(
                f"value {name!r} declares alias_of {target!r}, but the output_alias of {label} "
                f"links it to input {declared!r}"
            )


def _check_bindings(
    graph: onnx.GraphProto, contract: Contract, uses: dict[str, list[str]], inputs: set[str], initializers: set[str]
) -> None:
    outputs = {value_info.name for value_info in graph.output}
    outputs |= {name for node in graph.node for name in node.output if name}
    bound_from: dict[str, str] = {}
    for input_name, output_name in contract.persistent_bindings.items():
        binding = f"persistent binding {input_name!r} <- {output_name!r}"
        if input_name not in inputs:
            raise ContractError(f"{binding}: {input_name!r} is not a graph input")
        if input_name in initializers:
            raise ContractError(f"{binding}: input {input_name!r} is an initializer; a bound input must be fed")
        if output_name not in outputs:
            raise ContractError(f"{binding}: {output_name!r} is neither a graph output nor a node output")
        if output_name in bound_from:
            raise ContractError(
                f"{binding}: output {output_name!r} is already bound to input "
                f"{bound_from[output_name]!r}; an output feeds one input only"
            )
        bound_from[output_name] = input_name
        found = uses.get(input_name, [])
        if len(found) != 1:
            raise ContractError(
                f"{binding}: bound input {input_name!r} must have exactly one use, "
                f"but has {len(found)}" + (f": {_list(found)}" if found else "")
            )
