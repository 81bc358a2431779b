"""A paged state's cache contents at one moment: :class:`Checkpoint`."""

from __future__ import annotations

from typing import NamedTuple

from onnxkv.cache.page_table import PageTable

__all__ = ["Checkpoint", "Owed", "NOTHING_OWED"]


class Owed(NamedTuple):
    """Page conversions a paged state owes its next run (see ``State.keep_for_truncate``): ``planes``,
    (plane index, page format) pairs, made with the ``residual`` most recent positions of each row kept
    (the ``residual_tokens`` of the ``kv_format`` selector that chose them; a loaded cache states the
    saving state's)."""

    planes: tuple[tuple[int, str], ...] = ()
    residual: int = 0


NOTHING_OWED = Owed()


class Checkpoint:
    """A paged state's cache contents at one moment, held by page references (no copy).

    Made by :meth:`State.checkpoint <onnxkv.runtime.state.State.checkpoint>`;
    :meth:`State.restore <onnxkv.runtime.state.State.restore>` returns the
    state to it (any number of times).  Holding a checkpoint keeps its pages
    alive; :meth:`release` (or garbage collection) drops them.
    """

    def __init__(self, owner: object, table: PageTable, steps: int, pending: Owed) -> None:
        self._owner = owner
        self.table: PageTable | None = table
        self.steps = steps
        #: The page conversions the state owed its next run then: a restore owes them again.
        self._pending = pending

    @property
    def length(self) -> int:
        return 0 if self.table is None or not self.table.batch else int(self.table.lengths.max())

    def release(self) -> None:
        if self.table is not None:
            self.table.release()
            self.table = None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass
