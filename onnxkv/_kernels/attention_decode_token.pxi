# onnxkv/_kernels/attention_decode_token.pxi: decode_token -- rotary, the new K/V rows written and attention of
# S tokens of one sequence over a state's contiguous caches, checked at C speed (decode_token) or on checked
# pointers for the compiled step (decode_token_ptr).  Included by attention.pyx (a Cython include: it shares that
# module's names).

cdef object _F32 = np.dtype(np.float32)   # (_F16: attention_checks.pxi)
cdef object _U16 = np.dtype(np.uint16)
cdef object _I64 = np.dtype(np.int64)


def decode_token(q, k, v, cos, sin, interleaved, k_cache, v_cache, pos, scale, softcap, window, out,
                 *, kv_dtype=None) -> bool:
    """S new tokens of each of B sequences into a state's caches, fused: rotary
    on q and k, each row's k and v written at positions ``pos[b] .. pos[b] + S
    - 1`` of every KV head of its caches, then causal attention of each query
    over positions [0, its own] of its row into ``out`` (a decode step: S =
    1, B rows of a batch; a speculative verification: a few tokens of one).

    q                [B, S, Hq * D] float32, or float16 (a float16 model's tokens: then k, v and
                     out are float16 too and the caches 2-byte; rows may be strided, as slices of
                     a packed QKV row; with B > 1 and S > 1 a row's tokens follow the previous
                     row's: ``strides[0] == S * strides[1]``)
    k, v             [B, S, Hkv * D] of q's type (likewise)
    out              [B, S, Hq * D] of q's type, C-contiguous
    cos, sin         [max_pos, R / 2] float32 with 2 <= R <= D and every pos[b] + S <= max_pos
                     (row ``p`` rotates the first R dims of each head at position p, as
                     ``rotary_embedding``), or both None: no rotary
    k_cache, v_cache [B, Hkv, Cap, D], C-contiguous, writable: float32 (float32 tokens only),
                     float16, or bfloat16 bit patterns (uint16, with the keyword kv_dtype="bfloat16";
                     kv_dtype None or the caches' own type name otherwise)
    pos              an int (one row: B == 1) or int64 [B], C-contiguous: 0 <= pos[b] and
                     pos[b] + S <= min(Cap, 2**31 - 1)
    scale, softcap, window as ``attention``; the last dim of every array contiguous.

    Writes k_cache[b, :, pos[b]:pos[b] + S], v_cache[b, :, pos[b]:pos[b] + S]
    and out only; the result is bit for bit that of ``rotary_embedding`` on q
    and k (float16 widened to float32 first), writing the rows (rounded to the
    cache's type to nearest even, as NumPy's cast and ``f32_to_bf16`` round;
    float16 rows into a float16 cache without rotary: copied), and
    ``attention`` with kv_len = pos + S and q_pos[b] = [pos[b], .., pos[b] +
    S - 1] (the same kernels, row functions and thread split), its float32
    result rounded to float16 for float16 tokens (NaN payloads aside).
    Returns True when done; False, with nothing written, when an argument does
    not fit that description, out overlaps another argument or a cache
    overlaps the other or q, k, v, cos, sin -- the caller then takes the
    unfused calls, whose checks name the bad argument.  (One call per layer per
    decode step: every check is at C speed.)
    """
    cdef int64_t one = 0
    cdef const int64_t[::1] pv
    cdef const int64_t *pp = &one
    cdef int64_t B = 1
    if not (isinstance(q, np.ndarray) and isinstance(k, np.ndarray) and isinstance(v, np.ndarray)
            and isinstance(k_cache, np.ndarray) and isinstance(v_cache, np.ndarray) and isinstance(out, np.ndarray)
            and (sin is None) == (cos is None) and _scalars_ok(scale, softcap, window) and k_cache.flags.c_contiguous
            and v_cache.flags.c_contiguous and out.flags.c_contiguous and q.ndim == 3):
        return False
    if isinstance(pos, np.ndarray):
        if pos.dtype != _I64 or pos.ndim != 1 or pos.shape[0] != q.shape[0] or pos.shape[0] == 0 \
                or not pos.flags.c_contiguous:
            return False
        try:
            pv = pos.copy()   # the call's own: no write of the call may change a position it reads
        except (ValueError, TypeError, BufferError):
            return False
        pp, B = &pv[0], pv.shape[0]
    elif isinstance(pos, (int, np.integer)) and not isinstance(pos, bool) and q.shape[0] == 1 \
            and -2**63 <= pos < 2**63:
        one = pos
    else:
        return False
    if (kv_dtype is None or kv_dtype == "float32") and q.dtype == _F32 and k_cache.dtype == _F32:
        return _decode_f32(q, k, v, cos, sin, interleaved, k_cache, v_cache, pp, B, scale, softcap, window, out)
    return _decode_narrow(q, k, v, cos, sin, interleaved, k_cache, v_cache, pp, B, scale, softcap, window, out,
                          kv_dtype)


