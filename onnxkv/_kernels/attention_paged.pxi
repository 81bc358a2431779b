# onnxkv/_kernels/attention_paged.pxi: paged_attention -- the page format tables, the checks of block
# tables, page addresses and per-page formats, the fast path and the checked API.
# Included by attention.pyx (a Cython include: it shares that module's names).

_FORMAT_CODES = {"float32": 1, "float16": 10, "bfloat16": 16}


cdef uint8_t _format_bits[256]     # bits per element of each page format code (0: not a format)


cdef void _fill_format_bits():
    """Fill ``_format_bits`` from ``_validate.FORMAT_BITS`` (the codes the Python checks accept)."""
    for code, bits in V.FORMAT_BITS.items():
        _format_bits[code] = bits


_fill_format_bits()


cdef bint _formats_ok(const uint8_t[::1] formats, int64_t D) noexcept nogil:
    """True when every code of a page format table is a format whose D codes fill whole bytes."""
    cdef int64_t i, bits
    for i in range(formats.shape[0]):
        bits = _format_bits[formats[i]]
        if bits == 0 or (D * bits) % 8:
            return False
    return True


cdef inline bint _page_at(int64_t page, const uint64_t *kp, const uint64_t *vp, int64_t P) noexcept nogil:
    """True when ``page`` is an id in [0, P) whose K and V addresses are nonzero and 64-byte aligned."""
    if page < 0 or page >= P:
        return False
    return kp[page] != 0 and vp[page] != 0 and (kp[page] & 63) == 0 and (vp[page] & 63) == 0


cdef inline bint _page_ok(int64_t page, const uint64_t[::1] kp, const uint64_t[::1] vp) noexcept nogil:
    """``_page_at`` on the address tables of a call (K and V of the same length)."""
    return _page_at(page, &kp[0], &vp[0], kp.shape[0])


cdef bint _tables_ok(const int32_t[:, ::1] tables, const uint64_t[::1] kp, const uint64_t[::1] vp,
                     const int32_t[::1] lens, const int32_t[:, ::1] pos, int64_t window, int64_t bs,
                     const int32_t *starts) noexcept nogil:
    """True when every table entry the call reads passes ``_page_ok``: per row, the
    blocks holding a key some query token sees (the rule of
    ``_validate.paged_blocks_read``; lens must be <= M * bs; starts: kv_start
    [B] or NULL).  Each row keeps the span of blocks already checked, so the
    usual ordered positions check every block once."""
    cdef int64_t b, t, p, lo, hi, f, l, i, c0, c1
    for b in range(tables.shape[0]):
        c0, c1 = 0, -1      # blocks [c0, c1] of this row are checked
        for t in range(pos.shape[1]):
            p = pos[b, t]
            lo = p - window if window >= 0 else 0
            if lo < 0:
                lo = 0
            if starts != NULL and lo < starts[b]:
                lo = starts[b]
            hi = p + 1 if p + 1 < lens[b] else lens[b]
            if lo >= hi:
                continue
            f, l = lo // bs, (hi - 1) // bs
            if c1 < c0 or f > c1 + 1 or l < c0 - 1:     # no span yet, or apart from it: a new span
                c0, c1 = f, f - 1
            for i in range(f, min(l + 1, c0)):
                if not _page_ok(tables[b, i], kp, vp):
                    return False
            for i in range(max(f, c1 + 1), l + 1):
                if not _page_ok(tables[b, i], kp, vp):
                    return False
            c0, c1 = min(c0, f), max(c1, l)
    return True


cdef bint _positive_int_ok(x) except -1:
    """True when ``x`` is a Python int in [1, 2**31 - 1] (``_validate.positive_int`` accepts it unchanged)."""
    return type(x) is int and 1 <= x <= V.I32_MAX


