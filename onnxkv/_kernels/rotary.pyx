"""Rotary position embedding (float32).

x, out: [batch, seq, heads, head_size]; cos, sin: [max_pos, rotary_dim // 2];
positions: [batch, seq] int64.  The first rotary_dim = 2 * cos.shape[1] dims of
each head are rotated, the rest are copied.  ``out`` may be ``x`` (in place).
"""
from libc.stdint cimport int64_t
from cython.parallel cimport prange

from onnxkv._kernels._runtime cimport okv_threads, okv_simd
from . import _validate as V

cdef extern from "simd.h" nogil:
    void okv_rope_row_f32(const float *x, const float *c, const float *s, float *out, int64_t half,
                          int64_t head_size, int interleaved, int simd)

DEF PAR_MIN = 16384


cdef void _rope(const float[:, :, :, ::1] x, const float[:, ::1] cos, const float[:, ::1] sin,
                const int64_t[:, ::1] pos, int interleaved, float[:, :, :, ::1] out) noexcept nogil:
    cdef Py_ssize_t B = x.shape[0], S = x.shape[1], H = x.shape[2], D = x.shape[3]
    cdef Py_ssize_t half = cos.shape[1], rows = B * S * H, i, b, s, h
    cdef int64_t p
    cdef int simd = okv_simd()
    cdef int nt = okv_threads() if rows * D >= PAR_MIN else 1
    for i in prange(rows, num_threads=nt, schedule='static'):
        b = i // (S * H)
        s = (i // H) % S
        h = i % H
        p = pos[b, s]
        okv_rope_row_f32(&x[b, s, h, 0], &cos[p, 0], &sin[p, 0], &out[b, s, h, 0], half, D,
                         interleaved, simd)


def rotary_embedding(x, cos, sin, positions, interleaved, out):
    """Apply rotary embedding; writes ``out`` only.

    Non-interleaved (GPT-NeoX / Llama halves): x1 = x[..., :r/2], x2 = x[..., r/2:r],
    out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin.  Interleaved: the pairs
    (x[2i], x[2i+1]) are rotated the same way.  cos/sin row = positions[b, s].
    Raises ValueError (before writing) for bad shapes/dtypes or a position outside
    [0, max_pos).
    """
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
    _rope(x, cos, sin, positions, 1 if interleaved else 0, out)