cdef bint _decode_f32(q, k, v, cos, sin, interleaved, k_cache, v_cache, const int64_t *pos, int64_t B, scale,
                      softcap, window, out) except -1:
    """``decode_token`` of float32 tokens into float32 caches (checked there but for the views)."""
    cdef const float[:, :, :] qv     # rows may be strided (checked by _token_geometry: each row contiguous)
    cdef const float[:, :, :] kv
    cdef const float[:, :, :] vv
    cdef float[:, :, ::1] ov
    cdef float[:, :, :, ::1] kc
    cdef float[:, :, :, ::1] vc
    cdef const float[:, ::1] cv
    cdef const float[:, ::1] sv
    cdef int rot = cos is not None
    cdef int64_t g[9]
    cdef int64_t rd[4]
    try:
        qv = q
        kv = k
        vv = v
        ov = out
        kc = k_cache
        vc = v_cache
        if rot:
            cv = cos
            sv = sin
    except (ValueError, TypeError, BufferError):
        return False
    if rot:
        rd[0], rd[1], rd[2], rd[3] = cv.shape[0], cv.shape[1], sv.shape[0], sv.shape[1]
    if not _token_geometry(qv.shape, qv.strides, kv.shape, kv.strides, vv.shape, vv.strides, kc.shape, vc.shape,
                           ov.shape, rd, rot, 4, pos, B, g) \
            or not _token_disjoint(&qv[0, 0, 0], &kv[0, 0, 0], &vv[0, 0, 0], &kc[0, 0, 0, 0], &vc[0, 0, 0, 0],
                                   &ov[0, 0, 0], &cv[0, 0] if rot else NULL, &sv[0, 0] if rot else NULL,
                                   <size_t>(rd[0] * rd[1]) * 4 if rot else 0, g, B, 4, 4):
        return False
    if decode_token_ptr(&qv[0, 0, 0], g[6], &kv[0, 0, 0], g[7], &vv[0, 0, 0], g[8], &cv[0, 0] if rot else NULL,
                        &sv[0, 0] if rot else NULL, g[5], 1 if interleaved else 0, &kc[0, 0, 0, 0], &vc[0, 0, 0, 0],
                        B, g[0], g[1], g[2], g[3], g[4], pos, scale, softcap, window, &ov[0, 0, 0], okv_settings_get(),
                        0, OKV_KV_F32) != 0:
        raise MemoryError("decode_token: could not allocate the rotated queries or the workspace")
    return True


