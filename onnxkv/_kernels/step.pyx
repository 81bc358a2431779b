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
recorded, or that the caller pinned, must be that same memory now; one that did not must not overlap any
memory the program writes, and an external a call writes must not overlap
another external) -- and returns False, with nothing run, when one differs.
An external array may be *ragged*: its last dim may differ from the
recording's (an attention mask that grows by a column per step, a pool's page
addresses, a state's block tables); only a call of a kind that reads its length
from it (``KIND_MASK_LENGTHS``, the paged calls' tables, the masked calls' masks:
``RAGGED_WHOLE``) may take it, whole.  ``KIND_MASK_LENGTHS`` calls are *prelude* calls: they read only
externals and run first.  An external
may be *resizable*: a cache [B, H, Cap, D] whose capacity (dim 2) may differ
from the recording's (a new state's cache, or one that grew); only the cache
operands of decode-token, cache-rows and masked-decode calls may take it, whole
(``RESIZABLE_WHOLE``), and they read their capacity from it when replayed.  A call may
then refuse its values of the run (a gather index out of range, a decode
position other than the cache's committed length, a mask the kernel cannot
describe), read from operands no call
but a prelude call writes: every call is asked before any other runs, and one
refusal returns False with nothing but the prelude calls run (they write only
the program's own memory).  The calls then run with the calling thread's
kernel settings, as the recorded calls did; the results are bit for bit those of the calls run one by
one (the kernels' summation orders do not depend on the thread count).

Ownership: the program holds references to every baked array; the caller owns
the external arrays and must not let two runs of one program overlap (a
program is not thread-safe).
"""
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_WRITABLE, PyObject_GetBuffer, PyBuffer_Release
from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset, strcmp

from onnxkv._kernels._record cimport (KIND_ACTIVATION, KIND_CACHE_ROWS, KIND_CONCAT, KIND_CONVERT, KIND_COPY_ROWS,
                                      KIND_DECODE_PAGED, KIND_DECODE_TOKEN, KIND_GATHER_ROWS, KIND_MASK_LENGTHS,
                                      KIND_MASKED_DECODE, KIND_MASKED_PAGED, KIND_MATMUL_DYNAMIC, KIND_MATMUL_NBITS,
                                      KIND_MATMUL_PACKED, KIND_NONPAD_DECODE, KIND_PAGE_ROWS, KIND_RMS_NORM,
                                      KIND_ROTARY, KIND_SCATTER_ROWS, KIND_SKIP_RMS_NORM)
from onnxkv._kernels._runtime cimport okv_settings, okv_settings_get
from onnxkv._kernels.activation cimport act_f32_ptr
from onnxkv._kernels.convert cimport concat_ptr, convert_ptr, copy_rows_ptr
from onnxkv._kernels.attention cimport (decode_paged_ok, decode_paged_ptr, decode_token_ptr, masked_decode_ptr,
                                        masked_ranges, page_rows_ptr)
from onnxkv._kernels.gather cimport gather_rows_ptr
from onnxkv._kernels.imatmul cimport int8_weight_address, matmul_dynamic_ptr
from onnxkv._kernels.matmul cimport matmul_packed_ptr
from onnxkv._kernels.norm cimport rms_f32_ptr, skip_rms_f32_ptr
from onnxkv._kernels.qmatmul cimport matmul_nbits_ptr, nbits_weight_address
from onnxkv._kernels.rotary cimport rope_ptr

import numpy as np

__all__ = ["Program", "WRITTEN"]

#: Operand positions each kind writes (the others it reads; ``None`` operands are absent).
WRITTEN = {KIND_MATMUL_PACKED: (3,), KIND_RMS_NORM: (2,), KIND_SKIP_RMS_NORM: (4, 5), KIND_ACTIVATION: (2,),
           KIND_GATHER_ROWS: (2,), KIND_DECODE_TOKEN: (5, 6, 9, 10, 11), KIND_MATMUL_NBITS: (3,),
           KIND_MASK_LENGTHS: (1, 2), KIND_DECODE_PAGED: (9,), KIND_MATMUL_DYNAMIC: (3,), KIND_CACHE_ROWS: (1,),
           KIND_MASKED_DECODE: (4, 6, 7, 8), KIND_ROTARY: (4,), KIND_CONVERT: (1,), KIND_SCATTER_ROWS: (1, 3, 4),
           KIND_NONPAD_DECODE: (4, 6, 7, 8), KIND_CONCAT: (2,), KIND_COPY_ROWS: (1,), KIND_PAGE_ROWS: (4,),
           KIND_MASKED_PAGED: (4, 8, 9, 10)}
#: Operands whose values decide whether a call accepts the run (read before any call but the prelude ones runs:
#: never written by another call of the program).
CHECKED = {KIND_GATHER_ROWS: (1,), KIND_DECODE_TOKEN: (7, 8), KIND_DECODE_PAGED: (5, 6, 7, 8, 10),
           KIND_CACHE_ROWS: (2,), KIND_MASKED_DECODE: (3, 5), KIND_ROTARY: (3,), KIND_SCATTER_ROWS: (2,),
           KIND_NONPAD_DECODE: (3, 5), KIND_PAGE_ROWS: (1, 2, 3), KIND_MASKED_PAGED: (3, 5, 6, 7)}
#: Operand count of each kind.
_OPERANDS = {KIND_MATMUL_PACKED: 4, KIND_RMS_NORM: 3, KIND_SKIP_RMS_NORM: 6, KIND_ACTIVATION: 3, KIND_GATHER_ROWS: 3,
             KIND_DECODE_TOKEN: 12, KIND_MATMUL_NBITS: 4, KIND_MASK_LENGTHS: 3, KIND_DECODE_PAGED: 11,
             KIND_MATMUL_DYNAMIC: 4, KIND_CACHE_ROWS: 3, KIND_MASKED_DECODE: 9, KIND_ROTARY: 5, KIND_CONVERT: 2,
             KIND_SCATTER_ROWS: 5, KIND_NONPAD_DECODE: 9, KIND_CONCAT: 3, KIND_COPY_ROWS: 2, KIND_PAGE_ROWS: 5,
             KIND_MASKED_PAGED: 11}
#: Kinds run before the others are admitted (they read externals only), and the operand each takes whole from a
#: ragged external (its last dim read when replayed).
PRELUDE = {KIND_MASK_LENGTHS: 0}
#: (kind, operand) a kind takes whole from a ragged external, reading its last dim when replayed: a paged call's
#: page addresses (into ``ints[RAGGED_P]``) and block tables (``ints[RAGGED_M]``), a masked call's mask.
RAGGED_WHOLE = {(KIND_DECODE_PAGED, 5), (KIND_DECODE_PAGED, 6), (KIND_MASKED_DECODE, 3), (KIND_PAGE_ROWS, 1),
                (KIND_PAGE_ROWS, 2), (KIND_MASKED_PAGED, 3), (KIND_MASKED_PAGED, 5), (KIND_MASKED_PAGED, 6)}
#: (kind, operand) a kind may take whole from a resizable external (a cache [B, H, Cap, D]), reading its capacity
#: when replayed (``Program.execute`` sets the kind's capacity parameter).
RESIZABLE_WHOLE = {(KIND_DECODE_TOKEN, 5), (KIND_DECODE_TOKEN, 6), (KIND_CACHE_ROWS, 1), (KIND_MASKED_DECODE, 1),
                   (KIND_MASKED_DECODE, 2), (KIND_SCATTER_ROWS, 1), (KIND_NONPAD_DECODE, 1), (KIND_NONPAD_DECODE, 2)}
cdef enum:
    RAGGED_P = 14
    RAGGED_M = 15
#: Operands that are not arrays: (kind, position) -> the address of the C arguments they stand for.
_OPAQUE = {(KIND_MATMUL_NBITS, 1), (KIND_MATMUL_DYNAMIC, 1)}


include "step_checks.pxi"
include "step_rewrites.pxi"
include "step_cache_writes.pxi"


cdef inline uintptr_t _addr(a):
    return <uintptr_t>a.__array_interface__["data"][0]


cdef class Program:
    """Recorded kernel calls replayed as one (see the module docstring).

    ``Program(calls, externals, pinned, ragged, resizable)``: ``calls`` as :attr:`Recorder.calls`
    noted them (only the kinds of ``_record.pxd``); ``externals`` the arrays of
    the recorded run whose memory changes from run to run (each C-contiguous);
    ``pinned`` the indices of externals that must be at their recorded address
    in every run (memory the caller owns and may hand to the calls for reuse:
    an operand inside a pinned external's bounds is that same memory);
    ``ragged`` the indices of externals whose last dim may change and
    ``resizable`` those whose dim 2 may (see the module docstring).  Raises
    ValueError naming the call when an operand straddles an external array's
    bounds, a kind is unknown, a ragged external is taken other than whole by a
    prelude call or a paged decode call's tables (``RAGGED_WHOLE``, which must be), a paged decode call's
    planes or rows do not fit its tables, a resizable one other than whole as a decode call's cache, a
    prelude call reads memory
    that is not external or that a call writes or writes external memory, or
    when there are more than 64 external arrays.
    """
    def __cinit__(self):
        self.calls = NULL
        self.exts = NULL
        self.written = NULL

    def __init__(self, list calls, list externals, pinned=(), ragged=(), resizable=()):
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
            self.exts[e].ragged = e in ragged and x.ndim >= 1
            self.exts[e].resizable = e in resizable and x.ndim == 4 and not self.exts[e].ragged
        prelude_written = []
        for c, (kind, arrays, ints, floats) in enumerate(calls):
            _check_call(c, kind, arrays, ints, floats)
            cl = &self.calls[c]
            cl.kind = kind
            for j, v in enumerate(ints):
                cl.i[j] = v
            for j, v in enumerate(floats):
                cl.f[j] = v
            for j, a in enumerate(arrays):
                cl.ext[j] = -1
                if a is None:
                    continue
                if (kind, j) in _OPAQUE:   # a packed weight object: baked, kept alive here
                    cl.p[j] = <void *>(nbits_weight_address(a) if kind == KIND_MATMUL_NBITS else int8_weight_address(a))
                    self.keep.append(a)
                    continue
                if not a.flags.c_contiguous:   # the calls read [address, + nbytes) in C order
                    raise ValueError(f"Program: operand {j} of call {c} is not C-contiguous")
                lo, hi = _addr(a), _addr(a) + a.nbytes
                inside = [k for k, (b0, b1) in enumerate(bounds) if b0 <= lo and hi <= b1 and hi > lo]
                crossing = [k for k, (b0, b1) in enumerate(bounds) if lo < b1 and b0 < hi and k not in inside]
                if crossing:
                    raise ValueError(f"Program: operand {j} of call {c} straddles external array {crossing[0]}")
                whole = (PRELUDE.get(kind) == j or (kind, j) in RAGGED_WHOLE) and inside and bounds[inside[0]] == (lo, hi)
                if inside and self.exts[inside[0]].ragged and not whole:
                    raise ValueError(f"Program: operand {j} of call {c} lies in ragged external array {inside[0]}")
                if (kind, j) in RAGGED_WHOLE and not (whole and self.exts[inside[0]].ragged):
                    raise ValueError(f"Program: operand {j} of call {c} must be a whole ragged external array")
                if inside and self.exts[inside[0]].resizable and not (
                        (kind, j) in RESIZABLE_WHOLE and bounds[inside[0]] == (lo, hi)):
                    raise ValueError(f"Program: operand {j} of call {c} lies in resizable external array {inside[0]}")
                if kind in PRELUDE and (PRELUDE[kind] == j) != bool(inside):
                    raise ValueError(f"Program: operand {j} of prelude call {c} must be external iff it is read")
                if kind in PRELUDE and j in WRITTEN[kind]:
                    prelude_written.append((lo, hi))
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
            if not _operands_fit(kind, arrays, ints):
                raise ValueError(f"Program: call {c} (kind {kind}): its arrays' shapes or integer types are not the "
                                 "ones its parameters give")
        self.n_written = len(written)
        self.written = <uintptr_t *>malloc(max(1, 2 * self.n_written) * sizeof(uintptr_t))
        if self.written == NULL:
            raise MemoryError("Program: could not allocate the written ranges")
        for j, (w0, w1) in enumerate(written):
            self.written[2 * j] = w0
            self.written[2 * j + 1] = w1
        for e, (b0, b1) in enumerate(bounds):
            if e in pinned or any(b0 < w1 and w0 < b1 for w0, w1 in written):
                self.exts[e].pinned = b0     # the external viewed memory this program writes, or the caller's
        decided = [w for w in written if w not in prelude_written]
        for w0, w1 in prelude_written:   # run first, so only their own memory may hold what they write
            if sum(w0 < x1 and x0 < w1 for x0, x1 in written) > 1:
                raise ValueError("Program: another call writes the memory a prelude call writes")
        for c, (kind, arrays, _, _) in enumerate(calls):
            for j in CHECKED.get(kind, ()):
                lo, hi = _addr(arrays[j]), _addr(arrays[j]) + arrays[j].nbytes
                e = self.calls[c].ext[j]
                if any(lo < w1 and w0 < hi for w0, w1 in decided) or (e >= 0 and self.exts[e].written):
                    raise ValueError(f"Program: operand {j} of call {c} decides the call but a call writes it")
            if kind in PRELUDE and self.exts[self.calls[c].ext[PRELUDE[kind]]].written:
                raise ValueError(f"Program: prelude call {c} reads an external array a call writes")

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
        values of this run (a gather index out of range, a decode position
        other than the committed length, a full cache: :attr:`refused` is then
        True); True once every call ran.  Raises
        MemoryError when a call cannot allocate its workspace (the calls before
        it ran).
        """
        cdef void *bases[MAX_EXT]
        cdef int64_t lens[MAX_EXT]    # the last dim of each ragged external now
        cdef int done
        self.refused = False
        if not self.bind(externals, bases, lens):
            return False
        done = self.execute(bases, lens, okv_settings_get())
        if done < 0:
            raise MemoryError(f"Program: call {-1 - done} could not allocate its workspace")
        self.refused = done == 0
        return done == 1

    cdef bint bind(self, list externals, void **bases, int64_t *lens) except -1:
        """Check ``externals`` against the recording (the module docstring); fill ``bases`` (their addresses)
        and ``lens`` (the last dim of each ragged one, dim 2 of each resizable one) and return True, or False
        when one differs."""
        cdef int e, j, flags
        cdef Py_buffer view
        cdef ext_t *x
        cdef uintptr_t his[MAX_EXT]
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
                if view.ndim != x.ndim or view.itemsize != x.itemsize \
                        or (view.len != x.nbytes and not x.ragged and not x.resizable) \
                        or view.format == NULL or strcmp(view.format, x.format) != 0:
                    return False
                for j in range(x.ndim - 1 if x.ragged else x.ndim):
                    if view.shape[j] != x.shape[j] and not (x.resizable and j == 2):
                        return False
                if x.ragged:
                    lens[e] = view.shape[x.ndim - 1]
                    if lens[e] > INT32_MAX:
                        return False
                elif x.resizable:
                    lens[e] = view.shape[2]
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
                his[e] = hi
            finally:
                PyBuffer_Release(&view)
        for e in range(self.n_ext):     # an external a call writes overlaps no other external
            if self.exts[e].written:
                for j in range(self.n_ext):
                    if j != e and <uintptr_t>bases[j] < his[e] and <uintptr_t>bases[e] < his[j]:
                        return False
        return True

    cdef int execute(self, void **bases, const int64_t *lens, okv_settings s) noexcept:
        """Run the calls on externals at ``bases`` (checked by :meth:`bind`; a ragged one ``lens[e]`` long
        in its last dim, within what was bound; a resizable one of capacity ``lens[e]``): 1 when every call ran, 0 when one refused its values (only
        the prelude calls ran), ``-1 - c`` when call ``c`` could not allocate its workspace."""
        cdef int c, j
        cdef call_t *cl
        for c in range(self.n):
            cl = &self.calls[c]
            for j in range(NP):
                if cl.ext[j] >= 0:
                    cl.p[j] = <char *>bases[cl.ext[j]] + cl.off[j]
        for c in range(self.n):    # the prelude calls, from the externals alone
            cl = &self.calls[c]
            if cl.kind == KIND_MASK_LENGTHS:
                if self.exts[cl.ext[0]].ragged:
                    cl.i[1] = lens[cl.ext[0]]
                _mask_lengths(cl)
        for c in range(self.n):    # paged decode calls take the sizes of this run's page and block tables
            cl = &self.calls[c]
            if cl.kind == KIND_DECODE_PAGED:   # both whole ragged externals (checked when built)
                cl.i[RAGGED_P], cl.i[RAGGED_M] = lens[cl.ext[5]], lens[cl.ext[6]]
            elif cl.kind == KIND_PAGE_ROWS:
                cl.i[RAGGED_P], cl.i[RAGGED_M] = lens[cl.ext[1]], lens[cl.ext[2]]
            elif cl.kind == KIND_MASKED_PAGED:   # and the mask's keys
                cl.i[RAGGED_P], cl.i[RAGGED_M], cl.i[8] = lens[cl.ext[5]], lens[cl.ext[6]], lens[cl.ext[3]]
        for c in range(self.n):    # cache calls take the capacity of this run's caches
            cl = &self.calls[c]
            if cl.kind == KIND_DECODE_TOKEN and cl.ext[5] >= 0 and self.exts[cl.ext[5]].resizable:
                if cl.ext[6] < 0 or not self.exts[cl.ext[6]].resizable or lens[cl.ext[5]] != lens[cl.ext[6]]:
                    return 0
                cl.i[2] = lens[cl.ext[5]]
            elif cl.kind in (KIND_CACHE_ROWS, KIND_SCATTER_ROWS) and cl.ext[1] >= 0 and self.exts[cl.ext[1]].resizable:
                cl.i[4] = lens[cl.ext[1]]
            elif cl.kind == KIND_NONPAD_DECODE:   # the whole of this run's static caches
                if cl.ext[1] >= 0 and self.exts[cl.ext[1]].resizable:
                    if cl.ext[2] < 0 or not self.exts[cl.ext[2]].resizable or lens[cl.ext[1]] != lens[cl.ext[2]]:
                        return 0
                    cl.i[5] = lens[cl.ext[1]]
            elif cl.kind == KIND_MASKED_DECODE:   # the mask: a whole ragged external (checked when built)
                if cl.ext[1] >= 0 and self.exts[cl.ext[1]].resizable:
                    if cl.ext[2] < 0 or not self.exts[cl.ext[2]].resizable or lens[cl.ext[1]] != lens[cl.ext[2]]:
                        return 0
                    cl.i[5] = lens[cl.ext[1]]
                cl.i[8] = lens[cl.ext[3]]
        for c in range(self.n):    # every other call accepts this run's values before any runs
            if not _admit(&self.calls[c]):
                return 0
        for c in range(self.n):
            if self.calls[c].kind != KIND_MASK_LENGTHS and _dispatch(&self.calls[c], s) != 0:
                return -1 - c
        return 1


def _ints(a, itemsize: int, shape: tuple) -> bool:
    """Whether ``a`` is a signed integer array of ``itemsize`` bytes and ``shape``."""
    return a is not None and a.dtype.kind == "i" and a.itemsize == itemsize and a.shape == shape


def _operands_fit(int kind, arrays, ints) -> bool:
    """Whether the arrays of a cache-row, scatter or masked-decode call have the shapes its int parameters give
    and their positions, lengths and scratch are the integer arrays the replay reads and writes (int64 positions
    and ends, int32 scratch).  Other kinds: True (their kernels check their operands)."""
    if kind == KIND_DECODE_TOKEN:   # B rows of S tokens (q, k, v: the memory their token rows span)
        hq, hkv, cap, d, n = ints[0], ints[1], ints[2], ints[3], ints[8]
        qs, ks, vs, b = ints[9], ints[10], ints[11], ints[14]
        return (b >= 1 and n >= 1 and min(qs - hq * d, ks - hkv * d, vs - hkv * d) >= 0
                and arrays[5].shape == arrays[6].shape == (b, hkv, cap, d) and arrays[9].size == b * n * hq * d
                and arrays[0].size >= (b * n - 1) * qs + hq * d and arrays[1].size >= (b * n - 1) * ks + hkv * d
                and arrays[2].size >= (b * n - 1) * vs + hkv * d
                and _ints(arrays[7], 4, (b,)) and _ints(arrays[8], 4, (1,)) and _ints(arrays[10], 8, (2, b))
                and arrays[11].shape == (2, b, hkv, n, d) and arrays[11].flags.c_contiguous)
    if kind == KIND_CACHE_ROWS:
        return len(ints) > 4 and _ints(arrays[2], 8, (1,)) and arrays[0].shape == tuple(ints[:4])
    if kind == KIND_SCATTER_ROWS:
        b, h, s, d, cap = ints[:5]
        return (arrays[0].shape == arrays[3].shape == (b, h, s, d) and arrays[1].shape == (b, h, cap, d)
                and _ints(arrays[2], 8, (b,)) and _ints(arrays[4], 8, (b,)))
    if kind in (KIND_MASKED_DECODE, KIND_NONPAD_DECODE):
        b, hq, hkv, s, d, cap, mb, ms, t = ints[:9]
        return (arrays[0].shape == arrays[4].shape == (b, hq, s, d)
                and arrays[1].shape == arrays[2].shape == (b, hkv, cap, d) and arrays[3].shape == (mb, 1, ms, t)
                and _ints(arrays[5], 8, (1,) if kind == KIND_MASKED_DECODE else (b,))
                and _ints(arrays[6], 4, (b,)) and _ints(arrays[7], 4, (b,)) and _ints(arrays[8], 4, (b, s)))
    return True


cdef inline bint _admit(const call_t *c) noexcept nogil:
    """Whether a call accepts the values of this run (read from operands no call writes: CHECKED)."""
    cdef int64_t i, v, pos, total, n
    cdef const int64_t *idx
    if c.kind == KIND_GATHER_ROWS:     # every index in [-N, N) (wrap), else in [0, N)
        idx = <const int64_t *>c.p[1]
        for i in range(c.i[2]):
            v = idx[i]
            if v < (-c.i[0] if c.i[3] else 0) or v >= c.i[0]:
                return False
    elif c.kind == KIND_DECODE_TOKEN:  # the committed lengths, room in the cache and the rotary tables
        n, v, total = c.i[8], -1, (<const int32_t *>c.p[8])[0]
        for i in range(c.i[14]):   # each row at most at its committed length (one row: at it); several tokens:
            pos = <int64_t>(<const int32_t *>c.p[7])[i] + 1 - n     # rows of one length
            if (pos != (<const int64_t *>c.p[10])[i] if c.i[14] == 1 else pos > (<const int64_t *>c.p[10])[i]) \
                    or pos < 0 or pos > c.i[2] - n or pos > INT32_MAX - n \
                    or (c.p[3] != NULL and pos > c.i[7] - n) or (n > 1 and i > 0 and pos != v):
                return False
            v = pos if pos > v else v
        if total != v + n or total <= n:
            return False
    elif c.kind == KIND_DECODE_PAGED:
        return _paged_admitted(c)
    elif c.kind == KIND_PAGE_ROWS:
        return _page_rows_admitted(c)
    elif c.kind == KIND_MASKED_PAGED:
        return _masked_paged_admitted(c)
    elif c.kind == KIND_CACHE_ROWS:    # rows at the committed length, within the capacity
        pos = (<const int64_t *>c.p[2])[0]
        return 0 <= pos <= c.i[4] - c.i[2]
    elif c.kind == KIND_SCATTER_ROWS:  # every row's positions within the capacity (TensorScatter's linear mode)
        idx = <const int64_t *>c.p[2]
        for i in range(c.i[0]):
            if idx[i] < 0 or idx[i] > c.i[4] - c.i[2]:
                return False
    elif c.kind == KIND_NONPAD_DECODE:  # every key of the caches, and the mask and the rows' ends describe ranges
        if c.i[8] != c.i[5]:
            return False
        return masked_ranges(c.p[3], <int>c.i[9], <int>c.i[10], c.i[6], c.i[7], c.i[8], c.i[0], c.i[3],
                             <int32_t *>c.p[7], <int32_t *>c.p[8], <const int64_t *>c.p[5], NULL)
    elif c.kind == KIND_MASKED_DECODE:  # the new rows end the keys, and the mask describes ranges (into scratch)
        total = c.i[8]
        if total != (<const int64_t *>c.p[5])[0] + c.i[3] or total > c.i[5]:
            return False
        return masked_ranges(c.p[3], <int>c.i[9], <int>c.i[10], c.i[6], c.i[7], total, c.i[0], c.i[3],
                             <int32_t *>c.p[7], <int32_t *>c.p[8], NULL, NULL)
    elif c.kind == KIND_ROTARY:        # every position in [0, max_pos)
        idx = <const int64_t *>c.p[3]
        for i in range(c.i[0] * c.i[1]):
            if idx[i] < 0 or idx[i] >= c.i[4]:
                return False
    return True


cdef inline bint _paged_admitted(const call_t *c) noexcept nogil:
    """KIND_DECODE_PAGED (_record.pxd): every row appends at its committed length, into a position whose page
    the run staged, the total fits, and every position and page the call touches passes ``decode_paged_ok``."""
    cdef const int32_t *seqlens = <const int32_t *>c.p[7]
    cdef const int64_t *lengths = <const int64_t *>c.p[10]
    cdef int64_t b, B = c.i[8], S = c.i[PAGED_S], P = c.i[RAGGED_P], top = -1, committed = 0
    cdef int64_t total = (<const int32_t *>c.p[8])[0]
    if B < 1 or S < 1 or P < 1 or c.i[RAGGED_M] < 1:
        return False
    for b in range(B):   # seqlens[b]: the row's last new position; S > 1: every row's the same (GQA's rule)
        if <int64_t>seqlens[b] + 1 - S != lengths[b] or lengths[b] < 0 or seqlens[b] >= lengths[B + b] \
                or (S > 1 and seqlens[b] != seqlens[0]):
            return False
        if seqlens[b] > top:
            top = seqlens[b]
        if lengths[b] > committed:
            committed = lengths[b]
    if total <= S or total <= top or total > committed + S:
        return False
    return decode_paged_ok(<const uint64_t *>c.p[5] + c.i[9] * P, <const uint64_t *>c.p[5] + c.i[10] * P, P,
                           <const int32_t *>c.p[6], c.i[RAGGED_M], c.i[3], seqlens, B, S,
                           c.i[7] if c.p[3] != NULL else -1, c.i[6], NULL, NULL, 0, 0)


cdef inline int _dispatch(call_t *c, okv_settings s) noexcept:
    """Run one admitted call (the operand order of ``_record.pxd``); 0, or -1 when memory ran out."""
    if c.kind == KIND_DECODE_TOKEN:
        return _decode_token(c, s)
    cdef int64_t stats[2]     # a paged decode call's figures (a replay records no events)
    if c.kind == KIND_DECODE_PAGED:
        return decode_paged_ptr(c.p[0], c.i[11], c.p[1], c.i[12], c.p[2], c.i[13], <const float *>c.p[3],
                                <const float *>c.p[4], c.i[4], <int>c.i[5], <const uint64_t *>c.p[5] + c.i[9] * c.i[RAGGED_P],
                                <const uint64_t *>c.p[5] + c.i[10] * c.i[RAGGED_P], <const int32_t *>c.p[6],
                                c.i[RAGGED_M],
                                c.i[3], <const int32_t *>c.p[7], c.i[8], c.i[PAGED_S], c.i[0], c.i[1], c.i[2],
                                c.f[0], c.f[1],
                                c.i[6], c.p[9], s, stats, <int>c.i[17], <int>c.i[18], NULL)
    if c.kind == KIND_MASKED_DECODE:
        return masked_decode_ptr(c.p[0], c.p[1], c.p[2], c.i[0], c.i[1], c.i[2], c.i[3], c.i[4], c.i[5], c.i[8],
                                 <const int32_t *>c.p[7], <const int32_t *>c.p[8], <int32_t *>c.p[6], c.f[0], c.f[1],
                                 c.p[4], s, <int>c.i[11], <int>c.i[12], NULL)
    if c.kind == KIND_NONPAD_DECODE:
        return masked_decode_ptr(c.p[0], c.p[1], c.p[2], c.i[0], c.i[1], c.i[2], c.i[3], c.i[4], c.i[5], c.i[8],
                                 <const int32_t *>c.p[7], <const int32_t *>c.p[8], <int32_t *>c.p[6], c.f[0], c.f[1],
                                 c.p[4], s, <int>c.i[11], <int>c.i[12], <const int64_t *>c.p[5])
    if c.kind == KIND_PAGE_ROWS:
        return page_rows_ptr(c.p[0], <const uint64_t *>c.p[1] + c.i[5] * c.i[RAGGED_P], <const int32_t *>c.p[2],
                             c.i[RAGGED_M], c.i[4], <const int32_t *>c.p[4], c.i[0], c.i[1], c.i[2], c.i[3],
                             <int>c.i[6], <int>c.i[7], s)
    if c.kind == KIND_MASKED_PAGED:
        return _masked_paged(c, s, stats)
    if c.kind == KIND_CACHE_ROWS:
        _cache_rows(c)
    elif c.kind == KIND_SCATTER_ROWS:
        _scatter_rows(c)
    elif c.kind == KIND_ROTARY:
        rope_ptr(<const float *>c.p[0], <const float *>c.p[1], <const float *>c.p[2], <const int64_t *>c.p[3], c.i[0],
                 c.i[1], c.i[2], c.i[3], c.i[5], <int>c.i[6], <float *>c.p[4], s)
    elif c.kind == KIND_GATHER_ROWS:
        gather_rows_ptr(<const float *>c.p[0], c.i[0], c.i[1], <const int64_t *>c.p[1], c.i[2], <float *>c.p[2],
                        c.i[3] != 0)
    elif c.kind == KIND_MATMUL_NBITS:
        return -1 if matmul_nbits_ptr(c.p[1], <const float *>c.p[0], c.i[0], <const float *>c.p[2],
                                      <float *>c.p[3], <int>c.i[1], s) != 0 else 0
    elif c.kind == KIND_MATMUL_DYNAMIC:
        return -1 if matmul_dynamic_ptr(c.p[1], <const float *>c.p[0], c.i[0], <const float *>c.p[2],
                                        <float *>c.p[3], s) != 0 else 0
    elif c.kind == KIND_MATMUL_PACKED:
        return -1 if matmul_packed_ptr(<const float *>c.p[0], c.i[0], c.i[1], c.p[1], <int>c.i[4], c.i[2],
                                       c.i[3], <const float *>c.p[2], <float *>c.p[3], s) != 0 else 0
    elif c.kind == KIND_RMS_NORM:
        rms_f32_ptr(<const float *>c.p[0], <const float *>c.p[1], c.f[0], <float *>c.p[2], c.i[0], c.i[1], s)
    elif c.kind == KIND_SKIP_RMS_NORM:
        skip_rms_f32_ptr(<const float *>c.p[0], <const float *>c.p[1], <const float *>c.p[3],
                         <const float *>c.p[2], c.f[0], <float *>c.p[4], <float *>c.p[5], c.i[0], c.i[1], s)
    elif c.kind == KIND_ACTIVATION:
        act_f32_ptr(<int>c.i[0], <const float *>c.p[0], <const float *>c.p[1], <float *>c.p[2], c.i[1], s)
    elif c.kind == KIND_CONVERT:
        convert_ptr(c.p[0], c.p[1], c.i[0], <int>c.i[1], s)
    elif c.kind == KIND_CONCAT:
        concat_ptr(<const char *>c.p[0], <const char *>c.p[1], <char *>c.p[2], c.i[0], c.i[1], c.i[2])
    elif c.kind == KIND_COPY_ROWS:
        copy_rows_ptr(<const char *>c.p[0], <char *>c.p[1], c.i[0], c.i[1], c.i[2])
    return 0


cdef inline void _mask_lengths(call_t *c) noexcept nogil:
    """KIND_MASK_LENGTHS (_record.pxd): seqlens[b] = int32(sum(mask[b]) - 1), wrapping as NumPy's int64 does
    (unsigned arithmetic, then the low 32 bits), and total = L (at most INT32_MAX, checked by the caller)."""
    cdef const uint64_t *mask = <const uint64_t *>c.p[0]
    cdef int32_t *seqlens = <int32_t *>c.p[1]
    cdef int64_t b, l, L = c.i[1]
    cdef uint64_t acc
    for b in range(c.i[0]):
        acc = 0
        for l in range(L):
            acc += mask[b * L + l]
        seqlens[b] = <int32_t><uint32_t>(acc - 1)
    (<int32_t *>c.p[2])[0] = <int32_t>L


cdef inline int _decode_token(call_t *c, okv_settings s) noexcept nogil:
    """KIND_DECODE_TOKEN (_record.pxd), admitted: each row at the position it reads now (pos_io[1]), the committed
    bytes it writes over kept in the undo operand first (rewrites: _keep_overwritten)."""
    cdef int64_t *pos = <int64_t *>c.p[10] + c.i[14]
    cdef int64_t b
    for b in range(c.i[14]):
        pos[b] = <int64_t>(<const int32_t *>c.p[7])[b] + 1 - c.i[8]
    _keep_overwritten(c, pos)
    if decode_token_ptr(c.p[0], c.i[9], c.p[1], c.i[10], c.p[2], c.i[11], <const float *>c.p[3],
                        <const float *>c.p[4], c.i[4], <int>c.i[5], c.p[5], c.p[6], c.i[14], c.i[0], c.i[1], c.i[2],
                        c.i[3], c.i[8], pos, c.f[0], c.f[1], c.i[6], c.p[9], s, <int>c.i[12], <int>c.i[13]) != 0:
        return -1
    return 0
