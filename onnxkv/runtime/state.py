"""Persistent per-request state: caches that live across runs, updated in place.

``state = session.new_state(...)`` then ``state.run(feeds)`` for every step of
one request.  Every input the plan binds is fed from the state's storage, a
:class:`~onnxkv.runtime.stores.protocol.Store`: contiguous caches, pages with
copy-on-write, or contract-declared values (:mod:`onnxkv.runtime.stores`).
The state keeps the request's rules: one call at a time, cancellation, and
publishing a run only after it succeeded -- a failed or cancelled run leaves
every value, length, page table, page and ``committed_bytes`` exactly as
before, so the call can be retried.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from onnxkv.alloc import SlabAllocator, as_allocator
from onnxkv.cache.paged import BlockPool
from onnxkv.cache.policy import key_header, make_selector
from onnxkv.errors import InputError, StateError
from onnxkv.plan.step_loop import DecodeNames, Draws, StepsRun, check_steps
from onnxkv.runtime.cancellation import Cancellation
from onnxkv.runtime.state_paged import PagedAPI
from onnxkv.runtime.stores import Checkpoint, ContiguousStore, DeclaredStore, PagedStore, StoreContext
from onnxkv.runtime.stores.protocol import as_arrays

__all__ = ["State", "Cancellation", "Checkpoint", "DecodeNames", "Draws"]  # the last two: decode_steps' types

_CACHES = ("contiguous", "paged")


class State(PagedAPI):
    """One request's persistent values (see the module docstring).

    Args:
        session: the :class:`~onnxkv.Session` whose plan runs.
        initial: bound input name -> array [B, H, L, D] to start from (copied in; all, one length).
        capacity: fixed capacity in positions (per sequence when paged; overflow raises
            :class:`~onnxkv.errors.CacheCapacityError`); None = grow geometrically from ``initial_capacity``.
        allocator: persistent allocator of the caches (its ``stats()`` are what the event log reports).
            Default: a :class:`~onnxkv.alloc.SystemAllocator`; paged, a :class:`~onnxkv.alloc.SlabAllocator`
            whose lane ``i`` holds plane ``i``'s pages.
        cache_dtype: store the caches as ``"float16"`` or ``"bfloat16"`` (rounded to nearest even;
            GroupQueryAttention models; ``values`` shows the stored format, bfloat16 as uint16 bits).
        cache: ``"contiguous"`` (one buffer per cache value, grown geometrically) or ``"paged"`` (pages of
            ``block_size`` tokens with copy-on-write, at most ``max_pages`` live, None = unbounded: running
            out raises :class:`~onnxkv.errors.OutOfMemory` before anything is written).
        kv_format: page formats of a paged cache (:mod:`onnxkv.cache.policy`): None, a policy name or a
            ``FormatSelector`` ``(layer, past_length, k, v) -> (k_format, v_format)``; after every run the
            full pages it makes eligible are converted (each page once).
        key_channel_scales: quantized key pages get a scale and zero point per channel (KIVI, compact
            headers; policy "int8-kivi" sets it).
        key_channel_zero_points: a scale per head and a zero point per channel (channel-zp headers;
            policy "int8" sets it).  Not both.

    :func:`~onnxkv.runtime.cache_config.state_keywords` makes the keywords of a ``CacheConfig``.
    One state per request, many per session; two states never share writable storage.  Calls on one
    state must not overlap (a second concurrent call raises :class:`~onnxkv.errors.StateError`).
    """

    def __init__(
        self,
        session,
        initial: Mapping[str, np.ndarray] | None = None,
        capacity: int | None = None,
        initial_capacity: int = 32,
        allocator=None,
        cache_dtype: str | None = None,
        cache: str = "contiguous",
        block_size: int = 16,
        max_pages: int | None = None,
        kv_format=None,
        key_channel_scales: bool = False,
        key_channel_zero_points: bool = False,
        _pool: BlockPool | None = None,
    ) -> None:
        #: The storage keywords (every parameter but the session, the contents and the pool): a fork's.
        self._keywords = {k: v for k, v in locals().items() if k not in ("self", "session", "initial", "_pool")}
        if cache not in _CACHES:
            raise InputError(f"new_state: cache must be one of {_CACHES}, got {cache!r}")
        self.session = session
        self.bindings = list(session.bindings)
        self.allocator = SlabAllocator() if allocator is None and cache == "paged" else as_allocator(allocator)
        #: A page allocator of the state's own: its empty chunks go to the process's chunk reserve at close.
        self._own_slab = allocator is None and cache == "paged"
        self._ctx = StoreContext(session, self.allocator, capacity, initial_capacity, cache_dtype)
        self.capacity, self.initial_capacity = self._ctx.capacity, self._ctx.initial_capacity
        self.cache_dtype, self.cache, self.kv_format, self.steps = cache_dtype, cache, kv_format, 0
        self.declared = dict(session.declared_bindings)
        self._bound = frozenset(self.bound_inputs)
        self._presents = {b.present: b.past for b in self.bindings}
        self._busy = threading.Lock()
        self._closed = False
        selector = make_selector(kv_format)
        if selector is not None and cache != "paged":
            raise InputError(f"new_state: kv_format={kv_format!r} needs cache='paged'")
        #: Header kind of quantized key pages: "float32" (per head), "compact" or "channel-zp" (groups = head_size).
        self._key_header = key_header(selector, "new_state", key_channel_scales, key_channel_zero_points)
        if cache == "paged":
            self._store = PagedStore(self._ctx, selector, self._key_header, block_size, max_pages, _pool)
        else:
            self._store = DeclaredStore(self._ctx) if self.declared else ContiguousStore(self._ctx)
        if initial is not None:
            self.reset(initial)

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
        """Read-only views of the valid cache contents (positions ``[0, length)``) by bound input name: zero
        copy for contiguous caches, gathered copies of a paged cache, declared values whole; in the dtype held."""
        out = self._store.values
        for v in out.values():
            v.flags.writeable = False
        return out

    @property
    def length(self) -> int:
        """Valid positions in the caches (the longest row; 0 before the first run): what committed runs
        appended, less what ``truncate`` dropped; a static (TensorScatter) cache: one past the highest
        position a committed run wrote (its capacity is held whatever the length)."""
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

    @property
    def page_tables(self) -> np.ndarray | None:
        """A paged state's page tables (None for another cache; a read-only copy): int32 [batch, max_blocks],
        [b, i] the :attr:`pool` page id of row b's block i, -1: none (not written yet, or evicted)."""
        return self._store.committed_table("tables") if self.paged else None

    @property
    def first_positions(self) -> np.ndarray | None:
        """A paged state's first position still held per row (None for another cache; a read-only copy),
        int64 [batch]: above 0 once a sliding window evicted the pages before it."""
        return self._store.committed_table("first") if self.paged else None

    # The storage a store holds, for tests and audits (read only).
    _caches = property(lambda self: self._store.caches)
    _static = property(lambda self: self._ctx.static)
    _static_capacity = property(lambda self: self._ctx.static_capacity)
    _layer_pairs = property(lambda self: self._store.layer_pairs)

    def _check_open(self, api: str) -> None:
        if self._closed:
            raise StateError(f"State.{api}: the state is closed")

    def _check_feeds(self, api: str, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self._check_open(api)
        if not self._bound.isdisjoint(feeds):
            fed = sorted(self._bound.intersection(feeds))
            raise StateError(f"State.{api}: {fed} are bound to the state's caches and must not be fed")
        return as_arrays(f"State.{api}", feeds)

    @contextlib.contextmanager
    def _exclusive(self, api: str) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise StateError(f"State.{api}: another call is running on this state (calls must not overlap)")
        try:
            yield
        finally:
            self._busy.release()

    def run(
        self,
        feeds: Mapping[str, np.ndarray],
        output_names: list[str] | None = None,
        cancel: Cancellation | None = None,
        logits_at=None,
        *,
        before_commit: Callable[[dict], object] | None = None,
        segments=None,
        gaps_padding: bool = False,
    ) -> dict[str, np.ndarray]:
        """Run one step: bound inputs come from the state, the caller feeds the rest (``logits_at``: as
        :meth:`Session.run`'s).  ``before_commit`` is called with the outputs before the run is committed:
        if it raises, the run is discarded (the state as before; values a model's contract declares are
        written in place by its own nodes and keep the run) and the error propagates.

        ``segments`` (a paged state holding B rows; int [B], counts >= 0 summing to T): a run of segments,
        the token ids fed as [1, T], row 0's next ``segments[0]`` tokens, then row 1's, ... (0: the row is
        not run), each continuing at its row's length, over its own page table (token-wise feeds such as
        ``position_ids`` follow the same axis).  Its attention nodes must take segments
        (:attr:`Session.takes_segments`); the engine batches decode rows and prompt chunks of different
        lengths this way.  ``logits_at`` then holds [1, K] positions of that axis.  ``gaps_padding`` (paged
        rows of different lengths; an Attention graph sees the longest row's past): True when the feeds pad
        each row's unwritten positions, which its attention then drops whatever the graph's mask holds there
        (a finite bias such as -1e9); False: the mask must hide them, else InputError.

        Returns the requested outputs (default: every output that is not a bound present; one asked
        for by name is exported as a copy of the valid cache, an ``export`` event).  Raises StateError
        (closed, busy, a bound input fed) or, with the state unchanged, InputError / OperatorError /
        CacheCapacityError / Cancelled.
        """
        feeds = self._check_feeds("run", feeds)
        presents, produced = self._presents, self.declared.values()
        if output_names is None:
            output_names = [n for n in self.session.output_names if n not in presents and n not in produced]
        with self._exclusive("run"):
            store = self._store
            if segments is not None and not (self.paged and self.session.takes_segments):
                raise InputError(
                    "State.run: segments need a paged state of a model whose attention takes them "
                    "(Session.takes_segments)"
                )
            if not isinstance(gaps_padding, bool) or (gaps_padding and not self.paged):
                raise InputError(
                    f"State.run: gaps_padding must be a bool, True only on a paged state, got {gaps_padding!r}"
                )
            own = store.prepare(feeds, segments, gaps_padding) if self.paged else store.prepare(feeds)
            try:
                fetch = list(dict.fromkeys([*output_names, *produced]))
                out = self.session._run_plan(store.feeds(feeds), fetch, own, self.allocator, cancel, logits_at)
                store.finish()
                if before_commit is not None:
                    before_commit(out)
            except BaseException:
                store.discard()
                raise
            store.commit(out)
            self.steps += 1
            for name in output_names:
                if name in presents:
                    out[name] = self._ctx.export(name, out[name], own[presents[name]], self.paged)
            return {n: (np.array(out[n]) if n in produced else out[n]) for n in output_names}

    def decode_steps(
        self,
        feeds: Mapping[str, np.ndarray],
        count: int,
        names: DecodeNames,
        eos: Sequence[int] | Sequence[Sequence[int]] = (),
        draws: Draws | None = None,
        finished: np.ndarray | None = None,
        pad: int = 0,
    ) -> StepsRun | None:
        """Run up to ``count`` decode steps of B rows in one call (a compiled generation loop).

        ``feeds`` are the first step's feeds, as for :meth:`run`; ``names`` say which are the token ids, the
        mask (all ones, or each row's ones first: a right-padded batch), the positions and the logits.  Each
        later step feeds each row's argmax of the previous step's logits (ties: the lowest id), or the token
        ``draws`` draws from them (row ``b`` of step ``t``: ``uniforms[t * B + b]``), or ``pad`` for a row
        that has ended (``finished``: bool [B] or None, updated in place; a row ends after an id in ``eos``,
        or ``eos[b]``), a mask one column longer and the next positions (:func:`.step_loop.run_steps`).  They
        stop after ``count``, once every row has ended, when a cache is full, or before a step :meth:`run`
        must take; run in C, they leave what the steps through :meth:`run` leave.  Returns the ids and times
        (:class:`.step_loop.StepsRun`), or None with nothing run: a declared or static cache, a paged one
        with a format selector or quantized pages, the event log on, or no step recorded for the plan.

        Raises:
            StateError: closed, busy, or a bound input fed.
            InputError: ``feeds`` do not fit the model's inputs (a token id its vocabulary, as :meth:`run`), or
                ``count``, ``names``, ``eos``, ``draws``, ``finished`` or ``pad`` are not what ``check_steps`` takes.
            MemoryError: a kernel could not allocate its workspace; the state is unchanged.
        """
        feeds = self._check_feeds("decode_steps", feeds)
        self.session._check_token_ids(feeds.get(self.session.model.io.input_ids), "State.decode_steps")
        check_steps("State.decode_steps", count, draws, names, eos, self.session.plan.slot_of, finished, pad)
        with self._exclusive("decode_steps"):
            if self.session.events.enabled:
                return None
            with self.session._threads(1, lazy_blas=True):  # kernels only, in C: BLAS is never called
                run = self._store.decode_steps(self.session.plan, feeds, count, names, eos, draws, finished, pad)
            self.steps += run.steps if run is not None else 0
            return run

    def reset(self, initial: Mapping[str, np.ndarray] | None = None) -> None:
        """Drop the caches (back to empty), or start from ``initial`` contents (copied); all or nothing."""
        self._check_open("reset")
        with self._exclusive("reset"):
            if initial is not None:
                self._ctx.check_initial(initial, self.bound_inputs)
                self._store.reset(self._ctx.held(initial))
            else:
                self._store.close()
            self.steps = 0

    def truncate(self, length: int) -> None:
        """Drop every cached position at and after ``length`` in ``[0, state.length]`` (speculative decoding's
        rollback): only lengths change (a paged cache frees the pages wholly past ``length``).  Static
        (TensorScatter) caches and contract-declared values cannot be truncated."""
        self._check_open("truncate")
        with self._exclusive("truncate"):
            if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
                raise InputError(f"State.truncate: length must be an int, got {length!r}")
            if self.declared or self._static:
                raise StateError(
                    "State.truncate: this state's values are not a growing KV cache "
                    f"({'declared persistent bindings' if self.declared else 'static TensorScatter cache'})"
                )
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
                if self._own_slab:  # pages no fork still holds: their chunks, zeroed, for the next state
                    self.allocator.trim()

    def __enter__(self) -> State:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._store.close()