cdef bint _decode_narrow(q, k, v, cos, sin, interleaved, k_cache, v_cache, const int64_t *pos, int64_t B, scale,
                         softcap, window, out, kv_dtype) except -1:
    """``decode_token`` into 2-byte caches (float16, or bfloat16 bit patterns), of float32 or float16 tokens."""
    cdef const void *tok[4]     # q, k, v, out
    cdef Py_ssize_t sh[4][3]
    cdef Py_ssize_t st[4][3]
    cdef uint16_t[:, :, :, ::1] kc
    cdef uint16_t[:, :, :, ::1] vc
    cdef const float[:, ::1] cv
    cdef const float[:, ::1] sv
    cdef int rot = cos is not None, kv_type, io16 = q.dtype == _F16, j
    cdef int64_t g[9]
    cdef int64_t rd[4]
    if (kv_dtype is None or kv_dtype == "float16") and k_cache.dtype == _F16 and v_cache.dtype == _F16:
        kv_type = OKV_KV_F16
    elif kv_dtype == "bfloat16" and k_cache.dtype == _U16 and v_cache.dtype == _U16:
        kv_type = OKV_KV_BF16
    else:
        return False
    want = _F16 if io16 else _F32
    if q.dtype != want or k.dtype != want or v.dtype != want or out.dtype != want:
        return False
    arrays = (q, k, v, out)
    try:
        for j in range(4):
            _rows_view(arrays[j], io16, j == 3, &tok[j], sh[j], st[j])
        kc = k_cache.view(np.uint16)
        vc = v_cache.view(np.uint16)
        if rot:
            cv = cos
            sv = sin
    except (ValueError, TypeError, BufferError):
        return False
    if rot:
        rd[0], rd[1], rd[2], rd[3] = cv.shape[0], cv.shape[1], sv.shape[0], sv.shape[1]
    if not _token_geometry(sh[0], st[0], sh[1], st[1], sh[2], st[2], kc.shape, vc.shape, sh[3], rd, rot,
                           2 if io16 else 4, pos, B, g) \
            or not _token_disjoint(tok[0], tok[1], tok[2], &kc[0, 0, 0, 0], &vc[0, 0, 0, 0], tok[3],
                                   &cv[0, 0] if rot else NULL, &sv[0, 0] if rot else NULL,
                                   <size_t>(rd[0] * rd[1]) * 4 if rot else 0, g, B, 2 if io16 else 4, 2):
        return False
    if decode_token_ptr(tok[0], g[6], tok[1], g[7], tok[2], g[8], &cv[0, 0] if rot else NULL,
                        &sv[0, 0] if rot else NULL, g[5], 1 if interleaved else 0, &kc[0, 0, 0, 0], &vc[0, 0, 0, 0],
                        B, g[0], g[1], g[2], g[3], g[4], pos, scale, softcap, window, <void *>tok[3],
                        okv_settings_get(), io16, kv_type) != 0:
        raise MemoryError("decode_token: could not allocate the rotated queries or the workspace")
    return True


cdef int _rows_view(x, int io16, bint writable, const void **ptr, Py_ssize_t *shape, Py_ssize_t *strides) except -1:
    """Set the address, shape and byte strides of the 3-D float32 (float16 when ``io16``) array ``x`` through a
    buffer view (rows may be strided; ``writable``: a C-contiguous writable one); raises ValueError, TypeError
    or BufferError when it has none (the callers then decline).  The address stays valid while ``x`` lives."""
    cdef const float[:, :, :] f
    cdef const uint16_t[:, :, :] h
    cdef float[:, :, ::1] fw
    cdef uint16_t[:, :, ::1] hw
    cdef int i
    if writable:
        if io16:
            hw = x.view(np.uint16)
            ptr[0] = &hw[0, 0, 0]
            for i in range(3):
                shape[i], strides[i] = hw.shape[i], hw.strides[i]
        else:
            fw = x
            ptr[0] = &fw[0, 0, 0]
            for i in range(3):
                shape[i], strides[i] = fw.shape[i], fw.strides[i]
    elif io16:
        h = x.view(np.uint16)
        ptr[0] = &h[0, 0, 0]
        for i in range(3):
            shape[i], strides[i] = h.shape[i], h.strides[i]
    else:
        f = x
        ptr[0] = &f[0, 0, 0]
        for i in range(3):
            shape[i], strides[i] = f.shape[i], f.strides[i]
    return 0


