"""The fused decode call of :class:`~onnxkv.plan.ops.attention_gqa.GroupQueryAttention`.

:func:`fused_decode` serves the node's common decode call (a few new tokens of
one sequence, or a token of each row of a batch, into a state's contiguous caches) with one kernel call,
:func:`onnxkv._kernels.decode_token`, or declines it (None, nothing written)
so that the node's general path runs.  It reads the node's attributes and
tables only; the node owns the caches' bindings through ``rt``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from onnxkv._kernels import decode_token as _decode_kernel
from onnxkv._kernels._record import current as _recorder
from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._gqa_record import note_decode

if TYPE_CHECKING:
    from onnxkv.plan.ops.attention_gqa import GroupQueryAttention

__all__ = ["FUSED_TOKENS", "TOKEN_TYPES", "constant_rotary", "fused_decode"]

#: Element types of the tokens (q, k, v, output) the fused call takes.
TOKEN_TYPES = (np.dtype(np.float32), np.dtype(np.float16))

#: New tokens of one sequence the fused call takes at most (a decode step, a speculative verification, a
#: short first prompt); a longer run (a prompt chunk) takes the general path, whose attention splits its
#: queries into tiles.
FUSED_TOKENS = 16


def constant_rotary(op: GroupQueryAttention, inputs: list, end: int) -> tuple | None:
    """The node's constant (cos, sin) tables for positions below ``end``, (None, None) without rotary, or
    None when the call's tables are not the node's constants or are too short (the general path then)."""
    if not op.do_rotary:
        return None, None
    tables = op._tables
    if tables is None or len(inputs) < 9 or inputs[7] is not tables[0] or inputs[8] is not tables[1]:
        return None
    return (tables[2], tables[3]) if end <= tables[2].shape[0] else None


def fused_decode(op: GroupQueryAttention, inputs: list, rt: RunContext) -> tuple | None:
    """The outputs of node ``op`` for a few tokens of each row into a state's contiguous cache, or None.

    The general path's result for the common decode call -- S new tokens of
    one sequence (1 <= S <= ``FUSED_TOKENS``: a decode step, a speculative
    verification, or a first prompt into an empty cache) after a past, or
    of each of B rows (one token each, or rows of one length) written from
    at most each row's committed length after a past (a batched decode
    step; right-padded rows write over their padding, whose committed bytes
    are kept first, as the general path keeps them), float32 or float16 Q/K/V (separate
    or packed), the state's contiguous caches (float32, float16 or bfloat16; float16 tokens: not float32)
    bound in place with room for the tokens, no position_ids / attention_bias / head_sink / smooth_softmax,
    rotary (if any) from the node's constant tables -- computed by the
    fused kernel (:func:`onnxkv._kernels.decode_token`: the general path's
    rotary, append and attention in one call, bit for bit), which skips the
    general path's per-call array building and Python.  A cache that must
    grow grows first, as in the general path.  Anything else, including
    every argument the general path would refuse, returns None with no
    cache byte written and takes the general path (which raises its
    errors).
    """
    if len(inputs) < 7 or any(x is not None for x in inputs[9:]) or op.smooth_softmax or not op.bound:
        return None
    query, key, value, past_key, past_value, seqlens_k, total_seqlen = inputs[:7]
    caches = rt.caches
    past_k_name, past_v_name = op._past_names
    if caches is None or past_k_name not in caches or past_key is None or past_value is None:
        return None
    ck, cv = caches[past_k_name], caches[past_v_name]
    if (
        getattr(ck, "paged", False)
        or cv.storage != ck.storage
        or past_key.shape != past_value.shape
        or past_key.ndim != 4
        or not isinstance(query, np.ndarray)
        or query.ndim != 3
        or not 1 <= query.shape[1] <= FUSED_TOKENS
    ):
        return None
    b, n = query.shape[:2]
    if (
        not isinstance(seqlens_k, np.ndarray)
        or seqlens_k.shape != (b,)
        or seqlens_k.dtype.kind not in "iu"
        or not isinstance(total_seqlen, np.ndarray)
        or total_seqlen.size != 1
        or total_seqlen.dtype.kind not in "iu"
    ):
        return None
    past_len = past_key.shape[2]
    total = int(total_seqlen.reshape(-1)[0])
    # The general path's total_sequence_length and seqlens_k ranges.  One row: an append exactly at the
    # committed length (a past the row never wrote is refused there, and a rewrite of committed positions is
    # saved there first so that a failed run can restore it), so a first prompt (S == total) only on an
    # empty cache: its queries attend causally to its own keys, as a verification's do after a past.
    # Several rows: one token each, or rows of one length (the general path's rule), after a past, each
    # from at most its committed length; the bytes a row writes over are kept first (save_rows below).
    starts = seqlens_k.astype(np.int64) + (1 - n)
    total_b = int(starts.max()) + n
    if not n <= total <= past_len + n or not n <= int(starts.min()) + n or total_b > total:
        return None
    held = ck.lengths if b > 1 else None  # int64 [B]: what each row has written
    if b == 1:
        if int(starts[0]) != ck.length:
            return None
    elif (
        total <= n
        or (n > 1 and (starts != starts[0]).any())
        or held.tobytes() != cv.lengths.tobytes()  # int64 both
        or (starts > held).any()  # a row continues from what it wrote (right-padded rows rewrite)
    ):
        return None
    rotary = constant_rotary(op, inputs, total_b)
    if rotary is None:
        return None
    cos, sin = rotary
    hq, hkv = op.num_heads, op.kv_num_heads
    if key is None and value is None and query.shape[2] == (hq + 2 * hkv) * past_key.shape[3]:
        # packed QKV (the GenAI builder's fused projection): each token's q, k, v are contiguous slices
        d = past_key.shape[3]
        query, key, value = query[..., : hq * d], query[..., hq * d : (hq + hkv) * d], query[..., (hq + hkv) * d :]
    if past_key.shape[:2] != (b, hkv) or past_key.shape[3] * hq != query.shape[2]:
        return None
    present_len = max(total, past_len)
    if present_len > ck.capacity or present_len > cv.capacity:
        # growth, as the general path's cache writes grow: only for arguments it accepts up to there
        shape = (b, n, hkv * past_key.shape[3])
        if (
            query.dtype not in TOKEN_TYPES
            or key is None
            or value is None
            or key.dtype != query.dtype
            or value.dtype != query.dtype
            or key.shape != shape
            or value.shape != shape
        ):
            return None
    if query.dtype not in TOKEN_TYPES or (query.dtype == np.float16 and ck.storage == "float32"):
        return None  # float32 tokens into float32, float16 or bfloat16 caches; float16 tokens into 2-byte ones
    grown = ck.reserve(present_len), cv.reserve(present_len)
    if b > 1:  # the committed bytes a row writes over (below the longest row), as the general path's write
        ck.save_rows(starts, n)
        cv.save_rows(starts, n)
    output = rt.empty(0, (b, n, query.shape[2]), query.dtype)
    at = int(starts[0]) if b == 1 else starts  # the rows' first positions, as the kernel and the caches take them
    done = _decode_kernel(
        query,
        key,
        value,
        cos,
        sin,
        op.interleaved,
        ck.buffer,
        cv.buffer,
        at,
        float(op._softmax_scale(query.shape[2] // hq)),
        op.softcap,
        op.window,
        output,
        kv_dtype="bfloat16" if ck.storage == "bfloat16" else None,
    )
    # Record growth even when the kernel declined (the general path then finds the room made).
    written = n if done else 0
    present_k = rt.cache_appended(past_k_name, written, present_len, grown[0], at)
    present_v = rt.cache_appended(past_v_name, written, present_len, grown[1], at)
    if not done:
        return None
    outs = (output, present_k if op.has_present[0] else None, present_v if op.has_present[1] else None)
    rec = _recorder()
    if rec is not None:
        note_decode(op, rec, (query, key, value, cos, sin), ck, cv, seqlens_k, total_seqlen, output)
    return outs[: len(op.node.output)]
