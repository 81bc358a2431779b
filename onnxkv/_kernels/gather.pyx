"""Rows of a table picked by indices (ONNX Gather on axis 0 of a 2-D table, float32).

``gather_rows(table, indices, out)``: ``out[i] = table[indices[i]]`` for table
[N, D] float32, indices [m] int64 (negative counts from the end, as ONNX's
Gather: -N <= index < N) and out [m, D] float32, all C-contiguous; ``out``
must not overlap the others.  Every index is checked before the first row is
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
                             float *out) noexcept nogil:
    """The rows, after checking every index; returns -1 when all were in range, else the position of the
    first index out of range (nothing written)."""
    cdef int64_t i, v
    for i in range(m):
        v = indices[i]
        if v < -N or v >= N:
            return i
    for i in range(m):
        v = indices[i]
        if v < 0:
            v += N
        memcpy(out + i * D, table + v * D, <size_t>D * sizeof(float))
    return -1


def gather_rows(table, indices, out):
    """out[i] = table[indices[i]] (see the module docstring); raises ValueError naming the argument,
    or the first index out of range, before writing anything."""
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
        bad = gather_rows_ptr(&tv[0, 0], N, D, &iv[0], m, &ov[0, 0])
    if bad >= 0:
        raise ValueError(f"indices: indices[{bad}] = {int(indices[bad])} is out of range [{-N}, {N})")
    rec = recorder()
    if rec is not None:
        rec.note(KIND_GATHER_ROWS, (table, indices, out), (N, D, m), ())
