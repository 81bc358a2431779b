"""One batched forward per step: every decode row and every admitted prompt chunk of an
:class:`~onnxkv.engine.engine.Engine` in a single run of segments.

A mixin of Engine, used when the engine batches (paged caches over one pool) and its session's model takes
segments (:attr:`Session.takes_segments <onnxkv.runtime.session.Session.takes_segments>`: the ONNX Runtime
GenAI builder's GroupQueryAttention graphs, and opset-23 Attention graphs whose mask the graph builds).  A step with more than one thing to run (decode rows and a
prompt chunk, or the chunks of several prompts) moves the prompts' rows into the batched state after the
decode rows (a prompt's first chunk gets an empty row: :meth:`State.append_empty_rows`), and runs them all
at once (:meth:`State.run` with ``segments``): the token axis holds one token per decode row, then each
prompt's chunk, each row continuing at its own length over its own page table, and the LM head computes
only the rows that choose a token (the last token of each decode row and of each prompt's last chunk).
The weights are read once per step instead of once per run.

After the run, a prompt with chunks left goes back to a state of its own (its row forked out of the batch,
no payload copied); a prompt whose last chunk ran keeps its row and decodes from the next step, as the
separate runs would have it.  The tokens are those of the separate runs: every node but attention acts
on each token alone, and attention computes each row as alone (tests/engine compares with ``generate``).

A step whose run would need more pages than the pool has free (counted before it starts) makes its
separate runs instead, which make room (:mod:`onnxkv.engine.batched`) or name the request that does not
fit; so does a run that raises OutOfMemory anyway (pages copied on write) or passes a cache's fixed
capacity, after leaving everything as before it.  A model whose logits are not one row per token (a graph
that computes the last position only), or whose attention refuses the run (:class:`~onnxkv.errors.
SegmentsRefused`: an Attention graph whose mask is not causal attention over the run's tokens), is found at
its first such run, which is undone: the engine then runs its steps one by one, and ``describe()`` says
why.  Any other error propagates with every request as before the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from onnxkv.engine.request import Request, choose_tokens
from onnxkv.errors import CacheCapacityError, OutOfMemory, SegmentsRefused
from onnxkv.runtime.state import State

if TYPE_CHECKING:
    from onnxkv.engine.prefix import PrefixCache
    from onnxkv.runtime.session import Session

__all__ = ["SegmentSteps"]


class _NotPerToken(Exception):
    """The logits of a run of segments are not one row per token (a graph that computes some positions
    only): the engine makes this model's steps one run at a time from then on."""


