"""The paged API of a :class:`~onnxkv.runtime.state.State`: fork, reorder, checkpoint and restore, page
formats, saving and loading the cache.

Every method needs a paged state (``session.new_state(cache="paged")``;
StateError otherwise) and works on its
:class:`~onnxkv.runtime.stores.paged.PagedStore` under the state's rules:
one call at a time, and an error leaves the state, its pool, forks and
checkpoints exactly as they were.  Page payloads are never copied by these
calls except where a method says so.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from onnxkv.cache import serialize
from onnxkv.errors import InputError, StateError
from onnxkv.runtime.stores import Checkpoint, PagedStore, StoreContext

if TYPE_CHECKING:
    from onnxkv.runtime.state import State

__all__ = ["MAX_FORKS", "PagedAPI", "conversion_lengths"]

#: Most forks one :meth:`State.fork` call makes (each is a state of its own; beams and trees need far fewer).
MAX_FORKS = 1 << 16


def conversion_lengths(cycle: tuple[int, int], start: int, stop: int) -> range:
    """The lengths in (``start``, ``stop``) at which a run ending there makes a page due for conversion, for
    ``cycle`` = :attr:`PagedAPI.conversion_cycle` (block size, residual tokens): ``n - residual`` a positive
    multiple of the block size."""
    block, residual = cycle
    return range(residual + block * max(1, (start - residual) // block + 1), stop, block)


class PagedAPI:
    """The paged methods of :class:`~onnxkv.runtime.state.State` (module docstring); a State's base class,
    reading the state's store, storage keywords and call guard."""

    session: object
    paged: bool
    cache: str
    steps: int
    allocator: object
    _store: PagedStore
    _ctx: StoreContext
    _keywords: dict
    _check_open: Callable[[str], None]
    _exclusive: Callable[[str], contextlib.AbstractContextManager]

    def _require_paged(self, api: str, held: bool = True) -> PagedStore:
        self._check_open(api)
        if not self.paged:
            raise StateError(
                f"State.{api}: needs a paged state (session.new_state(cache='paged')); "
                f"this state's cache is '{self.cache}'"
            )
        if held and self._store.cache is None:
            raise StateError(f"State.{api}: the state holds no cache yet (run it first)")
        return self._store

    def keep_for_truncate(self, positions: int) -> None:
        """Keep ``positions`` more positions behind a sliding window (int >= 0; 0 by default), so that
        :meth:`State.truncate` can take back that many after a run.

        A state of a model with a ``local_window_size`` frees, after each run, the pages no later query
        can see; truncating into them is then refused.  Under a ``kv_format`` that converts full pages, a
        state with ``positions`` > 0 converts the pages a run fills at the start of its next run rather
        than after it (a converted page cannot be restored): a truncate between the two leaves them as
        written, and the next run converts what is full at the length it starts from, as runs of the
        kept tokens alone would (:attr:`conversion_cycle`).  Speculative decoding sets this to the
        tokens one of its steps may take back."""
        store = self._require_paged("keep_for_truncate", held=False)
        if isinstance(positions, bool) or not isinstance(positions, (int, np.integer)) or not 0 <= positions < 2**31:
            raise InputError(f"State.keep_for_truncate: positions must be an int in [0, 2**31), got {positions!r}")
        store.rollback = int(positions)

    @property
    def conversion_cycle(self) -> tuple[int, int] | None:
        """``(block_size, residual_tokens)`` of the ``kv_format``'s page conversions, None without one (a
        contiguous state, or no selector).  A run that leaves a row at a length ``n`` with
        ``n - residual_tokens`` a positive multiple of ``block_size`` makes that row's page before it
        eligible; the selector's choice for it is made once per run, so tokens fed as one run see
        native values where runs of fewer tokens would see converted ones.  Split a run at those lengths
        to get what token-by-token runs get (speculative decoding does)."""
        return self._store.conversion_cycle() if self.paged else None

    def fork(self, n: int = 1) -> list[State]:
        """``n`` new states sharing every page of this one (no payload byte copied); each continues on its
        own, its first write into a shared page copying that page only (``cow_copied_bytes``), and owes
        its next run the page conversions this state owes its own (:meth:`keep_for_truncate`).  ``n``: an
        int in ``[1, MAX_FORKS]`` (InputError otherwise, before any fork is made)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= MAX_FORKS:
            raise InputError(f"State.fork: n must be an int in [1, {MAX_FORKS}], got {n!r}")
        with self._exclusive("fork"):
            store = self._require_paged("fork")
            keywords = {**self._keywords, "allocator": self.allocator}
            out = [type(self)(self.session, **keywords, _pool=store.pool) for _ in range(int(n))]
            for st in out:
                st._store.adopt(store)
                st.steps = self.steps
            self._ctx.log("fork", allocations=0, cow_copied_bytes=0, prefix_copied_bytes=0)
            return out

    def sibling(self) -> State:
        """A new empty state over this state's page pool, with its settings (no page shared yet): the rows
        it writes can later move into this state with :meth:`append_rows` (how the engine batches requests)."""
        with self._exclusive("sibling"):
            store = self._require_paged("sibling", held=False)
            return type(self)(self.session, **{**self._keywords, "allocator": self.allocator}, _pool=store.pool)

    def start_on_pages(self, pages, length: int) -> None:
        """Start this empty state as one row holding ``pages`` (page ids of its pool, in order: logical
        blocks 0, 1, ...) by reference, its first ``length`` positions written (a cached prompt prefix):
        the next run continues at ``length``, and a write into a shared page copies that page first.
        InputError, nothing changed, for a state that holds a cache, an id that is not a live page of the
        pool, a ``length`` the pages do not end in, or a page some of whose claimed positions no row or
        cache of the pool holds as written (every page but the last must be full: a page a row truncated
        keeps stale positions)."""
        with self._exclusive("start_on_pages"):
            self._require_paged("start_on_pages", held=False).start_on_pages(pages, length)

    def append_rows(self, other: State) -> None:
        """Move every row of ``other`` (a state over the same page pool, see :meth:`sibling`) after this
        state's rows, each keeping its own length: ``other``'s page references pass to this state (no
        payload byte copied) and ``other`` is closed.  InputError, both states as they were, when ``other``
        is this state, not a state over this pool, or holds no rows."""
        if other is self or not isinstance(other, PagedAPI) or not other.paged:
            raise InputError(f"State.append_rows: expected another paged State, got {other!r}")
        with self._exclusive("append_rows"), other._exclusive("append_rows"):
            store, theirs = self._require_paged("append_rows", held=False), other._require_paged("append_rows")
            store.append_rows(theirs)
            self.steps = max(self.steps, other.steps)
        other.close()

    def append_empty_rows(self, n: int) -> None:
        """``n`` rows holding nothing (length 0, no page) after this state's rows (an int in [1,
        MAX_FORKS]): the engine starts prompts in them within a run of segments (:meth:`State.run`)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= MAX_FORKS:
            raise InputError(f"State.append_empty_rows: n must be an int in [1, {MAX_FORKS}], got {n!r}")
        with self._exclusive("append_empty_rows"):
            self._require_paged("append_empty_rows", held=False).append_empty(int(n))

    def keep_rows(self, indices) -> None:
        """Keep rows ``indices`` (distinct, in their new order; empty: none) and drop every other row's page
        references: what :meth:`reorder` does, but rows may all go (the state then holds no cache)."""
        with self._exclusive("keep_rows"):
            store = self._require_paged("keep_rows")
            idx = np.asarray(indices)
            if idx.ndim == 1 and idx.size and not np.issubdtype(idx.dtype, np.integer):
                raise InputError(f"State.keep_rows: indices must be a 1-D int array, got {indices!r}")
            # more than the rows held repeats one (counted before the indices are read)
            if idx.ndim == 1 and idx.size and (idx.size > store.cache.table.batch or np.unique(idx).size != idx.size):
                raise InputError(f"State.keep_rows: indices must be distinct, got {idx!r}")
            if idx.ndim == 1 and idx.size == 0:
                store.close()
            else:
                store.reorder(idx, "State.keep_rows")

    def reorder(self, indices) -> None:
        """Row ``i`` becomes old row ``indices[i]`` (beam search; ``len(indices)`` may differ from the
        batch): page tables permuted, reference counts adjusted, no payload byte copied."""
        with self._exclusive("reorder"):
            self._require_paged("reorder").reorder(indices)

    def checkpoint(self) -> Checkpoint:
        """The cache contents now, held by page references (no copy); see :meth:`restore`."""
        with self._exclusive("checkpoint"):
            return self._require_paged("checkpoint").checkpoint(self, self.steps)

    def restore(self, checkpoint: Checkpoint) -> None:
        """Return the caches to ``checkpoint`` (made by this state, not released), and the page
        conversions the state owed its next run then (:meth:`keep_for_truncate`); no payload copy."""
        with self._exclusive("restore"):
            self.steps = self._require_paged("restore").restore(checkpoint, self)

    def quantize_pages(self, indices, k_format: str | None, v_format: str | None) -> None:
        """Convert logical blocks ``indices`` (full blocks of every row) of every layer to new formats.

        ``k_format``/``v_format``: a page format name (:mod:`onnxkv.cache.formats`; a float format
        dequantizes) or None to leave that plane; integer parameters are chosen from each page's values.
        Each selected page gets one new payload; pages shared with other states or checkpoints are copied
        first (:func:`~onnxkv.cache.page_convert.quantize_blocks`).  An error (bad index, unknown format,
        OutOfMemory) leaves the state as it was.
        """
        with self._exclusive("quantize_pages"):
            self._require_paged("quantize_pages").quantize_pages(indices, k_format, v_format)

    def compress_rows(self, rows, fmt_name: str, keep_tokens: int = 0) -> int:
        """Convert the full pages of ``rows`` (row indices) older than each row's last ``keep_tokens``
        positions to the smaller page format ``fmt_name`` (e.g. "int8", "int4") in every layer, where this
        state alone holds them and their format has more bits; returns the payload bytes freed (an
        engine's relief for a full pool).  All or nothing; InputError for an unknown format or rows that are
        not distinct indices of this state's rows."""
        api = "State.compress_rows"
        if (
            isinstance(keep_tokens, (bool, np.bool_))
            or not isinstance(keep_tokens, (int, np.integer))
            or keep_tokens < 0
        ):
            raise InputError(f"{api}: keep_tokens must be an int ≥ 0, got {keep_tokens!r}")
        idx = np.asarray(rows) if isinstance(rows, (list, tuple, np.ndarray)) else None
        if idx is None or idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise InputError(f"{api}: rows must be a list or 1-D int array of row indices, got {rows!r}")
        with self._exclusive("compress_rows"):
            store = self._require_paged("compress_rows")
            batch = store.cache.table.batch
            if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= batch):
                raise InputError(f"{api}: rows must be in [0, {batch}), got {idx!r}")
            # distinct (more than the rows held repeats one: counted before the indices are read)
            if idx.size > batch or np.unique(idx).size != idx.size:
                raise InputError(f"{api}: rows must be distinct, got {idx!r}")
            return store.compress_rows([int(b) for b in idx], fmt_name, int(keep_tokens))

    def save_cache(self, path: str | os.PathLike | None = None) -> bytes:
        """The committed cache as ``PagedCacheProto`` bytes (:mod:`onnxkv.cache.serialize`), also written
        atomically to ``path`` if given (:func:`onnxkv.cache.serialize.save`; a file readable by its owner only).
        The page conversions the state owes its next run (:meth:`keep_for_truncate`) are in the file: a
        state that loads it makes them at its next run, as this state would."""
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise InputError(f"State.save_cache: path must be a str or os.PathLike, got {type(path).__name__}")
        with self._exclusive("save_cache"):
            snapshot = self._require_paged("save_cache").snapshot()
        if path is None:
            return serialize.encode(snapshot)
        try:
            return serialize.save(snapshot, path)
        except OSError as e:
            raise InputError(f"State.save_cache: cannot write {os.fspath(path)!r}: {e.strerror or e}") from e

    def load_cache(self, source: bytes | str | os.PathLike) -> None:
        """Replace the caches by a saved cache (bytes or a file from :meth:`save_cache`); all or nothing.

        The next run continues where the saved state stopped.  A cache file is untrusted: before a page
        is taken, the load checks its size against what ``max_pages`` could hold (InputError, before it is
        read), the frame (SerializationError), the model (signature, block size, layers; InputError), every
        rule of :func:`onnxkv.cache.serialize.validate`, and the state
        (:func:`onnxkv.cache.snapshot.paged_from_snapshot`: capacity, window, table size, InputError; free
        pages, OutOfMemory).  On any error the state, its pool, forks and checkpoints are exactly as they
        were.  StateError on a contiguous state; InputError for a ``source`` neither bytes nor a path, or an
        unreadable file (the OSError chained).
        """
        store = self._require_paged("load_cache", held=False)
        snapshot = store.decode(source)
        with self._exclusive("load_cache"):
            store.load(snapshot)
            self.steps = 0
