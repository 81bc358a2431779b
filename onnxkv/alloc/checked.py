"""Leasing from an allocator that is trusted to be called, not to be right.

Every buffer onnxkv takes from an allocator (cache storage, page payloads,
declared state values, a run's temporaries) comes through :func:`lease` and
goes back through :func:`release`.

:func:`lease` calls ``allocate(nbytes, alignment)`` and checks what came back
before anyone writes to it:

* ``buffer.nbytes`` is an int >= ``nbytes`` (else :class:`OutOfMemory`);
* ``buffer.address`` is an int multiple of ``alignment``;
* ``buffer.view(dtype, shape)`` is a NumPy array of exactly that dtype (native
  byte order) and shape, C-contiguous, with non-negative strides, writable,
  whose first byte is ``buffer.address`` (so its bytes lie in ``[address,
  address + nbytes)``);
* those ``nbytes`` bytes overlap no other live lease of the same allocator
  (ownership: an allocator handing out the same bytes twice is caught before
  two owners share them).

A violation gives the buffer back (unless it is the very object of a live
lease; a ``free`` that raises is logged) and raises :class:`InputError` (or
:class:`OutOfMemory` for a buffer smaller than asked) naming the caller, the
allocator, the request and the property.  ``allocate`` raising anything but
:class:`OutOfMemory` (which passes through) becomes an :class:`OutOfMemory`
naming the allocator, chained to the original.

Ownership index.  Per allocator (a :class:`~onnxkv.alloc.SlabLane` counts as
its parent), the byte ranges of its live leases sorted by start, in blocks: a
lease or a release costs O(log n) comparisons and moves at most a block.  The index keeps neither the
buffers nor the allocator alive: an allocator's ranges go when it is
collected or its last lease is released (one that cannot be weakly
referenced is held until then).  A lease whose owner is collected without
releasing it keeps its range: its allocator never took the bytes back.
Storage handed to a caller that frees it directly must leave the index first
(:func:`forget`).  Thread-safe.
"""

from __future__ import annotations

import bisect
import logging
import threading
import weakref
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from onnxkv.errors import InputError, OutOfMemory, StateError

from ._checks import _as_int
from .protocol import Buffer
from .slab import SlabLane

__all__ = ["lease", "release", "forget", "tracked"]

log = logging.getLogger("onnxkv.alloc")


class _Leases:
    """The live leases of one allocator: disjoint byte ranges sorted by start, with the id of each buffer.

    Kept in blocks of at most ``BLOCK`` ranges (each block's first start in ``firsts``): a lease or a
    release finds its block by bisection and moves at most a block's entries, so entering n leases in
    any address order costs O(n (log n + BLOCK)), not the O(n²) of one sorted list.
    """

    BLOCK = 512
    __slots__ = ("owner", "firsts", "blocks", "start_of")

    def __init__(self) -> None:
        self.owner: object = None  # a weak reference to the allocator (or the allocator itself)
        self.firsts: list[int] = []  # blocks[b][0][0]
        self.blocks: list[list[tuple[int, int, int]]] = []  # (start, end, id(buffer)), sorted by start
        self.start_of: dict[int, int] = {}  # id(buffer) -> start

    def __len__(self) -> int:
        return len(self.start_of)

    def overlapping(self, start: int, end: int) -> tuple[int, int, int] | None:
        """The range overlapping ``[start, end)`` as (start, end, id), or None.

        The ranges are disjoint, so the one with the largest start below
        ``end`` has the largest end of all of them: only it can overlap.
        """
        b = bisect.bisect_left(self.firsts, end) - 1
        if b < 0:
            return None
        block = self.blocks[b]
        entry = block[bisect.bisect_left(block, (end,)) - 1]  # the block's first start is below end
        return entry if entry[1] > start else None

    def add(self, start: int, end: int, buffer: object) -> None:
        b = max(bisect.bisect_right(self.firsts, start) - 1, 0)
        if not self.blocks:
            self.firsts.append(start)
            self.blocks.append([])
        block = self.blocks[b]
        bisect.insort(block, (start, end, id(buffer)))
        self.firsts[b] = block[0][0]
        if len(block) > 2 * self.BLOCK:  # split in two halves
            half = block[self.BLOCK :]
            del block[self.BLOCK :]
            self.blocks.insert(b + 1, half)
            self.firsts.insert(b + 1, half[0][0])
        self.start_of[id(buffer)] = start

    def remove(self, buffer: object) -> None:
        start = self.start_of.pop(id(buffer), None)
        if start is None:
            return
        b = bisect.bisect_right(self.firsts, start) - 1
        block = self.blocks[b]
        del block[bisect.bisect_left(block, (start,))]
        if block:
            self.firsts[b] = block[0][0]
        else:
            del self.blocks[b], self.firsts[b]


