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

from onnxkv._kernels._record cimport KIND_ROTARY, recorder, refuse
from onnxkv._kernels._runtime cimport okv_settings, okv_settings_get
from onnxkv._kernels._ranges cimport _disjoint
import numpy as np

from . import _validate as V

cdef extern from "simd.h" nogil:
    void okv_rope_row_f32(const float *x, const float *c, const float *s, float *out, int64_t half,
                          int64_t head_size, int interleaved, int simd)

DEF PAR_MIN = 16384


cdef void rope_ptr(const float *x, const float *cos, const float *sin, const int64_t *pos, int64_t B, int64_t S,
                   int64_t H, int64_t D, int64_t half, int interleaved, float *out, okv_settings st) noexcept nogil:
    """The kernel on checked pointers: x, out [B, S, H, D] (C order; out may be x), cos, sin [max_pos, half]
    (C order), pos [B, S] int64 with every value in [0, max_pos)."""
    cdef int64_t rows = B * S * H, i, b, s, h
    cdef int nt = st.threads if rows * D >= PAR_MIN else 1
    for i in prange(rows, num_threads=nt, schedule='static'):
        b = i // (S * H)
        s = (i // H) % S
        h = i % H
        okv_rope_row_f32(x + i * D, cos + pos[b * S + s] * half, sin + pos[b * S + s] * half, out + i * D, half, D,
                         interleaved, st.simd)


cdef void _rope(const float[:, :, :, ::1] x, const float[:, ::1] cos, const float[:, ::1] sin,
                const int64_t[:, ::1] pos, int interleaved, float[:, :, :, ::1] out, okv_settings st) noexcept nogil:
    rope_ptr(&x[0, 0, 0, 0], &cos[0, 0], &sin[0, 0], &pos[0, 0], x.shape[0], x.shape[1], x.shape[2], x.shape[3],
             cos.shape[1], interleaved, &out[0, 0, 0, 0], st)


cdef void _note(x, cos, sin, positions, interleaved, out):
    """Note a call that ran through ``_rope_fast`` (for a recording thread: _record.pyx)."""
    rec = recorder()
    if rec is not None:
        rec.note(KIND_ROTARY, (x, cos, sin, positions, out),
                 (x.shape[0], x.shape[1], x.shape[2], x.shape[3], cos.shape[0], cos.shape[1], 1 if interleaved else 0),
                 ())


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
            and _disjoint(o, nb, &sv[0, 0], tb)
            and _disjoint(o, nb, &pv[0, 0], <size_t>(pv.shape[0] * pv.shape[1]) * sizeof(int64_t))):
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
        _note(x, cos, sin, positions, interleaved, out)
        return
    refuse("rotary_embedding: a call outside the checked fast path is not replayed")
    V.array("x", x, (V.F32,), ndim=4)
    V.array("cos", cos, (V.F32,), ndim=2)
    V.array("sin", sin, (V.F32,), shape=cos.shape)
    V.array("positions", positions, (V.I64,), shape=x.shape[:2])
    V.array("out", out, (V.F32,), shape=x.shape, writeable=True)
    V.no_overlap("out", out, x, "x", allow_identical=True)
    V.no_overlap("out", out, cos, "cos")
    V.no_overlap("out", out, sin, "sin")
    V.no_overlap("out", out, positions, "positions")  # read while out is written
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
