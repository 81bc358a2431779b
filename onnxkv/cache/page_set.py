"""Per-page formats of a caller-indexed page tensor: the cache handle of the explicit paged graph form.

The explicit paged operators (:mod:`onnxkv.plan.ops.paged`) keep a cache as
one float32/float16 tensor of pages, ``[P, H, bs, D]`` (one plane) or ``[P,
2, H, bs, D]`` (two planes: index 0 keys, 1 values), page ids chosen by the
caller's block tables.  A :class:`PageSet` gives every (plane, page) its own
format (the layout of :mod:`onnxkv.cache.formats`):

* a page in the tensor's own type is its slot of the tensor, read in place
  (making a handle copies nothing);
* a *converted* page owns one payload allocated from the handle's allocator
  (64-byte aligned): a float page of another float type, or a quantized page
  (header, then codes).

The pages are held by a :class:`~onnxkv.cache.plane_payloads.PlanePayloads`
(``payloads``: the payload store of the states' paged caches too), one
plane per key/value index, every page id live, a page in the tensor's type
lent to it as the address of its slot.  ``ptrs`` (uint64 ``[planes, P]``)
holds each page's address and ``formats`` (uint8 ``[planes, P]``) its ONNX
element type code: the tables ``onnxkv._kernels.paged_attention`` reads.
``groups[plane]`` is G of the plane's quantized pages (1: one scale per head,
D: per head and channel; 0 while the plane holds no quantized page) and
``headers[plane]`` their header kind ("float32", or "channel-zp": one scale
per head and a zero point per channel, G = D).  Only the handle writes them.

Binding.  A handle belongs to one tensor object.  :meth:`PageSet.of` finds
it from that object or any full view of it (an array over the same memory
with the same address, shape, strides and dtype: NumPy collapses the base
chain of a view of a view, so memory, not ``base``, says what an array
views); :meth:`PageSet.attach`
makes it the first time.  The graph value of the cache stays the tensor
itself, so a state's persistent bindings and the plan's MUST_ALIAS pointer
checks work unchanged, and the operators look the handle up.  The handle
holds the tensor weakly; when the tensor object is collected, the payloads
go back to the allocator.

The tensor slot of a converted page is dead storage: it is filled with NaN
when the page leaves it (a reader unaware of the handle sees NaN, never a
stale value) and written again when the page is converted back to the
tensor's own type (which frees the payload; nothing is allocated).

:meth:`PageSet.convert` is all or nothing: indices, formats and parameters
are validated and every new payload is built before the first one is
published; an error (:class:`~onnxkv.errors.InputError`,
:class:`~onnxkv.errors.OutOfMemory`) frees what was built and leaves every
table and every byte as it was.  A page's payload is never changed in place:
converting it again replaces it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from onnxkv._kernels import _validate as V
from onnxkv.alloc import as_allocator
from onnxkv.alloc.checked import release
from onnxkv.cache import formats
from onnxkv.cache.bound import byte_span as _span
from onnxkv.cache.plane_payloads import PageParams, PlanePayloads, PlaneSpec
from onnxkv.errors import InputError, StateError

__all__ = ["PageSet", "PlaneTarget", "ConvertCost"]

_NATIVE = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}
_ALIGNMENT = 64
_FLOAT_CODES = [f.code for f in formats.FORMATS if f.is_float]
#: Guards ``_handles``.  Re-entrant: a garbage collection inside a locked section (any allocation may
#: start one) can free a dead tensor there and run its finalizer (:func:`_release_payloads`), which takes
#: the lock too.
_lock = threading.RLock()
#: id(tensor) -> its handle, while the tensor object is alive.
_handles: dict[int, PageSet] = {}


@dataclass(frozen=True)
class PlaneTarget:
    """The new format of the selected pages of one plane.

    ``fmt``: a format name or ONNX element code (:func:`onnxkv.cache.formats.page_format`).
    For an integer format, ``scale`` and ``zero_point`` are float32 arrays of
    one shape, ``[N, H]`` (one scale per page and head, G = 1) or ``[N, H, D]``
    (per page, head and channel, G = D), row ``i`` for the ``i``-th selected
    page; zero points are integers in the format's code range.  A float
    format ignores them (None allowed).  ``names`` label the two arrays in
    error messages.  ``header``: the header kind of the new quantized pages,
    "float32", or "channel-zp" (``[N, H, D]`` parameters whose scales are
    equal within each head).
    """

    fmt: str | int
    scale: np.ndarray | None = None
    zero_point: np.ndarray | None = None
    names: tuple[str, str] = ("scale", "zero_point")
    header: str = formats.HEADER_FLOAT32


@dataclass
class ConvertCost:
    """What one :meth:`PageSet.convert` did (for the event log).

    ``pages``: (plane, page) payloads replaced; ``allocations`` /
    ``allocated_bytes``: payloads allocated; ``freed_bytes``: payload bytes
    returned to the allocator; ``dequantized_bytes``: bytes of quantized
    payloads read to build the new pages.
    """

    pages: int = 0
    allocations: int = 0
    allocated_bytes: int = 0
    freed_bytes: int = 0
    dequantized_bytes: int = 0
    _pending: tuple | None = field(default=None, repr=False)
    _handle: PageSet | None = field(default=None, repr=False)

    def commit(self) -> None:
        """Free what a staged conversion replaced (see :meth:`PageSet.convert`); a no-op when not staged."""
        if self._pending is not None:
            self._handle._finish(self, True)

    def rollback(self) -> None:
        """Undo a staged conversion (see :meth:`PageSet.convert`); a no-op when not staged."""
        if self._pending is not None:
            self._handle._finish(self, False)


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _release_payloads(key: int, payloads: PlanePayloads) -> None:
    """Finalizer of a handle's tensor: forget the handle, free its payloads."""
    with _lock:
        _handles.pop(key, None)
    pages = np.arange(payloads.ptrs.shape[1])
    release(payloads.allocator, payloads.forget_pages(pages, keep=False), "PageSet")


