"""Next-token selection: greedy, temperature, top-k and top-p (nucleus) sampling."""

from __future__ import annotations

import math

import numpy as np

from onnxkv.errors import InputError

__all__ = ["SamplingConfig", "select_next"]


class SamplingConfig:
    """Validated sampling settings.

    ``temperature == 0`` is greedy (argmax; ties pick the lowest id).  Otherwise
    logits are divided by ``temperature``, restricted to the ``top_k`` highest
    and then to the smallest set whose probability reaches ``top_p``, and a
    token is drawn with a NumPy ``Generator`` seeded by ``seed`` (repeatable).
    """

    def __init__(self, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, api: str = "generate") -> None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating)) \
                or math.isnan(temperature) or temperature < 0:
            raise InputError(f"{api}: temperature must be a non-negative number, got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1):
            raise InputError(f"{api}: top_k must be a positive int or None, got {top_k!r}")
        if top_p is not None and (not isinstance(top_p, (int, float, np.floating)) or math.isnan(top_p)
                                  or not 0.0 < top_p <= 1.0):
            raise InputError(f"{api}: top_p must be in (0, 1] or None, got {top_p!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise InputError(f"{api}: seed must be a non-negative int or None, got {seed!r}")
        self.temperature = float(temperature)
        self.top_k = None if top_k is None else int(top_k)
        self.top_p = None if top_p is None else float(top_p)
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """The filtered sampling distribution of each row of ``logits`` [B, V] (float64)."""
    x = logits.astype(np.float64) / cfg.temperature
    v = x.shape[-1]
    if cfg.top_k is not None and cfg.top_k < v:
        kth = np.partition(x, v - cfg.top_k, axis=-1)[:, v - cfg.top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    x = x - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(axis=-1, keepdims=True)
    if cfg.top_p is not None and cfg.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        cum = np.cumsum(sorted_p, axis=-1)
        keep_sorted = (cum - sorted_p) < cfg.top_p  # always keeps the most likely token
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def select_next(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """One next token id per row of ``logits`` [B, V] (int64 [B])."""
    if cfg.greedy:
        return np.argmax(logits, axis=-1).astype(np.int64)
    p = probabilities(logits, cfg)
    u = cfg.rng.random(p.shape[0])
    cum = np.cumsum(p, axis=-1)
    ids = (cum < u[:, None]).sum(axis=-1)
    return np.minimum(ids, p.shape[-1] - 1).astype(np.int64)
