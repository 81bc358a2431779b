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
the same seed -- except that under a ``kv_format`` that quantizes pages, a
prefix hit runs the rest of the prompt over the cached pages in that format
(``generate`` alone runs its first chunk over native values), which can change
tokens; ``prefix_caching=False`` keeps them identical.

Batching.  With paged caches (the default there) on a GroupQueryAttention graph
(the ONNX Runtime GenAI builder's form, which takes a length per row) or an opset-23 Attention
graph (whose mask hides the positions a shorter row never wrote: the kernel
stores each row's new keys after its own), every request's pages
live in one page pool and the decode tokens of all requests run as one
batched forward pass over one state whose rows have their own lengths and
page tables (the weights are read once per step, not once per request).  A
prompt runs in chunks on a state of its own over the same pool; when its last
chunk has made the first token, its rows move into the batched state
(:meth:`State.append_rows`, no payload copied) and a finished request's row
leaves it (:meth:`State.keep_rows`).  When the session takes segments
(:attr:`Session.takes_segments`: GroupQueryAttention graphs, and Attention
graphs whose mask the graph builds) a step's prompt chunks run in the same
run as its decode rows, a run of segments (:mod:`onnxkv.engine.segments`):
one run per step; otherwise one run per prompt chunk (the last chunks of
prompts alike together).  Other graph
forms (one length per batch) and contiguous caches run one request per run;
:meth:`Engine.describe` says which.  Batched rows run the same kernels as a
row alone, whose per-row results do not depend on the rows beside them
(tests/engine compare tokens with ``generate``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from onnxkv.cache.formats import page_format
from onnxkv.engine.alone import decode_alone
from onnxkv.engine.batched import BatchedSteps, WaitForRoom
from onnxkv.engine.occupancy import pool_occupancy
from onnxkv.engine.prefix import PrefixCache
from onnxkv.engine.request import Request, choose_tokens
from onnxkv.engine.segments import SegmentSteps
from onnxkv.errors import CacheCapacityError, InputError, OutOfMemory, StateError
from onnxkv.generate.arguments import check_length, check_prompt, int_arg, token_ids
from onnxkv.generate.sampling import sampling_arguments
from onnxkv.runtime.cache_config import CacheConfig, cache_request
from onnxkv.runtime.prompt_chunk import prompt_chunk
from onnxkv.runtime.session import Session
from onnxkv.runtime.state import State

__all__ = ["Engine", "DEFAULT_MAX_BATCH_TOKENS"]

#: Kernels that quantize a run's activations with one scale over all its rows (ONNX Runtime's
#: quantize_dynamic models): a request's values then depend on the rows it runs with.
_SHARED_SCALE_OPS = frozenset({"DynamicQuantizeLinear", "DynamicQuantMatMul"})

#: Fed tokens per step when the engine is not told (about two prompt chunks of a small model).
DEFAULT_MAX_BATCH_TOKENS = 2048
_KINDS = ("contiguous", "paged")
#: Cache conventions whose graphs take a length per row, so requests of different lengths share a run.
_BATCHING_FORMS = ("group_query_attention", "attention")


def _alone(r: Request, cause: OutOfMemory | CacheCapacityError) -> OutOfMemory | CacheCapacityError:
    """The error of a run of ``r`` that does not fit in the pool even with every later request paused, or
    past its cache's fixed capacity: it names the request (``.request``), which the caller may abort to
    let the others go on (every step would raise it again)."""
    what = "does not fit even alone" if isinstance(cause, OutOfMemory) else "is past its cache's fixed capacity"
    err = type(cause)(
        f"Engine.step: request {r.id} ({r.prompt.size} prompt tokens, {len(r.tokens)} made) {what}; abort it "
        f"(Engine.abort(error.request)) to go on with the others: {cause}"
    )
    err.request = r
    return err


def _unmasked_attention(session: Session) -> bool | None:
    """For an opset-23 Attention graph with a node that takes no ``attn_mask``: True when every such node is
    causal (``is_causal=1``), else False; None when every node takes a mask, or for other graph forms."""
    if session.model.convention.kind != "attention":
        return None
    nodes = [n for n in session.model.proto.graph.node if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]
    bare = [n for n in nodes if len(n.input) < 4 or not n.input[3]]
    if not bare:
        return None
    return all(any(a.name == "is_causal" and a.i == 1 for a in n.attribute) for n in bare)


class Engine(SegmentSteps, BatchedSteps):
    """Continuous generation over one :class:`~onnxkv.Session` (see the module docstring).

    Args:
        session: the session every request runs on (its threads, event log and precision).
        cache: a :class:`~onnxkv.CacheConfig` or kind ("contiguous", "paged") for every request's state;
            None: paged (one pool, batched decode rows, prefix caching) on a GroupQueryAttention or
            opset-23 Attention graph, else contiguous (one state per request).  The model must have a
            cache that runs in place.
        max_batch_tokens: tokens fed per step at most (an int >= 1), decode tokens and prompt chunks
            together.
        max_pages: pages the engine's pool holds at most (paged; the same as the cache's ``max_pages``,
            which it must not contradict).
        prefix_caching: share full prompt pages between requests (batched engines; see
            :mod:`onnxkv.engine.prefix`).
        prefix_pages: most pages the prefix cache keeps (default: ``max_pages``, else 4096); unreferenced
            ones leave first, least recently used first, and whenever the pool needs room.
        max_cache_bytes: payload bytes the pool's pages may hold at most (batched; None: no bound).  Under
            it a full pool is relieved by converting cold pages to smaller formats before any request is
            paused (:mod:`onnxkv.engine.batched`).
        preempt_formats: the page formats cold pages step down through, in order (each smaller than the
            last).
        keep_native_tokens: the most recent positions of each request that are never converted.

    The engine is not thread-safe: one thread calls its methods.  :meth:`close` releases every page.
    """

    def __init__(
        self,
        session: Session,
        cache: CacheConfig | str | None = None,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        *,
        max_pages: int | None = None,
        prefix_caching: bool = True,
        prefix_pages: int | None = None,
        max_cache_bytes: int | None = None,
        preempt_formats: Sequence[str] = ("int8", "int4"),
        keep_native_tokens: int = 32,
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
        if max_pages is not None:
            max_pages = int_arg(api, "max_pages", max_pages, 1)
            config = cache if isinstance(cache, CacheConfig) else CacheConfig(cache or "paged")
            if config.max_pages not in (None, max_pages):
                raise InputError(f"{api}: max_pages={max_pages} contradicts the cache's max_pages={config.max_pages}")
            cache = replace(config, max_pages=max_pages)
        self._cache = cache_request(api, cache, _KINDS, {}, auto=True)
        unmasked = _unmasked_attention(session)
        #: An Attention graph whose nodes take no attn_mask cannot hide from a row what it never wrote, so
        #: its decode rows batch only in runs of segments (causal over each row's own keys), every step.
        self._decode_segments = unmasked is True and session.takes_segments
        batches = session.model.convention.kind in _BATCHING_FORMS and (unmasked is None or self._decode_segments)
        self.kind = self._cache.kind("paged" if batches else "contiguous")
        try:  # the state's checks of the cache against the model, now rather than at the first step
            probe = State(session, **self._cache.state_keywords(self.kind, initial_capacity=32))
        except InputError as e:
            raise InputError(f"{api}: the cache does not suit this model: {e}") from None
        #: (block size, residual tokens) of the kv_format's page conversions (State.conversion_cycle), or
        #: None: where pages convert, runs end where generate's would (Request.next_tokens)
        self._conversion_cycle = probe.conversion_cycle
        probe.close()
        if not isinstance(prefix_caching, bool):
            raise InputError(f"{api}: prefix_caching must be a bool, got {prefix_caching!r}")
        self.prefix_caching = prefix_caching
        self._prefix_pages = int_arg(api, "prefix_pages", prefix_pages, 0) if prefix_pages is not None else None
        self._prefix: PrefixCache | None = None  # made with the batched state
        # None: no byte bound (0 and False used to mean that too, silently)
        self._max_cache_bytes = None if max_cache_bytes is None else int_arg(api, "max_cache_bytes", max_cache_bytes, 1)
        if isinstance(preempt_formats, (str, bytes)) or not isinstance(preempt_formats, Sequence):
            raise InputError(f"{api}: preempt_formats must be a sequence of page format names, got {preempt_formats!r}")
        steps = [page_format(f) for f in preempt_formats]
        if any(b.bits >= a.bits for a, b in zip(steps, steps[1:])):
            raise InputError(
                f"{api}: preempt_formats must step down, each format fewer bits per element than the one before, "
                f"got {[f.name for f in steps]} (bits {[f.bits for f in steps]})"
            )
        self.preempt_formats = tuple(f.name for f in steps)
        self.keep_native_tokens = int_arg(api, "keep_native_tokens", keep_native_tokens, 0)
        self._requests: list[Request] = []  # added and not let go (pop_finished)
        self._added = 0  # requests ever added: the next request's id
        self.steps = 0
        self.batched = self.kind == "paged" and batches
        #: Batched steps run decode rows and prompt chunks as one run of segments (onnxkv.engine.segments).
        self._segmented = self.batched and session.takes_segments
        #: Why a model that takes segments stopped running its steps as one run (describe()), or None.
        self._unsegmented: str | None = None
        self._runs = 0  # State runs the current step made
        self._batch: State | None = None  # batched: the state of every decoding request's rows
        self._batch_slab = False  # batched: the pool's page allocator was made for it (close trims it)
        self._rows: list[Request] = []  # batched: the request of each of its rows, in order
        self._loop_short: list[int] = []  # batched: the rows (ids) run()'s loop did not fit or refused
        self._unlooped: set[int] = set()  # not batched: the requests (ids) whose state did not loop in run()
        self._decode_waited = False  # batched: the last step left the decode rows out (first in the next)
        self._paused_now: set[Request] = set()  # batched: paused in this step (not run again in it)
        self._closed = False

    @property
    def requests(self) -> list[Request]:
        """Every request added, in arrival order (finished ones included, until :meth:`pop_finished`)."""
        return list(self._requests)

    def pop_finished(self) -> list[Request]:
        """The finished requests the engine still lists, in arrival order; the engine lets them go (the
        caller's references stay valid).  A long-running loop of :meth:`step` calls it, so that the
        records of finished requests (prompt, tokens) do not accumulate."""
        done = [r for r in self._requests if r.finished is not None]
        if done:
            self._requests = [r for r in self._requests if r.finished is None]
        return done

    @property
    def active(self) -> list[Request]:
        """The requests not finished, in arrival order."""
        return [r for r in self._requests if r.finished is None]

    def describe(self) -> dict:
        """How the engine runs: batching, cache kind, budget, requests added and active (each request's
        prompt chunk is ``Request.chunk``), and ``shared_activation_scales``: the operators of the model that
        quantize a run's activations per tensor, whose rows then depend on one another (docs/engine.md)."""
        if self._segmented:
            batching = (
                "one batched run per step over one page pool: decode tokens of every request and chunks of "
                "waiting prompts in one run of segments (rows of their own lengths, token counts and page tables)"
            )
        elif self.batched:
            why = (
                self._unsegmented
                if self._unsegmented is not None
                else f"this graph form ('{self.session.model.convention.kind}') does not take segments"
            )
            batching = (
                "decode tokens of every request in one batched run over one page pool (rows of their own "
                f"lengths and page tables); prompt chunks one run per request ({why})"
            )
        elif self.kind != "paged":
            batching = (
                "one run per request and step, not batched: contiguous caches are one state per request "
                "(run() decodes each request's steps in C on its own state)"
            )
        else:
            batching = (
                f"one run per request and step: this graph form ('{self.session.model.convention.kind}') "
                "takes one length per batch, so rows of different lengths are not batched (run() decodes each "
                "request's steps in C on its own state)"
            )
        prefix = self._prefix
        # operators that quantize a run's activations with one scale for all its rows (docs/engine.md)
        shared = sorted({type(k).__name__ for k in self.session.plan.kernels} & _SHARED_SCALE_OPS)
        return {
            "batching": batching,
            "shared_activation_scales": shared,
            "prefix_caching": self.prefix_caching and self.batched,
            "prefix_cached_pages": len(prefix) if prefix is not None else 0,
            "prefix_evictions": prefix.evictions if prefix is not None else 0,
            "decode_rows": len(self._rows),
            "cache": self.kind,
            "max_batch_tokens": self.max_batch_tokens,
            "requests": self._added,
            "active": len(self.active),
            "steps": self.steps,
        }

    def pool_occupancy(self) -> dict:
        """What the page pool holds now, pages and bytes by request and page format (batched engines; ``{}``
        otherwise): :func:`onnxkv.engine.occupancy.pool_occupancy`.  Logged with every ``engine_step`` event
        when the session's event log is on."""
        return pool_occupancy(self)

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
        if self._closed:
            raise StateError(f"{api}: the engine is closed")
        sess, model = self.session, self.session.model
        max_new_tokens = int_arg(api, "max_new_tokens", max_new_tokens, 0)
        sampling = sampling_arguments(api, do_sample, temperature, top_k, top_p, seed)
        ids, _, _ = check_prompt(api, prompt_ids, None, sess.token_limit)
        if ids.shape[0] != 1:
            raise InputError(f"{api}: prompt_ids must be one sequence ([L] or [1, L]), got shape {ids.shape}")
        eos = token_ids(api, "eos_token_id", eos_token_id, model.eos_token_id, sess.token_limit)
        length = ids.shape[1]
        check_length(api, sess, length, max_new_tokens)
        state_kw = self._cache.state_keywords(self.kind, initial_capacity=max(32, length + min(max_new_tokens, 256)))
        limit = state_kw.get("max_pages") if self.kind == "paged" else None
        if limit is not None and -(-length // state_kw["block_size"]) > limit:
            raise OutOfMemory(
                f"{api}: a prompt of {length} tokens needs {-(-length // state_kw['block_size'])} pages of "
                f"{state_kw['block_size']} tokens, more than the pool's max_pages={limit} (nothing was queued)"
            )
        chunk = prompt_chunk(sess.plan.kernels, state_kw.get("block_size") if self.kind == "paged" else None)
        chunk = min(chunk, self.max_batch_tokens)
        pad = model.pad_token_id if model.pad_token_id is not None else (eos[0] if eos else 0)
        request = Request(self, self._added, ids[0], max_new_tokens, sampling, eos, chunk, state_kw, pad)
        self._added += 1
        if request.finished is None:
            self._start_on_prefix(request)
        self._requests.append(request)
        return request

    def abort(self, request: Request) -> None:
        """Stop ``request`` now (``finished == "aborted"`` unless it had finished) and release its state."""
        if not isinstance(request, Request) or request.engine is not self:
            raise InputError(f"Engine.abort: expected a Request of this engine, got {request!r}")
        if request.finished is None:
            self._finish(request, "aborted")

    def step(self) -> dict[int, int]:
        """One run for every unfinished request the budget admits (batched: one run for all decode rows,
        then one per prompt chunk); returns {request id: id produced} for the requests that produced a
        token in this step.  A run that raises (or whose token choice raises) propagates: the requests it
        ran are as before it, and the runs after it were not made in this step (step again to go on, or
        abort a request).  A request whose run does not fit in the pool even with every later request
        paused raises OutOfMemory naming it (``error.request``), and one past its cache's fixed capacity
        CacheCapacityError naming it: every step would, until it is aborted."""
        active = self.active
        self._paused_now = set()
        if self.batched and self._batch is None and active:  # the pool and prefix cache, before any admission
            self._new_state(active[0]).close()
        pending = self._pending_keys()
        for r in active:
            fresh = r._state is None and r.prompt_done == 0 and r not in self._rows
            if r._lookup:  # paused in an earlier step, and not run again since
                r._lookup = False
                if fresh:
                    self._start_on_prefix(r)
            elif fresh and self._prefix is not None and not self._shares(r, pending):
                self._start_on_prefix(r, again=True)  # the pages others cached since it arrived (or it waited for)
        rows = list(self._rows)
        decoding = [r for r in active if r.prompt_done >= r._seq.size and r not in rows]
        waiting = [r for r in active if r.prompt_done < r._seq.size]
        starved = [r for r in waiting if r._skipped]
        others = decoding + [r for r in waiting if not r._skipped]
        budget, chosen, decode_rows, starting, started = self.max_batch_tokens, [], False, 0, 0

        def admit(r: Request) -> None:
            nonlocal budget, starting, started
            need = r.next_tokens
            new = r._state is None
            if new and self._shares(r, pending):  # another request computes its next prompt page: it waits for it
                return
            r._skipped = need > budget or (
                new and not (self._room_for_row(started) and self._room_for_prompt(r, starting))
            )
            if not r._skipped:
                chosen.append(r)
                budget -= need
                starting += self._prompt_pages(r) if new else 0
                started += 1 if new else 0
                if new and self._prefix is not None:  # the pages it will compute: later ones wait for them
                    pending.update(self._prompt_keys(r))

        if rows and self._decode_waited and len(rows) <= budget:
            decode_rows, budget = True, budget - len(rows)
        for r in starved:
            admit(r)
        if rows and not decode_rows:
            decode_rows = len(rows) <= budget
            budget -= len(rows) if decode_rows else 0
        self._decode_waited = bool(rows) and not decode_rows
        for r in others:
            admit(r)
        self._runs = 0
        produced = self._segment_step(decode_rows, chosen) if self._segmented else None
        if produced is None:
            produced = self._separate_runs(decode_rows, rows, chosen)
        self.steps += 1
        if self._prefix is not None and len(self._prefix) > self._prefix.capacity:
            self._trim()
        events = self.session.events
        if events.enabled:
            events.record(
                self.session._step, "", "", "engine_step",
                extra={"requests": len(chosen) + (len(rows) if decode_rows else 0),
                       "batched_rows": len(rows) if decode_rows else 0,
                       "tokens_fed": self.max_batch_tokens - budget, "runs": self._runs,
                       "produced": len(produced), "active": len(self.active),
                       "pool": self.pool_occupancy()},
            )  # fmt: skip
        return produced

    def _separate_runs(self, decode_rows: bool, rows: list[Request], chosen: list[Request]) -> dict[int, int]:
        """A step's runs one by one: every decode row in one run (when ``decode_rows``), then the prompt
        chunks of ``chosen``, the last chunks of prompts alike run together; returns the ids produced."""
        try:
            produced: dict[int, int] = self._decode_batch() if decode_rows else {}
        except OutOfMemory as e:  # the earliest row does not fit with every later one paused
            raise _alone(min(rows, key=lambda r: r.id), e) from e
        except CacheCapacityError as e:  # the longest row is at the fixed capacity
            raise _alone(max(rows, key=lambda r: (r._cached, -r.id)), e) from e
        for group in self._groups(chosen):
            group = [r for r in group if r not in self._paused_now]  # paused by an earlier run of this step
            if not group:
                continue
            if len(group) > 1:
                try:
                    produced.update(self._advance_group(group))
                    continue
                except OutOfMemory:  # the rows do not fit together (nothing changed): the first alone, the rest wait
                    for r in group[1:]:
                        r._skipped = True
                    group = group[:1]
            try:
                token = self._advance(group[0])
            except WaitForRoom:  # the pool is held by earlier requests: first in a later step
                group[0]._skipped = True
                continue
            except (OutOfMemory, CacheCapacityError) as e:
                raise _alone(group[0], e) from e
            if token is not None:
                produced[group[0].id] = token
        return produced

    def _finish(self, r: Request, reason: str) -> None:
        """``r`` stops with ``reason``: its own state closed, or its batched row removed."""
        if r in self._rows:
            r.finished = reason
            self._drop_rows([r])
        else:
            r._release(reason)

    def run(self) -> list[Request]:
        """Step until every request has finished; returns every request in arrival order.  Once only
        decode rows are left (batched), their steps run in C up to the fewest tokens a row has left, each
        call (:meth:`_decode_loop`), with the tokens of the steps one by one; each such call counts its
        steps in :attr:`steps`.  Not batched (one state per request), once every active request decodes,
        each runs its remaining steps in C on its own state (:func:`~onnxkv.engine.alone.decode_alone`),
        the most steps one ran counted in :attr:`steps`; a request whose state cannot loop steps one by one."""
        while self.active:
            ran = self._decode_loop() if self.batched else self._decode_alone()
            if ran:
                self.steps += ran
            else:
                self.step()
        return self.requests

    def _decode_alone(self) -> int:
        """Not batched, every active request decoding: each one's remaining steps in C (those whose state
        did not loop once are not tried again); returns the most steps one ran."""
        active = self.active
        self._unlooped.intersection_update(r.id for r in active)  # (finished requests' ids let go)
        if any(r.prompt_done < r._seq.size or r._state is None for r in active):
            return 0
        ran = 0
        for r in active:
            if r.id not in self._unlooped:
                steps = decode_alone(r)
                if not steps:
                    self._unlooped.add(r.id)
                ran = max(ran, steps)
        return ran

    def _advance(self, r: Request) -> int | None:
        """Run ``r``'s next prompt chunk or decode step (as :func:`onnxkv.generate` runs them for one
        sequence); returns the id it produced, if any.  A run that raises, or whose token choice raises
        (made before the run is committed, which it then undoes), leaves ``r`` as before it (its feeds
        rewound, a first run's new state closed)."""
        model = self.session.model
        name = model.io.logits
        seq = r._seq
        length = seq.size
        chosen: list[int] = []

        def choice(last: bool, read_at):
            """``before_commit`` of the run: the id ``r`` takes from its logits, if it takes one."""
            if not last or r._resuming:  # a paused request's next token is the one it had made
                return None

            def choose(out: dict) -> None:
                logits = out[name]
                if logits.ndim == 3:
                    logits = logits[np.arange(1), read_at if read_at is not None and logits.shape[1] > 1 else 0]
                chosen[:] = choose_tokens([r], logits)

            return choose

        if r._state is None:
            first = r.next_tokens
            builder = r._feeds(seq[None, :first])
            state = self._new_state(r)
            feeds, read = builder.first()
            whole = first >= length  # its last chunk: the logits at its last token only
            try:
                out = self._run(
                    state, feeds, [name] if whole else [], [r], read if whole else None, choice(whole, read)
                )
            except BaseException:
                state.close()
                raise
            r._state, r._builder, r._out, r.prompt_done = state, builder, out, first
        else:
            fed = r._builder.total
            decoding = r.prompt_done >= length
            tokens = np.array([r.tokens[-1]]) if decoding else seq[None, r.prompt_done : r.prompt_done + r.next_tokens]
            last = decoding or r.prompt_done + tokens.shape[-1] >= length
            try:
                read_at = None if decoding else np.array([tokens.shape[1] - 1])
                feeds = r._builder.next(tokens, r._out)
                out = self._run(r._state, feeds, [name] if last else [], [r], read_at, choice(last, read_at))
            except BaseException:
                r._builder.rewind(fed)
                raise
            r._out = out
            if not decoding:
                r.prompt_done += tokens.shape[1]
        if r.prompt_done < length:
            if self.batched:  # its full pages so far, for requests waiting for them
                self._cache_prompt(r, r._state.page_tables[0], r.prompt_done)
            return None
        if self.batched:
            self._cache_prompt(r, r._state.page_tables[0])
        if r._resuming:  # a paused request: its next token is the one it had made; its row joins
            r._resuming = False
            return self._join(r)  # (only a batched engine pauses)
        (token,) = chosen
        stop = r._take(token)
        if stop is not None:
            r._release(stop)
        elif self.batched:  # its prompt is done: its rows join the batched state
            self._join(r)
        return token

    def _join(self, r: Request) -> None:
        """Batched: ``r``'s row (its tokens run) moves into the batched state."""
        r._cached = r._seq.size
        self._batch.append_rows(r._state)
        r._state, r._out, r._keys = None, None, None  # its keys served its prompt
        self._rows.append(r)

    def close(self) -> None:
        """Finish every request ("aborted") and release every page, the prefix cache's included (the empty
        chunks of a page allocator the engine made go to the process's chunk reserve at once, for the next
        engine or state: :mod:`onnxkv.alloc.chunk_reserve`); the engine takes no request afterwards."""
        self._closed = True
        for r in self.active:
            self._finish(r, "aborted")
        if self._prefix is not None:
            self._prefix.clear()
        if self._batch is not None:
            self._batch.close()
            if self._batch_slab:  # the pool's allocator is the engine's: its chunks go to the process's reserve now
                self._batch.allocator.trim()

    def _new_state(self, r: Request) -> State:
        """A request's own state; batched: over the page pool of the batched state (made with the first)."""
        if not self.batched:
            return State(self.session, **r._state_kw)
        if self._batch is None:
            first = State(self.session, **r._state_kw)
            first.pool.max_bytes = self._max_cache_bytes
            self._batch_slab = first._own_slab
            self._batch = first.sibling()
            if self.prefix_caching:
                capacity = self._prefix_pages
                if capacity is None:
                    capacity = first.pool.max_pages or 4096
                salt = repr((self._cache.config, first.pool.block_size)).encode()
                self._prefix = PrefixCache(first.pool, salt, capacity)
            return first
        return self._batch.sibling()
