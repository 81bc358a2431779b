"""GroupQueryAttention over a run of segments (:meth:`State.run <onnxkv.runtime.state.State.run>` with
``segments``): rows of different lengths and token counts in one run, their tokens on one axis.

The node's caches are a paged state's planes whose ``segments`` (int64 [R], counts summing to T) say that
the T query, key and value tokens of the batch-1 inputs are row 0's new tokens, then row 1's, and so on.
Row ``r``'s ``n_r`` tokens continue at its committed length ``L_r`` (positions ``L_r .. L_r + n_r - 1``):
rotary (``do_rotary=1``) rotates each token at its own position (``position_ids`` [1, T] when fed, else
that position); its keys and values go into its own pages; its queries attend causally over its first
``L_r + n_r`` keys, with the node's window and softcap, exactly as a run of that row alone would.  The
graph's ``seqlens_k`` and ``total_sequence_length`` describe the flattened batch (one row of T tokens)
and are not read.  The rows of one token count ``n`` run as one batched kernel call of ``n`` queries per
row (the decode rows together, equal prompt chunks together), over the rows' page tables in place.

A node that cannot take segments (``attention_bias``, ``head_sink`` or ``smooth_softmax``, or not bound
to the state) raises InputError: the state refuses such runs before they start
(:attr:`Session.takes_segments <onnxkv.runtime.session.Session.takes_segments>`), so this is defence in
depth.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._gqa_inputs import split_qkv
from onnxkv.plan.ops._segments import attend_rows, cache_segments, token_layout

if TYPE_CHECKING:
    from onnxkv.plan.ops.attention_gqa import GroupQueryAttention

__all__ = ["run_segments", "segments_of"]


def segments_of(op: GroupQueryAttention, rt: RunContext) -> np.ndarray | None:
    """The run's segments when ``op`` reads a state's paged cache in a run of segments, else None."""
    return cache_segments(rt, op._past_names[0], op.bound)


def run_segments(op: GroupQueryAttention, inputs: list, rt: RunContext, counts: np.ndarray) -> tuple:
    """The outputs of ``op`` in a run of segments ``counts`` (see the module docstring)."""
    if op.smooth_softmax or any(len(inputs) > i and inputs[i] is not None for i in (10, 11)):
        raise op._input_error("a run of segments takes no attention_bias, head_sink or smooth_softmax")
    query, key, value = inputs[:3]
    cos, sin = (inputs[i] if len(inputs) > i else None for i in (7, 8))
    position_ids = inputs[9] if len(inputs) > 9 else None
    q, k, v = split_qkv(op._input_error, op.num_heads, op.kv_num_heads, query, key, value)
    one, hq, t, d = q.shape
    if one != 1 or t != int(counts.sum()):
        raise op._input_error(
            f"a run of segments {counts.tolist()} needs [1, {int(counts.sum())}, ...] queries, got {query.shape}"
        )
    past_k, past_v = op._past_names
    ck, cv = rt.caches[past_k], rt.caches[past_v]
    starts = ck.lengths.astype(np.int64)  # each row continues at its committed length
    first, pos = token_layout(counts, starts)
    if op.do_rotary:
        q, k = op._rotary(q, k, cos, sin, position_ids, pos[None, :], False)
    present_k = rt.cache_write_segments(past_k, k)
    present_v = rt.cache_write_segments(past_v, v)
    out = attend_rows(
        q.astype(np.float32, copy=False), ck, cv, counts, starts, first, pos, op._softmax_scale(d), op.softcap,
        op.window, rt, d,
    )  # fmt: skip
    output = rt.empty(0, (1, t, hq * d), query.dtype)
    output.reshape(t, hq, d)[...] = out
    outs = (output, present_k if op.has_present[0] else None, present_v if op.has_present[1] else None)
    return outs[: len(op.node.output)]
