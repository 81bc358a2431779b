"""``onnxkv.generate``: greedy and sampled generation over a Session."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from onnxkv.errors import InputError
from onnxkv.generate.arguments import (as_session, callback_arg, check_prompt, choice, int_arg, optional_int, token_id,
                                       token_ids)
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.generate.sampling import SamplingConfig, select_next

__all__ = ["generate", "GenerationResult"]


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


def generate(
    session_or_model,
    input_ids,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    attention_mask=None,
    threads: int | None = None,
    callback: Callable[[int, np.ndarray], None] | None = None,
    cache: str = "auto",
    capacity: int | None = None,
    prefill_chunk: int | None = 512,
    cache_dtype: str | None = None,
    block_size: int = 16,
    kv_format=None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after each prompt row.

    Args:
        session_or_model: a :class:`~onnxkv.Session`, or anything
            :class:`~onnxkv.Session` accepts (then a session is built with ``threads``).
        input_ids: int [B, L] or [L] prompt ids, left-padded when rows differ in length.
        max_new_tokens: how many tokens to generate at most (≥ 0).
        temperature: 0 = greedy; otherwise logits are divided by it and a token is drawn.
        top_k: sample among the ``top_k`` highest logits only (None: all).
        top_p: then among the smallest set whose probability reaches ``top_p`` (None: all).
        seed: seeds the draws: the same seed gives the same tokens.
        eos_token_id: id(s) that end a row (default: the model's genai_config);
            generation stops when every row has ended.
        pad_token_id: id written after a row ended and into padding
            (default: the model's pad id, else the first EOS, else 0).
        attention_mask: 0/1 [B, L]; zeros mark left padding.
        callback: called after each new token as ``callback(step, tokens[B])``.
        cache: ``"auto"`` runs a recognised cache in place on a persistent
            state (nothing of cache size copied per token); ``"paged"`` does
            the same with a paged cache of ``block_size``-token pages (see
            :meth:`Session.new_state`); ``"tensor"`` threads it through the
            graph as tensors (past -> present).
        capacity: fixed cache capacity for the in-place path (None: grows).
        cache_dtype: on the in-place path, store the cache as ``"float16"`` or
            ``"bfloat16"`` (see :meth:`Session.new_state`).
        kv_format: with ``cache="paged"``, the page format policy (see
            :meth:`Session.new_state`: "int8", "int4", "residual-int4", ... or a selector).
        prefill_chunk: on the in-place path, a single unpadded prompt longer than
            this is fed in chunks of this many tokens (the same result with
            far smaller temporaries); None feeds it whole.

    Raises:
        InputError: bad arguments (the message names the argument and value).
    """
    api = "generate"
    max_new_tokens = int_arg(api, "max_new_tokens", max_new_tokens, 0)
    sampling = SamplingConfig(temperature, top_k, top_p, seed, api=api)
    callback_arg(api, "callback", callback)
    choice(api, "cache", cache, ("auto", "paged", "tensor"))
    capacity = optional_int(api, "capacity", capacity, 1)
    prefill_chunk = optional_int(api, "prefill_chunk", prefill_chunk, 1)
    if cache_dtype is not None:
        choice(api, "cache_dtype", cache_dtype, ("float32", "float16", "bfloat16"))
    block_size = int_arg(api, "block_size", block_size, 1)
    if kv_format is not None and cache != "paged":
        raise InputError(f"generate: kv_format={kv_format!r} needs cache='paged'")
    sess = as_session(api, "session_or_model", session_or_model, threads)
    model = sess.model
    vocab = sess.token_limit
    ids, mask, lengths = check_prompt(api, input_ids, attention_mask, vocab)
    eos = token_ids(api, "eos_token_id", eos_token_id, model.eos_token_id, vocab)
    if pad_token_id is None:
        pad_token_id = model.pad_token_id if model.pad_token_id is not None else (eos[0] if eos else 0)
    pad_token_id = token_id(api, "pad_token_id", pad_token_id, vocab)
    B, L = ids.shape
    if model.max_length is not None and L + max_new_tokens > model.max_length:
        raise InputError(f"generate: prompt length {L} + max_new_tokens {max_new_tokens} exceeds the model's "
                         f"max_length {model.max_length}")
    ids = np.where(mask == 1, ids, pad_token_id)

    if cache == "paged" and not sess.bindings:
        raise InputError("generate: cache='paged' needs a model with a recognised in-place cache; this model's is "
                         f"'{model.convention.kind}'")
    if cache_dtype is not None and (cache == "tensor" or not sess.bindings):
        raise InputError(f"generate: cache_dtype={cache_dtype!r} needs the in-place cache (cache='auto' or 'paged' "
                         "on a model with a recognised cache)")
    in_place = cache != "tensor" and bool(sess.bindings)
    chunked = in_place and prefill_chunk is not None and B == 1 and L > prefill_chunk
    first_len = int(prefill_chunk) if chunked else L
    builder = FeedBuilder(sess.plan.inputs, model, ids[:, :first_len], np.minimum(lengths, first_len),
                          int(pad_token_id), thread_cache=not in_place)
    if in_place:
        paged = {"cache": "paged", "block_size": block_size, "kv_format": kv_format} if cache == "paged" else {}
        state = sess.new_state(capacity=capacity, initial_capacity=max(32, L + min(max_new_tokens, 256)),
                               cache_dtype=cache_dtype, **paged)
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
        out = run(feeds, fetch)
        for c0 in range(first_len, L if chunked else 0, first_len):
            chunk = ids[:, c0:c0 + first_len]
            out = run(builder.next(chunk, out), fetch)
            read = np.array([chunk.shape[1] - 1])
        prefill = time.perf_counter() - t0
        for step in range(max_new_tokens):
            logits = out[model.io.logits]
            if logits.ndim == 3:
                logits = logits[np.arange(B), read if logits.shape[1] > 1 else 0]
            tok = select_next(logits, sampling)
            tok = np.where(finished, pad_token_id, tok)
            new_tokens.append(tok)
            if eos_arr.size:
                finished |= np.isin(tok, eos_arr)
            if callback is not None:
                callback(step, tok)
            if finished.all() or step == max_new_tokens - 1:
                break
            feeds = builder.next(tok, out)
            t0 = time.perf_counter()
            out = run(feeds, fetch)
            step_seconds.append(time.perf_counter() - t0)
    if state is not None:
        state.close()
    tokens = np.stack(new_tokens, axis=1) if new_tokens else np.zeros((B, 0), dtype=np.int64)
    return GenerationResult(np.concatenate([ids, tokens], axis=1), tokens, lengths, finished,
                            prefill, float(sum(step_seconds)), step_seconds)
