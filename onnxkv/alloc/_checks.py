"""Argument checks and the byte-view helper shared by the built-in allocators."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, not bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(value).__name__}") from None


def check_nbytes(nbytes: object) -> int:
    """Return ``nbytes`` as an ``int`` >= 0; ``TypeError``/``ValueError`` otherwise."""
    n = _as_int(nbytes, "nbytes")
    if n < 0:
        raise ValueError(f"nbytes must be >= 0, got {n}")
    return n


def check_alignment(alignment: object) -> int:
    """Return ``alignment`` as an ``int`` power of two >= 1; raise otherwise."""
    a = _as_int(alignment, "alignment")
    if a < 1 or a & (a - 1):
        raise ValueError(f"alignment must be a power of two >= 1, got {a}")
    return a


def byte_view(raw: np.ndarray, dtype: npt.DTypeLike, shape: int | Sequence[int]) -> np.ndarray:
    """View the leading bytes of the 1-D uint8 array ``raw`` as ``dtype[shape]``.

    The result shares memory with ``raw`` (no copy), is writable when ``raw``
    is, and is C-contiguous. ``ValueError`` if the shape needs more bytes than
    ``raw`` holds; ``TypeError`` for object or zero-size dtypes.
    """
    dt = np.dtype(dtype)
    if dt.hasobject or dt.itemsize == 0:
        raise TypeError(f"cannot view raw bytes as dtype {dt}")
    if type(shape) is tuple or isinstance(shape, Sequence):  # a tuple skips the ABC check
        dims = tuple(_as_int(d, "shape entry") for d in shape)
    else:
        dims = (_as_int(shape, "shape"),)
    if any(d < 0 for d in dims):
        raise ValueError(f"shape entries must be >= 0, got {dims}")
    need = dt.itemsize
    for d in dims:
        need *= d
    if need > raw.size:
        raise ValueError(f"shape {dims} of {dt} needs {need} bytes, buffer holds {raw.size}")
    return raw[:need].view(dt).reshape(dims)
