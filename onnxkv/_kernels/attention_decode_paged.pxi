# onnxkv/_kernels/attention_decode_paged.pxi: decode_token_paged -- rotary, each row's new K/V rows written into
# their pages and paged attention of S new tokens per row of a paged float32 cache, in one call checked at C speed.
# Included by attention.pyx after attention_paged.pxi (a Cython include: it shares that module's names).


def decode_token_paged(q, k, v, cos, sin, interleaved, k_pages, v_pages, block_tables, block_size, kv_heads, pos,
                       scale, softcap, window, out):
    """S new tokens of each of B rows of a paged float32 cache, fused: rotary on q and k, each row's k and v
    written into its pages at positions ``pos[b] .. pos[b] + S - 1`` (every KV head), then causal attention
    of each row's queries (query ``t`` at position ``pos[b] + t`` sees the row's positions up to its own)
    read through the block tables into ``out`` (a batched decode step: rows of their own lengths; S > 1:
    the rows of a speculative tree, or one sequence's verification).

    q            [B, S, Hq * D] float32: each token's row contiguous, rows ``q.strides[1]`` apart (with B > 1
                 and S > 1 a row's tokens follow the previous row's: ``strides[0] == S * strides[1]``), as
                 slices of packed QKV rows
    k, v         [B, S, Hkv * D] float32 (likewise)
    cos, sin     [max_pos, R / 2] float32 tables with 2 <= R <= D and every pos[b] + S - 1 < max_pos (row p
                 rotates the first R dims of each head at position p, as ``rotary_embedding``), or both None
    k_pages,     uint64 [P] page addresses (as ``paged_attention``): float32 pages [Hkv, block_size, D], every
    v_pages      page the call reads or writes native float32
    block_tables int32 [B, M]; the entries of the blocks holding positions pos[b] .. pos[b] + S - 1 are the
                 pages row b writes, which the caller's run holds alone (copy-on-write done), and no other
                 row's table names them
    pos          int32 [B]: each row's first new position (its length before the tokens), 0 <= pos[b] and
                 pos[b] + S <= M * block_size
    out          [B, S, Hq * D] float32, C-contiguous, disjoint from q, k, v and every page
    kv_heads, block_size: ints >= 1; scale, softcap, window as ``attention``.

    Writes the pages' rows at those positions and ``out`` only; the result is bit for bit that of
    ``rotary_embedding`` on q and k, ``page_write`` of the rows and ``paged_attention`` with kv_len = pos + S
    and q_pos[b, t] = pos[b] + t.  Returns the storage figures of ``paged_attention`` when done; None, with
    nothing written, when an argument does not fit that description -- the caller then takes the unfused
    calls, whose checks name the bad argument.  (One call per layer per batched decode step.)
    """
    cdef const float[:, :, :] qv     # rows may be strided (checked below: each row contiguous)
    cdef const float[:, :, :] kv
    cdef const float[:, :, :] vv
    cdef float[:, :, ::1] ov
    cdef const float[:, ::1] cv
    cdef const float[:, ::1] sv
    cdef const uint64_t[::1] kp
    cdef const uint64_t[::1] vp
    cdef const int32_t[:, ::1] tv
    cdef const int32_t[::1] lv
    cdef int64_t B, S, Hq, Hkv, D, M, P, bs, half = 0, qs, ks, vs
    cdef int rot = cos is not None, inter = 1 if interleaved else 0
    cdef okv_settings s = okv_settings_get()
    if not (isinstance(q, np.ndarray) and isinstance(k, np.ndarray) and isinstance(v, np.ndarray)
            and isinstance(k_pages, np.ndarray) and isinstance(v_pages, np.ndarray)
            and isinstance(block_tables, np.ndarray) and isinstance(pos, np.ndarray) and isinstance(out, np.ndarray)
            and (sin is None) == (not rot) and _positive_int_ok(block_size) and _positive_int_ok(kv_heads)
            and _scalars_ok(scale, softcap, window) and out.flags.c_contiguous
            and pos.dtype == np.int32 and pos.ndim == 1 and q.ndim == 3):
        return None
    S = q.shape[1]
    if S < 1 or pos.shape[0] and (int(pos.min()) < 0 or int(pos.max()) > 2147483647 - S):
        return None
    last = (pos + np.int32(S - 1)) if S > 1 else pos   # each row's last position: no wrap (checked above)
    try:
        qv = q
        kv = k
        vv = v
        ov = out
        kp = k_pages
        vp = v_pages
        tv = block_tables
        lv = last
        if rot:
            cv = cos
            sv = sin
    except (ValueError, TypeError, BufferError):
        return None
    B, Hkv, bs, M, P = qv.shape[0], kv_heads, block_size, tv.shape[1], kp.shape[0]
    if B == 0 or M == 0 or P == 0 or vp.shape[0] != P or tv.shape[0] != B or lv.shape[0] != B:
        return None
    if kv.shape[0] != B or kv.shape[1] != S or vv.shape[0] != B or vv.shape[1] != S \
            or kv.shape[2] % Hkv or kv.shape[2] == 0 or vv.shape[2] != kv.shape[2]:
        return None
    D = kv.shape[2] // Hkv
    Hq = qv.shape[2] // D
    if Hq == 0 or Hq * D != qv.shape[2] or Hq % Hkv or ov.shape[0] != B or ov.shape[1] != S \
            or ov.shape[2] != Hq * D:
        return None
    if qv.strides[2] != 4 or kv.strides[2] != 4 or vv.strides[2] != 4:
        return None
    # one stride between consecutive token rows (b, t) -> (b, t + 1) and (b, S - 1) -> (b + 1, 0)
    if S > 1 and B > 1 and (qv.strides[0] != S * qv.strides[1] or kv.strides[0] != S * kv.strides[1]
                            or vv.strides[0] != S * vv.strides[1]):
        return None
    qs, ks, vs = ((qv.strides[1], kv.strides[1], vv.strides[1]) if S > 1
                  else (qv.strides[0], kv.strides[0], vv.strides[0]))
    if qs % 4 or ks % 4 or vs % 4 or (B * S > 1 and (qs < Hq * D * 4 or ks < Hkv * D * 4 or vs < Hkv * D * 4)):
        return None
    qs, ks, vs = qs // 4, ks // 4, vs // 4
    if rot:
        half = cv.shape[1]
        if half == 0 or 2 * half > D or sv.shape[0] != cv.shape[0] or sv.shape[1] != half:
            return None
    cdef size_t onb = <size_t>(B * S * Hq * D) * sizeof(float)
    cdef const void *o = &ov[0, 0, 0]
    if not (_disjoint(o, onb, &qv[0, 0, 0], <size_t>((B * S - 1) * qs + Hq * D) * 4)
            and _disjoint(o, onb, &kv[0, 0, 0], <size_t>((B * S - 1) * ks + Hkv * D) * 4)
            and _disjoint(o, onb, &vv[0, 0, 0], <size_t>((B * S - 1) * vs + Hkv * D) * 4)):
        return None
    # every position, written page and read table entry checked before anything is written
    if not decode_paged_ok(&kp[0], &vp[0], P, &tv[0, 0], M, bs, &lv[0], B, S, cv.shape[0] if rot else -1, window):
        return None
    cdef int64_t stats[2]
    cdef float fscale = scale, fsoftcap = softcap
    cdef int64_t iwindow = window
    cdef int rc
    with nogil:
        rc = decode_paged_ptr(&qv[0, 0, 0], qs, &kv[0, 0, 0], ks, &vv[0, 0, 0], vs, &cv[0, 0] if rot else NULL,
                              &sv[0, 0] if rot else NULL, half, inter, &kp[0], &vp[0], &tv[0, 0], M, bs, &lv[0], B, S,
                              Hq, Hkv, D, fscale, fsoftcap, iwindow, &ov[0, 0, 0], s, stats)
    if rc != 0:
        raise MemoryError("decode_token_paged: could not allocate the workspace")
    return {"dequantized_bytes": int(stats[0]), "workspace_peak_bytes": int(stats[1])}