cdef bint _quant_args_ok(k_group, v_group, k_header, int64_t D) except -1:
    """True when the groups are Python ints 1 or D and k_header is "float32", or
    "compact" with k_group <= the compact header's groups, or "channel-zp" with
    k_group == D (the conditions of ``_validate.scale_group``, ``header_kind``
    and paged_attention's k_group check)."""
    if not (type(k_group) is int and type(v_group) is int and (k_group == 1 or k_group == D)
            and (v_group == 1 or v_group == D) and isinstance(k_header, str)):
        return False
    return (k_header == "float32" or (k_header == "compact" and k_group <= V.COMPACT_MAX_GROUPS)
            or (k_header == "channel-zp" and k_group == D))


cdef void _set_key_header(okv_attn_args *a, int64_t kG, int kind) noexcept:
    """The K plane's groups and header kind (a _validate.header_kind code: 1 HDR_COMPACT, 2
    HDR_CZP) in ``a``: a channel-zero-point header has one scale per head (kG 1 for the kernel)
    and D zero points."""
    a.kG = 1 if kind == 2 else kG
    a.k_compact = kind == 1
    a.k_czp = kind == 2


cdef object _paged_fast(q, k_pages, v_pages, block_tables, block_size, kv_heads, kv_len, q_pos, scale, softcap,
                        window, out, kv_start, kv_dtype, k_formats, v_formats, k_group, v_group, k_header):
    """Run ``paged_attention`` and return its figures when every argument is valid
    and nothing is empty (at least one page and table column), all checked at C
    speed: typed buffers (dtype, native byte order, dimensions, C-contiguity, a
    writeable ``out``), shapes, int32 kv_len / q_pos / kv_start, kv_len and
    kv_start values, scalars,
    format tables, groups and header, the address range of ``out`` against q,
    and every table entry the call reads -- the conditions of the Python
    checks.  Return None, with nothing written, to send the call through those
    checks (which name the bad argument)."""
    cdef const float[:, :, :, ::1] qv
    cdef float[:, :, :, ::1] ov
    cdef const uint64_t[::1] kp
    cdef const uint64_t[::1] vp
    cdef const int32_t[:, ::1] tv
    cdef const int32_t[::1] lv
    cdef const int32_t[:, ::1] pv
    cdef const int32_t[::1] sv
    cdef const uint8_t[::1] kfv
    cdef const uint8_t[::1] vfv
    cdef const int32_t *starts = NULL
    cdef int64_t B, Hq, Sq, D, M, P, bs, Hkv, maxlen
    cdef size_t onb
    cdef bint per_page = k_formats is not None or v_formats is not None
    cdef okv_attn_args a
    if not (isinstance(q, np.ndarray) and isinstance(k_pages, np.ndarray) and isinstance(v_pages, np.ndarray)
            and isinstance(block_tables, np.ndarray) and isinstance(kv_len, np.ndarray)
            and isinstance(q_pos, np.ndarray) and isinstance(out, np.ndarray)
            and (kv_start is None or isinstance(kv_start, np.ndarray))
            and _positive_int_ok(block_size) and _positive_int_ok(kv_heads) and _scalars_ok(scale, softcap, window)
            and (kv_dtype is None or (isinstance(kv_dtype, str) and kv_dtype in _KV_DTYPES))
            and (k_formats is None or isinstance(k_formats, np.ndarray))
            and (v_formats is None or isinstance(v_formats, np.ndarray))):
        return None
    kvname = "float32" if kv_dtype is None else kv_dtype
    try:
        qv = q
        ov = out
        kp = k_pages
        vp = v_pages
        tv = block_tables
        lv = kv_len
        pv = q_pos
        if kv_start is not None:
            sv = kv_start
        if per_page:
            kfv = k_formats if k_formats is not None else np.full(k_pages.shape[0], _FORMAT_CODES[kvname], np.uint8)
            vfv = v_formats if v_formats is not None else np.full(k_pages.shape[0], _FORMAT_CODES[kvname], np.uint8)
    except (ValueError, TypeError, BufferError):
        return None
    B, Hq, Sq, D = qv.shape[0], qv.shape[1], qv.shape[2], qv.shape[3]
    M, P, bs, Hkv = tv.shape[1], kp.shape[0], block_size, kv_heads
    if B == 0 or Hq == 0 or Sq == 0 or D == 0 or M == 0 or P == 0 or Hq % Hkv != 0:
        return None
    if vp.shape[0] != P or tv.shape[0] != B or lv.shape[0] != B or pv.shape[0] != B or pv.shape[1] != Sq \
            or ov.shape[0] != B or ov.shape[1] != Hq or ov.shape[2] != Sq or ov.shape[3] != D \
            or (kv_start is not None and sv.shape[0] != B):
        return None
    if per_page and not (kfv.shape[0] == P and vfv.shape[0] == P and _formats_ok(kfv, D) and _formats_ok(vfv, D)
                         and _quant_args_ok(k_group, v_group, k_header, D)):
        return None
    onb = <size_t>(B * Hq * Sq * D) * sizeof(float)
    cdef const void *o = &ov[0, 0, 0, 0]
    if not (_disjoint(o, onb, &qv[0, 0, 0, 0], onb)  # and every argument read while out is written
            and _disjoint(o, onb, &kp[0], <size_t>P * 8) and _disjoint(o, onb, &vp[0], <size_t>P * 8)
            and _disjoint(o, onb, &tv[0, 0], <size_t>(B * M) * 4) and _disjoint(o, onb, &lv[0], <size_t>B * 4)
            and _disjoint(o, onb, &pv[0, 0], <size_t>(B * Sq) * 4)
            and (kv_start is None or _disjoint(o, onb, &sv[0], <size_t>B * 4))
            and (not per_page or (_disjoint(o, onb, &kfv[0], <size_t>P) and _disjoint(o, onb, &vfv[0], <size_t>P)))):
        return None
    maxlen = _lengths_max(lv, M * bs)
    if kv_start is not None:
        if _lengths_max(sv, M * bs) < 0:
            return None
        starts = &sv[0]
    if maxlen < 0 or not _tables_ok(tv, kp, vp, lv, pv, window, bs, starts):
        return None
    _init_args(&a, q, out, kv_len, q_pos, Hkv, M * bs, scale, softcap, window, _KV_TYPES[kvname])
    a.kv_start = starts
    if per_page:
        a.k_fmt = &kfv[0]
        a.v_fmt = &vfv[0]
        a.vG = v_group
        _set_key_header(&a, k_group, V.HEADERS.index(k_header))
    a.k_pages = &kp[0]
    a.v_pages = &vp[0]
    a.block_tables = &tv[0, 0]
    a.M, a.bs = M, bs
    return _run(&a, maxlen, "paged_attention", okv_settings_get())


