"""RMS normalisation kernels (float32 / float64, row-parallel).

Ownership: the caller allocates every array; kernels only write ``out`` (and
``sum_out``).  All arguments are checked before anything is written.
Both entry points run about twice per layer per decode step, so valid
arguments are checked at C speed (``_rms_fast`` / ``_skip_rms_fast``); only a
call those checks refuse takes the Python checks, which name the bad argument.
"""
from libc.stdint cimport int64_t
from cython.parallel cimport prange

from onnxkv._kernels._runtime cimport okv_settings, okv_settings_get
from onnxkv._kernels._ranges cimport _disjoint, _same_or_disjoint
from onnxkv._kernels._record cimport KIND_RMS_NORM, KIND_SKIP_RMS_NORM, recorder, refuse
import numpy as np

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


cdef inline int _nt(Py_ssize_t work, int threads) noexcept nogil:
    return threads if work >= PAR_MIN else 1


cdef void rms_f32_ptr(const float *x, const float *g, float eps, float *out, int64_t rows, int64_t n,
                      okv_settings s) noexcept nogil:
    """``rms_norm`` of float32 rows on checked, non-empty arguments (x, out [rows, n]; g [n])."""
    cdef Py_ssize_t r
    cdef int simd = s.simd, nt = _nt(rows * n, s.threads)
    if nt == 1:   # no OpenMP region: entering one costs a decode-sized call more than its work
        for r in range(rows):
            okv_rms_row_f32(x + r * n, g, eps, out + r * n, n, simd)
        return
    for r in prange(rows, num_threads=nt, schedule='static'):
        okv_rms_row_f32(x + r * n, g, eps, out + r * n, n, simd)


cdef void skip_rms_f32_ptr(const float *x, const float *skip, const float *bias, const float *g, float eps,
                           float *out, float *sum_out, int64_t rows, int64_t n, okv_settings s) noexcept nogil:
    """``skip_rms_norm`` of float32 rows on checked, non-empty arguments (bias, sum_out may be NULL)."""
    cdef Py_ssize_t r
    cdef int simd = s.simd, nt = _nt(rows * n, s.threads)
    if nt == 1:   # no OpenMP region (as rms_f32_ptr)
        for r in range(rows):
            okv_skip_rms_row_f32(x + r * n, skip + r * n, bias, g, eps, out + r * n,
                                 sum_out + r * n if sum_out != NULL else NULL, n, simd)
        return
    for r in prange(rows, num_threads=nt, schedule='static'):
        okv_skip_rms_row_f32(x + r * n, skip + r * n, bias, g, eps, out + r * n,
                             sum_out + r * n if sum_out != NULL else NULL, n, simd)


cdef void _rms(const real[:, ::1] x, const real[::1] g, double eps, real[:, ::1] out, okv_settings s) noexcept nogil:
    cdef Py_ssize_t r, rows = x.shape[0], n = x.shape[1]
    if real is float:
        rms_f32_ptr(&x[0, 0], &g[0], <float>eps, &out[0, 0], rows, n, s)
    else:
        for r in prange(rows, num_threads=_nt(rows * n, s.threads), schedule='static'):
            okv_rms_row_f64(&x[r, 0], &g[0], eps, &out[r, 0], n)


cdef void _skip_rms(const real[:, ::1] x, const real[:, ::1] skip, const real[::1] g, const real[::1] bias,
                    bint has_bias, double eps, real[:, ::1] out, real[:, ::1] sum_out,
                    bint has_sum, okv_settings s) noexcept nogil:
    cdef Py_ssize_t r, rows = x.shape[0], n = x.shape[1]
    cdef const real *bp = &bias[0] if has_bias else NULL
    if real is float:
        skip_rms_f32_ptr(&x[0, 0], &skip[0, 0], bp, &g[0], <float>eps, &out[0, 0],
                         &sum_out[0, 0] if has_sum else NULL, rows, n, s)
    else:
        for r in prange(rows, num_threads=_nt(rows * n, s.threads), schedule='static'):
            okv_skip_rms_row_f64(&x[r, 0], &skip[r, 0], bp, &g[0], eps, &out[r, 0],
                                 &sum_out[r, 0] if has_sum else NULL, n)


