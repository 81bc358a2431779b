"""float16 / bfloat16 <-> float32 conversion (round to nearest even).

float16 is IEEE binary16: the AVX2 path uses F16C (vcvtph2ps / vcvtps2ph); the
scalar path is exact bit manipulation with the same results (NaN payloads
aside).  bfloat16 has no NumPy dtype and is stored as ``uint16`` bit patterns
(the upper 16 bits of the float32): widening is exact (shift left 16);
narrowing rounds to nearest even, overflow gives +-inf and NaN stays a (quiet)
NaN -- identical on the AVX2 and scalar paths and to
``reference.bf16_from_f32``.  Arrays of any shape, C-contiguous, processed
flat.  Used when loading/storing FLOAT16 / BFLOAT16 cache pages.
"""
from libc.stdint cimport int64_t, uint16_t
from libc.string cimport memcpy
from cython.parallel cimport prange

from onnxkv._kernels._record cimport KIND_CONCAT, KIND_CONVERT, KIND_COPY_ROWS, recorder
from onnxkv._kernels._runtime cimport okv_settings, okv_settings_get
from . import _validate as V

import numpy as np
from libc.stdlib cimport malloc, free

cdef extern from "simd.h" nogil:
    void okv_h2f_row(const uint16_t *x, float *out, int64_t n, int simd)
    void okv_f2h_row(const float *x, uint16_t *out, int64_t n, int simd)
    void okv_bf2f_row(const uint16_t *x, float *out, int64_t n, int simd)
    void okv_f2bf_row(const float *x, uint16_t *out, int64_t n, int simd)
    double okv_read_sum_f32(const float *x, int64_t n, int simd)

DEF CHUNK = 65536


cdef void _h2f(const uint16_t[::1] x, float[::1] out, okv_settings s) noexcept nogil:
    _h2f_ptr(&x[0], &out[0], x.shape[0], s)


cdef void _f2h(const float[::1] x, uint16_t[::1] out, okv_settings s) noexcept nogil:
    _f2h_ptr(&x[0], &out[0], x.shape[0], s)


cdef void _h2f_ptr(const uint16_t *x, float *out, Py_ssize_t n, okv_settings s) noexcept nogil:
    cdef Py_ssize_t nchunks = (n + CHUNK - 1) // CHUNK, c, i0, m
    cdef int simd = s.simd
    cdef int nt = s.threads if nchunks > 1 else 1
    for c in prange(nchunks, num_threads=nt, schedule='static'):
        i0 = c * CHUNK
        m = n - i0
        if m > CHUNK:
            m = CHUNK
        okv_h2f_row(x + i0, out + i0, m, simd)


cdef void _f2h_ptr(const float *x, uint16_t *out, Py_ssize_t n, okv_settings s) noexcept nogil:
    cdef Py_ssize_t nchunks = (n + CHUNK - 1) // CHUNK, c, i0, m
    cdef int simd = s.simd
    cdef int nt = s.threads if nchunks > 1 else 1
    for c in prange(nchunks, num_threads=nt, schedule='static'):
        i0 = c * CHUNK
        m = n - i0
        if m > CHUNK:
            m = CHUNK
        okv_f2h_row(x + i0, out + i0, m, simd)


cdef void convert_ptr(const void *x, void *out, int64_t n, int mode, okv_settings s) noexcept nogil:
    """KIND_CONVERT (_record.pxd) on checked pointers: mode 0 widens n float16 values at x into float32 at out,
    mode 1 rounds n float32 values at x to float16 at out, mode 2 copies n float32 values."""
    if mode == 0:
        _h2f_ptr(<const uint16_t *>x, <float *>out, n, s)
    elif mode == 1:
        _f2h_ptr(<const float *>x, <uint16_t *>out, n, s)
    else:
        memcpy(out, x, <size_t>n * sizeof(float))


cdef void _note(x, out, int mode):
    """Note a conversion that ran (for a recording thread: _record.pyx)."""
    rec = recorder()
    if rec is not None:
        rec.note(KIND_CONVERT, (x, out), (x.size, mode), ())


cdef void _bf2f(const uint16_t[::1] x, float[::1] out, okv_settings s) noexcept nogil:
    cdef Py_ssize_t n = x.shape[0], nchunks = (n + CHUNK - 1) // CHUNK, c, i0, m
    cdef int simd = s.simd
    cdef int nt = s.threads if nchunks > 1 else 1
    for c in prange(nchunks, num_threads=nt, schedule='static'):
        i0 = c * CHUNK
        m = n - i0
        if m > CHUNK:
            m = CHUNK
        okv_bf2f_row(&x[i0], &out[i0], m, simd)


cdef void _f2bf(const float[::1] x, uint16_t[::1] out, okv_settings s) noexcept nogil:
    cdef Py_ssize_t n = x.shape[0], nchunks = (n + CHUNK - 1) // CHUNK, c, i0, m
    cdef int simd = s.simd
    cdef int nt = s.threads if nchunks > 1 else 1
    for c in prange(nchunks, num_threads=nt, schedule='static'):
        i0 = c * CHUNK
        m = n - i0
        if m > CHUNK:
            m = CHUNK
        okv_f2bf_row(&x[i0], &out[i0], m, simd)


