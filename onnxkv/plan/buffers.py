"""Buffers of one run: taken from the session's allocator, recycled within the run.

A run allocates the outputs of its kernels through :meth:`RunBuffers.take` and
gives them back through :meth:`RunBuffers.release` after the last use of their
storage class.  A released buffer is kept in a free list keyed by its size and
handed out again to the next request of exactly that size in the same run
(decoder layers repeat the same shapes, so most requests after the first layer
are reuses, counted as ``reuse_count``).  At most ``pool_limit`` bytes are
kept for reuse; a released buffer that would exceed it goes straight back to
the allocator, so a long prefill does not hold every temporary it ever made.
:meth:`close` returns everything to the allocator at the end of the run, so
between runs the plan holds nothing.
"""

from __future__ import annotations

import numpy as np

__all__ = ["RunBuffers"]


class RunBuffers:
    """Owner of one run's temporaries (not thread-safe: one per run)."""

    __slots__ = ("allocator", "held", "free_lists", "pooled", "pool_limit")

    def __init__(self, allocator, pool_limit: int = 64 << 20) -> None:
        self.allocator = allocator
        self.held: dict[int, tuple] = {}  # slot -> (buffer, raw uint8 view)
        self.free_lists: dict[int, list] = {}
        self.pooled = 0
        self.pool_limit = pool_limit

    def _pool(self, entry: tuple) -> None:
        n = entry[0].nbytes
        if self.pooled + n > self.pool_limit:
            self.allocator.free(entry[0])
            return
        self.free_lists.setdefault(n, []).append(entry)
        self.pooled += n

    def take(self, slot: int, nbytes: int, dtype: np.dtype, shape: tuple) -> tuple[np.ndarray, bool]:
        """An array of ``shape``/``dtype`` owned by ``slot``; True if it was a reuse."""
        old = self.held.pop(slot, None)
        if old is not None:
            self._pool(old)
        lst = self.free_lists.get(nbytes)
        if lst:
            entry = lst.pop()
            self.pooled -= nbytes
            reused = True
        else:
            buf = self.allocator.allocate(nbytes, 64)
            entry = (buf, buf.view(np.uint8, (nbytes,)))
            reused = False
        self.held[slot] = entry
        return entry[1].view(dtype).reshape(shape), reused

    def release(self, slot: int) -> None:
        entry = self.held.pop(slot, None)
        if entry is not None:
            self._pool(entry)

    def close(self) -> None:
        """Return every buffer to the allocator."""
        free = self.allocator.free
        for buf, _ in self.held.values():
            free(buf)
        for lst in self.free_lists.values():
            for buf, _ in lst:
                free(buf)
        self.held.clear()
        self.free_lists.clear()
        self.pooled = 0
