"""Rows of a table picked by indices (ONNX Gather on axis 0 of a 2-D table, float32).

``gather_rows(table, indices, out, wrap=True)``: ``out[i] = table[indices[i]]``
for table [N, D] float32, indices [m] int64 (with ``wrap``, negative counts from
the end, as ONNX's Gather: -N <= index < N; without, 0 <= index < N: a table
of positions, whose negative rows do not exist) and out [m, D] float32, all
C-contiguous; ``out`` must not overlap the others.  Every index is checked before the first row is
written.  Noted for compiled steps (``_record.pyx``): a replay checks the
indices of its run the same way and writes nothing when one is out of range.
"""
from libc.stdint cimport int64_t
from libc.string cimport memcpy

import numpy as np

from onnxkv._kernels._ranges cimport _disjoint
from onnxkv._kernels._record cimport KIND_GATHER_ROWS, recorder, refuse

from . import _validate as V


cdef int64_t gather_rows_ptr(const float *table, int64_t N, int64_t D, const int64_t *indices, int64_t m,
                             float *out, bint wrap) noexcept nogil:
    """The rows, after checking every index (in [-N, N) with ``wrap``, else in [0, N)); returns -1 when all
    were in range, else the position of the first index out of range (nothing written)."""
    cdef int64_t i, v, low = -N if wrap else 0
    for i in range(m):
        v = indices[i]
        if v < low or v >= N:
            return i
    for i in range(m):
        v = indices[i]
        if v < 0:
            v += N
        memcpy(out + i * D, table + v * D, <size_t>D * sizeof(float))
    return -1


cdef bint _gather_fast(table, indices, out, bint wrap) except -1:
    """Run ``gather_rows`` when every argument is valid (typed buffers, shapes, disjoint ranges, every
    index in range: the conditions of the Python checks) and there is a row to write, all checked at C
    speed; return False, with nothing written, to send the call through those checks."""
    cdef const float[:, ::1] tv
    cdef const int64_t[::1] iv
    cdef float[:, ::1] ov
    if not (isinstance(table, np.ndarray) and isinstance(indices, np.ndarray) and isinstance(out, np.ndarray)):
        return False
    try:
        tv = table
        iv = indices
        ov = out
    except (ValueError, TypeError, BufferError):
        return False
    cdef int64_t m = iv.shape[0], N = tv.shape[0], D = tv.shape[1]
    if m == 0 or D == 0 or ov.shape[0] != m or ov.shape[1] != D:
        return False
    cdef size_t onb = <size_t>(m * D) * sizeof(float)
    if not (_disjoint(&ov[0, 0], onb, &tv[0, 0], <size_t>(N * D) * sizeof(float))
            and _disjoint(&ov[0, 0], onb, &iv[0], <size_t>m * sizeof(int64_t))):
        return False
    cdef int64_t bad
    with nogil:
        bad = gather_rows_ptr(&tv[0, 0], N, D, &iv[0], m, &ov[0, 0], wrap)
    return bad < 0


def gather_rows(table, indices, out, bint wrap=True):
    """out[i] = table[indices[i]] (see the module docstring); raises ValueError naming the argument,
    or the first index out of range, before writing anything.  (Called once per decode step, so valid
    arguments are checked in C; only a failing check takes the Python checks.)"""
    if _gather_fast(table, indices, out, wrap):
        _note(table, indices, out, wrap)
        return
    V.array("table", table, (V.F32,), ndim=2)
    V.array("indices", indices, (np.dtype(np.int64),), ndim=1)
    V.array("out", out, (V.F32,), shape=(indices.shape[0], table.shape[1]), writeable=True)
    V.no_overlap("out", out, table, "table")
    V.no_overlap("out", out, indices, "indices")
    cdef int64_t m = indices.shape[0], N = table.shape[0], D = table.shape[1], bad
    if m == 0 or D == 0:
        refuse("gather_rows: nothing to write")
        return
    cdef const float[:, ::1] tv = table
    cdef const int64_t[::1] iv = indices
    cdef float[:, ::1] ov = out
    with nogil:
        bad = gather_rows_ptr(&tv[0, 0], N, D, &iv[0], m, &ov[0, 0], wrap)
    if bad >= 0:
        raise ValueError(f"indices: indices[{bad}] = {int(indices[bad])} is out of range [{-N if wrap else 0}, {N})")
    _note(table, indices, out, wrap)


cdef void _note(table, indices, out, bint wrap):
    """Note a gather that ran (for a recording thread: _record.pyx)."""
    rec = recorder()
    if rec is not None:
        rec.note(KIND_GATHER_ROWS, (table, indices, out),
                 (table.shape[0], table.shape[1], indices.shape[0], int(wrap)), ())
