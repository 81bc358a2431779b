# cython: boundscheck=False, wraparound=False
"""Decode steps back to back: a compiled step's program replayed once per token.

:func:`decode_steps` runs a :class:`~onnxkv._kernels.step.Program` that holds a
whole decode step of B sequences (rows of one length, or of their own lengths
with each row's mask ones first; every node of the plan recorded) up to ``count`` times with no Python between the steps:
after each step it chooses each row's next token from the logits the program
wrote (their argmax, or a draw of :mod:`onnxkv._kernels.sampling` with the
step's uniform number for that row), writes the ids into the token external
(a row that has ended takes the pad id), lengthens the attention mask by one
column (all ones, or each row's ones first: one more each step, as a
right-padded batch's mask grows), advances the positions and the committed
lengths each decode call checks, writes the attention masks an export derives
from that mask (the outputs of an ``ExportMask`` node the loop stands in for),
and stops once every row has chosen an end-of-sequence id.  The
results are those of the steps run one by one (:meth:`Program.run`, then
``np.argmax`` or ``sampling.sample`` per row, ended rows padded), bit for bit.
"""
from libc.math cimport INFINITY, isnan
from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport free, malloc

import numpy as np

from onnxkv._kernels._record cimport (KIND_CACHE_ROWS, KIND_DECODE_PAGED, KIND_DECODE_TOKEN, KIND_MASKED_DECODE,
                                      KIND_MASKED_PAGED, KIND_PAGE_ROWS)
from onnxkv._kernels._runtime cimport okv_now_ns, okv_settings, okv_settings_get
from onnxkv._kernels.sampling cimport sample_row_f32
from onnxkv._kernels.step cimport MAX_EXT, PAGED_S, Program, call_t, ext_t

__all__ = ["decode_steps", "DONE", "EOS", "REFUSED", "MISMATCH"]

#: Why :func:`decode_steps` stopped: ``count`` steps ran, a step chose an end-of-sequence id, a step's calls
#: refused their values (the position, a token id out of the embedding's range: nothing of that step ran), or
#: the externals differ from the program's recording (a cache of another capacity: nothing ran).
DONE, EOS, REFUSED, MISMATCH = "done", "eos", "refused", "mismatch"


cdef inline int64_t _argmax(const float *x, int64_t n) noexcept nogil:
    """np.argmax of ``x[:n]`` (n >= 1): the first maximum, or the first NaN when there is one."""
    cdef int64_t i, best = 0
    cdef float top = x[0]
    if isnan(top):
        return 0
    for i in range(1, n):
        if isnan(x[i]):
            return i
        if x[i] > top:
            top = x[i]
            best = i
    return best


