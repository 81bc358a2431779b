"""The allocator contract every onnxkv storage user relies on.

An :class:`Allocator` hands out :class:`Buffer` objects. Ownership: the
allocator owns the memory; the caller holds a lease from ``allocate`` until it
passes the same buffer to ``free`` exactly once. Between the two, the caller
(and anyone it shares views with) may read and write every byte of the buffer;
nobody else writes them. After ``free`` the buffer and every view taken from it
must not be used again: the allocator may hand the bytes to someone else.

Anything with ``allocate``, ``free`` and ``stats`` methods following this
contract can be passed where onnxkv asks for an allocator (see
:func:`onnxkv.alloc.as_allocator`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class AllocatorStats:
    """A consistent snapshot of an allocator's accounting, in bytes and counts.

    ``committed``: bytes the allocator holds from the operating system.
    ``live``: bytes currently handed out (each allocator documents whether it
    counts requested or rounded-up bytes). ``peak``: the largest ``live`` seen.
    ``allocations`` / ``frees``: successful ``allocate`` / ``free`` calls.
    """

    committed: int
    live: int
    peak: int
    allocations: int
    frees: int


@runtime_checkable
class Buffer(Protocol):
    """A leased, fixed-size, aligned run of bytes.

    ``address`` is the address of the first byte and is a multiple of the
    alignment passed to ``allocate``. ``view`` returns a writable C-contiguous
    NumPy array over the buffer's bytes (no copy); it raises ``ValueError`` if
    the shape needs more than ``nbytes`` bytes or the buffer was freed.
    """

    @property
    def nbytes(self) -> int: ...

    @property
    def address(self) -> int: ...

    def view(self, dtype: npt.DTypeLike, shape: int | tuple[int, ...]) -> np.ndarray: ...


@runtime_checkable
class Allocator(Protocol):
    """Hands out and takes back :class:`Buffer` objects.

    ``allocate(nbytes, alignment=64)``: ``nbytes`` is an ``int`` >= 0 (0 gives
    a valid empty buffer); ``alignment`` is a power of two >= 1. A request the
    allocator cannot satisfy raises :class:`onnxkv.errors.OutOfMemory` and
    changes nothing. ``free(buffer)``: a buffer that is not live in this
    allocator (double free, foreign buffer) raises ``ValueError`` naming the
    allocator. ``stats()`` returns an :class:`AllocatorStats` snapshot.
    """

    def allocate(self, nbytes: int, alignment: int = 64) -> Buffer: ...

    def free(self, buffer: Buffer) -> None: ...

    def stats(self) -> AllocatorStats: ...
