"""Products with 4- and 8-bit block-quantized weights (qmatmul.h).

``pack_nbits`` repacks a weight given in ONNX Runtime's MatMulNBits layout
(q [N, ceil(K / bs), bs * bits / 8] uint8, low nibble first; scales [N, nblk];
zero points packed uint8, float, or absent: 2^(bits-1)) once into
:class:`PackedNBits`, panels of 16 columns whose 64-byte lines are the operand
of one VNNI dot product (see qmatmul.h).  ``matmul_nbits`` then computes
out[M, N] = x[M, K] @ w (+ bias), w[k, n] = (q[n, k] - zp[n, b]) * scale[n, b]:

* ``int8=True`` (accuracy_level 4), any number of rows: each row's blocks
  are quantized to int8 once per call and the integer dot products run on
  the block kernels (AVX-512 VNNI, AVX-VNNI, AVX2 or scalar; every path
  gives the same bits).  AMX-INT8 tiles are not used: with per-block scales
  every 16 x 16 C tile must be stored and scaled once per block (32 values of
  K for the GenAI builder's weights), and that store bounds the tiles below
  the VNNI kernels' speed;
* ``int8=False``, up to ``DECODE_M`` rows (decode): the block kernels with
  float32 activations against weights converted in registers;
* ``int8=False``, more rows (prefill): each thread dequantizes four panels at
  a time into a buffer it owns and runs matmul.h's packed float32 kernel on
  them.

The threads claim the panels in chunks (claim.h); for decode-sized products
the late-team heuristic of matmul_packed (``_runtime.okv_team_threads``) runs
them alone for a while when a team member keeps arriving late.

The exact arithmetic of each path is the contract in qmatmul.h; the NumPy
twins are ``reference.matmul_nbits_int8`` and ``reference.matmul_nbits_f32``.
"""
from libc.stdint cimport int8_t, int64_t, uint8_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset
from cython.parallel cimport prange

from onnxkv._kernels._runtime cimport (okv_grain, okv_now_ns, okv_settings, okv_settings_get, okv_settings_mine,
                                       okv_team_finished, okv_team_threads)
from onnxkv._kernels._ranges cimport _disjoint
from onnxkv._kernels._record cimport KIND_MATMUL_NBITS, recorder
import numpy as np

from . import _validate as V

cdef extern from "qmatmul.h" nogil:
    ctypedef struct okv_qmm:
        int64_t M, K, N, P, nblk, bs
        int bits
        const uint8_t *qw
        const float *sc
        const float *zp
        float zconst
        const float *bias
        float *out
        const int8_t *xq
        const float *xs
        const float *xsum
        const float *x
        const float *lut
    int OKV_QMM_SCALAR, OKV_QMM_AVX2, OKV_QMM_AVXVNNI, OKV_QMM_AVX512
    void okv_qmm_quant_rows(const float *x, int64_t M, int64_t K, int64_t bs, int64_t nblk, int8_t *xq,
                            float *xs, float *xsum, int isa)
    void okv_qmm_float_rows(const float *x, int64_t M, int64_t K, int64_t bs, int64_t nblk, float *xp,
                            float *xsum)
    void okv_qmm_range(const okv_qmm *a, int int8, int64_t p0, int64_t p1, int isa)
    void okv_qmm_dequant_isa(const okv_qmm *a, int64_t p0, int64_t p1, float *dst, int isa)
    int okv_cpu_vnni512_ok()
    int okv_cpu_avxvnni_ok()
    int64_t okv_qmm_claim(const okv_qmm *a, int int8, int isa, uint64_t *ranges, int nt, int t, int64_t chunk)

cdef extern from "claim.h" nogil:
    int64_t okv_claim_setup(uint64_t *ranges, int64_t P, int nt, int64_t unit)

cdef extern from "matmul_packed.h" nogil:
    void okv_matmul_packed_f32_ld(const float *x, int64_t M, int64_t K, const float *wp, int64_t N, int64_t ldc,
                                  const float *bias, float *out, int64_t p0, int64_t p1, int isa)
    int okv_mmp_avx512_usable()
    int OKV_MMP_SCALAR, OKV_MMP_AVX2, OKV_MMP_AVX512

