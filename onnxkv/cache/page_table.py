"""Page tables: which page id holds each logical block of each sequence.

A :class:`PageTable` holds, for a batch of sequences (rows), ``tables`` int32
``[B, M]`` (logical block ``i`` of row ``b`` covers tokens ``[i*bs, (i+1)*bs)``;
-1 = no page: never written, or evicted by a sliding window) and ``lengths``
int64 ``[B]``.  Every page id in a table holds one reference in its
:class:`~onnxkv.cache.block_pool.BlockPool`.  States, forks and checkpoints
are page tables: forking, reordering, checkpointing and truncating change
tables and reference counts only (no payload byte moves).
"""

from __future__ import annotations

import numpy as np

from onnxkv.cache.block_pool import BlockPool
from onnxkv.errors import InputError

__all__ = ["PageTable"]


class PageTable:
    """Page tables and valid lengths of a batch of sequences (module docstring).

    ``tables`` int32 [B, M] and ``lengths`` int64 [B] are owned by this
    object; every id in ``tables`` holds one reference in ``pool``.
    ``first`` int64 [B] is the first position still held (> 0 after sliding
    window eviction).
    """

    def __init__(self, pool: BlockPool, batch: int) -> None:
        self.pool = pool
        self.tables = np.full((batch, 0), -1, np.int32)
        self.lengths = np.zeros(batch, np.int64)
        self.first = np.zeros(batch, np.int64)
        pool.register(self)

    @property
    def batch(self) -> int:
        return self.tables.shape[0]

    def held_ids(self) -> np.ndarray:
        t = self.tables
        return t[t >= 0]

    def written_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, positions): every page a row holds and how many of its block's positions that row wrote
        (1 .. block size)."""
        bs, t = self.pool.block_size, self.tables
        written = np.clip(self.lengths[:, None] - np.arange(t.shape[1])[None, :] * bs, 0, bs)
        held = (t >= 0) & (written > 0)
        return t[held], written[held]

    def share(self, rows: np.ndarray | None = None) -> PageTable:
        """A new table holding rows ``rows`` (default all) of this one, sharing their pages."""
        sel = np.arange(self.batch) if rows is None else np.asarray(rows, np.int64)
        out = PageTable(self.pool, len(sel))
        out.tables = self.tables[sel].copy()
        out.lengths = self.lengths[sel].copy()
        out.first = self.first[sel].copy()
        self.pool.incref(out.held_ids())
        return out

    def permute(self, rows: np.ndarray, api: str = "PageTable.permute") -> None:
        """Make row ``i`` old row ``rows[i]`` (int [n], each in ``[0, batch)``; n >= 1 may differ from the
        batch, rows may repeat): the rows share their pages, references are adjusted, no payload is copied.
        InputError naming ``api`` for other rows, with nothing changed."""
        sel = np.asarray(rows)
        if sel.ndim != 1 or not sel.size or sel.dtype.kind not in "iu":
            raise InputError(f"{api}: indices must be a non-empty 1-D int array, got {rows!r}")
        if int(sel.min()) < 0 or int(sel.max()) >= self.batch:
            raise InputError(f"{api}: indices must be in [0, {self.batch}), got {sel.tolist()}")
        tables = self.tables[sel]
        old = self.held_ids()
        self.pool.incref(tables[tables >= 0])  # first: a page both tables hold never reaches 0 in between
        self.tables, self.lengths, self.first = tables, self.lengths[sel], self.first[sel]
        self.pool.decref(old)

    def release(self) -> None:
        """Drop every reference (pages nobody else holds are freed)."""
        ids = self.held_ids()
        self.tables = np.full((self.batch, 0), -1, np.int32)
        self.lengths[:] = 0
        self.first[:] = 0
        self.pool.decref(ids)

    def truncate(self, length: int) -> int:
        """Keep positions ``< length`` of every row; drop pages wholly past it; return pages released."""
        bs = self.pool.block_size
        keep = -(-int(length) // bs)
        drop = self.tables[:, keep:]
        ids = drop[drop >= 0]
        self.tables = self.tables[:, :keep].copy()
        self.lengths = np.minimum(self.lengths, length)
        self.first = np.minimum(self.first, self.lengths)
        return self.pool.decref(ids) if ids.size else 0

    def evict(self, window: int) -> int:
        """Drop pages no future query can see: all tokens below ``lengths[b] - window``. Returns pages released."""
        bs = self.pool.block_size
        released = []
        for b in range(self.batch):
            lo = int(self.lengths[b]) - window  # smallest position the next query may read
            n = max(0, lo) // bs  # blocks wholly below it
            row = self.tables[b, :n]
            gone = row[row >= 0]
            if gone.size:
                released.append(gone.copy())
                row[:] = -1
            self.first[b] = max(int(self.first[b]), n * bs)
        return self.pool.decref(np.concatenate(released)) if released else 0
