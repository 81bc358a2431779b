"""The process's reserve of released slab chunks: mapped regions kept, zeroed, for the next allocator.

A chunk a :class:`~onnxkv.alloc.SlabAllocator` maps fresh costs the
operating system's page faults when it is first written: one per 4 KiB page,
or a whole 2 MiB huge page cleared (and, under memory pressure, compacted)
per fault in a huge-page advised chunk.  A paged cache that lives for one
request (``generate(..., cache="paged")``, an engine's pool) would pay that
again for every request.  So a chunk an allocator lets go (a second empty chunk of a
size class, :meth:`SlabAllocator.trim`, or the allocator collected) is
offered here, and an allocator that needs a chunk takes one of the same
size, alignment and huge-page advice before it maps a new one.

Contract.
* A region is zeroed when it is offered (the bytes any slot of it was ever
  handed out over), so a chunk taken from the reserve reads as zeros like a
  fresh mapping: no byte of an earlier owner reaches the next one.
* The reserve holds at most :func:`chunk_reserve_limit` bytes (default
  :data:`DEFAULT_LIMIT_BYTES`; :func:`set_chunk_reserve_limit`, 0 turns it
  off); a region offered beyond the limit is dropped (unmapped once no view
  of it is left), so the process's resident memory after its caches close is
  at most that much above what a fresh mapping would leave.
* Thread-safe (one re-entrant lock: a garbage collection inside a locked
  section may run an allocator's finalizer, which offers its chunks).

:func:`chunk_reserve_stats` reports the bytes held and how often a request
was served from the reserve.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DEFAULT_LIMIT_BYTES",
    "ReserveStats",
    "chunk_reserve_limit",
    "chunk_reserve_stats",
    "set_chunk_reserve_limit",
]

#: Bytes the reserve holds at most unless told otherwise: the chunks of a few requests' caches of a
#: small model (a 2,048-token request of a 16-plane cache releases 16 two-MiB chunks and 16 first chunks).
DEFAULT_LIMIT_BYTES = 128 << 20


@dataclass(frozen=True)
class ReserveStats:
    """A snapshot of the reserve: ``held_bytes`` / ``regions`` kept now, ``limit_bytes``; counts since the
    process started: ``hits`` (chunks served from the reserve), ``misses`` (chunks the allocators had to
    map), ``kept`` / ``dropped`` (offered regions kept, or dropped over the limit)."""

    held_bytes: int
    regions: int
    limit_bytes: int
    hits: int
    misses: int
    kept: int
    dropped: int


class _Reserve:
    """Released regions by (size, alignment, huge-page advice), last offered first."""

    def __init__(self, limit: int) -> None:
        self._lock = threading.RLock()
        self._free: dict[tuple[int, int, bool], list[np.ndarray]] = {}
        self._held = 0
        self._limit = limit
        self._hits = self._misses = self._kept = self._dropped = 0

    def take(self, size: int, align: int, huge: bool) -> np.ndarray | None:
        """A zeroed region of ``size`` bytes aligned to ``align`` (advised huge pages iff ``huge``), or None."""
        with self._lock:
            regions = self._free.get((size, align, huge))
            if not regions:
                self._misses += 1
                return None
            region = regions.pop()
            self._held -= size
            self._hits += 1
            return region

    def offer(self, region: np.ndarray, align: int, huge: bool, touched: int) -> bool:
        """Keep ``region`` (uint8 [size], aligned to ``align``) if it fits under the limit, after zeroing its
        first ``touched`` bytes (all that was ever handed out); True if kept.  The caller no longer uses it."""
        size = region.size
        with self._lock:
            if self._held + size > self._limit:
                self._dropped += 1
                return False
            self._held += size  # claimed before the zeroing, which runs outside the lock
        region[:touched].fill(0)
        with self._lock:
            self._free.setdefault((size, align, huge), []).append(region)
            self._kept += 1
        return True

    def set_limit(self, limit: int) -> int:
        with self._lock:
            old, self._limit = self._limit, limit
            for key in list(self._free):
                regions = self._free[key]
                while regions and self._held > limit:
                    self._held -= regions.pop(0).size  # the oldest first
                if not regions:
                    del self._free[key]
            return old

    def stats(self) -> ReserveStats:
        with self._lock:
            return ReserveStats(
                held_bytes=self._held,
                regions=sum(len(r) for r in self._free.values()),
                limit_bytes=self._limit,
                hits=self._hits,
                misses=self._misses,
                kept=self._kept,
                dropped=self._dropped,
            )


#: The process's reserve (every SlabAllocator's).
RESERVE = _Reserve(DEFAULT_LIMIT_BYTES)


def set_chunk_reserve_limit(limit_bytes: int) -> int:
    """Bound the bytes of released chunks kept mapped for reuse (0: keep none); returns the old bound.
    Regions over a lowered bound are dropped at once, the oldest first.  ``ValueError`` unless an int >= 0."""
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, (int, np.integer)) or limit_bytes < 0:
        raise ValueError(f"set_chunk_reserve_limit: limit_bytes must be an int >= 0, got {limit_bytes!r}")
    return RESERVE.set_limit(int(limit_bytes))


def chunk_reserve_limit() -> int:
    """The bound of :func:`set_chunk_reserve_limit`."""
    return RESERVE.stats().limit_bytes


def chunk_reserve_stats() -> ReserveStats:
    """What the reserve holds now and how often it served a chunk (see :class:`ReserveStats`)."""
    return RESERVE.stats()
