"""The fused batched decode call of :class:`~onnxkv.plan.ops.attention_gqa.GroupQueryAttention` on pages.

:func:`paged_decode` serves the node's call for S new tokens of each row of a state's paged cache
(float32, float16 or bfloat16 pages; an engine's batched decode step, ``generate`` on paged caches, the verification of a speculative
tree or of a draft's tokens) with one kernel call, :func:`onnxkv._kernels.decode_token_paged` (rotary,
each row's new K/V rows written into their pages, paged attention), after the cache has staged the pages
the rows write (:meth:`PagedCache.prepare`: fresh and copy-on-write pages, as the general path's first
write does).  It declines (None, no cache byte written)
whatever the general path would treat otherwise or refuse, so that path runs and raises its errors.

A compiled step records the call (``_record.KIND_DECODE_PAGED``) with :class:`PagedAppend` as its effect: a
replay stages the rows' pages as this path does, reads the tables and page addresses the run has then, and
checks every position and page in C before anything runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from onnxkv._kernels import decode_token_paged as _paged_kernel
from onnxkv._kernels._record import DECODE_CACHE_TYPES, DECODE_PAGED
from onnxkv._kernels._record import current as _recorder
from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._gqa_decode import FUSED_TOKENS, TOKEN_TYPES, constant_rotary
from onnxkv.plan.ops._gqa_record import rows_span

if TYPE_CHECKING:
    from onnxkv.plan.ops.attention_gqa import GroupQueryAttention

__all__ = ["PagedAppend", "fused_cache", "note_page_tables", "paged_decode"]

_I32 = np.dtype(np.int32)


def paged_decode(op: GroupQueryAttention, inputs: list, rt: RunContext) -> tuple | None:
    """The outputs of node ``op`` for S new tokens per row into a state's paged cache, or None.

    Taken when: 1 <= S <= ``FUSED_TOKENS`` tokens per row after a past (not a first prompt; with S > 1
    every row of one length, the general path's rule), float32 or float16 Q/K/V (separate, or packed as the
    GenAI builder's fused projection), int32 ``seqlens_k`` [B] whose row totals minus S are exactly the rows'
    committed lengths (an append; ``total_sequence_length`` int32, at least every row's total and at most
    the past plus S), the state's paged caches bound in place (float32, float16 or bfloat16 pages; float16
    tokens: 2-byte ones) with every page native and no format
    selector reading the run's writes, no position_ids / attention_bias / head_sink / smooth_softmax /
    window-sized caches, rotary (if any) from the node's constant tables.  The result, the pages written
    and the event-log figures are the general path's.
    """
    if len(inputs) < 7 or any(x is not None for x in inputs[9:]) or op.smooth_softmax or not op.bound:
        return None
    if op.window_cache:
        return None
    query, key, value, past_key, past_value, seqlens_k, total_seqlen = inputs[:7]
    caches = rt.caches
    past_k_name, past_v_name = op._past_names
    if caches is None or past_k_name not in caches or past_v_name not in caches or past_key is None:
        return None
    ck, cv = caches[past_k_name], caches[past_v_name]
    cache = fused_cache((ck, cv))
    if cache is None:
        return None
    if (
        not isinstance(query, np.ndarray)
        or query.ndim != 3
        or not 1 <= query.shape[1] <= FUSED_TOKENS  # a longer run (a prompt chunk): the general path's tiles
        or query.dtype not in TOKEN_TYPES
        or (query.dtype == np.float16 and ck.storage == "float32")  # float16 tokens: into 2-byte pages
    ):
        return None
    b, n = query.shape[:2]
    if (
        not isinstance(seqlens_k, np.ndarray)
        or seqlens_k.dtype != _I32
        or seqlens_k.shape != (b,)
        or not isinstance(total_seqlen, np.ndarray)
        or total_seqlen.dtype != _I32
        or total_seqlen.size != 1
        or not isinstance(past_key, np.ndarray)
        or past_key.ndim != 4
    ):
        return None
    starts = seqlens_k.astype(np.int64) + (1 - n)  # each row's first position: its total minus the n new tokens
    total, past_len = int(total_seqlen.reshape(-1)[0]), past_key.shape[2]
    if (
        b != ck.batch
        or total <= n  # n tokens of a total of n: a prompt
        or total > past_len + n
        or int(starts.min()) < 0
        or int(starts.max()) + n > total
        or (n > 1 and (starts != starts[0]).any())  # the general path's rule for several tokens per row
        or starts.tobytes() != ck.lengths.tobytes()  # int64 both: an append at each row's length
    ):
        return None
    rotary = constant_rotary(op, inputs, int(starts.max()) + n)
    if rotary is None:
        return None
    cos, sin = rotary
    hq, hkv, d = op.num_heads, op.kv_num_heads, ck.head_size
    if key is None and value is None and query.shape[2] == (hq + 2 * hkv) * d:
        query, key, value = query[..., : hq * d], query[..., hq * d : (hq + hkv) * d], query[..., (hq + hkv) * d :]
    if (
        not isinstance(key, np.ndarray)
        or not isinstance(value, np.ndarray)
        or key.dtype != query.dtype
        or value.dtype != query.dtype
        or query.shape[2] != hq * d
        or key.shape != (b, n, hkv * d)
        or value.shape != (b, n, hkv * d)
        or ck.heads != hkv
    ):
        return None
    prep = cache.prepare(starts, n)  # the pages the rows write, held by this run alone (may raise as a write)
    output = rt.empty(0, (b, n, hq * d), query.dtype)
    stats = _paged_kernel(
        query, key, value, cos, sin, op.interleaved, ck.ptrs, cv.ptrs, cache.tables, ck.block_size, hkv,
        starts.astype(np.int32), float(op._softmax_scale(d)), op.softcap, op.window, output, kv_dtype=ck.storage,
    )  # fmt: skip
    if stats is None:  # declined: the general path writes the rows (its first write's cost is the pages')
        return None
    rec = _recorder()
    if rec is not None:
        _note(op, rec, (query, key, value, cos, sin), ck, cv, seqlens_k, total_seqlen, output)
    cache.appended((ck.index, cv.index), starts, n)
    if rt.recording:
        for name, plane, extra in ((past_k_name, ck, prep), (past_v_name, cv, None)):
            cost = cache.append_cost(plane.index, b, n)
            if extra is not None:
                for field in ("allocations", "allocated_bytes", "cow_copied_bytes"):
                    setattr(cost, field, getattr(cost, field) + getattr(extra, field))
            rt.cache_staged(name, cost)
    rt.count(**stats)
    present_len = max(total, past_len)
    presents = [c.placeholder(present_len) if want else None for c, want in zip((ck, cv), op.has_present)]
    return (output, *presents)[: len(op.node.output)]


def fused_cache(planes) -> object | None:
    """The one paged cache every plane of ``planes`` is a plane of, all of one storage (float32, float16 or
    bfloat16), when the fused call may write it (every page native, no format selector reading the run's
    writes); else None."""
    cache = getattr(planes[0], "cache", None) if getattr(planes[0], "paged", False) else None
    if cache is None or cache.keep_written or any(cache.payloads.converted):
        return None
    for plane in planes:
        if not getattr(plane, "paged", False) or plane.cache is not cache or plane.storage != planes[0].storage:
            return None
    return cache


def _note(op: GroupQueryAttention, rec, qkv_rot: tuple, ck, cv, seqlens_k: np.ndarray, total: np.ndarray, output):
    """Note the fused call of ``op`` that just ran on the recording thread (``_record.KIND_DECODE_PAGED``):
    ``qkv_rot`` its (q, k, v, cos or None, sin or None) arrays (q, k, v [B, 1, W], rows possibly strided),
    ``ck`` / ``cv`` the planes it wrote, ``output`` its result.  The page addresses and block tables are
    externals the replay takes from the run's caches (their last dims may change: the pool and the tables
    grow); the effect sets the committed lengths and staged ends the call checks the positions against."""
    q, k, v, cos, sin = qkv_rot
    cache = ck.cache
    b, n = q.shape[:2]
    lengths = np.zeros((2, b), dtype=np.int64)
    # between consecutive token rows (the kernel took them: one stride, row b's tokens after row b - 1's)
    strides = [x.strides[1 if n > 1 else 0] // x.itemsize if b * n > 1 else x.shape[2] for x in (q, k, v)]
    half, rows = (0, 0) if cos is None else (cos.shape[1], cos.shape[0])
    addresses, tables = note_page_tables(rec, cache)
    arrays = (*(rows_span(x) for x in (q, k, v)), cos, sin, addresses, tables, seqlens_k, total.reshape(1), output,
              lengths)  # fmt: skip
    ints = (op.num_heads, op.kv_num_heads, ck.head_size, ck.block_size, half, int(bool(op.interleaved)), op.window,
            rows, b, ck.index, cv.index, *strides, 0, 0, n, int(q.dtype == np.float16),
            DECODE_CACHE_TYPES[ck.storage])  # fmt: skip
    rec.note(DECODE_PAGED, arrays, ints, (float(op._softmax_scale(ck.head_size)), float(op.softcap)))
    presents = tuple((i + 1, op._past_names[i]) for i in (0, 1) if op.has_present[i])
    rec.effect(PagedAppend(op._past_names, lengths, presents, ck.block_size, n))


def note_page_tables(rec, cache) -> tuple[np.ndarray, np.ndarray]:
    """The run's page addresses [planes, P] and block tables [B, M] of the paged ``cache``, noted as the whole
    ragged externals a replay takes from the cache (by its first plane's name: every plane names the same
    tables)."""
    addresses, tables = cache.payloads.ptrs, cache.tables
    first = next(iter(cache.planes))
    rec.cache((first, "page_addresses"), addresses)
    rec.cache((first, "tables"), tables)
    rec.ragged_last(addresses)
    rec.ragged_last(tables)
    return addresses, tables


class PagedAppend:
    """The effect of a recorded call that writes (or reads) a run's paged cache at the rows' committed lengths:
    a paged decode call (``_record.KIND_DECODE_PAGED``), a cache Concat's rows (``KIND_PAGE_ROWS``), a masked
    attention over the pages (``KIND_MASKED_PAGED``, which writes its own rows or reads rows an earlier call
    wrote: ``writes`` False).

    The paged calls of one segment (one or three per layer) write one state's cache: :meth:`group` makes the
    first effect of a segment the *leader* of the others, which then do nothing but follow it.

    ``before(caches, steps)`` (the leader's) declines (False: the step is stale) unless every plane of the
    group is a paged plane of one cache whose pages are all native and whose writes no format
    selector reads, with the recorded batch and block size (the calls address pages by it); it sets
    ``lengths[0]`` of every effect of the group to the committed lengths (the positions the calls check)
    and stages the pages the rows write in the next ``steps`` runs (``tokens`` positions per row each;
    :meth:`PagedCache.prepare`, as :func:`paged_decode` does for one), whose end is ``lengths[1]`` (a call
    refuses a position past it).  ``after(rt)`` stages the appended rows of every plane the group writes (the
    leader) and returns ``(output index, placeholder)`` for the node's present outputs; :meth:`stage` stages
    the rows of several steps (the compiled generation loop, one token per step, which advances
    ``lengths[0]`` itself).
    """

    __slots__ = ("names", "lengths", "outputs", "presents", "block_size", "tokens", "writes", "followers", "leads",
                 "group_names", "present_len")  # fmt: skip

    def __init__(
        self,
        names: tuple[str, ...],
        lengths: np.ndarray,
        presents: tuple[tuple[int, str], ...],
        block_size: int,
        tokens: int = 1,
        writes: bool = True,
    ) -> None:
        self.names = names
        self.lengths = lengths
        self.block_size = block_size
        #: New tokens per row of the recorded call (its ``S``).
        self.tokens = tokens
        #: Whether the call writes the rows of ``names`` (else it reads rows another call wrote).
        self.writes = writes
        #: (node output index, past name) of each present output this effect sets (a placeholder).
        self.presents = presents
        #: The node outputs this effect sets.
        self.outputs = tuple(i for i, _ in presents)
        #: The effects this one leads (see :meth:`group`), and whether it leads (else another leads it).
        self.followers: list[PagedAppend] = []
        self.leads = True
        #: The past names the group writes (the leader's and its followers', in call order, once each).
        self.group_names: tuple[str, ...] = names if writes else ()
        #: The length of the presents after the run (set by the leader's :meth:`before`).
        self.present_len = 0

    @staticmethod
    def group(effects: list) -> None:
        """Make the first :class:`PagedAppend` of ``effects`` (a segment's, in call order) lead the others."""
        paged = [e for e in effects if type(e) is PagedAppend]
        for e in paged[1:]:
            e.leads, e.followers, e.group_names = False, [], e.names if e.writes else ()
        if paged:
            lead = paged[0]
            lead.leads, lead.followers = True, paged[1:]
            lead.group_names = tuple(dict.fromkeys(n for e in paged if e.writes for n in e.names))

    def before(self, caches: dict, steps: int = 1) -> bool:
        if not self.leads:
            return True
        planes = [caches[n] for n in self.group_names or self.names]
        cache = fused_cache(planes)
        if cache is None or planes[0].block_size != self.block_size:
            return False
        committed = cache.table.lengths
        if committed.shape != self.lengths.shape[1:]:
            return False
        n = self.tokens * steps
        self.lengths[0] = committed
        self.lengths[1] = committed + n
        self.present_len = int(committed.max()) + self.tokens
        for e in self.followers:
            e.lengths[...] = self.lengths
            e.present_len = self.present_len
        if self.group_names:  # (a group that only reads stages nothing: the nodes that wrote its rows did)
            cache.prepare(self.lengths[0], n)
        return True

    def after(self, rt: RunContext) -> list:
        if self.leads:
            self.stage(rt.caches, self.lengths[0], self.tokens)
            if rt.recording:
                for name in self.group_names:
                    plane = rt.caches[name]
                    rt.cache_staged(name, plane.cache.append_cost(plane.index, self.lengths.shape[1], self.tokens))
        return [(i, rt.caches[name].placeholder(self.present_len)) for i, name in self.presents]

    def stage(self, caches: dict, starts: np.ndarray, steps: int) -> None:
        """Stage ``steps`` rows appended from ``starts`` (int64 [B]) in every plane of the group (the
        leader, whose :meth:`before` found them planes of one cache; a follower stages nothing)."""
        if self.leads and self.group_names:
            planes = [caches[name] for name in self.group_names]
            planes[0].cache.appended([p.index for p in planes], starts, steps)
