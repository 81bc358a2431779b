"""Choosing page formats: the ``FormatSelector`` protocol and the built-in policies.

A paged state stores each full page of each plane (a layer's keys or values)
in its own format (see :mod:`onnxkv.cache.formats`).  The partly filled last
page of a sequence stays in the model's native type; when a run completes
pages, the state's selector is asked, per layer and execution, which formats
the eligible pages take::

    selector(layer, past_length, k, v) -> (k_format, v_format)

``layer`` is the layer index, ``past_length`` the longest row's length before
the run, ``k``/``v`` the new keys/values [B, H, S, D] of the run (float32).
Formats are names ("float32", "float16", "bfloat16", "int8", "uint8",
"int4", "uint4", "int2", "uint2") or None for "keep native".  A selector may
define ``residual_tokens`` (default 0): only full pages whose last token is
older than ``length - residual_tokens`` are converted, so the most recent
tokens stay native.  A selector may also define ``key_channel_scales``
(default False): True gives quantized key pages one scale and zero point per
channel instead of one per head, as ``new_state(key_channel_scales=True)``
does.

Signed integer formats are quantized symmetrically (zero point 0), unsigned
ones asymmetrically (:func:`onnxkv.cache.formats.params_for`).  The
``"int8"`` policy (also named ``"int8-kivi"``) follows KIVI: keys UINT8 with
one scale and zero point per (page, head, channel), which removes each
channel's own offset (keys carry large per-channel offsets), values INT8 per
(page, head).  ``"int8-head"`` stores both planes INT8 with one symmetric
scale per (page, head): 0.25x float32, but on the embedded trained model its
logit error is about 2.5x that of ``"int8"`` and greedy decoding leaves the
float32 tokens at near-ties of the reference (``benchmarks/bench_kv_quality.py``),
so it is not the default int8 layout.  ``"residual-int8"`` keeps the newest
128 tokens native and stores older pages like ``"int8"``.  Per-channel key
pages carry the compact header of :mod:`onnxkv.cache.formats` (a float32 S
per head, then one exponent byte and one zero-point byte per channel; scales
S * 2^(-e/16), rounded up): at block size 16, 8 KV heads and head size 128 a
key page costs 0.282x float32 and the cache 0.267x, against 0.25x for
``"int8-head"``.  Pages are converted once; a page never changes format in
place (the new payload replaces the old one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from onnxkv.errors import InputError

__all__ = ["FormatSelector", "UniformPolicy", "ResidualPolicy", "make_selector", "POLICIES"]

#: ``(layer, past_length, k, v) -> (k_format, v_format)``
FormatSelector = Callable[..., tuple]


@dataclass(frozen=True)
class UniformPolicy:
    """Every full page of every layer in ``k_format`` / ``v_format`` (None: native)."""

    k_format: str | None
    v_format: str | None
    residual_tokens: int = 0
    key_channel_scales: bool = False

    def __call__(self, layer: int, past_length: int, k, v) -> tuple[str | None, str | None]:
        return self.k_format, self.v_format


@dataclass(frozen=True)
class ResidualPolicy(UniformPolicy):
    """The most recent ``residual_tokens`` native; older full pages in ``k_format`` / ``v_format``."""


#: Built-in policies by name (``new_state(kv_format=...)``, ``--kv-format``).
POLICIES: dict[str, UniformPolicy] = {
    "fp32": UniformPolicy(None, None),
    "native": UniformPolicy(None, None),
    "fp16": UniformPolicy("float16", "float16"),
    "bf16": UniformPolicy("bfloat16", "bfloat16"),
    "int8": UniformPolicy("uint8", "int8", key_channel_scales=True),
    "int8-kivi": UniformPolicy("uint8", "int8", key_channel_scales=True),
    "int8-head": UniformPolicy("int8", "int8"),
    "int4": UniformPolicy("int4", "int4"),
    "residual-int8": ResidualPolicy("uint8", "int8", 128, key_channel_scales=True),
    "residual-int4": ResidualPolicy("int4", "int4", 128),
}


def make_selector(kv_format) -> FormatSelector | None:
    """A selector from ``kv_format``: None (native pages), a policy name of :data:`POLICIES`, or a callable."""
    if kv_format is None:
        return None
    if isinstance(kv_format, str):
        if kv_format not in POLICIES:
            raise InputError(f"kv_format must be one of {sorted(POLICIES)} or a callable, got {kv_format!r}")
        policy = POLICIES[kv_format]
        return None if policy.k_format is None and policy.v_format is None else policy
    if callable(kv_format):
        r = getattr(kv_format, "residual_tokens", 0)
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise InputError(f"kv_format: residual_tokens must be a non-negative int, got {r!r}")
        c = getattr(kv_format, "key_channel_scales", False)
        if not isinstance(c, bool):
            raise InputError(f"kv_format: key_channel_scales must be a bool, got {c!r}")
        return kv_format
    raise InputError(f"kv_format must be None, a policy name or a callable, got {kv_format!r}")
