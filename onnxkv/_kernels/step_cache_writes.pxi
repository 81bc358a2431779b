# onnxkv/_kernels/step_cache_writes.pxi: the replay of the calls that write a state's caches -- a contiguous
# cache's rows (KIND_CACHE_ROWS, KIND_SCATTER_ROWS) and a paged cache's (KIND_PAGE_ROWS, KIND_MASKED_PAGED,
# whose attention reads the pages after it writes its own rows) -- and the checks that admit the paged ones.
# Included by step.pyx (a Cython include: it shares that module's names).


cdef inline void _cache_rows(const call_t *c) noexcept nogil:
    """KIND_CACHE_ROWS (_record.pxd), admitted: each (row, head)'s S new positions copied at pos_io[0]."""
    cdef int64_t r, S = c.i[2], D = c.i[3], Cap = c.i[4], pos = (<const int64_t *>c.p[2])[0], e = c.i[5]
    cdef const char *src = <const char *>c.p[0]
    cdef char *dst = <char *>c.p[1]
    for r in range(c.i[0] * c.i[1]):
        memcpy(dst + (r * Cap + pos) * D * e, src + r * S * D * e, <size_t>(S * D * e))


cdef inline void _scatter_rows(const call_t *c) noexcept nogil:
    """KIND_SCATTER_ROWS (_record.pxd), admitted: each (row, head)'s S positions from write_indices[row] saved
    into saved[row, head], then the S new ones copied there; starts[row] = write_indices[row]."""
    cdef int64_t b, h, B = c.i[0], H = c.i[1], S = c.i[2], D = c.i[3], Cap = c.i[4], e = c.i[5], pos
    cdef const char *src = <const char *>c.p[0]
    cdef char *dst = <char *>c.p[1]
    cdef char *saved = <char *>c.p[3]
    cdef size_t n = <size_t>(S * D * e)
    for b in range(B):
        pos = (<const int64_t *>c.p[2])[b]
        (<int64_t *>c.p[4])[b] = pos
        for h in range(H):
            memcpy(saved + (b * H + h) * S * D * e, dst + ((b * H + h) * Cap + pos) * D * e, n)
            memcpy(dst + ((b * H + h) * Cap + pos) * D * e, src + (b * H + h) * S * D * e, n)


cdef inline bint _page_rows_admitted(const call_t *c) noexcept nogil:
    """KIND_PAGE_ROWS (_record.pxd): every row writes at its committed length into positions whose pages the run
    staged, and every position and page it writes passes ``decode_paged_ok`` (a window of 0: the blocks before
    them are not touched); sets the scratch ``last`` (each row's last position)."""
    cdef const int64_t *lengths = <const int64_t *>c.p[3]
    cdef int32_t *last = <int32_t *>c.p[4]
    cdef int64_t b, B = c.i[0], S = c.i[2], P = c.i[RAGGED_P]
    if B < 1 or S < 1 or P < 1 or c.i[RAGGED_M] < 1:
        return False
    for b in range(B):
        if lengths[b] < 0 or lengths[B + b] < S or lengths[b] > lengths[B + b] - S or lengths[b] > INT32_MAX - S:
            return False
        last[b] = <int32_t>(lengths[b] + S - 1)
    return decode_paged_ok(<const uint64_t *>c.p[1] + c.i[5] * P, <const uint64_t *>c.p[1] + c.i[5] * P, P,
                           <const int32_t *>c.p[2], c.i[RAGGED_M], c.i[4], last, B, S, -1, 0, NULL, NULL, 0, 0)


cdef inline bint _masked_paged_admitted(const call_t *c) noexcept nogil:
    """KIND_MASKED_PAGED (_record.pxd): every row's query is the position after its committed length, staged,
    the mask shows it one range of keys ending at that position (its start into the scratch ``kv_start``), and
    every position and page it reads (or writes) passes ``decode_paged_ok``; sets ``last``.  A row shorter
    than T - 1 (a ragged call only) has the keys it never wrote hidden by the mask and dropped."""
    cdef const int64_t *lengths = <const int64_t *>c.p[7]
    cdef int32_t *last = <int32_t *>c.p[8]
    cdef const int32_t *kv_start = <const int32_t *>c.p[9]
    cdef const int32_t *q_pos = <const int32_t *>c.p[10]
    cdef const int32_t *tables = <const int32_t *>c.p[6]
    cdef const uint64_t *kp
    cdef const uint64_t *vp
    cdef int64_t b, B = c.i[0], T = c.i[8], P = c.i[RAGGED_P], M = c.i[RAGGED_M]
    cdef bint ragged = c.i[13] != 0, longest = False
    if B < 1 or P < 1 or M < 1 or T < 1 or T > INT32_MAX:
        return False
    for b in range(B):
        if lengths[b] < 0 or lengths[b] > T - 1 or (not ragged and lengths[b] != T - 1) \
                or lengths[b] + 1 > lengths[B + b]:
            return False
        longest = longest or lengths[b] == T - 1
        last[b] = <int32_t>lengths[b]
    if not longest:    # the keys are the longest row's past and the new one (a narrower mask is the node's)
        return False
    if not masked_ranges(c.p[3], <int>c.i[9], <int>c.i[10], c.i[7], 1, T, B, 1, <int32_t *>c.p[9],
                         <int32_t *>c.p[10], NULL, lengths if ragged else NULL):
        return False
    kp = <const uint64_t *>c.p[5] + c.i[5] * P
    vp = <const uint64_t *>c.p[5] + c.i[6] * P
    for b in range(B):   # the keys the row's query sees, from its start: a window's evicted pages are not read
        if q_pos[b] != last[b] or not decode_paged_ok(kp, vp, P, tables + b * M, M, c.i[4], last + b, 1, 1, -1,
                                                      last[b] - kv_start[b], NULL, NULL, 0, 0):
            return False
    return True


cdef inline int _masked_paged(const call_t *c, okv_settings s, int64_t *stats) noexcept nogil:
    """KIND_MASKED_PAGED (_record.pxd), admitted: the rows' new K and V written (when given), then the
    attention of each row's query over its pages from ``kv_start``."""
    cdef int64_t P = c.i[RAGGED_P], Hq = c.i[1], Hkv = c.i[2], D = c.i[3]
    return decode_paged_ptr(c.p[0], Hq * D, c.p[1], Hkv * D, c.p[2], Hkv * D, NULL, NULL, 0, 0,
                            <const uint64_t *>c.p[5] + c.i[5] * P, <const uint64_t *>c.p[5] + c.i[6] * P,
                            <const int32_t *>c.p[6], c.i[RAGGED_M], c.i[4], <const int32_t *>c.p[8], c.i[0], 1, Hq,
                            Hkv, D, c.f[0], c.f[1], -1, c.p[4], s, stats, <int>c.i[11], <int>c.i[12],
                            <const int32_t *>c.p[9])