cdef bint _token_geometry(const Py_ssize_t *qd, const Py_ssize_t *qst, const Py_ssize_t *kd,
                          const Py_ssize_t *kst, const Py_ssize_t *vd, const Py_ssize_t *vst,
                          const Py_ssize_t *cd, const Py_ssize_t *vcd, const Py_ssize_t *od, const int64_t *rd,
                          int rot, int64_t isz, const int64_t *pos, int64_t B, int64_t *g) noexcept nogil:
    """Whether the arrays of a ``decode_token`` call fit it (q, k, v [B, S, W] of ``isz``-byte elements with
    strides ``*st`` in bytes, caches [B, Hkv, Cap, D], out [B, S, Hq*D], rd: cos and sin (rows, cols), pos
    [B]); g: (Hq, Hkv, Cap, D, S, half, q / k / v token-row strides in elements)."""
    cdef int64_t Hq, Hkv = cd[1], Cap = cd[2], D = cd[3], S = qd[1], half = 0, qs, ks, vs, b, top
    cdef int j
    if qst[2] != isz or kst[2] != isz or vst[2] != isz:
        return False
    if B < 1 or cd[0] != B or vcd[0] != B or vcd[1] != Hkv or vcd[2] != Cap or vcd[3] != D \
            or Hkv == 0 or D == 0 or S == 0 or S > Cap:
        return False
    Hq = qd[2] // D
    if qd[0] != B or Hq == 0 or Hq * D != qd[2] or Hq % Hkv != 0 or od[0] != B or od[1] != S or od[2] != Hq * D:
        return False
    if kd[0] != B or kd[1] != S or kd[2] != Hkv * D or vd[0] != B or vd[1] != S or vd[2] != Hkv * D:
        return False
    top = Cap - S if Cap <= INT32_MAX else INT32_MAX - S   # kv_len = pos + S is an int32 of the kernel
    if rot:
        half = rd[1]
        if half == 0 or 2 * half > D or rd[2] != rd[0] or rd[3] != half or S > rd[0]:
            return False
        if rd[0] - S < top:
            top = rd[0] - S
    for b in range(B):
        if not 0 <= pos[b] <= top:
            return False
    # token-row strides in elements (any for one token row), one stride from (b, t) to the next token row
    qs, ks, vs = Hq * D, Hkv * D, Hkv * D
    if B * S > 1:
        j = 1 if S > 1 else 0
        qs, ks, vs = qst[j], kst[j], vst[j]
        if B > 1 and S > 1 and (qst[0] != S * qst[1] or kst[0] != S * kst[1] or vst[0] != S * vst[1]):
            return False
        if qs <= 0 or ks <= 0 or vs <= 0 or qs % isz or ks % isz or vs % isz:
            return False
        qs, ks, vs = qs // isz, ks // isz, vs // isz
        if qs < Hq * D or ks < Hkv * D or vs < Hkv * D:
            return False
    g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8] = Hq, Hkv, Cap, D, S, half, qs, ks, vs
    return True


cdef bint _token_disjoint(const void *q, const void *k, const void *v, const void *kc, const void *vc,
                          const void *o, const void *cs, const void *sn, size_t tnb, const int64_t *g, int64_t B,
                          int64_t isz, int64_t csz) noexcept nogil:
    """Whether the caches (written) are disjoint from each other and from every operand the call reads (q, k,
    v, the rotary tables cs and sn of ``tnb`` bytes each, or NULL), and out (written) from all of those (g as
    ``_token_geometry`` fills it for B rows; isz, csz: the bytes of a token's and of a cache's element)."""
    cdef int64_t Hq = g[0], Hkv = g[1], Cap = g[2], D = g[3], S = g[4], R = B * g[4]
    cdef size_t qnb = <size_t>((R - 1) * g[6] + Hq * D) * isz, onb = <size_t>(R * Hq * D) * isz
    cdef size_t knb = <size_t>((R - 1) * g[7] + Hkv * D) * isz
    cdef size_t vnb = <size_t>((R - 1) * g[8] + Hkv * D) * isz
    cdef size_t cnb = <size_t>(B * Hkv * Cap * D) * csz
    cdef const void *read[5]
    cdef size_t nb[5]
    cdef int j, n = 5 if cs != NULL else 3
    read[0], read[1], read[2], read[3], read[4] = q, k, v, cs, sn
    nb[0], nb[1], nb[2], nb[3], nb[4] = qnb, knb, vnb, tnb, tnb
    if not (_disjoint(kc, cnb, vc, cnb) and _disjoint(o, onb, kc, cnb) and _disjoint(o, onb, vc, cnb)):
        return False
    for j in range(n):
        if not (_disjoint(read[j], nb[j], kc, cnb) and _disjoint(read[j], nb[j], vc, cnb)
                and _disjoint(read[j], nb[j], o, onb)):
            return False
    return True


