"""What a batched engine's page pool holds: pages and payload bytes by holder and by page format.

:func:`pool_occupancy` reads the pool, the batched state's page tables and each request's own state; it
changes nothing.  A page is charged to the one request whose rows hold it, to ``"shared"`` when rows of
several requests hold it (a shared prompt prefix), or to ``"prefix cache"`` when only the prefix cache
keeps it.  The engine logs it with every ``engine_step`` event (``extra["pool"]``) when the session's
event log is on; ``onnxkv report --pool FILE`` draws those records over the steps
(:mod:`onnxkv.occupancy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from onnxkv.cache.formats import page_format

if TYPE_CHECKING:
    from onnxkv.engine.engine import Engine

__all__ = ["pool_occupancy", "SHARED", "PREFIX"]

#: Holder name of pages that rows of more than one request hold.
SHARED = "shared"
#: Holder name of pages only the prefix cache keeps (unreferenced by any request).
PREFIX = "prefix cache"


def pool_occupancy(engine: Engine) -> dict:
    """The pool of ``engine`` now (batched engines; ``{}`` before the first request ran or otherwise):

    ``{"pages": live page ids, "max_pages": bound or None, "committed_bytes": payload bytes held,
    "max_bytes": byte bound or None, "holders": {name: {"pages": int, "bytes": {format: int}}}}``.
    Holder names are ``"request <id>"``, :data:`SHARED` and :data:`PREFIX`; formats are page format names
    (``"float32"``, ``"int8"``, ...), bytes summed over every plane (keys and values of every layer).
    """
    batch = engine._batch
    if not engine.batched or batch is None:
        return {}
    pool = batch.pool
    owner: dict[int, int] = {}  # page id -> request id, or -1: several requests
    tables: list[tuple[int, np.ndarray]] = []
    if batch.batch:
        tables += [(r.id, row) for r, row in zip(engine._rows, batch.page_tables, strict=True)]
    for r in engine.active:
        state = r._state
        if state is not None and not state.closed and state.batch:
            tables += [(r.id, row) for row in state.page_tables]
    for rid, row in tables:
        for p in row[row >= 0].tolist():
            held = owner.get(p)
            owner[p] = rid if held is None or held == rid else -1
    groups: dict[str, list[int]] = {}
    for p, rid in owner.items():
        groups.setdefault(f"request {rid}" if rid >= 0 else SHARED, []).append(p)
    if engine._prefix is not None:
        only = [p for p in engine._prefix.held_ids().tolist() if p not in owner]
        if only:
            groups[PREFIX] = only
    holders = {}
    for name, ids in groups.items():
        idx = np.asarray(ids, np.int64)
        codes, sizes = pool.formats[:, idx].ravel(), pool.sizes[:, idx].ravel()
        by_format: dict[str, int] = {}
        for code in np.unique(codes).tolist():
            by_format[page_format(int(code)).name] = int(sizes[codes == code].sum())
        holders[name] = {"pages": len(ids), "bytes": by_format}
    return {
        "pages": int(pool.live_pages),
        "max_pages": pool.max_pages,
        "committed_bytes": int(pool.committed_bytes),
        "max_bytes": pool.max_bytes,
        "holders": holders,
    }