class SegmentSteps:
    """The single-run steps of :class:`~onnxkv.engine.engine.Engine` (module docstring)."""

    session: Session
    _batch: State | None
    _rows: list[Request]
    _prefix: PrefixCache | None
    _runs: int
    _segmented: bool
    _unsegmented: str | None
    _decode_segments: bool
    _free_pages: Callable[[], int | None]

    def _segment_step(self, decode_rows: bool, chosen: list[Request]) -> dict[int, int] | None:
        """Run the decode rows (when ``decode_rows``) and the prompt chunks of ``chosen`` as one run of
        segments; returns {request id: id produced}, or None with nothing changed when the step should make
        its separate runs instead (fewer than two things to run, unless the decode rows batch only in runs
        of segments, or the run did not fit)."""
        prompts = [r for r in chosen if r.prompt_done < r._seq.size]
        rows = list(self._rows) if decode_rows else []
        alone = len(prompts) + (1 if rows else 0) < 2 and not (rows and self._decode_segments)
        if alone or len(prompts) != len(chosen):
            return None
        batch, n_rows = self._batch, len(self._rows)
        chunks = [r._seq[r.prompt_done : r.prompt_done + r.next_tokens] for r in prompts]
        if not self._segments_fit(rows, prompts, chunks):
            return None
        had_state = [r._state is not None for r in prompts]
        for r in prompts:  # their rows after the decode rows
            if r._state is not None:
                batch.append_rows(r._state)
                r._state = None
            else:
                batch.append_empty_rows(1)
        counts = np.array([1 if decode_rows else 0] * n_rows + [c.size for c in chunks], np.int64)
        tokens = np.concatenate([np.array([r.tokens[-1] for r in rows], np.int64), *chunks])
        ends = np.cumsum(counts) - 1  # each row's last token on the axis
        last = [r.prompt_done + c.size >= r._seq.size for r, c in zip(prompts, chunks, strict=True)]
        takers = [(i, r) for i, r in enumerate(rows)] + [
            (n_rows + j, r) for j, r in enumerate(prompts) if last[j] and not r._resuming
        ]
        name = self.session.model.io.logits
        chosen_ids: list[int] = []

        def choice(out: dict) -> None:  # before the run is committed: if it raises, the run is undone
            if takers:
                logits = out[name]
                if logits.ndim != 3 or logits.shape[:2] != (1, len(takers)):
                    raise _NotPerToken(logits.shape)
                chosen_ids[:] = choose_tokens([r for _, r in takers], logits[0])

        starts = batch.lengths
        positions = (
            starts[np.repeat(np.arange(counts.size), counts)]
            + np.arange(tokens.size)
            - np.repeat(ends + 1 - counts, counts)
        )
        feeds = self._flat_feeds(tokens, positions)
        at = np.array([[ends[i] for i, _ in takers]], np.int64) if takers else None
        try:
            self._runs += 1
            batch.run(feeds, [name] if takers else [], logits_at=at, before_commit=choice, segments=counts)
        except BaseException as e:
            for j, r in enumerate(prompts):  # the prompts' rows back where they were
                if had_state[j]:
                    r._state = self._row_out(n_rows + j)
            batch.keep_rows(list(range(n_rows)))
            if isinstance(e, (_NotPerToken, SegmentsRefused)):  # this model's steps run one by one from now on
                self._segmented = False
                self._unsegmented = "its logits are not one row per token" if isinstance(e, _NotPerToken) else str(e)
                return None
            if isinstance(e, (OutOfMemory, CacheCapacityError)):
                return None
            raise
        return self._after_segments(
            rows, prompts, chunks, last, n_rows, dict(zip((r.id for _, r in takers), chosen_ids))
        )

    def _segments_fit(self, rows: list[Request], prompts: list[Request], chunks: list) -> bool:
        """Whether the pages a run of segments adds (a page per row crossing into a new block; shared
        pages copied on write not counted) fit the pool's free pages and bytes, the prefix cache's
        unreferenced pages counted free.  When not, the step makes its runs one by one at once (they make
        room), instead of a run that would fail at its first cache write."""
        free = self._free_pages()
        if free is None:
            return True
        bs = self._batch.pool.block_size
        need = sum(1 for r in rows if r._cached % bs == 0)
        for r, chunk in zip(prompts, chunks, strict=True):
            done = r.prompt_done
            need += -(-(done + chunk.size) // bs) - -(-done // bs)
        return need <= free

    def _after_segments(
        self, rows: list[Request], prompts: list[Request], chunks: list, last: list[bool], n_rows: int, ids: dict
    ) -> dict[int, int]:
        """The requests' bookkeeping after a committed run of segments (see :meth:`_segment_step`)."""
        batch = self._batch
        tables = batch.page_tables
        produced: dict[int, int] = {}
        keep = list(range(n_rows))
        finished: list[Request] = []
        for r in rows:
            produced[r.id] = ids[r.id]
            r.finished = r._take(ids[r.id])
            r._cached += 1
            if r.finished is not None:
                finished.append(r)
        joined: list[Request] = []
        for j, (r, chunk) in enumerate(zip(prompts, chunks, strict=True)):
            i = n_rows + j
            if r.prompt_done == 0 and r._builder is None:  # its first chunk: the builder generate would make
                r._builder = r._feeds(chunk[None])
                r._builder.first()
            else:
                r._builder.next(chunk[None], None)
            r.prompt_done += chunk.size
            r._out = None
            if not last[j]:  # chunks left: its row back to a state of its own
                self._cache_prompt(r, tables[i], r.prompt_done)
                r._state = self._row_out(i)
                continue
            self._cache_prompt(r, tables[i])
            r._cached, r._keys = r._seq.size, None
            if r._resuming:  # a paused request: its next token is the one it had made
                r._resuming = False
            else:
                produced[r.id] = ids[r.id]
                r.finished = r._take(ids[r.id])
                if r.finished is not None:  # its row goes with the others not kept
                    finished.append(r)
                    continue
            keep.append(i)
            joined.append(r)
        gone = {id(r) for r in finished}
        kept = [i for i in keep if i >= n_rows or id(self._rows[i]) not in gone]
        self._rows = [self._rows[i] for i in kept if i < n_rows] + joined
        batch.keep_rows(kept)
        for r in finished:
            r._builder = r._out = r._keys = None
        return produced

    def _row_out(self, i: int) -> State:
        """A state of its own holding row ``i`` of the batched state (its pages shared by reference; the
        batch drops the row when it keeps the others)."""
        (own,) = self._batch.fork(1)
        own.keep_rows([i])
        return own

    def _flat_feeds(self, tokens: np.ndarray, positions: np.ndarray) -> dict:
        """The feeds of a run of segments: token ids [1, T], an attention mask of ones [1, T] (the graph's
        lengths of one row of T tokens, which the attention of a run of segments does not read) and, when
        the model takes them, the tokens' positions [1, T]."""
        io, dtypes = self.session.model.io, {g.name: g.dtype for g in self.session.plan.inputs}
        feeds = {io.input_ids: tokens[None].astype(dtypes[io.input_ids])}
        if io.attention_mask:
            feeds[io.attention_mask] = np.ones((1, tokens.size), dtypes[io.attention_mask])
        if io.position_ids:
            feeds[io.position_ids] = positions[None].astype(dtypes[io.position_ids])
        return feeds
