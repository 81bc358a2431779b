"""The payloads of a paged cache's page ids: bytes, addresses, formats and conversion.

A :class:`~onnxkv.cache.block_pool.BlockPool` hands out page ids and counts
their references; a :class:`PlanePayloads` owns what each live id holds in
every plane (one past input: a layer's keys or its values): the payload
buffer and its array, the address the paged attention kernel reads
(``ptrs``), the payload's format (``formats``, an ONNX element code, see
:mod:`onnxkv.cache.formats`) and its size (``sizes``).  A native page is
``[heads, block_size, head_size]`` of the plane's stored type; a converted
page is bytes (a float page of another float type, or a quantized page:
header, then codes).  A page's payload never changes format in place:
conversion builds a new payload (:meth:`PlanePayloads.build_payload`) and
swaps it in (:meth:`PlanePayloads.install_payload`).

Two owners use it.  A :class:`~onnxkv.cache.block_pool.BlockPool` (the
states' paged caches): every live id holds a leased payload per plane, the
plane layouts (``groups``, ``header``) are fixed.  A
:class:`~onnxkv.cache.page_set.PageSet` (the explicit paged graph form):
every page id is live for the life of its page tensor, a page in the
tensor's type is *lent* -- its record is the address of the tensor's slot,
with no array and no buffer (size 0), read and written by the PageSet --
and a converted page holds a payload from here; the layout of a plane's
quantized pages follows the parameters its conversions are given
(:meth:`PlanePayloads.set_layout`, :class:`PageParams`), and a staged
conversion swaps records without freeing (:meth:`PlanePayloads.swap`).

Who may write: a page's bytes only through a holder of the page's only
reference (the pool's rule; a PageSet holds every page alone); the records
here only through the owner (ids handed out and freed, pages lent) and the
conversion calls below, under the owner's lock.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from onnxkv import _kernels
from onnxkv.alloc import SlabAllocator
from onnxkv.alloc.checked import forget, lease, release
from onnxkv.cache import formats
from onnxkv.cache.contiguous import stored_to_float32
from onnxkv.cache.plane_spec import NATIVE_CODE, STORAGE, PageParams, PlaneSpec
from onnxkv.cache.spare_payloads import SparePayloads
from onnxkv.errors import StateError

__all__ = ["PlaneSpec", "PageParams", "PlanePayloads", "STORAGE", "NATIVE_CODE", "float_view", "payload_values"]


def float_view(payload: np.ndarray, fmt: formats.PageFormat, heads: int, block_size: int, head_size: int) -> np.ndarray:
    """The elements ``[heads, block_size, head_size]`` (the storage dtype of float format ``fmt``) of a
    converted float page's payload bytes ``payload`` (a view: writing it writes the payload)."""
    n = heads * block_size * head_size
    return payload[: n * fmt.dtype.itemsize].view(fmt.dtype).reshape(heads, block_size, head_size)


def payload_values(
    payload: np.ndarray,
    fmt: formats.PageFormat,
    heads: int,
    block_size: int,
    head_size: int,
    groups: int,
    header: str,
    tokens: int,
) -> np.ndarray:
    """Float32 ``[heads, tokens, head_size]``: the first ``tokens`` positions of a converted page's payload
    bytes in format ``fmt`` (a float format, or a quantized one with ``groups`` scale groups per head and
    ``header`` kind)."""
    if fmt.is_float:
        return stored_to_float32(float_view(payload, fmt, heads, block_size, head_size)[:, :tokens], fmt.name)
    out = np.empty((heads, tokens, head_size), np.float32)
    _kernels.dequantize_page(payload, fmt.code, heads, block_size, head_size, groups, tokens, out, header)
    return out


