"""``onnxkv.beam_search``: beam search with Hugging Face transformers' semantics.

Two parts, kept apart:

* :class:`BeamScorer` -- the scoring rules of transformers' (5.x, vectorised)
  ``generate(num_beams=k, do_sample=False)`` for decoder-only models, on
  log-probability tables only (no model): running beams, finished hypotheses,
  length penalty, ``early_stopping`` True / False / ``"never"``, finalisation.
* :func:`beam_search` -- the model driver.  It prefills the prompt once with
  batch B, expands every row to k beams and, every step, makes row ``i`` of
  the cache continue the beam the scorer chose for it (``beam_idx``) before
  running the k*B new tokens.  ``cache="paged"`` does that with
  ``State.reorder`` (page tables are permuted, beams share pages
  copy-on-write); ``cache="tensor"`` threads the cache as tensors and gathers
  them with ``np.take`` every step, as transformers does (a copy per beam).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from onnxkv._deprecation import renamed_argument
from onnxkv._kernels.sampling import top_indices
from onnxkv.errors import InputError
from onnxkv.generate.arguments import (
    as_session,
    bool_arg,
    callback_arg,
    check_length,
    check_prompt,
    int_arg,
    real_arg,
    token_id,
    token_ids,
)
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.plan.ops.shape import MAX_TENSOR_BYTES
from onnxkv.runtime.cache_config import CacheConfig, cache_request
from onnxkv.runtime.state import State

__all__ = ["beam_search", "BeamSearchResult", "BeamScorer", "MAX_BEAM_ROWS", "log_softmax"]

#: transformers' "minus infinity" for beam scores (added, in float32).
NEG = np.float32(-1.0e9)
#: ``|length_penalty| * ln(max_new_tokens + 1)`` above this would take the length factor out of the float32 range.
_LENGTH_EXPONENT_LIMIT = 80.0
#: Most beam rows (prompt rows * num_beams) one search runs: the paged state's rows, as State.fork's limit.
MAX_BEAM_ROWS = 1 << 16


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 log-softmax over the last axis, computed as torch does on the CPU
    (``(x - max) - log(sum(exp(x - max)))``, all in float32)."""
    x = np.asarray(logits, dtype=np.float32)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float32))


def _top(x: np.ndarray, n: int) -> np.ndarray:
    """Indices of the ``n`` largest entries of every row of ``x`` [R, N] (float32, no NaN, n ≤ N), best
    first; ties go to the lower index (:func:`onnxkv._kernels.sampling.top_indices`, one pass per row)."""
    return top_indices(np.ascontiguousarray(x, dtype=np.float32), n)


