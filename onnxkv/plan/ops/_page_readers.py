"""Attention nodes that read a paged state's pages themselves, and the cache writers that then hand them
placeholders instead of gathered copies.

Two graph forms write a layer's cache with one node and read it with another:

* the static-cache form: ``TensorScatter`` into each layer's cache, then an ONNX ``Attention`` with
  ``nonpad_kv_seqlen`` over the whole caches
  (:class:`~onnxkv.plan.ops.attention_onnx.Attention24`);
* an eager export's ``past -> Concat -> present``, then the layer's fused
  :class:`~onnxkv.plan.ops.masked_attention.MaskedAttention`.

In a paged state a writer has no contiguous present to return.  It gathers a
copy of the whole past (counted as ``prefix_copied_bytes``) unless the plan
found that every node reading the present reads the pages itself
(:func:`share_pages`): it then returns a zero-byte placeholder of the
present's shape, and the reader takes the caches' pages through the paged
streaming kernel (:func:`read_pages`), as a GroupQueryAttention node reads
its own.  A reader whose call the kernel cannot express (:func:`read_pages`
without ranges) gathers the copies itself, with the same count.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._util import BF16
from onnxkv.plan.registry import BuildContext

__all__ = ["page_pasts", "paged_state", "read_pages", "share_pages"]


def page_pasts(node: onnx.NodeProto, ctx: BuildContext, kind: str) -> tuple[str, str] | None:
    """The pasts of the caches bound by ``kind`` bindings (``"tensor_scatter"``, ``"concat"``) whose presents
    ``node`` reads as K (input 1) and V (input 2), or None."""
    presents = {(b.role, b.present): b.past for bs in ctx.bindings.values() for b in bs if b.kind == kind}
    names = [*node.input, "", ""]
    k, v = presents.get(("key", names[1])), presents.get(("value", names[2]))
    return None if k is None or v is None else (k, v)


def paged_state(rt: RunContext, reader) -> bool:
    """Whether ``reader`` (a kernel with ``page_pasts`` and ``pages_given``) runs in a paged state whose
    writers handed it placeholders: it must read the pages of its ``page_pasts`` itself."""
    pasts = reader.page_pasts
    return (
        reader.pages_given
        and rt.caches is not None
        and rt.in_place(pasts[0])
        and getattr(rt.caches[pasts[0]], "paged", False)
    )


def _pages_cover(tables: np.ndarray, block_size: int, kv_start, kv_len: np.ndarray) -> bool:
    """Whether every block of positions ``[kv_start[b], kv_len[b])`` (``kv_start`` None: from 0) of every row
    holds a page in ``tables`` [B, M]."""
    for b in range(tables.shape[0]):
        lo, hi = (0 if kv_start is None else int(kv_start[b])) // block_size, -(-int(kv_len[b]) // block_size)
        if hi > tables.shape[1] or (lo < hi and int(tables[b, lo:hi].min()) < 0):
            return False
    return True


def read_pages(rt: RunContext, pasts: tuple[str, str], seen, kv_len: np.ndarray, total: int) -> tuple:
    """``(keys, values, paged)`` of the paged state's caches bound to ``pasts``: the caches themselves for
    the paged streaming kernel (``paged`` True) when ``seen`` (the kernel's ranges ``(kv_start, q_pos,
    window)``) is given and every block a row may read (before ``kv_len``) holds a page; else gathered copies of
    their first ``total`` positions (zeros where nothing was written: what the writers would have
    returned), counted as the running node's copies."""
    ck, cv = rt.caches[pasts[0]], rt.caches[pasts[1]]
    if seen is not None and _pages_cover(ck.tables, ck.block_size, seen[0], kv_len):
        return ck, cv, True
    keys, values = ck.gather(total), cv.gather(total)
    rt.count(allocations=2, allocated_bytes=2 * keys.nbytes, prefix_copied_bytes=2 * keys.nbytes)
    if keys.dtype == np.uint16:  # bfloat16 held as its bit patterns
        keys, values = keys.view(BF16), values.view(BF16)
    return keys, values, False


def share_pages(nodes: list, kernels: list) -> None:
    """Let the in-place cache writers of a built plan (``nodes`` and their ``kernels``: kernels with a
    ``bound_past`` and a ``pages_read`` flag, a ``TensorScatter`` or a cache ``Concat``) return a placeholder in
    paged states where every node reading their present reads the pages itself: a kernel whose
    ``page_input(index)`` names the past bound to that writer.  Sets ``pages_read`` on those writers and
    ``pages_given`` on the readers (kernels with ``page_pasts``) whose K and V both come so."""
    readers: dict[str, list] = {}
    for node, kernel in zip(nodes, kernels):
        for index, name in enumerate(node.input):
            readers.setdefault(name, []).append((kernel, index))
    writers = [k for k in kernels if hasattr(k, "pages_read") and getattr(k, "bound_past", None) is not None]
    writer_ids = {id(k) for k in writers}
    deferred = set()
    for node, kernel in zip(nodes, kernels):
        if id(kernel) in writer_ids:
            took = readers.get(node.output[0], [])
            page_input = [getattr(r, "page_input", None) for r, _ in took]
            if took and all(f is not None and f(i) == kernel.bound_past for f, (_, i) in zip(page_input, took)):
                deferred.add(kernel.bound_past)
    readers_of_pages = [k for k in kernels if getattr(k, "page_pasts", None) is not None]
    changed = True
    while changed:  # a reader whose K or V still comes as a copy takes both as copies: its other one must too
        changed = False
        for kernel in readers_of_pages:
            if not all(p in deferred for p in kernel.page_pasts) and any(p in deferred for p in kernel.page_pasts):
                deferred.difference_update(kernel.page_pasts)
                changed = True
    for kernel in writers:
        kernel.pages_read = kernel.bound_past in deferred
    for kernel in readers_of_pages:
        kernel.pages_given = all(p in deferred for p in kernel.page_pasts)