def f16_to_f32(x, out):
    """out[...] = x as float32.  x: float16, out: float32 of the same shape."""
    V.array("x", x, (np.dtype(np.float16),))
    V.array("out", out, (V.F32,), shape=x.shape, writeable=True)
    V.no_overlap("out", out, x, "x")
    if x.size == 0:
        return
    _h2f(x.reshape(-1).view(np.uint16), out.reshape(-1), okv_settings_get())
    _note(x, out, 0)


def f32_to_f16(x, out):
    """out[...] = x rounded to float16 (nearest even; overflow gives +-inf).
    x: float32, out: float16 of the same shape."""
    V.array("x", x, (V.F32,))
    V.array("out", out, (np.dtype(np.float16),), shape=x.shape, writeable=True)
    V.no_overlap("out", out, x, "x")
    if x.size == 0:
        return
    _f2h(x.reshape(-1), out.reshape(-1).view(np.uint16), okv_settings_get())
    _note(x, out, 1)


def copy_f32(x, out):
    """out[...] = x, float32 arrays of one shape, C-contiguous, not overlapping (a Cast to the type its input
    has: a copy a compiled step replays)."""
    V.array("x", x, (V.F32,))
    V.array("out", out, (V.F32,), shape=x.shape, writeable=True)
    V.no_overlap("out", out, x, "x")
    if x.size == 0:
        return
    cdef const float[::1] xv = x.reshape(-1)
    cdef float[::1] ov = out.reshape(-1)
    with nogil:
        memcpy(&ov[0], &xv[0], <size_t>xv.shape[0] * sizeof(float))
    _note(x, out, 2)


cdef void concat_ptr(const char *a, const char *b, char *out, int64_t outer, int64_t na, int64_t nb) noexcept nogil:
    """KIND_CONCAT (_record.pxd) on checked pointers: ``outer`` rows of out, each ``na`` bytes of a's row then
    ``nb`` bytes of b's (an operand of no bytes is not read)."""
    cdef int64_t r
    for r in range(outer):
        if na:
            memcpy(out + r * (na + nb), a + r * na, <size_t>na)
        if nb:
            memcpy(out + r * (na + nb) + na, b + r * nb, <size_t>nb)


def concat_pair(a, b, out, axis):
    """out[...] = concatenate((a, b), axis) (an ONNX Concat of two inputs: a copy a compiled step replays).
    a, b: C-contiguous arrays of one dtype and rank, whose shapes differ at most at ``axis`` (in [0, rank));
    out: C-contiguous, writeable, of their dtype and the concatenated shape, overlapping neither."""
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "biuf":
        raise ValueError(f"a: expected a numpy.ndarray of numbers or booleans, got {getattr(a, 'dtype', type(a))}")
    V.array("a", a, (a.dtype,))
    V.array("b", b, (a.dtype,))
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise ValueError(f"concat_pair: axis must be an int, got {axis!r}")
    if not 0 <= axis < a.ndim or b.ndim != a.ndim:
        raise ValueError(f"concat_pair: axis {axis} out of range for ranks {a.ndim} and {b.ndim}")
    shape = list(a.shape)
    shape[axis] += b.shape[axis]
    if [d for i, d in enumerate(b.shape) if i != axis] != [d for i, d in enumerate(a.shape) if i != axis]:
        raise ValueError(f"b: shape {b.shape} differs from a's {a.shape} off axis {axis}")
    V.array("out", out, (a.dtype,), shape=tuple(shape), writeable=True)
    V.no_overlap("out", out, a, "a")
    V.no_overlap("out", out, b, "b")
    if out.size == 0:
        return
    cdef int64_t outer = 1, na = a.itemsize, nb = a.itemsize
    for d in a.shape[:axis]:
        outer *= d
    for d in a.shape[axis:]:
        na *= d
    for d in b.shape[axis:]:
        nb *= d
    cdef const char *pa = <const char *><size_t>a.__array_interface__["data"][0]
    cdef const char *pb = <const char *><size_t>b.__array_interface__["data"][0]
    cdef char *po = <char *><size_t>out.__array_interface__["data"][0]
    with nogil:
        concat_ptr(pa, pb, po, outer, na, nb)
    rec = recorder()
    if rec is not None:
        rec.note(KIND_CONCAT, (a if na else None, b if nb else None, out), (outer, na, nb), ())


cdef void copy_rows_ptr(const char *x, char *out, int64_t rows, int64_t row_bytes, int64_t stride) noexcept nogil:
    """KIND_COPY_ROWS (_record.pxd) on checked pointers: ``rows`` rows of ``row_bytes`` bytes, row r at
    ``x + r * stride``, packed into out."""
    cdef int64_t r
    for r in range(rows):
        memcpy(out + r * row_bytes, x + r * stride, <size_t>row_bytes)


