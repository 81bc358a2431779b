"""Integer products of dynamically quantized models (imatmul.h): ONNX ``MatMulInteger`` with a constant
weight, and ``DynamicQuantizeLinear``.

``pack_int8_weight`` packs a constant B (int8 or uint8 [K, N]) with its zero points (none, one, or one
per column) once into :class:`PackedInt8Weight`; ``matmul_integer`` then computes
out[m, n] = sum_k (a[m, k] - azp[m]) (B[k, n] - bzp[n]) as int32 that wraps, as ONNX Runtime's int32
accumulation does, for a uint8 or int8 [M, K] (AVX-512 VNNI, AVX2 or scalar: the same integers on every
path).  ``dynamic_quantize_linear`` quantizes float32 values to uint8 with the scale and zero point
ONNX Runtime's CPU kernel computes (the rule is in imatmul.h).  The threads claim panels of 16 columns
(claim.h); decode-sized products follow the late-team heuristic of the other products
(``_runtime.okv_team_threads``).

The NumPy twins are ``reference.matmul_integer`` and ``reference.dynamic_quantize_linear``.
"""
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset
from cython.parallel cimport prange

from onnxkv._kernels._record cimport KIND_MATMUL_DYNAMIC, recorder
from onnxkv._kernels._runtime cimport (okv_grain, okv_now_ns, okv_settings, okv_settings_get, okv_settings_mine,
                                       okv_team_finished, okv_team_threads)
import numpy as np

from . import _validate as V

cdef extern from "imatmul.h" nogil:
    ctypedef struct okv_imm:
        int64_t M, K, N, P, K4
        const int8_t *wq
        const int32_t *csum
        const int32_t *bzp
        const uint8_t *a
        const int32_t *azp
        const int32_t *rsum
        int32_t *out
        float *fout
        const float *fs
    int OKV_IMM_SCALAR, OKV_IMM_AVX2, OKV_IMM_AVX512
    void okv_imm_range(const okv_imm *a, int64_t p0, int64_t p1, int isa)
    int64_t okv_imm_claim(const okv_imm *a, int isa, uint64_t *ranges, int nt, int t, int64_t chunk)
    void okv_imm_rows(const uint8_t *A, int64_t M, int64_t K, int64_t K4, int sgn, uint8_t *ap, int32_t *rsum)
    void okv_dql(const float *x, int64_t n, uint8_t *y, float *scale, uint8_t *zp, int simd)
    void okv_dql_rows(const float *x, int64_t M, int64_t K, int64_t K4, uint8_t *ap, int32_t *rsum, float *scale,
                      uint8_t *zp, int simd)
    int okv_cpu_vnni512_ok()

cdef extern from "claim.h" nogil:
    int64_t okv_claim_setup(uint64_t *ranges, int64_t P, int nt, int64_t unit)

DEF DECODE_ROWS = 8      # rows up to which a product is decode-sized (the late-team heuristic applies)
DEF PAR_MIN = 1 << 15    # multiply-adds (M*K*N) each thread of a product gets at least (okv_grain)
DEF MAX_TEAM = 64        # threads of one product at most (the claim ranges live on the stack)

cdef int _vnni512 = okv_cpu_vnni512_ok()


cdef int _isa(okv_settings s) noexcept nogil:
    if not s.simd:
        return OKV_IMM_SCALAR
    if s.vnni and s.avx512 and _vnni512:
        return OKV_IMM_AVX512
    return OKV_IMM_AVX2


def integer_path() -> str:
    """The path the calling thread's settings select for ``matmul_integer``: "avx512-vnni", "avx2" or
    "scalar" (the VNNI switch is qmatmul's ``_set_vnni``, shared by every int8 product)."""
    return {OKV_IMM_SCALAR: "scalar", OKV_IMM_AVX2: "avx2", OKV_IMM_AVX512: "avx512-vnni"}[_isa(okv_settings_get())]


cdef class PackedInt8Weight:
    """A constant MatMulInteger weight in the panel layout of imatmul.h (read-only arrays owned by this
    object).

    Attributes: K, N, P = ceil(N / 16), K4 = K rounded up to 4; dtype (of the B it was packed from);
    wq int8 [P, K4 * 16]; csum, bzp int32 [P * 16] (column sums of B', zero points B' needs; imatmul.h);
    nbytes: bytes held.
    """
    cdef readonly int64_t K, N, P, K4
    cdef readonly object dtype, wq, csum, bzp
    cdef okv_imm base   # the weight fields of every call's arguments (pointers into the arrays above)

    @property
    def nbytes(self) -> int:
        return self.wq.nbytes + self.csum.nbytes + self.bzp.nbytes


