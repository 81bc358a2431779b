# onnxkv/_kernels/attention_decode_token.pxi: decode_token -- rotary, the new K/V rows written and attention of
# S tokens of one sequence over float32 caches, checked at C speed (decode_token) or on checked pointers for the
# compiled step (decode_token_ptr).  Included by attention.pyx (a Cython include: it shares that module's names).


def decode_token(q, k, v, cos, sin, interleaved, k_cache, v_cache, int64_t pos, scale, softcap, window, out) -> bool:
    """S new tokens of one sequence into float32 caches, fused: rotary on q and
    k, the tokens' k and v rows written at positions ``pos .. pos + S - 1`` of
    every KV head of the caches, then causal attention of each query over
    positions [0, its own] into ``out`` (a decode step: S = 1; a speculative
    verification: a few).

    q                [1, S, Hq * D] float32 (each token's heads side by side;
                     rows may be strided, as slices of a packed QKV row)
    k, v             [1, S, Hkv * D] float32 (rows may be strided)
    out              [1, S, Hq * D] float32, C-contiguous
    cos, sin         [max_pos, R / 2] float32 with 2 <= R <= D and pos + S <= max_pos
                     (row ``p`` rotates the first R dims of each head at position p, as
                     ``rotary_embedding``), or both None: no rotary
    k_cache, v_cache [1, Hkv, Cap, D] float32, C-contiguous, writable, 0 <= pos, pos + S <= Cap
    scale, softcap, window as ``attention``; the last dim of every array contiguous.

    Writes k_cache[0, :, pos:pos + S], v_cache[0, :, pos:pos + S] and out only;
    the result is bit for bit that of ``rotary_embedding`` on q and k, writing
    the rows, and ``attention`` with kv_len = [pos + S] and q_pos = [[pos, ..,
    pos + S - 1]] (the same kernels, row functions and thread split).  Returns
    True when done; False, with nothing written, when an argument does not fit
    that description or out overlaps another argument (or k, v a cache) -- the
    caller then takes the unfused calls, whose checks name the bad argument.
    (One call per layer per decode step: every check is at C speed.)
    """
    cdef const float[:, :, :] qv     # rows may be strided (checked below: each row contiguous)
    cdef const float[:, :, :] kv
    cdef const float[:, :, :] vv
    cdef float[:, :, ::1] ov
    cdef float[:, :, :, ::1] kc
    cdef float[:, :, :, ::1] vc
    cdef const float[:, ::1] cv
    cdef const float[:, ::1] sv
    cdef int64_t Hq, Hkv, Cap, D, S, half = 0, qs, ks, vs
    cdef okv_settings s = okv_settings_get()
    cdef int rot = cos is not None, inter = 1 if interleaved else 0
    if not (isinstance(q, np.ndarray) and isinstance(k, np.ndarray) and isinstance(v, np.ndarray)
            and isinstance(k_cache, np.ndarray) and isinstance(v_cache, np.ndarray) and isinstance(out, np.ndarray)
            and (sin is None) == (not rot) and _scalars_ok(scale, softcap, window) and k_cache.flags.c_contiguous
            and v_cache.flags.c_contiguous and out.flags.c_contiguous):
        return False
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
    if qv.strides[2] != 4 or kv.strides[2] != 4 or vv.strides[2] != 4:
        return False
    Hkv, Cap, D, S = kc.shape[1], kc.shape[2], kc.shape[3], qv.shape[1]
    if kc.shape[0] != 1 or vc.shape[0] != 1 or vc.shape[1] != Hkv or vc.shape[2] != Cap or vc.shape[3] != D \
            or Hkv == 0 or D == 0 or S == 0 or not 0 <= pos <= Cap - S:
        return False
    Hq = qv.shape[2] // D
    if qv.shape[0] != 1 or Hq == 0 or Hq * D != qv.shape[2] or Hq % Hkv != 0 \
            or ov.shape[0] != 1 or ov.shape[1] != S or ov.shape[2] != Hq * D:
        return False
    if kv.shape[0] != 1 or kv.shape[1] != S or kv.shape[2] != Hkv * D \
            or vv.shape[0] != 1 or vv.shape[1] != S or vv.shape[2] != Hkv * D:
        return False
    if rot:
        half = cv.shape[1]
        if half == 0 or 2 * half > D or sv.shape[0] != cv.shape[0] or sv.shape[1] != half or pos > cv.shape[0] - S:
            return False
    # row strides in floats (any for one row); rows must not overlap
    qs, ks, vs = Hq * D, Hkv * D, Hkv * D
    if S > 1:
        qs, ks, vs = qv.strides[1], kv.strides[1], vv.strides[1]
        if qs <= 0 or ks <= 0 or vs <= 0 or qs % 4 or ks % 4 or vs % 4:
            return False
        qs, ks, vs = qs // 4, ks // 4, vs // 4
        if qs < Hq * D or ks < Hkv * D or vs < Hkv * D:
            return False
    cdef size_t qnb = <size_t>((S - 1) * qs + Hq * D) * sizeof(float), onb = <size_t>(S * Hq * D) * sizeof(float)
    cdef size_t knb = <size_t>((S - 1) * ks + Hkv * D) * sizeof(float)
    cdef size_t vnb = <size_t>((S - 1) * vs + Hkv * D) * sizeof(float)
    cdef size_t cnb = <size_t>(Hkv * Cap * D) * sizeof(float)
    cdef const void *o = &ov[0, 0, 0]
    if not (_disjoint(o, onb, &qv[0, 0, 0], qnb) and _disjoint(o, onb, &kc[0, 0, 0, 0], cnb)
            and _disjoint(o, onb, &vc[0, 0, 0, 0], cnb) and _disjoint(&kc[0, 0, 0, 0], cnb, &vc[0, 0, 0, 0], cnb)
            and _disjoint(&kv[0, 0, 0], knb, &kc[0, 0, 0, 0], cnb) and _disjoint(&vv[0, 0, 0], vnb, &vc[0, 0, 0, 0], cnb)
            and _disjoint(&kv[0, 0, 0], knb, &vc[0, 0, 0, 0], cnb) and _disjoint(&vv[0, 0, 0], vnb, &kc[0, 0, 0, 0], cnb)):
        return False
    if decode_token_ptr(&qv[0, 0, 0], qs, &kv[0, 0, 0], ks, &vv[0, 0, 0], vs, &cv[0, 0] if rot else NULL,
                        &sv[0, 0] if rot else NULL, half, inter, &kc[0, 0, 0, 0], &vc[0, 0, 0, 0], Hq, Hkv, Cap, D,
                        S, pos, scale, softcap, window, &ov[0, 0, 0], s) != 0:
        raise MemoryError("decode_token: could not allocate the rotated queries or the workspace")
    return True


