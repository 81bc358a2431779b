"""Helpers shared by the operator modules (not operators themselves)."""

from __future__ import annotations

import numpy as np

__all__ = ["broadcast_shape", "normalize_axis", "normalize_axes", "int_list"]


def broadcast_shape(a: np.ndarray, b: np.ndarray) -> tuple[int, ...]:
    """NumPy/ONNX multidirectional broadcast of two shapes (fast when equal)."""
    if a.shape == b.shape:
        return a.shape
    return np.broadcast_shapes(a.shape, b.shape)


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
