"""The paged operations of a :class:`~onnxkv.runtime.state.State`: page tables, page formats, cache files.

Each call takes the state's request rules (open, one call at a time) and
delegates to its :class:`~onnxkv.runtime.stores.paged.PagedStore`, which
changes page tables only through :mod:`onnxkv.cache`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from onnxkv.cache import serialize
from onnxkv.cache.formats import HEADER_CHANNEL_ZP, HEADER_COMPACT
from onnxkv.errors import InputError, StateError
from onnxkv.runtime.stores import Checkpoint, PagedStore

if TYPE_CHECKING:
    from onnxkv.runtime.state import State

__all__ = ["PagedOperations", "MAX_FORKS"]

#: Most forks one :meth:`PagedOperations.fork` call makes (each is a state of its own; beams and trees need far fewer).
MAX_FORKS = 1 << 16


class PagedOperations:
    """The paged half of :class:`~onnxkv.runtime.state.State`'s API (a state with ``cache="paged"``).

    A contiguous or declared state raises :class:`~onnxkv.errors.StateError`
    from each; so does a paged state before its first run (except
    :meth:`load_cache`).
    """

    def _require_paged(self, api: str, held: bool = True) -> PagedStore:
        self._check_open(api)
        if not self.paged:
            raise StateError(f"State.{api}: needs a paged state (session.new_state(cache='paged')); "
                             f"this state's cache is '{self.cache}'")
        if held and self._store.cache is None:
            raise StateError(f"State.{api}: the state holds no cache yet (run it first)")
        return self._store

    def fork(self, n: int = 1) -> list[State]:
        """``n`` new states sharing every page of this one (copy-on-write); no payload byte is copied.

        Each fork continues independently; the first write into a shared page
        copies that page only (``cow_copied_bytes``).  ``n`` is an int in
        ``[1, MAX_FORKS]`` (InputError otherwise, before any fork is made).
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= MAX_FORKS:
            raise InputError(f"State.fork: n must be an int in [1, {MAX_FORKS}], got {n!r}")
        with self._exclusive("fork"):
            store = self._require_paged("fork")
            out = []
            for _ in range(int(n)):
                st = type(self)(self.session, capacity=self.capacity, initial_capacity=self.initial_capacity,
                                allocator=self.allocator, cache_dtype=self.cache_dtype, cache="paged",
                                kv_format=self.kv_format, key_channel_scales=self._key_header == HEADER_COMPACT,
                                key_channel_zero_points=self._key_header == HEADER_CHANNEL_ZP, _pool=store.pool)
                st._store.cache = store.share()
                st.steps = self.steps
                out.append(st)
            self._ctx.log("fork", allocations=0, cow_copied_bytes=0, prefix_copied_bytes=0)
            return out

    def reorder(self, indices) -> None:
        """Row ``i`` becomes old row ``indices[i]`` (beam search); ``len(indices)`` may differ from the batch.

        Page tables are permuted and reference counts adjusted; no payload
        byte is copied.
        """
        with self._exclusive("reorder"):
            self._require_paged("reorder").reorder(indices)

    def checkpoint(self) -> Checkpoint:
        """The cache contents now, held by page references (no copy); see :meth:`restore`."""
        with self._exclusive("checkpoint"):
            cp = Checkpoint(self, self._require_paged("checkpoint").cache.table.share(), self.steps)
            self._ctx.log("checkpoint", allocations=0, cow_copied_bytes=0, prefix_copied_bytes=0)
            return cp

    def restore(self, checkpoint: Checkpoint) -> None:
        """Return the caches to ``checkpoint`` (made by this state, not released); no payload copy."""
        with self._exclusive("restore"):
            store = self._require_paged("restore")
            if not isinstance(checkpoint, Checkpoint) or checkpoint._owner is not self:
                raise InputError("State.restore: the checkpoint was not made by this state")
            if checkpoint.table is None:
                raise StateError("State.restore: the checkpoint was released")
            store.restore(checkpoint.table)
            self.steps = checkpoint.steps

    def quantize_pages(self, indices, k_format: str | None, v_format: str | None) -> None:
        """Convert logical blocks ``indices`` (full blocks of every row) of every layer to new formats.

        ``k_format``/``v_format``: a page format name (see
        :mod:`onnxkv.cache.formats`; a float format dequantizes) or None to
        leave that plane.  An integer format's parameters are chosen from
        each page's values in the plane's header kind
        (:meth:`~onnxkv.cache.plane_payloads.PlanePayloads.build_payload`).
        Only the selected pages are replaced, each new payload allocated
        once; pages shared with other states or checkpoints are copied for
        this state first (:func:`~onnxkv.cache.page_convert.quantize_blocks`).
        An error (bad index, unknown format, OutOfMemory) leaves the state as it was.
        """
        with self._exclusive("quantize_pages"):
            self._require_paged("quantize_pages").quantize_pages(indices, k_format, v_format)

    def save_cache(self, path: str | os.PathLike | None = None) -> bytes:
        """Serialise the committed cache as a ``PagedCacheProto`` (see :mod:`onnxkv.cache.serialize`).

        Returns the bytes and, if ``path`` is given, writes them there
        atomically (:func:`onnxkv.cache.serialize.save`: a temporary file
        readable by its owner only replaces ``path``).  Paged states only.
        """
        with self._exclusive("save_cache"):
            snapshot = self._require_paged("save_cache").snapshot()
        return serialize.encode(snapshot) if path is None else serialize.save(snapshot, path)

    def load_cache(self, source: bytes | str | os.PathLike) -> None:
        """Replace the caches by a saved cache (bytes or a file from :meth:`save_cache`); all or nothing.

        The next run continues exactly where the saved state stopped.  A
        cache file is untrusted input; before the state's pool gives a page
        or the page table is allocated, the load checks: its size against
        what ``max_pages`` could hold
        (:func:`onnxkv.cache.snapshot.file_bytes_limit`; InputError, before
        it is read); the frame and protobuf encoding
        (:func:`onnxkv.cache.serialize.decode`; SerializationError); the
        model (:func:`onnxkv.cache.snapshot.expectation`: signature, block
        size, layers, heads, dtype, at most ``max_pages`` rows; InputError);
        every rule of :func:`onnxkv.cache.serialize.validate`; and the state
        (:func:`onnxkv.cache.snapshot.paged_from_snapshot`: header kinds,
        capacity, window, table size; InputError, and pages within the
        pool's free pages, OutOfMemory).

        On any error the state, its pool, its forks and checkpoints are
        exactly as they were.  Raises :class:`~onnxkv.errors.StateError` on a
        contiguous state, and :class:`~onnxkv.errors.InputError` for a
        ``source`` that is neither bytes nor a path, or a file that cannot
        be read (the OSError chained).
        """
        store = self._require_paged("load_cache", held=False)
        snapshot = store.decode(source)
        with self._exclusive("load_cache"):
            store.load(snapshot)
            self.steps = 0
