"""Cancelling a running :meth:`State.run <onnxkv.runtime.state.State.run>` from another thread."""

from __future__ import annotations

import threading

__all__ = ["Cancellation"]


class Cancellation:
    """A token to cancel a running :meth:`State.run` from another thread.

    The plan checks it between nodes (a replayed compiled step: between its recorded segments); a
    cancelled run raises :class:`~onnxkv.errors.Cancelled` and publishes nothing.
    """

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()