cdef int decode_token_ptr(const void *q, int64_t qs, const void *k, int64_t ks, const void *v, int64_t vs,
                          const float *cos, const float *sin, int64_t half, int inter, void *k_cache,
                          void *v_cache, int64_t B, int64_t Hq, int64_t Hkv, int64_t Cap, int64_t D, int64_t S,
                          const int64_t *pos, float scale, float softcap, int64_t window, void *out, okv_settings s,
                          int io16, int kv_type) noexcept nogil:
    """``decode_token`` on checked pointers (the compiled step's replay calls it): B rows of S tokens, token row
    ``b * S + t`` of q at ``(b * S + t) * qs`` elements (Hq*D each), of k, v at ``ks`` / ``vs`` (Hkv*D), out
    [B, S, Hq*D] contiguous, all float32, or float16 when ``io16``; caches [B, Hkv, Cap, D] of ``kv_type``
    (OKV_KV_F32 only with float32 tokens); cos, sin [>= pos[b] + S, half] float32 tables or NULL (no rotary);
    0 <= pos[b], pos[b] + S <= min(Cap, INT32_MAX), Hq % Hkv == 0, 2*half <= D, out disjoint from the others,
    the caches from each other and from q, k, v, cos and sin.  Returns 0, or -1 (nothing written) when memory
    cannot be allocated."""
    cdef int64_t b, h, t, p, r, isz = 2 if io16 else 4, esz = 4 if kv_type == OKV_KV_F32 else 2
    cdef int rot = cos != NULL, i
    cdef bint narrow = io16 or kv_type != OKV_KV_F32
    cdef char *kc
    cdef char *vc
    # queries head-major [B, Hq, S, D] (float32 tokens, one, no rotary: the rows themselves when they follow
    # each other), then two rows of scratch
    cdef float *qr = NULL
    cdef float *wide = NULL
    if rot or S > 1 or narrow or (B > 1 and qs != Hq * D):
        qr = <float *>malloc(<size_t>(B * Hq * S * D + (2 * D if narrow else 0)) * sizeof(float))
        if qr == NULL:
            return -1
        wide = qr + B * Hq * S * D
    for b in range(B):
        kc = <char *>k_cache + b * Hkv * Cap * D * esz
        vc = <char *>v_cache + b * Hkv * Cap * D * esz
        for t in range(S):
            p = pos[b] + t
            r = b * S + t
            for h in range(Hkv):
                for i in range(2):   # the key row, then the value row
                    _new_row(<const char *>(k if i == 0 else v) + ((r * ks if i == 0 else r * vs) + h * D) * isz,
                             (kc if i == 0 else vc) + (h * Cap + p) * D * esz, i == 0 and rot,
                             cos + p * half if rot else NULL, sin + p * half if rot else NULL, half, D, inter, io16,
                             kv_type, wide, wide + D if narrow else NULL, s.simd)
            if qr != NULL:
                for h in range(Hq):
                    _query_row(<const char *>q + (r * qs + h * D) * isz, qr + ((b * Hq + h) * S + t) * D, rot,
                               cos + p * half if rot else NULL, sin + p * half if rot else NULL, half, D, inter,
                               io16, wide, s.simd)
    return _token_attend(<const float *>q if qr == NULL else qr, qr, k_cache, v_cache, B, Hq, Hkv, Cap, D, S, pos,
                         scale, softcap, window, out, io16, kv_type, s)


