"""Converting the pages of one page table to other formats, copy-on-write, all or nothing.

:func:`prepare_conversion` does the work of every format change of a paged
state without publishing any of it: a page the table shares with other
holders (forks, checkpoints, the engine's prefix cache) is first copied into
a fresh page id for this table (one copy shared by all the table's places of
that page), so other holders never see a change; then each selected (page,
plane) gets one new payload built from its values
(:meth:`~onnxkv.cache.plane_payloads.PlanePayloads.build_payload`).  The
:class:`Conversion` it returns is then installed (page-table surgery and
payload swaps, which cannot fail) or abandoned (everything freed): an error
while preparing leaves table, counts and payloads as they were.

A run's ``kv_format`` conversions are prepared on the run's staged table
before it commits (:func:`full_pages_conversion`), so a conversion that
cannot get its memory fails the run, never leaving a page in a format the
run's later reads would not expect; :func:`quantize_blocks`
(``State.quantize_pages``) and :func:`convert_full_pages` prepare and
install on the committed table, between runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxkv.cache import formats
from onnxkv.cache.page_table import PageTable
from onnxkv.cache.plane_payloads import NATIVE_CODE
from onnxkv.errors import InputError

__all__ = [
    "Conversion",
    "prepare_conversion",
    "convert_pages",
    "full_pages_conversion",
    "convert_full_pages",
    "quantize_blocks",
]


class Conversion:
    """Pages of one table built in new formats, not yet published (:func:`prepare_conversion`).

    Holds the new payloads and, for each page the table shares with other
    holders, a fresh page id already holding a copy of it.  Nothing any
    reader sees has changed until :meth:`install` publishes everything
    (it cannot fail); :meth:`abandon` frees it all instead.  A conversion
    a run must see before it knows whether it commits is published with
    the old payloads and page references kept (:meth:`publish`), then
    settled (:meth:`settle`: they are freed) or undone (:meth:`undo`: the
    table, payloads and counts are as they were, the new ones freed).
    """

    def __init__(self, pool, where: dict[int, list[tuple[int, int]]], shared: list[int], fresh: np.ndarray) -> None:
        self.pool = pool
        self.where = where
        self.shared = shared
        self.fresh = fresh
        self.built: list[tuple[int, int, object, np.ndarray, str]] = []
        #: Bytes read by the copies of shared pages.
        self.copied = 0
        self._kept: list[tuple[int, int, tuple]] = []  # published: (plane, page, old payload record)
        self._table: PageTable | None = None

    @property
    def pages(self) -> int:
        """Pages converted (each counted once, whatever its planes)."""
        return len(self.where)

    def install(self, table: PageTable) -> None:
        """Publish the payloads and point ``table``'s places of each shared page at its copy; free what
        they replace."""
        self.publish(table)
        self.settle()

    def publish(self, table: PageTable) -> None:
        """As :meth:`install`, keeping the replaced payloads and the shared pages' references until
        :meth:`settle` or :meth:`undo`."""
        payloads = self.pool.payloads
        for plane, p, buf, arr, fmt in self.built:
            old = payloads.install_payload(plane, p, buf, arr, fmt, keep_old=True)
            if old is not None:
                self._kept.append((plane, p, old))
        for p, new in zip(self.shared, self.fresh.tolist()):
            places = self.where[p]
            self.pool.incref(np.full(len(places) - 1, new, np.int32))
            for b, blk in places:
                table.tables[b, blk] = new
        self.built, self._table = [], table

    def settle(self) -> None:
        """Free the payloads and drop the page references :meth:`publish` replaced."""
        for _, _, old in self._kept:
            self.pool.payloads.discard_payload(old[0])
        for p in self.shared:
            self.pool.decref(np.full(len(self.where[p]), p, np.int32))
        self._kept, self.shared, self.fresh, self._table = [], [], np.zeros(0, np.int32), None

    def undo(self) -> None:
        """Return the table, payloads and counts :meth:`publish` changed to what they were."""
        payloads = self.pool.payloads
        for plane, p, old in reversed(self._kept):
            payloads.restore_payload(plane, p, old)
        for p, new in zip(self.shared, self.fresh.tolist()):
            for b, blk in self.where[p]:
                self._table.tables[b, blk] = p
            self.pool.decref(np.full(len(self.where[p]), new, np.int32))
        self._kept, self.shared, self.fresh, self._table = [], [], np.zeros(0, np.int32), None

    def abandon(self) -> None:
        """Free the built payloads and the copies' page ids (nothing published)."""
        for _, _, buf, _, _ in self.built:
            self.pool.payloads.discard_payload(buf)
        self.built = []
        if self.fresh.size:
            self.pool.decref(self.fresh)
            self.fresh = np.zeros(0, np.int32)


