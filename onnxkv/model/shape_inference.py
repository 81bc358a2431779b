"""Alias-aware shape inference.

:func:`infer_shapes` runs ONNX shape inference, then treats every alias
equivalence class as one value: members are linked by ``alias_of``, by
``MUST_ALIAS`` output/input pairs and by persistent bindings (input <- output).
Within a class, what is known for one member holds for all:

* element types and ranks must agree where known;
* per dimension, known integers must agree and are then set on every member;
  a symbolic dim (``"seq"``) replaces unknown and differing symbols are left
  alone (the binding of a growing cache legitimately has ``past_len`` on one
  side and ``total_len`` on the other).

Learned types are fed back to ONNX shape inference until nothing changes, so
consumers of an aliased value (which ONNX cannot type when its producer is a
custom operator) are inferred as well.  Finally, for every
``ai.onnxkv::CacheUpdate(cache [B, H, capacity, D], values [B, H, new, D], position)``
node with a constant position, ``position + new <= capacity`` is checked where
the dims are known integers.  Violations raise :class:`ContractError` naming
the values or the node.

The paged-cache operators always write in place, declared or not
(:data:`OPERATOR_ALIASES`): ``ai.onnxkv::PagedCacheUpdate``'s
``updated_cache`` is one class with its ``cache``, ``ai.rt::PagedAttention``'s
``present`` with its ``past`` and ``ai.rt::QuantizePagedCache``'s
``quantized_cache`` with its ``cache`` (whose known dim 1 must be 2).  ``PagedAttention``'s ``Y`` gets ``Q``'s type and
shape, and known dims are checked against the attributes: ``block_size`` is
dim 2 of the ``cache`` [P, H, bs, D] / dim 3 of the ``past`` [P, 2, Hkv, bs, D],
``past`` has 2 in dim 1 and ``kv_num_heads`` in dim 2, and
``max_tokens <= max_blocks * block_size`` for the ``block_table`` [B, max_blocks].

Large initializers are handed to ONNX as typed graph inputs, so inference
never copies a model's weights; operators in domains without an opset import
are tolerated (their outputs are left to the alias classes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxkv.errors import ModelError
from onnxkv.model.contract import Contract, ContractError, alias_value_names, describe_node

__all__ = ["OPERATOR_ALIASES", "infer_shapes"]

Dim = int | str | None

#: Initializers with more elements than this are replaced by typed inputs for ONNX inference.
_DATA_PROP_LIMIT = 1024
#: Rounds of (ONNX inference, class merge) before giving up on reaching a fixed point.
_MAX_ROUNDS = 16

#: (domain, op_type) -> (output index, input index) pairs an operator always writes in place
#: (MUST_ALIAS whether or not the node declares it).
OPERATOR_ALIASES: dict[tuple[str, str], tuple[tuple[int, int], ...]] = {
    ("ai.onnxkv", "PagedCacheUpdate"): ((0, 0),),
    ("ai.rt", "PagedAttention"): ((1, 3),),
    ("ai.rt", "QuantizePagedCache"): ((0, 0),),
}


@dataclass(frozen=True)
class _Type:
    """What is known of one tensor value: element type (0 = unknown) and dims (None = unknown rank)."""

    elem_type: int = 0
    dims: tuple[Dim, ...] | None = None


def infer_shapes(model: onnx.ModelProto) -> dict[str, tuple[Dim, ...]]:
    """Infer main-graph tensor shapes with alias equivalence classes.

    Returns value name -> dims (an int, a symbolic name, or None when unknown)
    for every value whose rank is known.  Raises ContractError on conflicting
    types within an alias class, on an alias declaration that names a missing
    node input/output, on a CacheUpdate that would overflow its cache and on
    paged-cache operators whose known dims contradict their attributes;
    ModelError when ONNX shape inference itself fails.
    """
    classes = _alias_classes(model, Contract.from_model(model))
    light = _light_model(model)
    types: dict[str, _Type] = {}
    for _ in range(_MAX_ROUNDS):
        types = _onnx_types(light, model.graph)
        learned = _merge_classes(classes, types)
        learned.update(_attention_outputs(model.graph, {**types, **learned}))
        if not learned:
            break
        types.update(learned)
        _declare(light.graph, learned)
    _check_capacity(model.graph, types)
    _check_paged(model.graph, types)
    return {name: t.dims for name, t in types.items() if t.dims is not None}


# -- alias classes ------------------------------------------------------------------------------


def _alias_classes(model: onnx.ModelProto, contract: Contract) -> list[list[str]]:
    """Partition the aliased value names into equivalence classes (each sorted, two or more names)."""
    parent: dict[str, str] = {}

    def find(name: str) -> str:
        parent.setdefault(name, name)
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    def union(a: str, b: str) -> None:
        parent[find(a)] = find(b)

    graph = model.graph
    for index, aliases in contract.output_aliases.items():
        node = graph.node[index]
        for alias in aliases:
            output_name, input_name = alias_value_names(node, alias, index)
            union(output_name, input_name)
    for node in graph.node:
        for output_index, input_index in OPERATOR_ALIASES.get((node.domain, node.op_type), ()):
            if (
                output_index < len(node.output)
                and node.output[output_index]
                and input_index < len(node.input)
                and node.input[input_index]
            ):
                union(node.output[output_index], node.input[input_index])
    for name, target in contract.alias_of.items():
        union(name, target)
    for input_name, output_name in contract.persistent_bindings.items():
        union(input_name, output_name)
    members: dict[str, list[str]] = {}
    for name in parent:
        members.setdefault(find(name), []).append(name)
    return [sorted(group) for group in members.values() if len(group) > 1]


def _merge_classes(classes: list[list[str]], types: dict[str, _Type]) -> dict[str, _Type]:
    """Merge what each class knows; return the members whose type became more precise."""
    learned: dict[str, _Type] = {}
    for members in classes:
        merged = _merge(members, types)
        for name in members:
            own = types.get(name, _Type())
            refined = _refine(own, merged)
            if refined != own:
                learned[name] = refined
    return learned


def _refine(own: _Type, merged: _Type) -> _Type:
    """``merged`` for one member, keeping the member's own symbol where the class has none."""
    if merged.dims is None or own.dims is None:
        return merged
    dims = tuple(own_dim if dim is None else dim for own_dim, dim in zip(own.dims, merged.dims))
    return _Type(merged.elem_type, dims)


