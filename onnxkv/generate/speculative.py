"""``onnxkv.speculative_generate``: speculative decoding with a draft model or prompt lookup.

Each step proposes up to ``num_draft_tokens`` tokens cheaply, then the target
model scores ``[last accepted token] + proposal`` in one multi-token run of its
persistent state.  The accepted prefix of the proposal stays in the caches;
the rest is dropped with ``State.truncate`` (lengths only, no payload copy)
and :meth:`FeedBuilder.rewind <onnxkv.generate.feeds.FeedBuilder.rewind>`.

Proposals come from

* a **draft model** (same vocabulary): it runs autoregressively on its own
  state, catching up first on the tokens it has not seen (the target's
  correction or bonus token of the previous step);
* **prompt lookup** (no draft): the tokens that followed the most recent
  earlier occurrence of the last ``prompt_lookup_ngram`` tokens, falling back
  to shorter n-grams down to 1; no match proposes nothing (a plain one-token
  target step).

With ``tree=(k, depth)`` the draft proposes a tree instead of one chain: its
``k`` most likely next tokens, each continued greedily to ``depth`` tokens.
The target's paged state is forked into ``k`` rows (``State.reorder``: page
tables shared, no payload copied), every branch is verified in one run of
batch ``k``, and the row of the longest accepted branch is kept (the first
such, so the draft's own chain wins ties).

Greedy decoding accepts a proposed token when it is the target's argmax, so
the output is token-identical to greedy :func:`onnxkv.generate`.  Over pages
that a ``kv_format`` converts when full, a verification runs in pieces that end
where a conversion falls due (:meth:`~onnxkv.generate.verification.Stepper.pieces`), each made only while
the proposal is accepted, so every token reads the formats its own run would.  Sampling
uses the standard rejection rule (:func:`accept_or_resample`), which makes
every emitted token distributed exactly as the target's warped distribution.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from onnxkv._deprecation import renamed_argument
from onnxkv._kernels.sampling import top_indices
from onnxkv.errors import InputError
from onnxkv.generate.arguments import as_session, callback_arg, check_length, check_prompt, int_arg, token_ids
from onnxkv.generate.lookup import MAX_INDEXED_NGRAM, PromptIndex, prompt_lookup
from onnxkv.generate.sampling import SamplingConfig, probabilities, sampling_arguments, select_next
from onnxkv.generate.verification import Stepper, Verification, logit_rows
from onnxkv.runtime.cache_config import LEGACY_KEYWORDS, CacheConfig, cache_request

if TYPE_CHECKING:
    import os

    import onnx

    from onnxkv.model.load import Model
    from onnxkv.runtime.session import Session

__all__ = ["speculative_generate", "SpeculativeResult", "accept_or_resample", "prompt_lookup"]

API = "speculative_generate"
#: Frames from speculative_generate's body to its caller's (the renamed_argument wrapper is one).
_DEPTH = 2
#: Largest ``tree=(branches, depth)``: the rows of one verification run and the tokens of each.
MAX_BRANCHES, MAX_DEPTH = 16, 15


@dataclass
class SpeculativeResult:
    """What :func:`speculative_generate` returns.

    Attributes:
        sequences: int64 [1, L + new_tokens]: the prompt then the new tokens.
        new_tokens: number of tokens generated (≤ max_new_tokens; fewer after an EOS).
        proposed: draft tokens the target verified.
        accepted: of those, the ones the target accepted.
        target_runs / draft_runs: runs of each model's state (prefill included).
        seconds: wall time from the first run to the last token (prefill included).
    """

    sequences: np.ndarray
    new_tokens: int
    proposed: int
    accepted: int
    target_runs: int
    draft_runs: int
    seconds: float

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed (0.0 when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_second(self) -> float:
        """new_tokens / seconds (0.0 when nothing ran)."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def _draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn from the (unnormalised, non-negative, not all 0) weights ``p`` [V]: the first whose
    cumulative sum passes the draw, so never one of weight 0."""
    cum = np.cumsum(p)
    return min(int((cum <= rng.random() * cum[-1]).sum()), int(np.flatnonzero(p)[-1]))


def accept_or_resample(p: np.ndarray, q: np.ndarray, x: int, rng: np.random.Generator) -> tuple[bool, int]:
    """The speculative rejection rule for one proposed token.

    ``x`` was drawn from the draft distribution ``q`` [V]; ``p`` [V] is the
    target distribution at the same position (both float, summing to 1).
    ``x`` is accepted with probability ``min(1, p[x] / q[x])``; otherwise a
    token is drawn from ``normalize(max(0, p - q))``.  Either way the returned
    token is distributed as ``p``.  Uses one or two draws of ``rng``.

    Returns:
        (accepted, token): ``token == x`` when accepted.
    """
    if rng.random() * q[x] < p[x]:
        return True, int(x)
    residual = np.maximum(p - q, 0.0)
    return False, _draw(residual if residual.sum() > 0 else p, rng)


def _check_model(sess, role: str) -> None:
    """The model must keep a truncatable in-place cache on a state."""
    kind = sess.model.convention.kind
    if kind == "tensor_scatter" or not sess.bindings:
        raise InputError(
            f"{API}: the {role} model's cache convention is '{kind}'; speculative decoding rolls "
            "rejected tokens back with State.truncate, which needs a growing in-place KV cache "
            "(a static TensorScatter cache, declared persistent bindings or no cache cannot be truncated)"
        )


@renamed_argument(API, "target", "model")
def speculative_generate(
    model: Session | Model | onnx.ModelProto | str | os.PathLike,
    input_ids: np.ndarray | list[int],
    draft: Session | Model | onnx.ModelProto | str | os.PathLike | None = None,
    num_draft_tokens: int = 4,
    max_new_tokens: int = 32,
    prompt_lookup_ngram: int = 3,
    eos_token_id: int | list[int] | None = None,
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    threads: int | None = None,
    cache: CacheConfig | str | None = None,
    callback: Callable[[int, np.ndarray], None] | None = None,
    tree: tuple[int, int] | None = None,
    **deprecated,
) -> SpeculativeResult:
    """Generate up to ``max_new_tokens`` tokens after one prompt with speculative decoding.

    Args:
        model: the target model, whose distribution is sampled: a :class:`~onnxkv.Session`
            or anything :class:`~onnxkv.Session` accepts (built with ``threads``).
            ``target=`` is its deprecated keyword.
        input_ids: int [1, L] or [L] prompt ids (batch 1 only).
        draft: a smaller model of the same vocabulary (Session, Model or path)
            that proposes tokens; None proposes by prompt lookup.
        num_draft_tokens: tokens proposed per step at most (≥ 1); never more
            than the remaining budget minus one.
        max_new_tokens: exact number of tokens generated unless an EOS comes first (≥ 0).
        prompt_lookup_ngram: longest n-gram matched by prompt lookup (≥ 1).
        eos_token_id: id(s) that end generation (default: the target's genai_config);
            the EOS is emitted, nothing after it.
        do_sample: greedy unless True (greedy output is identical to greedy
            :func:`onnxkv.generate`), as in :func:`onnxkv.generate` (see
            :func:`~onnxkv.generate.sampling.sampling_arguments`).
        temperature: logits are divided by it before a draw (None: 1.0); with
            ``top_k``, ``top_p`` and ``seed``, as in :func:`onnxkv.generate`.
            Sampling warps target and draft distributions alike.
        top_k: sample among the ``top_k`` highest logits only (None: all).
        top_p: then among the smallest set whose probability reaches ``top_p`` (None: all).
        seed: seeds the draws: the same seed gives the same tokens.
        cache: a :class:`~onnxkv.CacheConfig` or a kind, ``"contiguous"`` (None) or
            ``"paged"``, for both states (``"tensor"`` cannot be truncated).  A
            contiguous cache without ``initial_capacity`` holds the whole output.
        callback: called after each new token as ``callback(step, tokens[1])``.
        tree: ``(k, depth)``: verify a tree of ``k`` branches of ``depth`` draft tokens per step
            (the draft's ``k`` most likely next tokens, each continued greedily) in one run of the
            target forked into ``k`` rows; ``depth`` replaces ``num_draft_tokens``.  Needs a draft,
            greedy decoding and a paged target cache (None: paged; the draft's stays contiguous).
        deprecated: ``state_options=`` (a mapping of the deprecated
            ``Session.new_state`` keywords) works for one release with a
            DeprecationWarning.

    Returns:
        A :class:`SpeculativeResult`.

    Raises:
        InputError: bad arguments (the message names the argument and its
            value), a batch larger than 1, a draft whose vocabulary (or logits
            width) differs from the target's, a model whose cache cannot be
            truncated (static TensorScatter caches), or a tree without a draft,
            with sampling or with a contiguous target cache.
    """
    unknown = sorted(set(deprecated) - {"state_options"})
    if unknown:
        raise TypeError(f"speculative_generate() got an unexpected keyword argument {unknown[0]!r}")
    max_new_tokens = int_arg(API, "max_new_tokens", max_new_tokens, 0)
    num_draft_tokens = int_arg(API, "num_draft_tokens", num_draft_tokens, 1)
    ngram = int_arg(API, "prompt_lookup_ngram", prompt_lookup_ngram, 1)
    cfg = sampling_arguments(API, do_sample, temperature, top_k, top_p, seed, depth=_DEPTH)
    callback_arg(API, "callback", callback)
    branches, num_draft_tokens = _tree_arg(tree, draft, cfg, num_draft_tokens)
    # a step proposes fewer than max_new_tokens tokens: more sizes nothing (the states' rollback included)
    num_draft_tokens = min(num_draft_tokens, max(1, max_new_tokens))
    request = cache_request(
        API,
        cache,
        ("contiguous", "paged"),
        _state_options(deprecated),
        depth=_DEPTH,
        given_as="state_options" if "state_options" in deprecated else None,
    )
    tsess = as_session(API, "model", model, threads)
    dsess = None if draft is None else as_session(API, "draft", draft, threads)
    model = tsess.model
    vocab = tsess.token_limit
    if dsess is not None:
        for what, t, d in (
            ("vocabulary", model.vocab_size, dsess.model.vocab_size),
            ("token id limit", vocab, dsess.token_limit),
        ):
            if t is not None and d is not None and t != d:
                raise InputError(
                    f"{API}: the draft model's {what} is {d}, the target's {t}; the draft must share "
                    "the target's vocabulary"
                )
    ids, _, _ = check_prompt(API, input_ids, None, vocab)
    if ids.shape[0] != 1:
        raise InputError(f"{API}: only batch 1 is supported, got input_ids of shape {ids.shape}")
    eos = set(token_ids(API, "eos_token_id", eos_token_id, model.eos_token_id, vocab))
    L = ids.shape[1]
    for role, s in (("target", tsess), ("draft", dsess)):
        if s is None:
            continue
        _check_model(s, role)
        check_length(API, s, L, max_new_tokens, f"the {role} model's")
    options = request.state_keywords("contiguous", initial_capacity=L + max_new_tokens + 1)
    target_options = request.state_keywords("paged" if branches else "contiguous", L + max_new_tokens + 1)
    if branches and target_options["cache"] != "paged":
        raise InputError(
            f"{API}: tree={tree!r} forks the target's page tables: cache must be 'paged' or None, got "
            f"{target_options['cache']!r}"
        )

    seq = list(ids[0].tolist())
    proposed = accepted = 0
    if max_new_tokens == 0:
        return SpeculativeResult(ids.copy(), 0, 0, 0, 0, 0, 0.0)
    # a step feeds at most num_draft_tokens + 1 tokens per row (the tree's depth + 1) and takes back as many
    tgt = Stepper(tsess, ids, target_options, "target", num_draft_tokens + 1)
    # proposals of prompt lookup: from an index of the sequence's n-grams (a search per step costs O(length))
    lookup = PromptIndex(ngram) if dsess is None and ngram <= MAX_INDEXED_NGRAM else None
    drf = None
    try:
        drf = None if dsess is None else Stepper(dsess, ids, options, "draft", num_draft_tokens + 1)
        t0 = time.perf_counter()
        last = logit_rows(tgt.prefill(), tsess, 1, "target")[0]
        if drf is not None:
            width = logit_rows(drf.prefill(), dsess, 1, "draft").shape[-1]
            if width != last.shape[-1]:
                raise InputError(
                    f"{API}: the draft model's logits have width {width}, the target's "
                    f"{last.shape[-1]}; the draft must share the target's vocabulary"
                )

        def emit(token: int) -> bool:
            """Append ``token``; True when generation is over."""
            seq.append(token)
            step = len(seq) - L - 1
            if callback is not None:
                callback(step, np.array([token], dtype=np.int64))
            return token in eos or step == max_new_tokens - 1

        done = emit(int(select_next(last[None], cfg)[0]))
        with tsess.decode_loop(max(1, branches) * (num_draft_tokens + 1)):
            while not done:
                k = min(num_draft_tokens, L + max_new_tokens - len(seq) - 1)
                qs = None
                if branches and k:
                    proposal, rows, verified = _tree_step(tgt, drf, dsess, tsess, seq, branches, k, eos)
                    proposed += verified
                else:
                    if drf is None:
                        if lookup is None:
                            proposal = prompt_lookup(np.array(seq, dtype=np.int64), ngram, k)
                        else:
                            lookup.extend(seq[len(lookup) :])
                            proposal = lookup.propose(k)
                    else:
                        proposal, qs = _propose(drf, dsess, seq, k, cfg, eos)
                    # The target caches seq[:-1]; seq[-1] is verified together with the proposal.
                    rows = Verification(tgt, tsess, np.array([seq[-1], *proposal.tolist()], dtype=np.int64))
                    proposed += proposal.shape[0]
                for i, x in enumerate(proposal.tolist()):
                    if cfg.greedy:
                        token = int(np.argmax(rows[i]))
                        ok = token == x
                    else:
                        p = probabilities(rows[i][None], cfg)[0]
                        if qs is None:
                            q = np.zeros_like(p)
                            q[x] = 1.0
                        else:
                            q = qs[i]
                        ok, token = accept_or_resample(p, q, x, cfg.rng)
                    accepted += ok
                    done = emit(token)
                    if done or not ok:
                        break
                else:  # all accepted: the bonus token
                    done = emit(int(select_next(rows[proposal.shape[0]][None], cfg)[0]))
                if not done:  # keep seq[:-1]: the accepted tokens; drop the rejected ones (and the draft's)
                    tgt.truncate(len(seq) - 1)
                    if drf is not None:
                        drf.truncate(len(seq) - 1)
        seconds = time.perf_counter() - t0
    finally:
        tgt.state.close()
        if drf is not None:
            drf.state.close()
    return SpeculativeResult(
        np.array([seq], dtype=np.int64),
        len(seq) - L,
        proposed,
        accepted,
        tgt.runs,
        0 if drf is None else drf.runs,
        seconds,
    )


def _state_options(deprecated: dict) -> dict:
    """The deprecated ``state_options`` mapping's State keywords (empty when not given)."""
    options = deprecated.get("state_options")
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise InputError(
            f"{API}: state_options must be a mapping of Session.new_state arguments or None, got "
            f"{type(options).__name__}"
        )
    allowed = (*LEGACY_KEYWORDS, "initial", "allocator")
    unknown = sorted(map(repr, set(options) - set(allowed)))
    if unknown:
        raise InputError(
            f"{API}: state_options has {', '.join(unknown)}; expected arguments of Session.new_state "
            f"other than cache: {sorted(allowed)}"
        )
    return dict(options)


def _propose(
    drf: Stepper, dsess, seq: list[int], k: int, cfg: SamplingConfig, eos: set[int]
) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """Run the draft on the tokens of ``seq`` it has not cached, then ``k - 1`` more single tokens.

    Greedy, those ``k - 1`` steps run as one call into C where the draft's state can
    (:meth:`Stepper.greedy`), together with the catch-up when that is one token (it is two, the last
    proposed token and the bonus token, only after a proposal accepted whole).  Returns the proposal
    (int64 [≤ k]; it stops after an EOS) and, when sampling, each proposed token's draft distribution
    (float64 [V]).
    """
    if k < 1:
        return np.zeros(0, dtype=np.int64), None if cfg.greedy else []
    pending = np.array(seq[drf.length :], dtype=np.int64)
    if cfg.greedy and pending.shape[0] == 1:
        return np.array(drf.greedy(int(pending[0]), k, eos), dtype=np.int64), None
    if cfg.greedy:
        x = int(np.argmax(logit_rows(drf.feed(pending), dsess, 1, "draft")[0]))
        tokens = [x] if k == 1 or x in eos else [x, *drf.greedy(x, k - 1, eos)]
        return np.array(tokens, dtype=np.int64), None
    tokens: list[int] = []
    dists: list[np.ndarray] = []
    while True:
        q = probabilities(logit_rows(drf.feed(pending), dsess, 1, "draft"), cfg)[0]
        x = _draw(q, cfg.rng)
        dists.append(q)
        tokens.append(x)
        if len(tokens) == k or x in eos:
            return np.array(tokens, dtype=np.int64), dists
        pending = np.array([x], dtype=np.int64)


def _tree_arg(tree, draft, cfg: SamplingConfig, num_draft_tokens: int) -> tuple[int, int]:
    """``(branches, depth)`` of the ``tree`` argument, or ``(0, num_draft_tokens)`` without one."""
    if tree is None:
        return 0, num_draft_tokens
    if (
        not isinstance(tree, (tuple, list))
        or len(tree) != 2
        or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in tree)
        or not 1 <= tree[0] <= MAX_BRANCHES
        or not 1 <= tree[1] <= MAX_DEPTH
    ):
        raise InputError(
            f"{API}: tree must be (branches, depth) with 1 <= branches <= {MAX_BRANCHES} and 1 <= depth <= "
            f"{MAX_DEPTH}, got {tree!r}"
        )
    if draft is None:
        raise InputError(f"{API}: tree={tuple(tree)!r} needs a draft model (its most likely tokens are the branches)")
    if not cfg.greedy:
        raise InputError(f"{API}: tree={tuple(tree)!r} verifies greedily; do_sample must be False")
    return int(tree[0]), int(tree[1])


def _most_likely(logits: np.ndarray, k: int) -> list[int]:
    """The ``k`` most likely tokens of a row of logits, best first, ties to the lower id (a stable sort's
    order, NaN last): the one-pass kernel for a float32 or float16 row without NaN, else the sort."""
    if logits.dtype in (np.float32, np.float16) and not np.isnan(logits).any():
        return top_indices(np.ascontiguousarray(logits, np.float32)[None], min(k, logits.size))[0].tolist()
    return np.argsort(-logits, kind="stable")[:k].tolist()


def _tree_step(
    tgt: Stepper, drf: Stepper, dsess, tsess, seq: list[int], k: int, depth: int, eos: set[int]
) -> tuple[np.ndarray, np.ndarray, int]:
    """Propose a tree of ``k`` branches of up to ``depth`` tokens, verify them in one run of the target forked
    into ``k`` rows, and keep the row of the branch with the longest accepted prefix (the first such).

    The draft catches up on the tokens of ``seq`` it has not cached; branch ``i`` starts with its ``i``-th
    most likely next token (branch 0 is its greedy chain) and continues greedily (stopping after an EOS).
    Returns the kept branch (int64 [n]), the target's logits at ``seq[-1]`` and after each of its tokens
    (float [≥ n + 1, V]), and how many tokens the target verified; the draft is left at ``seq``.
    """
    first = logit_rows(drf.feed(np.array(seq[drf.length :], dtype=np.int64)), dsess, 1, "draft")[0]
    root = drf.length
    branches = []
    for i, x in enumerate(_most_likely(first, k)):
        if i:
            drf.truncate(root)
        branches.append([x] if depth == 1 or x in eos else [x, *drf.greedy(x, depth - 1, eos)])
    drf.truncate(root)
    width = max(map(len, branches))
    # Rows verify [seq[-1], branch..., padding]: a branch shorter than the widest ended with an EOS, after
    # which nothing is emitted, so what pads it is never read.
    chunk = np.array([[seq[-1], *b, *[b[-1]] * (width - len(b))] for b in branches], dtype=np.int64)
    tgt.fork(len(branches))
    parts, fed = [], 0
    # in runs that end where a page conversion falls due (Stepper.pieces); the next runs only while some
    # branch has matched every token so far, so the row kept never ends before a conversion made
    for size in tgt.pieces(width + 1):
        out = tgt.state.run(tgt.builder.next(chunk[:, fed : fed + size], None), tgt.fetch)
        tgt.runs += 1
        logits = out[tsess.model.io.logits]
        if logits.ndim != 3 or logits.shape[1] < size:
            raise InputError(
                f"{API}: the target model returned logits of shape {logits.shape} for a {size}-token run; "
                "verification needs the logits of every fed position"
            )
        parts.append(logits[:, logits.shape[1] - size :])
        fed += size
        if fed <= width and not (np.concatenate(parts, axis=1).argmax(axis=-1) == chunk[:, 1 : fed + 1]).all(1).any():
            break
    rows = np.concatenate(parts, axis=1)
    guesses = rows.argmax(axis=-1)
    accepted = [next((j for j, x in enumerate(b) if guesses[i, j] != x), len(b)) for i, b in enumerate(branches)]
    best = int(np.argmax(accepted))
    tgt.keep(best)
    return np.array(branches[best], dtype=np.int64), rows[best], sum(map(len, branches))
