"""Prompt lookup: draft tokens copied from earlier in the sequence (speculative decoding without a draft model).

:func:`prompt_lookup` answers one query over a whole sequence (O(ngram * T));
:class:`PromptIndex` gives the same answers over a sequence that only grows, at a cost per appended token
and per query that does not depend on the sequence's length (``speculative_generate`` queries once per
step, so a search over the whole sequence each time made long contexts pay per token for their length).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["prompt_lookup", "PromptIndex", "MAX_INDEXED_NGRAM"]

#: The longest n-gram :class:`PromptIndex` indexes: it keeps ``ngram`` entries per token, so a longer
#: ``prompt_lookup_ngram`` searches with :func:`prompt_lookup` instead (same proposals).
MAX_INDEXED_NGRAM = 8


def prompt_lookup(tokens: np.ndarray, ngram: int, k: int) -> np.ndarray:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the last n-gram.

    Tries n = ``ngram`` down to 1: the last n tokens of ``tokens`` (int64 [T])
    are searched at every earlier start; the latest match proposes the tokens
    after it (at least one, at most ``k``).  Returns int64 [0] when no n-gram
    matches or ``k`` is 0.
    """
    T = tokens.shape[0]
    for n in range(min(ngram, T - 1), 0, -1):
        if k < 1:
            break
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: T - 1], n)
        hits = np.flatnonzero((windows == tokens[T - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].copy()
    return np.zeros(0, dtype=np.int64)


class PromptIndex:
    """:func:`prompt_lookup` over a sequence that only grows, answered from an index of its n-grams.

    For every n in ``1 .. ngram`` the index maps each n-gram that ends before the last token to its latest
    start: exactly the occurrences :func:`prompt_lookup` searches.  :meth:`extend` adds tokens in
    O(ngram) dictionary updates each (keys are tuples of ints); :meth:`propose` costs O(ngram + k).
    Memory: up to ``ngram`` entries per token.  The index owns its copy of the tokens (Python ints).
    """

    def __init__(self, ngram: int, tokens: Sequence[int] = ()) -> None:
        """``ngram`` in ``[1, MAX_INDEXED_NGRAM]``; ``tokens``: the sequence so far."""
        if not 1 <= ngram <= MAX_INDEXED_NGRAM:
            raise ValueError(f"PromptIndex: ngram must be in [1, {MAX_INDEXED_NGRAM}], got {ngram}")
        self.ngram = ngram
        self.tokens: list[int] = []
        self._starts: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram + 1)]  # [n]: n-gram -> start
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` (ints) to the sequence."""
        seq, starts = self.tokens, self._starts
        for token in tokens:
            seq.append(int(token))
            end = len(seq) - 1  # n-grams ending before the new last token are now searchable
            for n in range(1, min(self.ngram, end) + 1):
                starts[n][tuple(seq[end - n : end])] = end - n

    def propose(self, k: int) -> np.ndarray:
        """:func:`prompt_lookup` of the sequence so far: int64 [<= k] (empty without a match or when k < 1)."""
        seq = self.tokens
        T = len(seq)
        if k >= 1:
            for n in range(min(self.ngram, T - 1), 0, -1):
                start = self._starts[n].get(tuple(seq[T - n :]))
                if start is not None:
                    return np.array(seq[start + n : start + n + k], dtype=np.int64)
        return np.zeros(0, dtype=np.int64)
