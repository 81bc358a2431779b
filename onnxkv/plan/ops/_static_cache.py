"""The static-cache form's attention inputs in a paged state: which caches an ONNX ``Attention`` reads and how.

In the static-cache form (``TensorScatter`` into each layer's cache, then
``Attention`` with ``nonpad_kv_seqlen`` over the whole caches) the attention's
K and V are the presents of two in-place TensorScatter nodes.  In a paged
state those nodes return placeholders when the plan found that every reader
reads the pages itself (:func:`onnxkv.plan.ops.tensor_scatter.share_pages`),
and the attention reads the caches' pages through the paged streaming kernel
(:func:`static_pages`), as a GroupQueryAttention node reads its own.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._util import BF16
from onnxkv.plan.registry import BuildContext

__all__ = ["static_pages", "static_pasts"]


def static_pasts(node: onnx.NodeProto, ctx: BuildContext) -> tuple[str, str] | None:
    """The pasts of the static caches (TensorScatter bindings) whose presents ``node`` reads as K (input 1) and
    V (input 2), or None."""
    presents = {(b.role, b.present): b.past for bs in ctx.bindings.values() for b in bs if b.kind == "tensor_scatter"}
    names = [*node.input, "", ""]
    k, v = presents.get(("key", names[1])), presents.get(("value", names[2]))
    return None if k is None or v is None else (k, v)


def _pages_cover(tables: np.ndarray, block_size: int, kv_start, kv_len: np.ndarray) -> bool:
    """Whether every block of positions ``[kv_start[b], kv_len[b])`` (``kv_start`` None: from 0) of every row
    holds a page in ``tables`` [B, M]."""
    for b in range(tables.shape[0]):
        lo, hi = (0 if kv_start is None else int(kv_start[b])) // block_size, -(-int(kv_len[b]) // block_size)
        if hi > tables.shape[1] or (lo < hi and int(tables[b, lo:hi].min()) < 0):
            return False
    return True


def static_pages(rt: RunContext, pasts: tuple[str, str], seen, kv_len: np.ndarray, total: int) -> tuple:
    """``(keys, values, paged)`` of the paged state's static caches bound to ``pasts``: the caches themselves for
    the paged streaming kernel (``paged`` True) when ``seen`` (the kernel's ranges ``(kv_start, q_pos,
    window)``) is given and every block a row may read (before ``kv_len``) holds a page; else gathered copies of
    their first ``total`` positions (zeros where nothing was written: what the TensorScatter nodes would have
    returned), counted as the running node's copies."""
    ck, cv = rt.caches[pasts[0]], rt.caches[pasts[1]]
    if seen is not None and _pages_cover(ck.tables, ck.block_size, seen[0], kv_len):
        return ck, cv, True
    keys, values = ck.gather(total), cv.gather(total)
    rt.count(allocations=2, allocated_bytes=2 * keys.nbytes, prefix_copied_bytes=2 * keys.nbytes)
    if keys.dtype == np.uint16:  # bfloat16 held as its bit patterns
        keys, values = keys.view(BF16), values.view(BF16)
    return keys, values, False
