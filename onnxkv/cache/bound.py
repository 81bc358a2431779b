"""Which memory is bound to a state: a registry of live cache storage ranges.

Every :class:`~onnxkv.cache.contiguous.CacheTensor` registers its buffer's
address range while it holds it.  An operator about to write into caller
storage in place asks :func:`is_bound` so that storage owned by a state is
never written by a run that does not belong to that state (request isolation).
Thread-safe.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["byte_span", "register", "unregister", "is_bound"]

_lock = threading.Lock()
_ranges: dict[int, tuple[int, int]] = {}
# NumPy 2 moved byte_bounds to numpy.lib.array_utils; looked up once (a missing attribute of the numpy
# module costs its module __getattr__ on every call).
_byte_bounds = getattr(np.lib, "array_utils", np).byte_bounds


def byte_span(array: np.ndarray) -> tuple[int, int]:
    """The byte range [lo, hi) ``array`` covers."""
    lo, hi = _byte_bounds(array)
    return int(lo), int(hi)


def register(key: int, array: np.ndarray) -> None:
    with _lock:
        _ranges[key] = byte_span(array)


def unregister(key: int) -> None:
    with _lock:
        _ranges.pop(key, None)


def is_bound(array: np.ndarray) -> bool:
    """True if ``array`` overlaps storage currently held by any state's cache."""
    if array.size == 0:
        return False
    lo, hi = byte_span(array)
    with _lock:
        return any(lo < e and s < hi for s, e in _ranges.values())
