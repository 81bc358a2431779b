"""Persistent per-request state: caches that live across runs, updated in place.

``state = session.new_state(...)`` then ``state.run(feeds)`` for every step of
one request.  Every past input the plan binds (see
:mod:`onnxkv.model.rewrite`) is fed from the state's persistent
:class:`~onnxkv.cache.contiguous.CacheTensor`: the nodes joining past and
present write only the new positions, in place; nothing of cache size is
allocated or copied per token.

Atomicity: new lengths are staged and committed together after the whole run
succeeded.  Writes past a row's valid length need no undo; a write into
committed storage (a static cache's slots, a position below a row's length,
a contract-declared value) first saves exactly the bytes it replaces
(O(new tokens)), and a cache that grows keeps its previous buffer until the
run ends.  A failed or cancelled run -- whichever node it stopped after --
puts all of that back, leaving every value, length, page table, page and
``committed_bytes`` exactly as before, so the call can be retried.

Static (TensorScatter) caches hold their fixed capacity from the first run
on: the model reads the whole capacity as its past (zeros where nothing was
written).  Their valid length per row is the high-water mark of the
positions written so far (``write_indices + sequence_length`` of the runs
that committed), which is what ``length``, ``lengths`` and ``values`` report.

``cache="paged"`` keeps the caches in pages of ``block_size`` tokens from a
reference-counted :class:`~onnxkv.cache.paged.BlockPool` (see
:mod:`onnxkv.cache.paged`): :meth:`State.fork`, :meth:`State.reorder`,
:meth:`State.checkpoint` / :meth:`State.restore` and :meth:`State.truncate`
then change page tables only, and a write into a shared page copies that page
first (copy-on-write).  Models with a ``local_window_size`` evict pages that
left the window after every run.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import warnings
from collections.abc import Iterator, Mapping

import numpy as np

from onnxkv.alloc import SlabAllocator, as_allocator, checked
from onnxkv.cache import bound
from onnxkv.cache.contiguous import CacheTensor
from onnxkv.cache import serialize
from onnxkv.cache.formats import HEADER_CHANNEL_ZP, HEADER_COMPACT, HEADER_FLOAT32, page_format
from onnxkv.cache.paged import BlockPool, PagedCache, PageTable, PlaneSpec
from onnxkv.cache.page_set import PageSet
from onnxkv.cache.policy import key_header, make_selector
from onnxkv.cache.snapshot import expectation, file_bytes_limit, paged_from_snapshot, take_snapshot
from onnxkv.errors import CacheCapacityError, InputError, StateError

__all__ = ["State", "Cancellation", "Checkpoint"]

_CACHES = ("contiguous", "paged")
#: Most forks one :meth:`State.fork` call makes (each is a state of its own; beams and trees need far fewer).
MAX_FORKS = 1 << 16


class Cancellation:
    """A token to cancel a running :meth:`State.run` from another thread.

    The plan checks it between nodes; a cancelled run raises
    :class:`~onnxkv.errors.Cancelled` and publishes nothing.
    """

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()


class Checkpoint:
    """A paged state's cache contents at one moment, held by page references (no copy).

    Made by :meth:`State.checkpoint`; :meth:`State.restore` returns the state
    to it (any number of times).  Holding a checkpoint keeps its pages
    alive; :meth:`release` (or garbage collection) drops them.
    """

    def __init__(self, state: State, table: PageTable, steps: int) -> None:
        self._state = state
        self.table: PageTable | None = table
        self.steps = steps

    @property
    def length(self) -> int:
        return 0 if self.table is None or not self.table.batch else int(self.table.lengths.max())

    def release(self) -> None:
        if self.table is not None:
            self.table.release()
            self.table = None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass


class State:
    """One request's persistent values (see the module docstring).

    Args:
        session: the :class:`~onnxkv.Session` whose plan runs.
        initial: optional past input name -> array [B, H, L, D] to start from
            (copied in); every bound past must be given, with one length.
        capacity: fixed capacity in positions (overflow raises
            :class:`~onnxkv.errors.CacheCapacityError`); None = grow
            geometrically from ``initial_capacity``.
        initial_capacity: first capacity of growable caches.
        allocator: persistent allocator for the caches, separate from the
            session's allocator for temporaries.  Default: a
            :class:`~onnxkv.alloc.SystemAllocator` for contiguous caches; for
            ``cache="paged"`` a :class:`~onnxkv.alloc.SlabAllocator` whose
            lane ``i`` holds plane ``i``'s pages (one plane's pages adjacent
            in huge-page backed chunks; see :class:`~onnxkv.cache.paged.BlockPool`).
            A given allocator serves every cache (a ``SlabAllocator`` one
            lane per plane).  ``stats()`` of this allocator is what the event
            log reports.
        cache_dtype: store the caches as ``"float16"`` or ``"bfloat16"`` instead of
            the model's type (half the bytes held and read per token; values are
            rounded to nearest even on append; GroupQueryAttention models only).
            ``values`` then shows the stored format (bfloat16 as uint16 bits).
        cache: ``"contiguous"`` (one buffer per cache value, grown geometrically)
            or ``"paged"`` (pages of ``block_size`` tokens with copy-on-write;
            ``capacity`` then caps the positions per sequence).
        block_size: tokens per page (paged).
        max_pages: at most this many pages live in the pool (paged; None =
            unbounded); running out raises :class:`~onnxkv.errors.OutOfMemory`
            before anything is written.
        kv_format: page formats of a paged cache (see :mod:`onnxkv.cache.policy`):
            None (native pages), a policy name ("fp32", "fp16", "bf16", "int8",
            "int8-head", "int4", "residual-int8", "residual-int4", ...) or a ``FormatSelector``
            callable ``(layer, past_length, k, v) -> (k_format, v_format)``.
            After every successful run the full pages the selector makes
            eligible are converted (each page once, allocated once).
        key_channel_scales: quantized key pages get one scale and zero point
            per channel (KIVI, compact headers) instead of one scale per head
            (also set by a policy whose ``key_channel_scales`` is True, e.g.
            "int8-kivi").
        key_channel_zero_points: quantized key pages get one scale per head
            and one zero point per channel (channel-zp headers; also set by a
            policy whose ``key_channel_zero_points`` is True, e.g. "int8").
            Mutually exclusive with ``key_channel_scales`` (InputError).

    One state per request; many states per session.  Two states never share
    writable storage.  Calls on one state must not overlap (a second
    concurrent call raises :class:`~onnxkv.errors.StateError`).
    """

    def __init__(self, session, initial: Mapping[str, np.ndarray] | None = None, capacity: int | None = None,
                 initial_capacity: int = 32, allocator=None, cache_dtype: str | None = None,
                 cache: str = "contiguous", block_size: int = 16, max_pages: int | None = None,
                 kv_format=None, key_channel_scales: bool = False, key_channel_zero_points: bool = False,
                 _pool: BlockPool | None = None) -> None:
        if cache not in _CACHES:
            raise InputError(f"new_state: cache must be one of {_CACHES}, got {cache!r}")
        for name, v in (("capacity", capacity), ("initial_capacity", initial_capacity)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
                raise InputError(f"new_state: {name} must be a positive int, got {v!r}")
        self.session = session
        self.bindings = list(session.bindings)
        self.capacity = None if capacity is None else int(capacity)
        self.initial_capacity = int(initial_capacity)
        self.allocator = SlabAllocator() if allocator is None and cache == "paged" else as_allocator(allocator)
        if cache_dtype not in (None, "float32", "float16", "bfloat16"):
            raise InputError(f"new_state: cache_dtype must be None, 'float32', 'float16' or 'bfloat16', "
                             f"got {cache_dtype!r}")
        if cache_dtype is not None and session.model.convention.kind != "group_query_attention":
            raise InputError(f"new_state: cache_dtype={cache_dtype!r} needs a GroupQueryAttention model (its cache "
                             f"is read only by the attention kernel); this model's cache is "
                             f"'{session.model.convention.kind}'")
        self.cache_dtype = cache_dtype
        self.steps = 0
        self._caches: dict[str, CacheTensor] | None = None
        self.declared = dict(session.declared_bindings)
        # Fixed for the state's life: checked or used on every run.
        self._bound = frozenset(self.bound_inputs)
        self._presents = {b.present: b.past for b in self.bindings}
        self._values: dict[str, tuple] = {}  # declared input -> (buffer, array)
        self._busy = threading.Lock()
        self._closed = False
        conv = session.model.convention
        self._static = conv.kind == "tensor_scatter"
        self._static_capacity = conv.capacity
        self._graph_inputs = {g.name: g for g in session.plan.inputs}
        self.cache = cache
        self._paged: PagedCache | None = None
        self._pool: BlockPool | None = None
        self._window: int | None = None
        self._selector = make_selector(kv_format)
        if self._selector is not None and cache != "paged":
            raise InputError(f"new_state: kv_format={kv_format!r} needs cache='paged'")
        self.kv_format = kv_format
        #: Header kind of quantized key pages: "float32" (per head), "compact" or "channel-zp" (groups = head_size).
        self._key_header = key_header(self._selector, "new_state", key_channel_scales, key_channel_zero_points)
        if cache == "paged":
            self._pool = _pool if _pool is not None else self._new_pool(block_size, max_pages)
            self._window = self._model_window()
            self._needs_data = self._pasts_read_elsewhere()
        if initial is not None:
            self.reset(initial)

    # -- properties --------------------------------------------------------
    @property
    def bound_inputs(self) -> list[str]:
        return [b.past for b in self.bindings] + list(self.declared)

    @property
    def paged(self) -> bool:
        return self.cache == "paged"

    @property
    def pool(self) -> BlockPool | None:
        """The page pool of a paged state (shared with its forks), else None."""
        return self._pool

    @property
    def values(self) -> dict[str, np.ndarray]:
        """Read-only views of the valid cache contents (positions ``[0, length)``), by past input name.

        Zero-copy for contiguous caches; a paged cache is gathered into copies.
        Contract-declared values are shown whole.
        """
        out = {}
        for name, c in (self._caches or {}).items():
            out[name] = c.gather() if self.paged else c.view()
        for name, (_, arr) in self._values.items():
            out[name] = arr.view()
        for v in out.values():
            v.flags.writeable = False
        return out

    @property
    def length(self) -> int:
        """Valid positions in the caches (the longest row; 0 before the first run).

        A growing cache: the positions its committed runs appended (less what
        ``truncate`` dropped).  A static (TensorScatter) cache: one past the
        highest position a committed run wrote (its capacity is held
        whatever the length).
        """
        return 0 if not self._caches else next(iter(self._caches.values())).length

    @property
    def lengths(self) -> np.ndarray:
        """Valid positions per batch row (int64 [B]): what each row has written (a contiguous row that
        rewrote earlier positions keeps its length, as :attr:`length` does)."""
        if self._paged is not None:
            return self._paged.table.lengths.copy()
        if not self._caches:
            return np.zeros(0, np.int64)
        return np.array(next(iter(self._caches.values())).lengths, np.int64)

    @property
    def batch(self) -> int:
        """Rows (sequences) of the caches (0 before the first run)."""
        return 0 if not self._caches else next(iter(self._caches.values())).batch

    @property
    def committed_bytes(self) -> int:
        """Bytes of persistent storage this state holds.

        Contiguous: whole cache capacities.  Paged: every page its tables
        reference, once, in its own format (pages shared with forks or
        checkpoints included).  Declared values: their storage, plus the
        payloads of pages ``QuantizePagedCache`` converted
        (:class:`~onnxkv.cache.page_set.PageSet`).
        """
        if self._paged is not None:
            return self._pool.pages_bytes(self._paged.table.held_ids())
        declared = 0
        for _, a in self._values.values():
            handle = PageSet.of(a)
            declared += a.nbytes + (handle.payload_bytes if handle is not None else 0)
        return sum(c.nbytes for c in (self._caches or {}).values()) + declared

    @property
    def closed(self) -> bool:
        return self._closed

    # -- cache management --------------------------------------------------
    def _geometry(self, name: str, batch: int) -> tuple[tuple[int, int, int], np.dtype]:
        g = self._graph_inputs[name]
        conv = self.session.model.convention
        dims = g.shape or (None,) * 4
        heads = dims[1] if isinstance(dims[1], int) else conv.kv_heads
        head = dims[3] if isinstance(dims[3], int) else conv.head_size
        if heads is None or head is None:
            raise StateError(f"State: cannot tell the KV heads / head size of '{name}' from the model")
        return (batch, heads, head), g.dtype

    def _new_cache(self, name: str, batch: int, length: int = 0) -> CacheTensor:
        shape, dtype = self._geometry(name, batch)
        if self._static:
            return CacheTensor(name, shape, dtype, self.allocator, self._static_capacity, static=True)
        cap = self.capacity if self.capacity is not None else max(self.initial_capacity, length)
        if length > cap:
            raise CacheCapacityError(f"State: initial length {length} exceeds the fixed capacity {cap}")
        return CacheTensor(name, shape, dtype, self.allocator, cap, growable=self.capacity is None,
                           storage=self.cache_dtype)

    # -- paged cache ---------------------------------------------------------
    def _new_pool(self, block_size: int, max_pages: int | None) -> BlockPool:
        if self.declared or not self.bindings:
            raise InputError("new_state: cache='paged' needs a model whose past/present pairs onnxkv runs in place "
                             f"(this model's cache is '{self.session.model.convention.kind}' with "
                             f"{'declared persistent bindings' if self.declared else 'no in-place binding'})")
        planes = []
        for b in self.bindings:
            (_, heads, head), dtype = self._geometry(b.past, 1)
            header = self._key_header if b.role == "key" else HEADER_FLOAT32
            planes.append(PlaneSpec(b.past, heads, head, self.cache_dtype or np.dtype(dtype).name, np.dtype(dtype).name,
                                    1 if header == HEADER_FLOAT32 else head, header))
        return BlockPool(planes, block_size, self.allocator, max_pages)

    def _model_window(self) -> int | None:
        """Keys before a query that GroupQueryAttention's ``local_window_size`` keeps visible (None: all)."""
        windows = set()
        for node in self.session.model.proto.graph.node:
            if node.op_type == "GroupQueryAttention":
                w = next((a.i for a in node.attribute if a.name == "local_window_size"), -1)
                windows.add(w - 1 if w > 0 else None)
        return windows.pop() if len(windows) == 1 else None

    def _pasts_read_elsewhere(self) -> set[str]:
        """Bound pasts whose data a node other than the joining node reads (they are fed gathered copies)."""
        joiner = {b.past: b.node for b in self.bindings}
        out = set()
        for node in self.session.model.proto.graph.node:
            if node.op_type == "Shape":
                continue
            for x in node.input:
                if x in joiner and joiner[x] != (node.name or node.output[0]):
                    out.add(x)
        return out

    def _new_paged(self, batch: int) -> PagedCache:
        static = self._static_capacity if self._static else None
        cache = PagedCache(self._pool, PageTable(self._pool, batch), static_length=static,
                           max_tokens=static if self._static else self.capacity)
        if self._static:  # every page of the capacity, zero-filled; nothing written yet (lengths 0)
            try:
                for plane in cache.planes.values():
                    plane.write(np.zeros((batch, plane.heads, static, plane.head_size), np.float32), 0, static)
                cache.commit()
            except Exception:
                cache.discard()
                cache.table.release()
                raise
            cache.table.lengths[:] = 0
        return cache

    def _ensure_caches(self, batch: int) -> dict:
        if self.paged:
            if self._paged is None:
                self._paged = self._new_paged(batch)
                self._caches = self._paged.planes
            elif self._paged.table.batch != batch:
                raise InputError(f"State.run: batch size {batch} differs from the state's {self._paged.table.batch}; "
                                 "reorder or reset the state first")
            return self._caches
        if self._caches is None:
            caches = {}
            try:
                for b in self.bindings:
                    caches[b.past] = self._new_cache(b.past, batch)
            except Exception:
                for c in caches.values():
                    c.release()
                raise
            self._caches = caches
        else:
            have = next(iter(self._caches.values())).batch if self._caches else batch
            if have != batch:
                raise InputError(f"State.run: batch size {batch} differs from the state's {have}; reset the state first")
        return self._caches

    def _release(self) -> None:
        if self._paged is not None:
            self._paged.discard()
            self._paged.table.release()
            self._paged = None
        else:
            for c in (self._caches or {}).values():
                c.release()
        self._caches = None
        for name in list(self._values):
            self._drop_value(name)

    # -- declared persistent values (GraphProto.persistent_bindings) -------
    def _store(self, name: str, array: np.ndarray) -> None:
        """Copy ``array`` into fresh persistent storage held as value ``name``."""
        buf, arr = checked.lease(self.allocator, array.nbytes, 64, array.dtype, array.shape, f"State '{name}'")
        arr[...] = array
        self._drop_value(name)
        bound.register(id(buf), arr)
        self._values[name] = (buf, arr)

    def _drop_value(self, name: str) -> None:
        held = self._values.pop(name, None)
        if held is not None:
            bound.unregister(id(held[0]))
            checked.release(self.allocator, [held[0]], f"State '{name}'")

    def _ensure_values(self) -> None:
        for name in self.declared:
            if name in self._values:
                continue
            g = self._graph_inputs[name]
            if g.shape is None or not all(isinstance(d, int) for d in g.shape):
                raise StateError(f"State: persistent input '{name}' has no static shape {g.shape}; "
                                 "give its first value with new_state(initial=...)")
            self._store(name, np.zeros(g.shape, g.dtype))

    def reset(self, initial: Mapping[str, np.ndarray] | None = None) -> None:
        """Drop the caches (back to empty), or start from ``initial`` contents (copied)."""
        self._check_open("reset")
        with self._exclusive("reset"):
            if initial is None:
                self._release()
                self.steps = 0
                return
            missing = [n for n in self.bound_inputs if n not in initial]
            unknown = [n for n in initial if n not in self.bound_inputs]
            if missing or unknown:
                raise InputError(f"State.reset: initial must give exactly the bound inputs {self.bound_inputs}; "
                                 f"missing {missing}, unknown {unknown}")
            arrays = {n: np.asarray(a) for n, a in initial.items()}
            if self.declared:
                self._release()
                for name, a in arrays.items():
                    g = self._graph_inputs[name]
                    if a.dtype != g.dtype:
                        raise InputError(f"State.reset: initial '{name}' has dtype {a.dtype}, expected {g.dtype}")
                    self._store(name, a)
                self.steps = 0
                return
            lengths = {a.shape[2] if a.ndim == 4 else None for a in arrays.values()}
            batches = {a.shape[0] if a.ndim == 4 else None for a in arrays.values()}
            if None in lengths or len(lengths) != 1 or len(batches) != 1:
                raise InputError("State.reset: initial arrays must be [batch, heads, length, head_size] "
                                 "with one batch size and one length")
            length, batch = lengths.pop(), batches.pop()
            if self.paged:
                self._reset_paged(arrays, batch, length)
                return
            new: dict[str, CacheTensor] = {}
            try:
                for name, a in arrays.items():
                    c = self._new_cache(name, batch, length)
                    new[name] = c
                    want = self._graph_inputs[name].dtype
                    if a.shape[1:] != (c.heads, a.shape[2], c.head_size) or a.dtype != want:
                        raise InputError(f"State.reset: initial '{name}' has shape {a.shape} {a.dtype}, expected "
                                         f"[{batch}, {c.heads}, L, {c.head_size}] {want}")
                    c.write(a, 0, c.capacity if self._static else length)
                    c.commit()
            except Exception:
                for c in new.values():
                    c.release()
                raise
            self._release()
            self._caches = new
            self.steps = 0

    def truncate(self, length: int) -> None:
        """Drop every cached position at and after ``length`` (speculative decoding's rollback).

        Only the valid lengths change: no payload byte is copied (a contiguous
        cache's positions are overwritten by later appends; a paged cache
        frees the pages wholly past ``length``).
        ``length`` must be in ``[0, state.length]``.  Static (TensorScatter)
        caches and contract-declared values cannot be truncated.
        """
        self._check_open("truncate")
        with self._exclusive("truncate"):
            if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
                raise InputError(f"State.truncate: length must be an int, got {length!r}")
            if self.declared or self._static:
                raise StateError("State.truncate: this state's values are not a growing KV cache "
                                 f"({'declared persistent bindings' if self.declared else 'static TensorScatter cache'})")
            if not 0 <= length <= self.length:
                raise InputError(f"State.truncate: length must be in [0, {self.length}], got {length}")
            if self._paged is not None:
                table = self._paged.table
                if self._window is not None and int(table.first.max(initial=0)) > max(0, length - self._window):
                    raise StateError(f"State.truncate: positions below {int(table.first.max())} were evicted by the "
                                     f"sliding window; cannot go back to length {length}")
                freed = table.truncate(int(length))
                self._log("truncate", allocations=0, cow_copied_bytes=0, prefix_copied_bytes=0,
                          extra={"pages_freed": freed})
                return
            for c in (self._caches or {}).values():
                c.length = int(length)

    def _reset_paged(self, arrays: dict, batch: int, length: int) -> None:
        cache = self._new_paged(batch) if self._static else \
            PagedCache(self._pool, PageTable(self._pool, batch), max_tokens=self.capacity)
        try:
            for name, a in arrays.items():
                plane = cache.planes[name]
                want = self._graph_inputs[name].dtype
                if a.shape != (batch, plane.heads, length, plane.head_size) or a.dtype != want:
                    raise InputError(f"State.reset: initial '{name}' has shape {a.shape} {a.dtype}, expected "
                                     f"[{batch}, {plane.heads}, {length}, {plane.head_size}] {want}")
                plane.write(a, 0, length)
            cache.commit()
        except Exception:
            cache.discard()
            cache.table.release()
            raise
        self._release()
        self._paged, self._caches = cache, cache.planes
        self.steps = 0

    # -- page formats (paged) ---------------------------------------------------
    def _choose_formats(self, past_length: int) -> list[tuple[int, str]]:
        """Ask the selector (user code) which planes' full pages to convert after this run; before commit.

        Returns (plane index, format name) pairs, every name a known page
        format.  A selector that raises or names an unknown format fails the
        run, which then leaves the state unchanged.
        """
        cache, pool = self._paged, self._pool
        chosen = []
        for layer, (k, v) in enumerate(self._layer_pairs()):
            new_k, new_v = cache.last_written.get(k), cache.last_written.get(v)
            if new_k is None:
                continue
            pair = self._selector(layer, past_length, new_k, new_v)
            if not isinstance(pair, (tuple, list)) or len(pair) != 2 or \
                    not all(f is None or isinstance(f, str) for f in pair):
                raise InputError(f"kv_format: the selector must return (k_format, v_format), each a page format "
                                 f"name or None, for layer {layer}; got {pair!r}")
            for name, fmt in zip((k, v), pair):
                if fmt is None:
                    continue
                fmt = page_format(fmt).name
                plane = pool.plane_index[name]
                if fmt != pool.planes[plane].storage:
                    chosen.append((plane, fmt))
        return chosen

    def _convert_formats(self, chosen: list[tuple[int, str]]) -> None:
        """Convert the full pages :meth:`_choose_formats` made eligible, after the run was committed.

        The run is already published, so a conversion that fails (the
        allocator refusing a payload) does not fail it: pages converted
        before the failure keep their new format, the others stay as they
        are (their values unchanged; a later run converts them), and the
        failure is logged as a ``quantize_failed`` event and warned about.
        """
        cache = self._paged
        residual = int(getattr(self._selector, "residual_tokens", 0))
        converted = copied = 0
        try:
            for plane, fmt in chosen:
                n, c = cache.convert_full_pages(plane, fmt, residual)
                converted += n
                copied += c
        except Exception as e:  # noqa: BLE001 - reported, never swallowed silently
            warnings.warn(f"State.run: converting full pages to the kv_format failed after the run was committed "
                          f"({type(e).__name__}: {e}); those pages keep their format", RuntimeWarning, stacklevel=3)
            self._log("quantize_failed", allocations=0)
        if converted:
            self._log("quantize", cow_copied_bytes=copied, extra={"pages_converted": converted})

    def quantize_pages(self, indices, k_format: str | None, v_format: str | None) -> None:
        """Convert logical blocks ``indices`` (full blocks of every row) of every layer to new formats.

        ``k_format``/``v_format``: a page format name (see
        :mod:`onnxkv.cache.formats`; a float format dequantizes) or None to
        leave that plane.  An integer format's parameters are chosen from
        each page's values in the plane's header kind
        (:meth:`~onnxkv.cache.paged.BlockPool.build_payload`: per head,
        per channel in a compact header, or one scale per head and a zero
        point per channel in a channel-zp header).  Only the selected pages
        are replaced, each new payload allocated once; other pages keep their
        storage.  Pages shared
        with other states or checkpoints are copied for this state first.
        Everything is validated and every new payload built before anything
        is published: an error (bad index, unknown format, OutOfMemory)
        leaves the state as it was.
        """
        with self._exclusive("quantize_pages"):
            cache = self._require_paged("quantize_pages")
            pool, bs, table = self._pool, self._pool.block_size, cache.table
            for f in (k_format, v_format):
                if f is not None:
                    page_format(f)  # raises InputError naming the value
            idx = np.asarray(indices)
            if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer) or len(set(idx.tolist())) != idx.size:
                raise InputError(f"State.quantize_pages: indices must be distinct ints, got {indices!r}")
            full = int(table.lengths.min()) // bs if table.batch else 0
            lo = int(table.first.max(initial=0)) // bs
            if idx.size and (idx.min() < lo or idx.max() >= full):
                raise InputError(f"State.quantize_pages: indices must be full blocks in [{lo}, {full}) of every "
                                 f"row, got {idx.tolist()}")
            planes = [(pool.plane_index[n], f) for k, v in self._layer_pairs()
                      for n, f in ((k, k_format), (v, v_format)) if f is not None]
            pages = sorted({int(p) for p in table.tables[:, idx].reshape(-1) if p >= 0})
            shared = [p for p in pages if pool.refcount(p) > int((table.tables == p).sum())]
            fresh = pool.allocate(len(shared)) if shared else np.zeros(0, np.int32)
            built = []
            try:
                for p, new in zip(shared, fresh.tolist()):
                    pool.copy_page(p, new, bs)
                target = {p: p for p in pages}
                target.update(dict(zip(shared, fresh.tolist())))
                for p in pages:
                    for plane, fmt in planes:
                        buf, arr = pool.build_payload(plane, target[p], fmt, bs)
                        built.append((plane, target[p], buf, arr, fmt))
            except BaseException:
                for _, _, buf, _, _ in built:
                    pool.discard_payload(buf)
                pool.decref(fresh)
                raise
            for plane, p, buf, arr, fmt in built:
                pool.install_payload(plane, p, buf, arr, fmt)
            for p, new in zip(shared, fresh.tolist()):
                places = table.tables == p
                pool.incref(np.full(int(places.sum()) - 1, new, np.int32))
                table.tables[places] = new
                pool.decref(np.full(int(places.sum()), p, np.int32))
            self._log("quantize", cow_copied_bytes=len(shared) * pool.page_bytes,
                      extra={"pages_converted": len(pages)})

    # -- copy-on-write operations (paged) -------------------------------------
    def _require_paged(self, api: str) -> PagedCache:
        self._check_open(api)
        if not self.paged:
            raise StateError(f"State.{api}: needs a paged state (session.new_state(cache='paged')); "
                             f"this state's cache is '{self.cache}'")
        if self._paged is None:
            raise StateError(f"State.{api}: the state holds no cache yet (run it first)")
        return self._paged

    def _log(self, action: str, **counters: int) -> None:
        log = self.session.events
        if log.enabled:
            st = self.allocator.stats()
            log.record(max(self.session._step - 1, 0), "", "", action, committed=st.committed, live=st.live,
                       peak=st.peak, **counters)

    def fork(self, n: int = 1) -> list[State]:
        """``n`` new states sharing every page of this one (copy-on-write); no payload byte is copied.

        Each fork continues independently; the first write into a shared page
        copies that page only (``cow_copied_bytes``).  ``n`` is an int in
        ``[1, MAX_FORKS]`` (InputError otherwise, before any fork is made).
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= MAX_FORKS:
            raise InputError(f"State.fork: n must be an int in [1, {MAX_FORKS}], got {n!r}")
        with self._exclusive("fork"):
            cache = self._require_paged("fork")
            out = []
            for _ in range(int(n)):
                st = State(self.session, capacity=self.capacity, initial_capacity=self.initial_capacity,
                           allocator=self.allocator, cache_dtype=self.cache_dtype, cache="paged",
                           kv_format=self.kv_format, key_channel_scales=self._key_header == HEADER_COMPACT,
                           key_channel_zero_points=self._key_header == HEADER_CHANNEL_ZP, _pool=self._pool)
                st._paged = PagedCache(self._pool, cache.table.share(), cache.static_length, cache.max_tokens)
                st._caches = st._paged.planes
                st.steps = self.steps
                out.append(st)
            self._log("fork", allocations=0, cow_copied_bytes=0, prefix_copied_bytes=0)
            return out

    def reorder(self, indices) -> None:
        """Row ``i`` becomes old row ``indices[i]`` (beam search); ``len(indices)`` may differ from the batch.

        Page tables are permuted and reference counts adjusted; no payload
        byte is copied.
        """
        with self._exclusive("reorder"):
            cache = self._require_paged("reorder")
            idx = np.asarray(indices)
            if idx.ndim != 1 or idx.size == 0 or not np.issubdtype(idx.dtype, np.integer):
                raise InputError(f"State.reorder: indices must be a non-empty 1-D int array, got {indices!r}")
            b = cache.table.batch
            if idx.min() < 0 or idx.max() >= b:
                raise InputError(f"State.reorder: indices must be in [0, {b}), got {idx.tolist()}")
            new = cache.table.share(idx)
            cache.table.release()
            cache.table = new
            self._log("reorder", allocations=0, cow_copied_bytes=0, prefix_copied_bytes=0)

    def checkpoint(self) -> Checkpoint:
        """The cache contents now, held by page references (no copy); see :meth:`restore`."""
        with self._exclusive("checkpoint"):
            cache = self._require_paged("checkpoint")
            cp = Checkpoint(self, cache.table.share(), self.steps)
            self._log("checkpoint", allocations=0, cow_copied_bytes=0, prefix_copied_bytes=0)
            return cp

    def restore(self, checkpoint: Checkpoint) -> None:
        """Return the caches to ``checkpoint`` (made by this state, not released); no payload copy."""
        with self._exclusive("restore"):
            cache = self._require_paged("restore")
            if not isinstance(checkpoint, Checkpoint) or checkpoint._state is not self:
                raise InputError("State.restore: the checkpoint was not made by this state")
            if checkpoint.table is None:
                raise StateError("State.restore: the checkpoint was released")
            new = checkpoint.table.share()
            cache.table.release()
            cache.table = new
            self.steps = checkpoint.steps
            self._log("restore", allocations=0, cow_copied_bytes=0, prefix_copied_bytes=0)

    # -- serialisation (paged) ----------------------------------------------------
    def _layer_pairs(self) -> list[tuple[str, str]]:
        pairs: dict[int, dict[str, str]] = {}
        for b in self.bindings:
            pairs.setdefault(b.layer, {})[b.role] = b.past
        return [(p["key"], p["value"]) for _, p in sorted(pairs.items())]

    def _signature(self) -> str:
        conv = self.session.model.convention
        shapes = ";".join(f"{g.name}:{g.dtype}:{g.shape}" for g in self.session.plan.inputs)
        return hashlib.sha256(f"{conv.kind}|{shapes}".encode()).hexdigest()

    def save_cache(self, path: str | os.PathLike | None = None) -> bytes:
        """Serialise the committed cache as a ``PagedCacheProto`` (see :mod:`onnxkv.cache.serialize`).

        Returns the bytes and, if ``path`` is given, writes them there
        atomically (:func:`onnxkv.cache.serialize.save`: a temporary file
        readable by its owner only replaces ``path``).  Paged states only.
        """
        with self._exclusive("save_cache"):
            cache = self._require_paged("save_cache")
            snapshot = take_snapshot(cache, self._layer_pairs(), self._signature())
        return serialize.encode(snapshot) if path is None else serialize.save(snapshot, path)

    def load_cache(self, source: bytes | str | os.PathLike) -> None:
        """Replace the caches by a saved cache (bytes or a file from :meth:`save_cache`); all or nothing.

        The next run continues exactly where the saved state stopped.  A
        cache file is untrusted input; before the state's pool gives a page
        or the page table is allocated, the load checks:

        * size: a path must name a regular file; with ``max_pages``, a file
          larger than the pool could hold
          (:func:`onnxkv.cache.snapshot.file_bytes_limit`) is refused from
          its size, before it is read or parsed (InputError);
        * the frame (:func:`onnxkv.cache.serialize.decode`): header, CRC,
          body length against the bytes present, protobuf encoding
          (SerializationError);
        * the model, before a layer, row or block is decoded
          (:func:`onnxkv.cache.snapshot.expectation`): signature, block
          size, layer names, heads, head sizes, dtype, and with
          ``max_pages`` at most that many rows (InputError);
        * every rule of :func:`onnxkv.cache.serialize.validate` -- each
          position of ``[first_position, length)`` of every row and layer is
          held by exactly one block whose payload sizes match its length,
          heads, head size and format; quantization scales finite and > 0
          (SerializationError);
        * the state (:func:`onnxkv.cache.snapshot.paged_from_snapshot`):
          quantized payloads' scale groups and header kinds, lengths within
          the capacity, first positions leaving every position the model's
          window reads (0 for models without a window), a page table no
          larger than the payload the file carries (InputError), and pages
          within the pool's free pages (OutOfMemory).

        On any error the state, its pool, its forks and checkpoints are
        exactly as they were (tables, lengths, reference counts, payloads,
        allocator bytes).  Raises :class:`~onnxkv.errors.StateError` on a
        contiguous state, and :class:`~onnxkv.errors.InputError` for a
        ``source`` that is neither bytes nor a path, or a file that cannot
        be read (the OSError chained).
        """
        self._check_open("load_cache")
        if not self.paged:
            raise StateError(f"State.load_cache: needs a paged state (session.new_state(cache='paged')); this "
                             f"state's cache is '{self.cache}'")
        limit = file_bytes_limit(self._pool)
        expected = expectation(self._pool, self._layer_pairs(), self._signature(), "State.load_cache")
        if isinstance(source, (bytes, bytearray, memoryview)):
            snap = serialize.decode(source, limit, expected)
        elif isinstance(source, (str, os.PathLike)):
            try:
                snap = serialize.load(source, limit, expected)
            except OSError as e:
                raise InputError(f"State.load_cache: cannot read {os.fspath(source)!r}: {e}") from e
        else:
            raise InputError(f"State.load_cache: source must be bytes or a path, got {type(source).__name__}")
        with self._exclusive("load_cache"):
            cache = paged_from_snapshot(snap, self._pool, self._layer_pairs(),
                                        self._static_capacity if self._static else self.capacity,
                                        self._window, "State.load_cache")
            cache.static_length = self._static_capacity if self._static else None
            self._release()
            self._paged, self._caches = cache, cache.planes
            self.steps = 0

    def close(self) -> None:
        """Release the caches; the state cannot be used afterwards."""
        if not self._closed:
            with self._exclusive("close"):
                self._release()
                self._closed = True

    def __enter__(self) -> State:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self, api: str) -> None:
        if self._closed:
            raise StateError(f"State.{api}: the state is closed")

    @contextlib.contextmanager
    def _exclusive(self, api: str) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise StateError(f"State.{api}: another call is running on this state (calls must not overlap)")
        try:
            yield
        finally:
            self._busy.release()

    # -- running -------------------------------------------------------------
    def run(self, feeds: Mapping[str, np.ndarray], output_names: list[str] | None = None,
            cancel: Cancellation | None = None) -> dict[str, np.ndarray]:
        """Run one step: bound past inputs come from the state, the caller feeds the rest.

        Returns the requested outputs (default: every output that is not a
        bound present).  A bound present asked for by name is exported as a
        copy of the valid cache (counted as an ``export`` event).

        Raises:
            StateError: the state is closed, busy, or a bound input was fed.
            InputError / OperatorError / CacheCapacityError / Cancelled: the
                run failed; the state is unchanged.
        """
        self._check_open("run")
        if not self._bound.isdisjoint(feeds):
            fed = sorted(self._bound.intersection(feeds))
            raise StateError(f"State.run: {fed} are bound to the state's caches and must not be fed")
        presents = self._presents
        if output_names is None:
            output_names = [n for n in self.session.output_names
                            if n not in presents and n not in self.declared.values()]
        if self.declared:
            with self._exclusive("run"):
                return self._run_declared(feeds, output_names, cancel)
        with self._exclusive("run"):
            batch = self._batch(feeds)
            fresh = self._caches is None
            caches = self._ensure_caches(batch)
            before = self.length
            full = dict(feeds)
            past = self._static_capacity if self._static else None  # a static cache's past: its capacity
            if self._paged is not None:  # the selector sees this run's writes only
                self._paged.last_written.clear()
            try:
                if self.paged:
                    for name, c in caches.items():
                        full[name] = c.gather(past) if name in self._needs_data else c.placeholder(past or c.length)
                else:
                    for name, c in caches.items():
                        full[name] = c.view(past)
                out = self.session._run_plan(full, output_names, caches, self.allocator, cancel)
                chosen = self._choose_formats(before) if self._selector is not None else []
            except BaseException:
                for c in caches.values():
                    c.discard()
                if fresh:  # the first run made the caches: a failure leaves the state holding nothing, as before
                    self._release()
                raise
            for c in caches.values():
                c.commit()
            self.steps += 1
            if chosen:
                self._convert_formats(chosen)
            if self._paged is not None and self._window is not None:
                freed = self._paged.table.evict(self._window)
                if freed:
                    self._log("evict", allocations=0, extra={"pages_freed": freed})
            for name in output_names:
                if name in presents:
                    out[name] = self._export(name, out[name], caches[presents[name]])
            return out

    def _run_declared(self, feeds, output_names: list[str], cancel) -> dict[str, np.ndarray]:
        """Run with contract-declared persistent bindings; publish outputs after success.

        Kernels writing the values in place save what they overwrite and put it back if the run fails
        (:meth:`~onnxkv.plan.context.RunContext.preserve`); values a first run made are dropped again.
        """
        fresh = [name for name in self.declared if name not in self._values]
        try:
            self._ensure_values()
            full = dict(feeds)
            for name, (_, arr) in self._values.items():
                full[name] = arr
            fetch = list(dict.fromkeys(list(output_names) + list(self.declared.values())))
            own = {name: arr for name, (_, arr) in self._values.items()}
            out = self.session._run_plan(full, fetch, own, self.allocator, cancel)
        except BaseException:
            for name in fresh:
                self._drop_value(name)
            raise
        for name, produced in self.declared.items():
            value = out[produced]
            mine = self._values[name][1]
            if not (value.shape == mine.shape and
                    value.__array_interface__["data"][0] == mine.__array_interface__["data"][0]):
                self._store(name, value)  # not written in place: publish the new value
        self.steps += 1
        return {n: (np.array(out[n]) if n in self.declared.values() else out[n]) for n in output_names}

    def _export(self, present: str, value: np.ndarray, cache=None) -> np.ndarray:
        model_dtype = self._graph_inputs[cache.name].dtype if cache is not None else value.dtype
        if self.paged and cache is not None:
            copy = cache.as_float32(value.shape[2]).astype(model_dtype, copy=False)
        elif cache is not None and value.dtype != model_dtype:
            copy = cache.as_float32(value.shape[2]).astype(model_dtype, copy=False)
        else:
            copy = np.array(value, copy=True)
        log = self.session.events
        if log.enabled:
            st = self.allocator.stats()
            log.record(self.session._step - 1, present, "export", "export", allocations=1,
                       allocated_bytes=copy.nbytes, prefix_copied_bytes=copy.nbytes,
                       committed=st.committed, live=st.live, peak=st.peak)
        return copy

    def _batch(self, feeds: Mapping[str, np.ndarray]) -> int:
        ids = self.session.model.io.input_ids
        batch = None
        if ids and ids in feeds:
            batch = int(np.shape(feeds[ids])[0])
        else:
            batch = next((int(np.shape(v)[0]) for v in feeds.values() if np.ndim(v) >= 1), None)
        if batch is None:
            raise InputError("State.run: cannot tell the batch size from the feeds")
        if batch < 1:
            raise InputError(f"State.run: the feeds hold a batch of {batch} rows; a state runs at least one row")
        return batch

    def __del__(self) -> None:
        try:
            self._release()
        except Exception:
            pass
