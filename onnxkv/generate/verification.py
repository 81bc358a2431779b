"""The target and draft sequences of :func:`onnxkv.speculative_generate`: one model's state and feeds
(:class:`Stepper`), and the target's logits over a proposal, run in the pieces page conversions ask for
(:class:`Verification`)."""

from __future__ import annotations

import numpy as np

from onnxkv.errors import InputError
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.runtime.prompt_chunk import prompt_chunk
from onnxkv.runtime.state import State
from onnxkv.runtime.state_paged import conversion_lengths

__all__ = ["Stepper", "Verification", "logit_rows"]


def logit_rows(out: dict, sess, count: int, role: str) -> np.ndarray:
    """The last ``count`` positions' logits of a batch-1 run as float [count, V]."""
    x = out[sess.model.io.logits]
    if x.ndim == 2:
        x = x[:, None, :]
    if x.shape[1] < count:
        raise InputError(
            f"speculative_generate: the {role} model returned logits for {x.shape[1]} position(s) of a "
            f"{count}-token run; verification needs the logits of every fed position"
        )
    return x[0, x.shape[1] - count :]


class Stepper:
    """One model's state, feed builder and run counter for a batch-1 sequence."""

    def __init__(self, sess, prompt: np.ndarray, state_keywords: dict, role: str, rollback: int) -> None:
        """``rollback``: the positions one step may take back (kept behind a sliding window, and the page
        conversions of a ``kv_format`` deferred to the next run: :meth:`State.keep_for_truncate`)."""
        self.sess = sess
        self.role = role
        self.state = State(sess, **state_keywords)
        if self.state.paged:
            self.state.keep_for_truncate(rollback)
        #: (block size, residual tokens) of the page conversions; runs end where one falls due
        self.cycle = self.state.conversion_cycle
        # a prompt runs in the chunks generate feeds it in where pages convert between the runs
        chunk = prompt.shape[1] if self.cycle is None else prompt_chunk(sess.plan.kernels, self.cycle[0])
        self.prompt = prompt
        self.builder = FeedBuilder(
            sess.plan.inputs,
            sess.model,
            prompt[:, :chunk],
            np.array([min(chunk, prompt.shape[1])]),
            0,
            thread_cache=False,
        )
        self.fetch = [sess.model.io.logits]
        self.runs = 0

    @property
    def length(self) -> int:
        return self.builder.total

    def prefill(self) -> dict:
        """Run the prompt (in chunks, as :func:`onnxkv.generate` does, where pages convert between runs); its
        logits at the last token only ([1, 1, V], ``logits_at``)."""
        feeds, read = self.builder.first()
        chunk = self.builder.total
        while self.builder.total < self.prompt.shape[1]:
            self.runs += 1
            self.state.run(feeds, [])  # a chunk before the last: its cache writes only
            part = self.prompt[:, self.builder.total : self.builder.total + chunk]
            feeds, read = self.builder.next(part, None), np.array([part.shape[1] - 1])
        self.runs += 1
        return self.state.run(feeds, self.fetch, logits_at=read)

    def pieces(self, count: int) -> list[int]:
        """Sizes of the runs that feed ``count`` tokens after the cached ones: one run, or, where pages convert
        (:attr:`State.conversion_cycle`), runs that end wherever a conversion falls due, so each token sees
        the pages in the formats its own run would."""
        if self.cycle is None:
            return [count]
        start = self.length
        return np.diff([start, *conversion_lengths(self.cycle, start, start + count), start + count]).tolist()

    def feed(self, tokens: np.ndarray) -> dict:
        """Run ``tokens`` (int64 [S]) after the cached positions."""
        self.runs += 1
        return self.state.run(self.builder.next(tokens[None, :], None), self.fetch)

    def greedy(self, token: int, count: int, eos: set[int]) -> list[int]:
        """Feed ``token`` and then each chosen id: ``count`` greedy steps (fewer after an EOS); the ids chosen.

        Steps run as one call into C where the state can (:meth:`State.decode_steps`), else one by one.
        """
        names = self.builder.decode_names
        chosen: list[int] = []
        while len(chosen) < count:
            feeds = self.builder.next(np.array([[token]], dtype=np.int64), None)
            run = None if names is None else self.state.decode_steps(feeds, count - len(chosen), names, sorted(eos))
            if run is not None and run.steps:
                self.runs += run.steps
                if run.steps > 1:  # fed by the steps after the first: every chosen id but the last
                    self.builder.next(run.tokens[None, :-1], None)
                chosen.extend(run.tokens.tolist())
            else:
                self.runs += 1
                chosen.append(int(np.argmax(logit_rows(self.state.run(feeds, self.fetch), self.sess, 1, self.role)[0])))
            token = chosen[-1]
            if token in eos:
                break
        return chosen

    def fork(self, rows: int) -> None:
        """Make ``rows`` copies of the sequence (page tables shared: a paged state)."""
        self.state.reorder(np.zeros(rows, dtype=np.int64))
        self.builder.select_rows(np.zeros(rows, dtype=np.int64))

    def keep(self, row: int) -> None:
        """Keep only row ``row`` of a forked sequence."""
        self.state.reorder(np.array([row], dtype=np.int64))
        self.builder.select_rows(np.array([row], dtype=np.int64))

    def truncate(self, length: int) -> None:
        """Keep at most the first ``length`` positions (cache and feed bookkeeping)."""
        if length < self.length:
            self.state.truncate(length)
            self.builder.rewind(length)


class Verification:
    """The target's logits after each token of ``chunk`` (int64 [S], fed after the cached positions), row
    ``i`` read as ``self[i]`` (float [V]).  The runs that feed the chunk (:meth:`Stepper.pieces`) are made
    as rows are first read, so a proposal rejected before a page conversion falls due never runs past it:
    the truncate that follows then finds the pages as token-by-token runs would have left them."""

    def __init__(self, tgt: Stepper, sess, chunk: np.ndarray) -> None:
        self.tgt, self.sess, self.chunk = tgt, sess, chunk
        self.sizes = tgt.pieces(chunk.shape[0])
        self.rows: list[np.ndarray] = []

    def __getitem__(self, i: int) -> np.ndarray:
        while i >= len(self.rows):
            fed, size = len(self.rows), self.sizes.pop(0)
            self.rows.extend(logit_rows(self.tgt.feed(self.chunk[fed : fed + size]), self.sess, size, "target"))
        return self.rows[i]
