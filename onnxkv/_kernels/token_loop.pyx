# cython: boundscheck=False, wraparound=False
"""Decode steps back to back: a compiled step's program replayed once per token.

:func:`decode_steps` runs a :class:`~onnxkv._kernels.step.Program` that holds a
whole decode step of a batch-1 sequence (every node of the plan recorded) up
to ``count`` times with no Python between the steps: after each step it
chooses the next token from the logits the program wrote (their argmax, or a
draw of :mod:`onnxkv._kernels.sampling` with the step's uniform number),
writes that id into the token external, lengthens the attention mask by one
column, advances the position and the committed length each decode-token
call checks, and stops after an end-of-sequence id.  The results are those of
the steps run one by one (:meth:`Program.run`, then ``np.argmax`` or
``sampling.sample``), bit for bit.
"""
from libc.math cimport INFINITY, isnan
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc

from onnxkv._kernels._record cimport KIND_DECODE_PAGED, KIND_DECODE_TOKEN
from onnxkv._kernels._runtime cimport okv_now_ns, okv_settings, okv_settings_get
from onnxkv._kernels.sampling cimport sample_row_f32
from onnxkv._kernels.step cimport MAX_EXT, PAGED_S, Program, call_t

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
                 int64_t mask_len, float[::1] logits, const int64_t[::1] eos, int64_t[::1] tokens,
                 double[::1] seconds, double temperature=0.0, int64_t top_k=0, double top_p=1.0,
                 const double[::1] uniforms=None):
    """Run up to ``count = len(tokens)`` decode steps of ``program``; return ``(steps, why)``.

    ``externals`` are the program's external arrays (checked as :meth:`Program.run` checks them), bound
    once for every step: ``externals[token_ext]`` is the step's token id (int64, one element), which the
    caller sets for the first step; ``externals[mask_ext]`` the ragged attention mask (int64 [1, M]), of
    which step ``t`` reads the first ``mask_len + t`` columns (all ones, ``mask_len + count - 1 <= M``);
    ``externals[position_ext]`` (or -1: none) the token's position (int64, one element), one more each
    step.  The caller has set the committed length of every decode-token call (its effect's ``before``),
    and for a paged decode call staged the pages of every position the steps may write (a step whose
    position is past them is refused).
    ``logits`` is the program memory holding the step's logits (float32 [V]).

    Step ``t`` chooses the argmax of the logits (``temperature`` 0), or draws with ``uniforms[t]`` after
    ``temperature``, ``top_k`` (0: none) and ``top_p`` (1: none) as ``sampling.sample`` does.  It writes
    its id to ``tokens[t]`` and its time (seconds) to ``seconds[t]``; ``steps`` counts the steps that ran,
    ``why`` is :data:`DONE`, :data:`EOS` (``tokens[steps - 1]`` is in ``eos``),
    :data:`REFUSED` (step ``steps`` refused its values: nothing of it ran) or :data:`MISMATCH` (the
    externals differ from the recording, as :meth:`Program.run` checks them: nothing ran).  Each step's
    decode-token calls appended rows at their committed length, which the next step takes as committed.

    Raises:
        ValueError: an argument out of the ranges above.
        MemoryError: a call of step ``t`` could not allocate its workspace (steps before it ran; the
            caller must not commit any), or the sampling workspace could not be allocated (nothing ran).
    """
    cdef void *bases[MAX_EXT]
    cdef int64_t lens[MAX_EXT]
    cdef int64_t count = tokens.shape[0], t
    cdef int c
    cdef int64_t *token
    cdef int64_t *position = NULL
    cdef okv_settings s = okv_settings_get()
    cdef int n_ext = program.n_ext
    cdef int64_t V = logits.shape[0]
    cdef double *p = NULL
    cdef double *work = NULL
    cdef int64_t *order = NULL
    if seconds.shape[0] != count or V < 1:
        raise ValueError("decode_steps: tokens and seconds must have one element per step, logits at least one")
    if temperature != 0.0:
        if not (0.0 < temperature < INFINITY) or top_k < 0 or not (0.0 < top_p <= 1.0):
            raise ValueError(f"decode_steps: temperature {temperature}, top_k {top_k}, top_p {top_p} out of range "
                             "(temperature > 0 and finite, top_k >= 0, top_p in (0, 1])")
        if uniforms is None or uniforms.shape[0] != count:
            raise ValueError("decode_steps: sampling needs one uniform number per step")
        for t in range(count):
            if not (0.0 <= uniforms[t] < 1.0):
                raise ValueError(f"decode_steps: uniforms[{t}] = {uniforms[t]} is not in [0, 1)")
    for c, name in ((token_ext, "token"), (mask_ext, "mask"), (position_ext, "position")):
        if not (0 <= c < n_ext or (c == -1 and name == "position")):
            raise ValueError(f"decode_steps: {name} external {c} out of [0, {n_ext})")
    if not program.exts[mask_ext].ragged or program.exts[mask_ext].ndim != 2 or program.exts[mask_ext].shape[0] != 1:
        raise ValueError(f"decode_steps: external {mask_ext} is not the ragged [1, L] mask of a batch-1 step")
    for c in (token_ext, position_ext):
        if c >= 0 and (program.exts[c].nbytes != 8 or program.exts[c].itemsize != 8
                       or (program.exts[c].format[0] != c'l' and program.exts[c].format[0] != c'q')):
            raise ValueError(f"decode_steps: external {c} must be one int64 (a token id or a position)")
    if not program.bind(externals, bases, lens):
        return 0, MISMATCH
    if mask_len < 1 or mask_len + count - 1 > lens[mask_ext]:
        raise ValueError(f"decode_steps: {count} steps from a mask of {mask_len} columns need "
                         f"{mask_len + count - 1} columns, the mask has {lens[mask_ext]}")
    token = <int64_t *>bases[token_ext]
    if position_ext >= 0:
        position = <int64_t *>bases[position_ext]
    if temperature != 0.0:
        p = <double *>malloc(<size_t>(2 * V) * sizeof(double))
        order = <int64_t *>malloc(<size_t>(2 * V) * sizeof(int64_t))
        if p == NULL or order == NULL:
            free(p)
            free(order)
            raise MemoryError("decode_steps: could not allocate the sampling workspace")
        work = p + V
    try:
        return _steps(program, bases, lens, token, position, mask_ext, mask_len, logits, eos, tokens, seconds,
                      temperature, top_k, top_p, uniforms, p, work, order, s)
    finally:
        free(p)
        free(order)