#: Rows up to which the float32 (int8=False) products run on the block kernels; more rows take the
#: dequantize + float32 path.  int8 products run on the block kernels at every row count.
DEF DECODE_ROWS = 8
DECODE_M = DECODE_ROWS
DEF DEQ_G = 4            # panels (of 16 columns) a prefill thread dequantizes at a time
#: Panels (of 16 columns) a prefill thread dequantizes at a time.
DEQ_PANELS = DEQ_G
DEF PAR_MIN = 1 << 15   # multiply-adds (M*K*N) each thread of a product gets at least (okv_grain)
DEF MAX_TEAM = 64        # threads of one product at most (the claim ranges live on the stack)

cdef int _vnni512 = okv_cpu_vnni512_ok()
cdef int _avxvnni = okv_cpu_avxvnni_ok()
cdef int _mmp512 = okv_mmp_avx512_usable()


def _set_vnni(enabled) -> tuple:
    """Test switch of the calling thread: let the int8 products use VNNI dot
    products (AVX-512 VNNI at the avx512 level, AVX-VNNI at the avx2 level)
    where the CPU has them, or the AVX2 VPMADDUBSW path.  Returns
    (previous setting, the int8 path the thread's settings now select)."""
    cdef okv_settings *s = okv_settings_mine()
    old = bool(s.vnni)
    s.vnni = 1 if enabled else 0
    return old, int8_path()


cdef int _int8_isa(okv_settings s) noexcept nogil:
    if not s.simd:
        return OKV_QMM_SCALAR
    if s.vnni and s.avx512 and _vnni512:
        return OKV_QMM_AVX512
    if s.vnni and _avxvnni:
        return OKV_QMM_AVXVNNI
    return OKV_QMM_AVX2


cdef int _float_isa(okv_settings s) noexcept nogil:
    if not s.simd:
        return OKV_QMM_SCALAR
    return OKV_QMM_AVX512 if s.avx512 and _mmp512 else OKV_QMM_AVX2


def int8_path() -> str:
    """The int8 path the calling thread's settings select: "avx512-vnni",
    "avx-vnni", "avx2" or "scalar"."""
    return {OKV_QMM_SCALAR: "scalar", OKV_QMM_AVX2: "avx2", OKV_QMM_AVXVNNI: "avx-vnni",
            OKV_QMM_AVX512: "avx512-vnni"}[_int8_isa(okv_settings_get())]


cdef class PackedNBits:
    """A block-quantized weight in the panel layout of qmatmul.h (read-only arrays, owned by this object).

    Attributes: K, N, bits (4 or 8), block_size, nblk = ceil(K / block_size),
    P = ceil(N / 16); qw uint8 [P, nblk, 16 * block_size * bits / 8]; sc float32
    [P, nblk, 16]; zp float32 [P, nblk, 16] or None (every zero point is
    ``zconst``: 2^(bits-1), or 0 with a codebook); lut: float32 [16], the values
    the 4-bit codes stand for (codebook weights: w = lut[q] * scale, float
    activations only), or None (w = (q - zp) * scale); nbytes: bytes held.
    """
    cdef readonly int64_t K, N, bits, block_size, nblk, P
    cdef readonly object qw, sc, zp, lut
    cdef readonly float zconst
    cdef okv_qmm base   # the weight fields of every call's arguments (pointers into the arrays above)

    @property
    def nbytes(self) -> int:
        return self.qw.nbytes + self.sc.nbytes + sum(0 if a is None else a.nbytes for a in (self.zp, self.lut))

    @property
    def arrays(self) -> tuple:
        """The arrays it reads (qw, sc, and zp and lut when present): views of another weight's arrays for a
        weight ``nbits_columns`` made, so memory counts that follow array bases count them once."""
        return tuple(a for a in (self.qw, self.sc, self.zp, self.lut) if a is not None)


