"""Converting the committed pages of one page table to other formats, copy-on-write.

One routine, :func:`convert_pages`, does the page-table surgery of every
format change of a paged state: a page the table shares with other holders
(forks, checkpoints) is first copied for this table (one copy shared by all
the table's places of that page), so other holders never see a change; then
each selected (page, plane) gets one new payload built from its values
(:meth:`~onnxkv.cache.plane_payloads.PlanePayloads.build_payload`).  It is
all or nothing: ids and payloads are allocated and built before anything is
published; an error frees them and leaves table, counts and payloads as
they were.

:func:`convert_full_pages` (after a run, the ``kv_format`` selector's
choice) converts page by page through it; :func:`quantize_blocks`
(``State.quantize_pages``) converts every selected page in one call.
Call both between runs, on the committed table.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxkv.cache import formats
from onnxkv.cache.page_table import PageTable
from onnxkv.errors import InputError

__all__ = ["convert_pages", "convert_full_pages", "quantize_blocks"]


def convert_pages(
    table: PageTable, where: dict[int, list[tuple[int, int]]], targets: Sequence[tuple[int, str]]
) -> tuple[int, int]:
    """Give every page of ``where`` (page id -> its (row, block) places in ``table``) the format of each
    (plane, format name) of ``targets``; all or nothing (module docstring).

    A page whose reference count exceeds its places is copied for this
    table first.  Returns (pages copied, bytes read by those copies).
    Raises :class:`~onnxkv.errors.OutOfMemory` or
    :class:`~onnxkv.errors.InputError` (the allocator failed) with nothing
    changed.
    """
    pool, bs = table.pool, table.pool.block_size
    payloads = pool.payloads
    shared = [p for p, places in where.items() if pool.refcount(p) > len(places)]
    fresh = pool.allocate(len(shared)) if shared else np.zeros(0, np.int32)
    target = {p: p for p in where}
    target.update(zip(shared, fresh.tolist()))
    built, copied = [], 0
    try:
        for p, new in zip(shared, fresh.tolist()):
            copied += payloads.copy_page(p, new, bs)
        for p in where:
            for plane, fmt in targets:
                buf, arr = payloads.build_payload(plane, target[p], fmt, bs)
                built.append((plane, target[p], buf, arr, fmt))
    except BaseException:
        for _, _, buf, _, _ in built:
            payloads.discard_payload(buf)
        pool.decref(fresh)
        raise
    for plane, p, buf, arr, fmt in built:
        payloads.install_payload(plane, p, buf, arr, fmt)
    for p, new in zip(shared, fresh.tolist()):
        places = where[p]
        pool.incref(np.full(len(places) - 1, new, np.int32))
        for b, blk in places:
            table.tables[b, blk] = new
        pool.decref(np.full(len(places), p, np.int32))
    return len(shared), copied


def convert_full_pages(table: PageTable, plane: int, fmt_name: str, residual_tokens: int = 0) -> tuple[int, int]:
    """Convert ``table``'s full native pages of ``plane`` older than ``length - residual_tokens`` to ``fmt_name``.

    A page referenced only by this table is converted once (every row
    holding it sees the new payload); a page also held elsewhere is copied
    first (:func:`convert_pages`).  Page by page: an error leaves the pages
    converted before it in their new format and raises.  Returns (pages
    converted, bytes copied for copy-on-write).
    """
    pool, bs = table.pool, table.pool.block_size
    payloads = pool.payloads
    code = formats.page_format(fmt_name).code
    where: dict[int, list[tuple[int, int]]] = {}
    for b in range(table.batch):
        upto = min(max(0, int(table.lengths[b]) - residual_tokens) // bs, table.tables.shape[1])
        for blk in range(int(table.first[b]) // bs, upto):
            p = int(table.tables[b, blk])
            if p >= 0 and not payloads.quantized(plane, p) and int(payloads.formats[plane][p]) != code:
                where.setdefault(p, []).append((b, blk))
    copied = 0
    for p, places in where.items():
        copied += convert_pages(table, {p: places}, [(plane, fmt_name)])[1]
    return len(where), copied


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