_lock = threading.RLock()  # re-entrant: a collection inside a locked section may drop a dead allocator's ranges
_index: dict[int, _Leases] = {}  # id(allocator key) -> its live leases


def _key(allocator: object) -> object:
    return allocator.parent if isinstance(allocator, SlabLane) else allocator


def _dropped(key: int, leases: _Leases, _ref: object) -> None:
    """The allocator of ``leases`` was collected: forget its ranges."""
    with _lock:
        if _index.get(key) is leases:
            del _index[key]


def _leases_of(key: object) -> _Leases:
    """The (possibly new) leases of the allocator ``key``; the caller holds ``_lock``."""
    leases = _index.get(id(key))
    if leases is None:
        leases = _Leases()
        try:
            leases.owner = weakref.ref(key, lambda ref, k=id(key), mine=leases: _dropped(k, mine, ref))  # noqa: B008
        except TypeError:
            leases.owner = key
        _index[id(key)] = leases  # entered last: nothing that may collect (and free) runs until the caller adds
    return leases


def tracked(allocator: object) -> int:
    """How many leases of ``allocator`` (a lane: of its parent) are live in the ownership index."""
    with _lock:
        leases = _index.get(id(_key(allocator)))
        return len(leases) if leases is not None else 0


class _Violation(Exception):
    """What is wrong with a returned buffer; ``error`` is the class to raise."""

    def __init__(self, what: str, error: type[Exception] = InputError, leased: bool = False) -> None:
        super().__init__(what)
        self.error = error
        self.leased = leased  # the buffer object itself is a live lease


def _int_attr(buffer: object, name: str) -> int:
    try:
        value = getattr(buffer, name)
    except Exception as e:
        raise _Violation(f"has no readable {name} ({type(e).__name__}: {e})") from None
    try:
        return _as_int(value, name)
    except TypeError:
        raise _Violation(f"has {name} {value!r}, not an int") from None


def _checked_view(
    buffer: object, nbytes: int, alignment: int, dtype: np.dtype, shape: tuple[int, ...]
) -> tuple[np.ndarray, int]:
    """(``buffer.view(dtype, shape)`` as a plain array, ``buffer.address``), or :class:`_Violation`."""
    size = _int_attr(buffer, "nbytes")
    if size < nbytes:
        raise _Violation(f"holds {size} bytes, fewer than the {nbytes} asked for", OutOfMemory)
    address = _int_attr(buffer, "address")
    if address % alignment:
        raise _Violation(f"has address {address:#x}, not a multiple of the alignment {alignment}")
    try:
        view = buffer.view(dtype, shape)  # type: ignore[attr-defined]
    except Exception as e:
        raise _Violation(f"raised {type(e).__name__} from view(): {e}") from None
    if not isinstance(view, np.ndarray):
        raise _Violation(f"returned a {type(view).__name__} from view(), not a NumPy array")
    arr = view.view(np.ndarray)  # a plain array over the same bytes, whatever subclass came back
    if arr.dtype != dtype or not arr.dtype.isnative:
        raise _Violation(f"returned dtype {arr.dtype.str} from view(), expected {dtype.str}")
    if arr.shape != shape:
        raise _Violation(f"returned shape {arr.shape} from view()")
    strides = arr.strides
    if min(strides, default=0) < 0:
        raise _Violation(f"returned negative strides {strides} from view()")
    flags = arr.flags
    if not flags.c_contiguous:
        raise _Violation(f"returned a view that is not C-contiguous (strides {strides}) from view()")
    if not flags.writeable:
        raise _Violation("returned a read-only view from view()")
    first = arr.__array_interface__["data"][0]
    if arr.size and first != address:
        raise _Violation(f"returned a view whose first byte is at {first:#x}, not at the buffer's address {address:#x}")
    if arr.nbytes > nbytes:
        raise _Violation(f"returned a view of {arr.nbytes} bytes, past the {nbytes} leased")
    return arr, address