cdef bint decode_paged_ok(const uint64_t *kp, const uint64_t *vp, int64_t P, const int32_t *tables, int64_t M,
                          int64_t bs, const int32_t *last, int64_t B, int64_t S, int64_t rows,
                          int64_t window) noexcept nogil:
    """Whether :func:`decode_paged_ptr` may run on these values of a replay: ``S >= 1``; for every row, its
    positions ``last[b] - S + 1 .. last[b]`` in ``[0, M * bs)`` and below ``rows`` (the rotary table's rows;
    ``rows`` < 0: no rotary), and every table entry the call writes or reads (row ``b``'s blocks from its
    first query's window start to ``last[b]``) a page in ``[0, P)`` with nonzero, 64-byte aligned K and V
    addresses -- what ``decode_token_paged`` checks."""
    cdef int64_t b, p, first, lo, i
    if S < 1:
        return False
    for b in range(B):
        p = last[b]
        first = p - S + 1
        if first < 0 or p >= M * bs or (rows >= 0 and p >= rows):
            return False
        lo = first - window if window >= 0 else 0
        if lo < 0:
            lo = 0
        for i in range(lo // bs, p // bs + 1):
            if not _page_at(tables[b * M + i], kp, vp, P):
                return False
    return True


cdef int decode_paged_ptr(const float *q, int64_t qs, const float *k, int64_t ks, const float *v, int64_t vs,
                          const float *cos, const float *sin, int64_t half, int inter, const uint64_t *kp,
                          const uint64_t *vp, const int32_t *tables, int64_t M, int64_t bs, const int32_t *last,
                          int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, float scale, float softcap,
                          int64_t window, float *out, okv_settings s, int64_t *stats) noexcept nogil:
    """``decode_token_paged`` on values :func:`decode_paged_ok` accepted (it calls this, and so does the
    compiled step's replay): S tokens per row at positions ``last[b] - S + 1 .. last[b]``;
    q [B * S token rows of Hq*D, ``qs`` floats apart (row b's token t is row b * S + t)], k, v [B * S rows of
    Hkv*D, ``ks`` / ``vs`` apart], out [B, S, Hq*D] contiguous and disjoint from the others and every page;
    cos, sin [> max position, half] or NULL; the pages the rows write held by the run alone.  ``stats``: the
    figures of ``paged_attention`` (dequantized bytes, workspace peak).  Returns 0, or -1 (nothing but page
    rows written) when memory runs out."""
    cdef int64_t b, t, h, p, r, page, off, maxlen = 0
    cdef float *dst
    cdef float *rq = <float *>malloc(<size_t>(B * Hq * S * D) * sizeof(float))
    cdef int32_t *kl = <int32_t *>malloc(<size_t>B * sizeof(int32_t))
    # S > 1: the queries' positions [B, S] and the output in the kernel's [B, Hq, S, D] layout
    cdef int32_t *qp = <int32_t *>malloc(<size_t>(B * S) * sizeof(int32_t)) if S > 1 else NULL
    cdef float *ho = <float *>malloc(<size_t>(B * Hq * S * D) * sizeof(float)) if S > 1 else NULL
    cdef okv_attn_args a
    cdef int rot = cos != NULL, rc
    if rq == NULL or kl == NULL or (S > 1 and (qp == NULL or ho == NULL)):
        free(rq)
        free(kl)
        free(qp)
        free(ho)
        return -1
    for b in range(B):
        for t in range(S):
            r = b * S + t
            p = last[b] - S + 1 + t
            page, off = tables[b * M + p // bs], p % bs
            for h in range(Hkv):
                dst = <float *><size_t>kp[page] + (h * bs + off) * D
                if rot:
                    okv_rope_row_f32(k + r * ks + h * D, cos + p * half, sin + p * half, dst, half, D, inter, s.simd)
                else:
                    memcpy(dst, k + r * ks + h * D, <size_t>D * sizeof(float))
                memcpy(<float *><size_t>vp[page] + (h * bs + off) * D, v + r * vs + h * D, <size_t>D * sizeof(float))
            for h in range(Hq):
                dst = rq + ((b * Hq + h) * S + t) * D
                if rot:
                    okv_rope_row_f32(q + r * qs + h * D, cos + p * half, sin + p * half, dst, half, D, inter, s.simd)
                else:
                    memcpy(dst, q + r * qs + h * D, <size_t>D * sizeof(float))
            if S > 1:
                qp[r] = <int32_t>p
        kl[b] = <int32_t>(last[b] + 1)
        if last[b] + 1 > maxlen:
            maxlen = last[b] + 1
    _fill_args(&a, rq, ho if S > 1 else out, kl, qp if S > 1 else last, B, Hq, S, D, Hkv, M * bs, scale, softcap,
               window, OKV_KV_F32)
    a.k_pages = kp
    a.v_pages = vp
    a.block_tables = tables
    a.M, a.bs = M, bs
    rc = _run_units(&a, maxlen, s, stats)
    if rc == 0 and S > 1:   # [B, Hq, S, D] -> [B, S, Hq, D]
        for b in range(B):
            for h in range(Hq):
                for t in range(S):
                    memcpy(out + ((b * S + t) * Hq + h) * D, ho + ((b * Hq + h) * S + t) * D,
                           <size_t>D * sizeof(float))
    free(rq)
    free(kl)
    free(qp)
    free(ho)
    return rc
