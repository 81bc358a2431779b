"""Next-token selection: greedy, temperature, top-k and top-p (nucleus) sampling."""

from __future__ import annotations

import numpy as np

from onnxkv._deprecation import warn_deprecated
from onnxkv._kernels.sampling import sample as _kernels_sample
from onnxkv.generate.arguments import bool_arg, optional_int, real_arg

__all__ = ["SamplingConfig", "select_next", "sampling_arguments"]


class SamplingConfig:
    """Validated sampling settings.

    ``temperature == 0`` is greedy (argmax; ties pick the lowest id).  Otherwise
    logits are divided by ``temperature``, restricted to the ``top_k`` highest
    and then to the smallest set whose probability reaches ``top_p``, and a
    token is drawn with a NumPy ``Generator`` seeded by ``seed`` (repeatable).
    A ``top_k`` past every id keeps them all: it is held as at most ``2**63 - 1``.
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
        self.top_k = None if top_k is None else min(top_k, 2**63 - 1)
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


def _logits(logits: np.ndarray) -> np.ndarray:
    """``logits`` as the sampling kernel takes them: float32 or float64, C-contiguous (float16 and bfloat16
    widen exactly to float32, other types to float64)."""
    if logits.dtype not in (np.float32, np.float64):
        logits = logits.astype(np.float32 if logits.dtype.itemsize <= 2 else np.float64)
    return np.ascontiguousarray(logits)


def probabilities(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """The filtered sampling distribution of each row of ``logits`` [B, V] (float64), as
    :func:`onnxkv._kernels.sampling.sample` computes it before a draw."""
    x = _logits(logits)
    p = np.empty(x.shape, np.float64)
    _kernels_sample(x, cfg.temperature, cfg.top_k, cfg.top_p, np.zeros(x.shape[0]), p)
    return p


def select_next(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """One next token id per row of ``logits`` [B, V] (int64 [B]): the argmax, or a draw of
    :func:`onnxkv._kernels.sampling.sample` with one number of ``cfg.rng`` per row."""
    if cfg.greedy:
        return np.argmax(logits, axis=-1).astype(np.int64)
    return _kernels_sample(_logits(logits), cfg.temperature, cfg.top_k, cfg.top_p, cfg.rng.random(logits.shape[0]))
