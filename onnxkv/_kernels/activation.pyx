"""Element-wise activations: sigmoid, silu, silu_mul (float32 / float64).

Arrays of any shape are accepted as long as they are C-contiguous and of equal
shape; they are processed as flat 1-D vectors.  The caller owns ``out``; it may
be one of the inputs (exact aliasing), partial overlap is rejected.
"""
from libc.stdint cimport int64_t
from cython.parallel cimport prange

from onnxkv._kernels._runtime cimport okv_threads, okv_simd
from . import _validate as V

cdef extern from "simd.h" nogil:
    void okv_act_f32(int mode, const float *x, const float *up, float *out, int64_t n, int simd)
    void okv_act_f64(int mode, const double *x, const double *up, double *out, int64_t n)

ctypedef fused real:
    float
    double

DEF CHUNK = 16384


cdef void _act(int mode, const real[::1] x, const real[::1] up, real[::1] out) noexcept nogil:
    cdef Py_ssize_t n = x.shape[0], nchunks = (n + CHUNK - 1) // CHUNK, c, i0, m
    cdef int simd = okv_simd()
    cdef int nt = okv_threads() if nchunks > 1 else 1
    for c in prange(nchunks, num_threads=nt, schedule='static'):
        i0 = c * CHUNK
        m = n - i0
        if m > CHUNK:
            m = CHUNK
        if real is float:
            okv_act_f32(mode, &x[i0], &up[i0] if mode == 2 else NULL, &out[i0], m, simd)
        else:
            okv_act_f64(mode, &x[i0], &up[i0] if mode == 2 else NULL, &out[i0], m)


def _run(int mode, x, up, out):
    V.array("gate" if mode == 2 else "x", x, (V.F32, V.F64))
    xname = "gate" if mode == 2 else "x"
    if up is not None:
        V.array("up", up, (x.dtype,), shape=x.shape)
    V.array("out", out, (x.dtype,), shape=x.shape, writeable=True)
    V.no_overlap("out", out, x, xname, allow_identical=True)
    V.no_overlap("out", out, up, "up", allow_identical=True)
    if x.size == 0:
        return
    xf = x.reshape(-1)
    of = out.reshape(-1)
    uf = up.reshape(-1) if up is not None else xf
    if x.dtype == V.F32:
        _act[float](mode, xf, uf, of)
    else:
        _act[double](mode, xf, uf, of)


def sigmoid(x, out):
    """out = 1 / (1 + exp(-x)).  x, out: same shape, float32 or float64, C-contiguous."""
    _run(0, x, None, out)


def silu(x, out):
    """out = x * sigmoid(x).  x, out: same shape, float32 or float64, C-contiguous."""
    _run(1, x, None, out)


def silu_mul(gate, up, out):
    """out = gate * sigmoid(gate) * up (SwiGLU).  gate, up, out: same shape and dtype
    (float32 or float64), C-contiguous, processed flat."""
    _run(2, gate, up, out)
