"""``onnxkv.Engine``: many generation requests over one session, joining and leaving between steps.

``engine.add_request(prompt_ids, ...)`` queues a request with its own
sampling, seed, EOS ids and token limit; each :meth:`Engine.step` advances
every unfinished request the budget admits by one run -- the next chunk of
its prompt, or one decode token -- within ``max_batch_tokens`` fed tokens per
step: first the prompts a step had to leave waiting, then every decode token,
then prompt chunks in arrival order while they fit (so no request waits more
than one step for its chunk).  A prompt is fed in chunks of ``Request.chunk``
tokens: the session's prompt chunk for the cache, at most ``max_batch_tokens``.
Requests finish on an EOS id, at their limit or by :meth:`Engine.abort`; their
state (contiguous caches or pages) is released at once.

Each request's tokens are those :func:`onnxkv.generate` makes for it alone
with ``prefill_chunk=request.chunk`` (the same feeds, sampling stream and
stopping rule; ``generate``'s default chunk when ``max_batch_tokens`` is at
least that): greedy requests token for token, sampled ones draw for draw with
the same seed.

This version runs the requests of a step one after the other, each on its own
state (a run per request: rows of different lengths are not yet batched into
one forward pass, and pages are not yet shared between requests);
:meth:`Engine.describe` says so.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxkv.engine.request import Request
from onnxkv.errors import InputError
from onnxkv.generate.arguments import check_prompt, int_arg, token_ids
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.generate.sampling import sampling_arguments, select_next
from onnxkv.runtime.cache_config import CacheConfig, cache_request
from onnxkv.runtime.prompt_chunk import prompt_chunk
from onnxkv.runtime.session import Session
from onnxkv.runtime.state import State

__all__ = ["Engine", "DEFAULT_MAX_BATCH_TOKENS"]

#: Fed tokens per step when the engine is not told (about two prompt chunks of a small model).
DEFAULT_MAX_BATCH_TOKENS = 2048
_KINDS = ("contiguous", "paged")


class Engine:
    """Continuous generation over one :class:`~onnxkv.Session` (see the module docstring).

    Args:
        session: the session every request runs on (its threads, event log and precision).
        cache: a :class:`~onnxkv.CacheConfig` or kind ("contiguous", "paged") for every request's state;
            None: contiguous.  The model must have a cache that runs in place.
        max_batch_tokens: tokens fed per step at most (an int >= 1), decode tokens and prompt chunks
            together.

    The engine is not thread-safe: one thread calls its methods.
    """

    def __init__(
        self, session: Session, cache: CacheConfig | str | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    ) -> None:
        api = "Engine"
        if not isinstance(session, Session):
            raise InputError(f"{api}: session must be an onnxkv.Session, got {type(session).__name__}")
        if not session.bindings:
            raise InputError(
                f"{api}: the model's cache does not run in place (convention "
                f"'{session.model.convention.kind}'); the engine keeps one state per request"
            )
        self.session = session
        self.max_batch_tokens = int_arg(api, "max_batch_tokens", max_batch_tokens, 1)
        self._cache = cache_request(api, cache, _KINDS, {}, auto=True)
        self.kind = self._cache.kind("contiguous")
        self._requests: list[Request] = []
        self.steps = 0

    @property
    def requests(self) -> list[Request]:
        """Every request added, in arrival order (finished ones included)."""
        return list(self._requests)

    @property
    def active(self) -> list[Request]:
        """The requests not finished, in arrival order."""
        return [r for r in self._requests if r.finished is None]

    def describe(self) -> dict:
        """How the engine runs: batching, cache kind, budget, and the requests it holds (each request's
        prompt chunk is ``Request.chunk``)."""
        return {
            "batching": "one run per request and step: rows of different lengths are not batched into one "
            "forward pass, and requests do not share prefix pages",
            "cache": self.kind,
            "max_batch_tokens": self.max_batch_tokens,
            "requests": len(self._requests),
            "active": len(self.active),
            "steps": self.steps,
        }

    def add_request(
        self,
        prompt_ids,
        max_new_tokens: int,
        *,
        do_sample: bool = False,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> Request:
        """Queue a request: ``prompt_ids`` int [L] or [1, L] (one sequence, no padding); the sampling
        arguments as :func:`onnxkv.generate` takes them; ``eos_token_id`` default: the model's.  It runs
        from the next :meth:`step` on.  Raises InputError naming a bad argument (nothing is queued)."""
        api = "Engine.add_request"
        sess, model = self.session, self.session.model
        max_new_tokens = int_arg(api, "max_new_tokens", max_new_tokens, 0)
        sampling = sampling_arguments(api, do_sample, temperature, top_k, top_p, seed)
        ids, _, _ = check_prompt(api, prompt_ids, None, sess.token_limit)
        if ids.shape[0] != 1:
            raise InputError(f"{api}: prompt_ids must be one sequence ([L] or [1, L]), got shape {ids.shape}")
        eos = token_ids(api, "eos_token_id", eos_token_id, model.eos_token_id, sess.token_limit)
        length = ids.shape[1]
        if model.max_length is not None and length + max_new_tokens > model.max_length:
            raise InputError(
                f"{api}: prompt length {length} + max_new_tokens {max_new_tokens} exceeds the model's "
                f"max_length {model.max_length}"
            )
        state_kw = self._cache.state_keywords(self.kind, initial_capacity=max(32, length + min(max_new_tokens, 256)))
        chunk = prompt_chunk(sess.plan.kernels, state_kw.get("block_size") if self.kind == "paged" else None)
        chunk = min(chunk, self.max_batch_tokens)
        pad = model.pad_token_id if model.pad_token_id is not None else (eos[0] if eos else 0)
        request = Request(self, len(self._requests), ids[0], max_new_tokens, sampling, eos, chunk, state_kw, pad)
        self._requests.append(request)
        return request

    def abort(self, request: Request) -> None:
        """Stop ``request`` now (``finished == "aborted"`` unless it had finished) and release its state."""
        if not isinstance(request, Request) or request.engine is not self:
            raise InputError(f"Engine.abort: expected a Request of this engine, got {request!r}")
        if request.finished is None:
            request._release("aborted")

    def step(self) -> dict[int, int]:
        """One run for every unfinished request the budget admits; returns {request id: id produced} for
        the requests that produced a token in this step.  A run that raises propagates: its request is as
        before that run, and the requests after it were not run in this step (step again to go on, or
        abort it)."""
        active = self.active
        decoding = [r for r in active if r.prompt_done >= r.prompt.size]
        waiting = [r for r in active if r.prompt_done < r.prompt.size]
        starved = [r for r in waiting if r._skipped]
        budget, chosen = self.max_batch_tokens, []
        for r in starved + decoding + [r for r in waiting if not r._skipped]:
            need = r.next_tokens
            r._skipped = need > budget
            if not r._skipped:
                chosen.append(r)
                budget -= need
        produced: dict[int, int] = {}
        for r in chosen:
            token = self._advance(r)
            if token is not None:
                produced[r.id] = token
        self.steps += 1
        events = self.session.events
        if events.enabled:
            events.record(
                self.session._step, "", "", "engine_step",
                extra={"requests": len(chosen), "tokens_fed": self.max_batch_tokens - budget,
                       "produced": len(produced), "active": len(self.active)},
            )  # fmt: skip
        return produced

    def run(self) -> list[Request]:
        """Step until every request has finished; returns every request in arrival order."""
        while self.active:
            self.step()
        return self.requests

    def _advance(self, r: Request) -> int | None:
        """Run ``r``'s next prompt chunk or decode step (as :func:`onnxkv.generate` runs them for one
        sequence); returns the id it produced, if any.  A run that raises leaves ``r`` as before it (its
        state unchanged, its feeds rewound; a first run's new state closed)."""
        model = self.session.model
        name = model.io.logits
        length = r.prompt.size
        if r._state is None:
            first = min(r.chunk, length)
            builder = FeedBuilder(
                self.session.plan.inputs, model, r.prompt[None, :first], np.array([first]), r.pad_id,
                thread_cache=False,
            )  # fmt: skip
            state = State(self.session, **r._state_kw)
            feeds, read = builder.first()
            try:
                r._out = state.run(feeds, [name] if first >= length else [])
            except BaseException:
                state.close()
                raise
            r._state, r._builder, r.prompt_done, read_at = state, builder, first, read
        else:
            fed = r._builder.total
            decoding = r.prompt_done >= length
            tokens = np.array([r.tokens[-1]]) if decoding else r.prompt[None, r.prompt_done : r.prompt_done + r.chunk]
            last = decoding or r.prompt_done + tokens.shape[-1] >= length
            try:
                r._out = r._state.run(r._builder.next(tokens, r._out), [name] if last else [])
            except BaseException:
                r._builder.rewind(fed)
                raise
            read_at = None if decoding else np.array([tokens.shape[1] - 1])
            if not decoding:
                r.prompt_done += tokens.shape[1]
        if r.prompt_done < length:
            return None
        logits = r._out[name]
        if logits.ndim == 3:
            logits = logits[np.arange(1), read_at if read_at is not None and logits.shape[1] > 1 else 0]
        token = int(select_next(logits, r.sampling)[0])
        r.tokens.append(token)
        if token in r.eos:
            r._release("eos")
        elif len(r.tokens) >= r.max_new_tokens:
            r._release("length")
        return token
