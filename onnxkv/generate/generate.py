"""``onnxkv.generate``: greedy and sampled generation over a Session."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from onnxkv._deprecation import renamed_argument
from onnxkv.errors import InputError
from onnxkv.generate.arguments import (
    as_session,
    callback_arg,
    check_length,
    check_prompt,
    int_arg,
    optional_int,
    token_id,
    token_ids,
)
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.generate.sampling import SamplingConfig, sampling_arguments, select_next
from onnxkv.plan.step_loop import Draws
from onnxkv.runtime.cache_config import KINDS, CacheConfig, cache_request
from onnxkv.runtime.prompt_chunk import prompt_chunk
from onnxkv.runtime.session import check_precision
from onnxkv.runtime.state import State

__all__ = ["compiled_steps", "generate", "GenerationResult"]


@dataclass
class GenerationResult:
    """What :func:`generate` returns.

    Attributes:
        sequences: int64 [B, L + n]: the prompts as given (left-padded) then
            the new tokens; rows that finished early are filled with the pad id.
        tokens: int64 [B, n]: only the new tokens.
        prompt_lengths: int64 [B]: real (unpadded) prompt length per row.
        finished: bool [B]: rows that emitted an EOS.
        prefill_seconds / decode_seconds: wall time of the first run and of the rest.
        step_seconds: wall time of every decode run.
    """

    sequences: np.ndarray
    tokens: np.ndarray
    prompt_lengths: np.ndarray
    finished: np.ndarray
    prefill_seconds: float
    decode_seconds: float
    step_seconds: list[float] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens (all rows) per second of decode time (0 if no decode run)."""
        n = self.tokens.shape[0] * max(0, self.tokens.shape[1] - 1)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0


#: Deprecated State keywords of generate (now fields of CacheConfig).
_LEGACY = ("capacity", "cache_dtype", "block_size", "kv_format")
#: With a callback, decode steps run in C (State.decode_steps) at most this many at a time, so that the
#: callback sees each token at most this many steps after it was chosen.
CALLBACK_EVERY = 16
#: Frames from generate's body to its caller's (the renamed_argument wrapper is one), for deprecation warnings.
_DEPTH = 2