def row_layout(x) -> tuple | None:
    """(rows, row_bytes, stride) of an array view whose elements are ``rows`` runs of ``row_bytes`` contiguous
    bytes, one every ``stride`` bytes (stride >= row_bytes > 0; C order), or None for any other layout (an empty
    view, negative or interleaved strides, more than one outer stride)."""
    if not isinstance(x, np.ndarray) or x.size == 0:
        return None
    # (no negative indices: this module is compiled without wraparound)
    dims = [(n, st) for n, st in zip(x.shape, x.strides) if n != 1]
    row = x.itemsize
    while dims and dims[len(dims) - 1][1] == row:  # the contiguous tail
        row *= dims.pop()[0]
    if not dims:
        return (1, row, row)
    rows, stride = dims.pop()
    while dims:  # outer dims collapse into one stride
        n, st = dims.pop()
        if st != stride * rows:
            return None
        rows *= n
    return (rows, row, stride) if stride >= row else None


def copy_rows(x, out):
    """out[...] = x for a view ``x`` that :func:`row_layout` describes, inside the memory of its base array
    (a Slice of a contiguous tensor: a copy a compiled step replays); out: C-contiguous, writeable, of x's
    shape and dtype, overlapping neither x nor its base's span.  Returns False, with nothing written, for a
    view no row layout describes."""
    if not isinstance(x, np.ndarray) or x.dtype.kind not in "biuf":  # plain bytes: no object references
        raise ValueError(f"x: expected a numpy.ndarray of numbers or booleans, got {getattr(x, 'dtype', type(x))}")
    layout = row_layout(x)
    V.array("out", out, (x.dtype,), shape=x.shape, writeable=True)
    if layout is None:
        return False
    rows, row, stride = layout
    root = x
    while isinstance(root.base, np.ndarray):
        root = root.base
    lo = root.__array_interface__["data"][0]
    start = x.__array_interface__["data"][0]
    span_bytes = (rows - 1) * stride + row
    if not (root.flags.c_contiguous and lo <= start and start + span_bytes <= lo + root.nbytes):
        return False
    span = np.ndarray((span_bytes,), np.uint8, root, start - lo)
    V.no_overlap("out", out, span, "x")
    cdef const char *px = <const char *><size_t>start
    cdef char *po = <char *><size_t>out.__array_interface__["data"][0]
    cdef int64_t n = rows, nb = row, step = stride
    with nogil:
        copy_rows_ptr(px, po, n, nb, step)
    rec = recorder()
    if rec is not None:
        rec.note(KIND_COPY_ROWS, (span, out), (rows, row, stride), ())
    return True


def bf16_to_f32(x, out):
    """out[...] = x widened to float32 (exact).  x: uint16 array of bfloat16 bit
    patterns, out: float32 of the same shape."""
    V.array("x", x, (np.dtype(np.uint16),))
    V.array("out", out, (V.F32,), shape=x.shape, writeable=True)
    V.no_overlap("out", out, x, "x")
    if x.size == 0:
        return
    _bf2f(x.reshape(-1), out.reshape(-1), okv_settings_get())


def f32_to_bf16(x, out):
    """out[...] = x rounded to bfloat16 (nearest even; overflow gives +-inf; NaN
    stays NaN), stored as uint16 bit patterns.  x: float32, out: uint16 of the
    same shape."""
    V.array("x", x, (V.F32,))
    V.array("out", out, (np.dtype(np.uint16),), shape=x.shape, writeable=True)
    V.no_overlap("out", out, x, "x")
    if x.size == 0:
        return
    _f2bf(x.reshape(-1), out.reshape(-1), okv_settings_get())


DEF READ_CHUNK = 262144   # floats (1 MiB) per OpenMP task of read_sum


def read_sum(x):
    """Sum of a float32 array (float64 result of float32 partial sums), read with
    the kernels' threads and SIMD path.  A memory read-bandwidth probe for the
    benchmarks (bytes / time of a large array); not meant for accurate sums."""
    V.array("x", x, (V.F32,))
    if x.size == 0:
        return 0.0
    cdef const float[::1] xv = x.reshape(-1)
    cdef Py_ssize_t n = xv.shape[0], nchunks = (n + READ_CHUNK - 1) // READ_CHUNK, c, i0, m
    cdef okv_settings s = okv_settings_get()
    cdef int simd = s.simd
    cdef int nt = s.threads if nchunks > 1 else 1
    cdef double *part = <double *>malloc(nchunks * sizeof(double))
    cdef double total = 0.0
    if part == NULL:
        raise MemoryError("read_sum: could not allocate")
    with nogil:
        for c in prange(nchunks, num_threads=nt, schedule='static'):
            i0 = c * READ_CHUNK
            m = n - i0
            if m > READ_CHUNK:
                m = READ_CHUNK
            part[c] = okv_read_sum_f32(&xv[i0], m, simd)
        for c in range(nchunks):
            total += part[c]
    free(part)
    return total
