"""RMS normalisation kernels (float32 / float64, row-parallel).

Ownership: the caller allocates every array; kernels only write ``out`` (and
``sum_out``).  All arguments are checked before anything is written.
"""
from libc.stdint cimport int64_t
from cython.parallel cimport prange

from onnxkv._kernels._runtime cimport okv_threads, okv_simd
from . import _validate as V

cdef extern from "simd.h" nogil:
    void okv_rms_row_f32(const float *x, const float *g, float eps, float *out, int64_t n, int simd)
    void okv_rms_row_f64(const double *x, const double *g, double eps, double *out, int64_t n)
    void okv_skip_rms_row_f32(const float *x, const float *skip, const float *bias, const float *g, float eps,
                              float *out, float *sum_out, int64_t n, int simd)
    void okv_skip_rms_row_f64(const double *x, const double *skip, const double *bias, const double *g,
                              double eps, double *out, double *sum_out, int64_t n)

ctypedef fused real:
    float
    double

DEF PAR_MIN = 16384  # elements below which a call runs on one thread


cdef inline int _nt(Py_ssize_t work) noexcept nogil:
    return okv_threads() if work >= PAR_MIN else 1


cdef void _rms(const real[:, ::1] x, const real[::1] g, double eps, real[:, ::1] out) noexcept nogil:
    cdef Py_ssize_t r, rows = x.shape[0], n = x.shape[1]
    cdef int simd = okv_simd()
    for r in prange(rows, num_threads=_nt(rows * n), schedule='static'):
        if real is float:
            okv_rms_row_f32(&x[r, 0], &g[0], <float>eps, &out[r, 0], n, simd)
        else:
            okv_rms_row_f64(&x[r, 0], &g[0], eps, &out[r, 0], n)


cdef void _skip_rms(const real[:, ::1] x, const real[:, ::1] skip, const real[::1] g, const real[::1] bias,
                    bint has_bias, double eps, real[:, ::1] out, real[:, ::1] sum_out,
                    bint has_sum) noexcept nogil:
    cdef Py_ssize_t r, rows = x.shape[0], n = x.shape[1]
    cdef int simd = okv_simd()
    cdef const real *bp = &bias[0] if has_bias else NULL
    for r in prange(rows, num_threads=_nt(rows * n), schedule='static'):
        if real is float:
            okv_skip_rms_row_f32(&x[r, 0], &skip[r, 0], bp, &g[0], <float>eps, &out[r, 0],
                                 &sum_out[r, 0] if has_sum else NULL, n, simd)
        else:
            okv_skip_rms_row_f64(&x[r, 0], &skip[r, 0], bp, &g[0], eps, &out[r, 0],
                                 &sum_out[r, 0] if has_sum else NULL, n)


def _check_eps(eps):
    eps = float(eps)
    if not eps >= 0.0:
        raise ValueError(f"eps: must be >= 0, got {eps}")
    return eps


def rms_norm(x, gamma, eps, out):
    """out = x / sqrt(mean(x**2, axis=-1) + eps) * gamma.

    x, out: [rows, n] float32 or float64, C-contiguous; gamma: [n], same dtype.
    ``out`` is written by the kernel and may be ``x`` itself (in place); any other
    overlap is rejected.  Returns None.  Raises ValueError (naming the argument)
    before writing anything when a check fails.
    """
    V.array("x", x, (V.F32, V.F64), ndim=2)
    V.array("gamma", gamma, (x.dtype,), ndim=1, shape=(x.shape[1],))
    V.array("out", out, (x.dtype,), shape=x.shape, writeable=True)
    V.no_overlap("out", out, x, "x", allow_identical=True)
    V.no_overlap("out", out, gamma, "gamma")
    eps = _check_eps(eps)
    if x.size == 0:
        return
    if x.dtype == V.F32:
        _rms[float](x, gamma, eps, out)
    else:
        _rms[double](x, gamma, eps, out)


def skip_rms_norm(x, skip, gamma, bias, eps, out, sum_out):
    """s = x + skip (+ bias); sum_out[...] = s (if not None); out = rms_norm(s, gamma, eps).

    Same as com.microsoft.SkipSimplifiedLayerNormalization.  x, skip, out and
    sum_out: [rows, n]; gamma and bias (or None): [n]; one dtype (float32 or
    float64), C-contiguous.  ``out`` may be ``x`` or ``skip`` (exactly);
    ``sum_out`` may be ``x`` or ``skip`` but must not overlap ``out``.
    """
    V.array("x", x, (V.F32, V.F64), ndim=2)
    V.array("skip", skip, (x.dtype,), shape=x.shape)
    V.array("gamma", gamma, (x.dtype,), ndim=1, shape=(x.shape[1],))
    if bias is not None:
        V.array("bias", bias, (x.dtype,), ndim=1, shape=(x.shape[1],))
    V.array("out", out, (x.dtype,), shape=x.shape, writeable=True)
    if sum_out is not None:
        V.array("sum_out", sum_out, (x.dtype,), shape=x.shape, writeable=True)
        V.no_overlap("sum_out", sum_out, out, "out")
        V.no_overlap("sum_out", sum_out, x, "x", allow_identical=True)
        V.no_overlap("sum_out", sum_out, skip, "skip", allow_identical=True)
        V.no_overlap("sum_out", sum_out, gamma, "gamma")
        V.no_overlap("sum_out", sum_out, bias, "bias")
    V.no_overlap("out", out, x, "x", allow_identical=True)
    V.no_overlap("out", out, skip, "skip", allow_identical=True)
    V.no_overlap("out", out, gamma, "gamma")
    V.no_overlap("out", out, bias, "bias")
    eps = _check_eps(eps)
    if x.size == 0:
        return
    has_bias = bias is not None
    has_sum = sum_out is not None
    if x.dtype == V.F32:
        _skip_rms[float](x, skip, gamma, bias if has_bias else gamma, has_bias, eps, out,
                         sum_out if has_sum else out, has_sum)
    else:
        _skip_rms[double](x, skip, gamma, bias if has_bias else gamma, has_bias, eps, out,
                          sum_out if has_sum else out, has_sum)
