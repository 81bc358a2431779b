"""What the attention-mask chains of exports compute, proved from their nodes (no values needed).

Exports rebuild the attention mask from ``attention_mask`` [B, T] every run
with a chain of small index nodes.  ``transformers``' ``sdpa_mask`` /
``eager_mask`` as ``torch.onnx.export`` writes them (about 35 nodes: the
key positions ``Range(0, past + S)``, the query positions ``Range(0, S) +
past``, their comparison, the padding read by ``Gather`` from the flattened
mask at ``b * T + k``, an ``Expand`` and a ``Where`` to 0 / float32 min), and
onnxkv.zoo's Attention graphs (``Range`` / ``LessOrEqual`` / ``And`` with the
mask unsqueezed) are such chains.

:func:`analyse` evaluates a chain *symbolically*: every value becomes a
description that holds for every input -- a sum of input dims (:class:`Lin`),
a vector of them, an integer index tensor ``const + sum_a coeff_a * i_a`` over
its axes (:class:`Idx`), or a conjunction of comparisons and mask reads over
such indices (:class:`Pred`) -- and any node it cannot describe exactly makes
the values it produces unknown.  :func:`mask_formula` then accepts a 4-D
value only when it is, entry for entry,

    visible[b, 0, q, k] = (k <= q0 + q) [and k > q0 + q - W] [and mask[b, k] != 0]

over extents that are sums of dims, optionally turned into ``where(visible,
a, b)`` with two scalar constants.  The formula is a proof over all inputs
(up to the run-time conditions it lists: the keys within the mask's row, the
batch rows within its rows), so a fused node may compute it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import onnx
from onnx import numpy_helper

from onnxkv.plan.fusion import constant_node_value

__all__ = ["Lin", "MaskFormula", "analyse", "mask_formula"]

_INT64, _BOOL = onnx.TensorProto.INT64, onnx.TensorProto.BOOL
#: Largest window or offset constant taken (keeps every index sum far inside int64).
_LIMIT = 2**40


@dataclass(frozen=True)
class Lin:
    """``const + sum(coeff * dim(value, axis))``: an integer every input shape fixes."""

    terms: tuple = ()  # sorted ((value, axis), coeff) with coeff != 0
    const: int = 0

    def __add__(self, other: Lin) -> Lin:
        acc = dict(self.terms)
        for atom, c in other.terms:
            acc[atom] = acc.get(atom, 0) + c
        return Lin(tuple(sorted((a, c) for a, c in acc.items() if c)), self.const + other.const)

    def scale(self, k: int) -> Lin:
        return Lin(tuple((a, c * k) for a, c in self.terms) if k else (), self.const * k)

    @property
    def is_const(self) -> bool:
        return not self.terms

    @property
    def nonneg(self) -> bool:
        """Never negative (every dim is >= 0)."""
        return self.const >= 0 and all(c > 0 for _, c in self.terms)


_ONE, _ZERO = Lin((), 1), Lin((), 0)


class Vec(NamedTuple):
    """A 1-D integer tensor (a shape or a shape part) whose entries are :class:`Lin`."""

    items: tuple


class ShapeOf(NamedTuple):
    """``Shape(value)``, before an entry is taken."""

    value: str


@dataclass(frozen=True)
class Idx:
    """An integer tensor: entry ``i`` is ``const + sum_a coeff[a] * i[a]``; ``shape[a]`` its extents."""

    shape: tuple  # Lin per axis
    coeff: tuple  # Lin per axis (a dim only for a batch stride)
    const: Lin

    def __post_init__(self) -> None:
        # an axis of extent 1 only ever has index 0 (also where the tensor is broadcast): no coefficient
        coeff = tuple(_ZERO if n == _ONE else c for n, c in zip(self.shape, self.coeff))
        object.__setattr__(self, "coeff", coeff)


@dataclass(frozen=True)
class Pred:
    """A bool tensor of ``shape`` (Lin per axis, None: unknown extent): the conjunction of ``terms``, each
    ``("le" | "lt", a, b)`` (a <= b, a < b, for Idx a and b) or ``("mask", name, idx)`` (``name`` != 0 read
    at flat position ``idx`` of that graph input)."""

    shape: tuple
    terms: tuple


class Flat(NamedTuple):
    """``Reshape(pred, [-1])``: the entries of ``pred`` in row-major order (reshaped back later)."""

    pred: Pred


class Select(NamedTuple):
    """``Where(pred, a, b)`` with ``a`` and ``b`` one-element constants (of rank at most ``pred``'s)."""

    pred: Pred
    a: np.ndarray
    b: np.ndarray


@dataclass(frozen=True)
class MaskFormula:
    """``visible[b, 0, q, k] = (k <= q0 + q) & (k > q0 + q - window) & (mask[b, k] != 0)`` over
    ``[batch, 1, queries, keys]`` (window 0: none; mask None: no padding term; batch None: the batch axis is
    1), as bool, or ``where(visible, a, b)`` when ``values`` is (a, b)."""

    batch: Lin | None
    queries: Lin
    keys: Lin
    q0: Lin
    window: int
    mask: str | None
    values: tuple | None


def _attr(node: onnx.NodeProto, name: str, default=None):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _as_value(x: np.ndarray):
    """A small integer constant as a Lin (scalar) or Vec (1-D); anything else stays an array."""
    if x.dtype == np.int64 and x.ndim <= 1 and x.size <= 8 and (np.abs(x) < _LIMIT).all():
        return Lin((), int(x)) if x.ndim == 0 else Vec(tuple(Lin((), int(v)) for v in x))
    return x


def _axes(node: onnx.NodeProto, values: dict) -> list[int] | None:
    axes = _attr(node, "axes")
    if axes is None and len(node.input) > 1:
        v = values.get(node.input[1])
        axes = [a.const for a in v.items] if isinstance(v, Vec) and all(a.is_const for a in v.items) else None
    return None if axes is None else [int(a) for a in axes]


def _insert(i: Idx, axes: list[int]) -> Idx:
    """``i`` with unit axes inserted at ``axes`` (sorted positions of the result)."""
    shape, coeff = list(i.shape), list(i.coeff)
    for a in axes:
        shape.insert(a, _ONE)
        coeff.insert(a, _ZERO)
    return Idx(tuple(shape), tuple(coeff), i.const)


def _map_terms(terms: tuple, f) -> tuple:
    """``terms`` with ``f`` applied to every Idx they hold."""
    return tuple((t[0], t[1], f(t[2])) if t[0] == "mask" else (t[0], f(t[1]), f(t[2])) for t in terms)


def _unsqueeze(v, axes: list[int]):
    if isinstance(v, Lin):
        return Vec((v,)) if axes in ([0], [-1]) else None
    if not isinstance(v, Idx | Pred) or None in v.shape:
        return None
    rank = len(v.shape) + len(axes)
    axes = sorted(a + rank if a < 0 else a for a in axes)
    if len(set(axes)) != len(axes) or not all(0 <= a < rank for a in axes):
        return None
    shape = list(v.shape)
    for a in axes:
        shape.insert(a, _ONE)
    if isinstance(v, Idx):
        return _insert(v, axes)
    return Pred(tuple(shape), _map_terms(v.terms, lambda i: _insert(i, axes)))


def _bshape(a: tuple, b: tuple) -> tuple | None:
    """Broadcast of two symbolic shapes (aligned at the right), or None when not provably valid."""
    n = max(len(a), len(b))
    a, b = (_ONE,) * (n - len(a)) + a, (_ONE,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b):
        if x == _ONE:
            out.append(y)
        elif y == _ONE or x == y:
            out.append(x)
        else:
            return None
    return tuple(out)


def _lift(i: Idx, rank: int) -> Idx:
    n = rank - len(i.shape)
    return Idx((_ONE,) * n + i.shape, (_ZERO,) * n + i.coeff, i.const)


def _one(a, b):
    """A 1-element Vec beside an Idx of rank >= 1 broadcasts as its entry: (a, b) with it as a Lin."""
    if isinstance(a, Idx) and a.shape and isinstance(b, Vec) and len(b.items) == 1:
        return a, b.items[0]
    if isinstance(b, Idx) and b.shape and isinstance(a, Vec) and len(a.items) == 1:
        return a.items[0], b
    return a, b


def _add(a, b, sign: int = 1):
    a, b = _one(a, b)
    if isinstance(a, Lin) and isinstance(b, Lin):
        return a + b.scale(sign)
    if isinstance(a, Idx) and isinstance(b, Lin):
        return Idx(a.shape, a.coeff, a.const + b.scale(sign))
    if isinstance(a, Lin) and isinstance(b, Idx) and sign == 1:
        return _add(b, a)
    if isinstance(a, Idx) and isinstance(b, Idx):
        shape = _bshape(a.shape, b.shape)
        if shape is None:
            return None
        a, b = _lift(a, len(shape)), _lift(b, len(shape))
        return Idx(shape, tuple(x + y.scale(sign) for x, y in zip(a.coeff, b.coeff)), a.const + b.const.scale(sign))
    return None


def _mul(a, b):
    a, b = _one(a, b)
    if isinstance(b, Idx | Vec):
        a, b = b, a
    if isinstance(a, Lin) and isinstance(b, Lin):
        if a.is_const or b.is_const:
            return b.scale(a.const) if a.is_const else a.scale(b.const)
        return None
    if isinstance(a, Idx) and isinstance(b, Lin):
        if b.is_const:
            return Idx(a.shape, tuple(c.scale(b.const) for c in a.coeff), a.const.scale(b.const))
        if a.const == _ZERO and all(c.is_const for c in a.coeff):  # a batch index times a row length
            return Idx(a.shape, tuple(b.scale(c.const) for c in a.coeff), _ZERO)
    if isinstance(a, Vec) and isinstance(b, Lin | Vec):
        other = b.items if isinstance(b, Vec) else (b,) * len(a.items)
        if len(other) == 1:
            other = other * len(a.items)
        if len(other) == len(a.items) and all(x.is_const or y.is_const for x, y in zip(a.items, other)):
            return Vec(tuple(_mul(x, y) for x, y in zip(a.items, other)))
    return None


def _compare(op: str, a, b):
    if not (isinstance(a, Idx) and isinstance(b, Idx)):
        return None
    shape = _bshape(a.shape, b.shape)
    if shape is None:
        return None
    a, b = _lift(a, len(shape)), _lift(b, len(shape))
    term = {
        "LessOrEqual": ("le", a, b),
        "Less": ("lt", a, b),
        "GreaterOrEqual": ("le", b, a),
        "Greater": ("lt", b, a),
    }[op]
    return Pred(shape, (term,))


def _lift_pred(p: Pred, rank: int) -> tuple:
    """``p``'s terms on ``rank`` axes (leading unit axes added)."""
    return _map_terms(p.terms, lambda i: _lift(i, rank))


def _and(a, b):
    if not (isinstance(a, Pred) and isinstance(b, Pred)) or None in a.shape + b.shape:
        return None
    shape = _bshape(a.shape, b.shape)
    return None if shape is None else Pred(shape, _lift_pred(a, len(shape)) + _lift_pred(b, len(shape)))


def _gather(data, index, axis: int):
    if isinstance(index, Vec) and len(index.items) == 1 and isinstance(data, ShapeOf | Vec):
        item = _gather(data, index.items[0], axis)
        return None if item is None else Vec((item,))
    if isinstance(data, ShapeOf) and isinstance(index, Lin) and index.is_const and index.const >= 0 and axis == 0:
        return Lin((((data.value, index.const), 1),), 0)
    if (
        isinstance(data, Vec)
        and axis in (0, -1)
        and isinstance(index, Lin)
        and index.is_const
        and 0 <= index.const < len(data.items)
    ):
        return data.items[index.const]
    if isinstance(data, Pred) and isinstance(index, Idx) and axis == 0 and len(data.shape) == 2:
        # a flattened mask [N, 1] read at ``index``: every term's flat index composes with it
        (term,) = data.terms if len(data.terms) == 1 else (None,)
        if term is None or term[0] != "mask" or data.shape[1] != _ONE:
            return None
        flat = term[2]
        if flat.coeff != (_ONE, _ZERO) or flat.const != _ZERO:
            return None
        shape = index.shape + (_ONE,)
        return Pred(shape, (("mask", term[1], Idx(shape, index.coeff + (_ZERO,), index.const)),))
    return None


def _flatten(p, axis: int):
    if not isinstance(p, Pred) or len(p.shape) != 2 or axis != 2 or len(p.terms) != 1 or p.terms[0][0] != "mask":
        return None
    idx = p.terms[0][2]
    # row-major flat position of a [rows, cols] mask: rows * cols entries, one column
    if idx.coeff != (p.shape[1], _ONE) or idx.const != _ZERO:
        return None
    return Pred((None, _ONE), (("mask", p.terms[0][1], Idx((None, _ONE), (_ONE, _ZERO), _ZERO)),))


def _reshape(x, target):
    if isinstance(x, Vec) and target == Vec((Lin((), -1),)):
        return x
    if isinstance(x, Pred) and target == Vec((Lin((), -1),)):
        return Flat(x)
    if isinstance(x, Flat) and isinstance(target, Vec):
        p = x.pred
        keep = list(p.shape)
        while keep and keep[-1] == _ONE and len(keep) > len(target.items):
            keep.pop()
        if tuple(keep) != target.items:
            return None
        n = len(keep)
        return Pred(tuple(keep), tuple((t[0], t[1], Idx(t[2].shape[:n], t[2].coeff[:n], t[2].const)) for t in p.terms))
    return None


def _expand(p, shape):
    if not isinstance(p, Pred) or not isinstance(shape, Vec):
        return None
    if None in p.shape:
        return None
    out = _bshape(p.shape, shape.items)
    return None if out is None else Pred(out, _lift_pred(p, len(out)))


def _where(cond, a, b):
    if isinstance(cond, Pred) and all(
        isinstance(x, np.ndarray) and x.size == 1 and x.ndim <= len(cond.shape) for x in (a, b)
    ):  # one value each, broadcast over the mask's shape
        if a.dtype == b.dtype and a.dtype.kind == "f":
            return Select(cond, a, b)
    if type(cond) is tuple and isinstance(a, Vec) and isinstance(b, Vec):  # an element-wise choice of entries (Equal)
        if len(cond) == len(a.items) == len(b.items):
            return Vec(tuple(x if c else y for c, x, y in zip(cond, a.items, b.items)))
    return None


def _equal(a, b):
    if isinstance(a, Vec) and isinstance(b, Vec) and len(a.items) == len(b.items):
        out = []
        for x, y in zip(a.items, b.items):
            d = x + y.scale(-1)
            if d.is_const:
                out.append(d.const == 0)
            elif (x.nonneg and y.is_const and y.const < 0) or (y.nonneg and x.is_const and x.const < 0):
                out.append(False)
            else:
                return None
        return tuple(out)
    return None


def analyse(nodes: list[onnx.NodeProto], constants, inputs: set[str]) -> dict:
    """Value name -> description (see the module docstring) for every value of ``nodes`` (topologically
    ordered) that the rules describe; ``constants``: initializer values; ``inputs``: the graph inputs."""
    values: dict = {}

    def get(name: str):
        if name in values:
            return values[name]
        c = constants.get(name) if name else None
        return _as_value(c) if isinstance(c, np.ndarray) else None

    for node in nodes:
        if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
            continue
        op, ins = node.op_type, [get(x) for x in node.input]
        out = None
        if op == "Constant":
            c = constant_node_value(node)
            out = None if c is None else _as_value(c)
        elif op == "Shape" and _attr(node, "start") is None and _attr(node, "end") is None:
            v = ins[0]
            if isinstance(v, Idx | Pred):
                out = None if None in v.shape else Vec(v.shape)
            elif isinstance(v, Vec):
                out = Vec((Lin((), len(v.items)),))
            elif v is None and node.input[0]:
                out = ShapeOf(node.input[0])
        elif op == "Gather":
            out = _gather(ins[0], ins[1], _attr(node, "axis", 0))
        elif op == "Cast":
            to, v = _attr(node, "to"), ins[0]
            if to == _INT64 and isinstance(v, Lin | Vec | Idx):
                out = v
            elif to == _BOOL and isinstance(v, Pred):
                out = v
            elif to == _BOOL and node.input[0] in inputs and node.input[0] not in constants:
                rows, cols = Lin((((node.input[0], 0), 1),)), Lin((((node.input[0], 1), 1),))
                out = Pred((rows, cols), (("mask", node.input[0], Idx((rows, cols), (cols, _ONE), _ZERO)),))
        elif op in ("Add", "Sub"):
            out = _add(ins[0], ins[1], 1 if op == "Add" else -1)
        elif op == "Mul":
            out = _mul(ins[0], ins[1])
        elif op == "Range" and all(isinstance(v, Lin) for v in ins) and ins[2] == _ONE:
            out = Idx((ins[1] + ins[0].scale(-1),), (_ONE,), ins[0])
        elif op == "Unsqueeze":
            axes = _axes(node, values)
            out = None if axes is None else _unsqueeze(ins[0], axes)
        elif op in ("LessOrEqual", "Less", "GreaterOrEqual", "Greater"):
            out = _compare(op, ins[0], ins[1])
        elif op == "And":
            out = _and(ins[0], ins[1])
        elif op == "ConstantOfShape":
            value = _attr(node, "value")
            fill = numpy_helper.to_array(value) if value is not None else np.zeros(1, np.float32)
            shape = ins[0]
            if fill.size == 1 and fill.dtype == np.bool_ and bool(fill.reshape(())) and isinstance(shape, Vec):
                out = Pred(shape.items, ())
            elif fill.size == 1 and fill.dtype == np.int64 and isinstance(shape, Vec) and len(shape.items) == 1:
                n = shape.items[0]
                if n.is_const and 0 <= n.const <= 8:
                    out = Vec((Lin((), int(fill.reshape(()))),) * n.const)
        elif op == "Concat" and _attr(node, "axis") == 0 and all(isinstance(v, Vec) for v in ins):
            out = Vec(tuple(x for v in ins for x in v.items))
        elif op == "Reshape" and len(ins) == 2:
            out = _reshape(ins[0], ins[1])
        elif op == "Flatten":
            out = _flatten(ins[0], _attr(node, "axis", 1))
        elif op == "Expand":
            out = _expand(ins[0], ins[1])
        elif op == "Equal":
            out = _equal(ins[0], ins[1])
        elif op == "Where" and len(ins) == 3:
            out = _where(ins[0], ins[1], ins[2])
        if out is not None:
            values[node.output[0]] = out
    return values


def _axis_only(i: Idx, axis: int) -> bool:
    """Whether ``i`` counts along ``axis`` alone (coefficient 1 there, 0 elsewhere)."""
    return all(c == (_ONE if a == axis else _ZERO) for a, c in enumerate(i.coeff))


def mask_formula(value) -> MaskFormula | None:
    """The :class:`MaskFormula` a description of :func:`analyse` is, or None."""
    values = None
    if isinstance(value, Select):
        values, value = (value.a, value.b), value.pred
    if not isinstance(value, Pred) or len(value.shape) != 4 or value.shape[1] != _ONE or None in value.shape:
        return None
    batch, _, queries, keys = value.shape
    causal, window, mask = None, None, None
    for term in value.terms:
        if term[0] == "mask":
            idx = term[2]
            if len(idx.shape) != 4:
                return None
            if mask is not None or idx.const != _ZERO or idx.coeff[1:3] != (_ZERO, _ZERO) or idx.coeff[3] != _ONE:
                return None
            stride = Lin((((term[1], 1), 1),))
            if idx.coeff[0] != stride or idx.shape[3] != keys or idx.shape[0] not in (batch, _ONE):
                return None
            mask = term[1]
            continue
        op, a, b = term
        k, q = (a, b) if op == "le" else (b, a)
        if len(k.shape) != 4 or k.shape[3] != keys or q.shape[2] != queries or k.const != _ZERO:
            return None
        if _axis_only(a, 3) and _axis_only(b, 2) and op == "le":  # k <= q0 + q
            if causal is not None:
                return None
            causal = b.const
        elif _axis_only(b, 3) and _axis_only(a, 2) and op == "lt":  # q0 + q - W < k
            if window is not None:
                return None
            window = a.const
        else:
            return None
    if causal is None:
        return None
    w = 0
    if window is not None:
        d = causal + window.scale(-1)
        if not d.is_const or not 0 < d.const < _LIMIT:
            return None
        w = d.const
    if batch != _ONE and mask is None:
        return None
    return MaskFormula(None if batch == _ONE else batch, queries, keys, causal, w, mask, values)
