"""Element-wise activations: sigmoid, silu, silu_mul, gelu_tanh_mul, add, erf, and the products of a
tensor with one value: mul_scalar, div_scalar, softcap (float32 / float64).

Arrays of any shape are accepted as long as they are C-contiguous and of equal
shape (the one value: a one-element array of their dtype); they are processed
as flat 1-D vectors.  The caller owns ``out``; it may be one of the inputs
(exact aliasing; not the one value), partial overlap is rejected.  Called
several times per layer per decode step with 1-D arrays, so valid 1-D
arguments are checked at C speed (``_act_fast``); any other call takes the
Python checks, which name the bad argument.
"""
from libc.stdint cimport int64_t
from cython.parallel cimport prange

from onnxkv._kernels._runtime cimport okv_settings, okv_settings_get
from onnxkv._kernels._ranges cimport _disjoint, _same_or_disjoint
from onnxkv._kernels._record cimport KIND_ACTIVATION, recorder, refuse
import numpy as np

from . import _validate as V

cdef extern from "simd.h" nogil:
    void okv_act_f32(int mode, const float *x, const float *up, float *out, int64_t n, int simd)
    void okv_act_f64(int mode, const double *x, const double *up, double *out, int64_t n)

cdef extern from "<math.h>" nogil:
    float erff(float x)
    double c_erf "erf"(double x)

ctypedef fused real:
    float
    double

DEF CHUNK = 16384


DEF ADD = 3   # the mode of ``add``: out = x + up, element by element (IEEE sums, as NumPy's)
DEF GELU_TANH_MUL = 4   # the mode of ``gelu_tanh_mul``: out = gelu's tanh form of x, times up
# Modes whose ``up`` is one value (a one-element array), read by every element:
DEF MUL_SCALAR = 5   # out = x * up[0] (IEEE products, as NumPy's)
DEF DIV_SCALAR = 6   # out = x / up[0] (IEEE quotients, as NumPy's)
DEF SOFTCAP = 7   # out = up[0] * tanh(x / up[0])


cdef inline bint _scalar_up(int mode) noexcept nogil:
    """Whether ``up`` of activation ``mode`` is one value (modes 5-7) rather than a vector of x's length."""
    return mode >= MUL_SCALAR


cdef inline const real *_up_at(int mode, const real *up, Py_ssize_t i0) noexcept nogil:
    """``up`` where the chunk starting at element ``i0`` reads it (NULL for modes 0 and 1)."""
    if mode < 2:
        return NULL
    return up if _scalar_up(mode) else up + i0


