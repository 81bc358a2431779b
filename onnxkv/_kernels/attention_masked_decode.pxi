# onnxkv/_kernels/attention_masked_decode.pxi: an export's masked attention over a contiguous cache pair
# on checked pointers, for the compiled step (step.pyx's KIND_MASKED_DECODE): the additive mask described as the
# kernel's visible-key ranges (masked_ranges), then the streaming kernel (masked_decode_ptr).  Included by
# attention.pyx (a Cython include: it shares that module's names).

DEF MASK_HIDES = -1e30   # an additive mask entry at or below this hides its key (plan/ops/masked_attention.MASKED)


cdef bint masked_ranges(const void *mask, int kind, int causal, int64_t mb, int64_t ms, int64_t T, int64_t B,
                        int64_t S, int32_t *kv_start, int32_t *q_pos, const int64_t *ends,
                        const int64_t *gaps) noexcept nogil:
    """Describe a mask [mb, 1, ms, T] (C order; mb 1 or B, ms 1 or S, broadcast over batch rows and queries) as
    the kernel's ranges: query (b, s) sees exactly the keys kv_start[b] <= key <= q_pos[b * S + s].  ``kind`` 0:
    an additive float32 mask, which shows a key at 0 and hides it at or below -1e30 (NaN is neither); 1: a bool
    mask (one byte per entry), which shows it where nonzero; 2: an additive float16 mask (uint16 bits), which
    shows it at 0 and hides it at -inf only (its lowest finite value, -65504, hides a key only while the scores
    are small: the operator's Python path checks a bound that a replay does not, so such a mask is refused).
    ``causal``: query s also sees no key past its position E - S + s, with E = T, or with ``ends`` (int64 [B],
    each in [0, T]: the valid keys of each row, an ONNX Attention's ``nonpad_kv_seqlen``) E = ends[b], and
    no query sees a key at or past ``ends[b]``.  ``gaps`` (int64 [B], or NULL; with ``ends`` NULL): row ``b``
    wrote only its first ``gaps[b]`` keys before the S new ones, which follow them in its cache (a batch of
    rows of different lengths, as ``attention_onnx.ragged_mask`` compacts it): its keys ``gaps[b] <= key < T -
    S`` must be hidden from every query of the row, and the ranges count the keys after them from
    ``gaps[b]`` (E = gaps[b] + S).  False (the outputs then undefined)
    unless every float entry is one of the two, every query's visible keys are one contiguous range, the ranges
    of one batch row's queries start at the same key (``visible_ranges``), and every query sees a key -- the
    conditions under which the operators' Python paths (``mask_ranges``, ``attn_mask_ranges``) call the same
    kernel with these ranges; they evaluate the rest otherwise."""
    cdef int64_t b, s, t, lo, hi, mrow, cap, end, glo, ghi, key
    cdef const float *fm = <const float *>mask
    cdef const uint8_t *bm = <const uint8_t *>mask
    cdef const uint16_t *hm = <const uint16_t *>mask
    cdef float m
    cdef uint16_t h
    cdef bint seen
    if T < 1 or T > INT32_MAX or not (mb == 1 or mb == B) or not (ms == 1 or ms == S):
        return False
    if gaps != NULL and (ends != NULL or T < S):
        return False
    for b in range(B):
        end = T if ends == NULL else ends[b]
        glo = ghi = T                     # no gap: keys keep their columns
        if gaps != NULL:
            glo, ghi = gaps[b], T - S
            if glo < 0 or glo > ghi:
                return False
            end = glo + S
        if end < 0 or end > T:
            return False
        for s in range(S):
            mrow = ((b if mb > 1 else 0) * ms + (s if ms > 1 else 0)) * T
            lo = -1
            hi = -1
            for t in range(T):
                if kind == 1:
                    seen = bm[mrow + t] != 0
                elif kind == 2:
                    h = hm[mrow + t]
                    seen = (h & 0x7FFF) == 0
                    if not seen and h != 0xFC00:     # -inf hides the key; anything else is refused
                        return False
                else:
                    m = fm[mrow + t]
                    seen = m == 0
                    if not seen and not (m <= MASK_HIDES):
                        return False
                if glo <= t < ghi:        # a key the row never wrote: hidden, and not one of its keys
                    if seen:
                        return False
                    continue
                key = t if t < glo else t - (ghi - glo)
                if seen:
                    if lo < 0:
                        lo = key
                    elif hi != key - 1:
                        return False      # a hole inside the row
                    hi = key
            if lo < 0:
                return False              # no visible key: the operators' literal paths
            if s == 0:
                kv_start[b] = <int32_t>lo
            elif kv_start[b] != lo:
                return False
            if causal:
                cap = end - S + s
                if hi > cap:
                    hi = cap
            if hi < lo or end - 1 < lo:   # the causal bound or the row's end (kv_len) hides every key shown
                return False
            q_pos[b * S + s] = <int32_t>hi
    return True


cdef int masked_decode_ptr(const void *q, const void *k_cache, const void *v_cache, int64_t B, int64_t Hq,
                           int64_t Hkv, int64_t S, int64_t D, int64_t Cap, int64_t T, const int32_t *kv_start,
                           const int32_t *q_pos, int32_t *kv_len, float scale, float softcap, void *out,
                           okv_settings s, int io16, int kv_type, const int64_t *ends) noexcept nogil:
    """``attention`` of q [B, Hq, S, D] over the first T positions of the caches [B, Hkv, Cap, D] (T <= Cap; of
    ``kv_type``: OKV_KV_F32 or OKV_KV_F16) with the ranges of ``masked_ranges`` (kv_len: the call's scratch [B],
    set to T, or to ``ends[b]`` when given: the rows' valid keys, each in [1, T]), ``softcap``, no window, into
    out: bit for bit the operators' kernel call (whose work split follows the longest kv_len).  ``io16``: q and
    out are float16 (a float16 file's block), q widened first and the float32 result rounded once, as the
    operator's Python path does.  0, or -1 when memory cannot be allocated."""
    cdef okv_attn_args a
    cdef int64_t stats[2]
    cdef int64_t b, n = B * Hq * S * D, longest = 0
    cdef float *wide = NULL
    cdef int rc
    for b in range(B):
        kv_len[b] = <int32_t>(T if ends == NULL else ends[b])
        if kv_len[b] > longest:
            longest = kv_len[b]
    if io16:
        wide = <float *>malloc(<size_t>(2 * n) * sizeof(float))
        if wide == NULL:
            return -1
        okv_h2f_row(<const uint16_t *>q, wide, n, s.simd)
    _fill_args(&a, <const float *>q if wide == NULL else wide, <float *>out if wide == NULL else wide + n, kv_len,
               q_pos, B, Hq, S, D, Hkv, Cap, scale, softcap, -1, kv_type)
    a.k = k_cache
    a.v = v_cache
    a.kv_start = kv_start
    rc = _run_units(&a, longest, s, stats)
    if wide != NULL:
        if rc == 0:
            okv_f2h_row(wide + n, <uint16_t *>out, n, s.simd)
        free(wide)
    return rc