def pack_int8_weight(B, zero_point=None) -> PackedInt8Weight:
    """Pack a constant MatMulInteger weight for ``matmul_integer``.

    B: int8 or uint8 [K, N] (K, N >= 1, K < 2^31).  zero_point: None (0), or an array of B's dtype with
    one element or N (one per column).  Only read.  Raises ValueError naming the argument and what was
    expected."""
    if not isinstance(B, np.ndarray) or B.dtype not in (np.int8, np.uint8) or B.ndim != 2:
        raise ValueError(f"B: expected an int8 or uint8 [K, N] array, got "
                         f"{getattr(B, 'dtype', type(B).__name__)} {getattr(B, 'shape', '')}")
    cdef int64_t K = B.shape[0], N = B.shape[1]
    if K < 1 or N < 1 or K >= 2**31:
        raise ValueError(f"B: expected 1 <= K < 2^31 and N >= 1, got shape {B.shape}")
    if zero_point is None:
        z = np.zeros(N, np.int32)
    else:
        if not isinstance(zero_point, np.ndarray) or zero_point.dtype != B.dtype or zero_point.size not in (1, N):
            raise ValueError(f"zero_point: expected a {B.dtype} array of 1 or N={N} elements, got "
                             f"{getattr(zero_point, 'dtype', type(zero_point).__name__)} "
                             f"{getattr(zero_point, 'shape', '')}")
        z = np.broadcast_to(zero_point.reshape(-1).astype(np.int32), (N,))
    cdef int64_t P = (N + 15) // 16, K4 = (K + 3) // 4 * 4
    signed = B.dtype == np.int8
    bs = B.view(np.int8) if signed else (B ^ np.uint8(0x80)).view(np.int8)   # B' = B - 128 for uint8 B
    full = np.zeros((K4, P * 16), np.int8)
    full[:K, :N] = bs
    cdef PackedInt8Weight w = PackedInt8Weight.__new__(PackedInt8Weight)
    w.K, w.N, w.P, w.K4, w.dtype = K, N, P, K4, B.dtype
    # line j of panel p: byte 4c + kk = B'[4j + kk, 16p + c]
    w.wq = np.ascontiguousarray(full.reshape(K4 // 4, 4, P, 16).transpose(2, 0, 3, 1)).reshape(P, K4 * 16)
    csum = np.zeros(P * 16, np.int64)
    csum[:N] = bs.sum(axis=0, dtype=np.int64)
    w.csum = csum.astype(np.int32)   # |sum| < 2^31 * 128: wraps as the int32 arithmetic of the kernel does
    bzp = np.zeros(P * 16, np.int32)
    bzp[:N] = z if signed else z - 128
    w.bzp = bzp
    for a in (w.wq, w.csum, w.bzp):
        a.flags.writeable = False
    _set_base(w)
    return w


cdef void _set_base(PackedInt8Weight w):
    cdef const int8_t[:, ::1] wv = w.wq
    cdef const int32_t[::1] cv = w.csum, bv = w.bzp
    memset(&w.base, 0, sizeof(okv_imm))
    w.base.K, w.base.N, w.base.P, w.base.K4 = w.K, w.N, w.P, w.K4
    w.base.wq, w.base.csum, w.base.bzp = &wv[0, 0], &cv[0], &bv[0]


cdef uintptr_t int8_weight_address(object w) except 0:
    """The address of a PackedInt8Weight's call arguments (for ``matmul_dynamic_ptr``; valid while ``w`` lives)."""
    if not isinstance(w, PackedInt8Weight):
        raise TypeError(f"expected a PackedInt8Weight, got {type(w).__name__}")
    return <uintptr_t>&(<PackedInt8Weight>w).base


cdef void _product(okv_imm *a, okv_settings s) noexcept nogil:
    """The product on prepared arguments (weight, activations, zero points, row sums and the output set),
    its panels shared by the team through claims."""
    cdef uint64_t ranges[8 * MAX_TEAM]
    cdef int isa = _isa(s), nt
    cdef int64_t chunk, t, t0, done = 0
    cdef int64_t *donep = &done   # written by thread 0 of the team (a variable assigned in prange is lastprivate)
    cdef bint decode = a.M <= DECODE_ROWS
    nt = okv_grain(s.threads, a.M * a.K * a.N, PAR_MIN)
    nt = min(nt, MAX_TEAM, <int>((a.P + 3) // 4))
    if decode:
        nt = okv_team_threads(s, nt)
    t0 = okv_now_ns()
    if nt <= 1:
        okv_imm_range(a, 0, a.P, isa)
        return
    chunk = okv_claim_setup(ranges, a.P, nt, 4)
    for t in prange(nt, num_threads=nt, schedule='static'):
        okv_imm_claim(a, isa, ranges, nt, <int>t, chunk)
        if t == 0:
            donep[0] = okv_now_ns()
    if decode:
        okv_team_finished(s, t0, done)


cdef int _run(okv_imm *a, const uint8_t *A, int sgn, const int32_t *azp_src, int64_t nazp, okv_settings s) noexcept nogil:
    """The product on checked arguments (a: weight fields, M and out set; azp_src: nazp zero points, one for
    every row when nazp == 1, already shifted by 128 for int8 A).  Returns 0, -1 without memory."""
    cdef int64_t m
    cdef void *scratch = malloc(<size_t>(a.M * a.K4 + 8 * a.M + 64))
    if scratch == NULL:
        return -1
    a.rsum = <int32_t *>scratch
    a.azp = a.rsum + a.M
    a.a = <uint8_t *>(a.azp + a.M)
    for m in range(a.M):
        (<int32_t *>a.azp)[m] = azp_src[0 if nazp == 1 else m]
    okv_imm_rows(A, a.M, a.K, a.K4, sgn, <uint8_t *>a.a, <int32_t *>a.rsum)
    _product(a, s)
    free(scratch)
    return 0


cdef int matmul_dynamic_ptr(const void *w, const float *x, int64_t M, const float *ws, float *out,
                            okv_settings s) noexcept nogil:
    """``matmul_dynamic`` on checked pointers (the compiled step's replay calls it): w from
    ``int8_weight_address``, x [M, K], ws [N], out [M, N] disjoint from x, M >= 1.  Returns 0, or -1
    when memory runs out."""
    cdef okv_imm a = (<const okv_imm *>w)[0]
    cdef int64_t m, n, P16 = a.P * 16
    cdef float scale
    cdef uint8_t zp
    cdef void *scratch = malloc(<size_t>(M * a.K4 + 8 * M + 4 * P16 + 64))
    if scratch == NULL:
        return -1
    a.M = M
    a.rsum = <int32_t *>scratch
    a.azp = a.rsum + M
    a.fs = <float *>(a.azp + M)
    a.a = <uint8_t *>(a.fs + P16)
    okv_dql_rows(x, M, a.K, a.K4, <uint8_t *>a.a, <int32_t *>a.rsum, &scale, &zp, 1 if (s.simd and s.avx512) else 0)
    for m in range(M):
        (<int32_t *>a.azp)[m] = zp
    for n in range(P16):
        (<float *>a.fs)[n] = scale * ws[n] if n < a.N else 0.0
    a.fout = out
    _product(&a, s)
    free(scratch)
    return 0


def matmul_integer(a, PackedInt8Weight w, a_zero_point, out):
    """out = (a - a_zero_point) @ (B - B's zero points) as int32 (wrapping), B packed by
    ``pack_int8_weight``.

    a: uint8 or int8 [M, K] (K of the weight), C-contiguous; a_zero_point: None (0), or an array of a's
    dtype with one element or M (one per row); out: int32 [M, N], C-contiguous, written whole.  Any
    M >= 0.  Raises ValueError naming the argument before writing."""
    V.array("a", a, (np.dtype(np.uint8), np.dtype(np.int8)), ndim=2)
    if a.shape[1] != w.K:
        raise ValueError(f"a: expected shape (M, {w.K}) (K of the weight), got {a.shape}")
    V.array("out", out, (np.dtype(np.int32),), shape=(a.shape[0], w.N), writeable=True)
    V.no_overlap("out", out, a, "a")
    cdef int64_t M = a.shape[0]
    if a_zero_point is None:
        z = np.zeros(1, np.int32)
    else:
        if (not isinstance(a_zero_point, np.ndarray) or a_zero_point.dtype != a.dtype
                or a_zero_point.size not in (1, M)):
            raise ValueError(f"a_zero_point: expected a {a.dtype} array of 1 or M={M} elements, got "
                             f"{getattr(a_zero_point, 'dtype', type(a_zero_point).__name__)} "
                             f"{getattr(a_zero_point, 'shape', '')}")
        z = np.ascontiguousarray(a_zero_point.reshape(-1), dtype=np.int32)
    sgn = a.dtype == np.int8
    if sgn:
        z = z + 128   # A' = A + 128, so azp' = azp + 128
    if M == 0:
        return
    cdef const int32_t[::1] zv = z
    cdef const uint8_t[:, ::1] av = a.view(np.uint8)
    cdef int32_t[:, ::1] ov = out
    cdef okv_imm arg = w.base   # fout NULL: int32 results
    arg.M = M
    arg.out = &ov[0, 0]
    cdef int rc, is_signed = sgn
    cdef int64_t nz = zv.shape[0]
    cdef okv_settings s = okv_settings_get()
    with nogil:
        rc = _run(&arg, &av[0, 0], is_signed, &zv[0], nz, s)
    if rc != 0:
        raise MemoryError(f"matmul_integer: no memory for {M} rows of {w.K4} activation bytes")


def dynamic_quantize_linear(x, y) -> tuple:
    """ONNX DynamicQuantizeLinear as ONNX Runtime computes it (imatmul.h): x float32 (any shape,
    C-contiguous) into y uint8 of x's size (C-contiguous, written whole).  Returns (scale as a Python
    float, zero point as a Python int).  Raises ValueError naming the argument."""
    V.array("x", x, (V.F32,))
    V.array("y", y, (np.dtype(np.uint8),), writeable=True)
    if y.size != x.size:
        raise ValueError(f"y: expected {x.size} elements (x's), got shape {y.shape}")
    V.no_overlap("y", y, x, "x")
    cdef float scale = 1.0
    cdef uint8_t zp = 0
    cdef int64_t n = x.size
    if n == 0:
        return 1.0, 0
    cdef const float[::1] xv = x.reshape(-1)
    cdef uint8_t[::1] yv = y.reshape(-1)
    cdef okv_settings s = okv_settings_get()
    cdef int simd = 1 if (s.simd and s.avx512) else 0
    with nogil:
        okv_dql(&xv[0], n, &yv[0], &scale, &zp, simd)
    return float(scale), int(zp)


def matmul_dynamic(x, PackedInt8Weight w, ws, out):
    """The dynamically quantized product of ONNX Runtime's quantize_dynamic models in one call:
    DynamicQuantizeLinear of the whole x (one scale and zero point), MatMulInteger against the packed
    weight, each int32 result rounded to float32 and multiplied by ``x_scale * ws[n]`` (computed in
    float32): the bits of the graph's DynamicQuantizeLinear, MatMulInteger, Cast and two Muls.

    x: float32 [M, K] (K of the weight); ws: float32 [N]; out: float32 [M, N]; all C-contiguous, out
    disjoint from x.  Any M >= 0.  Raises ValueError naming the argument before writing."""
    V.array("x", x, (V.F32,), ndim=2)
    if x.shape[1] != w.K:
        raise ValueError(f"x: expected shape (M, {w.K}) (K of the weight), got {x.shape}")
    V.array("ws", ws, (V.F32,), shape=(w.N,))
    V.array("out", out, (V.F32,), shape=(x.shape[0], w.N), writeable=True)
    V.no_overlap("out", out, x, "x")
    V.no_overlap("out", out, ws, "ws")
    cdef int64_t M = x.shape[0]
    if M == 0:
        return
    cdef const float[:, ::1] xv = x
    cdef const float[::1] sv = ws
    cdef float[:, ::1] ov = out
    cdef okv_settings st = okv_settings_get()
    cdef int rc
    with nogil:
        rc = matmul_dynamic_ptr(&w.base, &xv[0, 0], M, &sv[0], &ov[0, 0], st)
    if rc != 0:
        raise MemoryError(f"matmul_dynamic: no memory for {M} rows of {w.K4} activation bytes")
    rec = recorder()
    if rec is not None:
        rec.note(KIND_MATMUL_DYNAMIC, (x, w, ws, out), (M,), ())
