"""Helpers shared by the operator modules (not operators themselves)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

__all__ = ["broadcast_shape", "normalize_axis", "normalize_axes", "int_list", "LayoutMemo"]

_UNKNOWN = object()


def broadcast_shape(a: np.ndarray, b: np.ndarray) -> tuple[int, ...]:
    """NumPy/ONNX multidirectional broadcast of two shapes (fast when equal)."""
    if a.shape == b.shape:
        return a.shape
    return np.broadcast_shapes(a.shape, b.shape)


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``np.matmul(a, b, out=out)``; float16 operands as float32 sums rounded once to float16, through
    BLAS (NumPy's float16 matmul has no BLAS: a 128-token float16 attention took about 140 ms a layer),
    the result ONNX Runtime's CPU MatMul gives float16 operands (a float32 MatMul between casts)."""
    if a.dtype != np.float16 or b.dtype != np.float16:
        return np.matmul(a, b, out=out)
    wide = np.matmul(a.astype(np.float32), b.astype(np.float32))
    if out is None:
        return wide.astype(np.float16)
    np.copyto(out, wide, casting="same_kind")
    return out


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
