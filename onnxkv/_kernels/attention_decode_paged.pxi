# onnxkv/_kernels/attention_decode_paged.pxi: decode_token_paged -- rotary, each row's new K/V rows written into
# their pages and paged attention of S new tokens per row of a paged cache, in one call checked at C speed.
# Included by attention.pyx after attention_paged.pxi (a Cython include: it shares that module's names).


def decode_token_paged(q, k, v, cos, sin, interleaved, k_pages, v_pages, block_tables, block_size, kv_heads, pos,
                       scale, softcap, window, out, *, kv_dtype=None):
    """S new tokens of each of B rows of a paged cache, fused: rotary on q and k, each row's k and v written
    into its pages at positions ``pos[b] .. pos[b] + S - 1`` (every KV head), then causal attention of each
    row's queries (query ``t`` at position ``pos[b] + t`` sees the row's positions up to its own) read
    through the block tables into ``out`` (a batched decode step: rows of their own lengths; S > 1: the rows
    of a speculative tree, or one sequence's verification).

    q            [B, S, Hq * D] float32, or float16 (a float16 model's tokens: then k, v and out float16 too
                 and the pages 2-byte): each token's row contiguous, rows ``q.strides[1]`` apart (with B > 1
                 and S > 1 a row's tokens follow the previous row's: ``strides[0] == S * strides[1]``), as
                 slices of packed QKV rows
    k, v         [B, S, Hkv * D] of q's type (likewise)
    cos, sin     [max_pos, R / 2] float32 tables with 2 <= R <= D and every pos[b] + S - 1 < max_pos (row p
                 rotates the first R dims of each head at position p, as ``rotary_embedding``), or both None
    k_pages,     uint64 [P] page addresses (as ``paged_attention``): pages [Hkv, block_size, D] of
    v_pages      ``kv_dtype`` (None or "float32": float32, float32 tokens only; "float16"; "bfloat16": bit
                 patterns), every page the call reads or writes native (that type)
    block_tables int32 [B, M]; the entries of the blocks holding positions pos[b] .. pos[b] + S - 1 are the
                 pages row b writes, which the caller's run holds alone (copy-on-write done), and no other
                 row's table names them
    pos          int32 [B]: each row's first new position (its length before the tokens), 0 <= pos[b] and
                 pos[b] + S <= M * block_size
    out          [B, S, Hq * D] of q's type, C-contiguous, disjoint from every other argument and every page
                 (q, k and v disjoint from every page the call touches too)
    kv_heads, block_size: ints >= 1; scale, softcap, window as ``attention``.

    Writes the pages' rows at those positions and ``out`` only; the result is bit for bit that of
    ``rotary_embedding`` on q and k (float16 widened first), ``page_write`` of the rows (rounded to the
    pages' type as the plane's writes round them) and ``paged_attention`` with kv_len = pos + S and q_pos[b,
    t] = pos[b] + t, its float32 result rounded to float16 for float16 tokens (NaN payloads aside).  Returns
    the storage figures of ``paged_attention`` when done; None, with nothing written, when an argument does
    not fit that description -- the caller then takes the unfused calls, whose checks name the bad
    argument.  (One call per layer per batched decode step.)
    """
    cdef const void *tok[4]     # q, k, v (rows may be strided: checked below, each row contiguous), out
    cdef Py_ssize_t sh[4][3]    # shapes of q, k, v, out
    cdef Py_ssize_t st[4][3]    # their strides in bytes
    cdef const float[:, ::1] cv
    cdef const float[:, ::1] sv
    cdef const uint64_t[::1] kp
    cdef const uint64_t[::1] vp
    cdef const int32_t[:, ::1] tv
    cdef const int32_t[::1] lv
    cdef int64_t B, S, Hq, Hkv, D, M, P, bs, half = 0, qs, ks, vs, isz
    cdef int rot = cos is not None, inter = 1 if interleaved else 0, io16, kv_type, j
    cdef okv_settings s = okv_settings_get()
    if not (isinstance(q, np.ndarray) and isinstance(k, np.ndarray) and isinstance(v, np.ndarray)
            and isinstance(k_pages, np.ndarray) and isinstance(v_pages, np.ndarray)
            and isinstance(block_tables, np.ndarray) and isinstance(pos, np.ndarray) and isinstance(out, np.ndarray)
            and (sin is None) == (not rot) and _positive_int_ok(block_size) and _positive_int_ok(kv_heads)
            and _scalars_ok(scale, softcap, window) and out.flags.c_contiguous
            and pos.dtype == np.int32 and pos.ndim == 1 and q.ndim == 3):
        return None
    io16 = q.dtype == _F16
    kv_type = {None: OKV_KV_F32, "float32": OKV_KV_F32, "float16": OKV_KV_F16,
               "bfloat16": OKV_KV_BF16}.get(kv_dtype, -1) if isinstance(kv_dtype, (str, type(None))) else -1
    want = _F16 if io16 else _F32
    if kv_type < 0 or (io16 and kv_type == OKV_KV_F32) or q.dtype != want or k.dtype != want \
            or v.dtype != want or out.dtype != want:
        return None
    isz = 2 if io16 else 4
    S = q.shape[1]
    if S < 1 or pos.shape[0] and (int(pos.min()) < 0 or int(pos.max()) > 2147483647 - S):
        return None
    last = (pos + np.int32(S - 1)) if S > 1 else pos   # each row's last position: no wrap (checked above)
    arrays = (q, k, v, out)
    try:
        for j in range(4):
            _rows_view(arrays[j], io16, j == 3, &tok[j], sh[j], st[j])
        kp = k_pages
        vp = v_pages
        tv = block_tables
        lv = last
        if rot:
            cv = cos
            sv = sin
    except (ValueError, TypeError, BufferError):
        return None
    B, Hkv, bs, M, P = sh[0][0], kv_heads, block_size, tv.shape[1], kp.shape[0]
    if B == 0 or M == 0 or P == 0 or vp.shape[0] != P or tv.shape[0] != B or lv.shape[0] != B:
        return None
    if sh[1][0] != B or sh[1][1] != S or sh[2][0] != B or sh[2][1] != S \
            or sh[1][2] % Hkv or sh[1][2] == 0 or sh[2][2] != sh[1][2]:
        return None
    D = sh[1][2] // Hkv
    Hq = sh[0][2] // D
    if Hq == 0 or Hq * D != sh[0][2] or Hq % Hkv or sh[3][0] != B or sh[3][1] != S or sh[3][2] != Hq * D:
        return None
    if st[0][2] != isz or st[1][2] != isz or st[2][2] != isz:
        return None
    # one stride between consecutive token rows (b, t) -> (b, t + 1) and (b, S - 1) -> (b + 1, 0)
    if S > 1 and B > 1 and (st[0][0] != S * st[0][1] or st[1][0] != S * st[1][1] or st[2][0] != S * st[2][1]):
        return None
    qs, ks, vs = (st[0][1], st[1][1], st[2][1]) if S > 1 else (st[0][0], st[1][0], st[2][0])
    if qs % isz or ks % isz or vs % isz \
            or (B * S > 1 and (qs < Hq * D * isz or ks < Hkv * D * isz or vs < Hkv * D * isz)):
        return None
    qs, ks, vs = qs // isz, ks // isz, vs // isz
    if rot:
        half = cv.shape[1]
        if half == 0 or 2 * half > D or sv.shape[0] != cv.shape[0] or sv.shape[1] != half:
            return None
    cdef size_t onb = <size_t>(B * S * Hq * D) * isz
    cdef const void *op = tok[3]
    if not (_disjoint(op, onb, tok[0], <size_t>((B * S - 1) * qs + Hq * D) * isz)
            and _disjoint(op, onb, tok[1], <size_t>((B * S - 1) * ks + Hkv * D) * isz)
            and _disjoint(op, onb, tok[2], <size_t>((B * S - 1) * vs + Hkv * D) * isz)
            # and from every table the call reads while it writes out
            and _disjoint(op, onb, &kp[0], <size_t>P * 8) and _disjoint(op, onb, &vp[0], <size_t>P * 8)
            and _disjoint(op, onb, &tv[0, 0], <size_t>(B * M) * 4) and _disjoint(op, onb, &lv[0], <size_t>B * 4)
            and (not rot or (_disjoint(op, onb, &cv[0, 0], <size_t>(cv.shape[0] * half) * 4)
                             and _disjoint(op, onb, &sv[0, 0], <size_t>(sv.shape[0] * half) * 4)))):
        return None
    # every position, written page and read table entry checked before anything is written, and every page
    # the call touches disjoint from the tokens and out
    cdef const void *spans[4]
    cdef size_t span_bytes[4]
    spans[0], spans[1], spans[2], spans[3] = tok[0], tok[1], tok[2], op
    span_bytes[0] = <size_t>((B * S - 1) * qs + Hq * D) * isz
    span_bytes[1] = <size_t>((B * S - 1) * ks + Hkv * D) * isz
    span_bytes[2] = <size_t>((B * S - 1) * vs + Hkv * D) * isz
    span_bytes[3] = onb
    if not decode_paged_ok(&kp[0], &vp[0], P, &tv[0, 0], M, bs, &lv[0], B, S, cv.shape[0] if rot else -1, window,
                           spans, span_bytes, 4, <size_t>(Hkv * bs * D) * (4 if kv_type == OKV_KV_F32 else 2)):
        return None
    cdef int64_t stats[2]
    cdef float fscale = scale, fsoftcap = softcap
    cdef int64_t iwindow = window
    cdef int rc
    with nogil:
        rc = decode_paged_ptr(tok[0], qs, tok[1], ks, tok[2], vs, &cv[0, 0] if rot else NULL,
                              &sv[0, 0] if rot else NULL, half, inter, &kp[0], &vp[0], &tv[0, 0], M, bs, &lv[0], B, S,
                              Hq, Hkv, D, fscale, fsoftcap, iwindow, <void *>op, s, stats, io16, kv_type, NULL)
    if rc != 0:
        raise MemoryError("decode_token_paged: could not allocate the workspace")
    return {"dequantized_bytes": int(stats[0]), "workspace_peak_bytes": int(stats[1])}


