"""Oracles for the beam-search tests.

``reference_beam_search`` is a plain per-hypothesis (lists, float64) rewrite of
transformers' beam search rules, independent of onnxkv's vectorised
:class:`~onnxkv.generate.beam_search.BeamScorer`; ``full_logprobs`` recomputes a
sequence's next-token log-probabilities from scratch (no cache) with
``Session.run``.
"""

from __future__ import annotations

import numpy as np

from onnxkv.generate.feeds import FeedBuilder


def full_logprobs(session, tokens: list[int]) -> np.ndarray:
    """float64 [V] log-softmax of the logits after feeding ``tokens`` whole (empty cache)."""
    model = session.model
    ids = np.array([tokens], dtype=np.int64)
    feeds, _ = FeedBuilder(session.plan.inputs, model, ids, np.array([len(tokens)]), 0).first()
    logits = session.run(feeds, [model.io.logits])[model.io.logits].astype(np.float64)
    last = logits[0, -1] if logits.ndim == 3 else logits[0]
    shifted = last - last.max()
    return shifted - np.log(np.exp(shifted).sum())


def reference_beam_search(
    logprobs, prompt: list[int], k: int, max_new: int, length_penalty: float, early_stopping, eos: list[int]
) -> list[tuple[float, list[int]]]:
    """Finished hypotheses (score, generated tokens), best first, of one prompt row.

    ``logprobs(tokens) -> [V]``.  Assumes the vocabulary holds at least
    ``max(2, 1 + len(eos)) * k`` tokens (so beams other than the first never
    contribute at the first step).
    """
    keep = max(2, 1 + len(eos)) * k
    running: list[tuple[float, list[int]]] = [(0.0, [])]
    finished: list[tuple[float, list[int]]] = []
    improvable = True
    for t in range(max_new):
        cands = []
        for j, (score, seq) in enumerate(running):
            lp = logprobs(prompt + seq)
            cands += [(score + float(lp[v]), j, v, seq + [v]) for v in range(lp.size)]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        cands = cands[:keep]
        hit = [c[2] in eos or t + 1 == max_new for c in cands]
        full = len(finished) == k and early_stopping is True
        if improvable and not full:
            for rank, (c, h) in enumerate(zip(cands, hit)):
                if h and rank < k:
                    finished.append((c[0] / (t + 1) ** length_penalty, c[3]))
            finished = sorted(finished, key=lambda f: -f[0])[:k]
        running = [(c[0], c[3]) for c, h in zip(cands, hit) if not h][:k]
        if early_stopping == "never" and length_penalty > 0:
            best_len = max_new
        else:
            best_len = t + 1
        if len(finished) == k and running and running[0][0] / best_len**length_penalty <= finished[-1][0]:
            improvable = False
        if not improvable or (len(finished) == k and early_stopping is True) or all(hit):
            break
    return finished
