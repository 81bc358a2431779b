"""GroupQueryAttention's input checks (see :mod:`.attention_gqa` for the semantics): Q, K, V and the past
buffers (shapes, dtypes, packed QKV), and the length inputs ``seqlens_k`` and ``total_sequence_length``,
checked in their own integer width before anything converts or adds to them.  Each function raises the
error ``error(message)`` builds (the node's InputError)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from onnxkv._kernels import _validate as V
from onnxkv.errors import InputError

__all__ = ["check_int32", "check_past", "row_lengths", "scalar_total", "split_qkv"]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float16))


def check_int32(error: Callable[[str], InputError], name: str, value: np.ndarray | None) -> None:
    """Integer input ``name`` (M = int32 in the spec; any integer dtype is accepted) must be integers in
    the int32 range, checked in its own width before anything converts or adds to it (absent: left to
    the checks of its use)."""
    if value is None:
        return
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise error(f"{name} must be int32, got {arr.dtype}")
    if np.can_cast(arr.dtype, np.int32):  # every value of the dtype fits (int32 itself: the usual case)
        return
    bad = V.outside(arr, -V.I32_MAX - 1, V.I32_MAX)
    if bad.any():
        at = int(np.argmax(bad))
        raise error(
            f"{name}[{at}] = {int(arr.reshape(-1)[at])} is outside the int32 range [{-V.I32_MAX - 1}, {V.I32_MAX}]"
        )


def scalar_total(error: Callable[[str], InputError], total_seqlen: np.ndarray | None, past_len: int, s: int) -> int:
    """``total_sequence_length`` (integers in the int32 range already), which must lie in
    ``[1, past_len + s]``: no row can hold more, and it sizes the present outputs."""
    t = total_seqlen if isinstance(total_seqlen, np.ndarray) else np.asarray(total_seqlen)
    if total_seqlen is None or t.size != 1:
        raise error("total_sequence_length must be a scalar (one int32 element)")
    total = int(t.item())
    if not 1 <= total <= past_len + s:
        raise error(
            f"total_sequence_length must be in [1, {past_len + s}] (past length {past_len} "
            f"+ {s} new tokens), got {total}"
        )
    return total


def row_lengths(
    error: Callable[[str], InputError],
    seqlens_k: np.ndarray | None,
    b: int,
    s: int,
    total: int,
    past_len: int,
    first_prompt: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (``total_b``, ``past_b``) as int64 [B] after validating ``seqlens_k``."""
    if seqlens_k is None or (seqlens_k.shape if isinstance(seqlens_k, np.ndarray) else np.shape(seqlens_k)) != (b,):
        raise error(f"seqlens_k must have shape ({b},), got {None if seqlens_k is None else np.shape(seqlens_k)}")
    if b < 1:
        raise error(f"the batch is empty (query shape has batch {b}); expected at least one row")
    totals = np.asarray(seqlens_k, dtype=np.int64) + 1
    rows = totals.tolist()
    lo, hi = min(rows), max(rows)
    if first_prompt:
        ok = lo >= 1 and hi <= s
        expected = f"in [0, {s - 1}] on a first prompt of {s} tokens"
    else:
        ok = lo >= s and hi - s <= past_len and hi <= total
        expected = (
            f"in [{s - 1}, {min(total, past_len + s) - 1}] "
            f"(total_sequence_length={total}, past length {past_len}, {s} new tokens)"
        )
    if not ok:
        bad = (totals < (1 if first_prompt else s)) | (totals > (s if first_prompt else min(total, past_len + s)))
        row = int(np.flatnonzero(bad)[0])
        raise error(f"seqlens_k[{row}]={int(totals[row]) - 1} out of range: expected {expected}")
    return totals, (np.zeros(b, np.int64) if first_prompt else totals - s)


def split_qkv(
    error: Callable[[str], InputError],
    hq: int,
    hkv: int,
    query: np.ndarray,
    key: np.ndarray | None,
    value: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q [B, Hq, S, D], K and V [B, Hkv, S, D] views of the (possibly packed) inputs."""
    if query.ndim != 3:
        raise error(f"query must be 3-D [batch, seq, hidden], got shape {query.shape}")
    if query.dtype not in _FLOATS:
        raise error(f"query must be float32 or float16, got {query.dtype}")
    b, s, hidden = query.shape
    if (key is None) != (value is None):
        raise error("key and value must be both present or both absent (packed QKV)")
    if key is None:
        heads = hq + 2 * hkv
        if hidden % heads:
            raise error(f"packed QKV hidden size {hidden} is not a multiple of num_heads + 2*kv_num_heads={heads}")
        d = hidden // heads
        qkv = query.reshape(b, s, heads, d).transpose(0, 2, 1, 3)
        return qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    if hidden % hq:
        raise error(f"query hidden size {hidden} is not a multiple of num_heads={hq}")
    d = hidden // hq
    for name, t in (("key", key), ("value", value)):
        if t.shape != (b, s, hkv * d):
            raise error(
                f"{name} must have shape {(b, s, hkv * d)} ([batch, seq, kv_num_heads*head_size]), got {t.shape}"
            )
        if t.dtype != query.dtype:
            raise error(f"{name} dtype {t.dtype} differs from query dtype {query.dtype}")
    return (
        query.reshape(b, s, hq, d).transpose(0, 2, 1, 3),
        key.reshape(b, s, hkv, d).transpose(0, 2, 1, 3),
        value.reshape(b, s, hkv, d).transpose(0, 2, 1, 3),
    )


def check_past(
    error: Callable[[str], InputError],
    hkv: int,
    past_key: np.ndarray | None,
    past_value: np.ndarray | None,
    b: int,
    d: int,
    dtype: np.dtype,
) -> int:
    """Validate the past buffers; return their sequence length P (0 when absent)."""
    if (past_key is None) != (past_value is None):
        raise error("past_key and past_value must be both present or both absent")
    if past_key is None:
        return 0
    want = (b, hkv, past_key.shape[2] if past_key.ndim == 4 else -1, d)
    for name, t in (("past_key", past_key), ("past_value", past_value)):
        if t.ndim != 4 or t.shape != want:
            raise error(f"{name} must be [batch, kv_num_heads, past_len, head_size]={want}, got {t.shape}")
        if t.dtype != dtype:
            raise error(f"{name} dtype {t.dtype} differs from query dtype {dtype}")
    return past_key.shape[2]
