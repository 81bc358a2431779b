"""Replay of recorded kernel calls: the compiled part of a step.

A :class:`Program` is built once from the kernel calls a :class:`~onnxkv._kernels._record.Recorder`
noted (the kinds of ``_record.pxd``) and replays them, in order, with no Python
between them.  Every array a call read or wrote is one of two kinds:

* **baked**: memory the program keeps alive (temporaries and outputs of the
  recorded run, constant weights); the replay uses the recorded address;
* **external**: memory inside one of the program's *external* arrays (the
  values the caller passes to :meth:`Program.run` each time, in a fixed order:
  the step's inputs that change from run to run); the replay uses the address
  of the array passed now plus the recorded byte offset.

Before the first call, :meth:`Program.run` checks every external array through
the buffer protocol against what was recorded -- C-contiguous, the same shape,
item size and format, writable where a call writes it, and the same relation
to the program's own memory (an external array that viewed baked memory when
recorded must be that same memory now; one that did not must not overlap any
memory the program writes) -- and returns False, with nothing run, when one
differs.  A call may also refuse its values of the run (a gather index out of
range): the replay then stops there and returns False.  The calls then run with the calling thread's kernel settings, as the
recorded calls did; the results are bit for bit those of the calls run one by
one (the kernels' summation orders do not depend on the thread count).

Ownership: the program holds references to every baked array; the caller owns
the external arrays and must not let two runs of one program overlap (a
program is not thread-safe).
"""
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_WRITABLE, PyObject_GetBuffer, PyBuffer_Release
from libc.stdint cimport int64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset, strcmp

from onnxkv._kernels._record cimport (KIND_ACTIVATION, KIND_GATHER_ROWS, KIND_MATMUL_PACKED, KIND_RMS_NORM,
                                      KIND_SKIP_RMS_NORM)
from onnxkv._kernels._runtime cimport okv_settings, okv_settings_get
from onnxkv._kernels.activation cimport act_f32_ptr
from onnxkv._kernels.gather cimport gather_rows_ptr
from onnxkv._kernels.matmul cimport matmul_packed_ptr
from onnxkv._kernels.norm cimport rms_f32_ptr, skip_rms_f32_ptr

__all__ = ["Program", "WRITTEN"]

DEF NP = 6      # array operands of a call at most
DEF NI = 4      # int parameters at most
DEF MAX_FORMAT = 8
DEF MAX_EXT = 64  # external arrays at most (a larger segment is not made: its nodes run in Python)

#: Operand positions each kind writes (the others it reads; ``None`` operands are absent).
WRITTEN = {KIND_MATMUL_PACKED: (3,), KIND_RMS_NORM: (2,), KIND_SKIP_RMS_NORM: (4, 5), KIND_ACTIVATION: (2,),
           KIND_GATHER_ROWS: (2,)}
#: Operand count of each kind.
_OPERANDS = {KIND_MATMUL_PACKED: 4, KIND_RMS_NORM: 3, KIND_SKIP_RMS_NORM: 6, KIND_ACTIVATION: 3, KIND_GATHER_ROWS: 3}


cdef struct call_t:
    int kind
    void *p[NP]          # operand addresses (baked, or set per run for external ones)
    int ext[NP]          # -1: baked; else the index of the external array the operand lies in
    int64_t off[NP]      # byte offset of an external operand in its array
    int64_t i[NI]
    float f


cdef struct ext_t:
    int ndim
    int64_t shape[8]
    int64_t itemsize
    char format[MAX_FORMAT]
    int written          # some call writes into it
    uintptr_t pinned     # the baked address it must have (it viewed program memory when recorded), or 0
    int64_t nbytes


cdef inline uintptr_t _addr(a):
    return <uintptr_t>a.__array_interface__["data"][0]