cdef int decode_token_ptr(const float *q, int64_t qs, const float *k, int64_t ks, const float *v, int64_t vs,
                          const float *cos, const float *sin, int64_t half, int inter, float *k_cache,
                          float *v_cache, int64_t Hq, int64_t Hkv, int64_t Cap, int64_t D, int64_t S, int64_t pos,
                          float scale, float softcap, int64_t window, float *out, okv_settings s) noexcept nogil:
    """``decode_token`` on checked pointers (the compiled step's replay calls it): q [S rows of Hq*D, ``qs``
    floats apart], k, v [S rows of Hkv*D, ``ks`` / ``vs`` apart], out [S, Hq*D] contiguous; caches [Hkv, Cap,
    D]; cos, sin [>= pos + S, half] tables or NULL (no rotary); 0 <= pos, pos + S <= Cap, Hq % Hkv == 0,
    2*half <= D, out disjoint from the others and the caches from each other and from k, v.  Returns 0, or
    -1 (nothing but cache rows written) when memory cannot be allocated."""
    cdef int64_t h, t, p
    cdef int64_t stats[2]
    cdef int32_t kl = <int32_t>(pos + S), qp1 = <int32_t>pos
    cdef int32_t *qp = &qp1
    cdef float *qr = NULL
    cdef float *ow = out
    cdef const float *src
    cdef okv_attn_args a
    cdef int rot = cos != NULL, rc
    for t in range(S):
        p = pos + t
        for h in range(Hkv):
            if rot:
                okv_rope_row_f32(k + t * ks + h * D, cos + p * half, sin + p * half, k_cache + (h * Cap + p) * D,
                                 half, D, inter, s.simd)
            else:
                memcpy(k_cache + (h * Cap + p) * D, k + t * ks + h * D, <size_t>D * sizeof(float))
            memcpy(v_cache + (h * Cap + p) * D, v + t * vs + h * D, <size_t>D * sizeof(float))
    # queries head-major [Hq, S, D] (one token: the row itself, rotated or not), and so the output
    if rot or S > 1:
        qr = <float *>malloc(<size_t>(Hq * S * D) * sizeof(float))
        if qr == NULL:
            return -1
        for t in range(S):
            for h in range(Hq):
                src = q + t * qs + h * D
                if rot:
                    okv_rope_row_f32(src, cos + (pos + t) * half, sin + (pos + t) * half, qr + (h * S + t) * D,
                                     half, D, inter, s.simd)
                else:
                    memcpy(qr + (h * S + t) * D, src, <size_t>D * sizeof(float))
    if S > 1:
        ow = <float *>malloc(<size_t>(Hq * S * D) * sizeof(float))
        qp = <int32_t *>malloc(<size_t>S * sizeof(int32_t))
        if ow == NULL or qp == NULL:
            free(qr)
            free(ow)
            free(qp)
            return -1
        for t in range(S):
            qp[t] = <int32_t>(pos + t)
    if qr != NULL:
        q = qr
    _fill_args(&a, q, ow, &kl, qp, 1, Hq, S, D, Hkv, Cap, scale, softcap, window, OKV_KV_F32)
    a.k = k_cache
    a.v = v_cache
    rc = _run_units(&a, pos + S, s, stats)
    free(qr)
    if S > 1:
        if rc == 0:
            for t in range(S):
                for h in range(Hq):
                    memcpy(out + (t * Hq + h) * D, ow + (h * S + t) * D, <size_t>D * sizeof(float))
        free(ow)
        free(qp)
    return rc
