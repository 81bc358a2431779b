"""An export's cache ``Concat`` and ``MaskedAttention`` as a compiled step records them.

In a state, the ``Concat`` that joins a layer's past and new keys (or values)
writes the new positions into the state's contiguous cache in place and
returns a view of the cache; the layer's ``MaskedAttention`` reads that view
through the streaming kernel.  Both views grow by the step's tokens every
step, so neither can be a recorded operand.  Instead:

* :func:`note_cache_rows` notes the copy (``_record.KIND_CACHE_ROWS``) into the
  run's cache buffer, taken by name, at the committed length that its effect
  :class:`RowsAppend` sets before each replay; the effect then stages the rows
  and sets the node's output (the present view) as the operator's own path does;
* :func:`note_masked_decode` notes the attention (``_record.KIND_MASKED_DECODE``)
  over the run's cache buffers, taken by name, for as many keys as the mask has
  columns (the mask: a whole ragged operand); its effect :class:`CommittedLength`
  sets the committed length before each replay, which the call checks the mask's
  length against.

The replayed calls are bit for bit the operators' kernel calls (see
:mod:`onnxkv.plan.compiled_step` for how effects run around a replay).
"""

from __future__ import annotations

import numpy as np

from onnxkv._kernels._record import CACHE_ROWS, MASKED_DECODE
from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._gqa_record import committed_pair

__all__ = [
    "CommittedLength",
    "appendable",
    "RowsAppend",
    "bound_cache_name",
    "cache_at",
    "note_attention_decode",
    "note_cache_rows",
    "note_masked_decode",
    "replayable_mask",
]


#: Element types of the contiguous caches recorded appends and masked-decode calls take (float16: a float16
#: model's own cache, written and read without conversion).
_CACHE_TYPES = (np.dtype(np.float32), np.dtype(np.float16))


def appendable(cache, dtype=np.float32) -> bool:
    """Whether ``cache`` is one the recorded appends and masked attention take: contiguous, growing (not
    static) and its buffer stored as ``dtype`` (float32, or a float16 model's float16)."""
    buffer = getattr(cache, "buffer", None)
    return (
        np.dtype(dtype) in _CACHE_TYPES
        and not getattr(cache, "paged", False)
        and not getattr(cache, "static", True)
        and getattr(cache, "storage", None) == np.dtype(dtype).name
        and isinstance(buffer, np.ndarray)
        and buffer.dtype == dtype
    )


def bound_cache_name(rt: RunContext, view: np.ndarray) -> str | None:
    """The name of the run's contiguous cache (not static) of ``view``'s dtype (float32, or a float16 file's
    float16) whose buffer ``view`` is the leading part of (its first ``view.shape[2]`` positions, every row and
    head), or None."""
    return cache_at(rt, view, lambda cache: appendable(cache, view.dtype))


def cache_at(rt: RunContext, view, accepts) -> str | None:
    """The name of the first run's cache for which ``accepts(cache)`` holds whose buffer ``view`` (4-D) is the
    leading part of -- the same address, rows, heads, head size and strides -- or None."""
    caches = rt.caches
    if not caches or not isinstance(view, np.ndarray) or view.ndim != 4:
        return None
    address = view.__array_interface__["data"][0]
    for name, cache in caches.items():
        if accepts(cache):
            buf = cache.buffer
            if (
                buf.__array_interface__["data"][0] == address
                and buf.shape[:2] == view.shape[:2]
                and buf.shape[3] == view.shape[3]
                and view.strides == buf.strides
            ):
                return name
    return None


def replayable_mask(mask, dtypes: tuple, b: int, s: int, t: int) -> bool:
    """Whether ``mask`` is an array a recorded masked-decode call can take: C-contiguous, of one of ``dtypes``,
    [b or 1, 1, s or 1, t] (one column per key)."""
    return (
        isinstance(mask, np.ndarray)
        and mask.dtype in dtypes
        and mask.flags.c_contiguous
        and mask.ndim == 4
        and mask.shape[1] == 1
        and mask.shape[0] in (1, b)
        and mask.shape[2] in (1, s)
        and mask.shape[3] == t
    )


def rows_appendable(cache, new: np.ndarray) -> bool:
    """Whether the copy of ``new`` [B, H, S, D] into ``cache`` is a recorded append's plain copy: a C-contiguous
    float32 ``new`` into an :func:`appendable` cache, or a float16 one into a float16 model's contiguous,
    growing float16 cache (no conversion on the way)."""
    if not isinstance(new, np.ndarray) or new.ndim != 4 or not new.flags.c_contiguous:
        return False
    return appendable(cache, new.dtype)


def note_cache_rows(rec, name: str, new: np.ndarray, cache, output: int | None = 0) -> None:
    """Note the copy of ``new`` [B, H, S, D] (:func:`rows_appendable`) that a node just made into the
    contiguous ``cache`` bound to the past ``name``, at its committed length, with its effect, which sets the
    node's output ``output`` (None: none) to the present view."""
    b, h, s, d = new.shape
    pos_io = np.zeros(1, dtype=np.int64)
    rec.note(CACHE_ROWS, (new, cache.buffer, pos_io), (b, h, s, d, cache.buffer.shape[2], new.itemsize), ())
    rec.cache(name, cache.buffer)
    rec.effect(RowsAppend(name, pos_io, s, output))