cdef inline void _new_row(const char *src, char *dst, bint turn, const float *c, const float *sn, int64_t half,
                          int64_t D, int inter, int io16, int kv_type, float *wide, float *turned,
                          int simd) noexcept nogil:
    """One new K (``turn``: rotated by c, sn) or V row of D elements at ``src`` (float32, or float16 when
    ``io16``) into a cache or page row at ``dst`` of ``kv_type``: rotated in float32, rounded to the row's type
    (a float32 row into a float32 cache, or a float16 row into a float16 one, unrotated: copied).  ``wide``,
    ``turned``: D floats of scratch each (unused for float32 tokens into a float32 cache)."""
    cdef const float *row
    if kv_type == OKV_KV_F32:     # float32 tokens (the callers' rule)
        if turn:
            okv_rope_row_f32(<const float *>src, c, sn, <float *>dst, half, D, inter, simd)
        else:
            memcpy(dst, src, <size_t>D * sizeof(float))
        return
    if io16 and kv_type == OKV_KV_F16 and not turn:
        memcpy(dst, src, <size_t>D * 2)
        return
    row = <const float *>src
    if io16:
        okv_h2f_row(<const uint16_t *>src, wide, D, simd)
        row = wide
    if turn:
        okv_rope_row_f32(row, c, sn, turned, half, D, inter, simd)
        row = turned
    if kv_type == OKV_KV_F16:
        okv_f2h_row(row, <uint16_t *>dst, D, simd)
    else:
        okv_f2bf_row(row, <uint16_t *>dst, D, simd)


cdef inline void _query_row(const char *src, float *dst, int rot, const float *c, const float *sn, int64_t half,
                            int64_t D, int inter, int io16, float *wide, int simd) noexcept nogil:
    """One query row of D elements at ``src`` (float32, or float16 when ``io16``: widened into ``wide``)
    into the float32 row ``dst``, rotated by c, sn when ``rot``."""
    cdef const float *row = <const float *>src
    if io16:
        okv_h2f_row(<const uint16_t *>src, wide, D, simd)
        row = wide
    if rot:
        okv_rope_row_f32(row, c, sn, dst, half, D, inter, simd)
    else:
        memcpy(dst, row, <size_t>D * sizeof(float))


cdef int _token_attend(const float *q, float *owned, const void *k_cache, const void *v_cache, int64_t B,
                       int64_t Hq, int64_t Hkv, int64_t Cap, int64_t D, int64_t S, const int64_t *pos, float scale,
                       float softcap, int64_t window, void *out, int io16, int kv_type, okv_settings s) noexcept nogil:
    """The attention of ``decode_token_ptr``: the S queries of each of B rows ``q`` (float32, head-major [B, Hq,
    S, D]; ``owned``: the buffer to free after, or NULL) over row b's cache positions [0, pos[b] + S), causal,
    into ``out`` ([B, S, Hq*D], float32, or rounded to float16 when ``io16``).  Returns 0, or -1 when memory
    cannot be allocated."""
    cdef int64_t b, h, t, longest = 0
    cdef int64_t stats[2]
    cdef int32_t kl1, qp1
    cdef int32_t *kl = &kl1
    cdef int32_t *qp = &qp1
    cdef bint staged = S > 1 or io16, lists = B * S > 1
    cdef float *ow = <float *>out
    cdef okv_attn_args a
    cdef int rc
    if lists:
        kl = <int32_t *>malloc(<size_t>(B + B * S) * sizeof(int32_t))
    if staged:   # head-major results, then token-major rows of out
        ow = <float *>malloc(<size_t>(B * Hq * S * D) * sizeof(float))
    if (lists and kl == NULL) or ow == NULL:
        free(owned)
        if lists:
            free(kl)
        if staged:
            free(ow)
        return -1
    if lists:
        qp = kl + B
    for b in range(B):
        kl[b] = <int32_t>(pos[b] + S)
        longest = pos[b] + S if pos[b] + S > longest else longest
        for t in range(S):
            qp[b * S + t] = <int32_t>(pos[b] + t)
    _fill_args(&a, q, ow, kl, qp, B, Hq, S, D, Hkv, Cap, scale, softcap, window, kv_type)
    a.k = k_cache
    a.v = v_cache
    rc = _run_units(&a, longest, s, stats)
    free(owned)
    if staged:
        if rc == 0:
            for b in range(B):
                for t in range(S):
                    for h in range(Hq):
                        if io16:
                            okv_f2h_row(ow + ((b * Hq + h) * S + t) * D,
                                        <uint16_t *>out + ((b * S + t) * Hq + h) * D, D, s.simd)
                        else:
                            memcpy(<float *>out + ((b * S + t) * Hq + h) * D, ow + ((b * Hq + h) * S + t) * D,
                                   <size_t>D * sizeof(float))
        free(ow)
    if lists:
        free(kl)
    return rc
