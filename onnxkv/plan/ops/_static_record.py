"""The static-cache form (``TensorScatter`` + ``Attention`` with ``nonpad_kv_seqlen``) as a compiled step records it.

In a state, a layer's ``TensorScatter`` writes the step's keys (or values) into
the state's static contiguous cache in place, each row at its own
``write_indices`` position, and returns the whole cache; the layer's
``Attention`` reads both caches whole through the streaming kernel, each row
up to its ``nonpad_kv_seqlen``.  The positions are graph inputs (or computed
from them), read when replayed, so:

* :func:`note_scatter_rows` notes the write (``_record.KIND_SCATTER_ROWS``) into
  the run's cache buffer, taken by name, at the positions of the node's
  ``write_indices`` input; the call saves the bytes it replaces, and its effect
  :class:`ScatterRows` hands them to the cache (the run's undo), stages the
  lengths as the operator's :meth:`~onnxkv.plan.context.RunContext.cache_write`
  does and sets the node's output (the present: the whole cache);
* :func:`note_nonpad_decode` notes the attention (``_record.KIND_NONPAD_DECODE``)
  over the run's two static caches, taken by name, with the node's mask and
  ``nonpad_kv_seqlen`` inputs as operands.

The replayed calls are bit for bit the operators' (see :mod:`onnxkv.plan.compiled_step`
for how effects run around a replay).  Paged static caches, stored formats
other than the model's, float16 files and windows are not recorded: those
nodes run in Python.
"""

from __future__ import annotations

import numpy as np

from onnxkv._kernels._record import NONPAD_DECODE, SCATTER_ROWS
from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._export_record import cache_at, replayable_mask

__all__ = ["ScatterRows", "note_nonpad_decode", "note_scatter_rows", "static_cache_name"]

_ROW_TYPES = (np.dtype(np.float32), np.dtype(np.float16))


def _static(cache, dtype) -> bool:
    """Whether ``cache`` is a static contiguous cache stored as ``dtype`` (no conversion on writes)."""
    buffer = getattr(cache, "buffer", None)
    return (
        getattr(cache, "static", False)
        and not getattr(cache, "paged", False)
        and isinstance(buffer, np.ndarray)
        and buffer.dtype == dtype
        and getattr(cache, "storage", None) == np.dtype(dtype).name
    )


def static_cache_name(rt: RunContext, whole: np.ndarray) -> str | None:
    """The name of the run's static contiguous cache whose whole buffer ``whole`` is (same address, shape,
    dtype and strides), or None."""
    return cache_at(rt, whole, lambda cache: _static(cache, whole.dtype) and cache.buffer.shape == whole.shape)


def note_scatter_rows(op, rec, rt: RunContext, update, indices, max_len: int) -> None:
    """Note the in-place write a ``TensorScatter`` node ``op`` just made of ``update`` [B, H, S, D] into the
    static cache bound to its past, at the rows' ``indices`` (its ``write_indices`` input; None: not given, or
    not linear), its present ``max_len`` positions long; or refuse the recording when a replay could not make
    it as the node did."""
    name = op.bound_past
    cache = rt.caches.get(name) if rt.caches else None
    if not (
        isinstance(update, np.ndarray)
        and update.ndim == 4
        and update.dtype in _ROW_TYPES
        and update.flags.c_contiguous
        and op.axis % 4 == 2
        and _static(cache, update.dtype)
        and update.shape[:2] == cache.buffer.shape[:2]
        and update.shape[3] == cache.buffer.shape[3]
        and max_len == cache.capacity
        and isinstance(indices, np.ndarray)
        and indices.dtype == np.int64
        and indices.shape == (update.shape[0],)
        and indices.flags.c_contiguous
    ):
        rec.refused.append(f"{op.op_type} node '{op.name}': not a linear write into a state's static cache")
        return
    b, h, s, d = update.shape
    saved, starts = np.zeros_like(update), np.zeros(b, np.int64)
    rec.note(SCATTER_ROWS, (update, cache.buffer, indices, saved, starts), (b, h, s, d, max_len, update.itemsize), ())
    rec.cache(name, cache.buffer)
    rec.effect(ScatterRows(name, saved, starts, s, max_len))


def note_nonpad_decode(op, rec, rt: RunContext, q, keys, values, mask, nonpad, y, y_out, scale: float) -> None:
    """Note the attention an ONNX ``Attention`` node ``op`` just ran on the streaming kernel over two whole
    static caches (``keys``, ``values``) with ``nonpad`` (its ``nonpad_kv_seqlen`` input, int64 [B]) and
    ``mask``, into ``y`` (the node's output ``y_out``'s memory); or refuse the recording."""
    names = (static_cache_name(rt, keys), static_cache_name(rt, values))
    b, hq, s, d = q.shape
    if (
        None in names
        or y_out is None
        or keys.dtype != np.float32
        or not all(isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous for x in (q, y))
        or not (isinstance(nonpad, np.ndarray) and nonpad.dtype == np.int64 and nonpad.shape == (b,))
        or not nonpad.flags.c_contiguous
        or not replayable_mask(mask, (np.float32, np.bool_), b, s, keys.shape[2])
    ):
        rec.refused.append(f"{op.op_type} node '{op.name}': not an attention over a state's float32 static caches")
        return
    mb, _, ms, t = mask.shape
    scratch = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros((b, s), np.int32)  # kv_len, kv_start, q_pos
    kind = 1 if mask.dtype == np.bool_ else 0
    ints = (b, hq, keys.shape[1], s, d, keys.shape[2], mb, ms, t, kind, int(op.is_causal), 0, 0)
    rec.note(NONPAD_DECODE, (q, keys, values, mask, y, nonpad, *scratch), ints, (float(scale), float(op.softcap)))
    rec.cache(names[0], keys)
    rec.cache(names[1], values)


class ScatterRows:
    """The effect of a recorded scatter-rows call (``_record.KIND_SCATTER_ROWS``) on the run's static cache
    ``name``.

    ``before(caches)`` is False (no replay) unless the run's cache is a static
    contiguous one, and sets ``starts`` to -1 (not written yet); the call writes
    ``tokens`` positions of each row at its ``write_indices`` and saves what they
    replaced in ``saved`` (their positions in ``starts``); ``after(rt)`` hands
    those to the cache and stages the lengths (:meth:`RunContext.cache_scattered`)
    and returns the node's output 0, the present (``max_len`` positions: the whole
    cache).  :meth:`kept` hands them over alone, after a replay that raised.
    """

    __slots__ = ("names", "saved", "starts", "tokens", "max_len")

    #: The node outputs this effect sets.
    outputs = (0,)

    def __init__(self, name: str, saved: np.ndarray, starts: np.ndarray, tokens: int, max_len: int) -> None:
        self.names = (name,)
        self.saved, self.starts = saved, starts
        self.tokens, self.max_len = tokens, max_len

    def before(self, caches: dict) -> bool:
        cache = caches[self.names[0]]
        self.starts[...] = -1
        return _static(cache, self.saved.dtype) and cache.capacity == self.max_len

    def kept(self, caches: dict) -> None:
        """Hand the cache the bytes the call saved (nothing when it did not run): a replay raised after it."""
        if self.starts[0] >= 0:
            caches[self.names[0]].saved_rows(self.starts, self.tokens, self.saved)

    def after(self, rt: RunContext) -> list:
        present = rt.cache_scattered(self.names[0], self.tokens, self.starts.copy(), self.saved, self.max_len)
        return [(0, present)]
