"""Element-wise operators: arithmetic, comparisons, logic, unary math, Where, Cast.

Binary operators broadcast multidirectionally (ONNX semantics) and write into
an output obtained from ``rt.empty``, so temporaries go through the session's
allocator.  Integer division truncates toward zero, as ``onnx.reference`` does.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxkv import _kernels as K
from onnxkv._kernels._record import current as _recorder
from onnxkv.plan.ops._util import add_float16, broadcast_shape, float16_pair, float32_pair, float32_scalar
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
    uses_blas = False

    def run(self, inputs: list, rt) -> tuple:
        a, b = inputs
        if a.dtype != b.dtype:
            raise TypeError(f"{self.op_type} node '{self.name}': input dtypes differ ({a.dtype} vs {b.dtype})")
        out = rt.empty(0, broadcast_shape(a, b), a.dtype)
        self.ufunc(a, b, out=out)
        return (out,)


class Add(_Binary):
    """``Add``: float32 addends of one shape (C-contiguous, non-empty) through the compiled ``add`` kernel,
    whose call a compiled step replays (a residual sum); float16 ones of one shape through the same kernel on
    their widenings (:func:`~onnxkv.plan.ops._util.add_float16`: NumPy's float16 sums, bit for bit);
    anything else as the other binary operators."""

    def compilable(self, inputs: list) -> bool:
        return float32_pair(*inputs) or float16_pair(*inputs)

    def run(self, inputs: list, rt) -> tuple:
        a, b = inputs
        if float32_pair(a, b):
            out = rt.empty(0, a.shape, np.float32)
            K.add(a.reshape(-1), b.reshape(-1), out.reshape(-1))
            return (out,)
        if float16_pair(a, b):
            return (add_float16(a, b, rt.empty(0, a.shape, np.float16), rt),)
        rec = _recorder()
        if rec is not None:
            rec.refused.append(f"Add node '{self.name}': not two float32 addends of one shape")
        return super().run(inputs, rt)


class Mul(_Binary):
    """``Mul``: a float32 tensor (C-contiguous, non-empty) times one float32 value (a one-element tensor of no
    higher rank, either operand) through the ``mul_scalar`` kernel, whose call a compiled step replays (an
    embedding's or a residual's scale: NumPy's products, bit for bit); anything else as the other binary
    operators."""

    ufunc = staticmethod(np.multiply)

    def compilable(self, inputs: list) -> bool:
        return float32_scalar(*inputs) or float32_scalar(*inputs[::-1])

    def run(self, inputs: list, rt) -> tuple:
        a, c = inputs if float32_scalar(*inputs) else inputs[::-1]
        if float32_scalar(a, c):
            out = rt.empty(0, a.shape, np.float32)
            K.mul_scalar(a.reshape(-1), c.reshape(-1), out.reshape(-1))
            return (out,)
        return super().run(inputs, rt)


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
    if _name in ("Add", "Mul"):
        register(_name)(Add if _name == "Add" else Mul)
        continue
    if _name in ("Max", "Min"):
        register(_name)(type(_name, (_Variadic,), {"ufunc": staticmethod(_f)}))
    else:
        register(_name)(type(_name, (_Binary,), {"ufunc": staticmethod(_f)}))


@register("Sum")
class Sum(_Variadic):
    ufunc = staticmethod(np.add)


@register("Mean")
class Mean(_Variadic):
    """The inputs' sum (broadcast as Sum's) divided by their count, in their type."""

    ufunc = staticmethod(np.add)

    def run(self, inputs: list, rt) -> tuple:
        (total,) = super().run(inputs, rt)
        return ((total / len(inputs)).astype(total.dtype, copy=False),)


@register("Div")
class Div(Op):
    """``Div``: integers truncated toward zero; a float32 tensor (C-contiguous, non-empty) divided by one
    float32 value (a one-element tensor of no higher rank) through the ``div_scalar`` kernel, whose call a
    compiled step replays (a logit scale: NumPy's quotients, bit for bit); other floats by NumPy."""

    uses_blas = False

    def compilable(self, inputs: list) -> bool:
        return float32_scalar(*inputs)

    def run(self, inputs: list, rt) -> tuple:
        a, b = inputs
        if float32_scalar(a, b):
            out = rt.empty(0, a.shape, np.float32)
            K.div_scalar(a.reshape(-1), b.reshape(-1), out.reshape(-1))
            return (out,)
        if a.dtype.kind in "iu":
            if np.any(b == 0):
                raise ZeroDivisionError(f"Div node '{self.name}': integer division by zero")
            # truncated toward zero in integers (float64 is exact only below 2**53)
            q, r = np.divmod(a, b)  # floored
            q += ((r != 0) & ((a < 0) != (b < 0))).astype(q.dtype)
            return (q.astype(a.dtype, copy=False),)
        out = rt.empty(0, broadcast_shape(a, b), a.dtype)
        with np.errstate(divide="ignore", invalid="ignore"):  # IEEE quotients (inf, NaN), as the kernel's
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
        if self.square and b.ndim <= a.ndim:  # a higher-rank exponent broadcasts the result to its rank
            out = rt.empty(0, a.shape, a.dtype)
            np.multiply(a, a, out=out)
            return (out,)
        return (np.power(a, b).astype(a.dtype, copy=False),)


class _Compare(Op):
    ufunc = staticmethod(np.equal)
    uses_blas = False

    def run(self, inputs: list, rt) -> tuple:
        a, b = inputs
        out = rt.empty(0, broadcast_shape(a, b), np.bool_)
        self.ufunc(a, b, out=out)
        return (out,)


for _name, _f in _COMPARE.items():
    register(_name)(type(_name, (_Compare,), {"ufunc": staticmethod(_f)}))


class _Unary(Op):
    ufunc = staticmethod(np.negative)
    uses_blas = False

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
    """float32 / float64 in the ``erf`` kernel (the C library's erff / erf); other types through float64."""

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        if x.dtype in (np.float32, np.float64):
            out = rt.empty(0, x.shape, x.dtype)
            K.erf(np.require(x, requirements="C"), out)  # np.require keeps a 0-D x 0-D
            return (out,)
        y = np.empty(x.shape, np.float64)
        K.erf(np.require(x, np.float64, "C"), y)
        return (y.astype(x.dtype),)


@register("IsNaN")
class IsNaN(Op):
    def run(self, inputs: list, rt) -> tuple:
        return (np.isnan(inputs[0]),)


@register("IsInf")
class IsInf(Op):
    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        pos, neg = self.attrs.get("detect_positive", 1), self.attrs.get("detect_negative", 1)
        if pos and neg:
            return (np.isinf(x),)
        return (np.isposinf(x) if pos else np.isneginf(x) if neg else np.zeros(x.shape, bool),)


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


#: Float 8 types whose conversion clamps out-of-range values to the largest finite value when ``saturate=1``.
_SATURATING = frozenset(
    {TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ}
)
_ROUND_MODES = ("up", "down", "nearest")


class _CastOp(Op):
    """Cast and CastLike: ``saturate`` (float 8 targets) and ``round_mode`` (float8e8m0) as the operator says.

    ``saturate=1`` (the default) clamps values beyond the target's range,
    infinities included, to its largest finite magnitude; ``saturate=0``
    maps them to NaN or infinity as the type has.  ``round_mode`` (``up``,
    ``down`` or ``nearest``) rounds to float8e8m0 only.  A target of STRING
    gives the values' decimal text.
    """

    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.saturate = int(self.attrs.get("saturate", 1))
        self.round_mode = self.attrs.get("round_mode", "up")
        if self.saturate not in (0, 1):
            raise self.error(f"attribute saturate must be 0 or 1, got {self.saturate}")
        if self.round_mode not in _ROUND_MODES:
            raise self.error(f"attribute round_mode must be one of {list(_ROUND_MODES)}, got {self.round_mode!r}")

    uses_blas = False

    def cast(self, x: np.ndarray, to: int, rt) -> np.ndarray:
        """``x`` converted to the ONNX element type ``to``, in a fresh array."""
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(to))
        if x.dtype == dtype:
            if _float32_copy(x, dtype):  # a copy a compiled step replays (an export's RMS norm input cast)
                out = rt.empty(0, x.shape, dtype)
                K.copy_f32(x, out)
                return out
            return x.copy()
        if to in _SATURATING and self.saturate:
            return numpy_helper.saturate_cast(x, dtype)
        if to == TensorProto.FLOAT8E8M0:
            # at least 1-D: onnx's converter assigns into its 0-d intermediate (a TypeError)
            y = numpy_helper.to_float8e8m0(np.atleast_1d(x), bool(self.saturate), self.round_mode)
            return y.reshape(x.shape).astype(dtype, copy=False)
        if to == TensorProto.STRING:
            return x.astype(np.str_).astype(object)
        out = rt.empty(0, x.shape, dtype)
        if _float_halves(x, dtype):  # NumPy's casts exactly, on the F16C kernels (a float16 model's boundary)
            (K.f16_to_f32 if x.dtype == np.float16 else K.f32_to_f16)(x, out)
        else:
            np.copyto(out, x, casting="unsafe")
        return out


def _float32_copy(x: np.ndarray, dtype: np.dtype) -> bool:
    """Whether casting ``x`` to ``dtype`` copies a non-empty C-contiguous float32 array (the ``copy_f32`` kernel)."""
    return x.dtype == dtype == np.float32 and x.size > 0 and x.flags.c_contiguous


def _float_halves(x: np.ndarray, dtype: np.dtype) -> bool:
    """Whether casting ``x`` to ``dtype`` is float16 -> float32 or float32 -> float16 of a C-contiguous array."""
    return {x.dtype, dtype} == {np.dtype(np.float16), np.dtype(np.float32)} and x.flags.c_contiguous


@register("Cast")
class Cast(_CastOp):
    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.to = int(self.attrs["to"])

    def compilable(self, inputs: list) -> bool:
        """A float16 <-> float32 cast, or a float32 one to float32, of a non-empty C-contiguous array: one
        conversion kernel call."""
        x = inputs[0]
        if not isinstance(x, np.ndarray) or x.size == 0:
            return False
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(self.to))
        return _float_halves(x, dtype) or _float32_copy(x, dtype)

    def run(self, inputs: list, rt) -> tuple:
        return (self.cast(inputs[0], self.to, rt),)


@register("CastLike")
class CastLike(_CastOp):
    def run(self, inputs: list, rt) -> tuple:
        x, like = inputs
        return (self.cast(x, helper.np_dtype_to_tensor_dtype(like.dtype), rt),)