cdef void _note_rms(x, gamma, eps, out):
    """Note an rms_norm that ran on float32 (for a recording thread: _record.pyx); refuse float64."""
    rec = recorder()
    if rec is not None:
        if x.dtype == V.F32:
            rec.note(KIND_RMS_NORM, (x, gamma, out), (x.shape[0], x.shape[1]), (float(eps),))
        else:
            rec.refused.append("rms_norm: float64 is not replayed")


cdef void _note_skip_rms(x, skip, gamma, bias, eps, out, sum_out):
    """Note a skip_rms_norm that ran on float32 (for a recording thread); refuse float64."""
    rec = recorder()
    if rec is not None:
        if x.dtype == V.F32:
            rec.note(KIND_SKIP_RMS_NORM, (x, skip, gamma, bias, out, sum_out), (x.shape[0], x.shape[1]),
                     (float(eps),))
        else:
            rec.refused.append("skip_rms_norm: float64 is not replayed")


cdef bint _rms_fast(real tag, x, gamma, eps, out) except -1:
    """Run ``rms_norm`` when every argument is valid and x is not empty, all checked
    at C speed (ndarrays whose typed buffers of dtype ``real`` accept them -- dtype,
    native byte order, dimensions, C-contiguity, a writeable ``out`` --, shapes,
    address ranges, a float ``eps`` >= 0: the conditions of the Python checks);
    return False, with nothing written, to send the call through those checks.
    ``tag`` only selects the dtype."""
    cdef const real[:, ::1] xv
    cdef const real[::1] gv
    cdef real[:, ::1] ov
    if not (isinstance(x, np.ndarray) and isinstance(gamma, np.ndarray) and isinstance(out, np.ndarray)
            and isinstance(eps, float) and <double>eps >= 0.0):
        return False
    try:
        xv = x
        gv = gamma
        ov = out
    except (ValueError, TypeError, BufferError):
        return False
    cdef Py_ssize_t rows = xv.shape[0], n = xv.shape[1]
    if rows == 0 or n == 0 or gv.shape[0] != n or ov.shape[0] != rows or ov.shape[1] != n:
        return False
    cdef size_t nb = <size_t>(rows * n) * sizeof(real)
    if not (_same_or_disjoint(&ov[0, 0], &xv[0, 0], nb)
            and _disjoint(&ov[0, 0], nb, &gv[0], <size_t>n * sizeof(real))):
        return False
    _rms(xv, gv, <double>eps, ov, okv_settings_get())
    return True