def decode_steps(Program program, list externals, int token_ext, int mask_ext, int position_ext,
                 int64_t mask_len, float[::1] logits, eos, int64_t[:, ::1] tokens,
                 double[::1] seconds, temperature=0.0, top_k=0, top_p=1.0,
                 const double[::1] uniforms=None, uint8_t[::1] finished=None, int64_t pad=0,
                 const int64_t[::1] mask_ones=None, const int64_t[:, ::1] derived=None,
                 const double[:, ::1] derived_values=None, Program head=None, list head_externals=None,
                 int head_token_ext=-1, int head_position_ext=-1, const int64_t[::1] derived_starts=None,
                 const int64_t[::1] derived_gaps=None):
    """Run up to ``count = len(tokens)`` decode steps of ``program`` for its B rows; return ``(steps, why)``.

    ``externals`` are the program's external arrays (checked as :meth:`Program.run` checks them), bound
    once for every step: ``externals[token_ext]`` holds the step's token ids (int64, one per row), which the
    caller sets for the first step; ``externals[mask_ext]`` the ragged attention mask (int64 [B, M]), of
    which step ``t`` reads ``mask_len + t`` columns per row (``mask_len + count - 1 <= M``), C-contiguous
    as the step reads it ([B, mask_len + t]): all ones (``mask_ones`` None: the caller fills M columns),
    or, with ``mask_ones`` (int64 [B], each in [0, mask_len]), row ``b``'s first ``mask_ones[b] + t``
    columns ones and the rest zeros (the loop writes it before each step);
    ``mask_ext`` may be -1 when ``derived`` is given: no node of the program reads the mask, the masks
    derived from it (all ones, ``mask_len + t`` columns at step ``t``) stand for it.
    ``derived`` (int64 [n, 5], with ``derived_values`` float64 [n, 2]; or None) describes, per row, an
    external the loop writes before each step as the ``ExportMask`` formula gives it for one query at
    position ``mask_len + t - 1`` over an all-ones mask, or over a left-padded one (``derived_starts``,
    int64 [B] or None: row ``b``'s first ``derived_starts[b]`` columns zeros, each in [0, mask_len);
    ``mask_ones`` must be None): ``(external, kind, window, rows, padded)``, the external ragged ``[rows,
    1, 1, M]`` (rows 1 or B; ``mask_len + count - 1 <= M``) of float32 (kind 0: ``derived_values[d, 0]``
    where key ``k`` is visible, ``[d, 1]`` where hidden) or bool (kind 1), C-contiguous as step ``t`` reads
    it ([rows, 1, 1, T = mask_len + t]); key ``k`` is visible when ``window`` is 0 or ``k > T - 1 -
    window``, and, for a mask the formula reads (``padded`` 1, then rows B when ``derived_starts`` or
    ``derived_gaps`` is given), ``k >= derived_starts[r]``; or, with ``derived_gaps`` (int64 [B] or None,
    each in [0, mask_len - 1]; ``derived_starts`` None), ``k`` outside ``[derived_gaps[r] + t, T - 1)``:
    the mask of rows of different lengths, each row's ones first (one more each step), then zeros up to
    the step's last column, which is one (the rows of requests of different lengths in one batch).
    ``externals[position_ext]`` (or -1: none) the tokens' positions (int64, one per row), one more each
    step.  ``head`` (or None) is a program run before ``program`` in every step, on ``head_externals``
    (checked and bound as ``program``'s), which must write nothing but its own memory (no cache);
    ``head_token_ext`` / ``head_position_ext`` (or -1) are its externals that hold the step's token ids /
    positions, written as ``program``'s are (``token_ext`` may be -1 when the head's holds them).  The
    caller has set the committed lengths of every decode call (its effect's ``before``), and for a paged
    decode call staged the pages of every position the steps may write (a step whose position is past
    them is refused).
    ``logits`` is the program memory holding the step's logits (float32 [B * V], row-major).
    ``eos`` is int64 [E] (every row's end ids) or [B, E] (each row's; a negative entry is no id).
    ``tokens`` is int64 [count, B]; ``finished`` (uint8 [B], or None: no row has ended) the rows that
    have ended, updated in place; ``pad`` the id an ended row takes.

    Step ``t`` chooses each row's argmax (``temperature`` 0), or draws row ``b`` with ``uniforms[t * B +
    b]`` after ``temperature``, ``top_k`` (0: none) and ``top_p`` (1: none) as ``sampling.sample`` does
    (each a number for every row, or one per row: float64 / int64 / float64 [B], a row of temperature 0
    taking its argmax);
    a row that has ended takes ``pad`` instead, and a row whose id is in ``eos`` has ended after it.  It
    writes the ids to ``tokens[t]`` and its time (seconds) to ``seconds[t]``; ``steps`` counts the steps
    that ran, ``why`` is :data:`DONE`, :data:`EOS` (every row has ended after step ``steps - 1``),
    :data:`REFUSED` (step ``steps`` refused its values: nothing of it ran) or :data:`MISMATCH` (the
    externals differ from the recording, as :meth:`Program.run` checks them: nothing ran).  Each step's
    decode calls appended rows at their committed lengths, which the next step takes as committed.

    Raises:
        ValueError: an argument out of the ranges above.
        MemoryError: a call of step ``t`` could not allocate its workspace (steps before it ran; the
            caller must not commit any), or the sampling workspace could not be allocated (nothing ran).
    """
    cdef void *bases[MAX_EXT]
    cdef int64_t lens[MAX_EXT]
    cdef void *hbases[MAX_EXT]
    cdef int64_t hlens[MAX_EXT]
    cdef int64_t *heads[2]
    cdef int64_t count = tokens.shape[0], B = tokens.shape[1], t, b
    cdef int c
    cdef int64_t *token
    cdef int64_t *position = NULL
    cdef okv_settings s = okv_settings_get()
    cdef int n_ext = program.n_ext
    cdef int64_t V = logits.shape[0] // B if B > 0 else 0
    cdef double *p = NULL
    cdef double *work = NULL
    cdef int64_t *order = NULL
    cdef bint sampled = False
    cdef const int64_t[:, ::1] ends
    if seconds.shape[0] != count or B < 1 or V < 1 or V * B != logits.shape[0]:
        raise ValueError("decode_steps: tokens [count, B >= 1] and seconds [count] must have one row per step, "
                         "logits B rows of at least one")
    if finished is None:
        finished = np.zeros(B, np.uint8)
    if finished.shape[0] != B:
        raise ValueError(f"decode_steps: finished must have one flag per row ({B}), got {finished.shape[0]}")
    e = np.asarray(eos)
    if e.dtype != np.int64 or e.ndim not in (1, 2) or (e.ndim == 2 and e.shape[0] not in (1, B)):
        raise ValueError(f"decode_steps: eos must be int64 [E], [1, E] or [{B}, E], got {e.dtype} {e.shape}")
    ends = np.ascontiguousarray(np.broadcast_to(e if e.ndim == 2 else e[None, :], (B, e.shape[e.ndim - 1])))
    cdef const double[::1] temps = _per_row(temperature, np.float64, B, "temperature")
    cdef const int64_t[::1] ks = _per_row(top_k, np.int64, B, "top_k")
    cdef const double[::1] ps = _per_row(top_p, np.float64, B, "top_p")
    for b in range(B):
        if temps[b] != 0.0:
            sampled = True
            if not (0.0 < temps[b] < INFINITY) or ks[b] < 0 or not (0.0 < ps[b] <= 1.0):
                raise ValueError(f"decode_steps: row {b}: temperature {temps[b]}, top_k {ks[b]}, top_p {ps[b]} out "
                                 "of range (temperature > 0 and finite, or 0: the argmax; top_k >= 0, top_p in (0, 1])")
    if sampled:
        if uniforms is None or uniforms.shape[0] != count * B:
            raise ValueError("decode_steps: sampling needs one uniform number per step and row")
        for t in range(count * B):
            if not (0.0 <= uniforms[t] < 1.0):
                raise ValueError(f"decode_steps: uniforms[{t}] = {uniforms[t]} is not in [0, 1)")
    cdef int64_t n_derived = 0 if derived is None else derived.shape[0]
    cdef int h_ext = 0 if head is None else head.n_ext
    if head is None and (head_token_ext != -1 or head_position_ext != -1 or head_externals is not None):
        raise ValueError("decode_steps: head externals given without a head program")
    for c, name in ((head_token_ext, "head token"), (head_position_ext, "head position")):
        if not (-1 <= c < h_ext):
            raise ValueError(f"decode_steps: {name} external {c} out of [0, {h_ext})")
    for c, name in ((token_ext, "token"), (mask_ext, "mask"), (position_ext, "position")):
        if not (0 <= c < n_ext or (c == -1 and (name == "position" or (name == "mask" and n_derived)
                                                or (name == "token" and head_token_ext >= 0)))):
            raise ValueError(f"decode_steps: {name} external {c} out of [0, {n_ext})")
    if mask_ext >= 0 and (not program.exts[mask_ext].ragged or program.exts[mask_ext].ndim != 2
                          or program.exts[mask_ext].shape[0] != B):
        raise ValueError(f"decode_steps: external {mask_ext} is not the ragged [{B}, L] mask of the rows' step")
    if derived_gaps is not None:
        if derived_starts is not None or n_derived == 0 or derived_gaps.shape[0] != B:
            raise ValueError(f"decode_steps: derived_gaps must come with derived masks, one per row ({B}), and "
                             f"without derived_starts")
        for b in range(B):
            if not 0 <= derived_gaps[b] <= mask_len - 1:
                raise ValueError(f"decode_steps: derived_gaps[{b}] = {derived_gaps[b]} is not in [0, "
                                 f"{mask_len - 1}]")
    _check_derived(program, derived, derived_values, n_derived, B, (token_ext, mask_ext, position_ext), mask_ones,
                   derived_starts, mask_len)
    for d in range(n_derived if derived_gaps is not None else 0):
        if derived[d, 4] and derived[d, 3] != B:
            raise ValueError(f"decode_steps: derived[{d}] is padded: with derived_gaps it needs {B} rows")
    for prog, c in ((program, token_ext), (program, position_ext), (head, head_token_ext), (head, head_position_ext)):
        if c >= 0 and not _one_int64_per_row(prog, c, B):
            raise ValueError(f"decode_steps: external {c} must be int64, one per row (token ids or positions)")
    if not program.bind(externals, bases, lens) or (head is not None and not head.bind(head_externals, hbases, hlens)):
        return 0, MISMATCH
    for c in ([mask_ext] if mask_ext >= 0 else []) + [int(derived[d, 0]) for d in range(n_derived)]:
        if mask_len < 1 or mask_len + count - 1 > lens[c]:
            raise ValueError(f"decode_steps: {count} steps from a mask of {mask_len} columns need "
                             f"{mask_len + count - 1} columns, external {c} has {lens[c]}")
    if mask_ones is not None:
        if mask_ones.shape[0] != B:
            raise ValueError(f"decode_steps: mask_ones must have one count per row ({B}), got {mask_ones.shape[0]}")
        for b in range(B):
            if not 0 <= mask_ones[b] <= mask_len:
                raise ValueError(f"decode_steps: mask_ones[{b}] = {mask_ones[b]} is not in [0, {mask_len}]")
    token = <int64_t *>bases[token_ext] if token_ext >= 0 else NULL
    if position_ext >= 0:
        position = <int64_t *>bases[position_ext]
    heads[0] = <int64_t *>hbases[head_token_ext] if head_token_ext >= 0 else NULL
    heads[1] = <int64_t *>hbases[head_position_ext] if head_position_ext >= 0 else NULL
    if sampled:
        p = <double *>malloc(<size_t>(2 * V) * sizeof(double))
        order = <int64_t *>malloc(<size_t>(2 * V) * sizeof(int64_t))
        if p == NULL or order == NULL:
            free(p)
            free(order)
            raise MemoryError("decode_steps: could not allocate the sampling workspace")
        work = p + V
    try:
        return _steps(program, bases, lens, token, position, mask_ext, mask_len, logits, ends, tokens, seconds,
                      temps, ks, ps, uniforms, p, work, order, s, finished, pad, mask_ones, derived, derived_values,
                      head, hbases, hlens, heads, derived_starts, derived_gaps)
    finally:
        free(p)
        free(order)