def _merge(members: list[str], types: dict[str, _Type]) -> _Type:
    known = [(name, types[name]) for name in members if name in types]
    where = f"alias class {members}"
    elem_type, elem_from = 0, ""
    for name, t in known:
        if t.elem_type and elem_type and t.elem_type != elem_type:
            raise ContractError(
                f"values {elem_from!r} and {name!r} alias each other ({where}) but have element "
                f"types {_type_name(elem_type)} and {_type_name(t.elem_type)}"
            )
        if t.elem_type and not elem_type:
            elem_type, elem_from = t.elem_type, name
    shaped = [(name, t.dims) for name, t in known if t.dims is not None]
    if not shaped:
        return _Type(elem_type, None)
    first, first_dims = shaped[0]
    for name, dims in shaped[1:]:
        if len(dims) != len(first_dims):
            raise ContractError(
                f"values {first!r} and {name!r} alias each other ({where}) but have ranks "
                f"{len(first_dims)} and {len(dims)} (shapes {list(first_dims)} and {list(dims)})"
            )
    return _Type(elem_type, tuple(_merge_dim(axis, shaped, where) for axis in range(len(first_dims))))


def _merge_dim(axis: int, shaped: list[tuple[str, tuple[Dim, ...]]], where: str) -> Dim:
    ints = [(name, dims[axis]) for name, dims in shaped if isinstance(dims[axis], int)]
    for name, value in ints[1:]:
        if value != ints[0][1]:
            raise ContractError(
                f"values {ints[0][0]!r} and {name!r} alias each other ({where}) but dim {axis} "
                f"is {ints[0][1]} vs {value}"
            )
    if ints:
        return ints[0][1]
    symbols = {dims[axis] for _, dims in shaped if isinstance(dims[axis], str)}
    return symbols.pop() if len(symbols) == 1 else None


