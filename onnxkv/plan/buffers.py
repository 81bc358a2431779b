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

from collections import defaultdict
from math import prod

import numpy as np

__all__ = ["RunBuffers"]


class RunBuffers:
    """Owner of one run's temporaries (not thread-safe: one per run).

    An entry is ``(buffer, raw uint8 view of its bytes, nbytes)``.
    """

    __slots__ = ("allocator", "held", "free_lists", "pooled", "pool_limit")

    def __init__(self, allocator, pool_limit: int = 64 << 20) -> None:
        self.allocator = allocator
        self.held: dict[int, tuple] = {}  # slot -> entry
        self.free_lists: defaultdict[int, list] = defaultdict(list)  # nbytes -> entries
        self.pooled = 0
        self.pool_limit = pool_limit

    def take(self, slot: int, shape: tuple, dtype: np.dtype) -> tuple[np.ndarray, bool]:
        """A C-contiguous ``dtype`` array of ``shape`` (non-negative ints) owned by ``slot``; True if it was a reuse."""
        nbytes = dtype.itemsize * int(prod(shape))
        held = self.held
        if slot in held:
            self.release(slot)
        lst = self.free_lists.get(nbytes)
        if lst:
            entry = lst.pop()
            self.pooled -= nbytes
            reused = True
        else:
            buf = self.allocator.allocate(nbytes, 64)
            entry = (buf, buf.view(np.uint8, (nbytes,)), nbytes)
            reused = False
        held[slot] = entry
        return entry[1].view(dtype).reshape(shape), reused

    def release(self, slot: int) -> None:
        """Return ``slot``'s buffer to the free lists (to the allocator past ``pool_limit``); no-op if it has none."""
        entry = self.held.pop(slot, None)
        if entry is not None:
            n = entry[2]
            if self.pooled + n > self.pool_limit:
                self.allocator.free(entry[0])
                return
            self.free_lists[n].append(entry)
            self.pooled += n

    def close(self) -> None:
        """Return every buffer to the allocator."""
        free = self.allocator.free
        for entry in self.held.values():
            free(entry[0])
        for lst in self.free_lists.values():
            for entry in lst:
                free(entry[0])
        self.held.clear()
        self.free_lists.clear()
        self.pooled = 0
