"""Decode-sized float32 matmul: out[M, N] = x[M, K] @ w[K, N] (+ bias[N]).

Two entry points, both for small M (batch x new tokens) and run in the
kernels' OpenMP pool (keeping BLAS and its busy-waiting threads off the decode
path); larger M is correct but not the target.  Each output element is summed
in the same order whatever the thread count, so results do not depend on it.

* ``matmul_rows``: ONNX MatMul layout (w row-major [K, N]), for weights known
  only at run time.  The threads split N into column segments and each segment
  computes all M rows, streaming its slice of every weight row in order, so the
  weight matrix is read once per call.  A single row with a long K is split
  along K instead (two contiguous halves of the weights, summed at the end).
* ``pack_weight`` / ``matmul_packed``: constant weights packed once into
  16-column panels ([ceil(N/16), K, 16], see matmul.h); register-tiled
  products with the accumulators in registers, each tile reading up to four
  adjacent panels side by side (several weight streams per thread keep a few
  rows as fast as one), the threads claiming chunks of panels: each streams
  its own contiguous range, then helps with the others' ends.  AVX-512 tiles
  where the CPU and OS run AVX-512 F/BW/VL/DQ (the calling thread's settings
  choose: ``KernelSettings(simd=...)``, ``set_packed_avx512``), AVX2, or
  scalar.  On cores shared with other processes a team
  member is often off its core, and every parallel region then waits for it
  (a decode step runs ~30 of these products): after two products in a row
  that waited for their team longer than the caller's own share took, the
  next products run on the calling thread alone, then the team is tried
  again (on free cores no product is late, so the team always runs).
"""
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from cython.parallel cimport prange

from onnxkv._kernels._runtime cimport (okv_avx512_usable, okv_bf16_usable, okv_grain, okv_now_ns, okv_settings,
                                       okv_settings_get, okv_settings_mine, okv_team_finished, okv_team_solo,
                                       okv_team_threads)
from onnxkv._kernels._ranges cimport _disjoint
from onnxkv._kernels._record cimport KIND_MATMUL_PACKED, recorder, refuse
import numpy as np

from . import _validate as V

cdef extern from "matmul.h" nogil:
    int64_t okv_matmul_plan(int64_t M, int64_t N, int nt, int64_t *width)
    void okv_matmul_seg_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                            const float *bias, float *out, int64_t n0, int64_t nb, int simd)

cdef extern from "matmul_packed.h" nogil:
    int64_t okv_mmp_panels(int64_t N)
    void okv_mmp_pack_rows(const void *w, int64_t K, int64_t N, void *wp, int64_t k0, int64_t k1, size_t esz)
    void okv_matmul_packed_ld(const float *x, int64_t M, int64_t K, const void *wp, int half, int64_t N,
                              int64_t ldc, const float *bias, float *out, int64_t p0, int64_t p1, int isa)
    int64_t okv_matmul_packed_claim(const float *x, int64_t M, int64_t K, const void *wp, int half, int64_t N,
                                    const float *bias, float *out, uint64_t *ranges, int nt, int t,
                                    int64_t chunk, int isa)
    int64_t okv_matmul_claim_setup(uint64_t *ranges, int isa, int64_t M, int64_t K, int64_t P, int nt)
    int okv_mmp_avx512_usable()
    int OKV_MMP_SCALAR, OKV_MMP_AVX2, OKV_MMP_AVX512

cdef extern from "claim.h" nogil:
    int64_t okv_claim_setup(uint64_t *ranges, int64_t P, int nt, int64_t unit)
    int64_t okv_claim_run(uint64_t *ranges, int nt, int t, int64_t chunk, void (*fn)(void *, int64_t, int64_t),
                          void *ctx)

cdef extern from "matmul_bf16.h" nogil:
    ctypedef struct okv_mmb_work:
        const uint32_t *xb
        const float *wp
        const float *bias
        float *out
        uint16_t *wb
        int64_t M, K, N, ws
        int hw
    void okv_mmb_work_range(void *ctx, int64_t lo, int64_t hi)
    int64_t okv_mmb_ws_halves(int64_t M, int64_t K)
    void okv_bf16_rows(const float *x, int64_t M, int64_t K, uint32_t *xb, int hw)
    int OKV_BF16_MIN_ROWS

cdef extern from "fma_probe.h" nogil:
    float okv_fma_probe(int isa, int64_t n)
    int okv_fma_lanes(int isa)
    int OKV_FMA_CHAINS

