"""Element-wise operators: arithmetic, comparisons, logic, unary math, Where, Cast.

Binary operators broadcast multidirectionally (ONNX semantics) and write into
an output obtained from ``rt.empty``, so temporaries go through the session's
allocator.  Integer division truncates toward zero, as ``onnx.reference`` does.
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from onnxkv import _kernels as K
from onnxkv.plan.ops._util import broadcast_shape
from onnxkv.plan.registry import BuildContext, Op, register

_BINARY = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Max": np.maximum,
    "Min": np.minimum,
}
_COMPARE = {
    "Equal": np.equal,
    "Less": np.less,
    "LessOrEqual": np.less_equal,
    "Greater": np.greater,
    "GreaterOrEqual": np.greater_equal,
    "And": np.logical_and,
    "Or": np.logical_or,
    "Xor": np.logical_xor,
}
_UNARY = {
    "Neg": np.negative,
    "Abs": np.abs,
    "Sqrt": np.sqrt,
    "Exp": np.exp,
    "Log": np.log,
    "Sin": np.sin,
    "Cos": np.cos,
    "Tanh": np.tanh,
    "Floor": np.floor,
    "Ceil": np.ceil,
    "Not": np.logical_not,
    "Sign": np.sign,
    "Round": np.rint,
}


class _Binary(Op):
    ufunc = staticmethod(np.add)

    def run(self, inputs: list, rt) -> tuple:
        a, b = inputs
        if a.dtype != b.dtype:
            raise TypeError(f"{self.op_type} node '{self.name}': input dtypes differ ({a.dtype} vs {b.dtype})")
        out = rt.empty(0, broadcast_shape(a, b), a.dtype)
        self.ufunc(a, b, out=out)
        return (out,)


class _Variadic(Op):
    """Max/Min/Sum/Mean with one or more inputs."""

    ufunc = staticmethod(np.maximum)

    def run(self, inputs: list, rt) -> tuple:
        acc = inputs[0]
        if len(inputs) == 1:
            return (acc.copy(),)
        for x in inputs[1:]:
            acc = self.ufunc(acc, x)
        return (acc,)


for _name, _f in _BINARY.items():
    if _name in ("Max", "Min"):
        register(_name)(type(_name, (_Variadic,), {"ufunc": staticmethod(_f)}))
    else:
        register(_name)(type(_name, (_Binary,), {"ufunc": staticmethod(_f)}))


@register("Sum")
class Sum(_Variadic):
    ufunc = staticmethod(np.add)


@register("Div")
class Div(Op):
    def run(self, inputs: list, rt) -> tuple:
        a, b = inputs
        if a.dtype.kind in "iu":
            if np.any(b == 0):
                raise ZeroDivisionError(f"Div node '{self.name}': integer division by zero")
            return (np.trunc(np.true_divide(a, b)).astype(a.dtype),)
        out = rt.empty(0, broadcast_shape(a, b), a.dtype)
        np.divide(a, b, out=out)
        return (out,)


@register("Mod")
class Mod(Op):
    def run(self, inputs: list, rt) -> tuple:
        a, b = inputs
        if self.attrs.get("fmod", 0):
            return (np.fmod(a, b).astype(a.dtype),)
        return (np.mod(a, b).astype(a.dtype),)


@register("Pow")
class Pow(Op):
    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        e = ctx.constant(node.input[1])
        self.square = e is not None and e.size == 1 and float(e.reshape(-1)[0]) == 2.0

    def run(self, inputs: list, rt) -> tuple:
        a, b = inputs
        if self.square:
            out = rt.empty(0, a.shape, a.dtype)
            np.multiply(a, a, out=out)
            return (out,)
        return (np.power(a, b).astype(a.dtype, copy=False),)


class _Compare(Op):
    ufunc = staticmethod(np.equal)

    def run(self, inputs: list, rt) -> tuple:
        a, b = inputs
        out = rt.empty(0, broadcast_shape(a, b), np.bool_)
        self.ufunc(a, b, out=out)
        return (out,)


for _name, _f in _COMPARE.items():
    register(_name)(type(_name, (_Compare,), {"ufunc": staticmethod(_f)}))


class _Unary(Op):
    ufunc = staticmethod(np.negative)

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        out = rt.empty(0, x.shape, x.dtype)
        self.ufunc(x, out=out)
        return (out,)


for _name, _f in _UNARY.items():
    register(_name)(type(_name, (_Unary,), {"ufunc": staticmethod(_f)}))


@register("Reciprocal")
class Reciprocal(Op):
    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        out = rt.empty(0, x.shape, x.dtype)
        np.divide(1, x, out=out)
        return (out,)


@register("Relu")
class Relu(Op):
    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        out = rt.empty(0, x.shape, x.dtype)
        np.maximum(x, 0, out=out)
        return (out,)


@register("Erf")
class Erf(Op):
    def run(self, inputs: list, rt) -> tuple:
        from math import erf

        x = inputs[0]
        return (np.vectorize(erf, otypes=[x.dtype])(x) if x.size else x.copy(),)


@register("IsNaN")
class IsNaN(Op):
    def run(self, inputs: list, rt) -> tuple:
        return (np.isnan(inputs[0]),)


@register("IsInf")
class IsInf(Op):
    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        pos, neg = self.attrs.get("detect_positive", 1), self.attrs.get("detect_negative", 1)
        return ((np.isposinf(x) if pos else False) | (np.isneginf(x) if neg else False),)


@register("Where")
class Where(Op):
    def run(self, inputs: list, rt) -> tuple:
        c, a, b = inputs
        shape = np.broadcast_shapes(c.shape, a.shape, b.shape)
        out = rt.empty(0, shape, a.dtype)
        np.copyto(out, b)
        np.copyto(out, a, where=c)
        return (out,)


@register("Sigmoid")
class Sigmoid(Op):
    """Sigmoid through the compiled kernel for float32/float64."""

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        out = rt.empty(0, x.shape, x.dtype)
        if x.dtype in (np.float32, np.float64) and x.flags.c_contiguous:
            K.sigmoid(x.reshape(-1), out.reshape(-1))
        else:
            np.divide(1, 1 + np.exp(-x), out=out)
        return (out,)


@register("Cast")
class Cast(Op):
    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.dtype = np.dtype(helper.tensor_dtype_to_np_dtype(int(self.attrs["to"])))

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        if x.dtype == self.dtype:
            return (x.copy(),)
        out = rt.empty(0, x.shape, self.dtype)
        np.copyto(out, x, casting="unsafe")
        return (out,)


@register("CastLike")
class CastLike(Op):
    def run(self, inputs: list, rt) -> tuple:
        x, like = inputs
        return (x.astype(like.dtype),)
