"""Streaming (online-softmax) attention over a contiguous (attention) or paged
(paged_attention) KV cache (float32 math; float32, float16 or bfloat16 K/V
converted in the load step).  Both share one C implementation: work units read
K/V through per-page base pointers (a contiguous cache is one page).

Decode (Sq = 1) and prefill (Sq > 1, causal) share one kernel.  All query heads
of a KV group are processed together: each K/V block is read once per work unit
and used by every query row of the group.  Running max, sum and accumulator are
float32; no score vector of cache length is materialised and the cache is never
gathered.  Parallel over batch x KV heads x query tiles; when batch x KV heads
does not fill the threads and Sq is small, each group is split along the cache
into chunks whose (max, sum, acc) states are merged exactly.  Paged decode
(Hq*Sq*D <= 16384) runs one unit per batch row and cache chunk over all KV
heads, reading each page (head-major) front to back: one short run per head
and page would leave the hardware prefetchers restarting every few KiB.

Three instruction sets, chosen per call from the calling thread's settings
(``KernelSettings``, _runtime.pyx): AVX-512 (F/BW/VL/DQ: 16-lane tiles,
the default where the CPU and OS support it; float32 K/V keep the 8-lane tiles
there, as fast on that memory-bound stream), AVX2+FMA+F16C (8 lanes) and
scalar.  ``set_simd_enabled(False)`` forces scalar, ``set_attention_avx512
(False)`` keeps AVX2 (tests and benchmarks run all three on one machine);
``attention_simd_level()`` names the one in use.  Inside the AVX-512 tiles,
paged_attention scores the keys of quantized pages with per-head scales, and
8-bit keys with per-channel scales, on the AMX-INT8 tiles where the CPU and
OS allow it (level "avx512+amx";
``set_attention_amx(False)`` keeps AVX-512 FMAs).

Paged caches may give every page its own format (k_formats / v_formats:
float32, float16, bfloat16, or 8/4/2-bit codes with a per-page header of
scales and zero points, attention_quant.h): each tile is dequantized in the
load step of its page's format, so old pages can be int4 while recent ones
stay float32 within one sequence.
"""
from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint8_t, uint16_t, uint64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy
from libc.math cimport isfinite
from cython.parallel cimport prange

import numpy as np

from onnxkv._kernels._runtime cimport (okv_amx_usable, okv_avx512_usable, okv_settings, okv_settings_get,
                                      okv_settings_mine)
from onnxkv._kernels._ranges cimport _disjoint
from . import _validate as V

cdef extern from "attention.h" nogil:
    ctypedef struct okv_attn_args:
        const float *q
        const void *k
        const void *v
        const uint64_t *k_pages
        const uint64_t *v_pages
        const int32_t *block_tables
        int64_t M, bs
        float *out
        const int32_t *kv_len
        const int32_t *q_pos
        const int32_t *kv_start
        int64_t B, Hq, Hkv, Sq, Cap, D
        float scale, softcap
        int64_t window
        int kv_type
        int prefetch
        int pf_qk_lines
        int prefill_rg
        int flash
        int bf16
        int64_t hpu
        const uint8_t *k_fmt
        const uint8_t *v_fmt
        int64_t kG, vG
        int k_compact
        int k_czp
        int amx
    int OKV_BK
    int OKV_BF16_MIN_ROWS
    int OKV_KV_F32
    int OKV_KV_F16
    int OKV_KV_BF16
    int OKV_MAX_TQ
    int64_t okv_attn_ws_floats(int64_t R, int64_t D)
    int64_t okv_attn_part_floats(int64_t R, int64_t D)
    int64_t okv_attn_amx_ws_floats(const okv_attn_args *a, int64_t tq)
    int64_t okv_attn_unit_ws_floats(const okv_attn_args *a, int64_t tq)
    float *okv_align64(float *p)
    int64_t okv_attn_unit(const okv_attn_args *a, int64_t b, int64_t hk0, int64_t t0, int64_t t1, int64_t c0,
                          int64_t c1, float *ws, float *part, int64_t pstride, int simd)
    void okv_attn_merge(const okv_attn_args *a, int64_t b, int64_t hk, const float *parts, int64_t nchunks)
    int64_t okv_attn_split_task(const okv_attn_args *a, int64_t i, int64_t nchunks, float *ws, float *parts,
                                int simd)
    int okv_thread_num()
    int OKV_ATTN_AVX2
    int OKV_ATTN_AVX512