def lease(
    allocator, nbytes: int, alignment: int, dtype: npt.DTypeLike, shape: tuple[int, ...], who: str
) -> tuple[Buffer, np.ndarray]:
    """Allocate ``nbytes`` at ``alignment`` from ``allocator`` and check it (see the module docstring).

    Returns ``(buffer, array)``: ``array`` is ``buffer.view(dtype, shape)``,
    checked, as a plain ``np.ndarray``.  ``who`` names the caller in errors.
    The lease enters the ownership index: give it back with :func:`release`.
    Raises :class:`OutOfMemory` (allocate failed, or the buffer is smaller
    than asked) or :class:`InputError` (any other property); either way
    nothing is leased.
    """
    dt = np.dtype(dtype)
    dims = tuple(int(d) for d in shape)
    try:
        buffer = allocator.allocate(nbytes, alignment)
    except OutOfMemory:
        raise
    except Exception as e:
        raise OutOfMemory(
            f"{who}: {allocator!r}.{_request(nbytes, alignment, dt, dims)} raised {type(e).__name__}: {e}"
        ) from e
    try:
        arr, address = _checked_view(buffer, nbytes, alignment, dt, dims)
        if nbytes:
            _enter(allocator, buffer, address, address + nbytes)
    except _Violation as v:
        exc = v.error(f"{who}: {allocator!r}.{_request(nbytes, alignment, dt, dims)} returned {buffer!r}, which {v}")
        if not v.leased:  # the same object is leased already: freeing it would end that lease
            _free_logged(allocator, buffer, who)
        raise exc from None
    return buffer, arr


def _request(nbytes: int, alignment: int, dtype: np.dtype, shape: tuple[int, ...]) -> str:
    """The request as errors name it: ``allocate(nbytes, alignment) for dtype[shape]`` (view(dtype, shape))."""
    return f"allocate({nbytes}, {alignment}) for {dtype}{list(shape)}"


def _enter(allocator, buffer: object, start: int, end: int) -> None:
    """Enter ``[start, end)`` in the live leases of ``allocator`` unless it overlaps one of them."""
    with _lock:
        leases = _leases_of(_key(allocator))
        hit = leases.overlapping(start, end)
        if hit is None:
            leases.add(start, end, buffer)
            return
        lo, hi, same = hit[0], hit[1], hit[2] == id(buffer)
    raise _Violation(
        f"overlaps bytes [{lo:#x}, {hi:#x}) of {'this very buffer' if same else 'a buffer'} it handed "
        f"out before, still leased: bytes [{start:#x}, {end:#x}) would be handed out twice",
        leased=same,
    )


def _free_logged(allocator, buffer: object, who: str) -> BaseException | None:
    """``allocator.free(buffer)``; an exception it raises is logged and returned."""
    try:
        allocator.free(buffer)
    except Exception as e:
        # formatted now: a kept record holds no buffer, allocator or frame
        log.warning("%s", f"{who}: {allocator!r}.free({buffer!r}) raised {type(e).__name__}: {e}")
        return e
    return None


def forget(allocator, buffers: Iterable[object | None]) -> None:
    """Take ``buffers`` (None entries are skipped) out of the ownership index of ``allocator`` without
    freeing them (for leases their owner hands to someone who frees them directly)."""
    with _lock:
        key = id(_key(allocator))
        leases = _index.get(key)
        if leases is not None:
            for b in buffers:
                if b is not None:
                    leases.remove(b)
            if not len(leases):
                del _index[key]


def release(allocator, buffers: Iterable[object | None], who: str, strict: bool = False) -> None:
    """Give ``buffers`` (None entries are skipped) back to ``allocator``.

    Each buffer leaves the ownership index, then ``free`` is called on it;
    every free is attempted whatever the others do.  The caller forgets the
    buffers (pointers, sizes, formats) before calling.  A ``free`` that
    raises is logged (logger ``onnxkv.alloc``, warning); with ``strict`` the
    first such error is then raised as :class:`StateError` naming ``who``
    and the allocator, chained to the original.
    """
    todo = [b for b in buffers if b is not None]
    forget(allocator, todo)
    first = None
    for b in todo:
        err = _free_logged(allocator, b, who)
        first = first or err
    if strict and first is not None:
        raise StateError(
            f"{who}: {allocator!r}.free raised {type(first).__name__}: {first} (the storage is "
            "forgotten; the allocator keeps whatever it did not take back)"
        ) from first
