"""What the attention operators share in a run of segments (:meth:`State.run
<onnxkv.runtime.state.State.run>` with ``segments``): the run's token layout and the attention of its rows
over their own page tables.  Used by :mod:`._gqa_segments` (GroupQueryAttention) and
:mod:`._attention_segments` (ONNX Attention).

A run of segments holds the new tokens of B rows on one token axis of a batch-1 run: ``counts[r]`` tokens
of row ``r`` after those of the rows before it (int64 [B], 0: the row does not run).  Row ``r``'s tokens
continue at its committed length ``L_r`` (positions ``L_r .. L_r + counts[r] - 1``); its queries attend
causally over its first ``L_r + counts[r]`` keys, as a run of the row alone does.
"""

from __future__ import annotations

import numpy as np

from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._attention_math import native_rows, paged_causal_attention

__all__ = ["Rows", "attend_rows", "cache_segments", "token_layout"]


class Rows:
    """The attributes the paged attention kernel reads of a :class:`~onnxkv.cache.paged.PagedPlane`, for
    some of its rows (``tables`` the staged tables of those rows, a contiguous copy; ``native``: the caller
    found every page they read native, so no per-page formats)."""

    def __init__(self, plane, rows: np.ndarray, native: bool = False) -> None:
        self.ptrs, self.block_size, self.heads, self.storage = plane.ptrs, plane.block_size, plane.heads, plane.storage
        self.formats = None if native else plane.formats
        self.groups, self.header = plane.groups, plane.header
        self.tables = np.ascontiguousarray(plane.tables[rows])


def cache_segments(rt: RunContext, past: str, bound: bool) -> np.ndarray | None:
    """The run's segments (int64 [B]) when a node ``bound`` to the state reads the paged cache of its input
    ``past`` in a run of segments, else None."""
    if rt.caches is None or not bound:
        return None
    return getattr(rt.caches.get(past), "segments", None)


def token_layout(counts: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(first, positions)``: int64 [B] the first token of each row on the axis, and int64 [T] each
    token's position (its row's committed length ``starts[r]`` plus its place in the row's segment)."""
    rows = np.repeat(np.arange(counts.size), counts)
    first = np.cumsum(counts) - counts
    return first, starts[rows] + np.arange(int(counts.sum())) - first[rows]


def attend_rows(
    q: np.ndarray,
    keys,
    values,
    counts: np.ndarray,
    starts: np.ndarray,
    first: np.ndarray,
    positions: np.ndarray,
    scale: float,
    softcap: float,
    window: int,
    rt: RunContext,
    dv: int,
) -> np.ndarray:
    """Each row's causal attention over its own pages: float32 [T, Hq, Dv], token ``t``'s heads.

    ``q`` float32 [1, Hq, T, D] (the run's queries, rotated where the node rotates); ``keys`` / ``values``
    the node's :class:`~onnxkv.cache.paged.PagedPlane` s, this run's keys already written; ``counts``,
    ``starts``, ``first``, ``positions`` as :func:`token_layout` gives them.  The rows of one token count
    ``n`` run as one kernel call of ``n`` queries per row (the decode rows together, equal prompt chunks
    together; the rows whose pages are all native apart from the others, :func:`native_rows`); each row's
    result is that of the row alone.  The kernel's storage figures go to ``rt``.
    """
    hq, t = q.shape[1], q.shape[2]
    out = np.empty((t, hq, dv), np.float32)
    for n in np.unique(counts[counts > 0]).tolist():
        rows = np.flatnonzero(counts == n)
        native = native_rows(keys, values, keys.tables[rows], starts[rows] + n)
        for group, all_native in ((rows[native], True), (rows[~native], False)):  # native rows apart
            if not group.size:
                continue
            at = first[group][:, None] + np.arange(n)  # [G, n]: their tokens on the axis
            got = np.empty((group.size, hq, n, dv), np.float32)
            cost = paged_causal_attention(
                q[0][:, at].transpose(1, 0, 2, 3), Rows(keys, group, all_native), Rows(values, group, all_native),
                starts[group] + n, positions[at], scale, softcap, window, got,
            )  # fmt: skip
            rt.count(**cost)
            out[at] = got.transpose(0, 2, 1, 3)
    return out
