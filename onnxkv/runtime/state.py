"""Persistent per-request state: caches that live across runs, updated in place.

``state = session.new_state(...)`` then ``state.run(feeds)`` for every step of
one request.  Every input the plan binds is fed from the state's storage, a
strategy behind the :class:`~onnxkv.runtime.stores.protocol.Store` protocol:
contiguous caches (:mod:`onnxkv.runtime.stores.contiguous`), pages with
copy-on-write (:mod:`onnxkv.runtime.stores.paged`) or contract-declared
values (:mod:`onnxkv.runtime.stores.declared`).  The state keeps the
request's rules: one call at a time, cancellation, and publishing a run only
after it succeeded.

Atomicity: a failed or cancelled run -- whichever node it stopped after --
leaves every value, length, page table, page and ``committed_bytes`` exactly
as before, so the call can be retried.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping

import numpy as np

from onnxkv.alloc import SlabAllocator, as_allocator
from onnxkv.cache.paged import BlockPool
from onnxkv.cache.policy import key_header, make_selector
from onnxkv.errors import InputError, StateError
from onnxkv.runtime.state_paged import PagedOperations
from onnxkv.runtime.stores import Checkpoint, ContiguousStore, DeclaredStore, PagedStore, StoreContext

__all__ = ["State", "Cancellation", "Checkpoint"]

_CACHES = ("contiguous", "paged")


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


class State(PagedOperations):
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
            lane ``i`` holds plane ``i``'s pages.  ``stats()`` of this
            allocator is what the event log reports.
        cache_dtype: store the caches as ``"float16"`` or ``"bfloat16"`` instead of
            the model's type (GroupQueryAttention models only; values are
            rounded to nearest even on append).  ``values`` then shows the
            stored format (bfloat16 as uint16 bits).
        cache: ``"contiguous"`` (one buffer per cache value, grown geometrically)
            or ``"paged"`` (pages of ``block_size`` tokens with copy-on-write;
            ``capacity`` then caps the positions per sequence).
        block_size: tokens per page (paged).
        max_pages: at most this many pages live in the pool (paged; None =
            unbounded); running out raises :class:`~onnxkv.errors.OutOfMemory`
            before anything is written.
        kv_format: page formats of a paged cache (see :mod:`onnxkv.cache.policy`):
            None (native pages), a policy name ("fp16", "int8", "int8-head",
            "residual-int4", ...) or a ``FormatSelector`` callable ``(layer,
            past_length, k, v) -> (k_format, v_format)``.  After every
            successful run the full pages the selector makes eligible are
            converted (each page once, allocated once).
        key_channel_scales: quantized key pages get one scale and zero point
            per channel (KIVI, compact headers; also set by a policy such as "int8-kivi").
        key_channel_zero_points: quantized key pages get one scale per head
            and one zero point per channel (channel-zp headers; also set by a
            policy such as "int8").  Mutually exclusive with ``key_channel_scales``.

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
        self.cache = cache
        self.steps = 0
        self.declared = dict(session.declared_bindings)
        self._bound = frozenset(self.bound_inputs)
        self._presents = {b.present: b.past for b in self.bindings}
        self._busy = threading.Lock()
        self._closed = False
        selector = make_selector(kv_format)
        if selector is not None and cache != "paged":
            raise InputError(f"new_state: kv_format={kv_format!r} needs cache='paged'")
        self.kv_format = kv_format
        #: Header kind of quantized key pages: "float32" (per head), "compact" or "channel-zp" (groups = head_size).
        self._key_header = key_header(selector, "new_state", key_channel_scales, key_channel_zero_points)
        self._ctx = StoreContext(session, self.allocator, self.capacity, self.initial_capacity, cache_dtype)
        if cache == "paged":
            self._store = PagedStore(self._ctx, selector, self._key_header, block_size, max_pages, _pool)
        else:
            self._store = DeclaredStore(self._ctx) if self.declared else ContiguousStore(self._ctx)
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
        return self._store.pool if self.paged else None

    @property
    def values(self) -> dict[str, np.ndarray]:
        """Read-only views of the valid cache contents (positions ``[0, length)``), by bound input name.

        Zero-copy for contiguous caches; a paged cache is gathered into copies.
        Contract-declared values are shown whole.
        """
        out = self._store.values
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
        caches = self._store.caches
        return 0 if not caches else next(iter(caches.values())).length

    @property
    def lengths(self) -> np.ndarray:
        """Valid positions per batch row (int64 [B]): what each row has written (a contiguous row that
        rewrote earlier positions keeps its length, as :attr:`length` does)."""
        caches = self._store.caches
        return np.array(next(iter(caches.values())).lengths, np.int64) if caches else np.zeros(0, np.int64)

    @property
    def batch(self) -> int:
        """Rows (sequences) of the caches (0 before the first run)."""
        caches = self._store.caches
        return 0 if not caches else next(iter(caches.values())).batch

    @property
    def committed_bytes(self) -> int:
        """Bytes of persistent storage this state holds (see each store's ``committed_bytes``)."""
        return self._store.committed_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    # The storage a store holds, for tests and audits (read only).
    _caches = property(lambda self: self._store.caches)
    _paged = property(lambda self: self._store.cache if self.paged else None)
    _values = property(lambda self: self._store.held if isinstance(self._store, DeclaredStore) else {})
    _static = property(lambda self: self._ctx.static)
    _static_capacity = property(lambda self: self._ctx.static_capacity)
    _layer_pairs = property(lambda self: self._store.layer_pairs)

    # -- request rules -----------------------------------------------------------
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

    def run(self, feeds: Mapping[str, np.ndarray], output_names: list[str] | None = None,
            cancel: Cancellation | None = None) -> dict[str, np.ndarray]:
        """Run one step: bound inputs come from the state, the caller feeds the rest.

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
        presents, produced = self._presents, self.declared.values()
        if output_names is None:
            output_names = [n for n in self.session.output_names if n not in presents and n not in produced]
        with self._exclusive("run"):
            store = self._store
            own = store.prepare(feeds)
            try:
                fetch = list(dict.fromkeys([*output_names, *produced]))
                out = self.session._run_plan(store.feeds(feeds), fetch, own, self.allocator, cancel)
                store.finish()
            except BaseException:
                store.discard()
                raise
            store.commit(out)
            self.steps += 1
            for name in output_names:
                if name in presents:
                    out[name] = self._ctx.export(name, out[name], own[presents[name]], self.paged)
            return {n: (np.array(out[n]) if n in produced else out[n]) for n in output_names}

    # -- contents ------------------------------------------------------------------
    def reset(self, initial: Mapping[str, np.ndarray] | None = None) -> None:
        """Drop the caches (back to empty), or start from ``initial`` contents (copied); all or nothing."""
        self._check_open("reset")
        with self._exclusive("reset"):
            if initial is not None:
                missing = [n for n in self.bound_inputs if n not in initial]
                unknown = [n for n in initial if n not in self.bound_inputs]
                if missing or unknown:
                    raise InputError(f"State.reset: initial must give exactly the bound inputs {self.bound_inputs}; "
                                     f"missing {missing}, unknown {unknown}")
                self._store.reset({n: np.asarray(a) for n, a in initial.items()})
            else:
                self._store.close()
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
            if self._store.caches:
                self._store.truncate(int(length))

    def close(self) -> None:
        """Release the caches; the state cannot be used afterwards."""
        if not self._closed:
            with self._exclusive("close"):
                self._store.close()
                self._closed = True

    def __enter__(self) -> State:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._store.close()
        except Exception:
            pass