cdef bint decode_paged_ok(const uint64_t *kp, const uint64_t *vp, int64_t P, const int32_t *tables, int64_t M,
                          int64_t bs, const int32_t *last, int64_t B, int64_t S, int64_t rows,
                          int64_t window, const void *const *spans, const size_t *span_bytes, int nspans,
                          size_t page_bytes) noexcept nogil:
    """Whether :func:`decode_paged_ptr` may run on these values of a replay: ``S >= 1``; for every row, its
    positions ``last[b] - S + 1 .. last[b]`` in ``[0, M * bs)`` and below ``rows`` (the rotary table's rows;
    ``rows`` < 0: no rotary), and every table entry the call writes or reads (row ``b``'s blocks from its
    first query's window start to ``last[b]``) a page in ``[0, P)`` with nonzero, 64-byte aligned K and V
    addresses, whose ``page_bytes`` at each address are disjoint from the ``nspans`` memory ranges ``spans``
    / ``span_bytes`` (the tokens and out of a call from Python; a replay's are step memory, which no page
    is) -- what ``decode_token_paged`` checks."""
    cdef int64_t b, p, first, lo, i, page
    cdef int j
    if S < 1:
        return False
    for b in range(B):
        p = last[b]
        first = p - S + 1
        if first < 0 or p // bs >= M or (rows >= 0 and p >= rows):   # (M * bs may pass int64's range)
            return False
        lo = first - window if window >= 0 else 0
        if lo < 0:
            lo = 0
        for i in range(lo // bs, p // bs + 1):
            page = tables[b * M + i]
            if not _page_at(page, kp, vp, P):
                return False
            for j in range(nspans):
                if not (_disjoint(<const void *>kp[page], page_bytes, spans[j], span_bytes[j])
                        and _disjoint(<const void *>vp[page], page_bytes, spans[j], span_bytes[j])):
                    return False
    return True


cdef int decode_paged_ptr(const void *q, int64_t qs, const void *k, int64_t ks, const void *v, int64_t vs,
                          const float *cos, const float *sin, int64_t half, int inter, const uint64_t *kp,
                          const uint64_t *vp, const int32_t *tables, int64_t M, int64_t bs, const int32_t *last,
                          int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, float scale, float softcap,
                          int64_t window, void *out, okv_settings s, int64_t *stats, int io16,
                          int kv_type, const int32_t *kv_start) noexcept nogil:
    """``decode_token_paged`` on values :func:`decode_paged_ok` accepted (it calls this, and so does the
    compiled step's replay): S tokens per row at positions ``last[b] - S + 1 .. last[b]``;
    q [B * S token rows of Hq*D, ``qs`` elements apart (row b's token t is row b * S + t)], k, v [B * S rows
    of Hkv*D, ``ks`` / ``vs`` apart; both NULL: the rows are in their pages already, nothing is written],
    out [B, S, Hq*D] contiguous and disjoint from the others and every
    page, all float32 or, ``io16``, float16; pages of ``kv_type`` (OKV_KV_F32 only with float32 tokens);
    cos, sin [> max position, half] or NULL; the pages the rows write held by the run alone; ``kv_start``
    [B] or NULL (0): the first key each row's queries see.  ``stats``: the
    figures of ``paged_attention`` (dequantized bytes, workspace peak).  Returns 0, or -1 (nothing but page
    rows written) when memory runs out."""
    cdef int64_t b, t, h, p, r, page, off, maxlen = 0, esz = 4 if kv_type == OKV_KV_F32 else 2
    cdef char *dst
    cdef const char *src
    cdef float *rq = <float *>malloc(<size_t>(B * Hq * S * D + 2 * D) * sizeof(float))
    cdef int32_t *kl = <int32_t *>malloc(<size_t>B * sizeof(int32_t))
    # S > 1: the queries' positions [B, S]; S > 1 or float16 tokens: the output in the kernel's [B, Hq, S, D]
    cdef int32_t *qp = <int32_t *>malloc(<size_t>(B * S) * sizeof(int32_t)) if S > 1 else NULL
    cdef bint staged = S > 1 or io16
    cdef float *ho = <float *>malloc(<size_t>(B * Hq * S * D) * sizeof(float)) if staged else NULL
    cdef float *wide
    cdef float *turned
    cdef okv_attn_args a
    cdef int rot = cos != NULL, rc, i
    if rq == NULL or kl == NULL or (S > 1 and qp == NULL) or (staged and ho == NULL):
        free(rq)
        free(kl)
        free(qp)
        free(ho)
        return -1
    wide, turned = rq + B * Hq * S * D, rq + B * Hq * S * D + D
    for b in range(B):
        for t in range(S):
            r = b * S + t
            p = last[b] - S + 1 + t
            page, off = tables[b * M + p // bs], p % bs
            for h in range(Hkv if k != NULL else 0):
                for i in range(2):   # the key row, then the value row
                    dst = <char *><size_t>(kp[page] if i == 0 else vp[page]) + (h * bs + off) * D * esz
                    src = <const char *>(k if i == 0 else v) + ((r * ks if i == 0 else r * vs) + h * D) * (
                        2 if io16 else 4)
                    _new_row(src, dst, i == 0 and rot, cos + p * half if rot else NULL,
                               sin + p * half if rot else NULL, half, D, inter, io16, kv_type, wide, turned, s.simd)
            for h in range(Hq):
                _query_row(<const char *>q + (r * qs + h * D) * (2 if io16 else 4), rq + ((b * Hq + h) * S + t) * D,
                           rot, cos + p * half if rot else NULL, sin + p * half if rot else NULL, half, D, inter,
                           io16, wide, s.simd)
            if S > 1:
                qp[r] = <int32_t>p
        kl[b] = <int32_t>(last[b] + 1)
        if last[b] + 1 > maxlen:
            maxlen = last[b] + 1
    _fill_args(&a, rq, ho if staged else <float *>out, kl, qp if S > 1 else last, B, Hq, S, D, Hkv, M * bs, scale,
               softcap, window, kv_type)
    a.k_pages = kp
    a.v_pages = vp
    a.block_tables = tables
    a.kv_start = kv_start
    a.M, a.bs = M, bs
    rc = _run_units(&a, maxlen, s, stats)
    if rc == 0 and staged:   # [B, Hq, S, D] -> [B, S, Hq, D], rounded to float16 for float16 tokens
        for b in range(B):
            for h in range(Hq):
                for t in range(S):
                    if io16:
                        okv_f2h_row(ho + ((b * Hq + h) * S + t) * D, <uint16_t *>out + ((b * S + t) * Hq + h) * D,
                                    D, s.simd)
                    else:
                        memcpy(<float *>out + ((b * S + t) * Hq + h) * D, ho + ((b * Hq + h) * S + t) * D,
                               <size_t>D * sizeof(float))
    free(rq)
    free(kl)
    free(qp)
    free(ho)
    return rc


cdef int page_rows_ptr(const void *src, const uint64_t *pages, const int32_t *tables, int64_t M, int64_t bs,
                       const int32_t *last, int64_t B, int64_t H, int64_t S, int64_t D, int io16, int kv_type,
                       okv_settings s) noexcept nogil:
    """The rows ``src`` [B, H, S, D] (C order; float32, or float16 when ``io16``) written into the pages of one
    plane (``pages``: its page addresses, pages [H, bs, D] of ``kv_type``, OKV_KV_F32 only for float32 rows)
    at positions ``last[b] - S + 1 .. last[b]`` of each row through ``tables`` [B, M], rounded to the pages'
    type as ``decode_paged_ptr`` writes its rows, on values :func:`decode_paged_ok` accepted (the pages held
    by the run alone).  Returns 0, or -1 (nothing written) when memory runs out."""
    cdef int64_t b, t, h, p, page, esz = 4 if kv_type == OKV_KV_F32 else 2, isz = 2 if io16 else 4
    cdef float *wide = <float *>malloc(<size_t>(2 * D) * sizeof(float))
    if wide == NULL:
        return -1
    for b in range(B):
        for t in range(S):
            p = last[b] - S + 1 + t
            page = tables[b * M + p // bs]
            for h in range(H):
                _new_row(<const char *>src + ((b * H + h) * S + t) * D * isz,
                         <char *><size_t>pages[page] + (h * bs + p % bs) * D * esz, 0, NULL, NULL, 0, D, 0, io16,
                         kv_type, wide, wide + D, s.simd)
    free(wide)
    return 0
