"""How large a value constant folding may make while a plan is built.

Folding runs a node whose inputs are all constants once, at build time.  A
node can ask for far more memory than the model file holds
(``ConstantOfShape([2**29])``, ``Expand``, ``Tile``, ``Range``, a broadcast
of two vectors), so before a node is folded :func:`fold_fits` predicts the
size of each output from the inputs' shapes and small constant values, with
ONNX's own shape inference (exact integer arithmetic, overflow checked), and
the node is folded only when every output holds at most
:data:`FOLD_LIMIT_BYTES` or no more elements than its inputs together (a
transposed, cast or dequantized weight).  A node that does not fit, or whose
output size cannot be predicted (no ONNX schema, or the inference fails or
leaves a dim unknown), is not folded: it runs with every call instead, with
the same result.  Operators without an ONNX schema (onnxkv's and
``com.microsoft``'s) are folded under the same limit, enforced on the
outputs their kernels allocate with ``rt.empty`` (:class:`FoldBudget`).
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["FOLD_LIMIT_BYTES", "FoldBudget", "FoldTooLarge", "fold_fits", "has_schema"]

#: A folded output may hold more bytes than this only if it has no more elements than its inputs together.
FOLD_LIMIT_BYTES = 64 << 20
#: Constant inputs with at most this many elements are given to shape inference by value (shapes, repeats, ...).
_VALUE_LIMIT = 64


def _schema(node: onnx.NodeProto, opsets: Mapping[str, int]):
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    try:
        return onnx.defs.get_schema(node.op_type, opsets.get(domain, onnx.defs.onnx_opset_version()), domain)
    except onnx.defs.SchemaError:
        return None


def has_schema(node: onnx.NodeProto, opsets: Mapping[str, int]) -> bool:
    """True when ONNX knows ``node``'s operator at the model's opset (its output sizes can be predicted)."""
    return _schema(node, opsets) is not None


def _allowed(elements: int, itemsize: int, input_elements: int) -> bool:
    return elements * itemsize <= FOLD_LIMIT_BYTES or elements <= input_elements


def fold_fits(node: onnx.NodeProto, inputs: list[np.ndarray | None], opsets: Mapping[str, int]) -> bool:
    """True when folding ``node`` over the constant ``inputs`` (None: omitted) stays within the limit.

    ``node`` must have an ONNX schema (:func:`has_schema`).  False when any
    output would exceed the limit or its size cannot be predicted.
    """
    schema = _schema(node, opsets)
    types: dict[str, onnx.TypeProto] = {}
    data: dict[str, onnx.TensorProto] = {}
    for name, arr in zip(node.input, inputs):
        if not name or arr is None:
            continue
        try:
            elem = helper.np_dtype_to_tensor_dtype(arr.dtype)
        except (KeyError, TypeError, ValueError):
            return False
        types[name] = helper.make_tensor_type_proto(elem, list(arr.shape))
        if arr.size <= _VALUE_LIMIT and arr.dtype.kind in "iufb":
            data[name] = numpy_helper.from_array(np.ascontiguousarray(arr), name)
    try:
        outs = onnx.shape_inference.infer_node_outputs(
            schema, node, types, data, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()]
        )
    except Exception:  # the inference rejected the node: let it fail (or not) at run time
        return False
    input_elements = sum(a.size for a in inputs if a is not None)
    for name in node.output:
        if not name:
            continue
        t = outs.get(name)
        if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
            return False
        dims = t.tensor_type.shape.dim
        if any(not d.HasField("dim_value") or d.dim_value < 0 for d in dims):
            return False
        try:
            itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(t.tensor_type.elem_type)).itemsize
        except (KeyError, TypeError, ValueError):
            itemsize = 8
        if not _allowed(prod(int(d.dim_value) for d in dims), itemsize, input_elements):
            return False
    return True


class FoldTooLarge(Exception):
    """Raised by :class:`FoldBudget` when a kernel asks for an output over the limit (the node is not folded)."""


class FoldBudget:
    """The ``rt.empty`` allocator of a fold: refuses outputs over the limit (:class:`FoldTooLarge`).

    Args:
        input_elements: elements of the node's constant inputs together.
    """

    def __init__(self, input_elements: int) -> None:
        self.input_elements = input_elements

    def __call__(self, _rt, _index: int, shape, dtype: np.dtype) -> np.ndarray:
        elements = prod(int(d) for d in shape)
        if any(int(d) < 0 for d in shape) or not _allowed(elements, np.dtype(dtype).itemsize, self.input_elements):
            raise FoldTooLarge(f"output of shape {tuple(shape)} over the fold limit")
        return np.empty(shape, dtype)