cdef extern from "simd.h" nogil:
    void okv_rope_row_f32(const float *x, const float *c, const float *s, float *out, int64_t half,
                          int64_t head_size, int interleaved, int simd)
    void okv_h2f_row(const uint16_t *x, float *out, int64_t n, int simd)
    void okv_f2h_row(const float *x, uint16_t *out, int64_t n, int simd)
    void okv_f2bf_row(const float *x, uint16_t *out, int64_t n, int simd)

DEF ROW_BUDGET = 64     # query rows (heads x tokens) per prefill work unit
DEF SPLIT_MAX_ROWS = 256
DEF SPLIT_MIN_KEYS = 1024
DEF PAR_MIN_WORK = 1 << 18  # multiply-adds below which one thread is used
DEF MULTI_HEAD_MAX_FLOATS = 1 << 14  # paged units take all KV heads if Hq*Sq*D (their accumulators) fits
DEF MULTI_HEAD_TASKS = 4     # cache chunks per thread for multi-head units
DEF SERIAL_MERGE_FLOATS = 1 << 18  # partial-state floats up to which the split merge runs on one thread
DEF MULTI_HEAD_MIN_KEYS = 512


cdef int _tiles(okv_attn_args *a, int64_t tq, int nt, int simd, int64_t *stats) noexcept nogil:
    """Query tiles of whole units; stats[0] += quantized bytes loaded,
    stats[1] = bytes of workspace allocated.  The tiles of a unit are taken
    last first: under the causal mask the later query tokens see more keys,
    so the dynamic schedule starts the longest tasks first and ends on short
    ones."""
    cdef int64_t upb = a.Hkv // a.hpu, units = a.B * upb, ntiles = (a.Sq + tq - 1) // tq
    cdef int64_t ntask = units * ntiles, i, u, t0, t1, nb = 0
    cdef int64_t wsz = okv_attn_unit_ws_floats(a, tq)
    cdef float *ws0
    cdef float *ws
    if ntask < nt:
        nt = <int>ntask
    stats[1] = (wsz * nt + 16) * sizeof(float)
    ws0 = <float *>malloc(<size_t>stats[1])
    if ws0 == NULL:
        return -1
    ws = okv_align64(ws0)
    if nt == 1:   # no OpenMP region: entering one costs a decode-sized call more than its work
        for i in range(ntask):
            u = i // ntiles
            t0 = (ntiles - 1 - i % ntiles) * tq
            nb += okv_attn_unit(a, u // upb, (u % upb) * a.hpu, t0, min(t0 + tq, a.Sq), 0, a.Cap, ws, NULL, 0, simd)
    else:
        for i in prange(ntask, num_threads=nt, schedule='dynamic'):
            u = i // ntiles
            t0 = (ntiles - 1 - i % ntiles) * tq
            t1 = t0 + tq
            if t1 > a.Sq:
                t1 = a.Sq
            nb += okv_attn_unit(a, u // upb, (u % upb) * a.hpu, t0, t1, 0, a.Cap, ws + okv_thread_num() * wsz,
                                NULL, 0, simd)
    stats[0] += nb
    free(ws0)
    return 0


cdef int _split(okv_attn_args *a, int64_t nchunks, int nt, int simd, int64_t *stats) noexcept nogil:
    """Cache-split chunks merged exactly; stats as in _tiles (the workspace
    includes the partial states)."""
    cdef int64_t G = a.Hq // a.Hkv, units = a.B * a.Hkv, R = G * a.Sq, nb = 0
    cdef int64_t ntask = a.B * (a.Hkv // a.hpu) * nchunks, i, u
    cdef int64_t wsz = okv_attn_ws_floats(a.hpu * R, a.D) + okv_attn_amx_ws_floats(a, a.Sq)
    cdef int64_t psz = okv_attn_part_floats(R, a.D)
    cdef float *ws0
    cdef float *parts0
    cdef float *ws
    cdef float *parts
    ws0 = <float *>malloc(<size_t>(wsz * nt + 16) * sizeof(float))
    parts0 = <float *>malloc(<size_t>(psz * units * nchunks + 16) * sizeof(float))
    stats[1] = (wsz * nt + psz * units * nchunks + 32) * sizeof(float)
    if ws0 == NULL or parts0 == NULL:
        free(ws0)
        free(parts0)
        return -1
    ws = okv_align64(ws0)
    parts = okv_align64(parts0)
    for i in prange(ntask, num_threads=nt, schedule='dynamic'):
        nb += okv_attn_split_task(a, i, nchunks, ws + okv_thread_num() * wsz, parts, simd)
    stats[0] += nb
    if units * nchunks * psz <= SERIAL_MERGE_FLOATS:
        # small merge: on this thread, sparing a second wake-up of the team
        # (costly when a co-tenant holds one of the cores)
        for u in range(units):
            okv_attn_merge(a, u // a.Hkv, u % a.Hkv, parts + u * nchunks * psz, nchunks)
    else:
        for u in prange(units, num_threads=nt if units >= nt else <int>units, schedule='static'):
            okv_attn_merge(a, u // a.Hkv, u % a.Hkv, parts + u * nchunks * psz, nchunks)
    free(ws0)
    free(parts0)
    return 0


include "attention_switches.pxi"


include "attention_checks.pxi"


cdef bint _attention_fast(q, k, v, kv_len, q_pos, scale, softcap, window, out, kv_start, kv_dtype) except -1:
    """Run ``attention`` when every argument is valid and nothing is empty (the
    cache neither), all checked at C speed: ndarrays whose typed buffers accept
    them (dtype, native byte order, dimensions, C-contiguity, a writeable
    ``out``), shapes, the K/V element type, address ranges of ``out`` against
    q, k and v, kv_len / kv_start values, scalars -- the conditions of the
    Python checks.  Return False, with nothing written, to send the call
    through those checks (which name the bad argument)."""
    cdef const float[:, :, :, ::1] qv
    cdef float[:, :, :, ::1] ov
    cdef const uint16_t[:, :, :, ::1] kv
    cdef const uint16_t[:, :, :, ::1] vv
    cdef const int32_t[::1] lv
    cdef const int32_t[:, ::1] pv
    cdef const int32_t[::1] sv
    cdef int64_t B, Hq, Sq, D, Hkv, Cap, maxlen
    cdef size_t onb, knb
    cdef okv_attn_args a
    if not (isinstance(q, np.ndarray) and isinstance(k, np.ndarray) and isinstance(v, np.ndarray)
            and isinstance(kv_len, np.ndarray) and isinstance(q_pos, np.ndarray) and isinstance(out, np.ndarray)
            and (kv_start is None or isinstance(kv_start, np.ndarray)) and _scalars_ok(scale, softcap, window)):
        return False
    kvname = _kv_fast_name(k, kv_dtype)
    if kvname is None or v.dtype is not k.dtype:
        return False
    try:
        qv = q
        ov = out
        lv = kv_len
        pv = q_pos
        if kv_start is not None:
            sv = kv_start
        # K/V of any element type as 16-bit words (a float32 element is two)
        kv = k.view(np.uint16)
        vv = v.view(np.uint16)
    except (ValueError, TypeError, BufferError):
        return False
    B, Hq, Sq, D = qv.shape[0], qv.shape[1], qv.shape[2], qv.shape[3]
    Hkv, Cap = kv.shape[1], kv.shape[2]
    if B == 0 or Hq == 0 or Sq == 0 or D == 0 or Hkv == 0 or Cap == 0 or Hq % Hkv != 0:
        return False
    if kv.shape[0] != B or kv.shape[3] != D * (k.itemsize // 2) or vv.shape[0] != B or vv.shape[1] != Hkv \
            or vv.shape[2] != Cap or vv.shape[3] != kv.shape[3]:
        return False
    if ov.shape[0] != B or ov.shape[1] != Hq or ov.shape[2] != Sq or ov.shape[3] != D \
            or lv.shape[0] != B or pv.shape[0] != B or pv.shape[1] != Sq \
            or (kv_start is not None and sv.shape[0] != B):
        return False
    onb = <size_t>(B * Hq * Sq * D) * sizeof(float)
    knb = <size_t>(B * Hkv * Cap * kv.shape[3]) * sizeof(uint16_t)
    if not (_disjoint(&ov[0, 0, 0, 0], onb, &qv[0, 0, 0, 0], onb)
            and _disjoint(&ov[0, 0, 0, 0], onb, &kv[0, 0, 0, 0], knb)
            and _disjoint(&ov[0, 0, 0, 0], onb, &vv[0, 0, 0, 0], knb)
            and _disjoint(&ov[0, 0, 0, 0], onb, &lv[0], <size_t>B * 4)
            and _disjoint(&ov[0, 0, 0, 0], onb, &pv[0, 0], <size_t>(B * Sq) * 4)
            and (kv_start is None or _disjoint(&ov[0, 0, 0, 0], onb, &sv[0], <size_t>B * 4))):
        return False
    maxlen = _lengths_max(lv, Cap)
    if maxlen < 0 or (kv_start is not None and _lengths_max(sv, Cap) < 0):
        return False
    _init_args(&a, q, out, kv_len, q_pos, Hkv, Cap, scale, softcap, window, _KV_TYPES[kvname])
    a.k = &kv[0, 0, 0, 0]
    a.v = &vv[0, 0, 0, 0]
    if kv_start is not None:
        a.kv_start = &sv[0]
    _run(&a, maxlen, "attention", okv_settings_get())
    return True


def attention(q, k, v, kv_len, q_pos, scale, softcap, window, out, kv_start=None, *, kv_dtype=None):
    """Causal streaming attention of q over the cached keys/values; writes ``out``.

    q, out   [B, Hq, Sq, D] float32, C-contiguous (out must not overlap q, k, v)
    k, v     [B, Hkv, Cap, D], same dtype: float32, float16, or bfloat16 stored as
             uint16 bit patterns (upper half of the float32 bits) -- bfloat16 has
             no NumPy dtype, so uint16 arrays are accepted only with the explicit
             keyword ``kv_dtype="bfloat16"``.  Only positions < kv_len[b] are read.
             FLOAT16/BFLOAT16 are converted to float32 in the load step (F16C /
             shift left 16); all math is float32.
    kv_len   [B] int32 in [0, Cap]
    q_pos    [B, Sq] int32: absolute position p of each query token; it sees keys
             j with kv_start[b] <= j <= p, j < kv_len[b] and, if window >= 0,
             j >= p - window
    kv_start [B] int32 in [0, Cap] or None (all zeros): left padding
    scale    float multiplying q.k; softcap > 0: s = softcap*tanh(s/softcap); 0 = off
    window   int in [-1, 2**62] (-1 = unlimited)
    kv_dtype None (infer float32/float16 from k.dtype), "float32", "float16" or
             "bfloat16" (k, v must then be uint16); keyword only.
    Hq must be a multiple of Hkv (MHA, GQA, MQA).  A query row with no visible
    key gets zeros.  NaN and infinities as the dense softmax (the NumPy twin):
    a query row with a NaN or +inf visible score (a NaN in q or in a key it
    sees) gets NaN, one whose visible scores are all -inf gets zeros; keys a
    row does not see never enter its softmax (attention.h).  Every check
    raises ValueError naming the argument before anything is written.  (Called once per layer per decode step, so valid
    arguments are checked in C; only a failing check takes the Python checks.)
    """
    if _attention_fast(q, k, v, kv_len, q_pos, scale, softcap, window, out, kv_start, kv_dtype):
        return
    V.array("q", q, (V.F32,), ndim=4)
    B, Hq, Sq, D = q.shape
    if not isinstance(k, np.ndarray):
        raise ValueError(f"k: expected a numpy.ndarray, got {type(k).__name__}")
    kvname = _kv_type(k, kv_dtype)
    kvdt = _KV_DTYPES[kvname]
    V.array("k", k, (kvdt,), ndim=4)
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k: expected shape [{B}, Hkv, Cap, {D}], got {k.shape}")
    Hkv, Cap = k.shape[1], k.shape[2]
    if isinstance(v, np.ndarray) and v.dtype != kvdt:
        raise ValueError(f"v: dtype {v.dtype} does not match k dtype {k.dtype} (K and V must share the "
                         "element type)")
    V.array("v", v, (kvdt,), shape=k.shape)
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"k: number of KV heads {Hkv} must divide the number of query heads {Hq}")
    V.array("kv_len", kv_len, (V.I32,), shape=(B,))
    V.array("q_pos", q_pos, (V.I32,), shape=(B, Sq))
    if kv_start is not None:
        V.array("kv_start", kv_start, (V.I32,), shape=(B,))
    V.array("out", out, (V.F32,), shape=q.shape, writeable=True)
    V.no_overlap("out", out, q, "q")
    V.no_overlap("out", out, k, "k")
    V.no_overlap("out", out, v, "v")
    V.no_overlap("out", out, kv_len, "kv_len")  # read while out is written
    V.no_overlap("out", out, q_pos, "q_pos")
    V.no_overlap("out", out, kv_start, "kv_start")
    _check_values("kv_len", kv_len, 0, Cap)
    if kv_start is not None:
        _check_values("kv_start", kv_start, 0, Cap)
    scale, softcap, window = _scalars(scale, softcap, window)
    if out.size == 0:
        return

    cdef const float[:, :, :, ::1] kv
    cdef const float[:, :, :, ::1] vv
    cdef const uint16_t[:, :, :, ::1] kh
    cdef const uint16_t[:, :, :, ::1] vh
    cdef const int32_t[::1] sv
    cdef okv_attn_args a
    _init_args(&a, q, out, kv_len, q_pos, Hkv, Cap, scale, softcap, window, _KV_TYPES[kvname])
    if k.size:
        if kvname == "float32":
            kv = k
            vv = v
            a.k = &kv[0, 0, 0, 0]
            a.v = &vv[0, 0, 0, 0]
        else:
            kh = k.view(np.uint16)
            vh = v.view(np.uint16)
            a.k = &kh[0, 0, 0, 0]
            a.v = &vh[0, 0, 0, 0]
    if kv_start is not None:
        sv = kv_start
        a.kv_start = &sv[0]
    _run(&a, int(kv_len.max()), "attention", okv_settings_get())


_KV_TYPES = {"float32": OKV_KV_F32, "float16": OKV_KV_F16, "bfloat16": OKV_KV_BF16}


include "attention_decode_token.pxi"


include "attention_masked_decode.pxi"


cdef void _init_args(okv_attn_args *a, q, out, kv_len, q_pos, int64_t Hkv, int64_t Cap, float scale, float softcap,
                     int64_t window, int kv_type):
    """Fill the fields every call has from checked, non-empty arguments (q, out
    [B, Hq, Sq, D] float32; kv_len [B], q_pos [B, Sq] int32); the K/V source
    (contiguous k/v or page tables) and kv_start are left NULL.  The pointers
    stay valid while the caller holds the arrays."""
    cdef const float[:, :, :, ::1] qv = q
    cdef float[:, :, :, ::1] ov = out
    cdef const int32_t[::1] lv = kv_len
    cdef const int32_t[:, ::1] pv = q_pos
    _fill_args(a, &qv[0, 0, 0, 0], &ov[0, 0, 0, 0], &lv[0], &pv[0, 0], qv.shape[0], qv.shape[1], qv.shape[2],
               qv.shape[3], Hkv, Cap, scale, softcap, window, kv_type)


cdef void _fill_args(okv_attn_args *a, const float *q, float *out, const int32_t *kv_len, const int32_t *q_pos,
                     int64_t B, int64_t Hq, int64_t Sq, int64_t D, int64_t Hkv, int64_t Cap, float scale,
                     float softcap, int64_t window, int kv_type) noexcept nogil:
    """``_init_args`` from raw pointers and shapes."""
    a.q = q
    a.out = out
    a.kv_len = kv_len
    a.q_pos = q_pos
    a.k = NULL
    a.v = NULL
    a.k_pages = NULL
    a.v_pages = NULL
    a.block_tables = NULL
    a.kv_start = NULL
    a.M = 0
    a.bs = 0
    a.B, a.Hq, a.Sq, a.D = B, Hq, Sq, D
    a.Hkv, a.Cap = Hkv, Cap
    a.scale = scale
    a.softcap = softcap
    a.window = window
    a.kv_type = kv_type
    a.hpu = 1
    a.k_fmt = NULL
    a.v_fmt = NULL
    a.kG = 1
    a.vG = 1
    a.k_compact = 0
    a.k_czp = 0
    a.amx = 0


cdef dict _run(okv_attn_args *a, int64_t maxlen, str api, okv_settings s):
    """``_run_units`` for a Python caller: raises MemoryError naming ``api``
    when the workspace cannot be allocated.  Returns {"dequantized_bytes":
    quantized codes and header bytes loaded, "workspace_peak_bytes": workspace
    allocated}."""
    cdef int64_t stats[2]
    cdef int rc
    with nogil:
        rc = _run_units(a, maxlen, s, stats)
    if rc != 0:
        raise MemoryError(f"{api}: could not allocate the workspace")
    return {"dequantized_bytes": int(stats[0]), "workspace_peak_bytes": int(stats[1])}


cdef int _run_units(okv_attn_args *a, int64_t maxlen, okv_settings s, int64_t *stats) noexcept nogil:
    """Run the work units of a fully described call: query tiles of whole
    (b, KV head) groups (all KV heads of b in one unit for paged decode), or
    cache-split chunks merged exactly when the units do not fill the threads.
    maxlen: the longest kv_len; s: the settings of the call.  stats[0]: the
    quantized codes and header bytes loaded, stats[1]: the workspace bytes
    allocated.  Returns 0, or -1 when the workspace cannot be allocated."""
    a.prefetch = s.prefetch
    a.pf_qk_lines = s.pf_qk_lines
    a.prefill_rg = s.prefill_rg
    a.flash = s.flash
    a.bf16 = s.bf16 and a.Sq >= OKV_BF16_MIN_ROWS
    cdef int nt = s.threads, simd = 0
    cdef int64_t B = a.B, Hq = a.Hq, Hkv = a.Hkv, Sq = a.Sq, D = a.D
    cdef int64_t G = Hq // Hkv, units, tq, nchunks = 1, h
    # Paged decode: one unit takes every KV head of its keys, so it reads each
    # page (all heads, head-major) front to back instead of one short run per head.
    if s.simd:
        simd = OKV_ATTN_AVX512 if s.avx512 else OKV_ATTN_AVX2
    a.amx = 0
    if simd == OKV_ATTN_AVX512 and s.amx:
        # keys: every call (per-channel key scales: only 8-bit pages go to AMX, attention_unit.h decides per page)
        a.amx = 1
    a.hpu = 1
    if a.block_tables != NULL and Hq * Sq * D <= MULTI_HEAD_MAX_FLOATS:
        if s.paged_heads <= 0:
            a.hpu = Hkv
        else:   # the most heads per unit, up to s.paged_heads, that divide Hkv
            for h in range(1, min(s.paged_heads, Hkv) + 1):
                if Hkv % h == 0:
                    a.hpu = h
    units = B * (Hkv // a.hpu)
    if B * Hq * Sq * max(maxlen, 1) * D < PAR_MIN_WORK:
        nt = 1          # too small to amortise waking the thread team
    if nt > 1 and Sq * G <= SPLIT_MAX_ROWS and Sq <= 16:
        if units < nt:      # fill the threads
            nchunks = min((nt + units - 1) // units, max(1, maxlen // (2 * OKV_BK)))
        # long caches: at least s.split_tasks tasks per thread (chunks of
        # >= SPLIT_MIN_KEYS keys) so the dynamic schedule balances threads that
        # run at different speeds (shared cores, one thread starting late)
        if s.split_tasks > 0:
            nchunks = max(nchunks, min((s.split_tasks * nt + units - 1) // units, maxlen // SPLIT_MIN_KEYS))
        if a.hpu > 1:   # few multi-head units: several chunks per thread for the dynamic schedule to balance
            nchunks = max(nchunks, min((MULTI_HEAD_TASKS * nt + units - 1) // units, maxlen // MULTI_HEAD_MIN_KEYS))
    stats[0] = 0
    stats[1] = 0
    if nchunks > 1:
        return _split(a, nchunks, nt, simd, stats)
    tq = max(1, min(Sq, OKV_MAX_TQ, ROW_BUDGET // G))
    return _tiles(a, tq, nt, simd, stats)


include "attention_paged.pxi"
include "attention_decode_paged.pxi"
