"""Contiguous storage of a state's caches: one :class:`~onnxkv.cache.contiguous.CacheTensor` per bound past.

Every past input the plan binds (see :mod:`onnxkv.model.rewrite`) is fed a
view of its persistent buffer ``[B, H, capacity, D]``: the nodes joining past
and present write only the new positions, in place; nothing of cache size is
allocated or copied per token.  New lengths are staged and committed
together after the whole run succeeded; a write into committed storage
saves the bytes it replaces, and a cache that grows keeps its previous
buffer until the run ends (see :mod:`onnxkv.cache.contiguous`), so a failed
run leaves every value, length and ``committed_bytes`` as before.

Static (TensorScatter) caches hold their fixed capacity from the first run
on: the model reads the whole capacity as its past (zeros where nothing was
written), and a row's valid length is the high-water mark of the positions
written so far.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from onnxkv.cache.contiguous import CacheTensor
from onnxkv.errors import CacheCapacityError, InputError
from onnxkv.plan.step_loop import StepsRun, run_steps
from onnxkv.runtime.stores.protocol import StoreContext, batch_and_length

__all__ = ["ContiguousStore"]


class ContiguousStore:
    """The :class:`~onnxkv.runtime.stores.protocol.Store` of contiguous caches (module docstring)."""

    def __init__(self, ctx: StoreContext) -> None:
        self.ctx = ctx
        self.caches: dict[str, CacheTensor] | None = None
        self._fresh = False

    def _new_cache(self, name: str, batch: int, length: int = 0) -> CacheTensor:
        ctx = self.ctx
        shape, dtype = ctx.geometry(name, batch)
        if ctx.static:
            return CacheTensor(name, shape, dtype, ctx.allocator, ctx.static_capacity, static=True)
        cap = ctx.capacity if ctx.capacity is not None else max(ctx.initial_capacity, length)
        if length > cap:
            raise CacheCapacityError(f"State: initial length {length} exceeds the fixed capacity {cap}")
        return CacheTensor(
            name, shape, dtype, ctx.allocator, cap, growable=ctx.capacity is None, storage=ctx.cache_dtype
        )

    # -- a run ---------------------------------------------------------------------
    def prepare(self, feeds: Mapping[str, np.ndarray]) -> dict[str, CacheTensor]:
        batch = self.ctx.batch_of(feeds)
        self._fresh = self.caches is None
        if self.caches is None:
            caches: dict[str, CacheTensor] = {}
            try:
                for b in self.ctx.bindings:
                    caches[b.past] = self._new_cache(b.past, batch)
            except Exception:
                for c in caches.values():
                    c.release()
                raise
            self.caches = caches
        else:
            have = next(iter(self.caches.values())).batch if self.caches else batch
            if have != batch:
                raise InputError(
                    f"State.run: batch size {batch} differs from the state's {have}; reset the state first"
                )
        return self.caches

    def feeds(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        full = dict(feeds)
        past = self.ctx.static_capacity if self.ctx.static else None  # a static cache's past: its capacity
        for name, c in self.caches.items():
            full[name] = c.view(past)
        return full

    def finish(self) -> None:
        """Nothing can fail a contiguous run after its plan."""

    def commit(self, out: Mapping[str, np.ndarray]) -> None:
        for c in self.caches.values():
            c.commit()

    def discard(self) -> None:
        for c in self.caches.values():
            c.discard()
        if self._fresh:  # the first run made the caches: a failure leaves the store holding nothing, as before
            self.close()

    def decode_steps(self, plan, feeds, count: int, names, eos, draws, finished=None, pad: int = 0) -> StepsRun | None:
        """Decode steps replayed in C (:func:`~onnxkv.plan.step_loop.run_steps`), committed; discarded if
        they raise (the caches stay: they were made by an earlier run)."""
        if self.caches is None:
            return None
        self._fresh = False
        try:
            run = run_steps(plan, self.feeds(feeds), self.caches, int(count), names, eos, draws, finished, pad)
        except BaseException:
            self.discard()
            raise
        if run is not None and run.steps:
            self.commit({})
        return run

    # -- contents ----------------------------------------------------------------------
    @property
    def values(self) -> dict[str, np.ndarray]:
        return {name: c.view() for name, c in (self.caches or {}).items()}

    @property
    def committed_bytes(self) -> int:
        return sum(c.nbytes for c in (self.caches or {}).values())

    def reset(self, arrays: dict[str, np.ndarray]) -> None:
        batch, length = batch_and_length(arrays)
        new: dict[str, CacheTensor] = {}
        try:
            for name, a in arrays.items():
                c = self._new_cache(name, batch, length)
                new[name] = c
                want = self.ctx.graph_inputs[name].dtype
                if a.shape[1:] != (c.heads, a.shape[2], c.head_size) or a.dtype != want:
                    raise InputError(
                        f"State.reset: initial '{name}' has shape {a.shape} {a.dtype}, expected "
                        f"[{batch}, {c.heads}, L, {c.head_size}] {want}"
                    )
                c.write(a, 0, c.capacity if self.ctx.static else length)
                c.commit()
        except Exception:
            for c in new.values():
                c.release()
            raise
        self.close()
        self.caches = new

    def truncate(self, length: int) -> None:
        for c in (self.caches or {}).values():
            c.length = int(length)

    def close(self) -> None:
        for c in (self.caches or {}).values():
            c.release()
        self.caches = None
