"""Paged storage of a state's caches: page tables over a reference-counted pool.

``cache="paged"`` keeps the caches in pages of ``block_size`` tokens from a
:class:`~onnxkv.cache.block_pool.BlockPool` (see :mod:`onnxkv.cache.paged`):
fork, reorder, checkpoint / restore and truncate change page tables only,
and a write into a shared page copies that page first (copy-on-write).  A
run stages a private table and commits or discards it whole
(:class:`~onnxkv.cache.paged.PagedCache`).  The full pages the
``kv_format`` selector makes eligible are converted as part of the run
(:mod:`onnxkv.cache.page_convert`: built before it commits, published with
it, so a conversion that cannot get its memory fails the run and changes
nothing), and models with a ``local_window_size`` evict pages that left the
window after it.

Every page-table change here goes through :mod:`onnxkv.cache`; this module
decides when, and counts it in the event log.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

import numpy as np

from onnxkv.cache import serialize
from onnxkv.cache.formats import HEADER_FLOAT32, page_format
from onnxkv.cache.page_convert import Conversion, convert_pages, quantize_blocks
from onnxkv.cache.paged import BlockPool, PagedCache, PagedPlane, PageTable, PlaneSpec
from onnxkv.cache.snapshot import expectation, file_bytes_limit, owed_planes, paged_from_snapshot, take_snapshot
from onnxkv.errors import InputError, OutOfMemory, StateError
from onnxkv.plan.step_loop import StepsRun, run_steps
from onnxkv.runtime.stores.checkpoint import NOTHING_OWED, Checkpoint, Owed
from onnxkv.runtime.stores.protocol import StoreContext, batch_and_length

__all__ = ["PagedStore", "MAX_ROWS"]

#: Rows a paged state's initial arrays hold at most (as many as one fork call makes).
MAX_ROWS = 1 << 16


class PagedStore:
    """The :class:`~onnxkv.runtime.stores.protocol.Store` of paged caches (module docstring).

    ``pool`` None makes a pool for the model's bound pasts; a given pool is
    shared (forks).  ``selector``: the ``kv_format`` selector or None;
    ``key_header``: the header kind of quantized key pages.
    """

    def __init__(
        self,
        ctx: StoreContext,
        selector,
        key_header: str,
        block_size: int,
        max_pages: int | None,
        pool: BlockPool | None = None,
    ) -> None:
        self.ctx = ctx
        self.selector = selector
        self.key_header = key_header
        self.pool = pool if pool is not None else self._new_pool(block_size, max_pages)
        self.window = self._model_window()
        #: Positions State.truncate may take back (State.keep_for_truncate): kept behind the window, and
        #: a run's page conversions wait for the next run.
        self.rollback = 0
        self._needs_data = self._pasts_read_elsewhere()
        self.cache: PagedCache | None = None
        self._fresh = False
        self._before = 0
        self._chosen: list[tuple[int, str]] = []
        #: Conversions a committed run chose, made at the start of the next run when ``rollback`` > 0.
        self._pending = NOTHING_OWED
        #: The conversion of the run in progress (built before it commits, installed by the commit), and
        #: the one owed by the last run (published before the run, settled by its commit or undone).
        self._conversion: Conversion | None = None
        self._owed: Conversion | None = None
        g = ctx.session.model.proto.graph
        nonpad = {n.input[6] for n in g.node if n.op_type == "Attention" and len(n.input) > 6}
        #: The graph input Attention reads as nonpad_kv_seqlen (static caches), and the run's valid lengths.
        self._nonpad, self._valid = min(nonpad & {x.name for x in g.input}, default=None), None

    @property
    def caches(self) -> dict[str, PagedPlane] | None:
        return None if self.cache is None else self.cache.planes

    # -- construction ----------------------------------------------------------------
    def _new_pool(self, block_size: int, max_pages: int | None) -> BlockPool:
        ctx = self.ctx
        declared = ctx.session.declared_bindings
        if declared or not ctx.bindings:
            raise InputError(
                "new_state: cache='paged' needs a model whose past/present pairs onnxkv runs in place "
                f"(this model's cache is '{ctx.session.model.convention.kind}' with "
                f"{'declared persistent bindings' if declared else 'no in-place binding'})"
            )
        planes = []
        for b in ctx.bindings:
            (_, heads, head), dtype = ctx.geometry(b.past, 1)
            header, name = self.key_header if b.role == "key" else HEADER_FLOAT32, np.dtype(dtype).name
            groups = 1 if header == HEADER_FLOAT32 else head
            planes.append(PlaneSpec(b.past, heads, head, ctx.cache_dtype or name, name, groups, header))
        return BlockPool(planes, block_size, ctx.allocator, max_pages)

    def _model_window(self) -> int | None:
        """Keys before a query that GroupQueryAttention's ``local_window_size`` keeps visible (None: all)."""
        windows = set()
        for node in self.ctx.session.model.proto.graph.node:
            if node.op_type == "GroupQueryAttention":
                w = next((a.i for a in node.attribute if a.name == "local_window_size"), -1)
                windows.add(w - 1 if w > 0 else None)
        return windows.pop() if len(windows) == 1 else None

    def _pasts_read_elsewhere(self) -> set[str]:
        """Bound pasts whose data a node of the planned graph other than the joining node reads (they are fed
        gathered copies); a float16 file's cache Casts, moved to the session's boundary, read none."""
        joiner = {b.past: b.node for b in self.ctx.bindings}
        out = set()
        for node in self.ctx.session.planned.graph.node:
            if node.op_type == "Shape":
                continue
            for x in node.input:
                if x in joiner and joiner[x] != (node.name or node.output[0]):
                    out.add(x)
        return out

    def _new_cache(self, batch: int, table: PageTable | None = None) -> PagedCache:
        """A cache of ``batch`` rows over ``table`` (None: an empty one); a static cache's table gets every
        page of its capacity, zero-filled, with nothing written yet (lengths 0)."""
        ctx = self.ctx
        static = ctx.static_capacity if ctx.static else None
        cache = PagedCache(
            self.pool,
            table if table is not None else PageTable(self.pool, batch),
            static_length=static,
            max_tokens=static if ctx.static else ctx.capacity,
        )
        if ctx.static and table is None:
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

    def adopt(self, source: PagedStore) -> None:
        """Hold a share of every page of ``source``'s committed table (a fork of it, over the same pool)
        and owe its next run the conversions ``source`` owes its own."""
        c = source.cache
        self.cache = PagedCache(self.pool, c.table.share(), c.static_length, c.max_tokens)
        self._pending = source._pending

    # -- a run -------------------------------------------------------------------------
    def prepare(self, feeds: Mapping[str, np.ndarray], segments=None, gaps_padding=False) -> dict[str, PagedPlane]:
        counts = None if segments is None else self._segments(feeds, segments)
        batch = self.ctx.batch_of(feeds) if counts is None else counts.size
        self._fresh = self.cache is None
        if self.cache is None:
            self.cache = self._new_cache(batch)
        elif self.cache.table.batch != batch:
            raise InputError(
                f"State.run: batch size {batch} differs from the state's {self.cache.table.batch}; "
                "reorder or reset the state first"
            )
        if self._pending.planes:  # owed by the last run: published before this run's queries read the pages
            # (else it fails), undone if the run is discarded
            self._owed = self._prepare_conversion(self._pending.planes, self._pending.residual)
            self._owed.publish(self.cache.table)
        self._valid = self._valid_lengths(feeds, batch) if self.ctx.static else None
        lengths = self.cache.lengths
        self._before = int(lengths.max()) if lengths.size else 0
        self._chosen = []
        self.cache.last_written.clear()  # the selector sees this run's writes only
        # only a selector reads a run's written values (whatever made the cache: a run, a fork, a reset, a load)
        self.cache.keep_written = self.selector is not None
        self.cache.segments = counts
        self.cache.gaps_padding = gaps_padding
        return self.cache.planes

    def _segments(self, feeds: Mapping[str, np.ndarray], segments) -> np.ndarray:
        """``segments`` of a run (:meth:`State.run`) as int64 [B], checked in its own width: one count >= 0
        per row this state holds, summing to the T token ids fed as [1, T]."""
        api = "State.run"
        if self.cache is None or self.ctx.static:
            raise InputError(f"{api}: segments need a paged state that holds rows (not a static cache)")
        rows = self.cache.table.batch
        seg = np.asarray(segments)
        if seg.dtype.kind not in "iu" or seg.shape != (rows,):
            raise InputError(
                f"{api}: segments must be {rows} integer token counts (one per row), got {seg.dtype} {seg.shape}"
            )
        name = self.ctx.session.model.io.input_ids
        shape = np.shape(feeds.get(name)) if name else None
        if shape is None or len(shape) != 2 or shape[0] != 1 or shape[1] < 1:
            raise InputError(f"{api}: segments need the token ids '{name}' fed as [1, T], got shape {shape}")
        t = shape[1]
        if seg.size and (int(seg.min()) < 0 or int(seg.max()) > t) or int(seg.astype(np.int64).sum()) != t:
            raise InputError(f"{api}: segments {seg.tolist()} must be counts >= 0 summing to the {t} token ids fed")
        return seg.astype(np.int64)

    def feeds(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        full = dict(feeds)
        # a static cache's past: its capacity; else the committed length (every plane of the cache has it)
        past = self.ctx.static_capacity if self.ctx.static else None
        length = past or next(iter(self.cache.planes.values())).length
        for name, c in self.cache.planes.items():
            full[name] = c.gather(past) if name in self._needs_data else c.placeholder(length)
        return full

    def finish(self) -> None:
        """Ask the selector (user code) which planes' full pages to convert with this run, and build them.

        Every chosen name must be a known page format.  A selector that
        raises or names an unknown format fails the run, and so does a
        conversion that cannot get its memory (OutOfMemory).  On a state
        that keeps positions for a truncate the conversion waits for the
        start of the next run, which it fails likewise.
        """
        if self.selector is None:
            return
        cache, pool = self.cache, self.pool
        for layer, (k, v) in enumerate(self.layer_pairs()):
            new_k, new_v = cache.last_written.get(k), cache.last_written.get(v)
            if new_k is None:
                continue
            pair = self.selector(layer, self._before, new_k, new_v)
            if (
                not isinstance(pair, (tuple, list))
                or len(pair) != 2
                or not all(f is None or isinstance(f, str) for f in pair)
            ):
                raise InputError(
                    f"kv_format: the selector must return (k_format, v_format), each a page format "
                    f"name or None, for layer {layer}; got {pair!r}"
                )
            for name, fmt in zip((k, v), pair):
                if fmt is None:
                    continue
                fmt = page_format(fmt).name
                plane = pool.plane_index[name]
                if fmt != pool.planes[plane].storage:
                    self._chosen.append((plane, fmt))
        if self._chosen and not self.rollback:  # part of the run: it fails the run when it cannot be made
            self._conversion = self._prepare_conversion(self._chosen, self._residual())

    def commit(self, out: Mapping[str, np.ndarray]) -> None:
        self.cache.commit()
        owed, self._owed = self._owed, None
        if owed is not None:
            self._pending = NOTHING_OWED
            self._converted(owed)
        conversion, self._conversion = self._conversion, None
        if conversion is not None:
            conversion.publish(self.cache.table)
            self._converted(conversion)
        elif self._chosen:  # a truncate within the margin may still take the pages back
            self._pending = Owed(tuple(self._chosen), self._residual())
        if self.window is not None:
            freed = self.cache.table.evict(self.window + self.rollback)
            if freed:
                self.ctx.log("evict", allocations=0, extra={"pages_freed": freed})

    def _valid_lengths(self, feeds: Mapping[str, np.ndarray], batch: int) -> np.ndarray | None:
        """A static cache's valid positions per row after the run: its Attention nodes' ``nonpad_kv_seqlen`` if
        fed, else the leading ones of each row of the attention mask (None: neither fed as int [batch, ...]).
        Past them lie the padding a right-padded prompt wrote, which later runs overwrite: not full pages."""
        v = feeds.get(self._nonpad) if self._nonpad else None
        if isinstance(v, np.ndarray) and v.dtype.kind in "iu" and v.shape == (batch,):
            return np.maximum(v.astype(np.int64), 0)
        m = feeds.get(self.ctx.session.model.io.attention_mask or "")
        if isinstance(m, np.ndarray) and m.dtype.kind in "iub" and m.ndim == 2 and m.shape[0] == batch:
            return np.cumprod(m != 0, axis=1).sum(axis=1)
        return None

    def _prepare_conversion(self, chosen, residual: int) -> Conversion:
        """The conversion of the full pages ``chosen`` ((plane, format) pairs) makes eligible, keeping the
        ``residual`` most recent positions, built on the staged run (else the committed table) and not yet
        published.  Raises OutOfMemory / InputError naming State.run when it cannot get its memory (a free
        page id to copy a shared page into, a payload)."""
        try:
            return self.cache.full_pages_conversion(list(chosen), residual, self._valid)
        except (OutOfMemory, InputError) as e:
            cls = OutOfMemory if isinstance(e, OutOfMemory) else InputError
            names = ", ".join(sorted({fmt for _, fmt in chosen}))
            raise cls(f"State.run: converting full pages to the kv_format ({names}) failed: {e}") from e

    def _converted(self, conversion: Conversion) -> None:
        """Settle a published ``conversion`` (free what it replaced) and log it."""
        conversion.settle()
        if conversion.pages:
            extra = {"pages_converted": conversion.pages}
            self.ctx.log("quantize", cow_copied_bytes=conversion.copied, extra=extra)

    def _residual(self) -> int:
        """The selector's ``residual_tokens`` (0 without a selector)."""
        return int(getattr(self.selector, "residual_tokens", 0))

    def conversion_cycle(self) -> tuple[int, int] | None:
        """``(block_size, residual_tokens)`` of the selector's conversions (State.conversion_cycle)."""
        if self.selector is None:
            return None
        return self.pool.block_size, self._residual()

    def decode_steps(self, plan, feeds, count: int, names, eos, draws, finished=None, pad: int = 0) -> StepsRun | None:
        """Decode steps replayed in C (:func:`~onnxkv.plan.step_loop.run_steps`: per call at most up to the
        end of the page holding the 64th next position), committed; None, nothing staged, for a static
        cache, a format selector or a step the loop cannot replay.  Discarded if they raise."""
        if self.cache is None or self.ctx.static or self.selector is not None:
            return None
        self._fresh = False
        self.cache.keep_written = False
        try:
            run = run_steps(plan, self.feeds(feeds), self.cache.planes, int(count), names, eos, draws, finished, pad)
        except BaseException:
            self.discard()
            raise
        if run is not None and run.steps:
            self.commit({})
        else:  # pages a declined or refused loop staged are dropped
            self.cache.discard()
        return run

    def discard(self) -> None:
        if self._conversion is not None:
            self._conversion.abandon()
            self._conversion = None
        self.cache.discard()
        if self._owed is not None:  # the conversions stay owed
            self._owed.undo()
            self._owed = None
        if self._fresh:  # the first run made the cache: a failure leaves the store holding nothing, as before
            self.close()

    # -- contents ------------------------------------------------------------------------
    @property
    def values(self) -> dict[str, np.ndarray]:
        return {name: c.gather() for name, c in (self.caches or {}).items()}

    def committed_table(self, field: str) -> np.ndarray:
        """A read-only copy of the committed page table's ``field``: "tables" (int32 [B, M] page ids,
        -1: none) or "first" (int64 [B], the first position still held); empty before the first run."""
        if self.cache is None:
            out = np.full((0, 0), -1, np.int32) if field == "tables" else np.zeros(0, np.int64)
        else:
            out = getattr(self.cache.table, field).copy()
        out.flags.writeable = False
        return out

    @property
    def committed_bytes(self) -> int:
        """Every page the table references, once, in its own format (pages shared with forks or
        checkpoints included)."""
        return 0 if self.cache is None else self.pool.payloads.pages_bytes(self.cache.table.held_ids())

    def reset(self, arrays: dict[str, np.ndarray]) -> None:
        batch, length = batch_and_length(arrays)
        if not 1 <= batch <= MAX_ROWS:
            raise InputError(f"State.reset: a paged state's initial arrays hold 1 to {MAX_ROWS} rows, got {batch}")
        self.pool.check_room(batch * -(-length // self.pool.block_size), "State.reset")  # before any table
        ctx = self.ctx
        cache = (
            self._new_cache(batch)
            if ctx.static
            else PagedCache(self.pool, PageTable(self.pool, batch), max_tokens=ctx.capacity)
        )
        try:
            for name, a in arrays.items():
                plane = cache.planes[name]
                want = ctx.graph_inputs[name].dtype
                if a.shape != (batch, plane.heads, length, plane.head_size) or a.dtype != want:
                    raise InputError(
                        f"State.reset: initial '{name}' has shape {a.shape} {a.dtype}, expected "
                        f"[{batch}, {plane.heads}, {length}, {plane.head_size}] {want}"
                    )
                plane.write(a, 0, length)
            cache.commit()
        except Exception:
            cache.discard()
            cache.table.release()
            raise
        self.close()
        self.cache = cache

    def truncate(self, length: int) -> None:
        table = self.cache.table
        if self.window is not None and int(table.first.max(initial=0)) > max(0, length - self.window):
            raise StateError(
                f"State.truncate: positions below {int(table.first.max())} were evicted by the "
                f"sliding window; cannot go back to length {length}"
            )
        freed = table.truncate(int(length))
        self.ctx.log("truncate", allocations=0, cow_copied_bytes=0, prefix_copied_bytes=0, extra={"pages_freed": freed})

    def close(self) -> None:
        self._pending = NOTHING_OWED
        if self.cache is not None:
            self.cache.discard()
            self.cache.table.release()
            self.cache = None

    # -- page tables -----------------------------------------------------------------------
    def reorder(self, indices, api: str = "State.reorder") -> None:
        """Row ``i`` becomes old row ``indices[i]``: tables permuted, counts adjusted, no payload copied
        (errors name ``api``)."""
        idx = np.asarray(indices)
        if idx.size > MAX_ROWS:
            raise InputError(f"{api}: indices make {idx.size} rows, more than the {MAX_ROWS} a state holds")
        self.cache.table.permute(idx, api)
        self.ctx.log("reorder", allocations=0, cow_copied_bytes=0, prefix_copied_bytes=0)

    def start_on_pages(self, pages, length: int) -> None:
        """One row over ``pages`` (live ids of this pool, one reference taken each), ``length`` written: each
        page but the last must be held full by some row or cache, the last with its share of ``length``."""
        api = "State.start_on_pages"
        if self.cache is not None:
            raise InputError(f"{api}: the state already holds a cache (use a new state, e.g. sibling())")
        ids = np.asarray(pages)
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
            raise InputError(f"{api}: pages must be a non-empty 1-D int array, got {pages!r}")
        if ids.size > self.pool.core.capacity:  # more would repeat ids (counted before they are read)
            raise InputError(f"{api}: {ids.size} pages given, more than the {self.pool.core.capacity} ids of the pool")
        refs = self.pool.core.refs()
        if int(ids.min()) < 0 or int(ids.max()) >= len(refs) or (refs[ids.astype(np.int64)] <= 0).any():
            raise InputError(f"{api}: pages must be live page ids of this state's pool, got {ids.tolist()}")
        bs = self.pool.block_size
        if (
            isinstance(length, bool)
            or not isinstance(length, (int, np.integer))
            or not ((ids.size - 1) * bs < length <= ids.size * bs)
        ):
            raise InputError(f"{api}: length must end in the last of {ids.size} page(s) of {bs} tokens, got {length!r}")
        if self.ctx.static:
            raise InputError(f"{api}: static caches hold every page of their capacity from the start")
        claimed = np.full(ids.size, bs, np.int64)
        claimed[-1] = int(length) - (ids.size - 1) * bs
        have = self.pool.written(ids.astype(np.int64))
        short = np.flatnonzero(have < claimed)
        if short.size:  # a row may only hold positions some row wrote (not a truncated page's stale ones)
            j = int(short[0])
            raise InputError(
                f"{api}: page {int(ids[j])} (block {j}) would hold {int(claimed[j])} written position(s), but no "
                f"row or cache holds more than {int(have[j])} of it"
            )
        table = PageTable(self.pool, 1)
        table.tables = ids.astype(np.int32)[None].copy()
        table.lengths[0] = int(length)
        self.pool.incref(table.held_ids())
        self.cache = self._new_cache(1, table)
        self.ctx.log("append_rows", allocations=0, cow_copied_bytes=0, prefix_copied_bytes=0)

    def append_rows(self, other: PagedStore) -> None:
        """Rows of ``other``'s committed table after this one's (the same pool): this store holds a
        reference to each of their pages; ``other`` keeps its own until it is closed."""
        if other.pool is not self.pool:
            raise InputError("State.append_rows: the other state's pages are in another pool (make it with sibling())")
        self._append_table(other.cache.table, "State.append_rows")

    def append_empty(self, n: int) -> None:
        """``n`` rows holding nothing (length 0, no page) after this store's rows."""
        empty = PageTable(self.pool, n)
        try:
            self._append_table(empty, "State.append_empty_rows")
        finally:
            empty.release()

    def _append_table(self, theirs: PageTable, api: str) -> None:
        """The rows of ``theirs`` after this store's, a reference taken to each of their pages."""
        if self.ctx.static:
            raise InputError(f"{api}: static caches have one capacity per state and cannot take rows")
        mine = self.cache.table if self.cache is not None else PageTable(self.pool, 0)
        table = PageTable(self.pool, mine.batch + theirs.batch)
        m = max(mine.tables.shape[1], theirs.tables.shape[1])
        table.tables = np.full((table.batch, m), -1, np.int32)
        table.tables[: mine.batch, : mine.tables.shape[1]] = mine.tables
        table.tables[mine.batch :, : theirs.tables.shape[1]] = theirs.tables
        table.lengths = np.concatenate([mine.lengths, theirs.lengths])
        table.first = np.concatenate([mine.first, theirs.first])
        self.pool.incref(table.held_ids())
        if self.cache is None:
            mine.release()
            self.cache = self._new_cache(table.batch, table)
        else:
            self.cache.replace_table(table)
        self.ctx.log("append_rows", allocations=0, cow_copied_bytes=0, prefix_copied_bytes=0)

    def checkpoint(self, owner: object, steps: int) -> Checkpoint:
        """A :class:`Checkpoint` of the committed table for ``owner`` (the state), at its ``steps``."""
        cp = Checkpoint(owner, self.cache.table.share(), steps, self._pending)
        self.ctx.log("checkpoint", allocations=0, cow_copied_bytes=0, prefix_copied_bytes=0)
        return cp

    def restore(self, checkpoint: Checkpoint, owner: object) -> int:
        """Make a share of ``checkpoint``'s table (made for ``owner``, not released) the committed table;
        return the checkpoint's steps."""
        if not isinstance(checkpoint, Checkpoint) or checkpoint._owner is not owner:
            raise InputError("State.restore: the checkpoint was not made by this state")
        if checkpoint.table is None:
            raise StateError("State.restore: the checkpoint was released")
        self.cache.replace_table(checkpoint.table.share())
        self._pending = checkpoint._pending
        self.ctx.log("restore", allocations=0, cow_copied_bytes=0, prefix_copied_bytes=0)
        return checkpoint.steps

    def quantize_pages(self, indices, k_format: str | None, v_format: str | None) -> None:
        """:func:`onnxkv.cache.page_convert.quantize_blocks` over every layer's key / value planes."""
        planes = [
            (self.pool.plane_index[n], f)
            for k, v in self.layer_pairs()
            for n, f in ((k, k_format), (v, v_format))
            if f is not None
        ]
        converted, shared = quantize_blocks(self.cache.table, indices, planes, "State.quantize_pages")
        self.ctx.log("quantize", cow_copied_bytes=shared * self.pool.page_bytes, extra={"pages_converted": converted})

    def compress_rows(self, rows, fmt_name: str, keep_tokens: int) -> int:
        """Convert the full pages of ``rows`` older than each row's last ``keep_tokens`` positions, held by
        this table alone and with more bits per element than ``fmt_name``, to ``fmt_name`` in every plane
        (all or nothing); returns the payload bytes freed."""
        target = page_format(fmt_name).bits
        table, pool, bs = self.cache.table, self.pool, self.pool.block_size
        payloads = pool.payloads
        where: dict[int, list[tuple[int, int]]] = {}
        for b in rows:
            upto = min(max(0, int(table.lengths[b]) - keep_tokens) // bs, table.tables.shape[1])
            for blk in range(int(table.first[b]) // bs, upto):
                p = int(table.tables[b, blk])
                if p < 0 or pool.refcount(p) != 1:  # shared: converting would copy it
                    continue
                if any(page_format(int(f[p])).bits > target for f in payloads.formats):
                    where[p] = [(b, blk)]
        if not where:
            return 0
        before = payloads.committed_bytes
        convert_pages(table, where, [(i, fmt_name) for i in range(len(payloads.formats))])
        freed = before - payloads.committed_bytes
        self.ctx.log("quantize", cow_copied_bytes=0, extra={"pages_converted": len(where), "bytes_freed": freed})
        return freed

    # -- serialisation ---------------------------------------------------------------------
    def layer_pairs(self) -> list[tuple[str, str]]:
        """(key past, value past) names of every layer, in layer order."""
        pairs: dict[int, dict[str, str]] = {}
        for b in self.ctx.bindings:
            pairs.setdefault(b.layer, {})[b.role] = b.past
        return [(p["key"], p["value"]) for _, p in sorted(pairs.items())]

    def signature(self) -> str:
        conv = self.ctx.session.model.convention
        shapes = ";".join(f"{g.name}:{g.dtype}:{g.shape}" for g in self.ctx.session.plan.inputs)
        return hashlib.sha256(f"{conv.kind}|{shapes}".encode()).hexdigest()

    def snapshot(self):
        """A :class:`~onnxkv.cache.snapshot.CacheSnapshot` of the committed cache and of the conversions it
        owes its next run."""
        owed = self._pending
        return take_snapshot(self.cache, self.layer_pairs(), self.signature(), owed.planes, owed.residual)

    def decode(self, source: bytes | str | os.PathLike):
        """The snapshot saved in ``source`` (bytes or a path), checked against the pool's size limit and the
        model before it is decoded (see :meth:`State.load_cache <onnxkv.runtime.state.State.load_cache>`)."""
        limit = file_bytes_limit(self.pool)
        expected = expectation(self.pool, self.layer_pairs(), self.signature(), "State.load_cache")
        if isinstance(source, (bytes, bytearray, memoryview)):
            return serialize.decode(source, limit, expected)
        if isinstance(source, (str, os.PathLike)):
            try:
                return serialize.load(source, limit, expected)
            except OSError as e:
                raise InputError(f"State.load_cache: cannot read {os.fspath(source)!r}: {e}") from e
        raise InputError(f"State.load_cache: source must be bytes or a path, got {type(source).__name__}")

    def load(self, snapshot) -> None:
        """Replace the cache by ``snapshot``'s contents; all or nothing (:func:`paged_from_snapshot`)."""
        ctx = self.ctx
        owed = owed_planes(self.pool, self.layer_pairs(), snapshot, "State.load_cache")  # before any page
        cache = paged_from_snapshot(
            snapshot,
            self.pool,
            self.layer_pairs(),
            ctx.static_capacity if ctx.static else ctx.capacity,
            self.window,
            "State.load_cache",
        )
        cache.static_length = ctx.static_capacity if ctx.static else None
        self.close()
        self.cache = cache
        if owed:  # the saving state owed them its next run: this state's next run makes them
            self._pending = Owed(owed, int(snapshot.owed_residual_tokens))
