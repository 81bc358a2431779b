"""Paged KV cache: a reference-counted page pool, page tables and copy-on-write.

Layout.  A cache is split into *planes*, one per past input a state binds
(the keys of layer 0, the values of layer 0, ...).  Physical page ``p`` is one
page id for the whole model: it owns one payload of ``[kv_heads, block_size,
head_size]`` elements per plane (head-major: one KV head's tokens are
contiguous), each allocated separately from the pool's allocator when the id
is handed out and returned to it when the id's reference count drops to 0.
By default the allocator is a :class:`~onnxkv.alloc.SlabAllocator` and each
plane allocates from a lane of its own, so the pages of one plane that are
allocated one after another (a sequence's logical blocks, as decode appends
them) are adjacent in huge-page backed chunks.
``BlockPool.ptrs[plane]`` holds the payload addresses by page id (0 when
free); the paged attention kernel reads pages through them.

A :class:`PageTable` holds, for a batch of sequences (rows), ``tables`` int32
``[B, M]`` (logical block ``i`` of row ``b`` covers tokens ``[i*bs, (i+1)*bs)``;
-1 = no page: never written, or evicted by a sliding window) and ``lengths``
int64 ``[B]``.  Every page id in a table holds one reference.  States,
forks and checkpoints are page tables: forking, reordering, checkpointing and
truncating change tables and reference counts only (no payload byte moves).

Writes (:class:`PagedCache`).  A run stages a private copy of the committed
table.  Before the first byte of a run is written, every logical block the
run writes gets a page it owns alone: a fresh page where there was none, a
copy of the shared page (that page only, its valid tokens only, counted as
``cow_copied_bytes``) where the page is referenced elsewhere.  All pages come
from one :meth:`BlockPool.allocate` call, so pool exhaustion raises
:class:`~onnxkv.errors.OutOfMemory` before anything is written.  Commit
publishes the staged table and drops the replaced pages' references;
discard frees the run's new pages: the committed table never changed.  A
write into committed positions of a page the state kept (a static cache's
slots, or positions below a row's length) first saves the bytes it replaces
(O(new tokens)); discard writes them back.

A static (TensorScatter) cache (``static_length``: its fixed capacity, the
whole past the model reads) keeps as each row's length the high-water mark
of the positions written so far.

Rows are bounded by what they wrote: a write starting past a row's
committed length (a claimed past the row never wrote) raises
:class:`~onnxkv.errors.InputError` before anything is staged (static caches,
whose unwritten positions read as zeros, excepted).  As defence in
depth every page a run stages is zero-filled before its copy or write (one
fill per page, never per token), so bytes an earlier request left in the
allocator's memory are never readable.

The reference counts and free list live in :mod:`onnxkv.cache._pagecore`
(Cython, flat int32 arrays, GIL-free inner functions).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import numpy as np

from onnxkv import _kernels
from onnxkv.alloc import SlabAllocator, as_allocator
from onnxkv.alloc.checked import forget, lease, release
from onnxkv.cache import formats
from onnxkv.cache._pagecore import PageCore
from onnxkv.cache.contiguous import WriteCost, rows_past, stored_to_float32
from onnxkv.errors import CacheCapacityError, InputError, OutOfMemory, StateError

__all__ = ["PlaneSpec", "BlockPool", "PageTable", "PagedCache", "PagedPlane", "live_pools"]

_STORAGE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16)}
#: ONNX element type codes of the native (float) storages.
_NATIVE_CODE = {"float32": 1, "float16": 10, "bfloat16": 16}
_pools: weakref.WeakSet = weakref.WeakSet()


def live_pools() -> list[BlockPool]:
    """Every :class:`BlockPool` still alive (for audits)."""
    return list(_pools)


@dataclass(frozen=True)
class PlaneSpec:
    """One plane of a paged cache: the past input it feeds and its page geometry.

    ``storage`` is the native stored element type ("float32", "float16" or
    "bfloat16"; bfloat16 is held as uint16 bit patterns) in which pages are
    written; full pages may be converted to other formats later (see
    :meth:`BlockPool.convert_page`).  ``model_dtype`` is the element type the
    model feeds and reads.  ``groups`` and ``header`` give the layout of the
    plane's quantized pages (:mod:`onnxkv.cache.formats`), one of: groups 1
    with header "float32" (one scale per head); groups head_size with header
    "compact" (a scale and zero point per channel, head_size <= 512: KIVI
    keys); groups head_size with header "channel-zp" (one scale per head, a
    zero point per channel).  :class:`BlockPool` rejects other pairs.
    """

    name: str
    heads: int
    head_size: int
    storage: str
    model_dtype: str = "float32"
    #: Scale groups of quantized pages: 1 (one scale per head) or head_size (per channel, for keys).
    groups: int = 1
    #: Header kind of the plane's quantized pages: "float32", "compact" or "channel-zp".
    header: str = formats.HEADER_FLOAT32

    @property
    def dtype(self) -> np.dtype:
        return _STORAGE[self.storage]

    def page_bytes(self, block_size: int) -> int:
        return self.heads * block_size * self.head_size * self.dtype.itemsize


class BlockPool:
    """Pages of ``block_size`` tokens for every plane, reference counted.

    Args:
        planes: the planes every page id holds a payload for.
        block_size: tokens per page (>= 1).
        allocator: persistent allocator the payloads come from (None: a new
            :class:`~onnxkv.alloc.SlabAllocator`).  A ``SlabAllocator``
            serves each plane from its lane ``plane index``
            (``allocators[i]`` is ``allocator.lane(i)``); any other
            allocator serves every plane itself.
        max_pages: at most this many page ids live at once (None: unbounded).

    ``allocator`` is the pool's allocator (its ``stats`` cover every
    plane); ``allocators[i]`` is what plane ``i``'s payloads are allocated
    from (native, converted and restored pages alike); any of them frees
    any payload of the pool.

    Ownership: page tables (:class:`PageTable`) hold references; a page's
    payload may be written only by a holder of its only reference.  Calls
    are serialised by an internal lock.
    """

    def __init__(self, planes: list[PlaneSpec], block_size: int = 16, allocator=None,
                 max_pages: int | None = None) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
            raise InputError(f"BlockPool: block_size must be a positive int, got {block_size!r}")
        if max_pages is not None and (isinstance(max_pages, bool) or not isinstance(max_pages, (int, np.integer))
                                      or max_pages < 1):
            raise InputError(f"BlockPool: max_pages must be None or a positive int, got {max_pages!r}")
        if not planes:
            raise InputError("BlockPool: at least one plane is needed")
        for p in planes:
            if p.storage not in _STORAGE:
                raise InputError(f"BlockPool: plane '{p.name}' storage must be one of {sorted(_STORAGE)}, "
                                 f"got {p.storage!r}")
            if p.groups not in (1, p.head_size):
                raise InputError(f"BlockPool: plane '{p.name}' groups must be 1 or its head_size {p.head_size}, "
                                 f"got {p.groups!r}")
            if p.header not in formats.HEADERS:
                raise InputError(f"BlockPool: plane '{p.name}' header must be one of {list(formats.HEADERS)}, "
                                 f"got {p.header!r}")
            want = 1 if p.header == formats.HEADER_FLOAT32 else p.head_size
            if p.groups != want:
                raise InputError(f"BlockPool: plane '{p.name}' with header {p.header!r} needs groups {want} "
                                 f"({'one scale per head' if want == 1 else 'one group per channel'}), got {p.groups}")
            if p.header == formats.HEADER_COMPACT and p.groups > formats.COMPACT_MAX_GROUPS:
                raise InputError(f"BlockPool: plane '{p.name}' has per-channel scales over head_size {p.head_size}; "
                                 f"their compact page headers hold at most {formats.COMPACT_MAX_GROUPS} channels "
                                 "(key_channel_scales needs head_size <= 512)")
        self.planes = list(planes)
        self.plane_index = {p.name: i for i, p in enumerate(self.planes)}
        self.block_size = int(block_size)
        self.allocator = SlabAllocator() if allocator is None else as_allocator(allocator)
        self.allocators = ([self.allocator.lane(i) for i in range(len(self.planes))]
                           if isinstance(self.allocator, SlabAllocator) else [self.allocator] * len(self.planes))
        self.max_pages = None if max_pages is None else int(max_pages)
        self.core = PageCore(64 if max_pages is None else min(64, int(max_pages)), self.max_pages)
        self._bufs: list[list] = [[] for _ in self.planes]
        self.pages: list[list] = [[] for _ in self.planes]
        self.ptrs: list[np.ndarray] = [np.zeros(0, np.uint64) for _ in self.planes]
        #: Per plane, the ONNX element code of each page id's payload (the native code while free: the
        #: attention kernel validates the whole table); see onnxkv.cache.formats.
        self.formats: list[np.ndarray] = [np.zeros(0, np.uint8) for _ in self.planes]
        #: Per plane, how many live pages are not in the native format (0: the kernel reads plain pages).
        self.converted: list[int] = [0 for _ in self.planes]
        #: Per plane, the payload bytes of each live page (0: free).
        self.sizes: list[np.ndarray] = [np.zeros(0, np.int64) for _ in self.planes]
        self._holders: weakref.WeakSet = weakref.WeakSet()
        #: id(buffer) -> buffer of each payload build_payload handed out and nobody installed or discarded yet.
        self._built: dict[int, object] = {}
        self._lock = threading.RLock()
        self._sync_capacity()
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
    def free_pages(self) -> int:
        """Page ids that can still be handed out (for max_pages=None: before the id table grows)."""
        return self.core.free_pages

    @property
    def committed_bytes(self) -> int:
        """Bytes of payload held by live pages (each in its own format)."""
        return int(sum(int(s.sum()) for s in self.sizes))

    def pages_bytes(self, ids: np.ndarray) -> int:
        """Payload bytes of the distinct live pages ``ids`` over all planes."""
        u = np.unique(ids[ids >= 0])
        return int(sum(int(s[u].sum()) for s in self.sizes))

    def refcount(self, page: int) -> int:
        return int(self.core.refs()[page])

    def _sync_capacity(self) -> None:
        cap = self.core.capacity
        for i in range(len(self.planes)):
            grow = cap - len(self.pages[i])
            if grow > 0:
                self._bufs[i].extend([None] * grow)
                self.pages[i].extend([None] * grow)
                ptrs = np.zeros(cap, np.uint64)
                ptrs[: len(self.ptrs[i])] = self.ptrs[i]
                self.ptrs[i] = ptrs
                fmts = np.full(cap, _NATIVE_CODE[self.planes[i].storage], np.uint8)
                fmts[: len(self.formats[i])] = self.formats[i]
                self.formats[i] = fmts
                sizes = np.zeros(cap, np.int64)
                sizes[: len(self.sizes[i])] = self.sizes[i]
                self.sizes[i] = sizes

    # -- references ------------------------------------------------------------
    def allocate(self, n: int) -> np.ndarray:
        """Hand out ``n`` fresh page ids (one reference each), native payloads allocated.

        Every payload is leased through :func:`onnxkv.alloc.checked.lease`
        (checked before anything writes to it).  Raises
        :class:`~onnxkv.errors.OutOfMemory` (too few free ids, the allocator
        failed) or :class:`~onnxkv.errors.InputError` (the allocator returned
        a buffer that breaks its contract) with nothing changed.
        """
        with self._lock:
            self._end_batch()
            ids = self.core.reserve(int(n))
            if ids is None:
                raise OutOfMemory(f"BlockPool: {n} page(s) needed but only {self.core.free_pages} of "
                                  f"max_pages={self.max_pages} are free (block_size={self.block_size})")
            self._sync_capacity()
            done: list[tuple[int, int]] = []
            try:
                for p in ids.tolist():
                    for i, spec in enumerate(self.planes):
                        buf, arr = self._lease_native(i)
                        self._hold(i, p, buf, arr, _NATIVE_CODE[spec.storage])
                        done.append((i, p))
            except BaseException:
                bufs = [self._forget(i, p) for i, p in done]
                self.core.decref(ids)
                release(self.allocator, bufs, "BlockPool")
                raise
            return ids

    def _lease_native(self, i: int):
        """(buffer, array [H, bs, D] of the plane's dtype): a native payload of plane ``i``, checked."""
        spec = self.planes[i]
        return lease(self.allocators[i], spec.page_bytes(self.block_size), 64, spec.dtype,
                     (spec.heads, self.block_size, spec.head_size), f"BlockPool: plane '{spec.name}'")

    def _hold(self, i: int, p: int, buf, arr: np.ndarray, code: int) -> None:
        """Make ``buf`` / ``arr`` the payload of page ``p`` in plane ``i``, format ``code`` (cannot fail)."""
        self._bufs[i][p], self.pages[i][p] = buf, arr
        self.ptrs[i][p] = arr.__array_interface__["data"][0]
        self.converted[i] -= self.quantized(i, p)
        self.formats[i][p] = code
        self.converted[i] += self.quantized(i, p)
        self.sizes[i][p] = arr.nbytes

    def _forget(self, i: int, p: int):
        """Clear every record of page ``p``'s payload in plane ``i``; return its buffer (for the caller to free)."""
        buf = self._bufs[i][p]
        self._bufs[i][p] = self.pages[i][p] = None
        self.ptrs[i][p] = 0
        if self.quantized(i, p):
            self.converted[i] -= 1
        self.formats[i][p] = _NATIVE_CODE[self.planes[i].storage]
        self.sizes[i][p] = 0
        return buf

    def _end_batch(self) -> None:
        """Forget the payloads :meth:`build_payload` handed out that were neither installed nor discarded
        (their builder freed them itself): they leave the ownership index."""
        if self._built:
            forget(self.allocator, self._built.values())
            self._built.clear()

    def incref(self, ids: np.ndarray) -> None:
        """One more reference to every id >= 0 (ids must be live)."""
        with self._lock:
            self._end_batch()
            self.core.incref(ids)

    def decref(self, ids: np.ndarray) -> int:
        """Drop one reference per id >= 0; free payloads reaching 0; return pages freed.

        The pool forgets the freed pages first, then frees their payloads: a
        ``free`` that raises is logged and the rest are still freed (the
        references are gone whatever the allocator does; see
        :mod:`onnxkv.alloc.protocol`).
        """
        with self._lock:
            self._end_batch()
            freed = self.core.decref(ids)
            bufs = [self._forget(i, p) for p in freed.tolist() for i in range(len(self.planes))]
        release(self.allocator, bufs, "BlockPool")
        return len(freed)

    def copy_page(self, src: int, dst: int, tokens: int) -> int:
        """Copy the first ``tokens`` positions of every head of page ``src`` into ``dst`` (all planes).

        ``dst`` is a native page held exclusively by the caller; a quantized
        ``src`` plane is dequantized into it.  Returns the bytes read.
        """
        if tokens <= 0:
            return 0
        n = 0
        for i, spec in enumerate(self.planes):
            b = self.pages[i][dst]
            if self.quantized(i, src):
                b[:, :tokens] = self._native(spec, self.read_page(i, src, tokens))
                n += self.pages[i][src].nbytes
            else:
                a = self.pages[i][src]
                b[:, :tokens] = a[:, :tokens]
                n += a[:, :tokens].nbytes
        return n

    # -- page formats ------------------------------------------------------------
    def quantized(self, plane: int, page: int) -> bool:
        """True if the payload of ``page`` in ``plane`` is not the plane's native type."""
        return int(self.formats[plane][page]) != _NATIVE_CODE[self.planes[plane].storage]

    @staticmethod
    def _native(spec: PlaneSpec, x: np.ndarray) -> np.ndarray:
        if spec.storage == "bfloat16":
            out = np.empty(x.shape, np.uint16)
            _kernels.f32_to_bf16(np.ascontiguousarray(x, dtype=np.float32), out)
            return out
        return x.astype(spec.dtype, copy=False)

    def read_page(self, plane: int, page: int, tokens: int) -> np.ndarray:
        """Float32 ``[H, tokens, D]`` of ``page`` in ``plane``, whatever its format."""
        spec = self.planes[plane]
        arr = self.pages[plane][page]
        code = int(self.formats[plane][page])
        if not self.quantized(plane, page):
            return stored_to_float32(arr[:, :tokens], spec.storage)
        fmt = formats.page_format(code)
        if fmt.is_float:
            n = spec.heads * self.block_size * spec.head_size
            typed = arr[: n * fmt.dtype.itemsize].view(fmt.dtype).reshape(spec.heads, self.block_size, spec.head_size)
            return stored_to_float32(typed[:, :tokens], fmt.name)
        out = np.empty((spec.heads, tokens, spec.head_size), np.float32)
        _kernels.dequantize_page(arr, code, spec.heads, self.block_size, spec.head_size, spec.groups, tokens, out,
                                 spec.header)
        return out

    def build_payload(self, plane: int, page: int, fmt_name: str, tokens: int):
        """A new payload holding the first ``tokens`` positions of ``page`` in ``fmt_name``: (buffer, array).

        The plane's native format gives a native page (``[H, bs, D]`` of the
        plane's dtype, positions past ``tokens`` zero), or ``(None, None)`` --
        nothing allocated -- when the page already is native.  Nothing is
        installed: :meth:`install_payload` swaps it in, :meth:`discard_payload`
        gives it back (a payload that is neither installed nor discarded
        -- its builder freed it -- leaves the ownership index of
        :mod:`onnxkv.alloc.checked` at the pool's next other call).
        Raises :class:`~onnxkv.errors.OutOfMemory` or
        :class:`~onnxkv.errors.InputError` when the allocator fails (see
        :func:`onnxkv.alloc.checked.lease`), with nothing allocated.
        """
        spec = self.planes[plane]
        fmt = formats.page_format(fmt_name)
        bs = self.block_size
        native = fmt.name == spec.storage
        if native and not self.quantized(plane, page):
            return None, None
        x = self.read_page(plane, page, tokens)
        if native:
            buf, arr = self._lease_native(plane)
        else:
            nbytes = formats.page_bytes(fmt, spec.heads, bs, spec.head_size, spec.groups, spec.header)
            buf, arr = formats.allocate_payload(self.allocators[plane], fmt, nbytes, f"BlockPool: plane '{spec.name}'")
        with self._lock:
            self._built[id(buf)] = buf
        try:
            self._encode(spec, fmt, x, arr)
        except BaseException:
            self.discard_payload(buf)
            raise
        return buf, arr

    def _encode(self, spec: PlaneSpec, fmt: formats.PageFormat, x: np.ndarray, arr: np.ndarray) -> None:
        """Write float32 ``x`` [H, tokens, D] into the new payload ``arr`` of format ``fmt`` (a native page
        [H, bs, D], else uint8 bytes); float positions past ``tokens`` are zero."""
        bs, tokens = self.block_size, x.shape[1]
        if fmt.is_float:
            shape = (spec.heads, bs, spec.head_size)
            typed = arr if arr.ndim == 3 else arr[: int(np.prod(shape)) * fmt.dtype.itemsize].view(fmt.dtype).reshape(shape)
            typed[:, :tokens] = self._native(PlaneSpec(spec.name, spec.heads, spec.head_size, fmt.name), x)
            typed[:, tokens:] = 0
        elif spec.header == formats.HEADER_COMPACT:
            scale, zero, header = formats.compact_params(x, fmt)
            _kernels.quantize_page(x, fmt.code, scale, zero, spec.groups, arr, bs, header=header)
        elif spec.header == formats.HEADER_CHANNEL_ZP:
            scale, zero, header = formats.channel_zp_params(x, fmt)
            _kernels.quantize_page(x, fmt.code, scale, zero, spec.groups, arr, bs, header=header,
                                   header_kind=formats.HEADER_CHANNEL_ZP)
        else:
            scale, zero = formats.params_for(x, fmt, "head")
            _kernels.quantize_page(x, fmt.code, scale, zero, spec.groups, arr, bs)

    def install_payload(self, plane: int, page: int, buf, arr: np.ndarray | None, fmt_name: str) -> None:
        """Swap a payload from :meth:`build_payload` into ``page`` (held exclusively); free the old one.

        ``buf`` None (a conversion to the page's own native format) changes
        nothing.  The page's records change first; a ``free`` of the old
        payload that raises is then logged: the new payload stays published.
        """
        if buf is None:
            return
        with self._lock:
            self._built.pop(id(buf), None)
            old = self._bufs[plane][page]
            self._hold(plane, page, buf, arr, formats.page_format(fmt_name).code)
        release(self.allocator, [old], "BlockPool")

    def discard_payload(self, buf) -> None:
        """Give back a payload from :meth:`build_payload` that will not be installed (None: nothing);
        a ``free`` that raises is logged."""
        if buf is not None:
            with self._lock:
                self._built.pop(id(buf), None)
            release(self.allocator, [buf], "BlockPool")

    def convert_page(self, plane: int, page: int, fmt_name: str, tokens: int) -> None:
        """Replace the payload of an exclusively held ``page`` in ``plane`` by one in ``fmt_name`` (allocated
        once; the plane's native format on a native page: nothing happens)."""
        buf, arr = self.build_payload(plane, page, fmt_name, tokens)
        self.install_payload(plane, page, buf, arr, fmt_name)

    # -- audit ---------------------------------------------------------------
    def register(self, holder: PageTable) -> None:
        self._holders.add(holder)

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
                raise StateError(f"BlockPool.audit: page {p} has {int(refs[p])} reference(s) but live page tables "
                                 f"hold {int(want[p])} ({bad.size} page(s) differ)")
            for i in range(len(self.planes)):
                has = self.ptrs[i][: len(refs)] != 0
                if (has != (refs > 0)).any():
                    p = int(np.flatnonzero(has != (refs > 0))[0])
                    raise StateError(f"BlockPool.audit: page {p} plane '{self.planes[i].name}' payload "
                                     f"{'held' if has[p] else 'missing'} with {int(refs[p])} reference(s)")
            for i, spec in enumerate(self.planes):
                live = self.ptrs[i][: len(refs)] != 0
                n = int((live & (self.formats[i][: len(refs)] != _NATIVE_CODE[spec.storage])).sum())
                if n != self.converted[i]:
                    raise StateError(f"BlockPool.audit: plane '{spec.name}' counts {self.converted[i]} converted "
                                     f"pages but holds {n}")
            if self.core.live_pages != int((refs > 0).sum()):
                raise StateError(f"BlockPool.audit: {self.core.live_pages} live ids but "
                                 f"{int((refs > 0).sum())} referenced pages")


class PageTable:
    """Page tables and valid lengths of a batch of sequences; see the module docstring.

    ``tables`` int32 [B, M] and ``lengths`` int64 [B] are owned by this
    object; every id in ``tables`` holds one reference in ``pool``.
    ``first`` int64 [B] is the first position still held (> 0 after sliding
    window eviction).
    """

    def __init__(self, pool: BlockPool, batch: int) -> None:
        self.pool = pool
        self.tables = np.full((batch, 0), -1, np.int32)
        self.lengths = np.zeros(batch, np.int64)
        self.first = np.zeros(batch, np.int64)
        pool.register(self)

    @property
    def batch(self) -> int:
        return self.tables.shape[0]

    def held_ids(self) -> np.ndarray:
        t = self.tables
        return t[t >= 0]

    def share(self, rows: np.ndarray | None = None) -> PageTable:
        """A new table holding rows ``rows`` (default all) of this one, sharing their pages."""
        sel = np.arange(self.batch) if rows is None else np.asarray(rows, np.int64)
        out = PageTable(self.pool, len(sel))
        out.tables = self.tables[sel].copy()
        out.lengths = self.lengths[sel].copy()
        out.first = self.first[sel].copy()
        self.pool.incref(out.held_ids())
        return out

    def release(self) -> None:
        """Drop every reference (pages nobody else holds are freed)."""
        ids = self.held_ids()
        self.tables = np.full((self.batch, 0), -1, np.int32)
        self.lengths[:] = 0
        self.first[:] = 0
        self.pool.decref(ids)

    def truncate(self, length: int) -> int:
        """Keep positions ``< length`` of every row; drop pages wholly past it; return pages released."""
        bs = self.pool.block_size
        keep = -(-int(length) // bs)
        drop = self.tables[:, keep:]
        ids = drop[drop >= 0]
        self.tables = self.tables[:, :keep].copy()
        self.lengths = np.minimum(self.lengths, length)
        self.first = np.minimum(self.first, self.lengths)
        return self.pool.decref(ids) if ids.size else 0

    def evict(self, window: int) -> int:
        """Drop pages no future query can see: all tokens below ``lengths[b] - window``. Returns pages released."""
        bs = self.pool.block_size
        released = []
        for b in range(self.batch):
            lo = int(self.lengths[b]) - window  # smallest position the next query may read
            n = max(0, lo) // bs  # blocks wholly below it
            row = self.tables[b, :n]
            gone = row[row >= 0]
            if gone.size:
                released.append(gone.copy())
                row[:] = -1
            self.first[b] = max(int(self.first[b]), n * bs)
        return self.pool.decref(np.concatenate(released)) if released else 0


class PagedCache:
    """One state's paged cache: a committed :class:`PageTable` and a run's staged edits.

    Args:
        pool: the :class:`BlockPool` (shared by forks of the state).
        table: the committed table (owned).
        static_length: for static (TensorScatter) caches, the fixed length.

    A run calls :meth:`write` through the planes (:class:`PagedPlane`); the
    state then calls :meth:`commit` or :meth:`discard`.
    """

    def __init__(self, pool: BlockPool, table: PageTable, static_length: int | None = None,
                 max_tokens: int | None = None) -> None:
        self.pool = pool
        self.table = table
        self.static_length = static_length
        self.max_tokens = max_tokens
        self._staged: np.ndarray | None = None
        self._staged_lengths: np.ndarray | None = None
        self._new: list[np.ndarray] = []
        self._replaced: list[int] = []
        self._prepared: tuple | None = None
        #: (plane, page, first offset, bytes) of committed positions the run overwrote in place (see _save),
        #: and the slots the current write overwrites (see _kept_slots).
        self._saved: list[tuple[int, int, int, np.ndarray]] = []
        self._kept: list[tuple[int, int, int]] = []
        #: plane name -> the new values [B, H, S, D] the last run wrote (for format selectors); cleared by the state.
        self.last_written: dict[str, np.ndarray] = {}
        self.planes = {spec.name: PagedPlane(self, i) for i, spec in enumerate(pool.planes)}

    @property
    def tables(self) -> np.ndarray:
        """The tables the current run reads (staged if the run wrote, else committed)."""
        return self._staged if self._staged is not None else self.table.tables

    @property
    def lengths(self) -> np.ndarray:
        return self._staged_lengths if self._staged_lengths is not None else self.table.lengths

    def short_row(self, starts) -> tuple[int, int, int] | None:
        """``(row, start, committed length)`` of the first row whose start (``starts``: one int or int [B])
        passes what it has written, or None."""
        return rows_past(starts, self.table.lengths)

    # -- staging ---------------------------------------------------------------
    def prepare(self, starts: np.ndarray, s: int) -> WriteCost:
        """Give every block that rows write at ``starts[b] .. starts[b]+s-1`` a page they own alone.

        Allocates all fresh and copy-on-write pages in one pool call before
        changing anything (OutOfMemory leaves the staging as it was); new
        pages are zero-filled.  InputError, nothing staged, when a row would
        start past its committed length (except in static caches).
        """
        key = (starts.tobytes(), s)
        if key == self._prepared:  # the other planes of the same write: pages are in place
            return WriteCost()
        pool, bs = self.pool, self.pool.block_size
        short = None if self.static_length is not None else self.short_row(starts)
        if short is not None:
            raise InputError(f"paged cache: row {short[0]} would be written at position {short[1]} but has "
                             f"written only {short[2]} positions; a row may only continue from what it wrote")
        if self._staged is None:
            self._staged = self.table.tables.copy()
            self._staged_lengths = self.table.lengths.copy()
        hi = int((starts + s).max()) if s else 0
        if self.max_tokens is not None and hi > self.max_tokens:
            raise CacheCapacityError(f"paged cache: {hi} positions needed, fixed capacity is {self.max_tokens}")
        if int(starts.min(initial=0)) < 0:
            raise InputError(f"paged cache: write position {int(starts.min())} is negative")
        tables = self._staged
        need_m = -(-hi // bs)
        if need_m > tables.shape[1]:
            grown = np.full((tables.shape[0], need_m), -1, np.int32)
            grown[:, : tables.shape[1]] = tables
            tables = self._staged = grown
        with pool._lock:  # forks in other threads must not change counts between the decision and the copy
            cost = self._stage_pages(tables, starts, s, key)
        self._kept = self._kept_slots(starts, s)
        return cost

    def _stage_pages(self, tables: np.ndarray, starts: np.ndarray, s: int, key: tuple) -> WriteCost:
        pool, bs = self.pool, self.pool.block_size
        plan = []
        total = 0
        for b in range(tables.shape[0]):
            lo_blk, hi_blk = int(starts[b]) // bs, -(-(int(starts[b]) + s) // bs)
            action, n = pool.core.pages_needed(tables[b], lo_blk, hi_blk)
            converted = self._converted(tables[b, lo_blk:hi_blk], action)
            if converted.any():  # a page no longer native is written: back to a native copy first
                action[converted] = 2
                n = int(np.count_nonzero(action))
            if n:
                plan.append((b, lo_blk, action))
                total += n
        cost = WriteCost()
        if not total:
            self._prepared = key
            return cost
        ids = pool.allocate(total)  # the only step that can fail: nothing changed before it
        self._new.append(ids)
        fresh = ids.tolist()
        for pages in pool.pages:  # no byte of the memory's earlier owner stays readable
            for p in fresh:
                pages[p].fill(0)
        committed = self.table.lengths
        k = 0
        for b, lo_blk, action in plan:
            for j in np.flatnonzero(action).tolist():
                blk = lo_blk + j
                new = int(ids[k])
                k += 1
                old = int(tables[b, blk])
                if action[j] == 2:  # copy on write: this page only, its valid tokens only (a static page: whole)
                    valid = bs if self.static_length is not None else min(bs, max(0, int(committed[b]) - blk * bs))
                    cost.cow_copied_bytes += pool.copy_page(old, new, valid)
                    self._replaced.append(old)  # only committed pages are shared: drop it at commit
                elif self.static_length is not None:  # a static cache reads unwritten positions as zeros
                    for i in range(len(pool.planes)):
                        pool.pages[i][new][...] = 0
                tables[b, blk] = new
        cost.allocations += total * len(pool.planes)
        cost.allocated_bytes += total * pool.page_bytes
        self._prepared = key
        return cost

    def _converted(self, ids: np.ndarray, action: np.ndarray) -> np.ndarray:
        """Mask of the KEEP entries of ``ids`` whose page is not native in some plane."""
        pool = self.pool
        keep = (action == 0) & (ids >= 0)
        if not any(pool.converted) or not keep.any():
            return np.zeros(len(ids), bool)
        out = np.zeros(len(ids), bool)
        for i, spec in enumerate(pool.planes):
            out |= keep & (pool.formats[i][np.where(keep, ids, 0)] != _NATIVE_CODE[spec.storage])
        return out

    def write(self, plane: int, new: np.ndarray, starts, length: int) -> WriteCost:
        """Write ``new`` [B, H, S, D] at positions ``starts[b]...`` of plane ``plane``; stage lengths."""
        spec = self.pool.planes[plane]
        b, h, s, d = new.shape
        if (b, h, d) != (self.table.batch, spec.heads, spec.head_size):
            raise InputError(f"paged cache '{spec.name}': update of shape {new.shape} does not fit "
                             f"[{self.table.batch}, {spec.heads}, S, {spec.head_size}]")
        starts = np.broadcast_to(np.asarray(starts, np.int64), (b,))
        cost = self.prepare(starts, s)
        self.last_written[spec.name] = new
        if spec.storage == "bfloat16":
            src = np.ascontiguousarray(new, dtype=np.float32)
            conv = np.empty(src.shape, np.uint16)
            _kernels.f32_to_bf16(src, conv)
            new = conv
        self._save(plane)
        # every block written is native and held by this run alone (prepare), so scatter by address
        _kernels.page_write(np.ascontiguousarray(new, dtype=spec.dtype), self.pool.ptrs[plane], self._staged,
                            starts, self.pool.block_size)
        cost.append_copied_bytes += b * h * s * d * spec.dtype.itemsize
        if self.static_length is None:
            self._staged_lengths[:] = starts + s
        else:  # a static cache: the high-water mark of the positions written
            np.maximum(self._staged_lengths, starts + s, out=self._staged_lengths)
        return cost

    def _kept_slots(self, starts: np.ndarray, s: int) -> list[tuple[int, int, int]]:
        """(page, first, last offset) of the committed positions a write of ``s`` positions from ``starts``
        replaces in pages the committed table holds (``prepare`` kept them: this state alone references them).

        Committed: below a row's committed length, or any position of a static cache.  Usually none (a
        write appends); the loop runs over the rows and blocks that do overwrite.
        """
        table, bs = self.table, self.pool.block_size
        extent = table.lengths if self.static_length is None else np.full(table.batch, self.static_length)
        out = []
        for b in np.flatnonzero(starts < extent).tolist():
            lo, hi = int(starts[b]), min(int(starts[b]) + s, int(extent[b]))
            for blk in range(lo // bs, min(-(-hi // bs), table.tables.shape[1])):
                page = int(self._staged[b, blk])
                if page >= 0 and page == int(table.tables[b, blk]):
                    out.append((page, max(lo, blk * bs) - blk * bs, min(hi, (blk + 1) * bs) - blk * bs))
        return out

    def _save(self, plane: int) -> None:
        """Keep the bytes of plane ``plane`` the current write replaces in kept pages (O(new tokens));
        :meth:`discard` writes them back."""
        pages = self.pool.pages[plane]
        for page, first, last in self._kept:
            self._saved.append((plane, page, first, pages[page][:, first:last].copy()))

    def commit(self) -> None:
        """Publish the staged tables and lengths; drop references of pages replaced by copies."""
        if self._staged is None:
            return
        self.table.tables = self._staged
        self.table.lengths = self._staged_lengths
        replaced = np.array(self._replaced, np.int32)
        self._staged = self._staged_lengths = self._prepared = None
        self._new, self._replaced, self._saved, self._kept = [], [], [], []
        if replaced.size:
            self.pool.decref(replaced)

    def discard(self) -> None:
        """Forget the run: restore the committed bytes it overwrote, free its new pages; the committed
        table is untouched."""
        new, saved = self._new, self._saved
        self._staged = self._staged_lengths = self._prepared = None
        self._new, self._replaced, self._saved, self._kept = [], [], [], []
        pages = self.pool.pages
        for plane, page, first, old in reversed(saved):
            pages[plane][page][:, first:first + old.shape[1]] = old
        for ids in new:
            self.pool.decref(ids)

    # -- reads -----------------------------------------------------------------
    def gather(self, plane: int, length: int) -> np.ndarray:
        """A contiguous copy ``[B, H, length, D]`` of plane ``plane`` in its native type.

        Converted (quantized) pages are dequantized.  Positions a row does not
        hold (never written, evicted, or at and past the row's own length, for a
        static cache the high-water mark of its writes) are zero: only each
        row's valid positions are read.
        """
        pool = self.pool
        spec = pool.planes[plane]
        bs = pool.block_size
        tables, lengths = self.tables, self.lengths
        out = np.zeros((tables.shape[0], spec.heads, length, spec.head_size), spec.dtype)
        pages = pool.pages[plane]
        for b in range(tables.shape[0]):
            held = min(length, int(lengths[b]))
            for blk in range(min(tables.shape[1], -(-held // bs))):
                p = int(tables[b, blk])
                if p >= 0:
                    n = min(bs, held - blk * bs)
                    if pool.quantized(plane, p):
                        out[b, :, blk * bs: blk * bs + n] = pool._native(spec, pool.read_page(plane, p, n))
                    else:
                        out[b, :, blk * bs: blk * bs + n] = pages[p][:, :n]
        return out

    # -- page formats ----------------------------------------------------------
    def convert_full_pages(self, plane: int, fmt_name: str, residual_tokens: int = 0) -> tuple[int, int]:
        """Convert this state's full native pages of ``plane`` older than ``length - residual_tokens``.

        A page referenced only by this state's table is converted once (every
        row holding it sees the new payload).  A page also held elsewhere
        (forks, checkpoints) is first copied for this state (one copy shared
        by all its rows, counted), so other holders never see a change.
        Returns (pages converted, bytes copied for copy-on-write).  Call
        between runs, on the committed table.
        """
        pool, bs, table = self.pool, self.pool.block_size, self.table
        target = formats.page_format(fmt_name).code
        where: dict[int, list[tuple[int, int]]] = {}
        for b in range(table.batch):
            upto = min(max(0, int(table.lengths[b]) - residual_tokens) // bs, table.tables.shape[1])
            for blk in range(int(table.first[b]) // bs, upto):
                p = int(table.tables[b, blk])
                if p >= 0 and not pool.quantized(plane, p) and int(pool.formats[plane][p]) != target:
                    where.setdefault(p, []).append((b, blk))
        copied = 0
        for p, places in where.items():
            if pool.refcount(p) > len(places):  # held outside this table: give this state its own copy
                (new,) = pool.allocate(1)
                copied += pool.copy_page(p, int(new), bs)
                pool.incref(np.full(len(places) - 1, new, np.int32))
                for b, blk in places:
                    table.tables[b, blk] = new
                pool.decref(np.full(len(places), p, np.int32))
                p = int(new)
            pool.convert_page(plane, p, fmt_name, bs)
        return len(where), copied


class PagedPlane:
    """What a run's kernels see of one plane (one past input) of a :class:`PagedCache`.

    Same write protocol as :class:`~onnxkv.cache.contiguous.CacheTensor`
    (``write``/``commit``/``discard``), plus the page addresses and tables
    the paged attention kernel reads.
    """

    paged = True

    def __init__(self, cache: PagedCache, index: int) -> None:
        self.cache = cache
        self.index = index
        self.spec = cache.pool.planes[index]
        self.name = self.spec.name
        self.storage = self.spec.storage
        self.heads = self.spec.heads
        self.head_size = self.spec.head_size

    @property
    def batch(self) -> int:
        return self.cache.table.batch

    @property
    def length(self) -> int:
        lengths = self.cache.lengths
        return int(lengths.max()) if lengths.size else 0

    @property
    def lengths(self) -> np.ndarray:
        """Committed positions of each row (int64 [B]: what each row wrote before this run), as
        :attr:`CacheTensor.lengths <onnxkv.cache.contiguous.CacheTensor.lengths>`; read only."""
        return self.cache.table.lengths

    def short_row(self, starts) -> tuple[int, int, int] | None:
        """:meth:`PagedCache.short_row`."""
        return self.cache.short_row(starts)

    @property
    def block_size(self) -> int:
        return self.cache.pool.block_size

    @property
    def ptrs(self) -> np.ndarray:
        return self.cache.pool.ptrs[self.index]

    @property
    def tables(self) -> np.ndarray:
        return self.cache.tables

    @property
    def formats(self) -> np.ndarray | None:
        """ONNX element code of each page id's payload in this plane (uint8 [pool capacity]),
        or None while every page is native (the kernel then skips per-page dispatch)."""
        pool = self.cache.pool
        return pool.formats[self.index] if pool.converted[self.index] else None

    @property
    def groups(self) -> int:
        return self.spec.groups

    @property
    def header(self) -> str:
        """Header kind of this plane's quantized pages ("float32", "compact" or "channel-zp";
        :attr:`PlaneSpec.header`)."""
        return self.spec.header

    def write(self, new: np.ndarray, starts, length: int) -> WriteCost:
        return self.cache.write(self.index, new, starts, length)

    def placeholder(self, length: int) -> np.ndarray:
        """A zero-byte stand-in of the present/past value ``[B, H, length, D]`` (nothing may read it)."""
        zero = np.zeros((), np.dtype(self.spec.model_dtype))
        return np.broadcast_to(zero, (self.batch, self.heads, int(length), self.head_size))

    def gather(self, length: int | None = None) -> np.ndarray:
        """A contiguous copy of the valid cache in the stored type (the price of a tensor consumer)."""
        return self.cache.gather(self.index, self.length if length is None else int(length))

    def as_float32(self, length: int | None = None) -> np.ndarray:
        """A float32 copy of :meth:`gather` (converting from the stored format)."""
        return stored_to_float32(self.gather(length), self.storage)

    def commit(self) -> None:
        self.cache.commit()

    def discard(self) -> None:
        self.cache.discard()
