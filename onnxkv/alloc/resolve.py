"""Accepting a user's allocator: duck-typed against the :class:`Allocator` protocol."""

from __future__ import annotations

from .protocol import Allocator
from .system import SystemAllocator

_REQUIRED = ("allocate", "free", "stats")


def check_allocator(obj: object) -> Allocator:
    """Return ``obj`` if it has callable ``allocate``, ``free`` and ``stats``;
    ``TypeError`` naming the missing methods otherwise."""
    missing = [name for name in _REQUIRED if not callable(getattr(obj, name, None))]
    if missing:
        raise TypeError(f"{type(obj).__name__} object is not an allocator: missing callable {', '.join(missing)}")
    return obj  # type: ignore[return-value]


def as_allocator(obj: object | None) -> Allocator:
    """``None`` -> a new :class:`SystemAllocator`; an allocator -> itself; else ``TypeError``."""
    if obj is None:
        return SystemAllocator()
    return check_allocator(obj)
