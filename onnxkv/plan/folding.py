"""Constant folding: which nodes run once while a plan is built, and running them.

A node whose inputs are all constants is folded (its outputs become read-only
constants) unless it is non-deterministic, has subgraphs, or its outputs would
exceed the limit of :mod:`onnxkv.plan.fold_limit` (it then runs with every
call).  An output that is a view of every byte of a constant input (a Reshape
of a weight) stays a view, so a weight mapped from external data is neither
copied nor read in full; other outputs are copies.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxkv.errors import ModelError
from onnxkv.plan.constant_data import kernel_view
from onnxkv.plan.context import RunContext
from onnxkv.plan.fold_limit import FoldBudget, FoldTooLarge, fold_fits, has_schema
from onnxkv.plan.graph_order import node_label
from onnxkv.plan.registry import Op

__all__ = ["NON_DETERMINISTIC", "foldable", "fold_node", "whole_view"]

#: Operators that must never be folded at build time.
NON_DETERMINISTIC = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
)


def foldable(node: onnx.NodeProto, constants: dict) -> bool:
    """Whether ``node`` may be folded: deterministic, no subgraphs, every input constant (or omitted)."""
    if node.op_type in NON_DETERMINISTIC or any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
    ):
        return False
    return all((not x) or x in constants for x in node.input)


def fold_node(node: onnx.NodeProto, kernel: Op, constants: dict, opsets: dict[str, int]) -> bool:
    """Run ``node`` on its constant inputs and add its outputs to ``constants``; False when it is not
    folded (its outputs would exceed the fold limit).  A node failing on constants is a ModelError."""
    inputs = [kernel_view(constants[x]) if x else None for x in node.input]
    if has_schema(node, opsets) and not fold_fits(node, inputs, opsets):
        return False
    rt = RunContext(FoldBudget(sum(a.size for a in inputs if a is not None)), False, -1)
    try:
        outs = kernel.run(inputs, rt)
    except FoldTooLarge:
        return False
    except ModelError:
        raise
    except Exception as e:  # a node failing on constants fails in every run: a defect of the model
        raise ModelError(f"{node_label(node)} failed on constant inputs: {e}") from e
    for name, val in zip(node.output, outs):
        if name and val is not None:
            arr = val if whole_view(val, inputs) else np.array(val, copy=True)
            arr.flags.writeable = False
            constants[name] = arr
    return True


def whole_view(value, inputs: list) -> bool:
    """True when ``value`` is a C-contiguous view of every byte of one of the read-only constant ``inputs``
    (a Reshape of a weight): folding keeps it instead of a copy, so a weight mapped from external data is
    neither duplicated nor read in full."""
    if not isinstance(value, np.ndarray) or not value.flags.c_contiguous:
        return False
    start = value.__array_interface__["data"][0]
    return any(
        isinstance(a, np.ndarray)
        and not a.flags.writeable
        and a.flags.c_contiguous
        and a.nbytes == value.nbytes
        and a.__array_interface__["data"][0] == start
        for a in inputs
    )
