"""Decode-sized float32 matmul: out[M, N] = x[M, K] @ w[K, N] (+ bias[N]).

ONNX MatMul layout (w row-major [K, N]).  Built for small M (batch x new
tokens): the OpenMP threads split N into column segments and each segment
computes all M rows, streaming its slice of every weight row in order, so the
weight matrix is read once per call.  A single row with a long K is split
along K instead (two contiguous halves of the weights, summed at the end).  Running in the kernels' OpenMP pool, it
keeps BLAS (and its own busy-waiting thread pool) off the decode path.  Larger
M is correct but not the target.  Each output column is summed in the same
order whatever the thread count, so results do not depend on it.
"""
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc
from cython.parallel cimport prange

from onnxkv._kernels._runtime cimport okv_threads, okv_simd
from . import _validate as V

cdef extern from "matmul.h" nogil:
    int64_t okv_matmul_plan(int64_t M, int64_t N, int nt, int64_t *width)
    void okv_matmul_seg_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                            const float *bias, float *out, int64_t n0, int64_t nb, int simd)

DEF PAR_MIN = 1 << 16   # M*K*N below this runs on one thread
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
                  float[:, ::1] out) noexcept nogil:
    cdef int64_t M = x.shape[0], K = x.shape[1], N = w.shape[1]
    cdef int64_t width = 0, nseg, s, n0, nb
    cdef int simd = okv_simd()
    cdef int nt = okv_threads()
    if M * K * N < PAR_MIN:
        nt = 1
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
    N = w.shape[1]
    if bias is not None:
        V.array("bias", bias, (V.F32,), shape=(N,))
    V.array("out", out, (V.F32,), shape=(M, N), writeable=True)
    V.no_overlap("out", out, x, "x")
    V.no_overlap("out", out, w, "w")
    V.no_overlap("out", out, bias, "bias")
    if M == 0 or N == 0:
        return
    if K == 0:
        out[...] = 0.0 if bias is None else bias
        return
    cdef const float[::1] bv
    cdef const float *bp = NULL
    if bias is not None:
        bv = bias
        bp = &bv[0]
    _matmul(x, w, bp, out)
