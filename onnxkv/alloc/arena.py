"""``ArenaAllocator``: buffers carved from one region reserved up front.

The bookkeeping (size-class free lists, splitting, coalescing, locking) is
in the Cython module ``_arena``; this is its thin Python face.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ._arena import ArenaCore
from ._checks import byte_view, check_alignment, check_nbytes
from .protocol import AllocatorStats, Buffer


class ArenaBuffer:
    """A leased block of an :class:`ArenaAllocator`'s region.

    ``offset`` is the distance from the region's start; ``nbytes`` is the size
    requested (the block behind it may be larger, rounded up to the arena's
    alignment). After ``free`` the buffer is dead: ``view`` and ``address``
    raise ``ValueError`` and views taken earlier must not be used.
    """

    __slots__ = ("_owner", "_handle", "_nbytes", "_live")

    def __init__(self, owner: ArenaAllocator, handle: tuple[int, int, int, int], nbytes: int) -> None:
        self._owner = owner
        self._handle = handle
        self._nbytes = nbytes
        self._live = True

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def offset(self) -> int:
        return self._handle[2]

    @property
    def address(self) -> int:
        self._check_live()
        return self._owner._core.address + self.offset

    def view(self, dtype: npt.DTypeLike, shape: int | tuple[int, ...]) -> np.ndarray:
        """Writable C-contiguous ``dtype[shape]`` array into the arena's region (no copy)."""
        self._check_live()
        start = self.offset
        return byte_view(self._owner._region[start : start + self._nbytes], dtype, shape)

    def _check_live(self) -> None:
        if not self._live:
            raise ValueError(f"buffer at offset {self.offset} was freed by {self._owner!r}")

    def __repr__(self) -> str:
        state = "" if self._live else " freed"
        return f"<ArenaBuffer offset={self.offset} nbytes={self._nbytes}{state}>"


class ArenaAllocator:
    """Allocates from one region of ``capacity`` bytes reserved at construction.

    Every buffer starts at a multiple of ``alignment`` (a power of two >= 64,
    the arena's granule) and takes a whole number of granules (a 0-byte request
    takes one). Larger per-request alignments are honoured by leaving a free
    pad in front. The arena never grows: a request no free block can hold
    raises :class:`~onnxkv.errors.OutOfMemory` naming the request, live bytes,
    capacity and largest free block, and changes nothing.

    Accounting counts block bytes: ``live`` is the sum of the (rounded-up)
    blocks handed out, ``committed`` is ``capacity``. Offsets are deterministic:
    the same sequence of calls on a fresh arena gives the same offsets.
    Thread-safe: the bookkeeping runs under a lock with the GIL released.
    """

    def __init__(self, capacity: int, alignment: int = 64) -> None:
        capacity = check_nbytes(capacity)
        alignment = check_alignment(alignment)
        if alignment < 64:
            raise ValueError(f"arena alignment must be a power of two >= 64, got {alignment}")
        if capacity == 0 or capacity % alignment:
            raise ValueError(f"capacity must be a positive multiple of {alignment}, got {capacity}")
        self._core = ArenaCore(capacity, alignment)
        self._region = np.frombuffer(self._core, dtype=np.uint8)

    @property
    def capacity(self) -> int:
        return self._core.capacity

    @property
    def alignment(self) -> int:
        return self._core.granule

    @property
    def largest_free_block(self) -> int:
        """Bytes of the largest free block (what a granule-aligned request can get)."""
        return self._core.stats()["largest_free"]

    def allocate(self, nbytes: int, alignment: int = 64) -> ArenaBuffer:
        """Lease ``nbytes`` bytes at ``alignment``; ``OutOfMemory`` if they do not fit."""
        n = check_nbytes(nbytes)
        a = check_alignment(alignment)
        return ArenaBuffer(self, self._core.allocate(n, a), n)

    def free(self, buffer: Buffer) -> None:
        """Take back a live buffer of this arena; ``ValueError`` otherwise (nothing changes)."""
        if not isinstance(buffer, ArenaBuffer) or buffer._owner is not self:
            raise ValueError(f"{self!r}: foreign buffer {buffer!r} was not allocated here")
        block, generation, offset, _ = buffer._handle
        try:
            self._core.free(block, generation, offset)
        except ValueError:
            raise ValueError(f"{self!r}: double free of {buffer!r}") from None
        buffer._live = False

    def reset(self) -> None:
        """Forget all history (counters, layout); ``RuntimeError`` if any buffer is live."""
        self._core.reset()

    def stats(self) -> AllocatorStats:
        """Snapshot; ``committed == capacity``, ``live`` counts block bytes."""
        s = self._core.stats()
        return AllocatorStats(
            committed=s["capacity"],
            live=s["live"],
            peak=s["peak"],
            allocations=s["allocations"],
            frees=s["frees"],
        )

    def __repr__(self) -> str:
        return f"ArenaAllocator(capacity={self.capacity}, alignment={self.alignment})"