cdef bint _one_int64_per_row(Program program, int c, int64_t B):
    """Whether external ``c`` of ``program`` is int64 with one element per row."""
    cdef ext_t *x = &program.exts[c]
    return x.nbytes == 8 * B and x.itemsize == 8 and (x.format[0] == c'l' or x.format[0] == c'q')


cdef _check_derived(Program program, const int64_t[:, ::1] derived, const double[:, ::1] values, int64_t n,
                    int64_t B, tuple taken, const int64_t[::1] mask_ones, const int64_t[::1] starts,
                    int64_t mask_len):
    """Raise ValueError unless every row of ``derived`` (see :func:`decode_steps`) names a distinct external,
    none of ``taken``, that is a ragged [rows, 1, 1, M] float32 (kind 0) or bool (kind 1) array, with a
    window >= 0, rows 1 or B (B when it is padded and ``starts`` are given), padded 0 or 1, and ``values``
    [n, 2] beside it; ``mask_ones`` is None when n > 0; ``starts`` (or None) [B] in [0, mask_len) and given
    only with ``derived``."""
    cdef int64_t d, e, kind, window, rows, padded
    cdef ext_t *x
    if starts is not None:
        if n == 0 or starts.shape[0] != B:
            raise ValueError(f"decode_steps: derived_starts must come with derived masks, one per row ({B})")
        for d in range(B):
            if not 0 <= starts[d] < mask_len:
                raise ValueError(f"decode_steps: derived_starts[{d}] = {starts[d]} is not in [0, {mask_len})")
    if n == 0:
        return
    if values is None or values.shape[0] != n or values.shape[1] != 2 or derived.shape[1] != 5:
        raise ValueError(f"decode_steps: derived must be int64 [n, 5] with derived_values float64 [n, 2], n = {n}")
    if mask_ones is not None:
        raise ValueError("decode_steps: derived masks stand for an all-ones or left-padded mask (mask_ones must be "
                         "None)")
    seen = set(c for c in taken if c >= 0)
    for d in range(n):
        e, kind, window, rows, padded = derived[d, 0], derived[d, 1], derived[d, 2], derived[d, 3], derived[d, 4]
        if padded not in (0, 1) or (padded and starts is not None and rows != B):
            raise ValueError(f"decode_steps: derived[{d}] padded = {padded} (0 or 1; 1 with derived_starts: {B} "
                             f"rows, got {rows})")
        if not 0 <= e < program.n_ext or e in seen:
            raise ValueError(f"decode_steps: derived[{d}] names external {e}, out of [0, {program.n_ext}) or taken")
        seen.add(e)
        x = &program.exts[e]
        if kind not in (0, 1) or window < 0 or rows not in (1, B) or not x.ragged or x.ndim != 4 \
                or x.shape[0] != rows or x.shape[1] != 1 or x.shape[2] != 1 or x.itemsize != (4 if kind == 0 else 1) \
                or x.format[0] != (c'f' if kind == 0 else c'?'):
            raise ValueError(f"decode_steps: derived[{d}] = ({e}, {kind}, {window}, {rows}) is not a ragged "
                             f"[rows, 1, 1, M] float32 (kind 0) or bool (kind 1) external, window >= 0, rows 1 "
                             f"or {B}")


