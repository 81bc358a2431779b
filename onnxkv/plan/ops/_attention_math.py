"""Attention arithmetic shared by the attention-family operators.

Two entry points:

* :func:`causal_attention` — positions-based masking (causal, sliding window,
  per-row valid length), the case the streaming kernel
  ``onnxkv._kernels.attention`` covers.  It runs that kernel for float32 with
  equal K and V head sizes, and :func:`dense_attention` otherwise.
* :func:`dense_attention` — arbitrary additive bias (``-inf`` = masked), attention
  sinks and the intermediate score matrices some operators expose.  NumPy.

Shapes: ``q`` [B, Hq, Sq, D]; ``k`` [B, Hkv, T, D]; ``v`` [B, Hkv, T, Dv] with
``Hq % Hkv == 0`` (query head ``h`` reads KV head ``h // (Hq // Hkv)``).  A query
row with no visible key produces zeros.  NaN and infinities follow the dense
softmax in both: a row with a NaN or +inf visible score gives NaN.

:func:`check_written` bounds what an operator attending over a state's cache
may claim: each row only the positions it wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from onnxkv import _kernels
from onnxkv._kernels import attention as _attention_kernel
from onnxkv.cache.plane_payloads import NATIVE_CODE
from onnxkv.errors import InputError

__all__ = ["Scores", "causal_attention", "paged_causal_attention", "dense_attention", "position_bias", "check_written"]


def check_written(op, cache, past: np.ndarray | int, claim: Callable[[int], str]) -> None:
    """Raise :class:`~onnxkv.errors.InputError` naming ``op``'s node when a row claims a past it never wrote.

    ``cache`` is the state's cache (:class:`~onnxkv.cache.contiguous.CacheTensor`
    or :class:`~onnxkv.cache.paged.PagedPlane`) whose ``lengths`` [B] hold
    what each row has written (its ``short_row`` finds the first row short of
    a claim); ``past`` (int [B] or one int) is the number of positions each
    row's queries attend before its new ones.  ``claim(row)`` says where the
    claim came from (only called for the error message).  Positions in
    ``[lengths[b], past[b])`` were never written by row ``b``: attending over
    them would read whatever the memory held.  O(B); no array operation for
    one int against equal rows.
    """
    short = cache.short_row(past)
    if short is not None:
        row, claimed, written = short
        raise InputError(
            f"{op.op_type} node '{op.name}': row {row} claims a past of {claimed} positions "
            f"({claim(row)}) but has written only {written}; a row may attend only over the "
            "positions it wrote"
        )


@dataclass
class Scores:
    """Intermediate [B, Hq, Sq, T] matrices of :func:`dense_attention` (when asked for).

    ``raw``: scale * q·k; ``capped``: after softcap; ``biased``: after adding the
    bias; ``probs``: after softmax (fully masked rows zeroed).
    """

    raw: np.ndarray
    capped: np.ndarray
    biased: np.ndarray
    probs: np.ndarray


def position_bias(
    kv_len: np.ndarray,
    q_pos: np.ndarray,
    total: int,
    window: int,
    dtype: type[np.floating] = np.float32,
    kv_start: np.ndarray | None = None,
) -> np.ndarray:
    """Additive [B, 1, Sq, total] bias (0 visible, -inf masked) of the kernel's mask rule.

    Query at absolute position ``p = q_pos[b, s]`` sees key ``j`` iff
    ``j < kv_len[b]``, ``j <= p``, ``j >= kv_start[b]`` (when given) and
    (``window >= 0``) ``j >= p - window``.
    """
    j = np.arange(total)[None, None, :]
    p = q_pos[:, :, None].astype(np.int64)
    visible = (j < kv_len[:, None, None]) & (j <= p)
    if kv_start is not None:
        visible &= j >= np.asarray(kv_start, np.int64)[:, None, None]
    if window >= 0:
        visible &= j >= p - window
    return np.where(visible, np.zeros((), dtype), np.array(-np.inf, dtype))[:, None]


def _expand_kv(x: np.ndarray, hq: int) -> np.ndarray:
    """[B, Hkv, T, D] -> [B, Hq, T, D] by repeating each KV head for its query group."""
    group = hq // x.shape[1]
    return x if group == 1 else np.repeat(x, group, axis=1)


def paged_causal_attention(
    q: np.ndarray,
    keys,
    values,
    kv_len: np.ndarray,
    q_pos: np.ndarray,
    scale: float,
    softcap: float,
    window: int,
    out: np.ndarray,
    kv_start: np.ndarray | None = None,
) -> dict:
    """:func:`causal_attention` over the pages of a paged cache (no gather), into ``out``.

    ``keys``/``values`` are the :class:`~onnxkv.cache.paged.PagedPlane` s of
    one layer (same page tables); each page is read in its own format
    (quantized pages are dequantized in the kernel's load step).  ``q``
    float32 [B, Hq, Sq, D]; ``kv_start`` [B] (None: 0) the first key of each
    row (pages wholly before it are not read).  Returns the kernel's storage
    figures (``dequantized_bytes``, ``workspace_peak_bytes``) for the event
    log.  A call whose pages are all native reads them as a pool without
    converted pages would (no per-page formats): a row's result does not
    depend on the formats of pages it does not read, as long as the rows of
    one call are all native or not (:func:`native_rows`).
    """
    k_formats, v_formats = keys.formats, values.formats
    if (k_formats is not None or v_formats is not None) and native_rows(
        keys, values, keys.tables, kv_len, kv_start
    ).all():
        k_formats = v_formats = None
    return _kernels.paged_attention(
        np.ascontiguousarray(q, dtype=np.float32),
        keys.ptrs,
        values.ptrs,
        keys.tables,
        keys.block_size,
        keys.heads,
        np.ascontiguousarray(kv_len, dtype=np.int32),
        np.ascontiguousarray(q_pos, dtype=np.int32),
        float(scale),
        float(softcap),
        int(window),
        out,
        kv_start=None if kv_start is None else np.ascontiguousarray(kv_start, dtype=np.int32),
        kv_dtype=keys.storage,
        k_formats=k_formats,
        v_formats=v_formats,
        k_group=keys.groups,
        v_group=values.groups,
        k_header=keys.header,
    )


def native_rows(keys, values, tables: np.ndarray, kv_len, kv_start=None) -> np.ndarray:
    """bool [B]: whether every page row ``b`` of a paged attention call reads (the blocks of ``tables[b]``
    from ``kv_start[b]`` to ``kv_len[b]``; absent entries skipped) is in its plane's native format, in the
    K and V planes ``keys`` / ``values`` (True for every row while neither lists per-page formats).  False
    for a row whose table names a page outside the planes' records: the kernel then names it."""
    b = tables.shape[0]
    if keys.formats is None and values.formats is None:
        return np.ones(b, bool)
    bs = keys.block_size
    lens = np.asarray(kv_len, np.int64).reshape(-1, 1)
    first = np.zeros_like(lens) if kv_start is None else np.asarray(kv_start, np.int64).reshape(-1, 1) // bs
    cols = np.arange(tables.shape[1])[None, :]
    read = (cols >= first) & (cols * bs < lens) & (tables >= 0)
    ok = np.ones(b, bool)
    for plane in (keys, values):
        f = plane.formats
        if f is None:
            continue
        inside = tables < f.size
        ok &= ~(read & ~inside).any(axis=1)
        codes = f[np.where(read & inside, tables, 0)]
        ok &= ~(read & inside & (codes != NATIVE_CODE[plane.storage])).any(axis=1)
    return ok


def dense_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    bias: np.ndarray | None,
    scale: float,
    softcap: float = 0.0,
    sink: np.ndarray | None = None,
    softmax_dtype: np.dtype | None = None,
    keep_scores: bool = False,
) -> tuple[np.ndarray, Scores | None]:
    """Softmax attention with an additive bias, in the order scale -> softcap -> bias -> softmax.

    ``bias`` broadcasts to [B, Hq, Sq, T]; ``-inf`` entries are masked, and a row
    whose bias is ``-inf`` everywhere yields zero probabilities and output.
    ``sink`` [Hq] adds ``exp(sink[h])`` to the softmax denominator (attention
    sink / smooth softmax; the running maximum includes the sink).
    ``softmax_dtype`` selects the softmax precision (default: ``q.dtype``).
    Returns (output [B, Hq, Sq, Dv] in ``q.dtype``, scores or None).
    """
    hq = q.shape[1]
    kk = _expand_kv(k, hq)
    vv = _expand_kv(v, hq)
    raw = np.matmul(q, kk.swapaxes(-1, -2)) * q.dtype.type(scale)
    capped = raw
    if softcap > 0:
        capped = np.tanh(raw / q.dtype.type(softcap)) * q.dtype.type(softcap)
    biased = capped if bias is None else capped + bias
    x = biased.astype(q.dtype if softmax_dtype is None else softmax_dtype, copy=False)
    m = np.max(x, axis=-1, keepdims=True)
    if sink is not None:
        sink_col = sink.astype(x.dtype).reshape(1, hq, 1, 1)
        m = np.maximum(m, sink_col)
    dead = np.isneginf(m)
    m = np.where(dead, 0, m)
    e = np.exp(x - m)
    denom = np.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + np.exp(sink_col - m)
    probs = np.where(dead | (denom == 0), 0, e / np.where(denom == 0, 1, denom))
    if bias is not None:
        masked_row = np.isneginf(np.max(np.broadcast_to(bias, biased.shape), axis=-1, keepdims=True))
        probs = np.where(masked_row, 0, probs)
    probs = probs.astype(q.dtype, copy=False)
    out = np.matmul(probs, vv)
    scores = Scores(raw, capped, biased, probs) if keep_scores else None
    return out, scores