def note_masked_decode(
    rec, names: tuple[str, str], q, k_buffer, v_buffer, mask, out, scale: float, softcap: float = 0.0, causal=False
) -> None:
    """Note the attention a node just ran: q [B, Hq, S, D] and out (C-contiguous, both float32 or both float16)
    over the first T positions of the run's caches ``names`` (k, v: float32 or float16) with ``mask`` [mb, 1,
    ms, T] (C-contiguous, one column per key: additive float32 or float16, or bool), ``causal`` bounding query s
    at key T - S + s, with its effect."""
    b, hq, s, d = q.shape
    mb, _, ms, t = mask.shape
    pos_io = np.zeros(1, dtype=np.int64)
    scratch = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros((b, s), np.int32)  # kv_len, kv_start, q_pos
    arrays = (q, k_buffer, v_buffer, mask, out, pos_io, *scratch)
    kind = {np.dtype(np.float32): 0, np.dtype(np.bool_): 1, np.dtype(np.float16): 2}[mask.dtype]
    ints = (b, hq, k_buffer.shape[1], s, d, k_buffer.shape[2], mb, ms, t, kind, int(causal))
    ints += (int(q.dtype == np.float16), int(k_buffer.dtype == np.float16))
    rec.note(MASKED_DECODE, arrays, ints, (float(scale), float(softcap)))
    rec.cache(names[0], k_buffer)
    rec.cache(names[1], v_buffer)
    rec.ragged_last(mask)
    rec.effect(CommittedLength(names, pos_io))


def note_attention_decode(op, rec, rt: RunContext, decode: tuple | None, starts, past_len: int, scale: float) -> None:
    """Note what an ONNX Attention node ``op`` just ran on the streaming kernel -- its new keys and values
    appended at the committed length of the state's contiguous float32 caches, then the attention over them
    -- or refuse the recording when a replay could not run it as the node did.  ``decode``: the node's
    (q, k, v [B, H, S, D] as the kernel and the appends took them, mask, y the kernel's output, y_out the
    node's output Y when it is y's memory), or None when the call was not an in-place contiguous one without
    a window and ``nonpad_kv_seqlen``; ``starts``: where the rows were written (an int: every row at the
    longest row's length ``past_len``)."""
    names = (op.node.input[4], op.node.input[5])
    caches = rt.caches
    if decode is None or not isinstance(starts, int) or caches is None:
        rec.refused.append(f"{op.op_type} node '{op.name}': not a decode over a state's contiguous caches")
        return
    q, k, v, mask, y, y_out = decode
    ck, cv = caches[names[0]], caches[names[1]]
    b, _, s, _ = q.shape
    t = past_len + s
    if (
        y_out is None
        or not (appendable(ck) and appendable(cv))
        or past_len != ck.length
        or past_len != cv.length
        or ck.short_row(past_len) is not None
        or not all(isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous for x in (q, k, v))
        or not replayable_mask(mask, (np.float32, np.bool_), b, s, t)
    ):
        rec.refused.append(f"{op.op_type} node '{op.name}': not a decode over a state's float32 caches")
        return
    present = 1 if op.want[1] else None
    note_cache_rows(rec, names[0], k, ck, present)
    note_cache_rows(rec, names[1], v, cv, None if present is None else 2)
    note_masked_decode(rec, names, q, ck.buffer, cv.buffer, mask, y, scale, op.softcap, op.is_causal)


class RowsAppend:
    """The effect of a recorded cache-rows call (``_record.KIND_CACHE_ROWS``) on the run's cache ``name``.

    ``before(caches)`` sets ``pos_io[0]`` to the cache's committed length
    (False -- no replay -- when every row has not written that far, where the
    operator raises, or the cache is not a contiguous one); the call copies
    ``tokens`` positions there; ``after(rt)`` stages them as the operator's
    :meth:`RunContext.cache_write` does and returns the node's output
    ``output`` (if any), the present view.
    """

    __slots__ = ("names", "pos_io", "tokens", "outputs")

    def __init__(self, name: str, pos_io: np.ndarray, tokens: int, output: int | None = 0) -> None:
        self.names = (name,)
        self.pos_io = pos_io
        self.tokens = tokens
        #: The node outputs this effect sets.
        self.outputs = () if output is None else (output,)

    def before(self, caches: dict) -> bool:
        cache = caches[self.names[0]]
        if getattr(cache, "paged", False) or cache.short_row(cache.length) is not None:
            return False
        self.pos_io[0] = cache.length
        return True

    def after(self, rt: RunContext) -> list:
        pos = int(self.pos_io[0])
        present = rt.cache_appended(self.names[0], self.tokens, pos + self.tokens, None, pos)
        return [(i, present) for i in self.outputs]


class CommittedLength:
    """The effect of a recorded masked-decode call (``_record.KIND_MASKED_DECODE``): ``before(caches)`` sets
    ``pos_io[0]`` to the committed length of the two caches (False when they differ); nothing after."""

    __slots__ = ("names", "pos_io")

    outputs = ()

    def __init__(self, names: tuple[str, str], pos_io: np.ndarray) -> None:
        self.names = names
        self.pos_io = pos_io

    def before(self, caches: dict) -> bool:
        return committed_pair(caches, self.names, self.pos_io)

    def after(self, rt: RunContext) -> list:
        return []
