# cython: boundscheck=False, wraparound=False, cdivision=True
"""Token choice: temperature, top-k and top-p (nucleus) sampling of a row of logits, in float64, and the
indices of a row's largest entries (``top_indices``: beam search's candidates, at the end).

``sample(logits, temperature, top_k, top_p, u, probs=None)`` draws one token
per row of ``logits`` [B, V] (float32 or float64) with the uniform numbers
``u`` [B] (float64 in [0, 1)), as transformers' warpers order it:

1. ``x = (logits - max(logits)) / temperature`` (float64: the largest is 0, so that a tiny temperature
   drives the others to -inf, never the largest to +inf);
2. top-k (``top_k`` < V): every ``x`` below the ``top_k``-th largest becomes -inf (ties with it stay);
3. ``p = exp(x - max(x))``, divided by its sum;
4. top-p (``top_p`` < 1): the tokens sorted by ``p`` descending (ties: lower id first) are kept while
   the sum of the ones before each is below ``top_p`` (the most likely is always kept); the others get 0,
   and ``p`` is divided by its new sum;
5. the token is the number of entries of ``cumsum(p)`` at or below ``u``: the first whose sum passes
   ``u``, so never one of probability 0 (``u`` 0 drew token 0 when it had none); where rounding leaves
   the total at or below ``u``, the last token of nonzero probability.

Sums are NumPy's pairwise sums and cumulative sums are sequential, as NumPy
computes them, so the result is the NumPy twin's (``reference.sample``) up to
the last bits of ``exp`` (``sampling_exp.h``: within 2 ulp, vectorised, the
same bits at every SIMD level); a draw whose ``u`` falls within those bits of a
boundary of ``cumsum(p)`` may pick the neighbouring token.  ``probs`` [B, V]
float64, when given, receives step 4's ``p``.  One call per token of a
sampled generation (the compiled generation loop calls the row function
directly), every argument checked first.
"""
from libc.math cimport INFINITY, isnan
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc

from onnxkv._kernels._runtime cimport okv_settings, okv_settings_get

import numpy as np

from . import _validate as V

__all__ = ["sample", "top_indices"]

cdef extern from "sampling_exp.h" nogil:
    void okv_exp_sub_f64(double *x, int64_t n, double m, int level)

cdef extern from "top_indices.h" nogil:
    ctypedef struct okv_top_pair:
        pass
    int OKV_TOP_PASS_MAX
    void okv_top_row(const float *x, int64_t N, int64_t n, int64_t *idx, float *val, int simd)
    void okv_top_row_sorted(const float *x, int64_t N, int64_t n, int64_t *idx, okv_top_pair *pairs)


ctypedef fused real:
    float
    double


cdef inline double _pairwise(const double *a, int64_t n) noexcept nogil:
    """NumPy's pairwise sum of n doubles (pairwise_sum_DOUBLE: 8 accumulators over blocks of up to 128)."""
    cdef double r[8]
    cdef double res
    cdef int64_t i, n2
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[i]
        return res
    if n <= 128:
        for i in range(8):
            r[i] = a[i]
        i = 8
        while i < n - (n % 8):
            r[0] += a[i]
            r[1] += a[i + 1]
            r[2] += a[i + 2]
            r[3] += a[i + 3]
            r[4] += a[i + 4]
            r[5] += a[i + 5]
            r[6] += a[i + 6]
            r[7] += a[i + 7]
            i += 8
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
        while i < n:
            res += a[i]
            i += 1
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return _pairwise(a, n2) + _pairwise(a + n2, n - n2)


cdef inline bint _before(double a, double b) noexcept nogil:
    """a sorts before b in NumPy's ascending order (NaN last)."""
    return a < b or (isnan(b) and not isnan(a))


