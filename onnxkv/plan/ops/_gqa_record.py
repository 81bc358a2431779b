"""The fused GroupQueryAttention decode call as a compiled step records it.

:func:`note_decode` notes the call that :meth:`GroupQueryAttention._decode_token`
just ran (``_record.KIND_DECODE_TOKEN``) on the calling thread's recorder;
:class:`CacheAppend` is its effect, which a replay runs around the call (see
:mod:`onnxkv.plan.compiled_step` and :mod:`onnxkv._kernels._record`).
"""

from __future__ import annotations

import numpy as np

from onnxkv._kernels._record import DECODE_CACHE_TYPES, DECODE_TOKEN
from onnxkv.plan.context import RunContext

__all__ = ["CacheAppend", "committed_pair", "note_decode", "rows_span"]


def note_decode(op, rec, qkv_rot: tuple, ck, cv, seqlens_k: np.ndarray, total_seqlen: np.ndarray, output) -> None:
    """Note the fused call of ``op`` (a GroupQueryAttention) that just ran into the contiguous caches
    ``ck`` / ``cv``: ``qkv_rot`` its (q, k, v, cos or None, sin or None) arrays (q, k, v [B, S, H*D], float32
    or float16, rows possibly strided), ``output`` its result.  A replay reads the rows' positions from
    ``seqlens_k``, takes the caches the run has then, and its effect stages the appended rows and the presents
    as the fused path does.  Refuses the recording when a replay could not read the positions as this run did
    (seqlens_k or total_sequence_length not int32)."""
    if seqlens_k.dtype != np.int32 or total_seqlen.dtype != np.int32 or total_seqlen.shape not in ((), (1,)):
        rec.refused.append(f"{op.op_type} node '{op.name}': positions not int32")
        return
    q, k, v, cos, sin = qkv_rot
    b, n = q.shape[:2]
    d = ck.buffer.shape[3]
    pos_io = np.zeros((2, b), dtype=np.int64)  # the rows' committed lengths, then the positions written
    undo = np.empty((2, b, op.kv_num_heads, n, d), dtype=ck.buffer.dtype)  # the bytes rows write over
    half, rows = (0, 0) if cos is None else (cos.shape[1], cos.shape[0])
    # between consecutive token rows (the kernel took them: one stride, row b's tokens after row b - 1's)
    strides = [x.shape[2] if b * n == 1 else x.strides[1 if n > 1 else 0] // x.itemsize for x in (q, k, v)]
    q, k, v = (rows_span(x) for x in (q, k, v))
    arrays = (q, k, v, cos, sin, ck.buffer, cv.buffer, seqlens_k, total_seqlen.reshape(1), output, pos_io, undo)
    ints = (op.num_heads, op.kv_num_heads, ck.buffer.shape[2], d, half, int(bool(op.interleaved)), op.window, rows,
            n, *strides, int(q.dtype == np.float16), DECODE_CACHE_TYPES[ck.storage], b)  # fmt: skip
    rec.note(DECODE_TOKEN, arrays, ints, (float(op._softmax_scale(d)), float(op.softcap)))
    rec.cache(op._past_names[0], ck.buffer)
    rec.cache(op._past_names[1], cv.buffer)
    rec.effect(CacheAppend(op._past_names, pos_io, op.has_present, n, undo))


def rows_span(x: np.ndarray) -> np.ndarray:
    """``x`` (3-D [B, S, W] with contiguous rows of W at nonnegative strides, as slices of packed QKV rows) as
    the flat view of the memory it spans, first element to last: the operand a program checks and addresses."""
    if x.flags.c_contiguous:
        return x
    span = sum((x.shape[i] - 1) * (x.strides[i] // x.itemsize) for i in (0, 1)) + x.shape[2]
    return np.lib.stride_tricks.as_strided(x, shape=(span,), strides=(x.itemsize,))


def committed_pair(caches: dict, names: tuple[str, str], pos_io: np.ndarray) -> bool:
    """Set ``pos_io[0]`` to the committed length of the caches ``names`` (a layer's K and V) and return True;
    False, with nothing set, when their lengths differ."""
    k, v = caches[names[0]], caches[names[1]]
    if k.length != v.length:
        return False
    pos_io[0] = k.length
    return True


class CacheAppend:
    """The effect of a recorded decode-token call (``_record.KIND_DECODE_TOKEN``) on the run's caches.

    ``before(caches)`` sets ``pos_io[0]`` (int64 [B]) to the committed lengths of the rows of the two caches
    (False when they differ or are missing, or the caches have another number of rows, or are static, or their
    committed length is not their longest row's: no replay) and ``pos_io[1]`` to -1 (no row written yet); the
    replayed call writes ``tokens`` rows to each row at ``pos_io[1]``, the positions it read (each at most its
    row's committed length: a right-padded row rewrites its padding), after copying the committed bytes they
    replace into ``undo`` (float32 or 2-byte [2, B, Hkv, tokens, D]: K, then V).  ``after(rt)`` hands those
    bytes to the caches (:meth:`kept`), then stages the rows in both caches as the operator's own path does
    (:meth:`RunContext.cache_appended`) and returns ``(output index, present view)`` for the node's present
    outputs.
    """

    __slots__ = ("names", "pos_io", "outputs", "tokens", "undo")

    def __init__(
        self, names: tuple[str, str], pos_io: np.ndarray, has_present: tuple[bool, bool], tokens: int, undo: np.ndarray
    ) -> None:
        self.names = names
        self.pos_io = pos_io
        #: The node outputs this effect sets (present key 1, present value 2).
        self.outputs = tuple(i + 1 for i in (0, 1) if has_present[i])
        #: Rows the call appends to each cache per run.
        self.tokens = tokens
        self.undo = undo

    def before(self, caches: dict) -> bool:
        self.pos_io[1] = -1
        if self.pos_io.shape[1] == 1:
            return caches[self.names[0]].batch == 1 and committed_pair(caches, self.names, self.pos_io)
        k, v = caches[self.names[0]], caches[self.names[1]]
        lengths = k.lengths
        if (
            lengths.shape != self.pos_io.shape[1:]
            or not np.array_equal(lengths, v.lengths)
            or k.static
            or v.static
            or k.length != int(lengths.max())
        ):
            return False
        self.pos_io[0] = lengths
        return True

    def kept(self, caches: dict) -> None:
        """Hand the two caches the committed bytes the call copied before writing over them (nothing when it
        did not run): a discarded run restores them.  After the replay, whether it ran every call or raised."""
        at = self.pos_io[1]
        if at.shape[0] > 1 and at[0] >= 0:
            for plane, name in enumerate(self.names):
                caches[name].saved_rows(at, self.tokens, self.undo[plane])

    def after(self, rt: RunContext) -> list:
        n = self.tokens
        self.kept(rt.caches)
        if self.pos_io.shape[1] == 1:
            at = int(self.pos_io[1, 0])
            end = at + n
        else:
            at = self.pos_io[1].copy()
            end = int(at.max()) + n
        presents = [rt.cache_appended(name, n, end, None, at) for name in self.names]
        return [(i, presents[i - 1]) for i in self.outputs]
