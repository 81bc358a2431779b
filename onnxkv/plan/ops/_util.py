"""Helpers shared by the operator modules (not operators themselves)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from onnxkv import _kernels as K

__all__ = [
    "BF16",
    "add_float16",
    "broadcast_shape",
    "float16_pair",
    "float32_pair",
    "float32_scalar",
    "normalize_axis",
    "normalize_axes",
    "int_list",
    "LayoutMemo",
]

#: bfloat16 as NumPy knows it (onnx's type; a state holds bfloat16 as uint16 bit patterns).
BF16 = np.dtype(helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16))

_UNKNOWN = object()


def broadcast_shape(a: np.ndarray, b: np.ndarray) -> tuple[int, ...]:
    """NumPy/ONNX multidirectional broadcast of two shapes (fast when equal)."""
    sa, sb = a.shape, b.shape
    if sa == sb:
        return sa
    if b.size == 1 and len(sb) <= len(sa):  # a scalar operand (a constant, a shape value): a's shape
        return sa
    if a.size == 1 and len(sa) <= len(sb):
        return sb
    return np.broadcast_shapes(sa, sb)


def widened(a: np.ndarray, rt=None) -> np.ndarray:
    """A float32 array of float16 ``a``'s values (exact), converted by the F16C kernel (NumPy's float16
    casts run element by element: 1.2 ms for a 128 x 5632 activation, against 0.03).  With ``rt`` (the
    running node's :class:`~onnxkv.plan.context.RunContext`) it is a temporary of :meth:`RunContext.scratch`,
    which the node hands back (``rt.unscratch``); else a new array."""
    out = np.empty(a.shape, np.float32) if rt is None else rt.scratch(a.shape, np.float32)
    if a.flags.c_contiguous:
        K.f16_to_f32(a, out)
    else:
        out[...] = a
    return out


def round_into(out: np.ndarray, wide: np.ndarray) -> np.ndarray:
    """``out`` = ``wide`` (float32) cast to out's dtype, as NumPy casts it: float16 (nearest even, overflow to
    infinity) by the F16C kernel; returns ``out``."""
    if (
        out.dtype == np.float16
        and wide.dtype == np.float32
        and out.flags.c_contiguous
        and wide.flags.c_contiguous
        and out.shape == wide.shape
    ):
        K.f32_to_f16(wide, out)
    else:
        with np.errstate(over="ignore"):  # overflow to infinity is the cast's result, as in the kernel
            np.copyto(out, wide, casting="same_kind")
    return out


def float16_pair(a, b) -> bool:
    """Whether ``a`` and ``b`` are non-empty C-contiguous float16 arrays of one shape (:func:`add_float16`)."""
    return _pair(a, b, np.float16)


def add_float16(a: np.ndarray, b: np.ndarray, out: np.ndarray, rt=None) -> np.ndarray:
    """``out`` = ``a + b`` for a :func:`float16_pair` and a float16 ``out`` of their shape (C-contiguous), as
    NumPy's float16 ``add`` gives it, bit for bit: the float32 sum of the widenings rounded to float16 (a
    float32 sum of two float16 values rounded again to float16 is their correctly rounded float16 sum, since
    24 >= 2 * 11 + 2 significand bits), on the F16C and ``add`` kernels instead of NumPy's element-by-element
    float16 loop.  ``rt``: the running node's context, whose scratch holds the widenings.  Returns ``out``."""
    wa, wb = widened(a, rt), widened(b, rt)
    K.add(wa.reshape(-1), wb.reshape(-1), wa.reshape(-1))
    round_into(out, wa)
    if rt is not None:
        rt.unscratch(wa, wb)
    return out


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``np.matmul(a, b, out=out)``; float16 operands as float32 sums rounded once to float16, through
    BLAS (NumPy's float16 matmul has no BLAS: a 128-token float16 attention took about 140 ms a layer),
    the result ONNX Runtime's CPU MatMul gives float16 operands (a float32 MatMul between casts)."""
    if a.dtype != np.float16 or b.dtype != np.float16:
        return np.matmul(a, b, out=out)
    wide = np.matmul(widened(a), widened(b))
    return round_into(np.empty(wide.shape, np.float16) if out is None else out, wide)


def float32_pair(a, b) -> bool:
    """Whether ``a`` and ``b`` are non-empty C-contiguous float32 arrays of one shape (the operands of an
    element-by-element kernel that a compiled step replays)."""
    return _pair(a, b, np.float32)


def float32_scalar(a, c) -> bool:
    """Whether ``a`` is a non-empty C-contiguous float32 array and ``c`` a one-element float32 array of no
    higher rank (``a`` op ``c`` has ``a``'s shape: the operands of a one-value kernel a compiled step
    replays)."""
    return (
        isinstance(a, np.ndarray)
        and isinstance(c, np.ndarray)
        and a.dtype == np.float32
        and c.dtype == np.float32
        and c.size == 1
        and c.ndim <= a.ndim
        and a.size > 0
        and a.flags.c_contiguous
    )


def _pair(a, b, dtype) -> bool:
    return (
        isinstance(a, np.ndarray)
        and isinstance(b, np.ndarray)
        and a.dtype == dtype
        and b.dtype == dtype
        and a.shape == b.shape
        and a.size > 0
        and a.flags.c_contiguous
        and b.flags.c_contiguous
    )


def normalize_axis(axis: int, rank: int, what: str) -> int:
    """``axis`` in [-rank, rank) made non-negative; ValueError naming ``what`` otherwise."""
    if not -rank <= axis < rank:
        raise ValueError(f"{what}: axis {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def normalize_axes(axes, rank: int, what: str) -> tuple[int, ...]:
    return tuple(normalize_axis(int(a), rank, what) for a in axes)


def int_list(value) -> list[int]:
    """A 0-/1-D integer tensor or sequence as a list of Python ints."""
    return [int(v) for v in np.asarray(value).reshape(-1)]


class LayoutMemo:
    """What a kernel learnt about a call, per key (shapes, bytes of small integer parameters), at most
    ``size`` keys (it starts over when full: prefill chunks may each bring a new shape).

    The values must depend on the key only (never on array contents the key
    does not hold).  Thread safety: a dict of immutable values; concurrent
    runs at worst learn a key twice.
    """

    __slots__ = ("_values", "size")

    def __init__(self, size: int = 64) -> None:
        self._values: dict[Hashable, Any] = {}
        self.size = size

    def get(self, key: Hashable, learn: Callable[..., Any], *args: Any) -> Any:
        """The value of ``key``, ``learn(*args)`` the first time (None is a value too)."""
        values = self._values
        value = values.get(key, _UNKNOWN)
        if value is _UNKNOWN:
            value = learn(*args)
            if len(values) >= self.size:
                values.clear()
            values[key] = value
        return value

    def keys(self) -> list[Hashable]:
        """The keys learnt so far, oldest first."""
        return list(self._values)
