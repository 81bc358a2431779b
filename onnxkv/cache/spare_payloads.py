"""Native page payloads a :class:`~onnxkv.cache.plane_payloads.PlanePayloads` keeps from freed pages.

A beam search step copies a shared page on write for some beams and frees the pages other beams dropped:
without spares, every such page costs a checked lease and a free per plane.  A freed page's native payload -- leased and checked when it was first leased, still
leased -- is kept instead, up to ``limit`` per plane, and handed to the next new page of that plane.

Its bytes are those of the page it held: whoever hands out a new page clears or overwrites it before any
reader sees it (as with any memory an allocator hands out again).  Spares are held by no page: the pool's
``committed_bytes`` leaves them out, its allocator's live bytes count them (``nbytes`` says how many).
"""

from __future__ import annotations

import numpy as np

__all__ = ["SparePayloads"]


class SparePayloads:
    """Per plane, up to ``limit`` native payloads ``(buffer, array)`` (``natives``: each plane's native
    dtype and page shape); the owner's lock guards every call."""

    def __init__(self, natives: list[tuple[np.dtype, tuple[int, ...]]], limit: int) -> None:
        self.limit = limit
        self._natives = natives  # per plane: the dtype and shape of a native page's array
        self._kept: list[list] = [[] for _ in natives]

    def keep(self, plane: int, buf, arr: np.ndarray | None) -> bool:
        """Keep a freed page's payload of ``plane`` when it is a native one (an array of the plane's native
        dtype and shape) and the plane holds fewer than ``limit``; False otherwise (the caller frees it)."""
        kept = self._kept[plane]
        dtype, shape = self._natives[plane]
        if len(kept) >= self.limit or arr is None or arr.dtype != dtype or arr.shape != shape:
            return False
        kept.append((buf, arr))
        return True

    def take(self, plane: int) -> tuple | None:
        """A kept payload ``(buffer, array)`` of ``plane``, or None."""
        kept = self._kept[plane]
        return kept.pop() if kept else None

    @property
    def nbytes(self) -> int:
        return sum(arr.nbytes for kept in self._kept for _, arr in kept)

    def drop(self) -> list:
        """Forget every kept payload; return their buffers (for the caller to free)."""
        out = [buf for kept in self._kept for buf, _ in kept]
        for kept in self._kept:
            kept.clear()
        return out