cdef tuple _steps(Program program, void **bases, int64_t *lens, int64_t *token, int64_t *position, int mask_ext,
                  int64_t mask_len, float[::1] logits, const int64_t[::1] eos, int64_t[::1] tokens,
                  double[::1] seconds, double temperature, int64_t top_k, double top_p,
                  const double[::1] uniforms, double *p, double *work, int64_t *order, okv_settings s):
    """The steps of :func:`decode_steps` on bound externals (``bases``, ``lens``)."""
    cdef int64_t count = tokens.shape[0], V = logits.shape[0], t = 0, tok, k, t0
    cdef int c, r
    cdef int64_t *pos_io
    cdef call_t *cl
    why = DONE
    while t < count:
        lens[mask_ext] = mask_len + t
        t0 = okv_now_ns()
        r = program.execute(bases, lens, s)
        if r == 0:
            why = REFUSED
            break
        if r < 0:
            raise MemoryError(f"decode_steps: call {-1 - r} of step {t} could not allocate its workspace")
        if temperature == 0.0:
            tok = _argmax(&logits[0], V)
        else:
            tok = sample_row_f32(&logits[0], V, temperature, top_k, top_p, uniforms[t], p, work, order)
        tokens[t] = tok
        seconds[t] = (okv_now_ns() - t0) * 1e-9
        t += 1
        for c in range(program.n):   # the row each decode call appended is committed for the next step
            cl = &program.calls[c]
            if cl.kind == KIND_DECODE_TOKEN:
                pos_io = <int64_t *>cl.p[10]   # [2, B]: each row's written position, S more
                for k in range(cl.i[14]):
                    pos_io[k] = pos_io[cl.i[14] + k] + cl.i[8]
            elif cl.kind == KIND_DECODE_PAGED:
                pos_io = <int64_t *>cl.p[10]   # row 0 of the lengths: the call's tokens per row more
                for k in range(cl.i[8]):
                    pos_io[k] += cl.i[PAGED_S]
        for k in range(eos.shape[0]):
            if eos[k] == tok:
                why = EOS
        if why == EOS or t == count:
            break
        token[0] = tok
        if position != NULL:
            position[0] += 1
    return t, why