class BeamScorer:
    """transformers' beam-search bookkeeping for ``batch`` rows of ``num_beams`` beams.

    Args:
        batch: B, prompt rows.
        num_beams: k beams per row.
        max_new_tokens: generation stops after this many tokens (every
            candidate of the last step counts as finished).
        length_penalty: a finished hypothesis of ``n`` generated tokens
            (its EOS included, the prompt excluded) scores ``sum_logprobs / n ** length_penalty``.
        early_stopping: ``True`` stops as soon as every row holds k finished
            hypotheses; ``False`` also stops when the best running beam, scored at
            its current length, cannot beat the worst finished one; ``"never"``
            does the same with the best length possible (``max_new_tokens``) when
            ``length_penalty > 0``.
        eos_token_id: ids that finish a hypothesis.
        pad_token_id: written after a hypothesis' end in :meth:`finalize`.

    Each step, :meth:`process` takes the log-probabilities of the k*B running
    beams (row ``b*k + j`` is beam j of prompt row b) and returns, for each of
    the k*B beams of the next step, its new token and the global row it
    continues.  Scores are float32 and follow transformers' arithmetic
    (``-1e9`` penalties are added, not masked).  Of the
    ``max(2, 1 + len(eos)) * k`` best candidates of a row, an EOS candidate ranked
    ``>= k`` is dropped; ties go to the lower candidate index.
    """

    def __init__(
        self,
        batch: int,
        num_beams: int,
        max_new_tokens: int,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        eos_token_id: Sequence[int] = (),
        pad_token_id: int = 0,
    ) -> None:
        self.batch, self.num_beams, self.max_new_tokens = int(batch), int(num_beams), int(max_new_tokens)
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.eos = np.asarray(list(eos_token_id), dtype=np.int64)
        self.pad_token_id = int(pad_token_id)
        B, k, n = self.batch, self.num_beams, self.max_new_tokens
        self.keep = max(2, 1 + self.eos.size) * k
        self.step = 0  # tokens generated so far
        self.running = np.full((B, k, n), self.pad_token_id, dtype=np.int64)
        self.running_scores = np.zeros((B, k), dtype=np.float32)
        self.running_scores[:, 1:] = NEG
        self.finished = np.full((B, k, n), self.pad_token_id, dtype=np.int64)
        # empty finished slots and candidates that may not finish: -inf, below every finished score (a negative
        # length_penalty multiplies a score far below NEG)
        self.finished_scores = np.full((B, k), -np.inf, dtype=np.float32)
        self.finished_lengths = np.zeros((B, k), dtype=np.int64)
        self.is_finished = np.zeros((B, k), dtype=bool)
        self.improvable = np.ones(B, dtype=bool)  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False
        self._rows = np.arange(B)[:, None]  # row indices for gathering per-row entries

    def process(self, log_probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Advance one step.

        Args:
            log_probs: float [B*k, V] log-probabilities of the next token per running beam.

        Returns:
            ``(tokens, beam_idx)``: int64 [B*k] each; beam ``i`` of the next step is
            old row ``beam_idx[i]`` (a global row, ``b*k + j``) followed by ``tokens[i]``.
            :attr:`done` tells whether the search has ended.

        Raises:
            InputError: wrong shape, fewer than ``keep`` candidates, or called after the end.
        """
        B, k, t = self.batch, self.num_beams, self.step
        lp = np.asarray(log_probs, dtype=np.float32)
        if self.done:
            raise InputError("beam_search: BeamScorer.process called after the search ended")
        if lp.ndim != 2 or lp.shape[0] != B * k:
            raise InputError(f"beam_search: log_probs must be [{B * k}, vocab], got shape {lp.shape}")
        if np.isnan(lp).any():
            raise InputError("beam_search: the log-probabilities contain NaN")
        V = lp.shape[1]
        if k * V < self.keep:
            raise InputError(
                f"beam_search: num_beams * vocab = {k * V} is below the {self.keep} candidates "
                "beam search keeps per row (max(2, 1 + len(eos_token_id)) * num_beams)"
            )
        acc = (lp.reshape(B, k, V) + self.running_scores[:, :, None]).reshape(B, k * V)
        rows = self._rows
        cand = _top(acc, self.keep)
        cand_scores = acc[rows, cand]
        src, tokens = cand // V, cand % V
        cand_seqs = self.running[rows, src]
        cand_seqs[:, :, t] = tokens
        if t + 1 >= self.max_new_tokens:
            hits = np.ones(tokens.shape, bool)
        elif self.eos.size == 0:
            hits = np.zeros(tokens.shape, bool)
        elif self.eos.size == 1:
            hits = tokens == self.eos[0]
        else:
            hits = np.isin(tokens, self.eos)

        # Running beams: the k best candidates that did not finish.
        run_scores = cand_scores + hits.astype(np.float32) * NEG
        nxt = _top(run_scores, k)
        self.running = cand_seqs[rows, nxt]
        self.running_scores = run_scores[rows, nxt]
        beam_idx = (src[rows, nxt] + rows * k).reshape(-1)

        # Finished hypotheses: merge the top-k candidates that just finished.  With none to take, the merge
        # would keep every slot where it is (the slots are sorted best first, ties by slot; the -inf a
        # candidate that is not taken scores ranks after every slot), so it is skipped.
        just = hits & (np.arange(self.keep) < k)[None, :]
        takes = just
        if just.any():
            full = self.is_finished.all(axis=1) & (self.early_stopping is True)
            takes = just & ~full[:, None] & self.improvable[:, None]
        if takes.any():
            self._merge(cand_scores, cand_seqs, just, takes, t)

        self.step = t + 1
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_new_tokens
        else:
            best_len = self.step
        best = self.running_scores[:, 0] / np.float32(best_len**self.length_penalty)
        # a row with an empty finished slot can always improve (transformers' -1e9 there fails once a negative
        # length_penalty takes the best running score below it)
        worst = np.where(self.is_finished, self.finished_scores.min(axis=1, keepdims=True), np.float32(-np.inf))
        self.improvable &= np.any(best[:, None] > worst, axis=1)
        all_full = bool(self.is_finished.all()) and self.early_stopping is True
        self.done = not (bool(self.improvable.any()) and not all_full and not bool(hits.all()))
        return self.running[:, :, t].reshape(-1).copy(), beam_idx

    def _merge(self, cand_scores, cand_seqs, just: np.ndarray, takes: np.ndarray, t: int) -> None:
        """Merge the candidates ``takes`` of step ``t`` (scored by length) into each row's k finished slots."""
        B, k = self.batch, self.num_beams
        fin = np.where(takes, cand_scores / np.float32((t + 1) ** self.length_penalty), np.float32(-np.inf))
        merged_scores = np.concatenate([self.finished_scores, fin], axis=1)
        rows, sel = self._rows, _top(merged_scores, k)
        self.finished_scores = merged_scores[rows, sel]
        self.finished = np.concatenate([self.finished, cand_seqs], axis=1)[rows, sel]
        lengths = np.concatenate([self.finished_lengths, np.full((B, self.keep), t + 1, np.int64)], axis=1)
        self.finished_lengths = lengths[rows, sel]
        self.is_finished = np.concatenate([self.is_finished, just], axis=1)[rows, sel]

    def finalize(self, num_return_sequences: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The best ``num_return_sequences`` hypotheses of every row, best first.

        Returns:
            ``(tokens, scores, lengths)``: int64 [B*n, G] generated tokens (padded
            with ``pad_token_id`` after each hypothesis' end; G is the longest
            returned hypothesis), float32 [B*n] length-penalised scores, int64 [B*n]
            generated lengths.  Row ``b*n + i`` is row b's i-th best.
        """
        n = int(num_return_sequences)
        lengths = self.finished_lengths[:, :n].reshape(-1)
        width = int(lengths.max()) if lengths.size else 0
        tokens = self.finished[:, :n, :width].reshape(self.batch * n, width)
        return tokens.copy(), self.finished_scores[:, :n].reshape(-1).copy(), lengths.copy()


@dataclass
class BeamSearchResult:
    """What :func:`beam_search` returns.

    Attributes:
        sequences: int64 [B*n, L + G]: row ``b*n + i`` is prompt row b (as given,
            left padding included) followed by its i-th best hypothesis, padded
            with the pad id after its end (n = ``num_return_sequences``, G the
            longest returned hypothesis).
        sequences_scores: float32 [B*n]: ``sum_logprobs / generated_length ** length_penalty``.
        prompt_seconds: wall time of the prefill run and the expansion to k beams per row.
        prompt_copied_bytes: bytes the expansion to k beams copied (like ``reorder_copied_bytes``).
        step_seconds: wall time of every decode step (scoring, cache reorder, feeds and the run).
        reorder_copied_bytes: per decode step, cache bytes the beam reorder copied
            (``np.take`` of the presents for ``cache="tensor"``; for ``"paged"``, the copy
            counters of events logged by ``State.reorder``, None without an event log).
        cache_copied_bytes: per decode step, ``prefix_copied_bytes + cow_copied_bytes``
            of the step's run in the session's event log (None when it is off).
        committed_bytes: per decode step, cache bytes held after the step
            (``State.committed_bytes``, or the presents' bytes for ``"tensor"``).
        num_beams: k.
        batch: B, prompt rows.
    """

    sequences: np.ndarray
    sequences_scores: np.ndarray
    prompt_seconds: float
    prompt_copied_bytes: int | None
    step_seconds: list[float]
    reorder_copied_bytes: list[int] | None
    cache_copied_bytes: list[int] | None
    committed_bytes: list[int]
    num_beams: int
    batch: int

    @property
    def decode_seconds(self) -> float:
        return float(sum(self.step_seconds))

    @property
    def tokens_per_second(self) -> float:
        """Beam tokens (k*B per step) run per second of decode time (0 without a decode step)."""
        n = self.batch * self.num_beams * len(self.step_seconds)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def copied_bytes(self) -> list[int] | None:
        """Per decode step, all cache bytes copied (reorder + run); None when not known."""
        if self.reorder_copied_bytes is None or self.cache_copied_bytes is None:
            return None
        return [a + b for a, b in zip(self.reorder_copied_bytes, self.cache_copied_bytes)]


class _PagedBeams:
    """``cache="paged"``: one paged state; a reorder permutes page tables."""

    def __init__(self, session, state_keywords: dict) -> None:
        self.state = State(session, **state_keywords)
        self.fetch = [session.model.io.logits]

    def run(self, feeds: dict, logits_at=None) -> dict:
        return self.state.run(feeds, self.fetch, logits_at=logits_at)

    def reorder(self, out: dict, indices: np.ndarray) -> tuple[dict, int | None]:
        self.state.reorder(indices)
        return out, None

    def committed_bytes(self, out: dict) -> int:
        return int(self.state.committed_bytes)

    def close(self) -> None:
        self.state.close()


class _TensorBeams:
    """``cache="tensor"``: stateless runs; a reorder gathers every present with ``np.take``."""

    def __init__(self, session) -> None:
        self.session = session
        self.presents = list(session.model.convention.present_outputs)
        self.fetch = [session.model.io.logits, *self.presents]

    def run(self, feeds: dict, logits_at=None) -> dict:
        return self.session.run(feeds, self.fetch, logits_at=logits_at)

    def reorder(self, out: dict, indices: np.ndarray) -> tuple[dict, int]:
        moved = {name: np.take(out[name], indices, axis=0) for name in self.presents}
        return moved, sum(a.nbytes for a in moved.values())

    def committed_bytes(self, out: dict) -> int:
        return sum(int(out[name].nbytes) for name in self.presents)

    def close(self) -> None:
        """Nothing to release: the presents are ordinary arrays."""


#: Frames from beam_search's body to its caller's (the renamed_argument wrapper is one), for deprecation warnings.
_DEPTH = 2

#: Event counters of payload bytes copied: any copy at all (reorders), and the copies a run makes
#: of cached positions (growth / concatenation of the past, copy-on-write; not the appended tokens).
_ALL_COPIES = ("prefix_copied_bytes", "append_copied_bytes", "cow_copied_bytes")
_RUN_COPIES = ("prefix_copied_bytes", "cow_copied_bytes")


def _copies(events, start: int, stop: int, fields: tuple[str, ...]) -> int:
    """Sum of ``fields`` over events ``start:stop`` of an :class:`~onnxkv.events.EventLog`."""
    return sum(getattr(events[i], f) for i in range(start, stop) for f in fields)


@renamed_argument("beam_search", "session_or_model", "model")
def beam_search(
    model,
    input_ids,
    num_beams: int,
    max_new_tokens: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    eos_token_id: int | list[int] | None = None,
    num_return_sequences: int = 1,
    attention_mask=None,
    pad_token_id: int | None = None,
    threads: int | None = None,
    cache: CacheConfig | str | None = None,
    callback: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
    *,
    do_sample: bool = False,
    **deprecated,
) -> BeamSearchResult:
    """Beam search, as transformers' ``generate(num_beams=..., do_sample=False)`` does it.

    Args:
        model: a :class:`~onnxkv.Session`, or anything it accepts (then a session
            is built with ``threads``).  ``session_or_model=`` is its deprecated keyword.
        input_ids: int [B, L] or [L] prompt ids, left-padded when rows differ in length.
        num_beams: k ≥ 1 beams per prompt row; prompt rows × k at most :data:`MAX_BEAM_ROWS` (65,536).
        max_new_tokens: at most this many generated tokens (≥ 1).
        length_penalty: exponent of the generated length dividing a hypothesis' log-probability.
        early_stopping: ``True``, ``False`` or ``"never"`` (see :class:`BeamScorer`).
        eos_token_id: id(s) ending a hypothesis (default: the model's).
        num_return_sequences: hypotheses returned per row, 1 ≤ n ≤ k.
        attention_mask: 0/1 [B, L]; zeros mark left padding.
        pad_token_id: fills the prompt's padding and every hypothesis after its
            end (default: the model's pad id, else the first EOS, else 0).
        cache: a :class:`~onnxkv.CacheConfig` or a kind: ``"paged"`` (prefill once on a
            paged state, beams share its pages, ``State.reorder`` per step; the
            config's block_size, max_pages, capacity and kv_format apply) or
            ``"tensor"`` (caches as tensors, gathered per beam with ``np.take``
            per step).  None: paged when the model's cache runs in place, else tensors.
        callback: called after every step as ``callback(step, tokens, beam_idx)``
            with the k*B running beams' new tokens and the rows they continue.
        do_sample: must be False: beam search is deterministic (beam sampling is not supported).
        deprecated: ``block_size=`` (now ``CacheConfig(kind="paged", block_size=...)``)
            works for one release with a DeprecationWarning.

    Returns:
        A :class:`BeamSearchResult`.  With the session's event log on
        (``Session(..., events=True)``) it also carries the copy counters.

    Raises:
        InputError: a bad argument (the message names it and its value).
    """
    api = "beam_search"
    unknown = sorted(set(deprecated) - {"block_size"})
    if unknown:
        raise TypeError(f"beam_search() got an unexpected keyword argument {unknown[0]!r}")
    if bool_arg(api, "do_sample", do_sample):
        raise InputError(
            "beam_search: do_sample=True (beam sampling) is not supported; beam search is "
            "deterministic (use do_sample=False, or onnxkv.generate(do_sample=True) to sample)"
        )
    k = int_arg(api, "num_beams", num_beams, 1)
    if k > MAX_BEAM_ROWS:
        raise InputError(f"beam_search: num_beams must be at most {MAX_BEAM_ROWS}, got {k}")
    max_new = int_arg(api, "max_new_tokens", max_new_tokens, 1)
    n_ret = int_arg(api, "num_return_sequences", num_return_sequences, 1)
    if n_ret > k:
        raise InputError(f"beam_search: num_return_sequences {n_ret} exceeds num_beams {k}")
    length_penalty = real_arg(api, "length_penalty", length_penalty)
    if abs(length_penalty) * math.log(max_new + 1) > _LENGTH_EXPONENT_LIMIT:
        raise InputError(
            f"beam_search: length_penalty {length_penalty} makes the length factor "
            f"(max_new_tokens + 1) ** length_penalty = {max_new + 1} ** {length_penalty} leave the "
            "float32 range"
        )
    if not (
        early_stopping is True
        or early_stopping is False
        or (isinstance(early_stopping, str) and early_stopping == "never")
    ):
        raise InputError(f"beam_search: early_stopping must be True, False or 'never', got {early_stopping!r}")
    if "block_size" in deprecated:
        int_arg(api, "block_size", deprecated["block_size"], 1)
    request = cache_request(api, cache, ("paged", "tensor"), deprecated, depth=_DEPTH)
    callback_arg(api, "callback", callback)
    sess = as_session(api, "model", model, threads)
    model = sess.model
    vocab = sess.token_limit
    cache = request.kind("paged" if sess.bindings else "tensor")
    if cache == "paged" and not sess.bindings:
        raise InputError(
            f"beam_search: cache kind 'paged' needs a model whose KV cache onnxkv runs in place; this "
            f"model's cache is '{model.convention.kind}' (use cache='tensor' or None)"
        )
    ids, mask, lengths = check_prompt(api, input_ids, attention_mask, vocab)
    eos = token_ids(api, "eos_token_id", eos_token_id, model.eos_token_id, vocab)
    if pad_token_id is None:
        pad_token_id = model.pad_token_id if model.pad_token_id is not None else (eos[0] if eos else 0)
    pad_token_id = token_id(api, "pad_token_id", pad_token_id, vocab)
    B, L = ids.shape
    check_length(api, sess, L, max_new)
    if B * k > MAX_BEAM_ROWS:
        raise InputError(
            f"beam_search: {B} row(s) * num_beams {k} = {B * k} beam rows; at most {MAX_BEAM_ROWS} run together"
        )
    table = 2 * B * k * max_new * np.dtype(np.int64).itemsize
    if table > MAX_TENSOR_BYTES:
        raise InputError(
            f"beam_search: {B} row(s) * num_beams {k} * max_new_tokens {max_new} hypotheses need "
            f"{table} bytes, more than this machine's memory ({MAX_TENSOR_BYTES} bytes)"
        )
    scorer = BeamScorer(B, k, max_new, length_penalty, early_stopping, eos, pad_token_id)
    if vocab is not None and k * vocab < scorer.keep:
        raise InputError(
            f"beam_search: num_beams {k} * vocab {vocab} is below the {scorer.keep} candidates "
            "beam search keeps per row"
        )
    ids = np.where(mask == 1, ids, pad_token_id)

    builder = FeedBuilder(sess.plan.inputs, model, ids, lengths, pad_token_id, thread_cache=cache == "tensor")
    beams = _PagedBeams(sess, request.state_keywords("paged")) if cache == "paged" else _TensorBeams(sess)
    log = sess.events if sess.events.enabled else None
    logits_name = model.io.logits
    step_seconds: list[float] = []
    reorder_copied: list[int] | None = [] if cache == "tensor" or log is not None else None
    cache_copied: list[int] | None = [] if log is not None else None
    committed: list[int] = []
    try:
        feeds, read = builder.first()
        t0 = time.perf_counter()
        out = beams.run(feeds, logits_at=read)  # each row's logits at its last token only: [B, 1, V]
        logits = out[logits_name]
        logits = logits[np.arange(B), read if logits.shape[1] > 1 else 0] if logits.ndim == 3 else logits
        expand = np.repeat(np.arange(B), k)
        n0 = len(log) if log is not None else 0
        out, prompt_copied = beams.reorder(out, expand)
        builder.select_rows(expand)
        if log is not None and prompt_copied is None:
            prompt_copied = _copies(log, n0, len(log), _ALL_COPIES)
        prompt_seconds = time.perf_counter() - t0
        logits = logits[expand]
        with sess.decode_loop(B * k):
            while True:
                t0 = time.perf_counter()
                tokens, beam_idx = scorer.process(log_softmax(logits))
                if callback is not None:
                    callback(scorer.step - 1, tokens, beam_idx)
                if scorer.done:
                    break
                n0 = len(log) if log is not None else 0
                out, moved = beams.reorder(out, beam_idx)
                builder.select_rows(beam_idx)
                n1 = len(log) if log is not None else 0
                out = beams.run(builder.next(tokens, out))
                logits = out[logits_name][:, -1] if out[logits_name].ndim == 3 else out[logits_name]
                step_seconds.append(time.perf_counter() - t0)
                if reorder_copied is not None:
                    reorder_copied.append(moved if moved is not None else _copies(log, n0, n1, _ALL_COPIES))
                if cache_copied is not None:
                    cache_copied.append(_copies(log, n1, len(log), _RUN_COPIES))
                committed.append(beams.committed_bytes(out))
    finally:
        beams.close()
    gen, scores, _ = scorer.finalize(n_ret)
    sequences = np.concatenate([np.repeat(ids, n_ret, axis=0), gen], axis=1)
    return BeamSearchResult(
        sequences, scores, prompt_seconds, prompt_copied, step_seconds, reorder_copied, cache_copied, committed, k, B
    )