cdef void _write_derived(void *base, int64_t kind, int64_t window, int64_t rows, double visible, double hidden,
                         int64_t T, const int64_t *starts, const int64_t *gaps, int64_t t) noexcept nogil:
    """One derived mask [rows, 1, 1, T] (see :func:`decode_steps`) for the query at position T - 1 of step
    ``t``; ``starts`` (or NULL): each row's keys hidden by its left padding; ``gaps`` (or NULL): each row's keys
    ``gaps[r] + t <= k < T - 1`` hidden."""
    cdef int64_t r, k, lo, glo, top = T - window if window > 0 else 0   # keys k > T - 1 - window
    cdef float *f = <float *>base
    cdef uint8_t *u = <uint8_t *>base
    cdef bint shown
    for r in range(rows):
        lo = starts[r] if starts != NULL and starts[r] > top else top
        glo = gaps[r] + t if gaps != NULL else T
        for k in range(T):
            shown = k >= lo and not (glo <= k < T - 1)
            if kind == 0:
                f[r * T + k] = <float>visible if shown else <float>hidden
            else:
                u[r * T + k] = 1 if shown else 0


def _per_row(value, dtype, int64_t B, str name):
    """``value`` (a number, or one per row) as a C-contiguous ``dtype`` [B]."""
    a = np.asarray(value)
    if a.ndim > 1 or (a.ndim == 1 and a.shape[0] != B):
        raise ValueError(f"decode_steps: {name} must be a number or one per row ({B}), got shape {a.shape}")
    if a.dtype.kind not in ("iu" if dtype == np.int64 else "iuf") or a.dtype == np.bool_:
        raise ValueError(f"decode_steps: {name} must be {np.dtype(dtype).name}, got {a.dtype}")
    return np.ascontiguousarray(np.broadcast_to(a.astype(dtype), (B,)))


