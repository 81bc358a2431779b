"""Values that are a function of each entry of an integer input alone (rotary tables), proved from the nodes.

Exports compute their rotary cosines and sines from ``position_ids`` [B, S]
every run: ``Unsqueeze``, ``Cast``, a ``Mul`` by the inverse frequencies, a
``Concat`` of the half with itself, ``Cos`` / ``Sin``, a ``Mul`` by the
attention scaling, a ``Cast``, and per layer an ``Unsqueeze`` of the head
axis (about a dozen nodes).  :func:`position_cones` finds, for each integer
graph input of rank 2, the nodes that transform it entry by entry: every value
they make has the input's two axes at two of its own (``a0 < a1``, extents
the input's) and *feature* axes of fixed extents elsewhere, and entry
``[..., b, ..., s, ...]`` depends on ``input[b, s]`` alone.  The rules keep
that true for every input:

* ``Unsqueeze`` (constant axes), ``Cast`` and element-wise unary operators;
* element-wise binary operators of two such values with the same two axes, or
  of one such value and a constant of rank no greater whose extent is 1 at the
  two axes (it broadcasts over features only);
* ``Concat`` of such values along a feature axis.

A value read by a node outside the nodes found (or a graph output) is an
*output* of the cone when its feature axes of extent > 1 all come after
``a1``: its memory is then ``[B, S, features]`` row-major, the rows of a
table indexed by the input's entries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from onnxkv.plan.fusion import constant_node_values

__all__ = ["Cone", "Layout", "position_cones"]

_UNARY = frozenset(("Cos", "Sin", "Neg", "Exp", "Sqrt", "Reciprocal", "Tanh", "Abs", "Log", "Floor", "Ceil"))
_BINARY = frozenset(("Add", "Sub", "Mul", "Div", "Pow"))


@dataclass(frozen=True)
class Layout:
    """A value of the cone: rank, the input's axes ``a0 < a1``, and the extents (None at ``a0``, ``a1``)."""

    shape: tuple
    a0: int
    a1: int


@dataclass(frozen=True)
class Cone:
    """The nodes (indices, graph order) that transform ``source`` entry by entry, and the values read
    outside them (``outputs``, with their layouts)."""

    source: str
    nodes: tuple
    outputs: tuple  # (name, Layout)


def _attr(node: onnx.NodeProto, name: str, default=None):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _constant(name: str, constants, made: dict) -> np.ndarray | None:
    if name in made:
        return made[name]
    c = constants.get(name)
    return c if isinstance(c, np.ndarray) else None


def _unsqueeze(v: Layout, axes: list[int]) -> Layout | None:
    rank = len(v.shape) + len(axes)
    axes = sorted(a + rank if a < 0 else a for a in axes)
    if len(set(axes)) != len(axes) or not all(0 <= a < rank for a in axes):
        return None
    shape, where = list(v.shape), [v.a0, v.a1]
    for a in axes:
        shape.insert(a, 1)
        where = [w + 1 if w >= a else w for w in where]
    return Layout(tuple(shape), where[0], where[1])


def _with_constant(v: Layout, c: np.ndarray) -> Layout | None:
    if c.ndim > len(v.shape):
        return None
    cshape = (1,) * (len(v.shape) - c.ndim) + c.shape
    if cshape[v.a0] != 1 or cshape[v.a1] != 1:
        return None
    out = []
    for i, (x, y) in enumerate(zip(v.shape, cshape)):
        if i in (v.a0, v.a1):
            out.append(None)
        elif x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return Layout(tuple(out), v.a0, v.a1)


def _pair(a: Layout, b: Layout) -> Layout | None:
    if len(a.shape) != len(b.shape) or (a.a0, a.a1) != (b.a0, b.a1):
        return None
    out = []
    for x, y in zip(a.shape, b.shape):
        if x is None or x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return Layout(tuple(out), a.a0, a.a1)


def _concat(values: list, axis: int) -> Layout | None:
    first = values[0]
    rank = len(first.shape)
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank or axis in (first.a0, first.a1):
        return None
    if any(len(v.shape) != rank or (v.a0, v.a1) != (first.a0, first.a1) for v in values):
        return None
    if any(v.shape[:axis] + v.shape[axis + 1 :] != first.shape[:axis] + first.shape[axis + 1 :] for v in values):
        return None
    shape = list(first.shape)
    shape[axis] = sum(v.shape[axis] for v in values)
    return Layout(tuple(shape), first.a0, first.a1)


def rows_layout(v: Layout) -> bool:
    """Whether every feature axis of extent > 1 comes after ``a1`` (the value is [B, S, features] in memory)."""
    return all(d == 1 for i, d in enumerate(v.shape) if i < v.a1 and i != v.a0)


def position_cones(
    nodes: list[onnx.NodeProto], constants: Mapping, inputs: set[str], protected: set[str]
) -> list[Cone]:
    """The cones of ``nodes`` (topologically ordered) over each graph input of ``inputs`` taken as [B, S] (the
    fused kernel reads its tables only for int64 [B, S] positions, and runs the nodes otherwise), each with at
    least one output; ``constants``: initializer values."""
    made = constant_node_values(nodes)
    cones = []
    for source in inputs:
        layouts: dict[str, Layout] = {source: Layout((None, None), 0, 1)}
        members: list[int] = []
        for i, n in enumerate(nodes):
            if n.domain not in ("", "ai.onnx") or len(n.output) != 1 or not any(x in layouts for x in n.input):
                continue
            ins = [layouts.get(x) for x in n.input]
            out = None
            if n.op_type == "Unsqueeze" and ins[0] is not None:
                axes = _attr(n, "axes")
                if axes is None and len(n.input) > 1:
                    c = _constant(n.input[1], constants, made)
                    axes = None if c is None or c.dtype != np.int64 or c.ndim != 1 else c.tolist()
                out = None if axes is None else _unsqueeze(ins[0], list(axes))
            elif n.op_type in _UNARY or n.op_type == "Cast":
                out = ins[0] if len(n.input) == 1 else None
            elif n.op_type in _BINARY and len(n.input) == 2:
                a, b = ins
                if a is not None and b is not None:
                    out = _pair(a, b)
                else:
                    c = _constant(n.input[1] if a is not None else n.input[0], constants, made)
                    out = None if c is None else _with_constant(a if a is not None else b, c)
            elif n.op_type == "Concat" and all(v is not None for v in ins) and ins:
                out = _concat(ins, int(_attr(n, "axis", 0)))
            if out is not None:
                layouts[n.output[0]] = out
                members.append(i)
        inside = {nodes[i].output[0] for i in members}
        member_set = set(members)
        outputs = []
        for i in members:
            name = nodes[i].output[0]
            read_outside = name in protected or any(
                name in n.input for j, n in enumerate(nodes) if j not in member_set and n.op_type != "Constant"
            )
            if read_outside and rows_layout(layouts[name]):
                outputs.append((name, layouts[name]))
            elif read_outside:
                outputs = []
                break
        if outputs and inside:
            cones.append(Cone(source, tuple(members), tuple(outputs)))
    return cones