cdef class Program:
    """Recorded kernel calls replayed as one (see the module docstring).

    ``Program(calls, externals)``: ``calls`` as :attr:`Recorder.calls` noted
    them (only the kinds of ``_record.pxd``); ``externals`` the arrays of the
    recorded run whose memory changes from run to run (each C-contiguous).
    Raises ValueError naming the call when an operand straddles an external
    array's bounds or a kind is unknown, or when there are more than 64
    external arrays.
    """
    cdef call_t *calls
    cdef int n
    cdef ext_t *exts
    cdef int n_ext
    cdef list keep              # the baked arrays
    cdef uintptr_t *written      # [n_written, 2]: [start, end) of the baked memory the calls write
    cdef int n_written
    cdef readonly int calls_count

    def __cinit__(self):
        self.calls = NULL
        self.exts = NULL
        self.written = NULL

    def __init__(self, list calls, list externals):
        cdef int c, j, e
        cdef call_t *cl
        self.n = len(calls)
        self.n_ext = len(externals)
        if self.n_ext > MAX_EXT:
            raise ValueError(f"Program: {self.n_ext} external arrays, at most {MAX_EXT}")
        self.calls_count = self.n
        self.calls = <call_t *>malloc(max(1, self.n) * sizeof(call_t))
        self.exts = <ext_t *>malloc(max(1, self.n_ext) * sizeof(ext_t))
        if self.calls == NULL or self.exts == NULL:
            raise MemoryError("Program: could not allocate the call table")
        memset(self.calls, 0, max(1, self.n) * sizeof(call_t))
        memset(self.exts, 0, max(1, self.n_ext) * sizeof(ext_t))
        self.keep = []
        bounds = [(_addr(x), _addr(x) + x.nbytes) for x in externals]
        written = []
        for e, x in enumerate(externals):
            if not x.flags.c_contiguous or x.ndim > 8:
                raise ValueError(f"Program: external array {e} must be C-contiguous of rank <= 8, got {x.shape}")
            fmt = memoryview(x).format.encode()
            if len(fmt) >= MAX_FORMAT:
                raise ValueError(f"Program: external array {e} has an unsupported format {fmt!r}")
            self.exts[e].ndim = x.ndim
            for j in range(x.ndim):
                self.exts[e].shape[j] = x.shape[j]
            self.exts[e].itemsize = x.itemsize
            memcpy(self.exts[e].format, <const char *>fmt, len(fmt))
            self.exts[e].format[len(fmt)] = 0
            self.exts[e].nbytes = x.nbytes
        for c, (kind, arrays, ints, floats) in enumerate(calls):
            if kind not in _OPERANDS or len(arrays) != _OPERANDS[kind] or len(ints) > NI or len(floats) > 1:
                raise ValueError(f"Program: call {c} has an unknown kind or arity ({kind}, {len(arrays)} arrays)")
            cl = &self.calls[c]
            cl.kind = kind
            for j, v in enumerate(ints):
                cl.i[j] = v
            if floats:
                cl.f = floats[0]
            for j, a in enumerate(arrays):
                cl.ext[j] = -1
                if a is None:
                    continue
                lo, hi = _addr(a), _addr(a) + a.nbytes
                inside = [k for k, (b0, b1) in enumerate(bounds) if b0 <= lo and hi <= b1 and hi > lo]
                crossing = [k for k, (b0, b1) in enumerate(bounds) if lo < b1 and b0 < hi and k not in inside]
                if crossing:
                    raise ValueError(f"Program: operand {j} of call {c} straddles external array {crossing[0]}")
                if inside:
                    cl.ext[j] = inside[0]
                    cl.off[j] = lo - bounds[inside[0]][0]
                    if j in WRITTEN[kind]:
                        self.exts[inside[0]].written = 1
                else:
                    cl.p[j] = <void *><uintptr_t>lo
                    self.keep.append(a)
                    if j in WRITTEN[kind]:
                        written.append((lo, hi))
        self.n_written = len(written)
        self.written = <uintptr_t *>malloc(max(1, 2 * self.n_written) * sizeof(uintptr_t))
        if self.written == NULL:
            raise MemoryError("Program: could not allocate the written ranges")
        for j, (w0, w1) in enumerate(written):
            self.written[2 * j] = w0
            self.written[2 * j + 1] = w1
        for e, (b0, b1) in enumerate(bounds):
            if any(b0 < w1 and w0 < b1 for w0, w1 in written):
                self.exts[e].pinned = b0     # the external viewed memory this program writes

    def __dealloc__(self):
        free(self.calls)
        free(self.exts)
        free(self.written)

    @property
    def externals(self) -> int:
        """How many external arrays :meth:`run` takes."""
        return self.n_ext

    def run(self, list externals) -> bool:
        """Replay the calls with ``externals`` (one array per external of the recording, in order).

        Returns False, having run nothing, when an external array differs from
        the recorded one (see the module docstring), or when a call refuses its
        values of this run (a gather index out of range: the calls before it
        ran, that one and the rest did not); True once every call ran.
        """
        cdef int e, c, j, flags
        cdef Py_buffer view
        cdef ext_t *x
        cdef call_t *cl
        cdef char *base
        cdef void *bases[MAX_EXT]
        cdef uintptr_t lo, hi
        if len(externals) != self.n_ext:
            return False
        for e in range(self.n_ext):
            x = &self.exts[e]
            flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT
            if x.written:
                flags |= PyBUF_WRITABLE
            try:
                PyObject_GetBuffer(externals[e], &view, flags)
            except (BufferError, TypeError, ValueError):
                return False
            try:
                if view.ndim != x.ndim or view.itemsize != x.itemsize or view.len != x.nbytes \
                        or view.format == NULL or strcmp(view.format, x.format) != 0:
                    return False
                for j in range(x.ndim):
                    if view.shape[j] != x.shape[j]:
                        return False
                lo = <uintptr_t>view.buf
                hi = lo + <uintptr_t>view.len
                if x.pinned:
                    if lo != x.pinned:
                        return False
                else:
                    for j in range(self.n_written):
                        if lo < self.written[2 * j + 1] and self.written[2 * j] < hi:
                            return False
                bases[e] = view.buf
            finally:
                PyBuffer_Release(&view)
        cdef okv_settings s = okv_settings_get()
        for c in range(self.n):
            cl = &self.calls[c]
            for j in range(NP):
                if cl.ext[j] >= 0:
                    cl.p[j] = <char *>bases[cl.ext[j]] + cl.off[j]
            if not _dispatch(cl, s):
                return False
        return True


