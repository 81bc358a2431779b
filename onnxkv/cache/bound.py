"""Which memory is bound to a state: a registry of live cache storage ranges.

Every :class:`~onnxkv.cache.contiguous.CacheTensor` registers its buffer's
address range while it holds it.  An operator about to write into caller
storage in place asks :func:`is_bound` so that storage owned by a state is
never written by a run that does not belong to that state (request isolation).

An entry lives until :func:`unregister` or until the registered array is
garbage collected, whichever comes first: storage whose release never ran (a
cache dropped without ``release``, a close that failed part way) is freed with
its arrays, and an address range left behind would later refuse an unrelated
caller array that happens to be allocated there.
Thread-safe.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import numpy as np

__all__ = ["byte_span", "register", "unregister", "is_bound"]

_lock = threading.Lock()
_ranges: dict[int, tuple[int, int, int]] = {}  # key -> (lo, hi, serial of the registration)
_serials = itertools.count()
# (key, serial) of registrations whose array was collected.  A finalizer only appends here (atomic): it may
# run inside a garbage collection started while _lock is held, where taking the lock or changing _ranges
# would deadlock or break an iteration; the entries are dropped under the lock before _ranges is read.
_collected: list[tuple[int, int]] = []
# NumPy 2 moved byte_bounds to numpy.lib.array_utils; looked up once (a missing attribute of the numpy
# module costs its module __getattr__ on every call).
_byte_bounds = getattr(np.lib, "array_utils", np).byte_bounds


def byte_span(array: np.ndarray) -> tuple[int, int]:
    """The byte range [lo, hi) ``array`` covers."""
    lo, hi = _byte_bounds(array)
    return int(lo), int(hi)


def register(key: int, array: np.ndarray) -> None:
    """Record ``array``'s byte range as bound under ``key`` (replacing what ``key`` held) until
    :func:`unregister` or until ``array`` is garbage collected."""
    lo, hi = byte_span(array)
    serial = next(_serials)
    weakref.finalize(array, _collected.append, (key, serial))
    with _lock:
        _drop_collected()
        _ranges[key] = (lo, hi, serial)


def unregister(key: int) -> None:
    with _lock:
        _drop_collected()
        _ranges.pop(key, None)


def _drop_collected() -> None:
    """Forget the ranges whose array was collected (a key registered again since keeps its new range).
    With _lock held."""
    while _collected:
        key, serial = _collected.pop()
        entry = _ranges.get(key)
        if entry is not None and entry[2] == serial:
            del _ranges[key]


def is_bound(array: np.ndarray) -> bool:
    """True if ``array`` overlaps storage currently held by any state's cache."""
    if array.size == 0:
        return False
    lo, hi = byte_span(array)
    with _lock:
        _drop_collected()
        return any(lo < e and s < hi for s, e, _ in _ranges.values())