@renamed_argument("generate", "session_or_model", "model")
def generate(
    model,
    input_ids,
    max_new_tokens: int,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    attention_mask=None,
    threads: int | None = None,
    callback: Callable[[int, np.ndarray], None] | None = None,
    cache: CacheConfig | str | None = None,
    prefill_chunk: int | str | None = "auto",
    *,
    do_sample: bool = False,
    prefill_precision: str | None = None,
    **deprecated,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after each prompt row.

    Args:
        model: a :class:`~onnxkv.Session`, or anything :class:`~onnxkv.Session`
            accepts (then a session is built with ``threads``).  ``session_or_model=``
            is its deprecated keyword.
        input_ids: int [B, L] or [L] prompt ids, left-padded when rows differ in length.
        max_new_tokens: how many tokens to generate at most (≥ 0).
        do_sample: draw each token (True) or take the argmax (False, greedy), as in transformers.
        temperature: logits are divided by it before a draw (None: 1.0).  A
            ``temperature`` > 0 without ``do_sample=True`` still samples for one
            release, with a DeprecationWarning.
        top_k: sample among the ``top_k`` highest logits only (None: all).
        top_p: then among the smallest set whose probability reaches ``top_p`` (None: all).
        seed: seeds the draws: the same seed gives the same tokens
            (see :func:`~onnxkv.generate.sampling.sampling_arguments`).
        eos_token_id: id(s) that end a row (default: the model's genai_config);
            generation stops when every row has ended.
        pad_token_id: id written after a row ended and into padding
            (default: the model's pad id, else the first EOS, else 0).
        attention_mask: 0/1 [B, L]; zeros mark left padding.
        callback: called once per new token, in order, as ``callback(step, tokens[B])``.  The decode
            steps of rows of one length (or of a padded batch: a GroupQueryAttention graph's, or one whose
            masks an ``ExportMask`` node computes) on a state run in C several at a time
            (:meth:`State.decode_steps <onnxkv.runtime.state.State.decode_steps>`); the callback is then
            called for each of them after they ran, at most ``CALLBACK_EVERY`` (16) steps late.
        cache: a :class:`~onnxkv.CacheConfig` or a kind (see
            :mod:`onnxkv.runtime.cache_config`): ``"contiguous"`` runs the cache in
            place on a persistent state (nothing of cache size copied per token),
            ``"paged"`` the same in pages, ``"tensor"`` threads it through the graph
            as tensors (past -> present).  None: contiguous when the model's cache
            runs in place, else tensors.  A contiguous cache without
            ``initial_capacity`` starts at the prompt length plus up to 256 tokens.
        prefill_chunk: on a state, a single unpadded prompt longer than this is
            fed in chunks of this many tokens (the same result with far smaller
            temporaries); ``"auto"``: the session's choice for the model and the
            cache (:meth:`~onnxkv.Session.prompt_chunk`); None feeds it whole.
            With ``Session(events=True)`` a chunked prompt records a
            ``"prompt_chunk"`` event (``extra``: chunk, prompt_tokens, chunks).
        prefill_precision: the prompt's products in ``"bf16"`` or ``"float32"`` for this call
            (see :class:`~onnxkv.Session`); None: the session's.  Decode steps are float32 either way.
        deprecated: ``capacity=``, ``cache_dtype=``, ``block_size=``,
            ``kv_format=`` (now CacheConfig fields) work for one release with a
            DeprecationWarning; ``cache="auto"`` is the deprecated spelling of None.

    Raises:
        InputError: bad arguments (the message names the argument and value).
    """
    api = "generate"
    unknown = sorted(set(deprecated) - set(_LEGACY))
    if unknown:
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}")
    max_new_tokens = int_arg(api, "max_new_tokens", max_new_tokens, 0)
    sampling = sampling_arguments(
        api, do_sample, temperature, top_k, top_p, seed, legacy_temperature=True, depth=_DEPTH
    )
    callback_arg(api, "callback", callback)
    request = cache_request(api, cache, KINDS, deprecated, depth=_DEPTH, auto=True)
    auto_chunk = isinstance(prefill_chunk, str) and prefill_chunk == "auto"
    if not auto_chunk:
        prefill_chunk = optional_int(api, "prefill_chunk", prefill_chunk, 1)
    check_precision(api, prefill_precision)
    sess = as_session(api, "model", model, threads)
    model = sess.model
    vocab = sess.token_limit
    ids, mask, lengths = check_prompt(api, input_ids, attention_mask, vocab)
    eos = token_ids(api, "eos_token_id", eos_token_id, model.eos_token_id, vocab)
    if pad_token_id is None:
        pad_token_id = model.pad_token_id if model.pad_token_id is not None else (eos[0] if eos else 0)
    pad_token_id = token_id(api, "pad_token_id", pad_token_id, vocab)
    B, L = ids.shape
    check_length(api, sess, L, max_new_tokens)
    ids = np.where(mask == 1, ids, pad_token_id)

    kind = request.kind("contiguous" if sess.bindings else "tensor")
    if kind != "tensor" and not sess.bindings:
        raise InputError(
            f"generate: cache kind {kind!r} needs a model with a recognised in-place cache; this "
            f"model's is '{model.convention.kind}' (use cache='tensor' or None)"
        )
    in_place = kind != "tensor"
    narrowed = [k for k in ("cache_dtype", "kv_format") if k in request.legacy]
    if not in_place and narrowed:
        raise InputError(
            f"generate: {narrowed[0]}={request.legacy[narrowed[0]]!r} needs a state's cache, got cache kind 'tensor'"
        )
    state_kw = request.state_keywords(kind, initial_capacity=max(32, L + min(max_new_tokens, 256))) if in_place else {}
    if auto_chunk:
        prefill_chunk = prompt_chunk(sess.plan.kernels, state_kw.get("block_size") if kind == "paged" else None)
    chunked = in_place and prefill_chunk is not None and B == 1 and L > prefill_chunk
    first_len = int(prefill_chunk) if chunked else L
    if chunked and sess.events.enabled:
        sess.events.record(
            sess._step,
            "",
            "",
            "prompt_chunk",
            extra={"chunk": first_len, "prompt_tokens": L, "chunks": -(-L // first_len)},
        )
    builder = FeedBuilder(
        sess.plan.inputs,
        model,
        ids[:, :first_len],
        np.minimum(lengths, first_len),
        int(pad_token_id),
        thread_cache=not in_place,
    )
    if in_place:
        state = State(sess, **state_kw)
        fetch = [model.io.logits]
        run = state.run
    else:
        state = None
        fetch = [model.io.logits, *model.convention.present_outputs]
        run = sess.run
    eos_arr = np.array(eos, dtype=np.int64)
    finished = np.zeros(B, dtype=bool)
    new_tokens: list[np.ndarray] = []
    step_seconds: list[float] = []
    prefill = 0.0
    if max_new_tokens > 0:
        feeds, read = builder.first()
        t0 = time.perf_counter()
        with sess.precision(prefill_precision):
            # A chunk before the last asks for no output: only its cache writes run (not the LM head);
            # the last asks for the logits at each row's last token only (logits_at: [B, 1, V]).
            out = run(feeds, [], logits_at=None) if chunked else run(feeds, fetch, logits_at=read)
            for c0 in range(first_len, L if chunked else 0, first_len):
                chunk = ids[:, c0 : c0 + first_len]
                last = c0 + first_len >= L
                read = np.array([chunk.shape[1] - 1])
                out = run(builder.next(chunk, out), fetch if last else [], logits_at=read if last else None)
        prefill = time.perf_counter() - t0
        # The steps of rows of one length may run as one call (State.decode_steps: contiguous or paged float32),
        # and those of a right-padded batch (GroupQueryAttention graphs) or a left-padded one (graphs whose
        # ExportMask node the loop writes).
        names = builder.decode_names
        loop = state is not None and names is not None
        logits = out[model.io.logits]
        if logits.ndim == 3:  # [B, 1, V] (logits_at), or the graph's own shape
            logits = logits[np.arange(B), read if logits.shape[1] > 1 else 0]
        tok = select_next(logits, sampling)
        step = 0
        with sess.decode_loop(B):
            while True:
                tok = np.where(finished, pad_token_id, tok)
                new_tokens.append(tok)
                if eos_arr.size:
                    finished |= (tok[:, None] == eos_arr).any(axis=1)  # a few ids: no np.isin set-up per token
                if callback is not None:
                    callback(step, tok)
                if finished.all() or step == max_new_tokens - 1:
                    break
                feeds = builder.next(tok, out)
                fast = None
                if loop:
                    left = max_new_tokens - 1 - step
                    fast = compiled_steps(state, feeds, left if callback is None else min(CALLBACK_EVERY, left),
                                          names, eos, sampling, finished.copy(), pad_token_id)  # fmt: skip
                if fast is not None and fast.steps:
                    # Its steps fed tok, then each row's id it chose but the last, which the next turn feeds.
                    chosen = fast.tokens.reshape(fast.steps, B)
                    if fast.steps > 1:
                        builder.next(chosen[:-1].T, None)
                    step_seconds.extend(fast.seconds.tolist())
                    for row in chosen[:-1]:  # not every row ended, not the last step: the loop stops there
                        step += 1
                        new_tokens.append(row.copy())
                        if eos_arr.size:
                            finished |= (row[:, None] == eos_arr).any(axis=1)
                        if callback is not None:
                            callback(step, new_tokens[-1])
                    step += 1
                    tok = chosen[-1].copy()  # padded where a row ended before it, as the loop's top pads it
                    continue
                t0 = time.perf_counter()
                out = run(feeds, fetch)
                step_seconds.append(time.perf_counter() - t0)
                step += 1
                logits = out[model.io.logits]
                if logits.ndim == 3:
                    logits = logits[np.arange(B), 0]
                tok = select_next(logits, sampling)
    if state is not None:
        state.close()
    tokens = np.stack(new_tokens, axis=1) if new_tokens else np.zeros((B, 0), dtype=np.int64)
    return GenerationResult(
        np.concatenate([ids, tokens], axis=1),
        tokens,
        lengths,
        finished,
        prefill,
        float(sum(step_seconds)),
        step_seconds,
    )


def compiled_steps(
    state: State, feeds: dict, count: int, names, eos: list[int], sampling: SamplingConfig, finished, pad: int
):
    """Up to ``count`` steps of the B rows in one call (:meth:`State.decode_steps`; ``finished``: the rows that
    have ended, which take ``pad``), drawing as :func:`select_next` does when sampling; the sampling
    generator then stands where ``select_next`` one step at a time would have left it (one number per row
    of each step that ran).  None when the state cannot run them so."""
    if sampling.greedy:
        return state.decode_steps(feeds, count, names, eos, finished=finished, pad=pad)
    rng, rows = sampling.rng, finished.shape[0]
    before = rng.bit_generator.state
    uniforms = rng.random(count * rows)
    draws = Draws(
        sampling.temperature, sampling.top_k or 0, 1.0 if sampling.top_p is None else sampling.top_p, uniforms
    )
    try:
        run = state.decode_steps(feeds, count, names, eos, draws, finished=finished, pad=pad)
    finally:
        rng.bit_generator.state = before
    rng.random(0 if run is None else run.steps * rows)  # exactly the numbers the steps drew with
    return run
