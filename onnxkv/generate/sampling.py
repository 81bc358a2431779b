"""Next-token selection: greedy, temperature, top-k and top-p (nucleus) sampling."""

from __future__ import annotations

import numpy as np

from onnxkv._deprecation import warn_deprecated
from onnxkv.generate.arguments import bool_arg, optional_int, real_arg

__all__ = ["SamplingConfig", "select_next", "sampling_arguments"]


class SamplingConfig:
    """Validated sampling settings.

    ``temperature == 0`` is greedy (argmax; ties pick the lowest id).  Otherwise
    logits are divided by ``temperature``, restricted to the ``top_k`` highest
    and then to the smallest set whose probability reaches ``top_p``, and a
    token is drawn with a NumPy ``Generator`` seeded by ``seed`` (repeatable).
    """

    def __init__(
        self,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        api: str = "generate",
    ) -> None:
        temperature = real_arg(api, "temperature", temperature, 0.0)
        top_k = optional_int(api, "top_k", top_k, 1)
        top_p = None if top_p is None else real_arg(api, "top_p", top_p, 0.0, 1.0, low_open=True)
        seed = optional_int(api, "seed", seed, 0)
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_arguments(
    api: str, do_sample, temperature, top_k, top_p, seed, *, legacy_temperature: bool = False, depth: int = 1
) -> SamplingConfig:
    """The SamplingConfig of the sampling arguments every generation API shares, as transformers reads them.

    ``do_sample`` False is greedy (``temperature``, ``top_k`` and ``top_p``
    are checked but not used); True draws from the logits divided by
    ``temperature`` (> 0; None: 1.0), kept to the ``top_k`` best (None or 0:
    all) and to the nucleus of probability ``top_p`` (None or 1.0: all), from
    a Generator seeded by ``seed``.

    ``legacy_temperature`` (``generate``): a ``temperature`` > 0 given without
    ``do_sample=True`` samples as ``generate`` did before it took
    ``do_sample``, with a DeprecationWarning (``depth``: see
    :func:`onnxkv._deprecation.warn_deprecated`).
    """
    do_sample = bool_arg(api, "do_sample", do_sample)
    if temperature is not None:
        temperature = real_arg(api, "temperature", temperature, 0.0, low_open=do_sample)
    top_k = optional_int(api, "top_k", top_k, 0)
    if top_p is not None:
        real_arg(api, "top_p", top_p, 0.0, 1.0, low_open=True)
    if not do_sample and legacy_temperature and temperature is not None and temperature > 0.0:
        warn_deprecated(
            f"{api}: temperature={temperature} without do_sample=True samples for one more release; "
            "pass do_sample=True to sample (without it, decoding will be greedy and temperature "
            "ignored, as in transformers and speculative_generate)",
            depth + 1,
        )
        do_sample = True
    if not do_sample:
        return SamplingConfig(0.0, None, None, seed, api=api)
    return SamplingConfig(1.0 if temperature is None else temperature, top_k or None, top_p, seed, api=api)


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