cdef inline bint _dispatch(call_t *c, okv_settings s) noexcept:
    """Run one recorded call (the operand order of ``_record.pxd``); False when its values are refused
    (a gather index out of range: nothing of that call written)."""
    if c.kind == KIND_GATHER_ROWS:
        return gather_rows_ptr(<const float *>c.p[0], c.i[0], c.i[1], <const int64_t *>c.p[1], c.i[2],
                               <float *>c.p[2]) < 0
    if c.kind == KIND_MATMUL_PACKED:
        matmul_packed_ptr(<const float *>c.p[0], c.i[0], c.i[1], <const float *>c.p[1], c.i[2], c.i[3],
                          <const float *>c.p[2], <float *>c.p[3], s)
    elif c.kind == KIND_RMS_NORM:
        rms_f32_ptr(<const float *>c.p[0], <const float *>c.p[1], c.f, <float *>c.p[2], c.i[0], c.i[1], s)
    elif c.kind == KIND_SKIP_RMS_NORM:
        skip_rms_f32_ptr(<const float *>c.p[0], <const float *>c.p[1], <const float *>c.p[3],
                         <const float *>c.p[2], c.f, <float *>c.p[4], <float *>c.p[5], c.i[0], c.i[1], s)
    elif c.kind == KIND_ACTIVATION:
        act_f32_ptr(<int>c.i[0], <const float *>c.p[0], <const float *>c.p[1], <float *>c.p[2], c.i[1], s)
    return True