cdef tuple _steps(Program program, void **bases, int64_t *lens, int64_t *token, int64_t *position, int mask_ext,
                  int64_t mask_len, float[::1] logits, const int64_t[:, ::1] eos, int64_t[:, ::1] tokens,
                  double[::1] seconds, const double[::1] temperature, const int64_t[::1] top_k,
                  const double[::1] top_p, const double[::1] uniforms, double *p, double *work, int64_t *order,
                  okv_settings s, uint8_t[::1] finished, int64_t pad, const int64_t[::1] mask_ones,
                  const int64_t[:, ::1] derived, const double[:, ::1] derived_values, Program head,
                  void **hbases, int64_t *hlens, int64_t **heads, const int64_t[::1] derived_starts,
                  const int64_t[::1] derived_gaps):
    """The steps of :func:`decode_steps` on bound externals (``bases``, ``lens``; the head's ``hbases``,
    ``hlens``, its token and position externals ``heads``)."""
    cdef int64_t count = tokens.shape[0], B = tokens.shape[1], V = logits.shape[0] // tokens.shape[1]
    cdef int64_t t = 0, tok, k, t0, b, L, d, n_derived = 0 if derived is None else derived.shape[0]
    cdef int64_t *mask = <int64_t *>bases[mask_ext] if mask_ext >= 0 else NULL
    cdef int c, r
    cdef bint ended
    cdef int64_t *pos_io
    cdef call_t *cl
    why = DONE
    while t < count:
        L = mask_len + t
        if mask_ext >= 0:
            lens[mask_ext] = L
        t0 = okv_now_ns()
        for d in range(n_derived):
            lens[derived[d, 0]] = L
            _write_derived(bases[derived[d, 0]], derived[d, 1], derived[d, 2], derived[d, 3], derived_values[d, 0],
                           derived_values[d, 1], L,
                           &derived_starts[0] if derived_starts is not None and derived[d, 4] else NULL,
                           &derived_gaps[0] if derived_gaps is not None and derived[d, 4] else NULL, t)
        if mask_ones is not None:   # [B, L] as the step reads it: each row's ones first
            for b in range(B):
                for k in range(L):
                    mask[b * L + k] = 1 if k < mask_ones[b] + t else 0
        r = 1 if head is None else head.execute(hbases, hlens, s)
        if r > 0:
            r = program.execute(bases, lens, s)
        if r == 0:
            why = REFUSED
            break
        if r < 0:
            raise MemoryError(f"decode_steps: a call of step {t} could not allocate its workspace")
        ended = True
        for b in range(B):
            if finished[b]:
                tok = pad
            elif temperature[b] == 0.0:
                tok = _argmax(&logits[b * V], V)
            else:
                tok = sample_row_f32(&logits[b * V], V, temperature[b], top_k[b], top_p[b], uniforms[t * B + b], p,
                                     work, order)
            tokens[t, b] = tok
            for k in range(eos.shape[1]):
                if eos[b, k] == tok:
                    finished[b] = 1
            ended = ended and finished[b]
        seconds[t] = (okv_now_ns() - t0) * 1e-9
        t += 1
        for c in range(program.n):   # the rows each decode call appended are committed for the next step
            cl = &program.calls[c]
            if cl.kind == KIND_DECODE_TOKEN:
                pos_io = <int64_t *>cl.p[10]   # [2, B]: each row's written position, S more (or as long)
                for k in range(cl.i[14]):
                    if pos_io[cl.i[14] + k] + cl.i[8] > pos_io[k]:
                        pos_io[k] = pos_io[cl.i[14] + k] + cl.i[8]
            elif cl.kind == KIND_DECODE_PAGED:
                pos_io = <int64_t *>cl.p[10]   # row 0 of the lengths: the call's tokens per row more
                for k in range(cl.i[8]):
                    pos_io[k] += cl.i[PAGED_S]
            elif cl.kind == KIND_CACHE_ROWS:   # the committed length it copies at: its S positions more
                (<int64_t *>cl.p[2])[0] += cl.i[2]
            elif cl.kind == KIND_MASKED_DECODE:   # the committed length of its caches: its S queries more
                (<int64_t *>cl.p[5])[0] += cl.i[3]
            elif cl.kind == KIND_PAGE_ROWS or cl.kind == KIND_MASKED_PAGED:   # row 0 of the lengths: S (1) more
                pos_io = <int64_t *>cl.p[3 if cl.kind == KIND_PAGE_ROWS else 7]
                for k in range(cl.i[0]):
                    pos_io[k] += cl.i[2] if cl.kind == KIND_PAGE_ROWS else 1
        if ended:
            why = EOS
            break
        if t == count:
            break
        for b in range(B):
            if token != NULL:
                token[b] = tokens[t - 1, b]
            if heads[0] != NULL:
                heads[0][b] = tokens[t - 1, b]
            if position != NULL:
                position[b] += 1
            if heads[1] != NULL:
                heads[1][b] += 1
    return t, why
