"""Attention masks built from their formula: the causal (windowed, padded) mask an export computes.

``causal_mask`` writes ``out[r, 0, q, k]`` = ``visible`` when key ``k`` is
visible to query ``q`` of batch row ``r`` -- ``k <= q0 + q``, and ``k > q0 + q -
window`` when ``window > 0``, and ``mask[r, k] != 0`` when a padding mask is
given -- else ``hidden``: the value :class:`onnxkv.plan.ops.export_mask.ExportMask`
was proved to compute, in one pass instead of a few NumPy calls per run.  The
values are copies (float32) or 1 / 0 (bool), never computed.
"""
from libc.stdint cimport int64_t, uint8_t

from onnxkv._kernels._ranges cimport _disjoint

import numpy as np

from . import _validate as V


ctypedef fused cell:
    float
    uint8_t


cdef void _fill(const int64_t *mask, int64_t cols, int64_t rows, int64_t nq, int64_t nk, int64_t q0,
                int64_t window, cell visible, cell hidden, cell *out) noexcept nogil:
    cdef int64_t r, q, k, hi, lo
    cdef cell *row
    for r in range(rows):
        for q in range(nq):
            row = out + (r * nq + q) * nk
            hi = q0 + q
            lo = hi - window if window > 0 else -1
            for k in range(nk):
                row[k] = visible if (k <= hi and k > lo and (mask == NULL or mask[r * cols + k] != 0)) else hidden


cdef bint _fast(mask, rows, nq, nk, q0, window, out, double visible, double hidden) except -1:
    """Write the mask when every argument is valid, checked at C speed (the conditions of the Python checks:
    ints in range, typed buffers of the right dtype, C order and shape, a writeable ``out`` apart from
    ``mask``); return False, with nothing written, to send the call through the Python checks (which name
    the bad argument).  Called once per decode step of an export."""
    if not (type(out) is np.ndarray and (mask is None or type(mask) is np.ndarray)):
        return False
    if not all(type(v) is int for v in (rows, nq, nk, q0, window)):
        return False
    if not (0 <= rows <= 2**62 and 0 <= nq <= 2**62 and 0 <= nk <= 2**62 and 0 <= window <= 2**62
            and -2**62 <= q0 <= 2**62):
        return False
    cdef const int64_t[:, ::1] mv
    cdef float[:, :, :, ::1] of
    cdef uint8_t[:, :, :, ::1] ob
    cdef bint f32 = out.dtype is V.F32
    try:
        if f32:
            of = out
        elif out.dtype == np.bool_:
            ob = out.view(np.uint8)
        else:
            return False
        if mask is not None:
            mv = mask
    except (ValueError, TypeError, BufferError):
        return False
    cdef int64_t r = rows, a = nq, b = nk, z = q0, w = window, cols = 0
    cdef Py_ssize_t[4] shape
    if f32:
        shape[0], shape[1], shape[2], shape[3] = of.shape[0], of.shape[1], of.shape[2], of.shape[3]
    else:
        shape[0], shape[1], shape[2], shape[3] = ob.shape[0], ob.shape[1], ob.shape[2], ob.shape[3]
    if shape[0] != r or shape[1] != 1 or shape[2] != a or shape[3] != b or r * a * b == 0:
        return False
    cdef const int64_t *mp = NULL
    cdef void *op = <void *>&of[0, 0, 0, 0] if f32 else <void *>&ob[0, 0, 0, 0]
    if mask is not None:
        if mv.shape[0] < r or mv.shape[1] < b or mv.shape[1] == 0:
            return False
        cols = mv.shape[1]
        mp = &mv[0, 0]
        if not _disjoint(op, <size_t>(r * a * b * (4 if f32 else 1)), mp, <size_t>(mv.shape[0] * cols * 8)):
            return False
    cdef float fv = visible, fh = hidden
    cdef uint8_t one = 1, zero = 0
    with nogil:
        if f32:
            _fill(mp, cols, r, a, b, z, w, fv, fh, <float *>op)
        else:
            _fill(mp, cols, r, a, b, z, w, one, zero, <uint8_t *>op)
    return True


def causal_mask(mask, rows, nq, nk, q0, window, out, visible=0.0, hidden=0.0):
    """Write the causal mask (see the module docstring) into ``out``.

    mask: None, or a C-contiguous int64 [>= rows, >= nk] padding mask (its first ``nk`` columns are read).
    rows, nq, nk: >= 0; q0: any int64 (a query sees no key when ``q0 + q < 0``); window: >= 0 (0: none).
    out: C-contiguous, writeable, float32 (``visible`` / ``hidden`` stored as float32) or bool, of shape
    [rows, 1, nq, nk], not overlapping ``mask``.  Raises ValueError naming the bad argument.
    """
    if _fast(mask, rows, nq, nk, q0, window, out, visible, hidden):
        return
    for name, v in (("rows", rows), ("nq", nq), ("nk", nk), ("window", window)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0 or v > 2**62:
            raise ValueError(f"causal_mask: {name} = {v!r}; expected an int in [0, 2**62]")
    if not isinstance(q0, (int, np.integer)) or isinstance(q0, bool) or abs(q0) > 2**62:
        raise ValueError(f"causal_mask: q0 = {q0!r}; expected an int of magnitude <= 2**62")
    V.array("out", out, (V.F32, np.dtype(np.bool_)), shape=(rows, 1, nq, nk), writeable=True)
    cdef int64_t cols = 0
    if mask is not None:
        V.array("mask", mask, (np.dtype(np.int64),), ndim=2)
        if mask.shape[0] < rows or mask.shape[1] < nk:
            raise ValueError(f"mask: shape {mask.shape} holds fewer than {rows} rows of {nk} keys")
        V.no_overlap("out", out, mask, "mask")
        cols = mask.shape[1]
    if out.size == 0:
        return
    cdef const int64_t[:, ::1] mv
    cdef const int64_t *mp = NULL
    if mask is not None and mask.size:
        mv = mask
        mp = &mv[0, 0]
    cdef int64_t r = rows, a = nq, b = nk, z = q0, w = window
    cdef float fv = visible, fh = hidden
    cdef float[::1] of
    cdef uint8_t[::1] ob
    cdef uint8_t one = 1, zero = 0
    if out.dtype == V.F32:
        of = out.reshape(-1)
        with nogil:
            _fill(mp, cols, r, a, b, z, w, fv, fh, &of[0])
    else:
        ob = out.reshape(-1).view(np.uint8)
        with nogil:
            _fill(mp, cols, r, a, b, z, w, one, zero, &ob[0])
