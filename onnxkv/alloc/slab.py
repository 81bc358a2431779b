"""``SlabAllocator``: equal-size slots carved from large, huge-page backed chunks.

Meant for many buffers of a few sizes that are read as a stream (the pages
of a paged KV cache): successive requests of one size get adjacent slots in
one chunk, so a reader walking them crosses few TLB entries, and the chunks
ask the kernel for transparent huge pages.

Layout.  A request of ``nbytes`` at ``alignment`` is served from the *size
class* ``slot = round_up(max(nbytes, 1), max(alignment, granule))``.  Each
class keeps a list of chunks: anonymous private ``mmap`` regions of
``chunk_bytes`` bytes whose first byte is aligned to ``chunk_bytes``, cut into
``chunk_bytes // slot`` slots at offsets ``0, slot, 2*slot, ...`` (a slot's
offset is a multiple of the slot size, hence of the request's alignment).
Each chunk is advised ``MADV_HUGEPAGE`` where the platform knows it (a hint:
skipped silently where it is missing or refused).  The first chunk of a class
(while the class has none mapped) is small instead: ``first_chunk_bytes``
(or the slot rounded up to a power of two, if larger), aligned to its size
and not advised, so a cache holding one page per plane keeps a few 4 KiB
pages resident, not one 2 MiB huge page per plane.  A request larger than a
chunk (``slot > chunk_bytes``) gets a region of its own, aligned to
``max(chunk_bytes, alignment)`` and released as soon as it is freed.

Order.  A request takes the lowest free slot of the lowest-addressed chunk of
its class that has one (a fresh chunk is mapped only when none has), so
slots handed out one after another are adjacent and freed slots are reused
lowest address first.  A chunk whose slots are all free is kept as the
class's one spare; a second empty chunk of the class is released.

Lanes.  :meth:`SlabAllocator.lane` gives allocators over separate sets of
size classes (a paged cache uses one lane per plane), so buffers of one lane
stay adjacent however the lanes' requests interleave.

Lifetime.  A chunk the allocator releases (a second empty chunk of a class,
the empty chunks :meth:`SlabAllocator.trim` hands back, the empty chunks of a
collected allocator) is offered to the process's chunk reserve
(:mod:`onnxkv.alloc.chunk_reserve`), zeroed, and a chunk the allocator needs
is taken from there before a new one is mapped: a cache that lives for one
request does not pay the page faults of fresh memory again for the next.  A
region the reserve does not keep is dropped: the mapping goes away once no
NumPy view of it is left (a view taken before ``free`` keeps its bytes
mapped, but it must not be used: see :mod:`onnxkv.alloc.protocol`; the bytes
may belong to another allocator by then).  Oversize regions are dropped on
``free``.  The allocator never calls ``mmap.close``.
"""

from __future__ import annotations

import bisect
import heapq
import mmap
import threading
import weakref

import numpy as np
import numpy.typing as npt

from onnxkv.errors import OutOfMemory

from ._checks import byte_view, check_alignment, check_nbytes
from .chunk_reserve import RESERVE
from .protocol import AllocatorStats, Buffer

#: ``madvise`` flag asking for transparent huge pages (None where the platform lacks it).
_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)
_MAP_PRIVATE: int = getattr(mmap, "MAP_PRIVATE", 0)


