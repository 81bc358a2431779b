"""The storage protocol of a :class:`~onnxkv.runtime.state.State`, and what every store shares.

A state keeps the request's rules (one call at a time, cancellation, the
order of a run: prepare, run the plan, publish or discard); where its
persistent values live is a :class:`Store`:

* :class:`~onnxkv.runtime.stores.contiguous.ContiguousStore`: one buffer per
  bound past input, grown geometrically (or a static cache's capacity);
* :class:`~onnxkv.runtime.stores.paged.PagedStore`: pages of a
  :class:`~onnxkv.cache.block_pool.BlockPool` with copy-on-write;
* :class:`~onnxkv.runtime.stores.declared.DeclaredStore`: values the model's
  contract declares persistent (``GraphProto.persistent_bindings``).

A run calls ``prepare`` (storage for this run; may raise with nothing
changed), ``feeds``, runs the plan, then ``finish`` (the last step that may
still fail the run), and then exactly one of ``commit`` (publish: every
staged length, page table and value at once) or ``discard`` (put back every
byte, length, page and ``committed_bytes`` as before the run).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from onnxkv.errors import InputError, StateError

__all__ = ["Store", "StoreContext", "batch_and_length"]


class Store(Protocol):
    """Where one state's persistent values live (module docstring).  Calls are serialised by the state."""

    #: Bound past input -> the cache object the kernels write (None before the first run or after reset).
    caches: dict[str, Any] | None

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Mapping[str, Any]:
        """Make or check this run's storage from the caller's ``feeds``; return what the plan's kernels
        write in place (``caches`` of :meth:`Session._run_plan`).  Raises with nothing changed."""

    def feeds(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The plan's feeds: ``feeds`` plus every bound input's value."""

    def finish(self) -> None:
        """After the plan ran, before :meth:`commit`: the last check that may fail the run."""

    def commit(self, out: Mapping[str, np.ndarray]) -> None:
        """Publish the run (``out``: the plan's outputs) -- lengths, tables and values at once."""

    def discard(self) -> None:
        """Forget the run: every value, length, page and byte count as before :meth:`prepare`."""

    def decode_steps(self, plan, feeds, count: int, names, eos, draws, finished=None, pad: int = 0) -> Any:
        """Up to ``count`` decode steps of ``plan`` in one call, committed (:func:`onnxkv.plan.step_loop.run_steps`,
        its arguments and result), or None with nothing run: only contiguous caches replay whole steps."""

    @property
    def values(self) -> dict[str, np.ndarray]:
        """Views or copies of the valid contents, by bound input name."""

    @property
    def committed_bytes(self) -> int:
        """Bytes of persistent storage held."""

    def reset(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace the contents by ``arrays`` (exactly the bound inputs); all or nothing."""

    def truncate(self, length: int) -> None:
        """Keep positions ``[0, length)`` of every row (``length`` checked by the state; growing caches only:
        the state refuses declared values and static caches before)."""

    def close(self) -> None:
        """Release every value; the store holds nothing afterwards (it may be prepared again)."""


@dataclass
class StoreContext:
    """What a store reads of its state and session; fixed for the state's life (``cache_dtype`` checked).

    ``static_capacity`` is a static (TensorScatter) cache's fixed capacity
    when ``static``; ``capacity`` / ``initial_capacity`` / ``cache_dtype``
    are the state's options (see :class:`~onnxkv.runtime.state.State`).
    """

    session: Any
    allocator: Any
    capacity: int | None
    initial_capacity: int
    cache_dtype: str | None

    def __post_init__(self) -> None:
        for name in ("capacity", "initial_capacity"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
                raise InputError(f"new_state: {name} must be a positive int, got {v!r}")
            setattr(self, name, None if v is None else int(v))
        conv = self.session.model.convention
        if self.cache_dtype not in (None, "float32", "float16", "bfloat16"):
            raise InputError(
                f"new_state: cache_dtype must be None, 'float32', 'float16' or 'bfloat16', got {self.cache_dtype!r}"
            )
        if self.cache_dtype is not None and conv.kind != "group_query_attention":
            fmt = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[self.cache_dtype]
            raise InputError(
                f"new_state: cache_dtype={self.cache_dtype!r} (kv_format={fmt!r}) needs a GroupQueryAttention model "
                f"(its cache is read only by the attention kernel); this model's cache is '{conv.kind}'"
            )
        self.bindings = list(self.session.bindings)
        self.static = conv.kind == "tensor_scatter"
        self.static_capacity = conv.capacity
        self.graph_inputs = {g.name: g for g in self.session.plan.inputs}

    @staticmethod
    def check_initial(initial: Mapping[str, np.ndarray], bound: list[str]) -> None:
        """Raise :class:`InputError` unless ``initial`` gives exactly the ``bound`` inputs (State.reset)."""
        missing = [n for n in bound if n not in initial]
        unknown = [n for n in initial if n not in bound]
        if missing or unknown:
            raise InputError(
                f"State.reset: initial must give exactly the bound inputs {bound}; missing {missing}, unknown {unknown}"
            )

    def held(self, initial: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``initial`` cache contents as arrays in the dtype the plan holds them: a cast cache's float32
        values rounded to float16 as the model's Casts round them (:mod:`onnxkv.model.cache_casts`)."""
        arrays = {n: np.asarray(a) for n, a in initial.items()}
        boundary = self.session.cast_boundary
        return arrays if boundary is None else boundary.graph_feeds(arrays, "State.reset")

    def geometry(self, name: str, batch: int) -> tuple[tuple[int, int, int], np.dtype]:
        """((batch, KV heads, head size), model dtype) of bound past input ``name``."""
        g = self.graph_inputs[name]
        conv = self.session.model.convention
        dims = g.shape or (None,) * 4
        heads = dims[1] if isinstance(dims[1], int) else conv.kv_heads
        head = dims[3] if isinstance(dims[3], int) else conv.head_size
        if heads is None or head is None:
            raise StateError(f"State: cannot tell the KV heads / head size of '{name}' from the model")
        return (batch, heads, head), g.dtype

    def log(self, action: str, **counters: int) -> None:
        """Record a storage event ``action`` (no node) with ``counters`` and the allocator's figures."""
        log = self.session.events
        if log.enabled:
            st = self.allocator.stats()
            log.record(
                max(self.session._step - 1, 0),
                "",
                "",
                action,
                committed=st.committed,
                live=st.live,
                peak=st.peak,
                **counters,
            )

    def export(self, present: str, value: np.ndarray, cache, paged: bool) -> np.ndarray:
        """A copy of bound present ``present`` (``value``: what the plan returned, ``cache``: its cache) in the
        model's dtype (the declared one of a cast cache, :mod:`onnxkv.model.cache_casts`), counted as an
        ``export`` event."""
        boundary = self.session.cast_boundary
        model_dtype = boundary.outputs[present] if boundary is not None else self.graph_inputs[cache.name].dtype
        if paged or value.dtype != model_dtype:
            copy = cache.as_float32(value.shape[2]).astype(model_dtype, copy=False)
        else:
            copy = np.array(value, copy=True)
        log = self.session.events
        if log.enabled:
            st = self.allocator.stats()
            log.record(
                self.session._step - 1,
                present,
                "export",
                "export",
                allocations=1,
                allocated_bytes=copy.nbytes,
                prefix_copied_bytes=copy.nbytes,
                committed=st.committed,
                live=st.live,
                peak=st.peak,
            )
        return copy

    def batch_of(self, feeds: Mapping[str, np.ndarray]) -> int:
        """Rows of the run ``feeds`` describe (input ids first); InputError when unknown or < 1."""
        ids = self.session.model.io.input_ids
        if ids and ids in feeds:
            shape = np.shape(feeds[ids])
            if len(shape) < 1:
                raise InputError(f"State.run: '{ids}' must be an array [batch, length], got shape {shape}")
            batch = int(shape[0])
        else:
            batch = next((int(np.shape(v)[0]) for v in feeds.values() if np.ndim(v) >= 1), None)
        if batch is None:
            raise InputError("State.run: cannot tell the batch size from the feeds")
        if batch < 1:
            raise InputError(f"State.run: the feeds hold a batch of {batch} rows; a state runs at least one row")
        return batch


def as_arrays(api: str, feeds: Mapping[str, object]) -> dict[str, np.ndarray]:
    """``feeds`` with every value an ndarray (lists and scalars converted, arrays as given); InputError naming
    ``api`` and the input for a value that is no array (a ragged nested list: NumPy's ValueError)."""
    if not isinstance(feeds, Mapping):
        raise InputError(f"{api}: feeds must be a mapping of input names to arrays, got {type(feeds).__name__}")
    out = {}
    for name, value in feeds.items():
        if type(value) is np.ndarray:
            out[name] = value
            continue
        try:
            out[name] = np.asarray(value)
        except (ValueError, TypeError) as e:
            raise InputError(
                f"{api}: input '{name}' must be a rectangular array, got {type(value).__name__}: {e}"
            ) from None
    return out


def batch_and_length(arrays: dict[str, np.ndarray]) -> tuple[int, int]:
    """(batch, length) of initial arrays [B, H, L, D] that agree on both; InputError otherwise."""
    lengths = {a.shape[2] if a.ndim == 4 else None for a in arrays.values()}
    batches = {a.shape[0] if a.ndim == 4 else None for a in arrays.values()}
    if None in lengths or len(lengths) != 1 or len(batches) != 1:
        raise InputError(
            "State.reset: initial arrays must be [batch, heads, length, head_size] with one batch size and one length"
        )
    return batches.pop(), lengths.pop()