def prepare_conversion(
    pool,
    where: dict[int, list[tuple[int, int]]],
    targets: dict[int, Sequence[tuple[int, str]]],
    dropped: Sequence[int] = (),
) -> Conversion:
    """Build every page of ``where`` (page id -> its (row, block) places in one table) in the formats of
    ``targets[page]`` ((plane, format name) pairs); publish nothing.

    A page with more references than places (after the references
    ``dropped`` lists go: a run's commit drops those of the pages it
    replaced by copies) is first copied into a fresh page id, which gets
    the payloads instead (its planes not converted now keep their formats,
    byte for byte).  Raises :class:`~onnxkv.errors.OutOfMemory` (no
    free page id for a copy, the allocator failed) or
    :class:`~onnxkv.errors.InputError` (the allocator broke its contract)
    with nothing allocated.
    """
    payloads, bs = pool.payloads, pool.block_size
    drops: dict[int, int] = {}
    for p in dropped:
        drops[p] = drops.get(p, 0) + 1
    shared = [p for p, places in where.items() if pool.refcount(p) - drops.get(p, 0) > len(places)]
    fresh = pool.allocate(len(shared)) if shared else np.zeros(0, np.int32)
    conversion = Conversion(pool, where, shared, fresh)
    target = {p: p for p in where}
    target.update(zip(shared, fresh.tolist()))
    try:
        for p, new in zip(shared, fresh.tolist()):
            conversion.copied += payloads.copy_page(p, new, bs)  # every plane native (dequantized) ...
            chosen = {plane for plane, _ in targets[p]}
            for plane in range(len(pool.planes)):  # ... but a plane not converted now keeps its format
                if plane not in chosen and payloads.quantized(plane, p):
                    buf, arr = payloads.duplicate_payload(plane, p)
                    fmt = formats.page_format(int(payloads.formats[plane][p])).name
                    conversion.built.append((plane, new, buf, arr, fmt))
        for p in where:
            for plane, fmt in targets[p]:
                buf, arr = payloads.build_payload(plane, target[p], fmt, bs)
                conversion.built.append((plane, target[p], buf, arr, fmt))
    except BaseException:
        conversion.abandon()
        raise
    return conversion


def convert_pages(
    table: PageTable, where: dict[int, list[tuple[int, int]]], targets: Sequence[tuple[int, str]]
) -> tuple[int, int]:
    """Give every page of ``where`` (page id -> its (row, block) places in ``table``) the format of each
    (plane, format name) of ``targets``; all or nothing (module docstring).

    A page whose reference count exceeds its places is copied for this
    table first.  Returns (pages copied, bytes read by those copies).
    Raises as :func:`prepare_conversion` does, with nothing changed.
    """
    conversion = prepare_conversion(table.pool, where, dict.fromkeys(where, targets))
    copies = len(conversion.shared)
    conversion.install(table)
    return copies, conversion.copied


