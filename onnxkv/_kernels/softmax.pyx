"""Row softmax (float32 / float64).

Numerically stable (subtracts the row max).  ``-inf`` entries give 0; a row
that is entirely ``-inf`` gives ``empty_row`` everywhere: 0 by default, NaN as
ONNX's Softmax gives it (the reference twin in ``reference.py`` implements the
same rule).  NaN / +inf inputs are not supported (results unspecified).
"""
from libc.stdint cimport int64_t
from cython.parallel cimport prange

from onnxkv._kernels._runtime cimport okv_settings, okv_settings_get
from . import _validate as V

cdef extern from "simd.h" nogil:
    void okv_softmax_row_f32(const float *x, float *out, int64_t n, float dead, int simd)
    void okv_softmax_row_f64(const double *x, double *out, int64_t n, double dead)

ctypedef fused real:
    float
    double

DEF PAR_MIN = 16384


cdef void _softmax(const real[:, ::1] x, real[:, ::1] out, double dead, okv_settings s) noexcept nogil:
    cdef Py_ssize_t r, rows = x.shape[0], n = x.shape[1]
    cdef int simd = s.simd
    cdef int nt = s.threads if rows * n >= PAR_MIN and rows > 1 else 1
    for r in prange(rows, num_threads=nt, schedule='static'):
        if real is float:
            okv_softmax_row_f32(&x[r, 0], &out[r, 0], n, <float>dead, simd)
        else:
            okv_softmax_row_f64(&x[r, 0], &out[r, 0], n, dead)


def softmax(x, out, empty_row=0.0):
    """out[r] = exp(x[r] - max(x[r])) / sum(...), over the last axis.

    x, out: [rows, n] float32 or float64, C-contiguous, same dtype; ``out`` may be
    ``x`` (in place).  A row of all -inf gives ``empty_row`` (a float: 0.0, or
    NaN as ONNX's Softmax) in every entry.
    """
    cdef double dead = float(empty_row)
    V.array("x", x, (V.F32, V.F64), ndim=2)
    V.array("out", out, (x.dtype,), shape=x.shape, writeable=True)
    V.no_overlap("out", out, x, "x", allow_identical=True)
    if x.size == 0:
        return
    if x.dtype == V.F32:
        _softmax[float](x, out, dead, okv_settings_get())
    else:
        _softmax[double](x, out, dead, okv_settings_get())