cdef double _kth(double *w, int64_t n, int64_t k) noexcept nogil:
    """The k-th smallest of w[:n] (0-based, NaN largest: np.partition(w, k)[k]); reorders w."""
    cdef int64_t lo = 0, hi = n - 1, i, j
    cdef double pivot, t
    while lo < hi:
        pivot = w[(lo + hi) // 2]
        i, j = lo, hi
        while i <= j:
            while _before(w[i], pivot):
                i += 1
            while _before(pivot, w[j]):
                j -= 1
            if i <= j:
                t = w[i]
                w[i] = w[j]
                w[j] = t
                i += 1
                j -= 1
        if k <= j:
            hi = j
        elif k >= i:
            lo = i
        else:
            return w[k]
    return w[k]


cdef void _order_desc(const double *p, int64_t *order, int64_t *tmp, int64_t n) noexcept nogil:
    """order = the ids 0..n-1 sorted by p descending, ties by id (a stable merge sort: np.argsort(-p,
    kind="stable")); tmp: n ints of workspace."""
    cdef int64_t width, lo, mid, hi, i, j, k
    cdef int64_t *src = order
    cdef int64_t *dst = tmp
    cdef int64_t *t
    for i in range(n):
        order[i] = i
    width = 1
    while width < n:
        lo = 0
        while lo < n:
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                # -p[j] sorts before -p[i] only when strictly smaller (stability: i first on ties)
                if _before(-p[src[j]], -p[src[i]]):
                    dst[k] = src[j]
                    j += 1
                else:
                    dst[k] = src[i]
                    i += 1
                k += 1
            while i < mid:
                dst[k] = src[i]
                i += 1
                k += 1
            while j < hi:
                dst[k] = src[j]
                j += 1
                k += 1
            lo += 2 * width
        t = src
        src = dst
        dst = t
        width *= 2
    if src != order:
        for i in range(n):
            order[i] = src[i]


cdef int64_t _sample(const real *logits, int64_t V, double temperature, int64_t top_k, double top_p, double u,
                     double *p, double *work, int64_t *order) noexcept nogil:
    """One draw (the module docstring) from logits[:V] into p[:V] (its probabilities); work: V doubles and
    order: 2V ints of workspace (used by top-k and top-p only)."""
    cdef int64_t i, ids, last
    cdef double m, s, c, kth
    cdef okv_settings s_
    m = <double>logits[0]
    for i in range(1, V):     # np.max: the largest, NaN if any is
        if isnan(<double>logits[i]) or <double>logits[i] > m or isnan(m):
            m = <double>logits[i] if not isnan(m) else m
    for i in range(V):
        p[i] = (<double>logits[i] - m) / temperature
    if 0 < top_k < V:
        for i in range(V):
            work[i] = p[i]
        kth = _kth(work, V, V - top_k)
        for i in range(V):
            if p[i] < kth:
                p[i] = -INFINITY
    m = p[0]
    for i in range(1, V):     # np.max: the largest, NaN if any is
        if isnan(p[i]) or p[i] > m or isnan(m):
            m = p[i] if not isnan(m) else m
    s_ = okv_settings_get()   # exp(-inf - m) is 0: the entries top-k dropped; one exp's bits on every level
    okv_exp_sub_f64(p, V, m, 2 if s_.avx512 else (1 if s_.simd else 0))
    s = _pairwise(p, V)
    for i in range(V):
        p[i] /= s
    if top_p < 1.0:
        _order_desc(p, order, order + V, V)
        c = 0.0
        for i in range(V):
            work[i] = p[order[i]]
        for i in range(V):   # keep while the cumulative sum before the token is below top_p
            c += work[i]
            if not (c - work[i] < top_p):
                p[order[i]] = 0.0
        s = _pairwise(p, V)
        for i in range(V):
            p[i] /= s
    c = 0.0
    ids = 0
    last = 0
    for i in range(V):
        c += p[i]
        if c <= u:
            ids += 1
        if p[i] > 0:
            last = i
    return min(ids, last)


cdef int64_t sample_row_f32(const float *logits, int64_t V, double temperature, int64_t top_k, double top_p,
                            double u, double *p, double *work, int64_t *order) noexcept nogil:
    """The draw of one float32 row (for the token loop): p, work: V doubles; order: 2V ints."""
    return _sample(logits, V, temperature, top_k, top_p, u, p, work, order)


def sample(logits, temperature, top_k, top_p, u, probs=None):
    """One token per row of ``logits`` (see the module docstring); returns int64 [B].

    logits [B, V] float32 or float64, C-contiguous, V >= 1; temperature > 0 and finite; top_k None or an
    int >= 1; top_p None or in (0, 1]; u [B] float64 in [0, 1); probs None or [B, V] float64, writable,
    C-contiguous.  Raises ValueError naming the argument before anything is written.
    """
    V.array("logits", logits, (np.dtype(np.float32), np.dtype(np.float64)), ndim=2)
    cdef int64_t B = logits.shape[0], n = logits.shape[1], b
    if n < 1:
        raise ValueError(f"logits: expected at least one column, got shape {logits.shape}")
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, (int, float, np.integer, np.floating)) \
            or not (temperature > 0 and temperature < INFINITY):
        raise ValueError(f"temperature: expected a finite number > 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer))
                              or top_k < 1):
        raise ValueError(f"top_k: expected None or an int >= 1, got {top_k!r}")
    cdef int64_t k = 0 if top_k is None else min(int(top_k), n)   # a top_k of V or more keeps every id
    cdef double temp = float(temperature)
    cdef double tp = 1.0 if top_p is None else float(top_p)
    if not (0.0 < tp <= 1.0):
        raise ValueError(f"top_p: expected None or a value in (0, 1], got {top_p}")
    V.array("u", u, (np.dtype(np.float64),), shape=(B,))
    if not ((u >= 0) & (u < 1)).all():
        raise ValueError(f"u: expected values in [0, 1), got {u}")
    if probs is not None:
        V.array("probs", probs, (np.dtype(np.float64),), shape=(B, n), writeable=True)
        V.no_overlap("probs", probs, logits, "logits")
        V.no_overlap("probs", probs, u, "u")
    out = np.empty(B, np.int64)
    cdef double[:, ::1] pv = probs if probs is not None else np.empty((B, n), np.float64)
    cdef double[::1] uv = u
    cdef int64_t[::1] ov = out
    cdef double *work = <double *>malloc(<size_t>n * sizeof(double))
    cdef int64_t *order = <int64_t *>malloc(<size_t>(2 * n) * sizeof(int64_t))
    cdef const float[:, ::1] lf
    cdef const double[:, ::1] ld
    if work == NULL or order == NULL:
        free(work)
        free(order)
        raise MemoryError("sample: could not allocate the workspace")
    try:
        if logits.dtype == np.float32:
            lf = logits
            with nogil:
                for b in range(B):
                    ov[b] = _sample(&lf[b, 0], n, temp, k, tp, uv[b], &pv[b, 0], work, order)
        else:
            ld = logits
            with nogil:
                for b in range(B):
                    ov[b] = _sample(&ld[b, 0], n, temp, k, tp, uv[b], &pv[b, 0], work, order)
    finally:
        free(work)
        free(order)
    return out


