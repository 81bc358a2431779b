"""Storage of contract-declared persistent values (``GraphProto.persistent_bindings``: input <- output).

Each declared input holds one value in persistent storage leased from the
state's allocator and registered with :mod:`onnxkv.cache.bound` (so the
plan's MUST_ALIAS checks accept it).  Kernels that write a value in place
save what they overwrite and put it back if the run fails
(:meth:`~onnxkv.plan.context.RunContext.preserve`); a value the model
produced elsewhere is copied into fresh storage when the run is committed;
values a failed first run made are dropped again.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from onnxkv.alloc import checked
from onnxkv.cache import bound
from onnxkv.cache.page_set import PageSet
from onnxkv.errors import InputError, StateError
from onnxkv.runtime.stores.protocol import StoreContext

__all__ = ["DeclaredStore"]


class DeclaredStore:
    """The :class:`~onnxkv.runtime.stores.protocol.Store` of declared persistent values (module docstring).

    ``held``: declared input -> (buffer, array) of its storage.
    """

    caches = None

    def __init__(self, ctx: StoreContext) -> None:
        self.ctx = ctx
        self.declared = dict(ctx.session.declared_bindings)
        self.held: dict[str, tuple] = {}
        self._fresh: list[str] = []

    def _store(self, name: str, array: np.ndarray) -> None:
        """Copy ``array`` into fresh persistent storage held as value ``name``."""
        buf, arr = checked.lease(self.ctx.allocator, array.nbytes, 64, array.dtype, array.shape, f"State '{name}'")
        arr[...] = array
        self._drop(name)
        bound.register(id(buf), arr)
        self.held[name] = (buf, arr)

    def _drop(self, name: str) -> None:
        held = self.held.pop(name, None)
        if held is not None:
            bound.unregister(id(held[0]))
            checked.release(self.ctx.allocator, [held[0]], f"State '{name}'")

    # -- a run ---------------------------------------------------------------------
    def prepare(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Make every value not held yet (zeros of its static shape); the held arrays are what kernels write."""
        self._fresh = [name for name in self.declared if name not in self.held]
        try:
            for name in self._fresh:
                g = self.ctx.graph_inputs[name]
                if g.shape is None or not all(isinstance(d, int) for d in g.shape):
                    raise StateError(
                        f"State: persistent input '{name}' has no static shape {g.shape}; "
                        "give its first value with new_state(initial=...)"
                    )
                self._store(name, np.zeros(g.shape, g.dtype))
        except BaseException:
            self.discard()
            raise
        return {name: arr for name, (_, arr) in self.held.items()}

    def feeds(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        full = dict(feeds)
        for name, (_, arr) in self.held.items():
            full[name] = arr
        return full

    def finish(self) -> None:
        """Nothing can fail a run of declared values after its plan."""

    def commit(self, out: Mapping[str, np.ndarray]) -> None:
        """Publish each declared output that was not written in place into its input's storage."""
        self._fresh = []
        for name, produced in self.declared.items():
            value = out[produced]
            mine = self.held[name][1]
            if not (
                value.shape == mine.shape
                and value.__array_interface__["data"][0] == mine.__array_interface__["data"][0]
            ):
                self._store(name, value)

    def decode_steps(self, plan, feeds, count: int, names, eos, draws, finished=None, pad: int = 0) -> None:
        """Whole decode steps are replayed over contiguous caches only: None, nothing run."""
        return None

    def discard(self) -> None:
        for name in self._fresh:
            self._drop(name)
        self._fresh = []

    # -- contents ----------------------------------------------------------------------
    @property
    def values(self) -> dict[str, np.ndarray]:
        return {name: arr.view() for name, (_, arr) in self.held.items()}

    @property
    def committed_bytes(self) -> int:
        """Each value's storage, plus the payloads of pages ``QuantizePagedCache`` converted
        (:class:`~onnxkv.cache.page_set.PageSet`)."""
        total = 0
        for _, a in self.held.values():
            handle = PageSet.of(a)
            total += a.nbytes + (handle.payload_bytes if handle is not None else 0)
        return total

    def reset(self, arrays: dict[str, np.ndarray]) -> None:
        self.close()
        for name, a in arrays.items():
            g = self.ctx.graph_inputs[name]
            if a.dtype != g.dtype:
                raise InputError(f"State.reset: initial '{name}' has dtype {a.dtype}, expected {g.dtype}")
            self._store(name, a)

    def close(self) -> None:
        for name in list(self.held):
            self._drop(name)