class _Chunk:
    """One mapped region: ``size`` bytes at ``address`` holding ``nslots`` slots of ``slot`` bytes.

    ``lane``: the lane of a class chunk (see :meth:`SlabAllocator.lane`).
    ``bump``: slots below it were handed out at least once since the chunk
    was last empty; ``freed``: a min-heap of free slot indices below ``bump``;
    ``touched``: slots below it were handed out at least once since the
    chunk was mapped (what the chunk reserve zeroes).  ``align`` / ``huge``:
    the alignment and huge-page advice it was mapped with.
    """

    __slots__ = (
        "region", "address", "size", "slot", "nslots", "lane", "used", "bump", "freed", "touched", "align", "huge"
    )  # fmt: skip

    def __init__(self, region: np.ndarray, slot: int, nslots: int, align: int = 0, huge: bool = False) -> None:
        self.region = region  # uint8 [size] over the mmap; keeps the mapping alive
        self.address: int = region.__array_interface__["data"][0]
        self.size = region.size
        self.slot = slot
        self.nslots = nslots
        self.lane = 0
        self.used = 0
        self.bump = 0
        self.freed: list[int] = []
        self.touched = 0
        self.align = align
        self.huge = huge

    def take(self) -> int:
        """Lease the lowest free slot; return its offset (the chunk must have one)."""
        if self.freed:
            index = heapq.heappop(self.freed)
        else:
            index = self.bump
            self.bump += 1
            self.touched = max(self.touched, self.bump)
        self.used += 1
        return index * self.slot

    def give_back(self, offset: int) -> None:
        self.used -= 1
        if self.used:
            heapq.heappush(self.freed, offset // self.slot)
        else:  # empty: refill from the start, in address order
            self.bump = 0
            self.freed.clear()


class _SizeClass:
    """The chunks of one slot size: by address, the ones with a free slot, and the empty spare."""

    __slots__ = ("chunks", "room", "spare")

    def __init__(self) -> None:
        self.chunks: dict[int, _Chunk] = {}
        self.room: list[int] = []  # sorted addresses of chunks with a free slot
        self.spare: _Chunk | None = None


class SlabBuffer:
    """A leased slot of a :class:`SlabAllocator` (or an oversize region of its own).

    ``nbytes`` is the size requested; the slot behind it may be larger. After
    ``free`` the buffer is dead: ``view`` and ``address`` raise ``ValueError``
    and views taken earlier must not be used.
    """

    __slots__ = ("_owner", "_chunk", "_offset", "_nbytes", "_live")

    def __init__(self, owner: SlabAllocator, chunk: _Chunk, offset: int, nbytes: int) -> None:
        self._owner = owner
        self._chunk = chunk
        self._offset = offset
        self._nbytes = nbytes
        self._live = True

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def slot_bytes(self) -> int:
        """Bytes of the slot (or oversize region) behind the buffer: what ``stats().live`` counts."""
        return self._chunk.slot

    @property
    def address(self) -> int:
        self._check_live()
        return self._chunk.address + self._offset

    def view(self, dtype: npt.DTypeLike, shape: int | tuple[int, ...]) -> np.ndarray:
        """Writable C-contiguous ``dtype[shape]`` array over this buffer's bytes (no copy)."""
        self._check_live()
        start = self._offset
        return byte_view(self._chunk.region[start : start + self._nbytes], dtype, shape)

    def _check_live(self) -> None:
        if not self._live:
            raise ValueError(f"buffer was freed by {self._owner!r}")

    def __repr__(self) -> str:
        state = f" address={self.address:#x}" if self._live else " freed"
        return f"<SlabBuffer nbytes={self._nbytes} slot={self._chunk.slot}{state}>"


class SlabAllocator:
    """Hands out slots of size classes from ``chunk_bytes`` chunks (see the module docstring).

    Args:
        chunk_bytes: bytes of one chunk and its alignment; a power of two that
            is a multiple of the system page size (default 2 MiB, one x86-64
            huge page).
        granule: smallest slot and smallest alignment of a slot (a power of
            two >= 64 and <= ``chunk_bytes``; default 64).
        first_chunk_bytes: bytes of a size class's first chunk (see the
            module docstring); a power of two in [page size, ``chunk_bytes``]
            (None: 64 KiB or ``chunk_bytes`` if smaller; ``chunk_bytes``: every
            chunk full size).
        huge_pages: advise the full-size chunks and the oversize regions
            ``MADV_HUGEPAGE`` (where available).

    Accounting.  ``committed`` is the bytes of the chunks and oversize regions
    currently mapped (full chunks, whether their slots are leased or not, the
    spare included); ``live`` is the bytes of the leased slots (requests
    rounded up to their size class).  So ``committed >= live`` always, unlike
    :class:`~onnxkv.alloc.SystemAllocator` whose ``committed == live`` counts
    requested bytes only.  Mapped bytes are address space: the operating
    system backs a page with memory only when it is first written (in an
    advised chunk, a whole 2 MiB huge page at a time).

    Thread-safe: every call runs under one lock.  A failed ``allocate`` (the
    ``mmap`` of a new chunk failed: :class:`~onnxkv.errors.OutOfMemory`)
    changes nothing.
    """

    def __init__(
        self,
        chunk_bytes: int = 2 << 20,
        granule: int = 64,
        first_chunk_bytes: int | None = None,
        huge_pages: bool = True,
    ) -> None:
        chunk = check_alignment(chunk_bytes)
        if chunk < mmap.PAGESIZE:
            raise ValueError(
                f"SlabAllocator: chunk_bytes must be a power of two >= the page size {mmap.PAGESIZE}, got {chunk}"
            )
        first = min(64 << 10, chunk) if first_chunk_bytes is None else check_alignment(first_chunk_bytes)
        if not mmap.PAGESIZE <= first <= chunk:
            raise ValueError(
                f"SlabAllocator: first_chunk_bytes must be a power of two in [page size "
                f"{mmap.PAGESIZE}, chunk_bytes={chunk}], got {first}"
            )
        grain = check_alignment(granule)
        if not 64 <= grain <= chunk:
            raise ValueError(f"SlabAllocator: granule must be a power of two in [64, chunk_bytes={chunk}], got {grain}")
        self._chunk_bytes = chunk
        self._first_chunk_bytes = first
        self._granule = grain
        self._huge_pages = bool(huge_pages) and _MADV_HUGEPAGE is not None
        # re-entrant: a collection inside a locked section (mapping a chunk allocates) may run the finalizer
        # of a dead owner, which frees its buffers here
        self._lock = threading.RLock()
        self._classes: dict[tuple[int, int], _SizeClass] = {}  # by (lane, slot bytes)
        self._oversize: set[_Chunk] = set()
        self._committed = 0
        self._live_bytes = 0
        self._peak = 0
        self._allocations = 0
        self._frees = 0
        self._reused = 0
        # a collected allocator's empty chunks go to the chunk reserve (the finalizer holds the classes, not self);
        # not at interpreter exit, where the allocator may still be alive and its owners still free into it
        weakref.finalize(self, _offer_empty, self._classes).atexit = False

    @property
    def chunk_bytes(self) -> int:
        return self._chunk_bytes

    @property
    def first_chunk_bytes(self) -> int:
        return self._first_chunk_bytes

    @property
    def granule(self) -> int:
        return self._granule

    @property
    def huge_pages(self) -> bool:
        """True if chunks are advised ``MADV_HUGEPAGE`` (asked for and known to the platform)."""
        return self._huge_pages

    @property
    def reused_chunks(self) -> int:
        """Chunks this allocator took from the process's chunk reserve instead of mapping them."""
        return self._reused

    @property
    def chunk_count(self) -> int:
        """Chunks and oversize regions currently mapped."""
        with self._lock:
            return sum(len(c.chunks) for c in self._classes.values()) + len(self._oversize)

    def allocate(self, nbytes: int, alignment: int = 64) -> SlabBuffer:
        """Lease ``nbytes`` bytes whose first byte's address is a multiple of ``alignment`` (lane 0).

        Raises :class:`~onnxkv.errors.OutOfMemory` (nothing changed) when a
        needed chunk cannot be mapped.
        """
        return self._allocate(nbytes, alignment, 0)

    def lane(self, index: int) -> SlabLane:
        """An allocator handing out this allocator's slots from chunks of lane ``index`` (an int >= 0).

        Lanes share the lock, the accounting and ``free``; they never share a
        chunk, so the buffers of one lane are adjacent to each other in
        allocation order whatever the other lanes allocate in between (lane 0
        is :meth:`allocate`'s).
        """
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
            raise ValueError(f"{self!r}: lane index must be an int >= 0, got {index!r}")
        return SlabLane(self, int(index))

    def _allocate(self, nbytes: int, alignment: int, lane: int) -> SlabBuffer:
        n = check_nbytes(nbytes)
        a = max(check_alignment(alignment), self._granule)
        slot = -(-max(n, 1) // a) * a
        with self._lock:
            if slot > self._chunk_bytes:
                chunk = self._map(slot, max(a, self._chunk_bytes), n, a, True, reuse=False)
                self._oversize.add(chunk)
                offset = chunk.take()
            else:
                cls = self._classes.get((lane, slot))
                if cls is not None and cls.room:
                    chunk = cls.chunks[cls.room[0]]
                else:
                    size = self._chunk_bytes
                    if cls is None or not cls.chunks:  # a class's first chunk: small, on base pages
                        size = min(max(self._first_chunk_bytes, 1 << (slot - 1).bit_length()), size)
                    chunk = self._map(size, size, n, a, size == self._chunk_bytes)
                    chunk.slot, chunk.nslots, chunk.lane = slot, size // slot, lane
                    if cls is None:
                        cls = self._classes[lane, slot] = _SizeClass()
                    cls.chunks[chunk.address] = chunk
                    bisect.insort(cls.room, chunk.address)
                if cls.spare is chunk:
                    cls.spare = None
                offset = chunk.take()
                if chunk.used == chunk.nslots:
                    del cls.room[bisect.bisect_left(cls.room, chunk.address)]
            self._live_bytes += chunk.slot
            self._peak = max(self._peak, self._live_bytes)
            self._allocations += 1
        return SlabBuffer(self, chunk, offset, n)

    def _map(self, size: int, align: int, nbytes: int, alignment: int, huge: bool, reuse: bool = True) -> _Chunk:
        """Map ``size`` bytes (rounded up to the page size) aligned to ``align``; counts them committed.
        ``huge``: advise ``MADV_HUGEPAGE`` (if the allocator does).  ``reuse``: take a region of the chunk
        reserve first (zeroed, mapped alike).

        The chunk comes back with one slot of its whole size; the caller sets
        the slot size of a class chunk.
        """
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        huge = huge and self._huge_pages
        if reuse:
            kept = RESERVE.take(size, align, huge)
            if kept is not None:
                self._committed += size
                self._reused += 1
                return _Chunk(kept, size, 1, align, huge)
        slack = align - mmap.PAGESIZE if align > mmap.PAGESIZE else 0
        try:
            region = mmap.mmap(-1, size + slack, flags=_MAP_PRIVATE)
        except (OSError, ValueError, OverflowError, MemoryError) as exc:
            raise OutOfMemory(
                f"{self!r}: cannot allocate {nbytes} bytes aligned to {alignment}: mapping a "
                f"chunk of {size} bytes failed: {exc}"
            ) from None
        whole = np.frombuffer(region, dtype=np.uint8)
        start = -whole.__array_interface__["data"][0] % align
        if huge:
            try:
                region.madvise(_MADV_HUGEPAGE, start, size)
            except OSError:  # only a hint: kernels without transparent huge pages refuse it
                pass
        self._committed += size
        return _Chunk(whole[start : start + size], size, 1, align, huge)

    def free(self, buffer: Buffer) -> None:
        """Take back a live buffer of this allocator; ``ValueError`` (nothing changed) otherwise."""
        with self._lock:
            if not isinstance(buffer, SlabBuffer) or buffer._owner is not self:
                raise ValueError(f"{self!r}: foreign buffer: {buffer!r} was not allocated here")
            if not buffer._live:
                raise ValueError(f"{self!r}: double free: {buffer!r} is not live in this allocator")
            buffer._live = False
            chunk = buffer._chunk
            self._live_bytes -= chunk.slot
            self._frees += 1
            chunk.give_back(buffer._offset)
            if chunk in self._oversize:
                self._oversize.discard(chunk)
                self._committed -= chunk.size
                return
            cls = self._classes.get((chunk.lane, chunk.slot))
            if cls is None:  # collected in one cycle with the buffer's owner, whose free came after the
                if chunk.used == 0:  # allocator's finalizer (_offer_empty): the chunk, once empty, to the reserve
                    _offer(chunk)
                return
            if chunk.used == chunk.nslots - 1:  # it was full
                bisect.insort(cls.room, chunk.address)
            if chunk.used == 0:
                if cls.spare is None:
                    cls.spare = chunk
                else:  # keep the lower-addressed empty chunk as the spare, release the other
                    keep, drop = sorted((cls.spare, chunk), key=lambda c: c.address)
                    cls.spare = keep
                    del cls.chunks[drop.address]
                    del cls.room[bisect.bisect_left(cls.room, drop.address)]
                    self._committed -= drop.size
                    _offer(drop)

    def trim(self) -> int:
        """Release every empty chunk (the spares included) to the process's chunk reserve, where the next
        allocator that needs one takes it (:mod:`onnxkv.alloc.chunk_reserve`); returns the bytes released.
        Leased buffers are untouched; the allocator stays usable (it maps or takes chunks again as needed).
        A state or pool that owns its allocator calls this when it closes."""
        released = 0
        with self._lock:
            for key, cls in list(self._classes.items()):
                for chunk in [c for c in cls.chunks.values() if c.used == 0]:
                    del cls.chunks[chunk.address]
                    del cls.room[bisect.bisect_left(cls.room, chunk.address)]
                    self._committed -= chunk.size
                    released += chunk.size
                    _offer(chunk)
                cls.spare = None
                if not cls.chunks:  # the class starts small again, as a new allocator's
                    del self._classes[key]
        return released

    def stats(self) -> AllocatorStats:
        """Snapshot; ``committed`` counts mapped chunks, ``live`` leased slot bytes (``committed >= live``)."""
        with self._lock:
            return AllocatorStats(
                committed=self._committed,
                live=self._live_bytes,
                peak=self._peak,
                allocations=self._allocations,
                frees=self._frees,
            )

    def __repr__(self) -> str:
        return (
            f"SlabAllocator(chunk_bytes={self._chunk_bytes}, first_chunk_bytes={self._first_chunk_bytes}, "
            f"at {id(self):#x})"
        )


def _offer(chunk: _Chunk) -> None:
    """Hand a released class chunk to the chunk reserve (it zeroes the slots ever handed out)."""
    RESERVE.offer(chunk.region, chunk.align, chunk.huge, chunk.touched * chunk.slot)


def _offer_empty(classes: dict[tuple[int, int], _SizeClass]) -> None:
    """A collected allocator's empty class chunks to the chunk reserve.  A chunk with a slot still leased
    goes there when its last slot is freed: an owner collected in the same garbage cycle (a state, a page
    pool) frees its buffers after this finalizer has run, and :meth:`SlabAllocator.free` then finds no
    class for the chunk."""
    for cls in classes.values():
        for chunk in cls.chunks.values():
            if chunk.used == 0:
                _offer(chunk)
    classes.clear()


class SlabLane:
    """One lane of a :class:`SlabAllocator` (from :meth:`SlabAllocator.lane`): an :class:`Allocator`.

    ``allocate`` takes slots from the lane's own chunks; ``free`` and
    ``stats`` are the parent's (a lane's buffer may be freed through the
    parent or any of its lanes; ``stats`` covers every lane).
    """

    __slots__ = ("parent", "index")

    def __init__(self, parent: SlabAllocator, index: int) -> None:
        self.parent = parent
        self.index = index

    def allocate(self, nbytes: int, alignment: int = 64) -> SlabBuffer:
        """Lease ``nbytes`` bytes at ``alignment`` from this lane's chunks (see :meth:`SlabAllocator.allocate`)."""
        return self.parent._allocate(nbytes, alignment, self.index)

    def free(self, buffer: Buffer) -> None:
        """The parent's :meth:`SlabAllocator.free`."""
        self.parent.free(buffer)

    def stats(self) -> AllocatorStats:
        """The parent's :meth:`SlabAllocator.stats` (all lanes)."""
        return self.parent.stats()

    def __repr__(self) -> str:
        return f"SlabLane({self.index} of {self.parent!r})"
