"""Feeds of the static-cache form (onnxkv.zoo.tensorscatter) for tests that choose each row's cache slots."""

from __future__ import annotations

import numpy as np


def static_feeds(capacity: int, tokens, write_indices, shown, positions=None) -> dict:
    """One run's feeds: ``tokens`` [B, S] at positions ``positions`` [B] on (default: ``write_indices``), written
    at cache slots ``write_indices`` [B]; row b's mask shows the slots ``[0, shown[b])`` of the ``capacity``."""
    tokens = np.asarray(tokens, np.int64)
    b, s = tokens.shape
    w = np.asarray(write_indices, np.int64)
    mask = np.zeros((b, capacity), np.int64)
    for r in range(b):
        mask[r, : shown[r]] = 1
    first = w if positions is None else np.asarray(positions, np.int64)
    return {
        "input_ids": tokens,
        "attention_mask": mask,
        "position_ids": first[:, None] + np.arange(s)[None, :],
        "write_indices": w,
    }