def _type_name(elem_type: int) -> str:
    return onnx.TensorProto.DataType.Name(elem_type)


# -- ONNX shape inference -----------------------------------------------------------------------


def _light_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy for ONNX inference: large initializers become typed inputs, every used domain is imported."""
    light = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import, functions=model.functions)
    src, graph = model.graph, light.graph
    graph.name = src.name
    for name in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(graph, name).extend(getattr(src, name))
    inputs = {value_info.name for value_info in src.input}
    for tensor in src.initializer:
        external = tensor.data_location == onnx.TensorProto.EXTERNAL
        if not external and int(np.prod(tensor.dims, dtype=np.int64)) <= _DATA_PROP_LIMIT:
            graph.initializer.append(tensor)
        elif tensor.name not in inputs:
            graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    imported = {opset.domain for opset in light.opset_import} | {"ai.onnx"}
    for domain in sorted(_domains(src) - imported):
        light.opset_import.append(helper.make_opsetid(domain, 1))
    return light


def _domains(graph: onnx.GraphProto) -> set[str]:
    domains = set()
    for node in graph.node:
        domains.add(node.domain)
        for attribute in node.attribute:
            for subgraph in [attribute.g, *attribute.graphs]:
                domains |= _domains(subgraph)
    return domains


def _onnx_types(light: onnx.ModelProto, original: onnx.GraphProto) -> dict[str, _Type]:
    """Run ONNX inference on ``light``; return the type of every main-graph value it knows."""
    try:
        inferred = onnx.shape_inference.infer_shapes(light, check_type=False, strict_mode=False, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        raise ModelError(f"ONNX shape inference failed: {exc}") from None
    types = {
        tensor.name: _Type(tensor.data_type, tuple(int(d) for d in tensor.dims)) for tensor in original.initializer
    }
    graph = inferred.graph
    for value_info in [*graph.input, *graph.output, *graph.value_info]:
        if value_info.type.HasField("tensor_type"):
            tensor_type = value_info.type.tensor_type
            dims = tuple(_dim(d) for d in tensor_type.shape.dim) if tensor_type.HasField("shape") else None
            types.setdefault(value_info.name, _Type(tensor_type.elem_type, dims))
    return types


def _dim(dim: onnx.TensorShapeProto.Dimension) -> Dim:
    if dim.HasField("dim_value"):
        return int(dim.dim_value)
    return dim.dim_param or None


def _declare(graph: onnx.GraphProto, learned: dict[str, _Type]) -> None:
    """Write learned types into ``graph`` (replacing its own entries for those names)."""
    for value_info in [*graph.input, *graph.output, *graph.value_info]:
        if value_info.name in learned:
            value_info.type.CopyFrom(_type_proto(learned[value_info.name]))
    listed = {value_info.name for value_info in [*graph.input, *graph.output, *graph.value_info]}
    for name in sorted(learned.keys() - listed):
        graph.value_info.add(name=name).type.CopyFrom(_type_proto(learned[name]))


def _type_proto(t: _Type) -> onnx.TypeProto:
    return helper.make_tensor_type_proto(t.elem_type, t.dims)


# -- CacheUpdate capacity -----------------------------------------------------------------------


def _check_capacity(graph: onnx.GraphProto, types: dict[str, _Type]) -> None:
    for index, node in enumerate(graph.node):
        if node.domain != "ai.onnxkv" or node.op_type != "CacheUpdate" or len(node.input) < 3:
            continue
        cache, values, position = node.input[:3]
        capacity = _axis(types.get(cache), 2)
        new_length = _axis(types.get(values), 2)
        start = _constant_max(graph, position)
        if capacity is None or new_length is None or start is None:
            continue
        if start + new_length > capacity:
            raise ContractError(
                f"{describe_node(node, index)}: position {start} + update length {new_length} "
                f"of {values!r} exceeds the capacity {capacity} of cache {cache!r}"
            )


def _axis(t: _Type | None, axis: int) -> int | None:
    if t is None or t.dims is None or len(t.dims) <= axis or not isinstance(t.dims[axis], int):
        return None
    return t.dims[axis]


def _constant_max(graph: onnx.GraphProto, name: str) -> int | None:
    """The largest element of the constant integer tensor ``name`` (initializer or Constant), or None.

    An initializer that is also a graph input is only a default and does not count.
    """
    if any(value_info.name == name for value_info in graph.input):
        return None
    for tensor in graph.initializer:
        if tensor.name == name and tensor.data_location != onnx.TensorProto.EXTERNAL:
            return _max_int(numpy_helper.to_array(tensor))
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and name in node.output:
            for attribute in node.attribute:
                if attribute.name in ("value", "value_int", "value_ints"):
                    return _max_int(np.asarray(helper.get_attribute_value(attribute)))
    return None


def _max_int(array: np.ndarray) -> int | None:
    array = np.asarray(array)
    if array.size == 0 or array.dtype.kind not in "iu":
        return None
    return int(array.max())


# -- paged-cache operators ----------------------------------------------------------------------


def _attention_outputs(graph: onnx.GraphProto, types: dict[str, _Type]) -> dict[str, _Type]:
    """``Y`` of each ``ai.rt::PagedAttention`` takes ``Q``'s type where that is more precise than Y's own."""
    learned: dict[str, _Type] = {}
    for node in graph.node:
        if (
            (node.domain, node.op_type) != ("ai.rt", "PagedAttention")
            or not node.input
            or not node.output
            or not node.output[0]
            or node.input[0] not in types
        ):
            continue
        q, own = types[node.input[0]], types.get(node.output[0], _Type())
        if q.dims is not None and own.dims is not None and len(q.dims) != len(own.dims):
            continue  # the kernel rejects the rank at run time
        refined = _refine(own, _Type(q.elem_type or own.elem_type, own.dims if q.dims is None else q.dims))
        if refined != own:
            learned[node.output[0]] = refined
    return learned


def _check_paged(graph: onnx.GraphProto, types: dict[str, _Type]) -> None:
    """Known dims of paged-cache operator inputs must agree with the node's attributes."""
    for index, node in enumerate(graph.node):
        key = (node.domain, node.op_type)
        if key not in OPERATOR_ALIASES:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        label = describe_node(node, index)
        if key == ("ai.onnxkv", "PagedCacheUpdate"):
            if node.input:
                _expect(label, node.input[0], types, 2, attrs.get("block_size"), "block_size")
            continue
        if key == ("ai.rt", "QuantizePagedCache"):
            if node.input:
                _expect(label, node.input[0], types, 1, 2, "K/V index (2)")
            continue
        if len(node.input) < 5:
            continue
        past, table = node.input[3], node.input[4]
        _expect(label, past, types, 1, 2, "K/V index (2)")
        _expect(label, past, types, 2, attrs.get("kv_num_heads"), "kv_num_heads")
        _expect(label, past, types, 3, attrs.get("block_size"), "block_size")
        blocks, block_size, max_tokens = _axis(types.get(table), 1), attrs.get("block_size"), attrs.get("max_tokens")
        if (
            blocks is not None
            and block_size is not None
            and max_tokens is not None
            and max_tokens > blocks * block_size
        ):
            raise ContractError(
                f"{label}: max_tokens={max_tokens} exceeds the {blocks} blocks of {block_size} tokens "
                f"of block table {table!r}"
            )


def _expect(label: str, name: str, types: dict[str, _Type], axis: int, want: int | None, what: str) -> None:
    have = _axis(types.get(name), axis)
    if have is not None and want is not None and have != want:
        raise ContractError(f"{label}: dim {axis} of {name!r} is {have}, but {what} is {want}")