def causal_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    kv_len: np.ndarray,
    q_pos: np.ndarray,
    scale: float,
    softcap: float,
    window: int,
    out: np.ndarray,
    kv_dtype: str | None = None,
    kv_start: np.ndarray | None = None,
) -> np.ndarray:
    """Positions-masked attention into ``out`` [B, Hq, Sq, D] (see :func:`position_bias`).

    ``k``/``v`` may be longer than every ``kv_len`` (capacity buffers); only the
    first ``kv_len[b]`` positions are read, from ``kv_start[b]`` (None: 0) on.
    Float32 queries with ``Dv == D`` and
    a C-contiguous ``out`` use the compiled streaming kernel, which reads float32,
    float16 or (``kv_dtype="bfloat16"``, uint16 bit patterns) bfloat16 K/V and
    converts them in its load step.  Returns ``out``.
    """
    kv_len = np.ascontiguousarray(kv_len, dtype=np.int32)
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int32)
    if kv_start is not None:
        kv_start = np.ascontiguousarray(kv_start, dtype=np.int32)
    narrow = kv_dtype == "bfloat16" or k.dtype == np.float16
    if (
        q.dtype == out.dtype == np.float32
        and k.dtype == v.dtype
        and (k.dtype == np.float32 or narrow)
        and v.shape[3] == q.shape[3]
        and out.flags.c_contiguous
    ):
        _attention_kernel(
            np.ascontiguousarray(q),
            np.ascontiguousarray(k),
            np.ascontiguousarray(v),
            kv_len,
            q_pos,
            float(scale),
            float(softcap),
            int(window),
            out,
            kv_start,
            kv_dtype=kv_dtype,
        )
        return out
    if kv_dtype == "bfloat16":
        raise ValueError("bfloat16 K/V need the compiled kernel (float32 queries, Dv == D)")
    total = int(kv_len.max(initial=0))
    bias = position_bias(kv_len, q_pos, total, window, q.dtype, kv_start)
    res, _ = dense_attention(q, k[:, :, :total], v[:, :, :total], bias, scale, softcap)
    out[...] = res
    return out