def _panels(a, P, N, fill):
    """[N, nblk] -> [P, nblk, 16] float32, columns past N set to ``fill``."""
    nblk = a.shape[1]
    full = np.full((P * 16, nblk), fill, np.float32)
    full[:N] = a
    return np.ascontiguousarray(full.reshape(P, 16, nblk).transpose(0, 2, 1))


def pack_nbits(B, scales, zero_points, int64_t K, int64_t N, int bits, int64_t block_size, lut=None) -> PackedNBits:
    """Repack an ONNX Runtime MatMulNBits weight for ``matmul_nbits``.

    B: uint8 [N, nblk, block_size * bits / 8] (or the same bytes flat), nblk =
    ceil(K / block_size), 4-bit codes low nibble first along K.  scales:
    float32 with N * nblk elements ([N, nblk] order).  zero_points: None
    (2^(bits-1) everywhere), uint8 with N * ceil(nblk * bits / 8) elements
    (packed like B along the blocks of a column), or float32 with N * nblk
    elements.  bits: 4 or 8; block_size: a power of two in [16, 256]; K, N >= 1.
    lut: None, or float32 [16] (bits 4, no zero points): code q stands for
    lut[q] (w = lut[q] * scale), and only ``int8=False`` products take the weight.
    The arguments are only read.  Raises ValueError naming the argument and
    the expected shape, size or value.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits: expected 4 or 8, got {bits}")
    if not (16 <= block_size <= 256 and block_size & (block_size - 1) == 0):
        raise ValueError(f"block_size: expected a power of two in [16, 256], got {block_size}")
    if K < 1 or N < 1:
        raise ValueError(f"K, N: expected >= 1, got K={K}, N={N}")
    if lut is not None:
        if not isinstance(lut, np.ndarray) or lut.dtype != np.float32 or lut.shape != (16,):
            raise ValueError(f"lut: expected a float32 array of shape (16,), got "
                             f"{getattr(lut, 'dtype', type(lut).__name__)} {getattr(lut, 'shape', '')}")
        if bits != 4 or zero_points is not None:
            raise ValueError(f"lut: a codebook takes 4-bit codes and no zero points, got bits={bits}"
                             f"{'' if zero_points is None else ' and zero points'}")
    nblk = (int(K) + block_size - 1) // block_size  # Python ints: no product below wraps
    blob = block_size * bits // 8
    P = (N + 15) // 16
    for name, a, dt in (("B", B, np.uint8), ("scales", scales, np.float32)):
        if not isinstance(a, np.ndarray) or a.dtype != dt:
            raise ValueError(f"{name}: expected a {np.dtype(dt).name} array, got "
                             f"{getattr(a, 'dtype', type(a).__name__)}")
    if B.size != N * nblk * blob:
        raise ValueError(f"B: expected {N * nblk * blob} bytes ([N={N}, {nblk} blocks, {blob}]), got shape {B.shape}")
    if scales.size != N * nblk:
        raise ValueError(f"scales: expected {N * nblk} elements ([N={N}, {nblk} blocks]), got shape {scales.shape}")
    b = B.reshape(N, nblk, blob)
    if bits == 4:
        q = np.empty((N, nblk, block_size), np.uint8)
        q[:, :, 0::2] = b & 15
        q[:, :, 1::2] = b >> 4
    else:
        q = b
    qp = np.zeros((P * 16, nblk, block_size), np.uint8)
    qp[:N] = q
    if bits == 4:   # line j of a block: k = 8j + kk (low nibble) and 8j + 4 + kk (high), byte 4c + kk
        q6 = qp.reshape(P, 16, nblk, block_size // 8, 2, 4)
        lines = (q6[:, :, :, :, 0, :] | (q6[:, :, :, :, 1, :] << 4)).transpose(0, 2, 3, 1, 4)
    else:           # line j: k = 4j + kk, byte 4c + kk
        lines = qp.reshape(P, 16, nblk, block_size // 4, 4).transpose(0, 2, 3, 1, 4)
    cdef PackedNBits w = PackedNBits.__new__(PackedNBits)
    w.K, w.N, w.bits, w.block_size, w.nblk, w.P = K, N, bits, block_size, nblk, P
    w.qw = np.ascontiguousarray(lines).reshape(P, nblk, 16 * blob)
    w.sc = _panels(scales.reshape(N, nblk), P, N, 0.0)
    w.zconst = 0.0 if lut is not None else float(1 << (bits - 1))
    w.zp = None
    w.lut = None if lut is None else np.array(lut, np.float32)
    if zero_points is not None:
        w.zp = _panels(_zero_points(zero_points, N, nblk, bits), P, N, w.zconst)
    for a in (w.qw, w.sc, w.zp, w.lut):
        if a is not None:
            a.flags.writeable = False
    _set_base(w)
    return w


def nbits_columns(PackedNBits w not None, n0, n1) -> PackedNBits:
    """Columns [n0, n1) of ``w`` as a PackedNBits over the same arrays (read-only views, no copy; they keep
    ``w``'s memory alive).  n0 and n1 are ints (not bool), n0 starts a panel (a multiple of 16) and
    0 <= n0 < n1 <= w.N.  A product with the result computes each column as the product with ``w`` computes
    it (panels are independent), so its values are those columns of ``w``'s product bit for bit.  Raises
    ValueError naming the bad bound."""
    if not all(isinstance(b, (int, np.integer)) and not isinstance(b, (bool, np.bool_)) for b in (n0, n1)) \
            or not (0 <= n0 < n1 <= w.N) or n0 % 16:
        raise ValueError(f"nbits_columns: columns [{n0!r}, {n1!r}) of a weight of N={w.N}: expected ints "
                         f"0 <= n0 < n1 <= N with n0 a multiple of 16")
    cdef int64_t p0 = n0 // 16, p1 = (n1 + 15) // 16
    cdef PackedNBits v = PackedNBits.__new__(PackedNBits)
    v.K, v.N, v.bits, v.block_size, v.nblk, v.P = w.K, n1 - n0, w.bits, w.block_size, w.nblk, p1 - p0
    v.qw, v.sc = w.qw[p0:p1], w.sc[p0:p1]
    v.zp = None if w.zp is None else w.zp[p0:p1]
    v.lut, v.zconst = w.lut, w.zconst
    _set_base(v)
    return v


cdef void _set_base(PackedNBits w):
    cdef const uint8_t[:, :, ::1] qv = w.qw
    cdef const float[:, :, ::1] sv = w.sc
    cdef const float[:, :, ::1] zv
    cdef const float[::1] lv
    memset(&w.base, 0, sizeof(okv_qmm))
    w.base.K, w.base.N, w.base.P, w.base.nblk, w.base.bs, w.base.bits = w.K, w.N, w.P, w.nblk, w.block_size, w.bits
    w.base.qw, w.base.sc, w.base.zconst = &qv[0, 0, 0], &sv[0, 0, 0], w.zconst
    if w.zp is not None:
        zv = w.zp
        w.base.zp = &zv[0, 0, 0]
    if w.lut is not None:
        lv = w.lut
        w.base.lut = &lv[0]


def _zero_points(z, N, nblk, bits):
    """The zero points as float32 [N, nblk] (see pack_nbits)."""
    if not isinstance(z, np.ndarray) or z.dtype not in (np.uint8, np.float32):
        raise ValueError(f"zero_points: expected a uint8 or float32 array, got {getattr(z, 'dtype', type(z).__name__)}")
    if z.dtype == np.float32:
        if z.size != N * nblk:
            raise ValueError(f"zero_points: expected {N * nblk} float32 elements ([N={N}, {nblk} blocks]), "
                             f"got shape {z.shape}")
        return z.reshape(N, nblk)
    per_col = (nblk * bits + 7) // 8
    if z.size != N * per_col:
        raise ValueError(f"zero_points: expected {N * per_col} uint8 elements ([N={N}, {per_col}] packed "
                         f"{bits}-bit), got shape {z.shape}")
    z = z.reshape(N, per_col)
    if bits == 8:
        return z.astype(np.float32)
    u = np.empty((N, per_col * 2), np.uint8)
    u[:, 0::2] = z & 15
    u[:, 1::2] = z >> 4
    return u[:, :nblk].astype(np.float32)


cdef void _decode(okv_qmm *a, int int8, int isa, int nt, int64_t *done) noexcept nogil:
    """The panels shared by nt threads (the caller limits nt to whole 4-panel
    tiles) through claims (claim.h): each thread streams its own contiguous
    range in chunks of tiles, then helps with the others' ends, so a thread
    that starts late costs the team one chunk.  done[0]: when the calling
    thread finished its claims (okv_now_ns)."""
    cdef uint64_t ranges[8 * MAX_TEAM]
    cdef int64_t chunk, t
    if nt <= 1:
        okv_qmm_range(a, int8, 0, a.P, isa)
        done[0] = okv_now_ns()
        return
    chunk = okv_claim_setup(ranges, a.P, nt, 4)
    for t in prange(nt, num_threads=nt, schedule='static'):
        okv_qmm_claim(a, int8, isa, ranges, nt, <int>t, chunk)
        if t == 0:
            done[0] = okv_now_ns()


cdef int _prefill(okv_qmm *a, const float *x, int fisa, int misa, int nt) noexcept nogil:
    """Groups of DEQ_PANELS panels: dequantized into a buffer of each thread, then
    the packed float32 kernel for all M rows.  Returns -1 when a buffer cannot
    be allocated (out is then partly written)."""
    cdef int64_t G = DEQ_G, ng = (a.P + G - 1) // G, t, g, g0, g1, p0, p1, ncol
    cdef int failed = 0
    cdef float *buf
    if nt > ng:
        nt = <int>ng
    for t in prange(nt, num_threads=nt, schedule='static'):
        buf = <float *>malloc(<size_t>(G * a.K * 16) * sizeof(float))
        if buf == NULL:
            failed += 1
        else:
            g0 = ng * t // nt
            g1 = ng * (t + 1) // nt
            for g in range(g0, g1):
                p0 = g * G
                p1 = p0 + G if p0 + G < a.P else a.P
                ncol = a.N - p0 * 16 if a.N - p0 * 16 < (p1 - p0) * 16 else (p1 - p0) * 16
                okv_qmm_dequant_isa(a, p0, p1, buf, fisa)
                okv_matmul_packed_f32_ld(x, a.M, a.K, buf, ncol, a.N, NULL if a.bias == NULL else a.bias + p0 * 16,
                                         a.out + p0 * 16, 0, p1 - p0, misa)
            free(buf)
    return -1 if failed else 0


cdef int _mmp_isa(okv_settings s) noexcept nogil:
    if not s.simd:
        return OKV_MMP_SCALAR
    return OKV_MMP_AVX512 if s.avx512 and _mmp512 else OKV_MMP_AVX2


cdef int _run(okv_qmm *a, const float *x, bint int8, okv_settings s) except -1:
    """``_run_units`` for a Python caller: raises MemoryError when a buffer cannot be allocated."""
    cdef int rc
    with nogil:
        rc = _run_units(a, x, int8, s)
    if rc == -1:
        raise MemoryError(f"matmul_nbits: no memory for {a.M} rows of activation blocks")
    if rc == -2:
        raise MemoryError(f"matmul_nbits: no memory for a {DEQ_G * a.K * 16 * 4}-byte dequantization buffer")
    return 0


cdef int _run_units(okv_qmm *a, const float *x, bint int8, okv_settings s) noexcept nogil:
    """Every path of matmul_nbits on checked arguments (a: weight, out, bias and M set).  Returns 0; -1
    when the activation blocks, -2 when a dequantization buffer cannot be allocated."""
    cdef int nt = okv_grain(s.threads, a.M * a.K * a.N, PAR_MIN)
    cdef int64_t span = a.nblk * a.bs, t0, done = 0
    cdef bint decode = a.M <= DECODE_ROWS
    cdef void *scratch
    if not int8 and not decode:
        return -2 if _prefill(a, x, _float_isa(s), _mmp_isa(s), nt) != 0 else 0
    nt = min(nt, MAX_TEAM, <int>((a.P + 3) // 4))
    if decode:
        nt = okv_team_threads(s, nt)
    # int8: xq [M, span] int8 + xs, xsum [M, nblk]; float: xp [M, span] (a copy when K % bs) + xsum
    scratch = malloc(<size_t>(a.M * (span * (1 if int8 else 4) + 8 * a.nblk)) + 64)
    if scratch == NULL:
        return -1
    a.xsum = <float *>scratch
    if int8:
        a.xs = a.xsum + a.M * a.nblk
        a.xq = <int8_t *>(a.xs + a.M * a.nblk)
        okv_qmm_quant_rows(x, a.M, a.K, a.bs, a.nblk, <int8_t *>a.xq, <float *>a.xs, <float *>a.xsum,
                           _float_isa(s))
    else:
        a.x = x if span == a.K else a.xsum + a.M * a.nblk
        okv_qmm_float_rows(x, a.M, a.K, a.bs, a.nblk, <float *>a.x, <float *>a.xsum)
    t0 = okv_now_ns()
    _decode(a, int8, _int8_isa(s) if int8 else _float_isa(s), nt, &done)
    free(scratch)
    if nt > 1 and decode:
        okv_team_finished(s, t0, done)
    return 0


cdef uintptr_t nbits_weight_address(object w) except 0:
    """The address of a PackedNBits' call arguments (for ``matmul_nbits_ptr``; valid while ``w`` lives)."""
    if not isinstance(w, PackedNBits):
        raise TypeError(f"expected a PackedNBits, got {type(w).__name__}")
    return <uintptr_t>&(<PackedNBits>w).base


cdef int matmul_nbits_ptr(const void *w, const float *x, int64_t M, const float *bias, float *out, int int8,
                          okv_settings s) noexcept nogil:
    """``matmul_nbits`` on checked pointers (the compiled step's replay calls it): w from
    ``nbits_weight_address``, x [M, K], out [M, N] disjoint from x and bias [N] (or NULL), M >= 1.
    Returns 0, or a negative code when memory runs out (see ``_run_units``)."""
    cdef okv_qmm a = (<const okv_qmm *>w)[0]
    a.M = M
    a.bias = bias
    a.out = out
    return _run_units(&a, x, int8, s)


cdef bint _fast(x, PackedNBits w, out, bias, bint int8) except -1:
    """Run matmul_nbits when every argument is valid, checked at C speed (the
    conditions of the Python checks); False, with nothing written, sends the
    call through those checks (which name the bad argument)."""
    cdef const float[:, ::1] xv
    cdef float[:, ::1] ov
    cdef const float[::1] bv
    cdef okv_qmm a = w.base
    if not (type(x) is np.ndarray and type(out) is np.ndarray and (bias is None or type(bias) is np.ndarray)):
        return False
    if int8 and w.lut is not None:
        return False
    try:
        xv = x
        ov = out
        if bias is not None:
            bv = bias
    except (ValueError, TypeError, BufferError):
        return False
    a.M = xv.shape[0]
    if a.M == 0 or xv.shape[1] != w.K or ov.shape[0] != a.M or ov.shape[1] != w.N:
        return False
    if bias is not None:
        if bv.shape[0] != w.N or not _disjoint(&ov[0, 0], <size_t>(a.M * w.N) * 4, &bv[0], <size_t>w.N * 4):
            return False
        a.bias = &bv[0]
    if not _disjoint(&ov[0, 0], <size_t>(a.M * w.N) * 4, &xv[0, 0], <size_t>(a.M * w.K) * 4):
        return False
    a.out = &ov[0, 0]
    _run(&a, &xv[0, 0], int8, okv_settings_get())
    return True


def matmul_nbits(x, PackedNBits w, out, bias=None, bint int8=True):
    """out = x @ w (+ bias) for a weight packed by ``pack_nbits``.

    x: float32 [M, K]; out: float32 [M, N], written whole; bias: optional
    float32 [N]; all C-contiguous, native byte order; out must not overlap x
    or bias.  int8: quantize x per block to int8 (accuracy_level 4) in the
    decode kernels (M <= DECODE_M), else float32 activations (a codebook weight
    takes only int8=False).  Any M >= 0.
    NaN or inf in a row's block makes that row's int8 outputs NaN; the float
    paths propagate them as IEEE arithmetic does.  Raises ValueError naming
    the argument before writing.  (Called per weight per decode step: valid
    arguments are checked in C; only a failing check takes the Python checks.)
    """
    if _fast(x, w, out, bias, int8):
        rec = recorder()
        if rec is not None:
            rec.note(KIND_MATMUL_NBITS, (x, w, bias, out), (x.shape[0], int(int8)), ())
        return
    if int8 and w.lut is not None:
        raise ValueError("matmul_nbits: int8=True on a codebook weight (lut): its products take float32 activations")
    V.array("x", x, (V.F32,), ndim=2)
    if x.shape[1] != w.K:
        raise ValueError(f"x: expected shape (M, {w.K}) (K of the weight), got {x.shape}")
    V.array("out", out, (V.F32,), shape=(x.shape[0], w.N), writeable=True)
    if bias is not None:
        V.array("bias", bias, (V.F32,), shape=(w.N,))
    V.no_overlap("out", out, x, "x")
    V.no_overlap("out", out, bias, "bias")
    if x.shape[0] != 0:   # every other argument passed: only M = 0 fails the C checks
        raise AssertionError("matmul_nbits: arguments passed the Python checks but not the C checks")


def dequantize_nbits(PackedNBits w, p0, p1):
    """The float32 weight of panels [p0, p1) as [K, 16 (p1 - p0)] (columns past N are zero):
    w[k, n] = (q - zp) * scale, for products too large for ``matmul_nbits`` to
    repeat the dequantization (callers use BLAS on it).  p0, p1: ints, 0 <= p0 < p1 <= P."""
    if not (all(isinstance(p, (int, np.integer)) and not isinstance(p, (bool, np.bool_)) for p in (p0, p1))
            and 0 <= p0 < p1 <= w.P):
        raise ValueError(f"p0, p1: expected ints 0 <= p0 < p1 <= {w.P}, got {p0!r}, {p1!r}")
    cdef okv_settings s = okv_settings_get()
    cdef okv_qmm a = w.base
    cdef int64_t lo = p0, hi = p1
    panels = np.empty((hi - lo, w.K, 16), np.float32)
    cdef float[:, :, ::1] dv = panels
    with nogil:
        okv_qmm_dequant_isa(&a, lo, hi, &dv[0, 0, 0], _float_isa(s))
    return panels.transpose(1, 0, 2).reshape(w.K, -1)


def quantize_rows(x, int64_t block_size):
    """The int8 activation blocks ``matmul_nbits`` computes for x (float32
    [M, K], C-contiguous) on the calling thread's instruction set: (xq int8
    [M, nblk * block_size], zero past K; xs, xsum float32 [M, nblk]), as
    reference.quantize_rows_int8 defines them.  block_size: a power of two in
    16..256.  (For tests of the SIMD paths; matmul_nbits quantizes internally.)"""
    V.array("x", x, (V.F32,), ndim=2)
    if not (16 <= block_size <= 256 and block_size & (block_size - 1) == 0):
        raise ValueError(f"quantize_rows: block_size must be a power of two in 16..256, got {block_size}")
    cdef int64_t M = x.shape[0], Kx = x.shape[1], nblk = (Kx + block_size - 1) // block_size
    xq = np.empty((M, nblk * block_size), np.int8)
    xs = np.empty((M, nblk), np.float32)
    xsum = np.empty((M, nblk), np.float32)
    if M == 0 or Kx == 0:
        return xq, xs, xsum
    cdef const float[:, ::1] xv = x
    cdef int8_t[:, ::1] qv = xq
    cdef float[:, ::1] sv = xs, uv = xsum
    cdef int isa = _float_isa(okv_settings_get())
    with nogil:
        okv_qmm_quant_rows(&xv[0, 0], M, Kx, block_size, nblk, &qv[0, 0], &sv[0, 0], &uv[0, 0], isa)
    return xq, xs, xsum
