# cython: boundscheck=False, wraparound=False
"""Greedy decode steps back to back: a compiled step's program replayed once per token.

:func:`greedy_steps` runs a :class:`~onnxkv._kernels.step.Program` that holds a
whole decode step of a batch-1 sequence (every node of the plan recorded) up
to ``count`` times with no Python between the steps: after each step it takes
the argmax of the logits the program wrote, writes that id into the token
external, lengthens the attention mask by one column, advances the position
and the committed length each decode-token call checks, and stops after an
end-of-sequence id.  The results are those of the steps run one by one
(:meth:`Program.run` and ``np.argmax``), bit for bit.
"""
from libc.math cimport isnan
from libc.stdint cimport int64_t

from onnxkv._kernels._record cimport KIND_DECODE_TOKEN
from onnxkv._kernels._runtime cimport okv_now_ns, okv_settings, okv_settings_get
from onnxkv._kernels.step cimport MAX_EXT, Program, call_t

__all__ = ["greedy_steps", "DONE", "EOS", "REFUSED", "MISMATCH"]

#: Why :func:`greedy_steps` stopped: ``count`` steps ran, a step chose an end-of-sequence id, a step's calls
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


def greedy_steps(Program program, list externals, int token_ext, int mask_ext, int position_ext,
                 int64_t mask_len, float[::1] logits, const int64_t[::1] eos, int64_t[::1] tokens,
                 double[::1] seconds):
    """Run up to ``count = len(tokens)`` greedy decode steps of ``program``; return ``(steps, why)``.

    ``externals`` are the program's external arrays (checked as :meth:`Program.run` checks them), bound
    once for every step: ``externals[token_ext]`` is the step's token id (int64, one element), which the
    caller sets for the first step; ``externals[mask_ext]`` the ragged attention mask (int64 [1, M]), of
    which step ``t`` reads the first ``mask_len + t`` columns (all ones, ``mask_len + count - 1 <= M``);
    ``externals[position_ext]`` (or -1: none) the token's position (int64, one element), one more each
    step.  The caller has set the committed length of every decode-token call (its effect's ``before``).
    ``logits`` is the program memory holding the step's logits (float32 [V]).

    Step ``t`` writes its chosen id to ``tokens[t]`` and its time (seconds) to ``seconds[t]``; ``steps``
    counts the steps that ran, ``why`` is :data:`DONE`, :data:`EOS` (``tokens[steps - 1]`` is in ``eos``),
    :data:`REFUSED` (step ``steps`` refused its values: nothing of it ran) or :data:`MISMATCH` (the
    externals differ from the recording, as :meth:`Program.run` checks them: nothing ran).  Each step's decode-token
    calls appended one row at their committed length, which the next step takes as committed.

    Raises:
        ValueError: an argument out of the ranges above.
        MemoryError: a call of step ``t`` could not allocate its workspace (steps before it ran; the
            caller must not commit any).
    """
    cdef void *bases[MAX_EXT]
    cdef int64_t lens[MAX_EXT]
    cdef int64_t count = tokens.shape[0], t, tok, k, t0
    cdef int c, r
    cdef int64_t *token
    cdef int64_t *position = NULL
    cdef int64_t *pos_io
    cdef call_t *cl
    cdef okv_settings s = okv_settings_get()
    cdef int n_ext = program.n_ext
    if seconds.shape[0] != count or logits.shape[0] < 1:
        raise ValueError("greedy_steps: tokens and seconds must have one element per step, logits at least one")
    for c, name in ((token_ext, "token"), (mask_ext, "mask"), (position_ext, "position")):
        if not (0 <= c < n_ext or (c == -1 and name == "position")):
            raise ValueError(f"greedy_steps: {name} external {c} out of [0, {n_ext})")
    if not program.exts[mask_ext].ragged or program.exts[mask_ext].ndim != 2 or program.exts[mask_ext].shape[0] != 1:
        raise ValueError(f"greedy_steps: external {mask_ext} is not the ragged [1, L] mask of a batch-1 step")
    for c in (token_ext, position_ext):
        if c >= 0 and (program.exts[c].nbytes != 8 or program.exts[c].itemsize != 8
                       or (program.exts[c].format[0] != c'l' and program.exts[c].format[0] != c'q')):
            raise ValueError(f"greedy_steps: external {c} must be one int64 (a token id or a position)")
    if not program.bind(externals, bases, lens):
        return 0, MISMATCH
    if mask_len < 1 or mask_len + count - 1 > lens[mask_ext]:
        raise ValueError(f"greedy_steps: {count} steps from a mask of {mask_len} columns need "
                         f"{mask_len + count - 1} columns, the mask has {lens[mask_ext]}")
    token = <int64_t *>bases[token_ext]
    if position_ext >= 0:
        position = <int64_t *>bases[position_ext]
    t = 0
    why = DONE
    while t < count:
        lens[mask_ext] = mask_len + t
        t0 = okv_now_ns()
        r = program.execute(bases, lens, s)
        if r == 0:
            why = REFUSED
            break
        if r < 0:
            raise MemoryError(f"greedy_steps: call {-1 - r} of step {t} could not allocate its workspace")
        tok = _argmax(&logits[0], logits.shape[0])
        tokens[t] = tok
        seconds[t] = (okv_now_ns() - t0) * 1e-9
        t += 1
        for c in range(program.n):   # the row each decode call appended is committed for the next step
            cl = &program.calls[c]
            if cl.kind == KIND_DECODE_TOKEN:
                pos_io = <int64_t *>cl.p[10]
                pos_io[0] = pos_io[1] + cl.i[8]
        for k in range(eos.shape[0]):
            if eos[k] == tok:
                why = EOS
        if why == EOS or t == count:
            break
        token[0] = tok
        if position != NULL:
            position[0] += 1
    return t, why
