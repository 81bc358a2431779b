"""One request of an :class:`~onnxkv.engine.engine.Engine`: its prompt, sampling, limits, state and tokens.

A request is made by :meth:`Engine.add_request` and advanced only by the
engine's steps.  Its fields are read-only to the caller; ``tokens`` grows by
one id per decode step, and ``stream()`` yields each new id as it is made,
stepping the engine when it has nothing new.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from onnxkv.generate.feeds import FeedBuilder
from onnxkv.generate.sampling import SamplingConfig, select_next
from onnxkv.runtime.state import State
from onnxkv.runtime.state_paged import conversion_lengths

if TYPE_CHECKING:
    from onnxkv.engine.engine import Engine

__all__ = ["Request", "choose_tokens"]


class Request:
    """A generation request (see the module docstring).

    Attributes:
        id: the engine's number for it (0, 1, ... in arrival order).
        prompt: int64 [L] prompt ids.
        max_new_tokens: most tokens it produces.
        eos: ids that end it (the EOS id itself is its last token).
        tokens: the ids produced so far (a list of ints).
        chunk: prompt tokens per run (the session's prompt chunk for the request's cache, as ``generate``).
        prompt_done: prompt tokens already run (or taken from the prefix cache).
        prefix_hit_tokens: prompt tokens whose cached pages it took instead of running them.
        preemptions: times it was paused to make room in the page pool (it then ran its prompt and
            tokens again).
        finished: None while it runs, else why it stopped: "eos", "length" or "aborted".
    """

    def __init__(
        self,
        engine: Engine,
        rid: int,
        prompt: np.ndarray,
        max_new_tokens: int,
        sampling: SamplingConfig,
        eos: list[int],
        chunk: int,
        state_kw: dict,
        pad_id: int,
    ) -> None:
        self.engine = engine
        self.id = rid
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.eos = eos
        self.chunk = chunk
        self.pad_id = pad_id
        self.tokens: list[int] = []
        self.prompt_done = 0
        self.finished: str | None = None if max_new_tokens > 0 else "length"
        self._state_kw = state_kw
        self._state: State | None = None
        self._builder: FeedBuilder | None = None
        self._out: dict | None = None
        self.prefix_hit_tokens = 0
        self.preemptions = 0
        self._seq = prompt  # the ids it runs before decoding: its prompt; after a pause, its tokens too
        self._resuming = False  # paused after a token: the run of _seq makes none
        self._lookup = False  # paused: look its prefix up when the next step starts
        self._cached = 0  # batched decode rows: tokens its row holds in the batched state
        self._read = 0  # tokens stream() has yielded
        self._skipped = False  # its prompt chunk did not fit the last step's budget: first in the next
        self._keys: tuple | None = None  # prefix caching: (_seq, the keys of its full pages before its last id)
        self._converted = False  # pages of its row were converted to make room: it caches no prefix pages

    def __repr__(self) -> str:
        status = self.finished or ("prompt" if self.prompt_done < self._seq.size else "decoding")
        return f"Request(id={self.id}, prompt={self.prompt.size} tokens, new={len(self.tokens)}, {status})"

    @property
    def state(self) -> State | None:
        """The state holding the request's cache while it runs: its own, or the engine's batched state
        once its decode row joined it (one row among others); None before its first run and once finished."""
        if self._state is None and self.finished is None and self in self.engine._rows:
            return self.engine._batch
        return self._state

    @property
    def next_tokens(self) -> int:
        """Tokens its next run feeds: its next prompt chunk, or 1 while decoding (0 when finished).

        Over pages a ``kv_format`` converts (the engine's conversion cycle), a run ends where the runs of
        :func:`onnxkv.generate` alone end, since a token reads the pages converted before its run: its
        prompt in chunks counted from the prompt's start, then (a paused request) the tokens it had made
        in runs ending at each length where a page falls due (``State.conversion_cycle``), as its
        single-token runs did, and never wider than its chunk (so within every step's budget).
        """
        if self.finished is not None:
            return 0
        done, size = self.prompt_done, self._seq.size
        if done >= size:
            return 1
        cycle = self.engine._conversion_cycle
        if cycle is None:
            return min(self.chunk, size - done)
        if done < self.prompt.size:
            return min((done // self.chunk + 1) * self.chunk, self.prompt.size) - done
        return min(self.chunk, next(iter(conversion_lengths(cycle, done, size)), size) - done)

    def _take(self, token: int) -> str | None:
        """Append ``token`` (chosen by :func:`choose_tokens`) and say why it stops there ("eos",
        "length") or None; the caller finishes it."""
        self.tokens.append(token)
        return "eos" if token in self.eos else "length" if len(self.tokens) >= self.max_new_tokens else None

    def _feeds(self, ids: np.ndarray) -> FeedBuilder:
        """A builder of its feeds over its engine's session, ``ids`` [B, L] its first tokens (every row
        whole; the state supplies the cache)."""
        plan, model = self.engine.session.plan, self.engine.session.model
        return FeedBuilder(
            plan.inputs, model, ids, np.full(ids.shape[0], ids.shape[1]), self.pad_id, thread_cache=False
        )

    def stream(self) -> Iterator[int]:
        """Yield every id of this request in order as it is produced, stepping the engine (and so every
        other request with it) while this one has nothing new; ends when the request finishes."""
        while True:
            while self._read < len(self.tokens):
                self._read += 1
                yield self.tokens[self._read - 1]
            if self.finished is not None:
                return
            self.engine.step()

    def _release(self, reason: str) -> None:
        """Finish with ``reason`` and close the state (its caches or pages go back)."""
        self.finished = reason
        if self._state is not None:
            self._state.close()
        self._state = self._builder = self._out = self._keys = None


def choose_tokens(requests: list[Request], logits: np.ndarray) -> list[int]:
    """The next id of each of ``requests`` from its row of ``logits`` [N, V], each with its own sampling:
    all or none.  A choice that raises (a sampling kernel's MemoryError) puts every request's random
    stream back where it was, so the engine can leave the requests as before the run that made the
    logits and make it again."""
    streams = [r.sampling.rng.bit_generator.state for r in requests if not r.sampling.greedy]
    try:
        return [int(select_next(logits[i : i + 1], r.sampling)[0]) for i, r in enumerate(requests)]
    except BaseException:
        for r, state in zip((r for r in requests if not r.sampling.greedy), streams, strict=True):
            r.sampling.rng.bit_generator.state = state
        raise
