"""A paged state's cache contents at one moment: :class:`Checkpoint`."""

from __future__ import annotations

from onnxkv.cache.page_table import PageTable

__all__ = ["Checkpoint"]


class Checkpoint:
    """A paged state's cache contents at one moment, held by page references (no copy).

    Made by :meth:`State.checkpoint <onnxkv.runtime.state.State.checkpoint>`;
    :meth:`State.restore <onnxkv.runtime.state.State.restore>` returns the
    state to it (any number of times).  Holding a checkpoint keeps its pages
    alive; :meth:`release` (or garbage collection) drops them.
    """

    def __init__(self, owner: object, table: PageTable, steps: int, pending: list[tuple[int, str]]) -> None:
        self._owner = owner
        self.table: PageTable | None = table
        self.steps = steps
        #: The page conversions the state owed its next run then ((plane, format) pairs; see
        #: ``State.keep_for_truncate``): a restore owes them again.
        self._pending = list(pending)

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
