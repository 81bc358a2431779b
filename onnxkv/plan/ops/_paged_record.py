"""An export's cache ``Concat``, ``MaskedAttention`` and an ONNX ``Attention`` node in a paged state, as a
compiled step records them.

In a paged state whose writers hand their readers placeholders (:mod:`._page_readers`), a decode step of an
eager export writes each layer's new K and V rows into the cache's pages (the ``Concat`` nodes) and reads
them back through the paged streaming kernel (``MaskedAttention``); an ONNX ``Attention`` node does both.
A replay makes the same kernel calls:

* :func:`note_page_rows` notes a Concat's write (``_record.KIND_PAGE_ROWS``) at the rows' committed lengths;
* :func:`note_masked_paged` notes the attention of one query per row (``_record.KIND_MASKED_PAGED``) over the
  pages, with the mask a whole ragged operand whose visible keys the call describes itself (each row's query
  must see a range ending at its own position);
* :func:`note_attention_paged` notes an ``Attention`` node's call: its rows written by the same call.

Each call's effect is a :class:`~onnxkv.plan.ops._gqa_paged_decode.PagedAppend`, as a GroupQueryAttention
node's paged decode call has: the first of a segment stages the pages of every plane the segment writes and
sets the committed lengths the calls check; the compiled generation loop advances them itself.  A call is
noted only where a replay computes what the node computed: every row at one committed length (or, for an
``Attention`` node over the rows of requests of different lengths, each row at its own, the mask hiding the
keys between), one new position per row, every page native (no format selector), a mask of one of the kernel's
types.
"""

from __future__ import annotations

import numpy as np

from onnxkv._kernels._record import DECODE_CACHE_TYPES, MASKED_PAGED, PAGE_ROWS
from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._export_record import replayable_mask
from onnxkv.plan.ops._gqa_paged_decode import PagedAppend, fused_cache, note_page_tables

__all__ = ["note_attention_paged", "note_masked_paged", "note_page_rows"]

_MASK_KINDS = {np.dtype(np.float32): 0, np.dtype(np.bool_): 1, np.dtype(np.float16): 2}


def _at_one_length(planes, length: int, ragged: bool = False) -> bool:
    """Whether every row of the paged ``planes`` has committed exactly ``length`` positions (``ragged``: at
    most ``length``, the longest row exactly)."""
    return all(
        p.lengths.size and (ragged or int(p.lengths.min()) == length) and int(p.lengths.max()) == length for p in planes
    )


def note_page_rows(op, rec, rt: RunContext, name: str, new: np.ndarray, past_len: int) -> None:
    """Note the write a cache Concat ``op`` just made of ``new`` [B, H, S, D] into the paged cache bound to
    ``name`` at every row's committed length ``past_len``, with its effect (which sets the node's output, the
    present placeholder), or refuse the recording when a replay could not make it."""
    plane = rt.caches[name]
    cache = fused_cache((plane,))
    half = new.dtype == np.float16
    if (
        cache is None
        or not isinstance(new, np.ndarray)
        or new.ndim != 4
        or not new.flags.c_contiguous
        or new.dtype not in (np.float32, np.float16)
        or (half and plane.storage == "float32")
        or new.shape[0] != plane.batch
        or not _at_one_length((plane,), past_len)
    ):
        rec.refused.append(f"{op.op_type} node '{op.name}': not an append to a paged cache's native pages")
        return
    b, h, s, d = new.shape
    lengths, last = np.zeros((2, b), np.int64), np.zeros(b, np.int32)
    addresses, tables = note_page_tables(rec, plane.cache)
    ints = (b, h, s, d, plane.block_size, plane.index, int(half), DECODE_CACHE_TYPES[plane.storage], 0, 0, 0, 0, 0, 0,
            addresses.shape[1], tables.shape[1])  # fmt: skip
    rec.note(PAGE_ROWS, (new, addresses, tables, lengths, last), ints, ())
    rec.effect(PagedAppend((name,), lengths, ((0, name),), plane.block_size, s))