def paged_attention(q, k_pages, v_pages, block_tables, block_size, kv_heads, kv_len, q_pos, scale, softcap,
                    window, out, *, kv_start=None, kv_dtype=None, k_formats=None, v_formats=None, k_group=1,
                    v_group=1, k_header="float32"):
    """Causal streaming attention of q over a paged KV cache; writes ``out``.

    Same math, masking, NaN handling and result as :func:`attention` on the
    same keys laid out contiguously, but K/V are read page by page through the
    block tables: no gather of the logical cache, no temporary of its length.
    On the AMX tiles a query row holding a NaN or an infinity scores NaN.

    q, out       [B, Hq, Sq, D] float32, C-contiguous; out is written fully and
                 must not overlap q, any other array argument or any page (pages
                 are not checked for that)
    k_pages,     uint64 [P] each: addresses of the K (V) pages, e.g.
    v_pages      ``arr.__array_interface__['data'][0]``; 0 = no page.  Page p
                 holds [kv_heads, block_size, D] elements of the cache type,
                 C-contiguous (one head's block_size tokens contiguous),
                 64-byte aligned.  The caller keeps every page alive and
                 unmodified for the duration of the call.
    block_tables int32 [B, M]: logical block i of row b (keys [i*bs, (i+1)*bs))
                 -> page id in [0, P), or -1.  Only the entries of blocks that
                 hold a key visible to some query of the call are read; all
                 others (past kv_len, wholly outside every query's window) may
                 be -1 and their pages are never touched.
    block_size   int in [1, 2**31 - 1] (bs): keys per page
    kv_heads     int in [1, 2**31 - 1] dividing Hq (MHA, GQA, MQA)
    kv_len       [B] int32 or int64 in [0, min(M*bs, 2**31 - 1)] (checked in its own width)
    q_pos        [B, Sq] int32 or int64 (int32 range): absolute position p of
                 each query token; it sees keys j with kv_start[b] <= j <= p,
                 j < kv_len[b] and, if window >= 0, j >= p - window
    scale, softcap, window: as in :func:`attention`
    kv_start     None (all zeros) or [B] int32 or int64 in [0, M*bs]: the first
                 key each row's queries see (left padding, or the start of an
                 attention mask's range); the blocks wholly before it are
                 never read.  Keyword only.
    kv_dtype     None or "float32" (float32 pages), "float16", "bfloat16"
                 (uint16 bit patterns); keyword only.
    k_formats,   None (every page of that plane is kv_dtype) or uint8 [P]: the
    v_formats    format of each page id, an ONNX element type code -- 1
                 float32, 10 float16, 16 bfloat16, 2 uint8, 3 int8, 21 uint4,
                 22 int4, 25 uint2, 26 int2 -- with the quantized page layout
                 (docs: a header of float32 scale[kv_heads*G] and
                 zero_point[kv_heads*G] padded to 64 bytes, then per head and
                 token D codes packed low bits first; value = (code - zp) *
                 scale).  Formats may differ from page to page and between K
                 and V; each tile is dequantized in the load step of its
                 page's format (no float copy of any page).  Every present
                 format needs D*bits % 8 == 0.  Keyword only.
    k_group,     G of the quantized pages of that plane: 1 (one scale / zero
    v_group      point per head) or D (per head and channel).  Keyword only.
    k_header     header kind of the quantized K pages: "float32" (the layout
                 above) or "compact" (k_group <= 512: float32 S[kv_heads],
                 uint8 e[kv_heads*G], uint8 zc[kv_heads*G] padded to 64 bytes,
                 scale = S * 2^(-e/16) as quant.h decodes it, zero point zc;
                 onnxkv.cache.formats) or "channel-zp" (k_group == D:
                 float32 s[kv_heads], float32 w[kv_heads], int8
                 o[kv_heads*D] padded to 64 bytes, scale s[h], zero point
                 z0 + w[h] * o with z0 = 0 for signed formats and 2^(bits-1)
                 for unsigned ones).  V pages carry float32 headers.
                 Keyword only.
    Every check (shapes, dtypes, format codes, groups, and for every row the
    table entries the call reads: page ids in range, nonzero 64-byte aligned
    addresses) raises ValueError (TypeError for a non-integer block_size /
    kv_heads / group) naming the argument before anything is written.

    Returns {"dequantized_bytes": bytes of quantized codes and header entries
    the work units loaded (each once per unit; 0 without quantized pages),
    "workspace_peak_bytes": bytes of the per-thread workspaces (and partial
    states of a cache split) the call allocated} -- for the event log.
    (Called once per layer per decode step, so valid arguments are checked in
    C; only a failing check takes the Python checks.)
    """
    figures = _paged_fast(q, k_pages, v_pages, block_tables, block_size, kv_heads, kv_len, q_pos, scale, softcap,
                          window, out, kv_start, kv_dtype, k_formats, v_formats, k_group, v_group, k_header)
    if figures is not None:
        return figures
    V.array("q", q, (V.F32,), ndim=4)
    B, Hq, Sq, D = q.shape
    kvname = "float32" if kv_dtype is None else _kv_name(kv_dtype)
    V.array("k_pages", k_pages, (V.U64,), ndim=1)
    V.array("v_pages", v_pages, (V.U64,), shape=k_pages.shape)
    V.array("block_tables", block_tables, (V.I32,), ndim=2)
    if block_tables.shape[0] != B:
        raise ValueError(f"block_tables: expected shape [{B}, M], got {block_tables.shape}")
    M = block_tables.shape[1]
    bs = V.positive_int("block_size", block_size)
    Hkv = V.positive_int("kv_heads", kv_heads)
    if Hq % Hkv != 0:
        raise ValueError(f"kv_heads: {Hkv} must divide the number of query heads {Hq}")
    kv_len32 = V.as_int32("kv_len", kv_len, 0, min(M * bs, V.I32_MAX), (B,))
    q_pos32 = V.as_int32("q_pos", q_pos, -V.I32_MAX - 1, V.I32_MAX, (B, Sq))
    kv_start32 = None if kv_start is None else V.as_int32("kv_start", kv_start, 0, min(M * bs, V.I32_MAX), (B,))
    V.array("out", out, (V.F32,), shape=q.shape, writeable=True)
    for other, name in ((q, "q"), (k_pages, "k_pages"), (v_pages, "v_pages"), (block_tables, "block_tables"),
                        (kv_len, "kv_len"), (q_pos, "q_pos"), (kv_start, "kv_start"), (k_formats, "k_formats"),
                        (v_formats, "v_formats")):  # what the call reads while it writes out
        V.no_overlap("out", out, other if isinstance(other, np.ndarray) else None, name)
    scale, softcap, window = _scalars(scale, softcap, window)
    read = V.paged_blocks_read(kv_len32, q_pos32, window, bs, M, kv_start32)
    V.page_tables(block_tables, read, bs, {"k_pages": k_pages, "v_pages": v_pages})
    per_page = k_formats is not None or v_formats is not None
    if per_page:
        P = k_pages.shape[0]
        fmts = {}
        for name, f in (("k_formats", k_formats), ("v_formats", v_formats)):
            fmts[name] = (np.full(P, _FORMAT_CODES[kvname], np.uint8) if f is None
                          else V.page_formats(name, f, P, D))
        kG = V.scale_group("k_group", k_group, D)
        vG = V.scale_group("v_group", v_group, D)
        k_kind = V.header_kind("k_header", k_header, kG)
        if k_kind == V.HDR_CZP and kG != D:
            raise ValueError(f"k_group: a channel-zp K header has one zero point per channel: k_group must be the "
                             f"head size {D}, got {kG}")
    if out.size == 0:
        return {"dequantized_bytes": 0, "workspace_peak_bytes": 0}

    cdef const uint64_t[::1] kp
    cdef const uint64_t[::1] vp
    cdef const int32_t[:, ::1] tv
    cdef const int32_t[::1] sv
    cdef const uint8_t[::1] kfv
    cdef const uint8_t[::1] vfv
    cdef okv_attn_args a
    _init_args(&a, q, out, kv_len32, q_pos32, Hkv, M * bs, scale, softcap, window, _KV_TYPES[kvname])
    if kv_start32 is not None:
        sv = kv_start32
        a.kv_start = &sv[0]
    if per_page and P:
        kfv = fmts["k_formats"]
        vfv = fmts["v_formats"]
        a.k_fmt = &kfv[0]
        a.v_fmt = &vfv[0]
        a.vG = vG
        _set_key_header(&a, kG, k_kind)
    if k_pages.size:
        kp = k_pages
        vp = v_pages
        a.k_pages = &kp[0]
        a.v_pages = &vp[0]
    # a non-NULL table marks the call as paged even when it has no columns
    tv = block_tables if M else np.full((B, 1), -1, np.int32)
    a.block_tables = &tv[0, 0]
    a.M, a.bs = M, bs
    return _run(&a, int(kv_len32.max()), "paged_attention", okv_settings_get())
