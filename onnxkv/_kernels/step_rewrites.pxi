# onnxkv/_kernels/step_rewrites.pxi: the committed bytes a replayed decode call writes over, kept before it writes
# (a row of a right-padded batch rewrites its padding; a row shorter than the longest writes below the caches'
# committed length), so that a discarded run restores them.  Included by step.pyx (a Cython include: it shares
# that module's names).


cdef inline void _keep_overwritten(const call_t *c, const int64_t *at) noexcept nogil:
    """KIND_DECODE_TOKEN (_record.pxd), admitted, before its kernel writes: for each row ``b`` and each cache (K,
    then V), the positions ``at[b] .. min(at[b] + S, held) - 1`` of every KV head copied into the undo operand
    ``[2, B, Hkv, S, D]`` at ``[cache, b, head, 0 ..]``, ``held`` the caches' committed length (the longest row's,
    the largest of pos_io[0]); nothing for a row at or past it.  Admission kept every position within [0, Cap -
    S] and each at[b] at most its row's committed length."""
    cdef int64_t B = c.i[14], H = c.i[1], Cap = c.i[2], D = c.i[3], S = c.i[8], b, h, held = 0, n
    cdef int64_t e = 4 if c.i[13] == 0 else 2
    cdef const int64_t *committed = <const int64_t *>c.p[10]
    cdef char *undo = <char *>c.p[11]
    cdef int plane
    for b in range(B):
        held = committed[b] if committed[b] > held else held
    for b in range(B):
        n = held - at[b] if held - at[b] < S else S
        if n <= 0:
            continue
        for plane in range(2):
            for h in range(H):
                memcpy(undo + (((plane * B + b) * H + h) * S) * D * e,
                       <const char *>c.p[5 + plane] + ((b * H + h) * Cap + at[b]) * D * e, <size_t>(n * D * e))
