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
    """Per plane of ``planes`` (:class:`~onnxkv.cache.plane_spec.PlaneSpec`, pages of ``block_size``
    tokens), up to ``limit`` native payloads ``(buffer, array, address)``.  Every call takes ``lock`` (the owner's,
    re-entrant): a conversion back to a native page takes a spare without holding it."""

    def __init__(self, planes: list, block_size: int, limit: int, lock) -> None:
        self.limit = limit
        # per plane: the dtype and shape of a native page's array
        self._natives = [(p.dtype, (p.heads, block_size, p.head_size)) for p in planes]
        self._kept: list[list] = [[] for _ in planes]
        self._lock = lock

    def keep(self, plane: int, buf, arr: np.ndarray | None, address: int) -> bool:
        """Keep a freed page's payload of ``plane`` (``address``: its array's first byte) when it is a native
        one (an array of the plane's native dtype and shape) and the plane holds fewer than ``limit``; False
        otherwise (the caller frees it)."""
        kept = self._kept[plane]
        dtype, shape = self._natives[plane]
        with self._lock:
            if len(kept) >= self.limit or arr is None or arr.dtype != dtype or arr.shape != shape:
                return False
            kept.append((buf, arr, address))
            return True

    def take(self, plane: int) -> tuple | None:
        """A kept payload ``(buffer, array, address)`` of ``plane``, or None."""
        kept = self._kept[plane]
        with self._lock:
            return kept.pop() if kept else None

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(arr.nbytes for kept in self._kept for _, arr, _ in kept)

    def drop(self) -> list:
        """Forget every kept payload; return their buffers (for the caller to free)."""
        with self._lock:
            out = [buf for kept in self._kept for buf, _, _ in kept]
            for kept in self._kept:
                kept.clear()
            return out
