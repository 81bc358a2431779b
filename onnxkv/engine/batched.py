"""The batched steps of an :class:`~onnxkv.engine.engine.Engine`: one page pool, decode rows of every
request in one state, grouped prompt chunks, the prefix cache, and preemption.

A mixin of Engine (its base class), used only when ``Engine.batched`` (paged caches on a
GroupQueryAttention or Attention graph; see the engine module).

Memory.  A run that finds the pool full (``max_pages`` ids, or ``max_cache_bytes`` of payload) is made
again after room is made, in this order:

1. the prefix cache's unreferenced pages are evicted, least recently used first;
2. under a byte budget, the cold pages (all but the last ``keep_native_tokens`` positions) of the
   latest-arriving requests are converted to the next of ``preempt_formats`` (every candidate to int8
   before any to int4; pages shared with other requests are left alone, and the prefix cache first lets
   go of the pages it holds with that request alone: ``prefix_evict``): event ``preempt_quantize``;
3. the latest-arriving request holding pages is paused: its row or state goes (unshared pages back to
   the pool), and it waits to run its prompt and the tokens it had made again (``Request.preemptions``;
   event ``preempt``), from what the prefix cache still holds, before it decodes on with the same
   sampling stream;
4. the prefix cache lets go of the pages it holds with the run's state alone (``prefix_evict``):
   the run's ``kv_format`` conversion (part of the run) then converts them in place, where it would
   have needed a free page to copy each into.

Only requests that arrived after the ones a run is for are converted or paused (the decode run keeps its
earliest row), so the earliest request always progresses; a prompt run that finds the pool held by
earlier requests waits for a later step.  A run that does not fit with every other request paused
raises OutOfMemory.  Converted pages change a request's logits a little (int8 pages kept greedy tokens
equal on the tests' model; int4 may not); pauses do not change its tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from onnxkv.engine.prefix import PrefixCache
from onnxkv.engine.request import Request, choose_tokens
from onnxkv.errors import OutOfMemory
from onnxkv.runtime.state import Draws, State

if TYPE_CHECKING:
    from onnxkv.runtime.session import Session

__all__ = ["BatchedSteps", "WaitForRoom"]


class WaitForRoom(OutOfMemory):
    """A prompt run found the pool full of earlier requests' pages: its requests wait (internal to a step)."""


