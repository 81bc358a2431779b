"""Appending into a paged KV cache: scatter new tokens into their pages by address.

``page_write(new, pages, tables, starts, block_size)`` copies ``new`` [B, H, S, D]
(C-contiguous) so that row b's token t lands at logical position
``p = starts[b] + t``: page ``tables[b, p // block_size]``, slot
``p % block_size``.  A page is ``[H, block_size, D]`` elements of ``new``'s
element type, C-contiguous, at the address ``pages[page id]`` (head-major:
one head's tokens contiguous).  Only those (head, slot) rows are written;
nothing else of any page changes.  Every check runs before the first byte is
written.  One copy of ``D`` elements per (row, head, token); no GIL.
"""
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memcpy

import numpy as np

from . import _validate as V


cdef void _scatter(const char *src, const uint64_t *pages, const int32_t *tables, const int64_t *starts,
                   int64_t B, int64_t H, int64_t S, int64_t row, int64_t M, int64_t bs) noexcept nogil:
    cdef int64_t b, h, t, pos, blk, slot
    cdef char *page
    for b in range(B):
        for t in range(S):
            pos = starts[b] + t
            blk = pos // bs
            slot = pos - blk * bs
            page = <char *>pages[tables[b * M + blk]]
            for h in range(H):
                memcpy(page + (h * bs + slot) * row, src + ((b * H + h) * S + t) * row, <size_t>row)


def page_write(new, pages, tables, starts, block_size):
    """Scatter ``new`` [B, H, S, D] into pages (see the module docstring).

    new     C-contiguous [B, H, S, D] of any element type (the pages' type)
    pages   uint64 [P] page addresses (0 = no page)
    tables  int32 [B, M] logical block -> page id
    starts  [B] of any integer dtype: first position written per row, in
            [0, M * block_size - S] (checked in its own width)
    block_size int in [1, 2**31 - 1]
    Raises ValueError naming the argument (bad shapes, a written block past M,
    an entry outside [0, P) or a page address of 0) before writing anything.
    """
    V.array("pages", pages, (V.U64,), ndim=1)
    V.array("tables", tables, (V.I32,), ndim=2)
    if not isinstance(new, np.ndarray) or new.ndim != 4 or not new.flags.c_contiguous:
        raise ValueError(f"new: expected a C-contiguous [B, H, S, D] array, got "
                         f"{getattr(new, 'shape', type(new).__name__)}")
    B, H, S, D = new.shape
    bs = V.positive_int("block_size", block_size)
    M = tables.shape[1]
    if tables.shape[0] != B:
        raise ValueError(f"tables: expected {B} rows, got shape {tables.shape}")
    if not isinstance(starts, np.ndarray) or starts.dtype.kind not in "iu" or starts.shape != (B,):
        got = f"{starts.dtype} {starts.shape}" if isinstance(starts, np.ndarray) else type(starts).__name__
        raise ValueError(f"starts: expected an integer array of shape ({B},), got {got}")
    if B and S:
        if starts.dtype != V.I64 and starts.dtype != V.I32:  # other widths: compared in their own first
            bad = V.outside(starts, 0, M * bs - S)
            if bad.any():
                _bad_start(starts, int(np.argmax(bad)), S, M, bs)
        st = np.ascontiguousarray(starts, dtype=np.int64)    # lossless: int32/int64, or checked above
        b, blk = _first_bad(pages, tables, st, S, bs)
        if b >= 0 and blk < 0:
            _bad_start(starts, b, S, M, bs)
        if b >= 0:
            raise ValueError(f"tables: row {b}, block {blk} is written but holds {int(tables[b, blk])} (expected a "
                             f"page id in [0, {pages.shape[0]}) with a nonzero address)")
    if not (B and S and H and D):
        return
    cdef const char[::1] src = new.reshape(-1).view(np.int8)
    cdef const uint64_t[::1] pg = pages
    cdef const int32_t[::1] tb = np.ascontiguousarray(tables).reshape(-1)
    cdef const int64_t[::1] sv = st
    cdef int64_t row = D * new.itemsize, b_ = B, h_ = H, s_ = S, m_ = M, bs_ = bs
    with nogil:
        _scatter(&src[0], &pg[0], &tb[0], &sv[0], b_, h_, s_, row, m_, bs_)


def _bad_start(starts, b, S, M, bs):
    raise ValueError(f"starts: row {b} = {int(starts[b])} does not fit {S} new tokens in {M} blocks of {bs} "
                     f"tokens (expected [0, {M * bs - S}])")


cdef tuple _first_bad(const uint64_t[::1] pages, const int32_t[:, ::1] tables, const int64_t[::1] starts,
                      int64_t S, int64_t bs):
    """``(row, -1)`` of the first row whose start does not fit ``S`` tokens in its blocks, else ``(row,
    block)`` of the first block written (rows, then blocks, in order) whose entry is not a page id in
    ``[0, P)`` with a nonzero address, else ``(-1, -1)``."""
    cdef int64_t b, blk, page, B = starts.shape[0], M = tables.shape[1], P = pages.shape[0]
    cdef int64_t hi = M * bs - S, row = -1, bad = -1
    with nogil:
        for b in range(B):
            if starts[b] < 0 or starts[b] > hi:
                row = b
                break
        if row < 0:
            for b in range(B):
                for blk in range(starts[b] // bs, (starts[b] + S - 1) // bs + 1):
                    page = tables[b, blk]
                    if page < 0 or page >= P or pages[page] == 0:
                        row, bad = b, blk
                        break
                if row >= 0:
                    break
    return row, bad
