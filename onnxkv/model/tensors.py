"""A model's stored tensors and attributes, read with their sizes and types checked.

Everything a model file stores is hostile until checked: a tensor's dims,
its element type and the bytes (or typed entries) it holds must agree before
any array is made from them, and an attribute's declared type, its value and
the type the operator's schema expects must agree before any kernel reads it.
Sizes are computed in Python ints (no overflow) from the dims, so a tensor
declaring 2^40 elements with 4 bytes of data is rejected without allocating.

* :func:`element_count` / :func:`data_nbytes`: what the dims promise.
* :func:`tensor_array`: a ``TensorProto`` with in-file data as a NumPy array
  (:class:`~onnxkv.errors.ModelError` naming the tensor, the size held and the
  size expected when they differ).
* :func:`check_attributes`: every attribute of every node of a graph (and of
  its subgraphs) is well formed: a known type whose value is set, UTF-8
  strings, tensors whose data fits their dims, and for standard ONNX operators
  the type the schema declares.

This module imports only ``onnx`` and ``numpy``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from onnxkv.errors import ModelError

__all__ = ["element_count", "data_nbytes", "tensor_array", "check_attributes"]

#: Element types stored packed in ``raw_data``: bits per element.
_PACKED_BITS = {
    TensorProto.INT4: 4,
    TensorProto.UINT4: 4,
    TensorProto.FLOAT4E2M1: 4,
    TensorProto.INT2: 2,
    TensorProto.UINT2: 2,
    TensorProto.FLOAT6E2M3: 6,
    TensorProto.FLOAT6E3M2: 6,
}
#: Elements per ``int32_data`` entry of the packed types (one byte per entry; 6-bit: one element).
_PER_ENTRY = {
    TensorProto.INT4: 2,
    TensorProto.UINT4: 2,
    TensorProto.FLOAT4E2M1: 2,
    TensorProto.INT2: 4,
    TensorProto.UINT2: 4,
}
_COMPLEX = (TensorProto.COMPLEX64, TensorProto.COMPLEX128)


def _type_name(data_type: int) -> str:
    return TensorProto.DataType.Name(data_type) if data_type in TensorProto.DataType.values() else str(data_type)


def element_count(tensor: TensorProto, what: str) -> int:
    """The number of elements ``tensor``'s dims declare (a Python int); ModelError for a negative dim, or
    dims whose nonzero ones multiply past 2**62 (no array has that shape, even with a 0 dim beside them)."""
    count = extent = 1
    for d in tensor.dims:
        if d < 0:
            raise ModelError(f"{what} has dims {list(tensor.dims)}: a dim is negative")
        count *= int(d)
        extent *= max(int(d), 1)
    if extent > 2**62:
        raise ModelError(f"{what} has dims {list(tensor.dims)}: no array has that shape (dims past 2**62)")
    return count


def _np_dtype(data_type: int, what: str) -> np.dtype:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(data_type))
    except (KeyError, TypeError, ValueError):
        raise ModelError(
            f"{what} has element type {_type_name(data_type)}, which is not a tensor type onnxkv can read"
        ) from None


def data_nbytes(data_type: int, count: int, what: str) -> int:
    """Bytes of ``raw_data`` (or external data) ``count`` elements of ``data_type`` occupy (packed types packed)."""
    if data_type == TensorProto.STRING:
        raise ModelError(f"{what} is a STRING tensor, which cannot be stored as raw or external data")
    bits = _PACKED_BITS.get(data_type)
    if bits is not None:
        return -(-count * bits // 8)
    return count * _np_dtype(data_type, what).itemsize


def _expected_entries(data_type: int, count: int) -> int:
    """Entries of the typed field (``float_data``, ``int32_data`` ...) ``count`` elements occupy."""
    if data_type in _COMPLEX:
        return 2 * count
    per = _PER_ENTRY.get(data_type)
    return count if per is None else -(-count // per)


def _check_data(tensor: TensorProto, what: str) -> int:
    """Check that ``tensor``'s in-file data fits its dims and element type; return its element count."""
    if tensor.data_location == TensorProto.EXTERNAL:
        raise ModelError(f"{what} keeps its data in an external file; load the model with onnxkv.load")
    if tensor.HasField("segment"):
        raise ModelError(f"{what} is a segment of a tensor; segments are not supported")
    count = element_count(tensor, what)
    _np_dtype(tensor.data_type, what)
    dims = list(tensor.dims)
    if tensor.HasField("raw_data"):
        want = data_nbytes(tensor.data_type, count, what)
        if len(tensor.raw_data) != want:
            raise ModelError(
                f"{what} holds {len(tensor.raw_data)} bytes of raw_data, expected {want} for dims "
                f"{dims} of {_type_name(tensor.data_type)}"
            )
        return count
    field = helper.tensor_dtype_to_field(tensor.data_type)
    have, want = len(getattr(tensor, field)), _expected_entries(tensor.data_type, count)
    if have != want:
        raise ModelError(
            f"{what} holds {have} entries in {field}, expected {want} for dims {dims} of {_type_name(tensor.data_type)}"
        )
    return count