def full_pages_conversion(
    table: PageTable,
    tables: np.ndarray,
    lengths: np.ndarray,
    chosen: Sequence[tuple[int, str]],
    residual_tokens: int = 0,
    dropped: Sequence[int] = (),
) -> Conversion:
    """:func:`prepare_conversion` of the full native pages of each (plane, format name) of ``chosen`` that
    are older than ``length - residual_tokens`` in their row of ``tables`` / ``lengths`` (``table``'s own,
    or a run's staged ones, whose commit drops the references ``dropped`` lists), from each row's first
    kept position (``table.first``).

    A page held only by this table is converted once (every row holding
    it sees the new payload); a page also held elsewhere is copied first.
    Raises as :func:`prepare_conversion` does, with nothing allocated.
    """
    pool, bs = table.pool, table.pool.block_size
    payloads = pool.payloads
    blocks = np.arange(tables.shape[1])
    upto = np.minimum(np.maximum(lengths.astype(np.int64) - residual_tokens, 0) // bs, tables.shape[1])
    full = (blocks >= (table.first.astype(np.int64) // bs)[:, None]) & (blocks < upto[:, None]) & (tables >= 0)
    rows, cols = np.nonzero(full)  # the full pages' places, row by row (read once per run: vectorised)
    ids = tables[rows, cols]
    where: dict[int, list[tuple[int, int]]] = {}
    targets: dict[int, list[tuple[int, str]]] = {}
    for plane, fmt_name in chosen:
        native = NATIVE_CODE[pool.planes[plane].storage]
        if formats.page_format(fmt_name).code == native:
            continue
        for i in np.flatnonzero(payloads.formats[plane][ids] == native).tolist():
            p, place = int(ids[i]), (int(rows[i]), int(cols[i]))
            places = where.setdefault(p, [])
            if place not in places:
                places.append(place)
            if (plane, fmt_name) not in targets.setdefault(p, []):
                targets[p].append((plane, fmt_name))
    return prepare_conversion(pool, where, targets, dropped)


def convert_full_pages(table: PageTable, plane: int, fmt_name: str, residual_tokens: int = 0) -> tuple[int, int]:
    """Convert ``table``'s full native pages of ``plane`` older than ``length - residual_tokens`` to
    ``fmt_name`` (:func:`full_pages_conversion`), all or nothing.  Returns (pages converted, bytes copied
    for copy-on-write)."""
    conversion = full_pages_conversion(table, table.tables, table.lengths, [(plane, fmt_name)], residual_tokens)
    conversion.install(table)
    return conversion.pages, conversion.copied


def quantize_blocks(table: PageTable, indices, planes: Sequence[tuple[int, str]], api: str) -> tuple[int, int]:
    """Convert logical blocks ``indices`` (full blocks of every row) of ``planes`` ((plane, format name)
    pairs) in one :func:`convert_pages` call: all or nothing.

    ``indices`` must be distinct ints naming blocks full in every row and
    not evicted (InputError starting with ``api``, nothing changed).
    Returns (pages converted, pages copied for copy-on-write).
    """
    bs = table.pool.block_size
    for _, f in planes:
        formats.page_format(f)  # raises InputError naming the value
    idx = np.asarray(indices)
    # distinct blocks are at most the table's blocks: a longer list repeats one (counted before it is read)
    if (
        idx.ndim != 1
        or not np.issubdtype(idx.dtype, np.integer)
        or idx.size > table.tables.shape[1]
        or len(set(idx.tolist())) != idx.size
    ):
        raise InputError(f"{api}: indices must be distinct ints, got {indices!r}")
    full = int(table.lengths.min()) // bs if table.batch else 0
    lo = int(table.first.max(initial=0)) // bs
    if idx.size and (idx.min() < lo or idx.max() >= full):
        raise InputError(f"{api}: indices must be full blocks in [{lo}, {full}) of every row, got {idx.tolist()}")
    pages = sorted({int(p) for p in table.tables[:, idx].reshape(-1) if p >= 0})
    where = {p: [(int(b), int(blk)) for b, blk in zip(*np.nonzero(table.tables == p))] for p in pages}
    shared, _ = convert_pages(table, where, planes)
    return len(pages), shared
