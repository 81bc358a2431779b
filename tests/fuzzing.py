"""Budgets of the fuzz and property tests: small in CI, larger on request.

Every randomized test of the suite takes its size from here, so that one
environment variable turns the whole suite into a longer fuzzing run:

* ``ONNXKV_FUZZ_SCALE=N`` (default 1) multiplies every budget by ``N``
  (Hypothesis ``max_examples``, stateful step counts, plain random loops);
* Hypothesis runs the ``"ci"`` profile (derandomized, so a CI failure
  reproduces) unless ``ONNXKV_FUZZ_SCALE`` is above 1, which loads the
  ``"fuzz"`` profile (random seeds: each run explores new inputs).

Hypothesis prints the failing example of a property; a plain random loop
must name its seed and iteration in its failure message.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

__all__ = ["SCALE", "examples", "hypothesis_settings"]


def _scale() -> int:
    raw = os.environ.get("ONNXKV_FUZZ_SCALE", "1")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"ONNXKV_FUZZ_SCALE must be a positive int, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"ONNXKV_FUZZ_SCALE must be a positive int, got {raw!r}")
    return value


#: Multiplier of every fuzz budget (``ONNXKV_FUZZ_SCALE``).
SCALE = _scale()

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", derandomize=True, **_COMMON)
settings.register_profile("fuzz", derandomize=False, **_COMMON)
settings.load_profile("fuzz" if SCALE > 1 else "ci")


def examples(n: int) -> int:
    """``n`` scaled by ``ONNXKV_FUZZ_SCALE`` (the CI budget is ``n``)."""
    return int(n) * SCALE


def hypothesis_settings(max_examples: int, **kwargs) -> settings:
    """Hypothesis settings of the loaded profile with ``max_examples`` scaled by :data:`SCALE`."""
    return settings(max_examples=examples(max_examples), **kwargs)
