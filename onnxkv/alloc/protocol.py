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

What onnxkv checks.  The allocator object is trusted to be called; what it
returns is not.  Every buffer is checked before anything writes to it
(:func:`onnxkv.alloc.checked.lease`): ``nbytes`` at least the request,
``address`` aligned, ``view`` an array of exactly the dtype (native byte
order) and shape asked for, C-contiguous, non-negative strides, writable,
starting at ``address``, and its bytes overlapping no other live buffer of
the same allocator.  A bad buffer is given back to ``free`` and the request
fails with :class:`~onnxkv.errors.OutOfMemory` (``allocate`` raised, or the
buffer is too small) or :class:`~onnxkv.errors.InputError` naming the
allocator, the request and the property; nothing else changes.

When ``free`` raises.  The owner forgets the buffer first (page tables,
pointers, formats, sizes, reference and conversion counts) and still frees
every other buffer of the same call, so pools, caches and page sets stay
consistent (their audits pass) and the allocator keeps whatever it did not
take back.  Then, per site:

* raised as :class:`~onnxkv.errors.StateError` naming the allocator, chained
  to the original, where nothing is published yet: the old storage of a
  contiguous cache that grew during a run
  (:meth:`~onnxkv.cache.contiguous.CacheTensor.reserve`), a run's temporary
  given back during the run (``RunBuffers.release``).  The run fails and the
  state is as before it (a grown cache keeps its larger capacity);
* logged (logger ``onnxkv.alloc``, warning) and swallowed where the call's
  effect is already published or the free cleans up after another error
  (which is the one raised): pages whose last reference is dropped
  (``BlockPool.decref``: commit, discard, release, truncate, eviction),
  payloads replaced by a conversion (``BlockPool.install_payload``,
  ``convert_page``, ``PageSet.convert`` and its commit and rollback), built
  payloads given back (``BlockPool.discard_payload``), a state's caches
  released (``CacheTensor.release``), a page tensor's payloads when the
  tensor is collected, a run's temporaries at its end, and a rejected or
  rolled-back allocation.
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
