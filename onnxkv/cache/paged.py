"""Paged KV cache: a state's page table and a run's staged writes, copy-on-write.

Layout.  A cache is split into *planes*, one per past input a state binds
(the keys of layer 0, the values of layer 0, ...).  Physical page ``p`` is one
page id for the whole model: it owns one payload of ``[kv_heads, block_size,
head_size]`` elements per plane (head-major: one KV head's tokens are
contiguous), each allocated separately from the pool's allocator when the id
is handed out and returned to it when the id's reference count drops to 0
(ids and counts: :mod:`onnxkv.cache.block_pool`; payloads, formats and
conversion: :mod:`onnxkv.cache.plane_payloads`).
By default the allocator is a :class:`~onnxkv.alloc.SlabAllocator` and each
plane allocates from a lane of its own, so the pages of one plane that are
allocated one after another (a sequence's logical blocks, as decode appends
them) are adjacent in huge-page backed chunks.
``PlanePayloads.ptrs[plane]`` holds the payload addresses by page id (0 when
free); the paged attention kernel reads pages through them.

A :class:`~onnxkv.cache.page_table.PageTable` maps each row's logical blocks
to page ids, one reference each; forking, reordering, checkpointing and
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

Full-page format conversion after a run goes through
:mod:`onnxkv.cache.page_convert` (copy-on-write for shared pages).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxkv import _kernels
from onnxkv.cache._pagecore import COPY
from onnxkv.cache.block_pool import BlockPool, PlaneSpec, live_pools
from onnxkv.cache.contiguous import WriteCost, rows_past, stored_to_float32
from onnxkv.cache.page_convert import Conversion, full_pages_conversion
from onnxkv.cache.page_table import PageTable
from onnxkv.errors import CacheCapacityError, InputError, OutOfMemory

__all__ = ["PlaneSpec", "BlockPool", "PageTable", "PagedCache", "PagedPlane", "live_pools"]

#: No page marked non-native (:meth:`PageCore.write_plan`).
_NONE = np.zeros(0, np.uint8)


def _stored(spec: PlaneSpec, new: np.ndarray) -> np.ndarray:
    """New values as plane ``spec`` stores them: C-contiguous, of its element type (bfloat16 rounded to
    nearest even, as uint16 bits)."""
    if spec.storage == "bfloat16":
        src = np.ascontiguousarray(new, dtype=np.float32)
        bits = np.empty(src.shape, np.uint16)
        _kernels.f32_to_bf16(src, bits)
        return bits
    return np.ascontiguousarray(new, dtype=spec.dtype)


class PagedCache:
    """One state's paged cache: a committed :class:`PageTable` and a run's staged edits.

    Args:
        pool: the :class:`BlockPool` (shared by forks of the state).
        table: the committed table (owned).
        static_length: for static (TensorScatter) caches, the fixed length.

    A run calls :meth:`write` through the planes (:class:`PagedPlane`); the
    state then calls :meth:`commit` or :meth:`discard`.
    """

    def __init__(
        self, pool: BlockPool, table: PageTable, static_length: int | None = None, max_tokens: int | None = None
    ) -> None:
        self.pool = pool
        self.payloads = pool.payloads
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
        #: Whether a run's writes must be kept in :attr:`last_written` (a format selector reads them); when
        #: False a kernel may write the pages itself (:meth:`appended`).  Set by the state's store.
        self.keep_written = True
        #: int64 [B] tokens per row of the current run when it is a run of segments (set by the state's store
        #: for one run), else None.
        self.segments: np.ndarray | None = None
        #: Whether the current run's positions a row never wrote, below the longest row's length, are padding
        #: its attention drops (``State.run(gaps_padding=True)``; set by the state's store for one run).
        self.gaps_padding = False
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

    def replace_table(self, table: PageTable) -> None:
        """Make ``table`` (owned from now on) the committed table and drop the old one's references
        (reorder, restore); between runs."""
        old, self.table = self.table, table
        old.release()

    # -- staging ---------------------------------------------------------------
    def prepare(self, starts: np.ndarray, s) -> WriteCost:
        """Give every block that rows write at ``starts[b] .. starts[b]+s-1`` a page they own alone (``s``:
        an int for every row, or int64 [B] a count per row, 0 for a row not written: a run of segments).

        Allocates all fresh and copy-on-write pages in one pool call before
        changing anything (OutOfMemory leaves the staging as it was); new
        pages are zero-filled.  InputError, nothing staged, when a row would
        start past its committed length (except in static caches).
        """
        ragged = isinstance(s, np.ndarray)
        key = (starts.tobytes(), s.tobytes() if ragged else s)
        if key == self._prepared:  # the other planes of the same write: pages are in place
            return WriteCost()
        pool, bs = self.pool, self.pool.block_size
        if not ragged and s == 1 and not any(self.payloads.converted):
            # a decode step: every row usually writes into a page of its own (a static cache keeps its bytes)
            static = self.static_length is not None
            with pool._lock:  # forks in other threads must not change counts between the decision and the write
                end = pool.core.appends_in_place(self.tables, starts, starts if static else self.table.lengths, bs)
            if end >= 0 and (self.max_tokens is None or end <= self.max_tokens):
                if self._staged is None:
                    self._staged = self.table.tables.copy()
                    self._staged_lengths = self.table.lengths.copy()
                self._prepared, self._kept = key, self._kept_slots(starts, s) if static else []
                return WriteCost()
        short = None if self.static_length is not None else self.short_row(starts)
        if short is not None:
            raise InputError(
                f"paged cache: row {short[0]} would be written at position {short[1]} but has "
                f"written only {short[2]} positions; a row may only continue from what it wrote"
            )
        if self._staged is None:
            self._staged = self.table.tables.copy()
            self._staged_lengths = self.table.lengths.copy()
        hi = int((starts + s).max()) if np.any(s) else 0
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

    def _stage_pages(self, tables: np.ndarray, starts: np.ndarray, s, key: tuple) -> WriteCost:
        """Give the blocks rows write (``s``: an int for every row, or int64 [B]) pages they alone hold in
        ``tables`` (the staged table, wide enough): fresh pages, zero-filled, and copies on write of shared
        or converted pages (:meth:`PageCore.write_plan`).  A page shared only by rows of this write, all of
        which append into it, is kept by one of them (the first writing furthest: every other holder copies
        its valid tokens first and the keeper writes past every holder's committed positions, so no
        holder's committed token changes even if the run is discarded); not in static caches, nor while
        any page is converted."""
        pool, bs, payloads = self.pool, self.pool.block_size, self.payloads
        starts = starts.astype(np.int64, copy=False)
        counts = s.astype(np.int64, copy=False) if isinstance(s, np.ndarray) else np.full(starts.shape, s, np.int64)
        converted = any(payloads.converted)
        if converted:  # a page no longer native is written: back to a native copy first
            nonnative = (~payloads.native_pages(np.arange(pool.core.capacity))).astype(np.uint8)
        else:
            nonnative = _NONE
        try:
            rows, blocks, actions = pool.core.write_plan(
                tables, starts, counts, bs, self.table.lengths, nonnative, self.static_length is None and not converted
            )
        except MemoryError as e:  # NumPy's, for the plan's arrays: nothing staged yet
            if isinstance(e, OutOfMemory):
                raise
            raise OutOfMemory(f"paged cache: no memory for the plan of a write into {tables.shape[0]} rows") from e
        cost = WriteCost()
        total = int(rows.size)
        if not total:
            self._prepared = key
            return cost
        ids = pool.allocate(total)  # the only step that can fail: nothing changed before it
        self._new.append(ids)
        fresh = ids.tolist()
        for pages in payloads.pages:  # no byte of the memory's earlier owner stays readable
            for p in fresh:
                pages[p].fill(0)
        committed = self.table.lengths
        for b, blk, action, new in zip(rows.tolist(), blocks.tolist(), actions.tolist(), fresh):
            if action == COPY:  # this page only, its valid tokens only (a static page: whole)
                old = int(tables[b, blk])
                valid = bs if self.static_length is not None else min(bs, max(0, int(committed[b]) - blk * bs))
                cost.cow_copied_bytes += payloads.copy_page(old, new, valid)
                self._replaced.append(old)  # only committed pages are shared: drop it at commit
            tables[b, blk] = new
        cost.allocations += total * len(pool.planes)
        cost.allocated_bytes += total * pool.page_bytes
        self._prepared = key
        return cost

    def write(self, plane: int, new: np.ndarray, starts, length: int) -> WriteCost:
        """Write ``new`` [B, H, S, D] at positions ``starts[b]...`` of plane ``plane``; stage lengths."""
        spec = self.pool.planes[plane]
        b, h, s, d = new.shape
        if (b, h, d) != (self.table.batch, spec.heads, spec.head_size):
            raise InputError(
                f"paged cache '{spec.name}': update of shape {new.shape} does not fit "
                f"[{self.table.batch}, {spec.heads}, S, {spec.head_size}]"
            )
        starts = np.broadcast_to(np.asarray(starts, np.int64), (b,))
        cost = self.prepare(starts, s)
        self.last_written[spec.name] = new
        new = _stored(spec, new)
        self._save(plane)
        # every block written is native and held by this run alone (prepare), so scatter by address
        _kernels.page_write(
            new,
            self.payloads.ptrs[plane],
            self._staged,
            starts,
            self.pool.block_size,
        )
        cost.append_copied_bytes += b * h * s * d * spec.dtype.itemsize
        self._stage_lengths(starts, s)
        return cost

    def write_segments(self, plane: int, new: np.ndarray, counts: np.ndarray) -> WriteCost:
        """Write a run of segments into plane ``plane``: ``new`` [1, H, T, D] holds ``counts[b]`` tokens of
        row ``b`` after those of the rows before it (``counts`` int64 [B], summing to T), each row's written
        at its committed length; stage lengths.  The caller (the state) checked ``counts``."""
        spec = self.pool.planes[plane]
        one, h, t, d = new.shape
        if (one, h, d) != (1, spec.heads, spec.head_size) or counts.shape != (self.table.batch,) or t != counts.sum():
            raise InputError(
                f"paged cache '{spec.name}': a run of segments {counts.tolist()} got an update of shape {new.shape}; "
                f"expected [1, {spec.heads}, {int(counts.sum())}, {spec.head_size}]"
            )
        starts = self.table.lengths.copy()
        cost = self.prepare(starts, counts)
        self.last_written[spec.name] = new
        new = _stored(spec, new)
        self._save(plane)
        ptrs, bs, at = self.payloads.ptrs[plane], self.pool.block_size, 0
        for b in np.flatnonzero(counts).tolist():  # each row's tokens by address, into pages it holds alone
            n = int(counts[b])
            _kernels.page_write(
                np.ascontiguousarray(new[:, :, at : at + n]), ptrs, self._staged[b : b + 1], starts[b : b + 1], bs
            )
            at += n
        cost.append_copied_bytes += h * t * d * spec.dtype.itemsize
        self._stage_lengths(starts, counts)
        return cost

    def hold_rows(self, lengths: np.ndarray) -> None:
        """Stage each row's length as at most ``lengths[b]`` (the positions of a right-padded prompt that
        are the row's own; the rest were written and are overwritten by its next tokens)."""
        if self._staged_lengths is not None and self.static_length is None:
            np.minimum(self._staged_lengths, np.asarray(lengths, np.int64), out=self._staged_lengths)

    def _stage_lengths(self, starts: np.ndarray, s) -> None:
        """Each row's staged length after writing ``s`` positions from ``starts`` (a static cache: the
        high-water mark of the positions written)."""
        if self.static_length is None:
            self._staged_lengths[:] = starts + s
        else:
            np.maximum(self._staged_lengths, starts + s, out=self._staged_lengths)

    def appended(self, planes: Sequence[int], starts: np.ndarray, s: int) -> None:
        """Stage ``s`` positions per row from ``starts`` (int64 [B]) of the planes ``planes`` (indices) that
        a kernel wrote into the pages :meth:`prepare` staged for a write from the same ``starts`` of at least
        ``s`` positions (the fused paged decode; the compiled generation loop, which stages its steps' pages
        first and may stop early); as :meth:`write` stages what it scatters (:meth:`append_cost` is what
        it costs the event log).  Only while :attr:`keep_written` is False."""
        prepared = self._prepared
        if self.keep_written or prepared is None or prepared[0] != starts.tobytes() or not 0 < s <= prepared[1]:
            names = ", ".join(repr(self.pool.planes[p].name) for p in planes)
            raise InputError(f"paged cache {names}: appended rows without their prepared pages")
        if self._kept:
            for plane in planes:
                self._save(plane)
        self._stage_lengths(starts, s)

    def append_cost(self, plane: int, rows: int, s: int) -> WriteCost:
        """The :class:`WriteCost` of ``s`` positions of ``rows`` rows staged by :meth:`appended` in plane
        ``plane`` (the bytes a kernel wrote)."""
        spec = self.pool.planes[plane]
        return WriteCost(append_copied_bytes=rows * spec.heads * s * spec.head_size * spec.dtype.itemsize)

    def _kept_slots(self, starts: np.ndarray, s) -> list[tuple[int, int, int]]:
        """(page, first, last offset) of the committed positions a write of ``s`` positions from ``starts``
        replaces in pages the committed table holds (``prepare`` kept them: this state alone references them).

        Committed: below a row's committed length, or any position of a static cache.  Usually none (a
        write appends); the loop runs over the rows and blocks that do overwrite.
        """
        table, bs = self.table, self.pool.block_size
        extent = table.lengths if self.static_length is None else self.static_length
        over = starts < extent
        if not over.any():
            return []
        counts = np.broadcast_to(np.asarray(s, np.int64), starts.shape)
        extent = np.broadcast_to(extent, starts.shape)
        out = []
        for b in np.flatnonzero(over & (counts > 0)).tolist():
            lo, hi = int(starts[b]), min(int(starts[b]) + int(counts[b]), int(extent[b]))
            for blk in range(lo // bs, min(-(-hi // bs), table.tables.shape[1])):
                page = int(self._staged[b, blk])
                if page >= 0 and page == int(table.tables[b, blk]):
                    out.append((page, max(lo, blk * bs) - blk * bs, min(hi, (blk + 1) * bs) - blk * bs))
        return out

    def _save(self, plane: int) -> None:
        """Keep the bytes of plane ``plane`` the current write replaces in kept pages (O(new tokens));
        :meth:`discard` writes them back."""
        pages = self.payloads.pages[plane]
        for page, first, last in self._kept:
            self._saved.append((plane, page, first, pages[page][:, first:last].copy()))

    def commit(self) -> None:
        """Publish the staged tables and lengths; drop references of pages replaced by copies."""
        self.segments, self.gaps_padding = None, False
        if self._staged is None:
            return
        self.table.tables = self._staged
        self.table.lengths = self._staged_lengths
        replaced = np.array(self._replaced, np.int32)
        self._staged = self._staged_lengths = self._prepared = None
        self._new, self._replaced, self._saved, self._kept = [], [], [], []
        if replaced.size:
            self.pool.decref(replaced)

    def drop_unwritten(self) -> int:
        """Free the fresh pages this run staged wholly past every row's staged length (a compiled generation
        loop that stopped before the positions it staged pages for: an end-of-sequence id); return how
        many.  Their table entries become -1, as if never staged."""
        if self._staged is None or self.static_length is not None or not self._new:
            return 0
        bs, tables = self.pool.block_size, self._staged
        new = {p for ids in self._new for p in ids.tolist()}
        drop: list[int] = []
        for b in range(tables.shape[0]):
            for blk in range(-(-int(self._staged_lengths[b]) // bs), tables.shape[1]):
                if int(tables[b, blk]) in new:
                    drop.append(int(tables[b, blk]))
                    tables[b, blk] = -1
        if drop:
            gone = set(drop)
            self._new = [np.array([p for p in ids.tolist() if p not in gone], np.int32) for ids in self._new]
            self.pool.decref(np.array(drop, np.int32))
        return len(drop)

    def discard(self) -> None:
        """Forget the run: restore the committed bytes it overwrote, free its new pages; the committed
        table is untouched."""
        new, saved = self._new, self._saved
        self._staged = self._staged_lengths = self._prepared = self.segments = None
        self.gaps_padding = False
        self._new, self._replaced, self._saved, self._kept = [], [], [], []
        pages = self.payloads.pages
        for plane, page, first, old in reversed(saved):
            pages[plane][page][:, first : first + old.shape[1]] = old
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
        payloads = self.payloads
        pages = payloads.pages[plane]
        for b in range(tables.shape[0]):
            held = min(length, int(lengths[b]))
            for blk in range(min(tables.shape[1], -(-held // bs))):
                p = int(tables[b, blk])
                if p >= 0:
                    n = min(bs, held - blk * bs)
                    if payloads.quantized(plane, p):
                        out[b, :, blk * bs : blk * bs + n] = payloads.native(spec, payloads.read_page(plane, p, n))
                    else:
                        out[b, :, blk * bs : blk * bs + n] = pages[p][:, :n]
        return out

    # -- page formats ----------------------------------------------------------
    def full_pages_conversion(self, chosen, residual_tokens: int = 0, valid=None) -> Conversion:
        """:func:`~onnxkv.cache.page_convert.full_pages_conversion` of ``chosen`` ((plane, format name)
        pairs) over the staged run's tables (whose commit drops the pages it replaced), else the committed
        ones, rows no longer than ``valid`` (int64 [B] or None): install it on :attr:`table` after the commit."""
        staged = self._staged is not None
        tables, lengths = (self._staged, self._staged_lengths) if staged else (self.table.tables, self.table.lengths)
        lengths = lengths if valid is None else np.minimum(lengths, valid)
        return full_pages_conversion(self.table, tables, lengths, chosen, residual_tokens, self._replaced)


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
        self._placeholders: tuple[np.ndarray, ...] = ()

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
        return self.cache.payloads.ptrs[self.index]

    @property
    def page_addresses(self) -> np.ndarray:
        """Every plane's page addresses (uint64 [planes, pool capacity]; :attr:`ptrs` is row :attr:`index`),
        replaced when the pool grows."""
        return self.cache.payloads.ptrs

    @property
    def tables(self) -> np.ndarray:
        return self.cache.tables

    @property
    def formats(self) -> np.ndarray | None:
        """ONNX element code of each page id's payload in this plane (uint8 [pool capacity]),
        or None while every page is native (the kernel then skips per-page dispatch)."""
        payloads = self.cache.payloads
        return payloads.formats[self.index] if payloads.converted[self.index] else None

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

    @property
    def segments(self) -> np.ndarray | None:
        """int64 [B]: the tokens of each row in this run when it is a run of segments (its token axis the
        rows' new tokens one after another, batch 1; :meth:`State.run <onnxkv.runtime.state.State.run>`),
        else None."""
        return self.cache.segments

    @property
    def gaps_padding(self) -> bool:
        """Whether this run's positions a row never wrote below the longest row's are padding (see
        :meth:`State.run <onnxkv.runtime.state.State.run>`)."""
        return self.cache.gaps_padding

    def write_segments(self, new: np.ndarray) -> WriteCost:
        """:meth:`PagedCache.write_segments` of this plane with the run's :attr:`segments`."""
        return self.cache.write_segments(self.index, new, self.cache.segments)

    def placeholder(self, length: int) -> np.ndarray:
        """A zero-byte stand-in of the present/past value ``[B, H, length, D]`` (nothing may read it): a
        read-only array of zeros, every stride 0 (made per layer and step, so without broadcast_to's cost;
        the last two made are kept, as the present of one step is the past of the next)."""
        shape = (self.batch, self.heads, int(length), self.head_size)
        for made in self._placeholders:
            if made.shape == shape:
                return made
        dtype = np.dtype(self.spec.model_dtype)
        made = np.ndarray(shape, dtype, buffer=bytes(dtype.itemsize), strides=(0, 0, 0, 0))
        self._placeholders = (made, self._placeholders[0]) if self._placeholders else (made,)
        return made

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
