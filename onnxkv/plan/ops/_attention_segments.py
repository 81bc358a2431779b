"""ONNX ``Attention`` (opsets 23-25) over a run of segments (:meth:`State.run
<onnxkv.runtime.state.State.run>` with ``segments``): rows of different lengths and token counts in one
run, their tokens on one axis (:mod:`._segments`).

The node's caches are a paged state's planes whose ``segments`` say which of the T query, key and value
tokens of the batch-1 inputs belong to which row.  The graph builds the node's ``attn_mask`` for what it
sees, one row of T tokens; a run of segments takes only the mask of plain causal attention over that row
(query ``i`` sees the keys ``0 .. i`` of the mask's T columns: bool, or 0 and ``-inf`` / at most
``MASKED``; or no mask and ``is_causal=1``), which is what a graph makes of an ``attention_mask`` of T
ones, and reads it as each row's causal attention over its own cache, as the row run alone would have
it.  Row ``r``'s keys and values go into its own pages at its committed length, and its queries attend
over its first ``L_r + n_r`` keys with the node's scale, softcap and left window (opset 25; a right
window adds nothing to causal attention); Y is each token's, in the layout and dtype of Q (float16 and
bfloat16 computed in float32, as the node's kernel path does), bit for bit the row alone.

Anything else raises :class:`~onnxkv.errors.SegmentsRefused` before anything is written: another mask,
a ``qk_matmul_output``, ``nonpad_kv_seqlen``, a ``softmax_precision`` other than FLOAT, float64 inputs
(whose rows alone take the dense path) or a node not bound to the state's caches.
:func:`mask_only_nodes` gives the nodes whose values reach attention masks only, which
:attr:`Session.takes_segments <onnxkv.runtime.session.Session.takes_segments>` lets through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx

from onnxkv.errors import SegmentsRefused
from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._segments import attend_rows, token_layout
from onnxkv.plan.ops.masked_attention import MASKED, cached_mask_ranges

if TYPE_CHECKING:
    from onnxkv.plan.ops.attention_onnx import Attention23

__all__ = ["mask_only_nodes", "run_segments", "takes_segments"]


def takes_segments(op: Attention23) -> bool:
    """Whether runs of segments may reach ``op``: bound to a state's caches, no ``qk_matmul_output``, no
    ``nonpad_kv_seqlen`` input, and the softmax in float32."""
    nonpad = op.has_nonpad and len(op.node.input) > 6 and bool(op.node.input[6])
    return op.bound and not op.want[3] and not nonpad and op.softmax_dtype in (None, np.dtype(np.float32))


def _refuse(op: Attention23, message: str) -> SegmentsRefused:
    return SegmentsRefused(f"{op.op_type} node '{op.name}': a run of segments {message}")


def _check_causal(op: Attention23, mask, t: int) -> None:
    """SegmentsRefused unless ``mask`` (with the node's causal rule and right window) lets query ``i`` of the
    T tokens see exactly the keys ``0 .. i`` of the mask's columns."""
    from onnxkv.plan.ops.attention_onnx import attn_mask_ranges

    i = np.arange(t)
    if mask is None:
        if not op.is_causal:
            raise _refuse(op, "needs causal attention over its tokens; this node has no attn_mask and is_causal=0")
        return
    ok = isinstance(mask, np.ndarray) and mask.shape[-1:] == (t,)
    ranges = cached_mask_ranges(mask, 1, t, t, attn_mask_ranges) if ok else None  # every layer reads one mask
    if ranges is not None:
        kv_start, hi, _ = ranges
        hi = hi[0]
        if op.is_causal:
            hi = np.minimum(hi, i)
        if op.right >= 0:
            hi = np.minimum(hi, i + op.right)
        if (kv_start is None or not kv_start.any()) and np.array_equal(hi, i):
            return
    got = f"another mask of shape {np.shape(mask)}"
    if ok and mask.dtype.kind == "f" and mask.size:
        low = float(np.min(mask))
        if MASKED < low < 0 and np.isin(mask, (0.0, low)).all():  # its hiding value is a finite bias
            got = f"a mask that hides keys with the finite bias {low:g} (above {MASKED:g})"
    raise _refuse(
        op,
        f"needs the attn_mask of causal attention over its {t} tokens (query i sees keys 0 .. i), as a graph "
        f"builds it from an attention_mask of ones, hiding with False, -inf or at most {MASKED:g}; got {got}",
    )


def run_segments(op: Attention23, inputs: list, rt: RunContext, counts: np.ndarray) -> Sequence[np.ndarray | None]:
    """The outputs of ``op`` in a run of segments ``counts`` (see the module docstring)."""
    q_in, k_in, v_in, mask = inputs[:4]
    if not takes_segments(op):
        raise _refuse(
            op, "takes no qk_matmul_output, nonpad_kv_seqlen or softmax_precision other than FLOAT, and a node "
            "bound to the state's caches",
        )  # fmt: skip
    q, k, v = op._to_bnsh(q_in, k_in, v_in)
    one, hq, t, d = q.shape
    if one != 1 or t != int(counts.sum()):
        raise _refuse(op, f"{counts.tolist()} needs Q of one row of {int(counts.sum())} tokens, got {q_in.shape}")
    if q.dtype == np.float64:
        raise _refuse(op, "takes float16, bfloat16 or float32 inputs, got float64")
    _check_causal(op, mask, t)
    past_k, past_v = op.node.input[4], op.node.input[5]
    ck, cv = rt.caches[past_k], rt.caches[past_v]
    starts = ck.lengths.astype(np.int64)  # each row continues at its committed length
    first, pos = token_layout(counts, starts)
    present_k = rt.cache_write_segments(past_k, k)
    present_v = rt.cache_write_segments(past_v, v)
    scale = float(op.scale) if op.scale is not None else 1.0 / np.sqrt(d)
    y = attend_rows(
        q.astype(np.float32, copy=False), ck, cv, counts, starts, first, pos, scale, op.softcap, op.left, rt,
        v.shape[3],
    )  # fmt: skip
    outs: list[np.ndarray | None] = [op._output(rt, y.transpose(1, 0, 2)[None], q_in.ndim, q_in.dtype), None, None]
    if op.want[1]:
        outs[1], outs[2] = present_k, present_v
    return outs[: len(op.node.output)]


def mask_only_nodes(graph: onnx.GraphProto) -> set[int]:
    """Indices of the nodes of ``graph`` whose every output is read only as the ``attn_mask`` of an ONNX
    Attention node or by other such nodes (never a graph output): the nodes that build the attention
    mask.  In a run of segments their values reach nothing but masks, which the Attention nodes check."""
    outputs = {o.name for o in graph.output}
    readers: dict[str, list[tuple[int, int]]] = {}
    for k, n in enumerate(graph.node):
        for slot, name in enumerate(n.input):
            if name:
                readers.setdefault(name, []).append((k, slot))
    masks: set[int] = set()
    for k in range(len(graph.node) - 1, -1, -1):  # readers come after what they read
        n = graph.node[k]
        if all(
            name not in outputs
            and all(
                (graph.node[r].op_type == "Attention" and graph.node[r].domain in ("", "ai.onnx") and slot == 3)
                or r in masks
                for r, slot in readers.get(name, [])
            )
            for name in n.output
            if name
        ):
            masks.add(k)
    return masks