class BatchedSteps:
    """The batched steps of :class:`~onnxkv.engine.engine.Engine` (module docstring)."""

    session: Session
    max_batch_tokens: int
    batched: bool
    _batch: State | None
    _rows: list[Request]
    _loop_short: list[int]
    _prefix: PrefixCache | None
    preempt_formats: tuple[str, ...]
    _conversion_cycle: tuple[int, int] | None
    _paused_now: set[Request]
    _runs: int
    keep_native_tokens: int

    def _prompt_keys(self, r: Request) -> list[bytes]:
        """The prefix-cache keys of ``r``'s full pages before its last id (the tokens it runs before
        decoding), computed once per sequence."""
        if r._keys is None or r._keys[0] is not r._seq:
            r._keys = (r._seq, self._prefix.keys(r._seq[: r._seq.size - 1]))
        return r._keys[1]

    def _start_on_prefix(self, r: Request, again: bool = False) -> None:
        """Batched with prefix caching: give ``r`` the cached pages of the longest prefix of the tokens it
        must run (its prompt; after a pause, its tokens too), whole pages before the last one, and a state
        that continues after them.  ``again``: a request that waited for another's prompt pages looks up
        once more (logged only when it finds some).  Not while the started requests fill
        ``max_batch_tokens``: a state makes a decode row, and a step runs its decode rows only together."""
        if not (self.batched and self.prefix_caching) or self._prefix is None or not self._room_for_row():
            return
        prefix = self._prefix
        hits = prefix.lookup(self._prompt_keys(r))
        hits = hits[: self._exact_pages(r, hits)]
        events = self.session.events
        if events.enabled and (hits or not again):
            events.record(
                self.session._step, "", "", "prefix_lookup",
                extra={"request": r.id, "prefix_hit_tokens": len(hits) * prefix.block_size,
                       "prefix_cached_pages": len(prefix)},
            )  # fmt: skip
        if not hits:
            return
        done = len(hits) * prefix.block_size
        state = self._batch.sibling()
        state.start_on_pages(np.array(hits, np.int32), done)
        builder = r._feeds(r._seq[None, :done])
        builder.first()  # its bookkeeping of the cached tokens; they are not run
        r._state, r._builder, r.prompt_done, r.prefix_hit_tokens = state, builder, done, done

    def _exact_pages(self, r: Request, hits: list[int]) -> int:
        """How many of the cached pages ``hits`` (``r``'s first blocks) ``r`` takes: all, or over pages a
        ``kv_format`` converts, the most after which ``r`` goes on as :func:`onnxkv.generate` alone would:
        at a length where one of its runs ends (a multiple of its chunk within its prompt, or any length
        past it: Request.next_tokens), over pages in the formats its state holds there (converted before
        that length less the residual tokens, native after).  A page cached at another point of a prompt
        would give the tokens after it other values."""
        if self._conversion_cycle is None or not hits:
            return len(hits)
        block, residual = self._conversion_cycle
        native = self._batch.pool.native_pages(np.array(hits, np.int64))
        for n in range(len(hits), 0, -1):
            length = n * block
            due = max(0, (length - residual) // block)
            if (length >= r.prompt.size or length % r.chunk == 0) and not native[:due].any() and native[due:n].all():
                return n
        return 0

    def _pending_keys(self) -> set[bytes]:
        """Keys of the prompt pages that requests running their prompts now will cache (batched, prefix
        caching): a request not started whose next page is among them waits for them (:meth:`_shares`)."""
        if self._prefix is None:
            return set()
        out: set[bytes] = set()
        for r in self.active:
            if r._state is not None and r.prompt_done < r._seq.size:
                out.update(self._prompt_keys(r)[r.prompt_done // self._prefix.block_size :])
        return out

    def _shares(self, r: Request, pending: set[bytes]) -> bool:
        """Whether ``r`` (not started) waits for prompt pages another request is computing now: its first
        uncached page's key is in ``pending``.  It then takes them from the cache a step or more later
        instead of computing and holding them again (prompts sharing a prefix that arrive together compute
        and store it once)."""
        if self._prefix is None:
            return False
        keys = self._prompt_keys(r)
        n = self._prefix.cached_run(keys)
        return n < len(keys) and keys[n] in pending

    def _groups(self, chosen: list[Request]) -> list[list[Request]]:
        """``chosen`` in runs: batched, the last prompt chunks of requests at one position, of one length and
        alike in having a state (prefix hits) or not, run together (one run of their rows); the others
        alone.  In the order of their first request."""
        groups: dict[object, list[Request]] = {}
        for r in chosen:
            n = r.next_tokens
            last = r.prompt_done < r._seq.size and r.prompt_done + n == r._seq.size
            key = (r.prompt_done, n, r._state is None) if self.batched and last else r.id
            groups.setdefault(key, []).append(r)
        return list(groups.values())

    def _advance_group(self, group: list[Request]) -> dict[int, int]:
        """Batched: the last prompt chunks of ``group`` (one position, one length) as one run of
        ``len(group)`` rows, then each row's first token and its move into the batched state.  A run that
        raises, or whose token choice raises, leaves every request of the group as before it."""
        model = self.session.model
        name, done = model.io.logits, group[0].prompt_done
        tokens = np.stack([r._seq[done:] for r in group])
        at = np.full(len(group), tokens.shape[1] - 1)  # each row's logits at its last token only
        taking = [i for i, r in enumerate(group) if not r._resuming]  # a paused request had made its token

        chosen: list[int] = []

        def choice(out: dict) -> None:  # before the run is committed: if it raises, the run is undone
            logits = out[name]
            logits = logits[:, -1] if logits.ndim == 3 else logits
            chosen.extend(choose_tokens([group[i] for i in taking], logits[taking]))

        if done == 0:
            builder = group[0]._feeds(tokens)
            feeds, _ = builder.first()
            state = self._new_state(group[0])
            try:
                self._run(state, feeds, [name], group, at, choice)
            except BaseException:
                state.close()
                raise
        else:  # prefix hits: their states' rows into one state for the run
            builder = group[0]._builder
            state = self._batch.sibling()
            for r in group:
                state.append_rows(r._state)
            try:
                self._run(state, builder.ragged(tokens, np.full(len(group), done)), [name], group, at, choice)
            except BaseException:
                for i, (r, own) in enumerate(zip(group, state.fork(len(group)), strict=True)):
                    own.keep_rows([i])
                    r._state = own
                state.close()
                raise
        tokens_of = dict(zip(taking, chosen, strict=True))
        produced, keep = {}, []
        tables = state.page_tables
        for i, r in enumerate(group):
            self._cache_prompt(r, tables[i])
            r.prompt_done = r._cached = r._seq.size
            r._builder, r._state, r._out, r._keys = builder, None, None, None
            if r._resuming:  # a paused request: its next token is the one it had made
                r._resuming = False
                keep.append(i)
                continue
            produced[r.id] = tokens_of[i]
            r.finished = r._take(tokens_of[i])
            if r.finished is None:
                keep.append(i)
        if keep:
            if len(keep) < len(group):
                state.keep_rows(keep)
            self._batch.append_rows(state)
            self._rows.extend(group[i] for i in keep)
        else:
            state.close()
        return produced

    def _room_for_row(self, admitted: int = 0) -> bool:
        """Batched: whether a new prompt may start, after ``admitted`` new prompts this step (every started
        request will hold a decode row, and the decode rows of a step must fit ``max_batch_tokens``: more
        rows than that would never run again)."""
        if not self.batched:
            return True
        started = sum(1 for r in self.active if r._state is not None or r in self._rows)
        return started + admitted < self.max_batch_tokens

    def _prompt_pages(self, r: Request) -> int:
        """Batched: pages ``r``'s next prompt chunk writes (0 before the pool exists)."""
        return -(-r.next_tokens // self._batch.pool.block_size) if self.batched and self._batch is not None else 0

    def _room_for_prompt(self, r: Request, starting: int = 0) -> bool:
        """Batched: whether ``r``'s first prompt chunk may start now, after prompts of ``starting`` pages
        admitted before it in this step: the pool has room for all of them and a page for every decode row
        besides (free ids and bytes, the prefix cache's unreferenced pages counted free), or holds no
        request and nothing was admitted yet.  Starting it on less would pause others (thrashing), or make
        a run of several prompts' last chunks that does not fit together."""
        if not self.batched or self._batch is None:
            return True
        free = self._free_pages()
        if free is None or (not self._holders() and not starting):
            return True
        return free >= starting + self._prompt_pages(r) + len(self._rows)

    def _free_pages(self) -> int | None:
        """Batched: pages the pool can still hand out (free ids and bytes, the prefix cache's unreferenced
        pages counted free), or None when it is bounded by neither."""
        pool = self._batch.pool
        free = []
        if pool.max_pages is not None:
            free.append(pool.max_pages - pool.live_pages)
        if pool.max_bytes is not None:
            free.append((pool.max_bytes - pool.committed_bytes) // pool.page_bytes)
        if not free:
            return None
        return min(free) + (self._prefix.unreferenced() if self._prefix is not None else 0)

    def _decode_batch(self) -> dict[int, int]:
        """Batched: one run of every decode row; each row's token chosen with its request's sampling.  When
        the pool is full: the prefix cache's unreferenced pages go first, then the latest request (its row,
        or another's own state) is paused, and the run is made again over the rows left."""
        name = self.session.model.io.logits
        chosen: list[int] = []

        def choice(out: dict) -> None:  # before the run is committed: if it raises, the run is undone
            logits = out[name]
            chosen[:] = choose_tokens(rows, logits[:, -1] if logits.ndim == 3 else logits)

        while True:
            rows = self._rows
            tokens = np.array([r.tokens[-1] for r in rows])
            lengths = np.array([r._cached for r in rows])
            try:
                self._runs += 1
                feeds = rows[0]._builder.ragged(tokens, lengths)
                self._batch.run(feeds, [name], before_commit=choice, gaps_padding=True)
                break
            except OutOfMemory:
                if not self._make_room([min(rows, key=lambda r: r.id)], state=self._batch):  # the earliest goes on
                    raise
                if not self._rows:
                    return {}
        produced, done = {}, []
        for r, token in zip(rows, chosen, strict=True):
            produced[r.id] = token
            r.finished = r._take(token)
            r._cached += 1
            if r.finished is not None:
                done.append(r)
        if done:
            self._drop_rows(done)
        return produced

    def _decode_loop(self) -> int:
        """Batched, from :meth:`Engine.run`: when every active request is a decode row, the decode steps up
        to the fewest tokens a row has left run in C (:meth:`State.decode_steps`, one call), each row ending
        at its own end ids, a greedy row taking its argmax and a sampled row drawing with its own
        temperature, ``top_k`` and ``top_p`` from its own random stream as :func:`choose_tokens` does one
        step at a time (the streams then stand where those steps leave them).  A row that ends (an end id)
        is fed the pad id until the others end or the steps are done, then leaves as after a step.  Returns
        the steps that ran; 0 (nothing run or changed) when the rows do not qualify or the state cannot run
        them so (the event log on, pages to convert, a full pool: :meth:`step` takes them)."""
        rows = self._rows
        if not self.batched or self._batch is None or len(rows) < 1 or len(rows) != len(self.active):
            return 0
        if self._loop_short == [r.id for r in rows]:  # these rows' pages did not fit ahead, or a step refused them
            return 0
        first = rows[0]
        names = first._builder.decode_names if first._builder is not None else None
        if names is None:
            return 0
        count = min(r.max_new_tokens - len(r.tokens) for r in rows)
        if count < 2:
            return 0
        feeds = first._builder.ragged(np.array([r.tokens[-1] for r in rows]), np.array([r._cached for r in rows]))
        draws, streams = None, [r.sampling.rng.bit_generator.state for r in rows if not r.sampling.greedy]
        if streams:  # row b of step t draws its own stream's t-th number: uniforms[t * B + b]; greedy rows argmax
            cfgs = [r.sampling for r in rows]
            uniforms = np.stack([np.zeros(count) if c.greedy else c.rng.random(count) for c in cfgs], axis=1)
            draws = Draws(
                np.array([0.0 if c.greedy else c.temperature for c in cfgs]),
                np.array([0 if c.greedy else c.top_k or 0 for c in cfgs], np.int64),
                np.array([1.0 if c.greedy or c.top_p is None else c.top_p for c in cfgs]),
                uniforms.reshape(-1),
            )
        run = None
        try:
            # a row fed the pad id has ended and leaves after the call: whose pad id it is does not matter
            eos = [list(r.eos) for r in rows]
            run = self._batch.decode_steps(feeds, count, names, eos, draws, np.zeros(len(rows), bool),
                                           first.pad_id)  # fmt: skip
        except OutOfMemory:  # the pages of the steps do not fit: nothing changed, steps make room one by one
            self._loop_short = [r.id for r in rows]  # not tried again until the rows change
        finally:
            for r, state in zip((r for r in rows if not r.sampling.greedy), streams, strict=True):
                r.sampling.rng.bit_generator.state = state
                r.sampling.rng.random(0 if run is None else run.steps)
        if run is not None and not run.steps:  # its first step refused the rows' values: not tried again for them
            self._loop_short = [r.id for r in rows]
        if run is None or not run.steps:
            return 0
        tokens = run.tokens.reshape(run.steps, len(rows))
        done = []
        for r, column in zip(rows, tokens.T, strict=True):
            for token in column.tolist():
                r.finished = r._take(token)
                if r.finished is not None:
                    done.append(r)
                    break
            r._cached += run.steps
        if done:
            self._drop_rows(done)
        return run.steps

    def _drop_rows(self, gone: list[Request]) -> None:
        """Batched: remove the rows of ``gone`` from the batched state (their pages go back unless shared)."""
        keep = [i for i, r in enumerate(self._rows) if r not in gone]
        self._batch.keep_rows(keep)
        self._rows = [self._rows[i] for i in keep]
        for r in gone:
            r._builder = r._out = r._keys = None

    def _run(
        self, state: State, feeds: dict, outputs: list[str], owners: list[Request], logits_at=None, before_commit=None
    ) -> dict:
        """``state.run`` for the prompt runs of ``owners`` (``logits_at``, ``before_commit``: see :meth:`State.run`); while the pool is out of pages, room is made
        from requests that arrived after them (:meth:`_make_room`) and the run is made again (a failed run
        changes nothing).  When only earlier requests hold pages, WaitForRoom: the owners wait for them to
        finish.  OutOfMemory when nobody else holds a page: the run does not fit even alone."""
        while True:
            try:
                self._runs += 1
                return state.run(feeds, outputs, logits_at=logits_at, before_commit=before_commit)
            except OutOfMemory:
                if self._make_room(owners, newer_than=max(r.id for r in owners), state=state):
                    continue
                if self.batched and any(r not in owners for r in self._holders()):
                    raise WaitForRoom from None
                raise

    def _holders(self) -> list[Request]:
        """The active requests that hold pages (a row of the batched state, or a state of their own)."""
        return [r for r in self.active if r._state is not None or r in self._rows]

    def _make_room(self, keep: list[Request], newer_than: int = -1, state: State | None = None) -> bool:
        """Free pages: the prefix cache's unreferenced ones (least recently used first), else pause the
        latest-arriving request holding pages that is not in ``keep`` and arrived after request
        ``newer_than`` (its unshared pages go back; it runs its prompt and tokens again when it
        resumes), else drop the prefix cache's references to the pages it holds with ``state`` (the run's)
        alone (the run's conversion then needs no copy of them).  Returns whether anything changed."""
        if not self.batched:  # each request has a pool of its own: another's pages are no room
            return False
        if self._prefix is not None and self._evict(len(self._prefix)):
            return True
        pool = self._batch.pool
        before = pool.live_pages
        holders = sorted(
            (r for r in self._holders() if r not in keep and r.id > newer_than), key=lambda r: r.id, reverse=True
        )
        if pool.max_bytes is not None and self._compress(holders):
            return True
        for r in holders:
            self._pause(r)
            if self._prefix is not None:  # the pages it shared with the prefix cache are unreferenced now
                self._evict(len(self._prefix))
            if pool.live_pages < before:
                return True
        # last: the cache lets go of the pages it holds with the run alone, which the run's kv_format may
        # then convert in place instead of copying them into pages the pool does not have
        return self._prefix is not None and state is not None and self._release(state.page_tables) > 0

    def _compress(self, holders: list[Request]) -> bool:
        """Under a byte budget: the cold pages (all but the last ``keep_native_tokens`` positions) of the
        first of ``holders`` (latest first) that has any, stepped down to the next of ``preempt_formats``
        (every holder to the first format before any to the second).  Returns whether bytes were freed."""
        for fmt in self.preempt_formats:
            for r in holders:
                state, row = (self._batch, self._rows.index(r)) if r in self._rows else (r._state, 0)
                if self._prefix is not None:  # its prompt pages the cache holds with it alone: its own now
                    self._release(state.page_tables[row])
                freed = state.compress_rows([row], fmt, self.keep_native_tokens)
                if freed > 0:
                    r._converted = True  # its pages, and those it computes over them, are no prefix for others
                    events = self.session.events
                    if events.enabled:
                        events.record(
                            self.session._step, "", "", "preempt_quantize",
                            extra={"request": r.id, "format": fmt, "bytes_freed": freed},
                        )  # fmt: skip
                    return True
        return False

    def _pause(self, r: Request) -> None:
        """Preempt ``r``: drop its row or close its state; it waits to run its prompt and the tokens it
        made (all but the last, which it feeds next) again, from whatever prefix pages stay cached."""
        if r in self._rows:
            self._drop_rows([r])
        elif r._state is not None:
            r._state.close()
        if r.tokens:
            r._seq = np.concatenate([r.prompt, np.asarray(r.tokens[:-1], np.int64)])
            r._resuming = True
        r._state = r._builder = r._out = None
        r.prompt_done = r._cached = r.prefix_hit_tokens = 0
        r._converted = False  # it computes its pages again, over cached pages that were never converted
        r.preemptions += 1
        self._paused_now.add(r)
        r._lookup = True  # its prefix pages are looked up when the next step starts, not now
        events = self.session.events
        if events.enabled:
            events.record(
                self.session._step, "", "", "preempt", extra={"request": r.id, "rerun_tokens": int(r._seq.size)}
            )

    def _release(self, pages: np.ndarray) -> int:
        """The prefix cache's references dropped to those of ``pages`` (page ids) one other holder has."""
        return self._log_evictions(self._prefix.release(pages))

    def _evict(self, n: int) -> int:
        return self._log_evictions(self._prefix.evict(n))

    def _trim(self) -> int:
        return self._log_evictions(self._prefix.trim())

    def _log_evictions(self, freed: int) -> int:
        events = self.session.events
        if freed and events.enabled:
            events.record(self.session._step, "", "", "prefix_evict", extra={"evictions": freed})
        return freed

    def _cache_prompt(self, r: Request, table: np.ndarray, done: int | None = None) -> None:
        """Batched with prefix caching: ``r``'s full pages of the tokens it ran before decoding (its prompt,
        after a pause its tokens too; ``table`` its row's page ids) into the cache; ``done``: only the pages
        of its first ``done`` tokens (after a prompt chunk: requests waiting for them take them)."""
        if self._prefix is None or r._converted:  # converted pages would change other requests' tokens
            return
        keys = self._prefix.keys(r._seq) if done is None else self._prompt_keys(r)[: done // self._prefix.block_size]
        if keys:
            self._prefix.insert(keys, table[: len(keys)])