def tensor_array(tensor: TensorProto, what: str) -> np.ndarray:
    """``tensor`` (data stored in the model) as a NumPy array, after :func:`_check_data`.

    ``what`` names the tensor in errors (e.g. ``"initializer 'w'"``).

    Raises:
        ModelError: a negative dim, an unknown element type, data of another
            size than the dims declare, invalid UTF-8 strings, or external data.
    """
    count = _check_data(tensor, what)
    try:
        arr = numpy_helper.to_array(tensor)
    except (ValueError, TypeError, KeyError) as e:  # UnicodeDecodeError is a ValueError
        raise ModelError(f"{what} cannot be read: {type(e).__name__}: {e}") from None
    if arr.size != count:
        raise ModelError(f"{what} holds {arr.size} elements, expected {count} for dims {list(tensor.dims)}")
    return arr


#: Which field holds an attribute's value, per attribute type, and whether it is repeated.
_ATTRIBUTE_FIELDS = {
    AttributeProto.FLOAT: ("f", False),
    AttributeProto.INT: ("i", False),
    AttributeProto.STRING: ("s", False),
    AttributeProto.TENSOR: ("t", False),
    AttributeProto.GRAPH: ("g", False),
    AttributeProto.SPARSE_TENSOR: ("sparse_tensor", False),
    AttributeProto.TYPE_PROTO: ("tp", False),
    AttributeProto.FLOATS: ("floats", True),
    AttributeProto.INTS: ("ints", True),
    AttributeProto.STRINGS: ("strings", True),
    AttributeProto.TENSORS: ("tensors", True),
    AttributeProto.GRAPHS: ("graphs", True),
    AttributeProto.SPARSE_TENSORS: ("sparse_tensors", True),
    AttributeProto.TYPE_PROTOS: ("type_protos", True),
}


@functools.lru_cache(maxsize=1024)
def _schema_types(op_type: str, version: int, domain: str) -> dict[str, int]:
    """Attribute name -> AttributeProto type the ONNX schema of ``domain::op_type`` at ``version`` declares
    ({} without a schema).  Do not mutate the result (it is cached)."""
    try:
        schema = onnx.defs.get_schema(op_type, version, domain)
    except onnx.defs.SchemaError:
        return {}
    return {name: int(a.type) for name, a in schema.attributes.items()}


def check_attributes(graph: onnx.GraphProto, opsets: Mapping[str, int]) -> None:
    """Check every attribute of every node of ``graph`` and its subgraphs (see the module docstring).

    ``opsets``: domain ("" for ONNX) -> imported opset version, to find each
    standard operator's schema.

    Raises:
        ModelError: naming the node, the attribute, what it holds and what was expected.
    """
    for node in graph.node:
        name = f"{node.op_type} node '{node.name or (node.output[0] if node.output else '')}'"
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        expected = _schema_types(node.op_type, opsets.get(domain, onnx.defs.onnx_opset_version()), domain)
        for a in node.attribute:
            where = f"{name}: attribute '{a.name}'"
            if a.type not in _ATTRIBUTE_FIELDS:
                raise ModelError(f"{where} has type {a.type}, which is not an ONNX attribute type")
            field, repeated = _ATTRIBUTE_FIELDS[a.type]
            type_name = AttributeProto.AttributeType.Name(a.type)
            want = expected.get(a.name)
            if want is not None and want != a.type:
                raise ModelError(
                    f"{where} has type {type_name}, expected "
                    f"{AttributeProto.AttributeType.Name(want)} (ONNX schema of {node.op_type})"
                )
            if not repeated and not a.HasField(field):
                raise ModelError(f"{where} has type {type_name} but no value in its field '{field}'")
            strings = (
                list(a.strings)
                if a.type == AttributeProto.STRINGS
                else [a.s]
                if a.type == AttributeProto.STRING
                else []
            )
            for s in strings:
                try:
                    s.decode("utf-8")
                except UnicodeDecodeError:
                    raise ModelError(f"{where} holds the bytes {s[:32]!r}, expected a UTF-8 string") from None
            tensors = [a.t] if a.type == AttributeProto.TENSOR else list(a.tensors)
            for i, t in enumerate(tensors):
                _check_data(t, f"{where}" + (f" (tensor {i})" if a.type == AttributeProto.TENSORS else ""))
            for g in [a.g] if a.type == AttributeProto.GRAPH else list(a.graphs):
                for t in g.initializer:
                    _check_data(t, f"{where}: initializer '{t.name}' of the subgraph")
                check_attributes(g, opsets)
