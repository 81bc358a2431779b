# The recorded-call program of a compiled step (see step.pyx), shared by cimport with the token loop
# (token_loop.pyx), which replays one program many times.
from libc.stdint cimport int64_t, uintptr_t

from onnxkv._kernels._runtime cimport okv_settings

cdef enum:
    NP = 12          # array operands of a call at most
    NI = 19          # int parameters at most
    NF = 2           # float parameters at most
    MAX_FORMAT = 8
    MAX_EXT = 64     # external arrays at most (a larger segment is not made: its nodes run in Python)
    PAGED_S = 16     # the int parameter holding a paged decode call's tokens per row (``_record.pxd``)


cdef struct call_t:
    int kind
    void *p[NP]          # operand addresses (baked, or set per run for external ones)
    int ext[NP]          # -1: baked; else the index of the external array the operand lies in
    int64_t off[NP]      # byte offset of an external operand in its array
    int64_t i[NI]
    float f[NF]


cdef struct ext_t:
    int ndim
    int64_t shape[8]
    int64_t itemsize
    char format[MAX_FORMAT]
    int written          # some call writes into it
    uintptr_t pinned     # the baked address it must have (it viewed program memory when recorded), or 0
    int64_t nbytes
    int ragged           # its last dim may differ from run to run (taken whole by prelude and paged calls only)
    int resizable        # a cache [1, H, Cap, D] whose capacity (dim 2) may differ (taken whole by decode calls)


cdef class Program:
    cdef call_t *calls
    cdef int n
    cdef ext_t *exts
    cdef int n_ext
    cdef list keep              # the baked arrays
    cdef uintptr_t *written      # [n_written, 2]: [start, end) of the baked memory the calls write
    cdef int n_written
    cdef readonly int calls_count
    cdef readonly bint refused   # the last run's externals were the recording's but a call refused its values

    cdef bint bind(self, list externals, void **bases, int64_t *lens) except -1
    cdef int execute(self, void **bases, const int64_t *lens, okv_settings s) noexcept
