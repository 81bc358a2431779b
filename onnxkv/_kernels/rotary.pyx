"""Rotary position embedding (float32).

x, out: [batch, seq, heads, head_size]; cos, sin: [max_pos, rotary_dim // 2];
positions: [batch, seq] int64.  The first rotary_dim = 2 * cos.shape[1] dims of
each head are rotated, the rest are copied.  ``out`` may be ``x`` (in place).
Called for q and k of every layer at each decode step, so valid arguments are
checked at C speed (``_rope_fast``); only a call those checks refuse takes the
Python checks, which name the bad argument.
"""
from libc.stdint cimport int64_t
from cython.parallel cimport prange

from onnxkv._kernels._runtime cimport okv_settings, okv_settings_get
from onnxkv._kernels._ranges cimport _disjoint
import numpy as np

from . import _validate as V

cdef extern from "simd.h" nogil:
    void okv_rope_row_f32(const float *x, const float *c, const float *s, float *out, int64_t half,
                          int64_t head_size, int interleaved, int simd)

DEF PAR_MIN = 16384


cdef void _rope(const float[:, :, :, ::1] x, const float[:, ::1] cos, const float[:, ::1] sin,
                const int64_t[:, ::1] pos, int interleaved, float[:, :, :, ::1] out, okv_settings st) noexcept nogil:
    cdef Py_ssize_t B = x.shape[0], S = x.shape[1], H = x.shape[2], D = x.shape[3]
    cdef Py_ssize_t half = cos.shape[1], rows = B * S * H, i, b, s, h
    cdef int64_t p
    cdef int simd = st.simd
    cdef int nt = st.threads if rows * D >= PAR_MIN else 1
    for i in prange(rows, num_threads=nt, schedule='static'):
        b = i // (S * H)
        s = (i // H) % S
        h = i % H
        p = pos[b, s]
        okv_rope_row_f32(&x[b, s, h, 0], &cos[p, 0], &sin[p, 0], &out[b, s, h, 0], half, D,
                         interleaved, simd)


cdef bint _rope_fast(x, cos, sin, positions, interleaved, out) except -1:
    """Run ``rotary_embedding`` when every argument is valid, x is not empty and
    cos has rows and columns, all checked at C speed (ndarrays whose typed
    buffers accept them -- dtype, native byte order, dimensions, C-contiguity, a
    writeable ``out`` --, shapes, address ranges, every position in
    [0, max_pos): the conditions of the Python checks); return False, with
    nothing written, to send the call through those checks."""
    cdef const float[:, :, :, ::1] xv
    cdef const float[:, ::1] cv, sv
    cdef const int64_t[:, ::1] pv
    cdef float[:, :, :, ::1] ov
    cdef Py_ssize_t d, b, s
    if not (isinstance(x, np.ndarray) and isinstance(cos, np.ndarray) and isinstance(sin, np.ndarray)
            and isinstance(positions, np.ndarray) and isinstance(out, np.ndarray)):
        return False
    try:
        xv = x
        cv = cos
        sv = sin
        pv = positions
        ov = out
    except (ValueError, TypeError, BufferError):
        return False
    cdef Py_ssize_t max_pos = cv.shape[0], half = cv.shape[1]
    if max_pos == 0 or half == 0 or sv.shape[0] != max_pos or sv.shape[1] != half \
            or pv.shape[0] != xv.shape[0] or pv.shape[1] != xv.shape[1] or 2 * half > xv.shape[3]:
        return False
    for d in range(4):
        if xv.shape[d] == 0 or ov.shape[d] != xv.shape[d]:
            return False
    for b in range(pv.shape[0]):
        for s in range(pv.shape[1]):
            if pv[b, s] < 0 or pv[b, s] >= max_pos:
                return False
    cdef size_t nb = <size_t>(xv.shape[0] * xv.shape[1] * xv.shape[2] * xv.shape[3]) * sizeof(float)
    cdef size_t tb = <size_t>(max_pos * half) * sizeof(float)
    cdef const void *o = &ov[0, 0, 0, 0]
    cdef const void *xp = &xv[0, 0, 0, 0]
    if not ((o == xp or _disjoint(o, nb, xp, nb)) and _disjoint(o, nb, &cv[0, 0], tb)
            and _disjoint(o, nb, &sv[0, 0], tb)):
        return False
    _rope(xv, cv, sv, pv, 1 if interleaved else 0, ov, okv_settings_get())
    return True


def rotary_embedding(x, cos, sin, positions, interleaved, out):
    """Apply rotary embedding; writes ``out`` only.

    Non-interleaved (GPT-NeoX / Llama halves): x1 = x[..., :r/2], x2 = x[..., r/2:r],
    out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin.  Interleaved: the pairs
    (x[2i], x[2i+1]) are rotated the same way.  cos/sin row = positions[b, s].
    Raises ValueError (before writing) for bad shapes/dtypes or a position outside
    [0, max_pos).
    """
    if _rope_fast(x, cos, sin, positions, interleaved, out):
        return
    V.array("x", x, (V.F32,), ndim=4)
    V.array("cos", cos, (V.F32,), ndim=2)
    V.array("sin", sin, (V.F32,), shape=cos.shape)
    V.array("positions", positions, (V.I64,), shape=x.shape[:2])
    V.array("out", out, (V.F32,), shape=x.shape, writeable=True)
    V.no_overlap("out", out, x, "x", allow_identical=True)
    V.no_overlap("out", out, cos, "cos")
    V.no_overlap("out", out, sin, "sin")
    half = cos.shape[1]
    if 2 * half > x.shape[3]:
        raise ValueError(f"cos: rotary_dim 2*{half} exceeds head_size {x.shape[3]}")
    if positions.size:
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos.shape[0]:
            raise ValueError(f"positions: values must be in [0, {cos.shape[0]}), got range [{lo}, {hi}]")
    if x.size == 0:
        return
    if cos.shape[0] == 0 or half == 0:
        if out is not x:
            out[...] = x
        return
    _rope(x, cos, sin, positions, 1 if interleaved else 0, out, okv_settings_get())