cdef inline void _add_run(const real *x, const real *up, real *out, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        out[i] = x[i] + up[i]


cdef inline void _chunk(int mode, const real *x, const real *up, real *out, Py_ssize_t n, int simd) noexcept nogil:
    """One chunk of activation ``mode`` (``up`` NULL for modes 0 and 1)."""
    cdef Py_ssize_t i
    cdef real c
    if mode == ADD:
        _add_run(x, up, out, n)
    elif mode == MUL_SCALAR:
        c = up[0]
        for i in range(n):
            out[i] = x[i] * c
    elif mode == DIV_SCALAR:
        c = up[0]
        for i in range(n):
            out[i] = x[i] / c
    elif real is float:
        okv_act_f32(mode, x, up, out, n, simd)
    else:
        okv_act_f64(mode, x, up, out, n)


cdef void act_f32_ptr(int mode, const float *x, const float *up, float *out, int64_t n,
                      okv_settings s) noexcept nogil:
    """Activation ``mode`` (0 sigmoid, 1 silu, 2 silu_mul with ``up``, 3 add ``up``, 4 gelu_tanh_mul with
    ``up``, 5 times ``up[0]``, 6 divided by ``up[0]``, 7 softcap ``up[0]``) of n float32 values on checked,
    non-empty arguments (``up`` NULL for modes 0 and 1)."""
    cdef Py_ssize_t nchunks = (n + CHUNK - 1) // CHUNK, c, i0, m
    cdef int simd = s.simd
    cdef int nt = s.threads if nchunks > 1 else 1
    if nt == 1:   # no OpenMP region: entering one costs a decode-sized call more than its work
        _chunk(mode, x, up, out, n, simd)
        return
    for c in prange(nchunks, num_threads=nt, schedule='static'):
        i0 = c * CHUNK
        m = n - i0
        if m > CHUNK:
            m = CHUNK
        _chunk(mode, x + i0, _up_at(mode, up, i0), out + i0, m, simd)


cdef void _act(int mode, const real[::1] x, const real[::1] up, real[::1] out, okv_settings s) noexcept nogil:
    cdef Py_ssize_t n = x.shape[0], nchunks = (n + CHUNK - 1) // CHUNK, c, i0, m
    cdef int nt = s.threads if nchunks > 1 else 1
    if real is float:
        act_f32_ptr(mode, &x[0], &up[0] if mode >= 2 else NULL, &out[0], n, s)
        return
    for c in prange(nchunks, num_threads=nt, schedule='static'):
        i0 = c * CHUNK
        m = n - i0
        if m > CHUNK:
            m = CHUNK
        _chunk(mode, &x[i0], _up_at(mode, &up[0], i0), &out[i0], m, 0)


cdef void _note_act(int mode, x, up, out):
    """Note an activation that ran on float32 (for a recording thread: _record.pyx); refuse float64."""
    rec = recorder()
    if rec is not None:
        if x.dtype == V.F32:
            rec.note(KIND_ACTIVATION, (x, up if mode >= 2 else None, out), (mode, x.size), ())
        else:
            rec.refused.append("activation: float64 is not replayed")


cdef bint _act_fast(real tag, int mode, x, up, out) except -1:
    """Run activation ``mode`` when x, up (or None) and out are valid non-empty
    1-D arrays, all checked at C speed (ndarrays whose typed buffers of dtype
    ``real`` accept them -- dtype, native byte order, C-contiguity, a writeable
    ``out`` --, lengths, address ranges: the conditions of the Python checks);
    return False, with nothing written, to send the call through those checks.
    ``tag`` only selects the dtype."""
    cdef const real[::1] xv, uv
    cdef real[::1] ov
    if not (isinstance(x, np.ndarray) and isinstance(out, np.ndarray)
            and (up is None or isinstance(up, np.ndarray))):
        return False
    try:
        xv = x
        uv = x if up is None else up
        ov = out
    except (ValueError, TypeError, BufferError):
        return False
    cdef Py_ssize_t n = xv.shape[0]
    if n == 0 or uv.shape[0] != (1 if _scalar_up(mode) else n) or ov.shape[0] != n:
        return False
    cdef size_t nb = <size_t>n * sizeof(real)
    if not _same_or_disjoint(&ov[0], &xv[0], nb):
        return False
    if not (_disjoint(&ov[0], nb, &uv[0], sizeof(real)) if _scalar_up(mode) else _same_or_disjoint(&ov[0], &uv[0], nb)):
        return False
    _act(mode, xv, uv, ov, okv_settings_get())
    return True


def _run(int mode, x, up, out):
    if isinstance(x, np.ndarray):
        if x.dtype is V.F32 and _act_fast(<float>0, mode, x, up, out) \
                or x.dtype is V.F64 and _act_fast(<double>0, mode, x, up, out):
            _note_act(mode, x, up, out)
            return
    V.array("gate" if mode in (2, GELU_TANH_MUL) else "x", x, (V.F32, V.F64))
    xname = "gate" if mode in (2, GELU_TANH_MUL) else "x"
    upname = "y" if mode == ADD else "c" if _scalar_up(mode) else "up"
    if _scalar_up(mode):
        V.array("c", up, (x.dtype,))
        if up.size != 1:
            raise ValueError(f"c: must hold one value, got shape {up.shape}")
    elif up is not None:
        V.array(upname, up, (x.dtype,), shape=x.shape)
    V.array("out", out, (x.dtype,), shape=x.shape, writeable=True)
    V.no_overlap("out", out, x, xname, allow_identical=True)
    V.no_overlap("out", out, up, upname, allow_identical=not _scalar_up(mode))
    if x.size == 0:
        refuse("activation: an empty input (nothing written)")
        return
    xf = x.reshape(-1)
    of = out.reshape(-1)
    uf = up.reshape(-1) if up is not None else xf
    if x.dtype == V.F32:
        _act[float](mode, xf, uf, of, okv_settings_get())
    else:
        _act[double](mode, xf, uf, of, okv_settings_get())
    _note_act(mode, x, up, out)


def sigmoid(x, out):
    """out = 1 / (1 + exp(-x)).  x, out: same shape, float32 or float64, C-contiguous."""
    _run(0, x, None, out)


def silu(x, out):
    """out = x * sigmoid(x).  x, out: same shape, float32 or float64, C-contiguous."""
    _run(1, x, None, out)


def add(x, y, out):
    """out = x + y, element by element (each sum rounded once, as NumPy's ``add``).  x, y, out: same shape
    and dtype (float32 or float64), C-contiguous, processed flat; out may be x or y."""
    _run(ADD, x, y, out)


def gelu_tanh_mul(gate, up, out):
    """out = gelu_tanh(gate) * up (Gemma's GeGLU): gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715
    g^3))), computed as g * sigmoid(2 sqrt(2 / pi) (g + 0.044715 g^3)).  gate, up, out: same shape and dtype
    (float32 or float64), C-contiguous, processed flat; out may be gate or up."""
    _run(GELU_TANH_MUL, gate, up, out)


def mul_scalar(x, c, out):
    """out = x * c, element by element (each product rounded once, as NumPy's ``multiply``).  x, out: same shape
    and dtype (float32 or float64), C-contiguous, processed flat; out may be x.  c: a one-element array of
    x's dtype, not inside out."""
    _run(MUL_SCALAR, x, c, out)


def div_scalar(x, c, out):
    """out = x / c, element by element (each quotient rounded once, as NumPy's ``divide``).  Arguments as
    :func:`mul_scalar`'s."""
    _run(DIV_SCALAR, x, c, out)


def softcap(x, c, out):
    """out = c * tanh(x / c) (Gemma 2's logit cap), the quotient and product rounded as NumPy's.  The tanh is
    the C library's on the scalar path; the AVX2 path's is a polynomial below |x / c| = 0.5 and
    ``1 - 2 / (exp(2 |x / c|) + 1)`` above it, within a few float32 ulps of it.  Arguments as
    :func:`mul_scalar`'s."""
    _run(SOFTCAP, x, c, out)


def silu_mul(gate, up, out):
    """out = gate * sigmoid(gate) * up (SwiGLU).  gate, up, out: same shape and dtype
    (float32 or float64), C-contiguous, processed flat."""
    _run(2, gate, up, out)


cdef void _erf(const real[::1] x, real[::1] out, int nt) noexcept nogil:
    cdef Py_ssize_t n = x.shape[0], nchunks = (n + CHUNK - 1) // CHUNK, c, i, i1
    if nchunks < 2:
        nt = 1
    for c in prange(nchunks, num_threads=nt, schedule='static'):
        i1 = (c + 1) * CHUNK
        if i1 > n:
            i1 = n
        for i in range(c * CHUNK, i1):
            if real is float:
                out[i] = erff(x[i])
            else:
                out[i] = c_erf(x[i])


def erf(x, out):
    """out = erf(x), by the C library's erff / erf (within an ulp or two of the exact value).  x, out:
    same shape, float32 or float64, C-contiguous; out may be x itself (not a partial overlap)."""
    V.array("x", x, (V.F32, V.F64))
    V.array("out", out, (x.dtype,), shape=x.shape, writeable=True)
    V.no_overlap("out", out, x, "x", allow_identical=True)
    if x.size == 0:
        return
    cdef int nt = okv_settings_get().threads
    if x.dtype == V.F32:
        _erf[float](x.reshape(-1), out.reshape(-1), nt)
    else:
        _erf[double](x.reshape(-1), out.reshape(-1), nt)
