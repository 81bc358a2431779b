"""Reductions: ReduceSum/Mean/Max/Min/Prod/SumSquare/L2, ArgMax/ArgMin.

Axes come from the ``axes`` input (ReduceSum ≥ 13, the others ≥ 18) or the
``axes`` attribute (older opsets); ``noop_with_empty_axes`` reduces each element alone.
A reduction over an empty set of values gives the operator's identity:
ReduceMax ``-inf`` (the dtype's minimum for integers, False for bool),
ReduceMin ``+inf`` (the maximum, True), ReduceSum/SumSquare/L2 0, ReduceProd 1.
"""

from __future__ import annotations

import numpy as np

from onnxkv.plan.ops._util import int_list, normalize_axes, normalize_axis
from onnxkv.plan.registry import Op, register


def _extreme(dtype: np.dtype, largest: bool):
    """The largest (or smallest) value of ``dtype``: ±inf for floats, the integer limits, True/False for bool."""
    if dtype == np.bool_:
        return largest
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.max if largest else info.min
    return dtype.type(np.inf if largest else -np.inf)


def _extremum(reduce, empty_largest: bool):
    """``reduce`` (np.max/np.min) giving ``_extreme(dtype, empty_largest)`` over an empty set of values."""

    def run(x: np.ndarray, axes, keep: bool) -> np.ndarray:
        if x.size:
            return reduce(x, axis=axes, keepdims=keep)
        return reduce(x, axis=axes, keepdims=keep, initial=_extreme(x.dtype, empty_largest))

    return run


_REDUCE = {
    "ReduceSum": lambda x, axes, keep: np.sum(x, axis=axes, keepdims=keep, dtype=x.dtype),
    "ReduceMean": lambda x, axes, keep: np.mean(x, axis=axes, keepdims=keep, dtype=x.dtype),
    "ReduceMax": _extremum(np.max, empty_largest=False),
    "ReduceMin": _extremum(np.min, empty_largest=True),
    "ReduceProd": lambda x, axes, keep: np.prod(x, axis=axes, keepdims=keep, dtype=x.dtype),
    "ReduceSumSquare": lambda x, axes, keep: np.sum(x * x, axis=axes, keepdims=keep, dtype=x.dtype),
    "ReduceL2": lambda x, axes, keep: np.sqrt(np.sum(x * x, axis=axes, keepdims=keep, dtype=x.dtype)),
}


class _Reduce(Op):
    fn = staticmethod(_REDUCE["ReduceSum"])

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        keep = bool(self.attrs.get("keepdims", 1))
        if len(inputs) > 1 and inputs[1] is not None and inputs[1].size:
            axes = int_list(inputs[1])
        else:
            axes = self.attrs.get("axes")
        if not axes:
            # noop: a reduction of each element alone (ReduceSumSquare x², ReduceL2 |x|, the others x)
            axes = () if self.attrs.get("noop_with_empty_axes", 0) else None
        else:
            axes = normalize_axes(axes, x.ndim, f"{self.op_type} '{self.name}'")
        return (np.asarray(self.fn(x, axes, keep)).astype(x.dtype, copy=False),)


for _name, _fn in _REDUCE.items():
    register(_name)(type(_name, (_Reduce,), {"fn": staticmethod(_fn)}))


class _Arg(Op):
    fn = staticmethod(np.argmax)

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        axis = normalize_axis(self.attrs.get("axis", 0), x.ndim, f"{self.op_type} '{self.name}'")
        keep = bool(self.attrs.get("keepdims", 1))
        if self.attrs.get("select_last_index", 0):
            flipped = np.flip(x, axis)
            r = x.shape[axis] - 1 - self.fn(flipped, axis=axis, keepdims=keep)
        else:
            r = self.fn(x, axis=axis, keepdims=keep)
        return (np.asarray(r, dtype=np.int64),)


register("ArgMax")(type("ArgMax", (_Arg,), {"fn": staticmethod(np.argmax)}))
register("ArgMin")(type("ArgMin", (_Arg,), {"fn": staticmethod(np.argmin)}))