def top_indices(x, n):
    """Indices of the ``n`` largest entries of every row of ``x``, best first; equal values in ascending
    index (of equal values at the boundary, the lower indices).  Returns int64 [R, n].

    x: float32 [R, N], C-contiguous, no NaN; n: an int in [1, N].  One pass per row for n up to 64, a sort
    of the row above (top_indices.h); the same indices at every SIMD level as the NumPy twin
    (``reference.top_indices``).  Raises ValueError naming the argument before anything is computed.  (Beam
    search: the candidates of a step among beams x vocab.)
    """
    V.array("x", x, (V.F32,), ndim=2)
    cdef int64_t R = x.shape[0], N = x.shape[1], r
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= N:
        raise ValueError(f"n: expected an int in [1, {N}] (the row length), got {n!r}")
    if np.isnan(x).any():
        raise ValueError("x: expected no NaN")
    cdef int64_t k = n
    out = np.empty((R, k), np.int64)
    cdef int64_t[:, ::1] ov = out
    cdef const float[:, ::1] xv = x
    cdef int simd = okv_settings_get().simd
    cdef bint sort = k > OKV_TOP_PASS_MAX
    cdef void *work = malloc(<size_t>N * sizeof(okv_top_pair) if sort else <size_t>k * sizeof(float))
    if work == NULL:
        raise MemoryError("top_indices: could not allocate the workspace")
    with nogil:
        for r in range(R):
            if sort:
                okv_top_row_sorted(&xv[r, 0], N, k, &ov[r, 0], <okv_top_pair *>work)
            else:
                okv_top_row(&xv[r, 0], N, k, &ov[r, 0], <float *>work, simd)
    free(work)
    return out
