"""Page ids of a paged cache: reference counts, the free list and the audit.

A :class:`BlockPool` hands out page ids, one id for every plane of the
model (see :mod:`onnxkv.cache.paged`), and counts the references page tables
hold to them; the counts and the free list live in
:mod:`onnxkv.cache._pagecore` (Cython, flat int32 arrays, GIL-free inner
functions).  What an id holds -- a payload per plane, its address, format
and size, and format conversion -- is its
:class:`~onnxkv.cache.plane_payloads.PlanePayloads` (``pool.payloads``):
the pool only asks it for native payloads when ids are handed out and
returns them when an id's count drops to 0.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from onnxkv.alloc import SlabAllocator, as_allocator
from onnxkv.alloc.checked import release
from onnxkv.cache._pagecore import PageCore
from onnxkv.cache.plane_payloads import PlanePayloads, PlaneSpec
from onnxkv.errors import InputError, OutOfMemory, StateError

__all__ = ["PlaneSpec", "BlockPool", "live_pools", "MAX_PAGE_IDS"]

#: Page ids live at once at most: block tables hold them as int32.
MAX_PAGE_IDS = 2**31 - 1
#: Ids a failed allocation gives back per call (each call's result array is that small).
_UNDO_CHUNK = 1 << 12

_pools: weakref.WeakSet = weakref.WeakSet()

#: The payload records and calls of :class:`PlanePayloads` a pool answers for (``pool.X`` is ``pool.payloads.X``).
_PAYLOAD_API = (
    "pages",
    "ptrs",
    "formats",
    "converted",
    "sizes",
    "allocators",
    "committed_bytes",
    "pages_bytes",
    "native_pages",
    "quantized",
    "read_page",
    "copy_page",
    "build_payload",
    "install_payload",
    "discard_payload",
    "convert_page",
)


def live_pools() -> list[BlockPool]:
    """Every :class:`BlockPool` still alive (for audits)."""
    return list(_pools)


#: Native payloads of freed pages each plane of a BlockPool keeps for its next pages by default.
SPARE_PAGES = 4


class BlockPool:
    """Page ids of ``block_size`` tokens for every plane, reference counted.

    Args:
        planes: the planes every page id holds a payload for.
        block_size: tokens per page (>= 1).
        allocator: persistent allocator the payloads come from (None: a new
            :class:`~onnxkv.alloc.SlabAllocator`).  A ``SlabAllocator``
            serves each plane from its lane ``plane index``
            (``allocators[i]`` is ``allocator.lane(i)``); any other
            allocator serves every plane itself.
        max_pages: at most this many page ids live at once (None: unbounded).
        spare_pages: native payloads of freed pages each plane keeps for its next pages (default
            :data:`SPARE_PAGES`; 0: every freed payload goes back to the
            allocator at once).  A decode step that copies a page on write and frees another (a beam
            search's) then leases nothing; ``spare_bytes`` counts them, and they go back when the pool
            holds no page.

    ``allocator`` is the pool's allocator (its ``stats`` cover every
    plane).  ``payloads`` owns every page's payloads; the pool answers for
    its records and calls (``pages``, ``ptrs``, ``formats``, ``converted``,
    ``sizes``, ``allocators``, ``committed_bytes``, ``pages_bytes``,
    ``quantized``, ``read_page``, ``copy_page``, ``build_payload``,
    ``install_payload``, ``discard_payload``, ``convert_page``: see
    :class:`~onnxkv.cache.plane_payloads.PlanePayloads`).

    Ownership: page tables (:class:`~onnxkv.cache.page_table.PageTable`)
    hold references; a page's payload may be written only by a holder of
    its only reference.  Calls are serialised by an internal lock, which the
    payloads share.
    """

    def __init__(
        self,
        planes: list[PlaneSpec],
        block_size: int = 16,
        allocator=None,
        max_pages: int | None = None,
        spare_pages: int = SPARE_PAGES,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
            raise InputError(f"BlockPool: block_size must be a positive int, got {block_size!r}")
        if max_pages is not None and (
            isinstance(max_pages, bool) or not isinstance(max_pages, (int, np.integer)) or max_pages < 1
        ):
            raise InputError(f"BlockPool: max_pages must be None or a positive int, got {max_pages!r}")
        if not planes:
            raise InputError("BlockPool: at least one plane is needed")
        if isinstance(spare_pages, bool) or not isinstance(spare_pages, (int, np.integer)) or spare_pages < 0:
            raise InputError(f"BlockPool: spare_pages must be an int >= 0, got {spare_pages!r}")
        self._lock = threading.RLock()
        self.block_size = int(block_size)
        self.allocator = SlabAllocator() if allocator is None else as_allocator(allocator)
        self.payloads = PlanePayloads(planes, self.block_size, self.allocator, self._lock, spare_pages=int(spare_pages))
        self.planes = self.payloads.planes
        self.plane_index = {p.name: i for i, p in enumerate(self.planes)}
        self.max_pages = None if max_pages is None else int(max_pages)
        #: Payload bytes the live pages may hold at most (None: no bound), checked when ids are handed
        #: out (a native page's bytes each): pages converted to smaller formats make room under it.  Set
        #: between runs (an engine's cache budget).
        self.max_bytes: int | None = None
        self.core = PageCore(64 if max_pages is None else min(64, int(max_pages)), self.max_pages)
        self._holders: weakref.WeakSet = weakref.WeakSet()
        self.payloads.grow(self.core.capacity)
        _pools.add(self)

    # -- geometry ------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of one native page id over all planes."""
        return sum(p.page_bytes(self.block_size) for p in self.planes)

    @property
    def live_pages(self) -> int:
        return self.core.live_pages

    @property
    def spare_bytes(self) -> int:
        """Bytes of the spare payloads the planes keep (leased from the allocator, held by no page)."""
        with self._lock:
            return self.payloads.spares.nbytes

    @property
    def free_pages(self) -> int:
        """Page ids that can still be handed out (for max_pages=None: before the id table grows)."""
        return self.core.free_pages

    def refcount(self, page: int) -> int:
        return int(self.core.refs()[page])

    def check_room(self, n: int, api: str) -> None:
        """Raise :class:`~onnxkv.errors.OutOfMemory` naming ``api``, with nothing allocated, unless ``n`` more
        pages may be live at once: within ``max_pages`` (else within :data:`MAX_PAGE_IDS`) and ``max_bytes``.
        Callers check before they size tables by ``n``; whether the allocator has the memory is known only
        when :meth:`allocate` asks it."""
        free = self.free_pages if self.max_pages is not None else MAX_PAGE_IDS - self.live_pages
        if n > free:
            limit = f"max_pages={self.max_pages}" if self.max_pages is not None else "the int32 page ids"
            raise OutOfMemory(
                f"{api}: {n} page(s) needed but only {free} of {limit} are free (block_size={self.block_size})"
            )
        held = self.payloads.committed_bytes if self.max_bytes is not None else 0
        if self.max_bytes is not None and held + n * self.page_bytes > self.max_bytes:
            raise OutOfMemory(
                f"{api}: {n} page(s) of {self.page_bytes} bytes needed but the pages hold {held} of "
                f"max_bytes={self.max_bytes}"
            )

    # -- references ------------------------------------------------------------
    def allocate(self, n: int) -> np.ndarray:
        """Hand out ``n`` fresh page ids (one reference each), native payloads allocated.

        Every payload is a spare of a freed page (:class:`PlanePayloads`) or
        leased through :func:`onnxkv.alloc.checked.lease` (checked before
        anything writes to it); its bytes are not cleared.  Raises
        :class:`~onnxkv.errors.OutOfMemory` (too few free ids, the allocator
        failed) or :class:`~onnxkv.errors.InputError` (the allocator returned
        a buffer that breaks its contract) with nothing changed.
        """
        with self._lock:
            self.payloads.end_batch()
            self.check_room(int(n), "BlockPool")  # under the lock: reserve then finds the ids free
            try:
                ids = self.core.reserve(int(n))
            except MemoryError as e:  # its id arrays could not grow (nothing reserved)
                raise OutOfMemory(f"BlockPool: no memory for the ids of {n} page(s)") from e
            try:
                self.payloads.grow(self.core.capacity)
                self.payloads.lease_pages(ids)
            except BaseException as e:
                for i in range(0, ids.size, _UNDO_CHUNK):  # memory may have run out: no array of ids.size
                    self.core.decref(ids[i : i + _UNDO_CHUNK])
                if isinstance(e, MemoryError) and not isinstance(e, OutOfMemory):  # NumPy's, or the lists'
                    raise OutOfMemory(f"BlockPool: no memory for the records of {n} page(s)") from e
                raise
            return ids

    def incref(self, ids: np.ndarray) -> None:
        """One more reference to every id >= 0 (ids must be live)."""
        with self._lock:
            self.payloads.end_batch()
            self.core.incref(ids)

    def decref(self, ids: np.ndarray) -> int:
        """Drop one reference per id >= 0; free payloads reaching 0 (a few native ones stay spares for the
        next pages, until the pool holds no page); return pages freed.

        The pool forgets the freed pages first, then frees their payloads: a
        ``free`` that raises is logged and the rest are still freed (the
        references are gone whatever the allocator does; see
        :mod:`onnxkv.alloc.protocol`).
        """
        with self._lock:
            self.payloads.end_batch()
            freed = self.core.decref(ids)
            bufs = self.payloads.forget_pages(freed)
            if not self.core.live_pages:  # nothing left: the spare payloads go back too
                bufs += self.payloads.spares.drop()
        if bufs:
            release(self.allocator, bufs, "BlockPool")
        return len(freed)

    # -- audit ---------------------------------------------------------------
    def register(self, holder) -> None:
        """Count ``holder`` among the reference holders audited: anything with ``held_ids()`` (the ids it
        holds a reference to, with repeats) and ``written_ids()`` (each page it holds and how many of its
        positions were written: a page table, the engine's prefix cache)."""
        self._holders.add(holder)

    def written(self, ids: np.ndarray) -> np.ndarray:
        """int64 [len(ids)]: the most positions any holder says were written in each page of ``ids`` (0 for
        a page no holder has written): what a new row may claim it holds (``State.start_on_pages``)."""
        with self._lock:
            most = np.zeros(self.core.capacity, np.int64)
            for holder in list(self._holders):
                held, positions = holder.written_ids()
                np.maximum.at(most, held, positions)
            return most[ids]

    def audit(self) -> None:
        """Check the pool is whole: counts equal live holders' references, payloads exactly on live ids.

        Raises :class:`~onnxkv.errors.StateError` naming the first mismatch.
        """
        with self._lock:
            refs = self.core.refs()
            held = [h.held_ids() for h in list(self._holders)]
            ids = np.concatenate(held) if held else np.zeros(0, np.int32)
            want = np.bincount(ids, minlength=len(refs)) if ids.size else np.zeros(len(refs), np.int64)
            bad = np.flatnonzero(want != refs)
            if bad.size:
                p = int(bad[0])
                raise StateError(
                    f"BlockPool.audit: page {p} has {int(refs[p])} reference(s) but live page tables "
                    f"hold {int(want[p])} ({bad.size} page(s) differ)"
                )
            self.payloads.check(refs)
            if self.core.live_pages != int((refs > 0).sum()):
                raise StateError(
                    f"BlockPool.audit: {self.core.live_pages} live ids but {int((refs > 0).sum())} referenced pages"
                )


def _answer(name: str) -> property:
    return property(lambda self: getattr(self.payloads, name), doc=f"``payloads.{name}`` (:class:`PlanePayloads`).")


for _name in _PAYLOAD_API:
    setattr(BlockPool, _name, _answer(_name))