cdef bint _skip_rms_fast(real tag, x, skip, gamma, bias, eps, out, sum_out) except -1:
    """Run ``skip_rms_norm`` when every argument is valid and x is not empty, all
    checked at C speed like ``_rms_fast`` (including every overlap rule of the
    Python checks); return False, with nothing written, to send the call through
    those checks.  ``tag`` only selects the dtype."""
    cdef const real[:, ::1] xv, kv
    cdef const real[::1] gv, bv
    cdef real[:, ::1] ov, sv
    cdef bint has_bias = bias is not None, has_sum = sum_out is not None
    if not (isinstance(x, np.ndarray) and isinstance(skip, np.ndarray) and isinstance(gamma, np.ndarray)
            and isinstance(out, np.ndarray) and (not has_bias or isinstance(bias, np.ndarray))
            and (not has_sum or isinstance(sum_out, np.ndarray)) and isinstance(eps, float)
            and <double>eps >= 0.0):
        return False
    try:
        xv = x
        kv = skip
        gv = gamma
        ov = out
        bv = bias if has_bias else gamma
        sv = sum_out if has_sum else out
    except (ValueError, TypeError, BufferError):
        return False
    cdef Py_ssize_t rows = xv.shape[0], n = xv.shape[1]
    if rows == 0 or n == 0 or gv.shape[0] != n or bv.shape[0] != n:
        return False
    if kv.shape[0] != rows or kv.shape[1] != n or ov.shape[0] != rows or ov.shape[1] != n \
            or sv.shape[0] != rows or sv.shape[1] != n:
        return False
    cdef size_t nb = <size_t>(rows * n) * sizeof(real), vb = <size_t>n * sizeof(real)
    cdef const void *o = &ov[0, 0]
    cdef const void *sp = &sv[0, 0]
    if not (_same_or_disjoint(o, &xv[0, 0], nb) and _same_or_disjoint(o, &kv[0, 0], nb)
            and _disjoint(o, nb, &gv[0], vb) and _disjoint(o, nb, &bv[0], vb)):
        return False
    if has_sum and not (_disjoint(sp, nb, o, nb) and _same_or_disjoint(sp, &xv[0, 0], nb)
                        and _same_or_disjoint(sp, &kv[0, 0], nb) and _disjoint(sp, nb, &gv[0], vb)
                        and _disjoint(sp, nb, &bv[0], vb)):
        return False
    _skip_rms(xv, kv, gv, bv, has_bias, <double>eps, ov, sv, has_sum, okv_settings_get())
    return True


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
    if isinstance(x, np.ndarray):
        if x.dtype is V.F32 and _rms_fast(<float>0, x, gamma, eps, out) \
                or x.dtype is V.F64 and _rms_fast(<double>0, x, gamma, eps, out):
            _note_rms(x, gamma, eps, out)
            return
    V.array("x", x, (V.F32, V.F64), ndim=2)
    V.array("gamma", gamma, (x.dtype,), ndim=1, shape=(x.shape[1],))
    V.array("out", out, (x.dtype,), shape=x.shape, writeable=True)
    V.no_overlap("out", out, x, "x", allow_identical=True)
    V.no_overlap("out", out, gamma, "gamma")
    eps = _check_eps(eps)
    if x.size == 0:
        refuse("rms_norm: an empty input (nothing written)")
        return
    if x.dtype == V.F32:
        _rms[float](x, gamma, eps, out, okv_settings_get())
    else:
        _rms[double](x, gamma, eps, out, okv_settings_get())
    _note_rms(x, gamma, eps, out)


def skip_rms_norm(x, skip, gamma, bias, eps, out, sum_out):
    """s = x + skip (+ bias); sum_out[...] = s (if not None); out = rms_norm(s, gamma, eps).

    Same as com.microsoft.SkipSimplifiedLayerNormalization.  x, skip, out and
    sum_out: [rows, n]; gamma and bias (or None): [n]; one dtype (float32 or
    float64), C-contiguous.  ``out`` may be ``x`` or ``skip`` (exactly);
    ``sum_out`` may be ``x`` or ``skip`` but must not overlap ``out``.  Returns
    None.  Raises ValueError (naming the argument) before writing anything when
    a check fails.
    """
    if isinstance(x, np.ndarray):
        if x.dtype is V.F32 and _skip_rms_fast(<float>0, x, skip, gamma, bias, eps, out, sum_out) \
                or x.dtype is V.F64 and _skip_rms_fast(<double>0, x, skip, gamma, bias, eps, out, sum_out):
            _note_skip_rms(x, skip, gamma, bias, eps, out, sum_out)
            return
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
        refuse("skip_rms_norm: an empty input (nothing written)")
        return
    has_bias = bias is not None
    has_sum = sum_out is not None
    if x.dtype == V.F32:
        _skip_rms[float](x, skip, gamma, bias if has_bias else gamma, has_bias, eps, out,
                         sum_out if has_sum else out, has_sum, okv_settings_get())
    else:
        _skip_rms[double](x, skip, gamma, bias if has_bias else gamma, has_bias, eps, out,
                          sum_out if has_sum else out, has_sum, okv_settings_get())
    _note_skip_rms(x, skip, gamma, bias, eps, out, sum_out)