class PlanePayloads:
    """Per plane and page id: payload buffer and array, address, format and size (module docstring).

    Args:
        planes: the planes every page id holds a payload for (checked).
        block_size: tokens per page.
        allocator: where payloads come from; a ``SlabAllocator`` serves plane
            ``i`` from its lane ``i`` (``allocators[i]``), any other
            allocator serves every plane itself.  Any of them frees any
            payload.
        lock: the owner's lock (re-entrant), taken around every record change.
        owner: the owner's name, leading error messages.
        labels: per plane, what an allocation error names (default ``"{owner}: plane '{name}'"``).
        spare_pages: native payloads of freed pages each plane keeps (:mod:`~onnxkv.cache.spare_payloads`).

    Records, by plane ``i`` and page id (grown by :meth:`grow`):
    ``pages[i][p]`` the payload array (None: free or lent), ``ptrs[i, p]``
    uint64 addresses (0: free), ``formats[i, p]`` uint8 ONNX element codes
    (the native code while free: the attention kernel validates the whole
    table), ``sizes[i, p]`` int64 payload bytes (0: free or lent);
    ``ptrs``, ``formats`` and ``sizes`` are ``[planes, capacity]`` arrays.
    ``converted[i]`` counts the live pages that are not native (0: the
    kernel reads plain pages).
    """

    def __init__(
        self,
        planes: list[PlaneSpec],
        block_size: int,
        allocator,
        lock: threading.RLock,
        owner: str = "BlockPool",
        labels: list[str] | None = None,
        spare_pages: int = 0,
    ) -> None:
        for p in planes:
            p.check(owner)
        self.planes = list(planes)
        self.block_size = int(block_size)
        self.allocator = allocator
        self.allocators = (
            [allocator.lane(i) for i in range(len(self.planes))]
            if isinstance(allocator, SlabAllocator)
            else [allocator] * len(self.planes)
        )
        self.owner = owner
        self._labels = labels or [f"{owner}: plane '{p.name}'" for p in self.planes]
        self._lock = lock
        n = len(self.planes)
        self._bufs: list[list] = [[] for _ in self.planes]
        self.pages: list[list] = [[] for _ in self.planes]
        self.ptrs = np.zeros((n, 0), np.uint64)
        self.formats = np.zeros((n, 0), np.uint8)
        self.converted: list[int] = [0 for _ in self.planes]
        self.sizes = np.zeros((n, 0), np.int64)
        #: id(buffer) -> buffer of each payload build_payload handed out and nobody installed or discarded yet.
        self._built: dict[int, object] = {}
        #: Native payloads of freed pages kept for the next pages (``spare_pages`` per plane).
        self.spares = SparePayloads(self.planes, self.block_size, spare_pages, lock)
        #: Per plane: the native format code and a native payload's bytes.
        self._native_codes = np.array([NATIVE_CODE[p.storage] for p in self.planes], np.uint8)
        self._native_bytes = np.array([p.page_bytes(self.block_size) for p in self.planes], np.int64)

    # -- records ---------------------------------------------------------------
    def grow(self, capacity: int) -> None:
        """Extend every plane's records to ``capacity`` page ids (new ids free); all or nothing (a
        MemoryError leaves them as they were)."""
        have = self.ptrs.shape[1]
        if capacity <= have:
            return
        n = len(self.planes)
        ptrs, sizes = np.zeros((n, capacity), np.uint64), np.zeros((n, capacity), np.int64)
        fmts = self._native_codes[:, None].repeat(capacity, axis=1)
        ptrs[:, :have], fmts[:, :have], sizes[:, :have] = self.ptrs, self.formats, self.sizes
        pad, lists = [None] * (capacity - have), [*self._bufs, *self.pages]
        try:  # the record lists grow in place (their holders see the new records)
            for records in lists:
                records.extend(pad)
        except BaseException:
            for records in lists:  # those extended (a failed extend changes nothing), one by one: a slice
                while len(records) > have:  # deletion would allocate a buffer of its size
                    records.pop()
            raise
        self.ptrs, self.formats, self.sizes = ptrs, fmts, sizes

    @property
    def committed_bytes(self) -> int:
        """Bytes of payload held by live pages (each in its own format)."""
        return int(self.sizes.sum())

    def native_pages(self, ids: np.ndarray) -> np.ndarray:
        """bool [len(ids)]: whether each of the live pages ``ids`` is in its native format in every plane."""
        return (self.formats[:, np.asarray(ids, np.int64)] == self._native_codes[:, None]).all(axis=0)

    def pages_bytes(self, ids: np.ndarray) -> int:
        """Payload bytes of the distinct live pages ``ids`` over all planes."""
        u = np.unique(ids[ids >= 0])
        return int(self.sizes[:, u].sum())

    def lease_pages(self, ids: np.ndarray) -> None:
        """Give each new page id of ``ids`` (free ids: no payload, native format) a native payload in every
        plane, a spare or leased and checked (:func:`onnxkv.alloc.checked.lease`); on an error none is kept
        (they are freed) and it is raised.

        The undo allocates nothing in proportion to ``ids`` (it runs when memory has run out: each payload
        is freed as it is forgotten, the last leased first)."""
        bufs, pages, addrs = self._bufs, self.pages, [0] * len(self.planes)
        k = plane = 0  # leased so far: pages ids[:k] in every plane, then page ids[k] in planes [0, plane)
        try:
            for k in range(ids.size):
                p = int(ids[k])
                for plane in range(len(self.planes)):
                    bufs[plane][p], pages[plane][p], addrs[plane] = self._lease_native(plane)
                plane = 0
                self.ptrs[:, p] = addrs  # the format of a free id is native already
                self.sizes[:, p] = self._native_bytes
        except BaseException:
            for j in range(k, -1, -1):
                for i in range(plane if j == k else len(self.planes))[::-1]:
                    release(self.allocator, (self._forget(i, int(ids[j])),), self.owner)
            raise

    def forget_pages(self, ids: np.ndarray, keep: bool = True) -> list:
        """Clear the records of freed page ids ``ids`` (distinct) in every plane; return their buffers (for
        the caller to free, after its lock), but for the native payloads ``spares`` keeps (``keep``)."""
        out: list = []
        if not ids.size:
            return out
        at = np.asarray(ids, np.intp)
        codes, addresses = self.formats[:, at], self.ptrs[:, at].tolist()
        native = codes == self._native_codes[:, None]
        for i, n in enumerate((~native).sum(axis=1).tolist()):
            self.converted[i] -= n
        self.formats[:, at] = self._native_codes[:, None]
        self.ptrs[:, at] = 0
        self.sizes[:, at] = 0
        native = native.tolist()
        bufs, pages, spares = self._bufs, self.pages, self.spares
        for j, p in enumerate(at.tolist()):
            for i in range(len(self.planes)):
                buf, arr = bufs[i][p], pages[i][p]
                bufs[i][p] = pages[i][p] = None
                if not (keep and native[i][j] and spares.keep(i, buf, arr, addresses[i][j])):
                    out.append(buf)
        return out

    def _lease_native(self, i: int):
        """(buffer, array [H, bs, D] of the plane's dtype, address): a native payload of plane ``i``, a spare
        (its bytes those of the page it held) or leased and checked."""
        spare = self.spares.take(i)
        if spare is not None:
            return spare
        spec = self.planes[i]
        buf, arr = lease(
            self.allocators[i],
            spec.page_bytes(self.block_size),
            64,
            spec.dtype,
            (spec.heads, self.block_size, spec.head_size),
            f"{self.owner}: plane '{spec.name}'",
        )
        return buf, arr, arr.__array_interface__["data"][0]

    def swap(self, plane: int, page: int, buf, arr: np.ndarray | None, code: int, address: int = 0) -> tuple:
        """Make ``buf`` / ``arr`` the payload of ``page`` in ``plane``, format ``code``; return the previous
        record ``(buf, arr, code, address)``, which the caller frees or keeps (cannot fail; frees nothing).

        ``arr`` None records a lent page at ``address`` (its owner's storage, never freed here) or, with
        address 0, a free one.  Passing a returned record back restores the page exactly.  Called under
        the owner's lock.
        """
        old_code = int(self.formats[plane, page])
        old = (self._bufs[plane][page], self.pages[plane][page], old_code, int(self.ptrs[plane, page]))
        if self._built:
            self._built.pop(id(buf), None)
        self._bufs[plane][page], self.pages[plane][page] = buf, arr
        self.ptrs[plane, page] = address if arr is None else arr.__array_interface__["data"][0]
        native = NATIVE_CODE[self.planes[plane].storage]
        self.converted[plane] += (code != native) - (old_code != native)
        self.formats[plane, page] = code
        self.sizes[plane, page] = 0 if arr is None else arr.nbytes
        return old

    def _forget(self, i: int, p: int):
        """Clear every record of page ``p``'s payload in plane ``i``; return its buffer (for the caller to free)."""
        return self.swap(i, p, None, None, NATIVE_CODE[self.planes[i].storage])[0]

    def set_layout(self, plane: int, groups: int, header: str) -> None:
        """Declare the scale groups and header kind of ``plane``'s quantized pages (a PageSet, whose
        conversions carry their own parameters: any header kind of :class:`PageParams` with groups 1 or
        head_size); the caller makes every quantized page of the plane agree."""
        self.planes[plane] = dataclasses.replace(self.planes[plane], groups=int(groups), header=header)

    def end_batch(self) -> None:
        """Forget the payloads :meth:`build_payload` handed out that were neither installed nor discarded
        (their builder freed them itself): they leave the ownership index.  Called under the owner's lock."""
        if self._built:
            forget(self.allocator, self._built.values())
            self._built.clear()

    def check(self, refs: np.ndarray) -> None:
        """Audit: a payload exactly on every id whose count in ``refs`` is > 0, and ``converted`` right.
        Raises :class:`~onnxkv.errors.StateError` naming the first mismatch.  Ids past the records (the id
        table grew, the records could not: a failed allocation) must be free."""
        beyond = np.flatnonzero(refs[self.ptrs.shape[1] :] > 0)
        if beyond.size:
            raise StateError(
                f"{self.owner}.audit: page {self.ptrs.shape[1] + int(beyond[0])} is referenced but has no record"
            )
        refs = refs[: self.ptrs.shape[1]]
        for i in range(len(self.planes)):
            has = self.ptrs[i][: len(refs)] != 0
            if (has != (refs > 0)).any():
                p = int(np.flatnonzero(has != (refs > 0))[0])
                raise StateError(
                    f"{self.owner}.audit: page {p} plane '{self.planes[i].name}' payload "
                    f"{'held' if has[p] else 'missing'} with {int(refs[p])} reference(s)"
                )
        for i, spec in enumerate(self.planes):
            live = self.ptrs[i][: len(refs)] != 0
            n = int((live & (self.formats[i][: len(refs)] != NATIVE_CODE[spec.storage])).sum())
            if n != self.converted[i]:
                raise StateError(
                    f"{self.owner}.audit: plane '{spec.name}' counts {self.converted[i]} converted pages but holds {n}"
                )

    # -- reads and copies --------------------------------------------------------
    def quantized(self, plane: int, page: int) -> bool:
        """True if the payload of ``page`` in ``plane`` is not the plane's native type."""
        return int(self.formats[plane][page]) != NATIVE_CODE[self.planes[plane].storage]

    @staticmethod
    def native(spec: PlaneSpec, x: np.ndarray) -> np.ndarray:
        """Float32 ``x`` in ``spec``'s stored type (bfloat16 rounded to nearest even, as uint16 bits)."""
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
        return payload_values(
            arr,
            formats.page_format(code),
            spec.heads,
            self.block_size,
            spec.head_size,
            spec.groups,
            spec.header,
            tokens,
        )

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
                b[:, :tokens] = self.native(spec, self.read_page(i, src, tokens))
                n += self.pages[i][src].nbytes
            else:
                a = self.pages[i][src]
                b[:, :tokens] = a[:, :tokens]
                n += a[:, :tokens].nbytes
        return n

    # -- conversion ----------------------------------------------------------------
    def build_payload(self, plane: int, page: int, fmt_name: str, tokens: int):
        """A new payload holding the first ``tokens`` positions of ``page`` in ``fmt_name``: (buffer, array).

        The plane's native format gives a native page (``[H, bs, D]`` of the
        plane's dtype, positions past ``tokens`` zero), or ``(None, None)`` --
        nothing allocated -- when the page already is native.  Nothing is
        installed: :meth:`install_payload` swaps it in, :meth:`discard_payload`
        gives it back (a payload that is neither installed nor discarded
        -- its builder freed it -- leaves the ownership index of
        :mod:`onnxkv.alloc.checked` at the owner's next other call).
        Raises :class:`~onnxkv.errors.OutOfMemory` or
        :class:`~onnxkv.errors.InputError` when the allocator fails (see
        :func:`onnxkv.alloc.checked.lease`), with nothing allocated.
        """
        if formats.page_format(fmt_name).name == self.planes[plane].storage and not self.quantized(plane, page):
            return None, None
        return self.encode_payload(plane, fmt_name, self.read_page(plane, page, tokens))

    def encode_payload(self, plane: int, fmt_name: str, x: np.ndarray, params: PageParams | None = None):
        """A new payload of ``plane`` in ``fmt_name`` holding float32 ``x`` ``[H, tokens, D]``: (buffer, array).

        The plane's native format gives a native page (positions past
        ``tokens`` zero); an integer format is quantized with ``params``, or
        with parameters computed from ``x`` in the plane's layout when None.
        Nothing is installed and the ownership rules are those of
        :meth:`build_payload`; raises as it does, with nothing allocated.
        """
        spec = self.planes[plane]
        fmt = formats.page_format(fmt_name)
        if fmt.name == spec.storage:
            buf, arr, _ = self._lease_native(plane)
        else:
            groups, header = (spec.groups, spec.header) if params is None else (params.groups, params.header)
            nbytes = formats.page_bytes(fmt, spec.heads, self.block_size, spec.head_size, groups, header)
            buf, arr = formats.allocate_payload(self.allocators[plane], fmt, nbytes, self._labels[plane])
        with self._lock:
            self._built[id(buf)] = buf
        try:
            self._encode(spec, fmt, x, arr, params)
        except BaseException:
            self.discard_payload(buf)
            raise
        return buf, arr

    def _encode(
        self, spec: PlaneSpec, fmt: formats.PageFormat, x: np.ndarray, arr: np.ndarray, params: PageParams | None
    ) -> None:
        """Write float32 ``x`` [H, tokens, D] into the new payload ``arr`` of format ``fmt`` (a native page
        [H, bs, D], else uint8 bytes; quantized with ``params`` if given); float positions past ``tokens``
        are zero."""
        bs, tokens = self.block_size, x.shape[1]
        if fmt.is_float:
            typed = arr if arr.ndim == 3 else float_view(arr, fmt, spec.heads, bs, spec.head_size)
            typed[:, :tokens] = self.native(PlaneSpec(spec.name, spec.heads, spec.head_size, fmt.name), x)
            typed[:, tokens:] = 0
        elif params is not None:
            extra = {} if params.header_bytes is None else {"header": params.header_bytes, "header_kind": params.header}
            scale, zero = np.ascontiguousarray(params.scale), np.ascontiguousarray(params.zero_point)
            _kernels.quantize_page(x, fmt.code, scale, zero, params.groups, arr, bs, **extra)
        elif spec.header == formats.HEADER_COMPACT:
            scale, zero, header = formats.compact_params(x, fmt)
            _kernels.quantize_page(x, fmt.code, scale, zero, spec.groups, arr, bs, header=header)
        elif spec.header == formats.HEADER_CHANNEL_ZP:
            scale, zero, header = formats.channel_zp_params(x, fmt)
            _kernels.quantize_page(
                x, fmt.code, scale, zero, spec.groups, arr, bs, header=header, header_kind=formats.HEADER_CHANNEL_ZP
            )
        else:
            scale, zero = formats.params_for(x, fmt, "head")
            _kernels.quantize_page(x, fmt.code, scale, zero, spec.groups, arr, bs)

    def install_payload(
        self, plane: int, page: int, buf, arr: np.ndarray | None, fmt_name: str, keep_old: bool = False
    ) -> tuple | None:
        """Swap a payload from :meth:`build_payload` into ``page`` (held exclusively); free the old one, or
        with ``keep_old`` return its record for :meth:`restore_payload` (or :meth:`discard_payload` of its
        buffer, the first item).

        ``buf`` None (a conversion to the page's own native format) changes
        nothing (returns None).  The page's records change first; a ``free``
        of the old payload that raises is then logged: the new payload stays
        published.
        """
        if buf is None:
            return None
        with self._lock:
            old = self.swap(plane, page, buf, arr, formats.page_format(fmt_name).code)
        if keep_old:
            return old
        release(self.allocator, [old[0]], self.owner)
        return None

    def restore_payload(self, plane: int, page: int, old: tuple) -> None:
        """Put back the record :meth:`install_payload` kept (``keep_old``); free the payload it replaced."""
        with self._lock:
            new = self.swap(plane, page, *old)[0]
        release(self.allocator, [new], self.owner)

    def duplicate_payload(self, plane: int, page: int):
        """A new payload holding a byte copy of ``page``'s payload in ``plane``, which is not native (its
        format; header and codes alike): (buffer, array), as :meth:`build_payload` returns them."""
        src = self.pages[plane][page]
        fmt = formats.page_format(int(self.formats[plane][page]))
        buf, arr = formats.allocate_payload(self.allocators[plane], fmt, src.nbytes, self._labels[plane])
        with self._lock:
            self._built[id(buf)] = buf
        arr[:] = src.reshape(-1).view(np.uint8)
        return buf, arr

    def discard_payload(self, buf) -> None:
        """Give back a payload from :meth:`build_payload` that will not be installed, or one a
        :meth:`swap` replaced (None: nothing); a ``free`` that raises is logged."""
        if buf is not None:
            with self._lock:
                self._built.pop(id(buf), None)
            release(self.allocator, [buf], self.owner)

    # -- stored form (cache files) ----------------------------------------------------
    def stored(
        self, plane: int, page: int, tokens: int
    ) -> tuple[str, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """The first ``tokens`` positions of ``page`` in ``plane`` as stored: (format name, data, scale,
        zero point).  ``data`` is a copy: ``[H, tokens, D]`` elements of a native or float page, else
        packed codes uint8 ``[H, tokens, D * bits / 8]`` with the header's float32 scales and zero points
        (``[H * groups]`` each; None for floats)."""
        spec = self.planes[plane]
        arr = self.pages[plane][page]
        if not self.quantized(plane, page):
            return spec.storage, arr[:, :tokens].copy(), None, None
        fmt = formats.page_format(int(self.formats[plane][page]))
        if fmt.is_float:
            return (
                fmt.name,
                float_view(arr, fmt, spec.heads, self.block_size, spec.head_size)[:, :tokens].copy(),
                None,
                None,
            )
        hdr = formats.header_bytes(fmt, spec.heads, spec.groups, spec.header)
        row = spec.head_size * fmt.bits // 8
        scale, zero_point = formats.decode_header(arr, fmt, spec.heads, spec.groups, spec.header)
        codes = arr[hdr : hdr + spec.heads * self.block_size * row].reshape(spec.heads, self.block_size, row)
        return fmt.name, codes[:, :tokens].copy(), scale, zero_point

    def install_stored(
        self, plane: int, page: int, fmt_name: str, data: np.ndarray, tokens: int, header: np.ndarray | None, api: str
    ) -> None:
        """Make the stored form ``data`` of ``tokens`` positions (see :meth:`stored`) the payload of ``page``
        in ``plane``, a native page held alone; ``header``: a quantized page's header bytes in the plane's
        header kind (:func:`onnxkv.cache.formats.encode_header`).  The plane's native format is written
        in place (positions past ``tokens`` zero); another gets a new payload from the plane's allocator.
        Raises :class:`~onnxkv.errors.OutOfMemory` / :class:`~onnxkv.errors.InputError` (starting with
        ``api``) when the allocator fails, with the page unchanged."""
        spec = self.planes[plane]
        bs = self.block_size
        if fmt_name == spec.storage:
            self.pages[plane][page][:, :tokens] = data
            self.pages[plane][page][:, tokens:] = 0  # recycled memory: a static cache reads the slots past n as 0
            return
        fmt = formats.page_format(fmt_name)
        nbytes = formats.page_bytes(fmt, spec.heads, bs, spec.head_size, spec.groups, spec.header)
        buf, arr = formats.allocate_payload(self.allocators[plane], fmt, nbytes, api)
        try:
            arr[:] = 0
            if fmt.is_float:
                float_view(arr, fmt, spec.heads, bs, spec.head_size)[:, :tokens] = data
            else:
                row = spec.head_size * fmt.bits // 8
                arr[: header.size] = header
                codes = arr[header.size : header.size + spec.heads * bs * row]
                codes.reshape(spec.heads, bs, row)[:, :tokens] = data
        except BaseException:
            self.discard_payload(buf)
            raise
        self.install_payload(plane, page, buf, arr, fmt.name)

    def convert_page(self, plane: int, page: int, fmt_name: str, tokens: int) -> None:
        """Replace the payload of an exclusively held ``page`` in ``plane`` by one in ``fmt_name`` (allocated
        once; the plane's native format on a native page: nothing happens)."""
        buf, arr = self.build_payload(plane, page, fmt_name, tokens)
        self.install_payload(plane, page, buf, arr, fmt_name)
