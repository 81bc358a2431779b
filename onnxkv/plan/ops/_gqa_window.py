"""GroupQueryAttention's window-sized caches (``sliding_window_cache=1``), ONNX Runtime 1.32 CPU layout.

A layer whose queries see only the ``W = local_window_size`` most recent keys
may keep past and present buffers of a fixed capacity ``C >= W`` (the past's
dim 2; the present has the same shape) instead of the whole sequence.
``seqlens_k`` stays absolute (``P + S - 1`` for ``P`` positions before the
step's ``S``); rotary uses those absolute positions.  The buffer holds the
most recent positions at rows ``[0, end(P))``:

* ``end(P) = P`` while ``P <= C``; after that whole blocks of
  ``gap = C - W + 1`` rows are reclaimed at once:
  ``end(P) = P - gap * ceil((P - C) / gap)`` (so ``W <= end <= C``);
* a step attends over the ``end(P)`` resident rows followed by its ``S`` new
  rows (cache-relative positions: the window and causal masks depend only on
  distances, so the result is the full-sequence result);
* the present holds the last ``end(P + S)`` of those rows at ``[0, end(P + S))``
  and zeros after them (ONNX Runtime leaves those rows unspecified; no query
  reads them).

This module computes that layout; :mod:`onnxkv.plan.ops.attention_gqa` runs
the attention.  A state (which keeps whole caches, in absolute positions)
does not use it: there the node attends with its window over the state's
cache, with the same outputs.
"""

from __future__ import annotations

import numpy as np

__all__ = ["window_end", "stage", "keep"]


def window_end(past: np.ndarray, capacity: int, window: int) -> np.ndarray:
    """Resident rows ``end(P)`` (int64, shape of ``past``) of a buffer of ``capacity`` after ``past`` positions."""
    past = np.asarray(past, np.int64)
    gap = capacity - window + 1
    reclaimed = gap * ((past - capacity + gap - 1) // gap)
    return np.where(past <= capacity, past, past - reclaimed)


def stage(buffer: np.ndarray, new: np.ndarray, resident: np.ndarray) -> np.ndarray:
    """[B, H, max(resident) + S, D] float32: row ``b``'s ``resident[b]`` buffer rows, then its ``S`` new rows.

    Rows after ``resident[b] + S`` are zeros (the attention reads each row's
    first ``resident[b] + S`` only).
    """
    b, h, s, d = new.shape
    staged = np.zeros((b, h, int(resident.max(initial=0)) + s, d), np.float32)
    for row in range(b):
        r = int(resident[row])
        staged[row, :, :r] = buffer[row, :, :r]
        staged[row, :, r : r + s] = new[row]
    return staged


def keep(staged: np.ndarray, resident: np.ndarray, s: int, kept: np.ndarray, present: np.ndarray) -> None:
    """Write each row's last ``kept[b]`` staged rows (of ``resident[b] + s``) to ``present[b, :, :kept[b]]``,
    zeros after them."""
    present.fill(0)
    for row in range(staged.shape[0]):
        end, n = int(resident[row]) + s, int(kept[row])
        present[row, :, :n] = staged[row, :, end - n : end]
