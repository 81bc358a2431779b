"""``SystemAllocator``: every buffer is a fresh NumPy array (memory on demand)."""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt

from onnxkv.errors import OutOfMemory

from ._checks import byte_view, check_alignment, check_nbytes
from .protocol import AllocatorStats, Buffer


class SystemBuffer:
    """A buffer of :class:`SystemAllocator`: an aligned slice of its own uint8 array.

    The allocator keeps the array alive until ``free``; views taken before
    ``free`` keep the bytes alive but must not be used after it.
    """

    __slots__ = ("_owner", "_raw", "_nbytes")

    def __init__(self, owner: SystemAllocator, raw: np.ndarray, nbytes: int) -> None:
        self._owner = owner
        self._raw: np.ndarray | None = raw  # at least one byte, so its address is meaningful
        self._nbytes = nbytes

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def address(self) -> int:
        return self._live_raw().__array_interface__["data"][0]

    def view(self, dtype: npt.DTypeLike, shape: int | tuple[int, ...]) -> np.ndarray:
        """Writable C-contiguous ``dtype[shape]`` array over this buffer's bytes."""
        return byte_view(self._live_raw()[: self._nbytes], dtype, shape)

    def _live_raw(self) -> np.ndarray:
        if self._raw is None:
            raise ValueError(f"buffer was freed by {self._owner!r}")
        return self._raw

    def __repr__(self) -> str:
        state = " freed" if self._raw is None else f" address={self.address:#x}"
        return f"<SystemBuffer nbytes={self._nbytes}{state}>"


class SystemAllocator:
    """Allocates each buffer as a fresh over-allocated NumPy array, sliced to the alignment.

    Accounting counts requested bytes: ``live`` is the sum of ``nbytes`` of
    live buffers and ``committed`` equals ``live`` (nothing is reserved ahead).
    Thread-safe: accounting is guarded by a lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, SystemBuffer] = {}
        self._live_bytes = 0
        self._peak = 0
        self._allocations = 0
        self._frees = 0

    def allocate(self, nbytes: int, alignment: int = 64) -> SystemBuffer:
        """Lease ``nbytes`` bytes whose first byte's address is a multiple of ``alignment``."""
        n = check_nbytes(nbytes)
        a = check_alignment(alignment)
        try:
            whole = np.empty(max(n, 1) + a - 1, dtype=np.uint8)
        except (MemoryError, ValueError) as exc:
            raise OutOfMemory(f"{self!r}: cannot allocate {n} bytes aligned to {a}: {exc}") from None
        start = -whole.__array_interface__["data"][0] % a
        buffer = SystemBuffer(self, whole[start : start + max(n, 1)], n)
        with self._lock:
            self._live[id(buffer)] = buffer
            self._live_bytes += n
            self._peak = max(self._peak, self._live_bytes)
            self._allocations += 1
        return buffer

    def free(self, buffer: Buffer) -> None:
        """Take back a live buffer of this allocator; ``ValueError`` otherwise."""
        with self._lock:
            live = self._live.get(id(buffer))
            if live is not buffer:
                kind = "double free" if getattr(buffer, "_owner", None) is self else "foreign buffer"
                raise ValueError(f"{self!r}: {kind}: {buffer!r} is not live in this allocator")
            del self._live[id(buffer)]
            self._live_bytes -= live.nbytes
            self._frees += 1
            live._raw = None

    def stats(self) -> AllocatorStats:
        """Snapshot of the accounting; ``committed == live``."""
        with self._lock:
            return AllocatorStats(
                committed=self._live_bytes,
                live=self._live_bytes,
                peak=self._peak,
                allocations=self._allocations,
                frees=self._frees,
            )

    def __repr__(self) -> str:
        return f"SystemAllocator(at {id(self):#x})"