class PageSet:
    """Page formats and addresses of one page tensor (see the module docstring).

    Made by :meth:`attach`.  Calls on one handle are serialised by ``lock``
    (re-entrant); a kernel reading pages through ``ptrs`` holds it for the
    duration of the call, so no payload is freed under it.
    """

    def __init__(self, tensor: np.ndarray, allocator) -> None:
        self._tensor = weakref.ref(tensor)
        self.allocator = allocator
        self.dtype = tensor.dtype
        self.native = formats.page_format(_NATIVE[tensor.dtype])
        self.two_planes = tensor.ndim == 5
        self.num_pages = tensor.shape[0]
        self.heads, self.block_size, self.head_size = (int(x) for x in tensor.shape[-3:])
        names = ("keys", "values") if self.two_planes else ("pages",)
        specs = [PlaneSpec(name, self.heads, self.head_size, self.native.name) for name in names]
        self.lock = threading.RLock()
        self.payloads = PlanePayloads(specs, self.block_size, allocator, self.lock, "PageSet", ["PageSet"] * len(names))
        self.payloads.grow(self.num_pages)
        base = np.uint64(_address(tensor))
        pages = np.arange(self.num_pages, dtype=np.uint64) * np.uint64(tensor.strides[0])
        plane_step = np.uint64(tensor.strides[1]) if self.two_planes else np.uint64(0)
        self._slots = np.stack([base + pages + np.uint64(i) * plane_step for i in range(len(names))])
        self._slots.flags.writeable = False
        for plane in range(len(names)):
            for page in range(self.num_pages):
                self._lend(plane, page)
        weakref.finalize(tensor, _release_payloads, id(tensor), self.payloads)

    # -- binding ---------------------------------------------------------------------
    @staticmethod
    def of(tensor: np.ndarray) -> PageSet | None:
        """The handle of ``tensor`` (or of the tensor it fully views), or None."""
        with _lock:
            handle, whole = PageSet._find(tensor)
            return handle if whole else None

    @staticmethod
    def _find(tensor: np.ndarray) -> tuple[PageSet | None, bool]:
        """(handle of the live tensor whose memory ``tensor`` overlaps, True if it views that tensor whole);
        registry locked."""
        if not isinstance(tensor, np.ndarray) or tensor.size == 0:
            return None, False
        lo, hi = _span(tensor)
        for handle in tuple(_handles.values()):  # a collection here may run a finalizer that drops one
            t = handle._tensor()
            if t is None:
                continue
            t_lo, t_hi = _span(t)
            if lo < t_hi and t_lo < hi:
                same = (_address(t), t.shape, t.strides, t.dtype)
                return handle, same == (_address(tensor), tensor.shape, tensor.strides, tensor.dtype)
        return None, False

    @classmethod
    def attach(cls, tensor: np.ndarray, allocator=None) -> PageSet:
        """The handle of ``tensor``, made on first use with payloads from ``allocator``.

        ``tensor``: writable C-contiguous float32/float16 ``[P, H, bs, D]`` or
        ``[P, 2, H, bs, D]``, all dims >= 1.  An existing handle keeps the
        allocator it was made with.  Raises :class:`InputError` for another
        array, including a partial view of a tensor that has a handle.
        """
        ok = (
            isinstance(tensor, np.ndarray)
            and tensor.dtype in _NATIVE
            and tensor.ndim in (4, 5)
            and (tensor.ndim == 4 or tensor.shape[1] == 2)
            and tensor.size > 0
        )
        if not ok:
            what = f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, np.ndarray) else type(tensor).__name__
            raise InputError(
                f"PageSet.attach: expected a float32/float16 page tensor [P, H, bs, D] or "
                f"[P, 2, H, bs, D] with every dim >= 1, got {what}"
            )
        if not (tensor.flags.c_contiguous and tensor.flags.writeable):
            raise InputError("PageSet.attach: the page tensor must be writable and C-contiguous")
        with _lock:
            found, whole = cls._find(tensor)
            if found is not None:
                if not whole:
                    raise InputError(
                        "PageSet.attach: the array views part of a page tensor that has a handle; pass that tensor"
                    )
                return found
            handle = cls(tensor, as_allocator(allocator))
            _handles[id(tensor)] = handle
            return handle

    def _live_tensor(self) -> np.ndarray:
        t = self._tensor()
        if t is None:
            raise StateError("PageSet: its page tensor was released")
        return t

    # -- reads -----------------------------------------------------------------------
    @property
    def planes(self) -> int:
        return len(self.payloads.planes)

    @property
    def ptrs(self) -> np.ndarray:
        """uint64 ``[planes, P]``: each page's address (its tensor slot, or its payload)."""
        return self.payloads.ptrs

    @property
    def formats(self) -> np.ndarray:
        """uint8 ``[planes, P]``: each page's ONNX element type code."""
        return self.payloads.formats

    @property
    def groups(self) -> list[int]:
        """G of each plane's quantized pages (0: the plane holds none)."""
        return [spec.groups if self.quantized(i).any() else 0 for i, spec in enumerate(self.payloads.planes)]

    @property
    def headers(self) -> list[str]:
        """Header kind of each plane's quantized pages ("float32" while it holds none)."""
        return [spec.header for spec in self.payloads.planes]

    def converted(self, plane: int | None = None) -> np.ndarray:
        """Bool ``[P]`` (or ``[planes, P]`` for plane None): pages not in the tensor's own type."""
        fmts = self.formats if plane is None else self.formats[plane]
        return fmts != self.native.code

    def quantized(self, plane: int) -> np.ndarray:
        """Bool ``[P]``: pages of ``plane`` in an integer (quantized) format."""
        return ~np.isin(self.formats[plane], _FLOAT_CODES)

    @property
    def any_converted(self) -> bool:
        return any(self.payloads.converted)

    @property
    def payload_bytes(self) -> int:
        """Bytes of every converted page's payload (held besides the tensor)."""
        return self.payloads.committed_bytes

    def _slot(self, tensor: np.ndarray, plane: int, page: int) -> np.ndarray:
        return tensor[page, plane] if self.two_planes else tensor[page]

    def _lend(self, plane: int, page: int) -> tuple:
        """Make the tensor slot of ``page`` its storage in ``plane``; return the replaced record."""
        return self.payloads.swap(plane, page, None, None, self.native.code, int(self._slots[plane, page]))

    def page_values(self, plane: int, page: int) -> np.ndarray:
        """Float32 ``[H, bs, D]`` of ``page`` in ``plane``, read in its own format."""
        with self.lock:
            if int(self.formats[plane, page]) == self.native.code:
                return self._slot(self._live_tensor(), plane, page).astype(np.float32)
            return self.payloads.read_page(plane, page, self.block_size)

    # -- conversion ------------------------------------------------------------------
    def _check_target(self, api: str, plane: int, target: PlaneTarget, n: int, selected: np.ndarray) -> tuple:
        """(format, G, scale [n, H*G], zero point [n, H*G], header bytes [n] or None) of a validated
        target (G = 0 and None for floats; header bytes for channel-zp targets only)."""
        fmt = formats.page_format(target.fmt)
        if fmt.is_float:
            return fmt, 0, None, None, None
        h, d = self.heads, self.head_size
        if d * fmt.bits % 8:
            raise InputError(
                f"{api}: format {fmt.name} needs head_size * {fmt.bits} bits to be a multiple of 8, head_size is {d}"
            )
        scale, zero = target.scale, target.zero_point
        for name, a in zip(target.names, (scale, zero)):
            if not isinstance(a, np.ndarray) or a.shape not in ((n, h), (n, h, d)):
                shape = list(a.shape) if isinstance(a, np.ndarray) else type(a).__name__
                raise InputError(
                    f"{api}: {name} must be [{n}, {h}] (per page and head) or [{n}, {h}, {d}] "
                    f"(per page, head and channel) for {n} selected page(s), got {shape}"
                )
        formats.check_params(api, fmt, scale, zero, target.names)
        g = 1 if scale.ndim == 2 else d
        czp = target.header == formats.HEADER_CHANNEL_ZP
        if czp and g == 1:
            raise InputError(
                f"{api}: {target.names[0]} must be [{n}, {h}, {d}] for channel-zp pages (one scale per "
                f"head repeated over its channels, a zero point per channel), got {list(scale.shape)}"
            )
        quantized = self.quantized(plane) & ~selected
        if quantized.any() and (g, target.header) != (self.groups[plane], self.headers[plane]):
            have = {1: "per head", d: "per channel"}[self.groups[plane]]
            if self.headers[plane] == formats.HEADER_CHANNEL_ZP:
                have = "with channel-zp headers"
            gives = "channel-zp" if czp else {1: "per-head", d: "per-channel"}[g]
            raise InputError(
                f"{api}: {target.names[0]} gives {gives} scales but plane {plane} already holds pages "
                f"quantized {have} (e.g. page {int(np.flatnonzero(quantized)[0])}); one granularity per "
                "plane"
            )
        scale, zero = scale.reshape(n, h * g), zero.reshape(n, h * g)
        headers = None
        if czp:  # every header encoded (and checked) before anything is built
            headers = [
                formats.encode_header(
                    fmt,
                    np.ascontiguousarray(scale[i]),
                    np.ascontiguousarray(zero[i]),
                    h,
                    target.header,
                    f"{api}: page {i} of {target.names[0]} / {target.names[1]}",
                )
                for i in range(n)
            ]
        return fmt, g, scale, zero, headers

    def convert(
        self,
        indices: np.ndarray,
        targets: Sequence[PlaneTarget | None],
        api: str = "PageSet.convert",
        indices_name: str = "indices",
        staged: bool = False,
    ) -> ConvertCost:
        """Give pages ``indices`` of every plane with a target its new format; all or nothing.

        ``indices``: 1-D int array of distinct page ids in ``[0, P)``.
        ``targets``: one :class:`PlaneTarget` or None (plane untouched) per
        plane.  A page already in the target float format is left as it is;
        every other selected page gets one new payload (or returns to its
        tensor slot for the tensor's own type), built from its current values
        in whatever format it has.  Errors start with ``api`` and call the
        indices ``indices_name``.

        ``staged``: the new pages are published (readers see them at once) but
        the old storage is kept: freeing replaced payloads and filling vacated
        tensor slots with NaN wait for :meth:`ConvertCost.commit`, and
        :meth:`ConvertCost.rollback` puts every table, payload and group back
        as before the call (a run that fails after the conversion).  Exactly
        one of the two must be called.
        """
        with self.lock:
            tensor = self._live_tensor()
            idx = self._check_indices(api, indices, indices_name)
            if len(targets) != self.planes:
                raise InputError(f"{api}: {len(targets)} plane target(s) for {self.planes} plane(s)")
            selected = np.zeros(self.num_pages, bool)
            selected[idx] = True
            checked = [
                None if t is None else self._check_target(api, i, t, idx.size, selected) for i, t in enumerate(targets)
            ]
            cost = ConvertCost()
            built = self._build_all(idx, checked, cost)
            layouts = list(self.payloads.planes)
            swapped = []  # (plane, page, the record the new page replaced)
            for plane, page, fmt, buf, arr, x in built:
                if buf is None:  # back to the tensor's own type: into its slot
                    self._slot(tensor, plane, page)[...] = x
                    swapped.append((plane, page, self._lend(plane, page)))
                else:
                    swapped.append((plane, page, self.payloads.swap(plane, page, buf, arr, fmt.code)))
                cost.pages += 1
            for plane, (spec, target) in enumerate(zip(checked, targets)):
                if spec is not None:
                    self._sync_layout(plane, spec[1], target.header)
            cost._pending, cost._handle = (layouts, swapped), self
            if not staged:
                cost.commit()
            return cost

    def _check_indices(self, api: str, indices: np.ndarray, indices_name: str) -> np.ndarray:
        """``indices`` as int64 after checking they are distinct page ids (InputError starting with ``api``)."""
        idx = np.asarray(indices)
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise InputError(f"{api}: {indices_name} must be a 1-D int array, got {idx.dtype} {list(idx.shape)}")
        bad = np.flatnonzero(V.outside(idx, 0, self.num_pages - 1))  # in the ids' own width: none wraps
        if bad.size:
            raise InputError(
                f"{api}: {indices_name}[{int(bad[0])}] = {int(idx[bad[0]])} is not a page id in [0, {self.num_pages})"
            )
        idx = idx.astype(np.int64)
        unique, counts = np.unique(idx, return_counts=True)
        if (counts > 1).any():
            raise InputError(
                f"{api}: {indices_name} must be distinct, page {int(unique[counts > 1][0])} is "
                f"selected {int(counts[counts > 1][0])} times"
            )
        return idx

    def _build_all(self, idx: np.ndarray, checked: list, cost: ConvertCost) -> list[tuple]:
        """(plane, page, format, buffer, payload, values) of every page the validated targets ``checked``
        change: a new payload, or (buffer None) the float32 values going back to the tensor slot.
        All or nothing: an error gives back what was built and is raised."""
        built = []
        try:
            for plane, spec in enumerate(checked):
                if spec is None:
                    continue
                fmt, g, scale, zero, headers = spec
                for i, page in enumerate(idx.tolist()):
                    code = int(self.formats[plane, page])
                    if fmt.is_float and code == fmt.code:
                        continue
                    if code not in _FLOAT_CODES:
                        cost.dequantized_bytes += int(self.payloads.sizes[plane, page])
                    x = self.page_values(plane, page)
                    if fmt.code == self.native.code:
                        built.append((plane, page, fmt, None, None, x))
                        continue
                    params = None
                    if not fmt.is_float:
                        header = None if headers is None else headers[i]
                        kind = formats.HEADER_FLOAT32 if header is None else formats.HEADER_CHANNEL_ZP
                        params = PageParams(scale[i], zero[i], g, kind, header)
                    buf, arr = self.payloads.encode_payload(plane, fmt.name, x, params)
                    built.append((plane, page, fmt, buf, arr, None))
                    cost.allocations += 1
                    cost.allocated_bytes += arr.nbytes
        except BaseException:
            for *_, buf, _, _ in built:
                self.payloads.discard_payload(buf)
            raise
        return built

    def _finish(self, cost: ConvertCost, keep: bool) -> None:
        """Commit (``keep``) or roll back the conversion ``cost`` (see :meth:`convert`)."""
        layouts, swapped = cost._pending
        cost._pending = None
        unused = []  # the payloads the outcome leaves without a page
        with self.lock:
            tensor = self._tensor()
            for plane, page, old in reversed(swapped):
                now_lent = self.payloads.pages[plane][page] is None
                if keep:
                    if old[1] is not None:
                        unused.append(old[0])
                        cost.freed_bytes += old[1].nbytes
                    elif tensor is not None:  # the page left its slot: dead storage now
                        self._slot(tensor, plane, page)[...] = np.nan
                    continue
                new = self.payloads.swap(plane, page, *old)
                unused.append(new[0])
                if now_lent and tensor is not None:  # the page had come back to its slot
                    self._slot(tensor, plane, page)[...] = np.nan
            if not keep:
                for plane, spec in enumerate(layouts):
                    self.payloads.set_layout(plane, spec.groups, spec.header)
        for buf in unused:
            self.payloads.discard_payload(buf)

    def _sync_layout(self, plane: int, g: int, header: str) -> None:
        """The layout of ``plane``'s quantized pages after a conversion whose target had G = ``g`` (0: a
        float target) and header kind ``header``."""
        if not self.quantized(plane).any():
            self.payloads.set_layout(plane, 1, formats.HEADER_FLOAT32)
        elif g:
            self.payloads.set_layout(plane, g, header)

    # -- checks ----------------------------------------------------------------------
    def audit(self) -> None:
        """Check tables and payloads agree; raises :class:`~onnxkv.errors.StateError` naming the first mismatch."""
        with self.lock:
            for plane, spec in enumerate(self.payloads.planes):
                for page in range(self.num_pages):
                    code = int(self.formats[plane, page])
                    held = self.payloads.pages[plane][page]
                    ptr = int(self.ptrs[plane, page])
                    if code == self.native.code:
                        ok = held is None and ptr == int(self._slots[plane, page])
                    else:
                        fmt = formats.page_format(code)
                        g, header = (1, formats.HEADER_FLOAT32) if fmt.is_float else (spec.groups, spec.header)
                        want = formats.page_bytes(fmt, self.heads, self.block_size, self.head_size, g, header)
                        ok = (
                            held is not None and ptr == _address(held) and held.nbytes == want and ptr % _ALIGNMENT == 0
                        )
                    if not ok:
                        raise StateError(
                            f"PageSet.audit: plane {plane} page {page} (format code {code}) does not match its payload"
                        )