DEF PAR_MIN = 1 << 16   # multiply-adds (M*K*N) each thread of a product gets at least (okv_grain)
DEF SPLIT_K_MIN = 256    # one-row products with K at least this are split in two halves of K


cdef int _one_row_split_k(const float[:, ::1] x, const float[:, ::1] w, const float *bias,
                          float[:, ::1] out, int nt, int simd) noexcept nogil:
    """One row (decode, batch 1): the two halves of K are streamed by different
    threads, each a contiguous half of the weight matrix (a column split makes
    both threads walk every weight row, which streams worse), then summed.  The
    split is the same for any thread count, so results do not depend on it.
    Returns 0, or -1 if the partial buffer could not be allocated."""
    cdef int64_t K = x.shape[1], N = w.shape[1]
    cdef int64_t half = (K // 2 + 3) & ~(<int64_t>3)
    cdef int64_t width = 0, nseg, s, n0, nb, k0, kn, n
    cdef int part
    cdef float *tmp = <float *>malloc(<size_t>N * sizeof(float))
    cdef float *dst
    cdef const float *b
    if tmp == NULL:
        return -1
    nseg = okv_matmul_plan(1, N, 1, &width)
    for part in prange(2, num_threads=2 if nt > 1 else 1, schedule='static'):
        if part == 0:
            dst = &out[0, 0]
            b = bias
            k0 = 0
            kn = half
        else:
            dst = tmp
            b = NULL
            k0 = half
            kn = K - half
        for s in range(nseg):
            n0 = s * width
            nb = N - n0
            if nb > width:
                nb = width
            okv_matmul_seg_f32(&x[0, k0], 1, kn, &w[k0, 0], N, b, dst, n0, nb, simd)
    for n in range(N):
        out[0, n] += tmp[n]
    free(tmp)
    return 0


cdef void _matmul(const float[:, ::1] x, const float[:, ::1] w, const float *bias,
                  float[:, ::1] out, okv_settings st) noexcept nogil:
    cdef int64_t M = x.shape[0], K = x.shape[1], N = w.shape[1]
    cdef int64_t width = 0, nseg, s, n0, nb
    cdef int simd = st.simd
    cdef int nt = okv_grain(st.threads, M * K * N, PAR_MIN)
    if M == 1 and K >= SPLIT_K_MIN and _one_row_split_k(x, w, bias, out, nt, simd) == 0:
        return
    nseg = okv_matmul_plan(M, N, nt, &width)
    if nt > nseg:
        nt = <int>nseg
    if nt == 1:
        for s in range(nseg):
            n0 = s * width
            nb = N - n0 if N - n0 < width else width
            okv_matmul_seg_f32(&x[0, 0], M, K, &w[0, 0], N, bias, &out[0, 0], n0, nb, simd)
        return
    for s in prange(nseg, num_threads=nt, schedule='static'):
        n0 = s * width
        nb = N - n0
        if nb > width:
            nb = width
        okv_matmul_seg_f32(&x[0, 0], M, K, &w[0, 0], N, bias, &out[0, 0], n0, nb, simd)


def matmul_rows(x, w, out, bias=None):
    """out = x @ w (+ bias), float32, for few rows (decode).

    x: [M, K], w: [K, N] (ONNX MatMul layout, row-major), out: [M, N], bias:
    optional [N]; all float32, C-contiguous, native byte order.  ``out`` must not
    overlap x, w or bias.  Raises ValueError naming the argument before writing.
    """
    V.array("x", x, (V.F32,), ndim=2)
    V.array("w", w, (V.F32,), ndim=2)
    M, K = x.shape
    if w.shape[0] != K:
        raise ValueError(f"w: expected {K} rows (x.shape[1]), got shape {w.shape}")
    V.array("out", out, (V.F32,), shape=(M, w.shape[1]), writeable=True)
    if _check_bias_overlap_empty(x, w, "w", out, bias):
        _matmul(x, w, _data_or_null(bias), out, okv_settings_get())


def _check_bias_overlap_empty(x, w, w_name, out, bias):
    """Checks of ``bias`` and of ``out`` overlapping an input, once x, w and out
    passed theirs; then the products with nothing to sum (M or N zero: no
    write; K zero: out = bias or 0).  Returns True when the kernel must run."""
    N = out.shape[1]
    if bias is not None:
        V.array("bias", bias, (V.F32,), shape=(N,))
    V.no_overlap("out", out, x, "x")
    V.no_overlap("out", out, w, w_name)
    V.no_overlap("out", out, bias, "bias")
    if out.shape[0] == 0 or N == 0:
        return False
    if x.shape[1] == 0:
        out[...] = 0.0 if bias is None else bias
        return False
    return True


cdef const float *_data_or_null(const float[::1] a):
    """First element of a (the caller keeps the array alive), or NULL for None."""
    return NULL if a is None else &a[0]


#: Columns per panel of the packed weight layout (``pack_weight``).
PANEL = 16

cdef int _avx512_usable = okv_mmp_avx512_usable()


def set_packed_avx512(enabled: bool) -> bool:
    """Let the calling thread's ``matmul_packed`` calls use their AVX-512
    tiles (when the CPU and OS support AVX-512) or only the AVX2 ones (to test
    and compare both on one machine).  One switch of the thread's settings
    with ``attention.set_attention_avx512`` (``KernelSettings(simd=...)``);
    other threads keep theirs.  The SIMD switch (``set_simd_enabled``) still
    selects the scalar path.  Returns whether the AVX-512 tiles are now in
    use."""
    okv_settings_mine().avx512 = okv_avx512_usable() if enabled else 0
    return bool(okv_settings_mine().avx512 and _avx512_usable)


cdef inline int _packed_isa(okv_settings s) noexcept nogil:
    if not s.simd:
        return OKV_MMP_SCALAR
    return OKV_MMP_AVX512 if s.avx512 and _avx512_usable else OKV_MMP_AVX2


cdef void _pack(const char *w, int64_t K, int64_t N, char *wp, size_t esz, okv_settings s) noexcept nogil:
    cdef int64_t nblk = (K + 15) // 16, t, b0, b1
    cdef int nt = s.threads
    if K * N < PAR_MIN:
        nt = 1
    if nt > nblk:
        nt = <int>nblk
    for t in prange(nt, num_threads=nt, schedule='static'):
        b0 = nblk * t // nt
        b1 = nblk * (t + 1) // nt
        okv_mmp_pack_rows(w, K, N, wp, b0 * 16, K if b1 * 16 > K else b1 * 16, esz)


cdef uintptr_t _address(a):
    return <uintptr_t>a.__array_interface__["data"][0]


def pack_weight(w):
    """The packed layout of a MatMul weight, for ``matmul_packed``.

    w: [K, N] float32 or float16, C-contiguous, native byte order (ONNX MatMul
    layout).  Returns a new array wp [P, K, 16] of w's dtype with P = ceil(N /
    16): wp[p, k, j] is w[k, 16 p + j], zero where 16 p + j >= N.  Each panel
    wp[p] is one contiguous block and the array starts on a 64-byte boundary
    (every float32 wp[p, k] is one cache line, two float16 ones share one).  The
    caller owns the result; w is only read.  Raises ValueError naming ``w`` for
    a bad argument.
    """
    V.array("w", w, (V.F32, V.F16), ndim=2)
    Kd, N = w.shape
    P = (N + PANEL - 1) // PANEL
    n = P * Kd * PANEL
    buf = np.empty(n + 64 // w.itemsize, w.dtype)
    off = (-buf.ctypes.data % 64) // w.itemsize
    wp = buf[off:off + n].reshape(P, Kd, PANEL)
    if n:
        _pack(<const char *>_address(w), Kd, N, <char *>_address(wp), w.itemsize, okv_settings_get())
    return wp


DEF MAX_TEAM = 64            # threads of one product at most (the claim ranges live on the stack)


def _set_adaptive(enabled, solo=0):
    """Private switch for benchmarks and tests: let the calling thread's
    ``matmul_packed`` and ``matmul_nbits`` calls run alone after a late team
    (see ``okv_team_threads`` in _runtime.pyx; a setting of this thread only),
    and set the number of products still to run alone (process-wide heuristic
    state).  Returns the previous (enabled, products left)."""
    cdef okv_settings *s = okv_settings_mine()
    old = (bool(s.adaptive), okv_team_solo(max(0, int(solo))))
    s.adaptive = 1 if enabled else 0
    return old


cdef int matmul_packed_ptr(const float *x, int64_t M, int64_t K, const void *wp, int half, int64_t P,
                           int64_t N, const float *bias, float *out, okv_settings s) noexcept nogil:
    """out [M, N] = x [M, K] @ w (+ bias) with w packed as wp [P, K, PANEL] of float32 values, or of float16
    ones (``half``), P = ceil(N / PANEL); checked, non-empty, non-overlapping arguments (``matmul_packed``'s
    conditions).  Returns 0, or -1 with nothing written when the bfloat16 path (float32 panels, ``s.bf16`` and
    M >= OKV_BF16_MIN_ROWS: :func:`_matmul_bf16`) could not allocate its workspace.

    Threads claim chunks of panels (okv_matmul_packed_claim): each its own
    contiguous range from the front, then the others' from the back, so a
    thread that starts late or runs slower costs the team one chunk.  The team
    size comes from the late-team heuristic (okv_team_threads, _runtime.pyx),
    which this product then informs.  The result does not depend on any of it
    (one summation order for any split).  Called with the GIL held (the
    heuristic's counters are module state)."""
    cdef int64_t t, t0, chunk
    cdef uint64_t ranges[8 * MAX_TEAM]
    cdef int64_t done[1]
    cdef int isa = _packed_isa(s)
    cdef int nt = okv_grain(s.threads, M * K * N, PAR_MIN)
    if nt > P:
        nt = <int>P
    if P >= (<int64_t>1 << 31):   # beyond the claim words (a weight of > 2^35 columns)
        nt = 1
    if s.bf16 and M >= OKV_BF16_MIN_ROWS and not half:
        return _matmul_bf16(x, M, K, <const float *>wp, P, N, bias, out, s, nt)
    nt = okv_team_threads(s, nt)
    if nt == 1:
        okv_matmul_packed_ld(x, M, K, wp, half, N, N, bias, out, 0, P, isa)
        return 0
    if nt > MAX_TEAM:
        nt = MAX_TEAM
    chunk = okv_matmul_claim_setup(ranges, isa, M, K, P, nt)
    t0 = okv_now_ns()
    done[0] = t0
    for t in prange(nt, num_threads=nt, schedule='static'):
        okv_matmul_packed_claim(x, M, K, wp, half, N, bias, out, ranges, nt, t, chunk, isa)
        if t == 0:
            done[0] = okv_now_ns()
    okv_team_finished(s, t0, done[0])
    return 0


cdef int _matmul_bf16(const float *x, int64_t M, int64_t K, const float *wp, int64_t P, int64_t N,
                      const float *bias, float *out, okv_settings s, int nt) noexcept nogil:
    """``matmul_packed_ptr`` in bfloat16 (matmul_bf16.h): x rounded once into pairs, each thread rounding the
    panel lines of its tiles; the AVX-512-BF16 tiles at the AVX-512 level (``s.bf16`` is set only where the
    CPU has them), the portable twin below it.  Panels are claimed as in the float32 product (one summation
    order whatever the split).  Returns 0, or -1 with nothing written when memory cannot be allocated."""
    cdef okv_mmb_work w
    cdef uint64_t ranges[8 * MAX_TEAM]
    cdef int64_t chunk, t
    cdef uint32_t *xb = <uint32_t *>malloc(<size_t>(M * ((K + 1) // 2)) * sizeof(uint32_t))
    if nt > MAX_TEAM:
        nt = MAX_TEAM
    w.ws = okv_mmb_ws_halves(M, K)
    w.wb = <uint16_t *>malloc(<size_t>(w.ws * nt) * sizeof(uint16_t))
    if xb == NULL or w.wb == NULL:
        free(xb)
        free(w.wb)
        return -1
    w.hw = s.avx512
    okv_bf16_rows(x, M, K, xb, w.hw)
    w.xb, w.wp, w.bias, w.out, w.M, w.K, w.N = xb, wp, bias, out, M, K, N
    if nt == 1:
        okv_mmb_work_range(&w, 0, P)
    else:
        chunk = okv_matmul_claim_setup(ranges, OKV_MMP_AVX512, M, K, P, nt)
        for t in prange(nt, num_threads=nt, schedule='static'):
            okv_claim_run(ranges, nt, <int>t, chunk, okv_mmb_work_range, &w)
    free(xb)
    free(w.wb)
    return 0


cdef int _matmul_packed(const float[:, ::1] x, const void *wp, int half, int64_t P, const float *bias,
                        float[:, ::1] out, okv_settings s) except -1:
    """``matmul_packed_ptr`` on typed buffers; MemoryError when its workspace cannot be allocated."""
    if matmul_packed_ptr(&x[0, 0], x.shape[0], x.shape[1], wp, half, P, out.shape[1], bias, &out[0, 0], s) != 0:
        raise MemoryError(f"matmul_packed: could not allocate the bfloat16 workspace of a {x.shape[0]} x "
                          f"{x.shape[1]} x {out.shape[1]} product")
    return 0


cdef void _note_packed(x, wp, out, bias):
    """Note a packed product that ran (for a recording thread: _record.pyx)."""
    rec = recorder()
    if rec is not None:
        rec.note(KIND_MATMUL_PACKED, (x, wp, bias, out),
                 (x.shape[0], x.shape[1], wp.shape[0], out.shape[1], wp.dtype == np.float16), ())


BF16_MIN_ROWS = OKV_BF16_MIN_ROWS


def _bf16_pairs(x, bint hw):
    """Test hook: the bfloat16 pairs [M, ceil(K/2)] (uint32: low half x[2j], high x[2j+1]) that a bf16
    product rounds float32 ``x`` [M, K] into, by the AVX-512-BF16 conversion (``hw``, where
    :func:`onnxkv._kernels._runtime.bf16_available`) or the portable one."""
    cdef const float[:, ::1] xv = x
    cdef int64_t M = xv.shape[0], K = xv.shape[1]
    out = np.zeros((M, (K + 1) // 2), np.uint32)
    cdef uint32_t[:, ::1] ov = out
    if hw and not okv_bf16_usable():
        raise ValueError("_bf16_pairs: the AVX-512-BF16 conversion cannot run in this process")
    if M and K:
        okv_bf16_rows(&xv[0, 0], M, K, &ov[0, 0], 1 if hw else 0)
    return out


def _claim_in_turn(x, wp, out, int nt, order):
    """Test hook: run the panel claiming of a ``nt``-thread product on the
    calling thread, thread ``order[0]`` first to completion, then the others in
    ``order``; return the panels each took (the first takes every panel: its own
    range from the front, the others' from the back).  Arguments as
    ``matmul_packed`` (no bias)."""
    if x.shape[0] != out.shape[0] or wp.shape[1:] != (x.shape[1], PANEL) \
            or wp.shape[0] != (out.shape[1] + PANEL - 1) // PANEL or np.shares_memory(out, x) \
            or np.shares_memory(out, wp):
        raise ValueError(f"_claim_in_turn: shapes x {x.shape}, wp {wp.shape}, out {out.shape} do not fit")
    cdef const float[:, ::1] xv = x
    cdef const float[:, :, ::1] wv = wp
    cdef float[:, ::1] ov = out
    cdef int64_t M = xv.shape[0], K = xv.shape[1], N = ov.shape[1], P = wv.shape[0], chunk
    cdef uint64_t ranges[8 * MAX_TEAM]
    cdef int t, isa = _packed_isa(okv_settings_get())
    if not 1 <= nt <= min(P, MAX_TEAM):
        raise ValueError(f"nt: expected 1..{min(P, MAX_TEAM)}, got {nt}")
    chunk = okv_matmul_claim_setup(ranges, isa, M, K, P, nt)
    return [okv_matmul_packed_claim(&xv[0, 0], M, K, &wv[0, 0, 0], 0, N, NULL, &ov[0, 0], ranges, nt, <int>t, chunk,
                                    isa) for t in order]


cdef bint _packed_fast(x, wp, out, bias) except -1:
    """Run ``matmul_packed`` when every argument is valid and the product is not
    empty, all checked at C speed (typed buffers, shapes, address ranges: the
    conditions of the Python checks); return False, with nothing written, to send
    the call through those checks instead (which name the bad argument)."""
    cdef const float[:, ::1] xv
    cdef const unsigned char[:, :, ::1] wv
    cdef float[:, ::1] ov
    cdef const float[::1] bv
    cdef const float *bp = NULL
    cdef int64_t M, K, N
    cdef int half
    if not (isinstance(x, np.ndarray) and isinstance(wp, np.ndarray) and isinstance(out, np.ndarray)
            and (bias is None or isinstance(bias, np.ndarray))):
        return False
    if wp.dtype != np.float32 and wp.dtype != np.float16 or not wp.dtype.isnative:
        return False
    half = wp.dtype == np.float16
    try:
        xv = x
        wv = wp.view(np.uint8)
        ov = out
        if bias is not None:
            bv = bias
    except (ValueError, TypeError, BufferError):
        return False
    M, K, N = xv.shape[0], xv.shape[1], ov.shape[1]
    if M == 0 or K == 0 or N == 0 or wv.shape[1] != K or wv.shape[2] != PANEL * wp.itemsize or ov.shape[0] != M \
            or wv.shape[0] != (N + PANEL - 1) // PANEL:
        return False
    if bias is not None:
        if bv.shape[0] != N:
            return False
        bp = &bv[0]
    cdef size_t onb = <size_t>(M * N) * sizeof(float)
    if not (_disjoint(&ov[0, 0], onb, &xv[0, 0], <size_t>(M * K) * sizeof(float))
            and _disjoint(&ov[0, 0], onb, &wv[0, 0, 0], <size_t>(wv.shape[0] * K * wv.shape[2]))
            and (bp == NULL or _disjoint(&ov[0, 0], onb, bp, <size_t>N * sizeof(float)))):
        return False
    _matmul_packed(xv, &wv[0, 0, 0], half, wv.shape[0], bp, ov, okv_settings_get())
    return True


def matmul_packed(x, wp, out, bias=None):
    """out = x @ w (+ bias) with w given packed by ``pack_weight``; float32 sums.

    x: [M, K]; wp: [ceil(N / 16), K, 16] (``pack_weight(w)`` of w [K, N]), float32
    or float16 (widened exactly in registers: the result is that of the float32
    widening of w); out: [M, N]; bias: optional [N]; x, out and bias float32; all
    C-contiguous, native byte order.  The bfloat16 prompt path
    (``prefill_precision``) takes float32 panels only; float16 ones keep float32
    products.
    ``out`` must not overlap x, wp or bias.  Any M is correct; the kernel is
    built for few rows (the weights are read once per call and each thread
    streams a contiguous range of panels).  Each output element is summed in
    the same order whatever the thread count.  Raises ValueError naming the
    argument before writing.  (Called once per weight per decode step, so valid
    arguments are checked in C; only a failing check takes the Python checks.)
    """
    if _packed_fast(x, wp, out, bias):
        _note_packed(x, wp, out, bias)
        return
    V.array("x", x, (V.F32,), ndim=2)
    V.array("wp", wp, (V.F32, V.F16), ndim=3)
    M, Kd = x.shape
    if wp.shape[1:] != (Kd, PANEL):
        raise ValueError(f"wp: expected shape (P, {Kd}, {PANEL}) (pack_weight of a [{Kd}, N] weight), "
                         f"got {wp.shape}")
    V.array("out", out, (V.F32,), ndim=2, writeable=True)
    N = out.shape[1]
    if out.shape[0] != M or wp.shape[0] != (N + PANEL - 1) // PANEL:
        raise ValueError(f"out: expected shape ({M}, N) with ceil(N / {PANEL}) == {wp.shape[0]} "
                         f"(wp.shape[0]), got {out.shape}")
    if _check_bias_overlap_empty(x, wp, "wp", out, bias):
        _matmul_packed(x, <const void *>_address(wp), wp.dtype == np.float16, wp.shape[0], _data_or_null(bias), out,
                       okv_settings_get())
        _note_packed(x, wp, out, bias)
    else:
        refuse("matmul_packed: an empty product (nothing or only the bias written)")


def fma_peak_gflops(steps=20_000_000) -> float:
    """The float32 FMA throughput of this machine in GFLOP/s, measured now: every thread of the calling
    thread's settings runs ``steps`` steps of independent FMA chains of the widest vectors its SIMD level
    allows (the level ``matmul_packed`` uses); the FLOP of all threads over the wall time.  The peak the
    benchmarks measure the products and the attention against (``benchmarks/bench_prefill.py``)."""
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= 1 << 40:
        raise ValueError(f"fma_peak_gflops: steps must be an int in [1, 2**40], got {steps!r}")
    cdef okv_settings s = okv_settings_get()
    cdef int isa = _packed_isa(s), nt = s.threads, t
    cdef int64_t n = steps, t0
    cdef float sink = okv_fma_probe(isa, 1000)   # the vector units warmed
    t0 = okv_now_ns()
    for t in prange(nt, num_threads=nt, schedule="static", nogil=True):
        sink += okv_fma_probe(isa, n)
    seconds = (okv_now_ns() - t0) * 1e-9
    if sink != sink:  # consumed; the chains never reach NaN
        raise RuntimeError("fma_peak_gflops: the probe's chains became NaN")
    return 2.0 * OKV_FMA_CHAINS * okv_fma_lanes(isa) * n * nt / seconds / 1e9