def note_masked_paged(
    rec,
    rt: RunContext,
    names: tuple[str, str],
    q,
    rows,
    mask,
    out,
    scale: float,
    softcap: float,
    causal: bool,
    presents: tuple = (),
    ragged: bool = False,
) -> bool:
    """Note the attention call an operator just ran over the pages of the caches ``names``: q [B, Hq, 1, D] (float32,
    or float16 with out and 2-byte pages) and ``out`` as the kernel took them, ``rows`` the new (k, v) [B, Hkv,
    1, D] the node wrote itself (None: an earlier node wrote them), ``mask`` [mb, 1, 1, T] (C-contiguous, one
    column per key: additive float32 or float16, or bool) with ``causal`` bounding the query at key T - 1, and
    ``presents`` the (output index, past name) of the node's present outputs.  ``ragged``: the rows may have
    committed fewer than T - 1 positions, the mask hiding the keys a row never wrote (which the node dropped,
    its new rows stored after each row's own: ``attention_onnx.ragged_mask``).  Returns False, noting nothing,
    when a replay could not make the call: the caller then refuses the recording."""
    planes = (rt.caches[names[0]], rt.caches[names[1]])
    cache = fused_cache(planes)
    b, hq, s, d = q.shape
    half = q.dtype == np.float16
    t = mask.shape[-1] if isinstance(mask, np.ndarray) and mask.ndim == 4 else -1
    arrays = (q, out) if rows is None else (q, out, *rows)
    if (
        cache is None
        or s != 1
        or planes[0].storage != planes[1].storage
        or (half and planes[0].storage == "float32")
        or not all(isinstance(x, np.ndarray) and x.flags.c_contiguous and x.dtype == q.dtype for x in arrays)
        or q.dtype not in (np.float32, np.float16)
        or out.shape != q.shape
        or mask.dtype not in _MASK_KINDS
        or (mask.dtype == np.float16 and not half)
        or not replayable_mask(mask, (mask.dtype,), b, 1, t)
        or not _at_one_length(planes, t - 1, ragged)
        or b != planes[0].batch
        or d != planes[0].head_size
        or hq % planes[0].heads
        or (rows is not None and not rows[0].shape == rows[1].shape == (b, planes[0].heads, 1, d))
    ):
        return False
    k, v = rows if rows is not None else (None, None)
    lengths = np.zeros((2, b), np.int64)
    scratch = tuple(np.zeros(b, np.int32) for _ in range(3))  # last, kv_start, q_pos
    addresses, tables = note_page_tables(rec, planes[0].cache)
    ints = (b, hq, planes[0].heads, d, planes[0].block_size, planes[0].index, planes[1].index, mask.shape[0], t,
            _MASK_KINDS[mask.dtype], int(causal), int(half), DECODE_CACHE_TYPES[planes[0].storage], int(ragged),
            addresses.shape[1], tables.shape[1])  # fmt: skip
    rec.note(MASKED_PAGED, (q, k, v, mask, out, addresses, tables, lengths, *scratch), ints, (scale, softcap))
    rec.ragged_last(mask)
    rec.effect(PagedAppend(names, lengths, presents, planes[0].block_size, 1, writes=rows is not None))
    return True


def note_attention_paged(op, rec, rt: RunContext, decode: tuple, starts, past_len: int, scale: float) -> None:
    """Note what an ONNX Attention node ``op`` just ran on the paged streaming kernel in a paged state -- its
    new rows written at every row's committed length (``starts``: ``past_len``, or int64 [B] when the rows
    differ and the node dropped the keys its mask hides between a row's own and the new ones), then the
    attention over the pages -- or refuse the recording.  ``decode``: (q, k, v [B, H, S, D] as the kernel and
    the writes took them, the node's attn_mask input, y the kernel's output, y_out the node's output Y when it
    is y's memory)."""
    q, k, v, mask, y, y_out = decode
    names = (op.node.input[4], op.node.input[5])
    presents = ((1, names[0]), (2, names[1])) if op.want[1] else ()
    ragged = isinstance(starts, np.ndarray)
    if (
        y_out is None
        or not (isinstance(starts, int) or (ragged and np.array_equal(starts, rt.caches[names[0]].lengths)))
        or q.dtype != np.float32
        or not isinstance(mask, np.ndarray)
        or mask.dtype == np.float16
        or not note_masked_paged(
            rec, rt, names, q, (k, v), mask, y, scale, op.softcap, op.is_causal, presents, ragged=ragged
        )
    ):
        rec.refused.append(f"{op.op_type} node '{op.name}': not a decode over a paged state's native pages")
