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
channel instead of one per head, as ``CacheConfig(key_layout=KeyLayout.CHANNEL)``
does; or ``key_channel_zero_points`` (default False): True gives quantized
key pages one scale per head and one zero point per channel (the
"channel-zp" header), as ``CacheConfig(key_layout=KeyLayout.CHANNEL_ZERO_POINT)``
does.  The two are mutually exclusive.

The selector is called during the run, before it is committed: a selector
that raises, or returns anything but format names or None, fails the run and
leaves the state unchanged.  The conversion is part of the run: its payloads
(and the copies of pages other holders share) are built before the run
commits and published with it (on a state that keeps positions for a
truncate, ``State.keep_for_truncate``, at the start of its next run
instead, undone if that run fails).  A conversion that cannot get its memory (an allocator refusing a
payload, no free page to copy a shared page into) fails its run with
``OutOfMemory`` and leaves the state unchanged; made again once there is
room, the run converts as it would have.

Signed integer formats are quantized symmetrically (zero point 0), unsigned
ones asymmetrically (:func:`onnxkv.cache.formats.params_for`), except key
pages with channel zero points (:func:`onnxkv.cache.formats.channel_zp_params`:
per channel, the zero point centres the channel's range).

The ``"int8"`` policy stores keys INT8 with one scale per (page, head) and one
zero point per (page, head, channel), values INT8 per (page, head).  Keys
carry large per-channel offsets; removing them is what the KIVI layout's
quality comes from, much more than its per-channel scales, so per-channel
zero points keep KIVI's quality while one scale per head lets the attention
kernel score the codes with its per-head path plus one correction per page
(the zero points' share) instead of re-folding the query per page.  Its key
pages carry the channel-zp header of :mod:`onnxkv.cache.formats` (float32
scale and zero-point unit per head, one int8 zero-point code per channel): at
block size 16, 8 KV heads and head size 128 a key page costs 1088 + 16384
bytes, 0.267x float32, and the cache (values INT8 per head) 0.259x.
``"int8-kivi"`` is KIVI itself: keys UINT8 with one
scale and zero point per (page, head, channel) in the compact header (a
float32 S per head, then one exponent byte and one zero-point byte per
channel; scales S * 2^(-e/16), rounded up: 0.282x float32 per key page),
values INT8 per (page, head).  ``"int8-head"`` stores both planes INT8 with
one symmetric scale per (page, head): 0.25x float32, but on the embedded
trained model its logit error is about 2.5x that of KIVI and greedy decoding
leaves the float32 tokens at near-ties of the reference
(``benchmarks/bench_kv_quality.py``), so it is not the default int8 layout.
``"residual-int8"`` keeps the newest 128 tokens native and stores older pages
like ``"int8"``.  Pages are converted once; a page never changes format in
place (the new payload replaces the old one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from onnxkv.cache import formats
from onnxkv.errors import InputError

__all__ = ["FormatSelector", "UniformPolicy", "ResidualPolicy", "make_selector", "key_header", "POLICIES"]

#: ``(layer, past_length, k, v) -> (k_format, v_format)``
FormatSelector = Callable[..., tuple]


@dataclass(frozen=True)
class UniformPolicy:
    """Every full page of every layer in ``k_format`` / ``v_format`` (None: native).

    ``key_channel_scales``: quantized key pages get a scale and zero point per
    channel (compact header); ``key_channel_zero_points``: one scale per head
    and a zero point per channel (channel-zp header).  At most one is True.
    """

    k_format: str | None
    v_format: str | None
    residual_tokens: int = 0
    key_channel_scales: bool = False
    key_channel_zero_points: bool = False

    def __call__(self, layer: int, past_length: int, k, v) -> tuple[str | None, str | None]:
        return self.k_format, self.v_format


@dataclass(frozen=True)
class ResidualPolicy(UniformPolicy):
    """The most recent ``residual_tokens`` native; older full pages in ``k_format`` / ``v_format``."""


#: Built-in policies by name (``CacheConfig("paged", kv_format=...)``, ``--kv-format``).  As a
#: name, ``"fp16"`` / ``"bf16"`` in a CacheConfig store every page in that type from its first
#: token; the policy objects ``POLICIES["fp16"]`` / ``POLICIES["bf16"]`` convert full pages only.
POLICIES: dict[str, UniformPolicy] = {
    "fp32": UniformPolicy(None, None),
    "native": UniformPolicy(None, None),
    "fp16": UniformPolicy("float16", "float16"),
    "bf16": UniformPolicy("bfloat16", "bfloat16"),
    "int8": UniformPolicy("int8", "int8", key_channel_zero_points=True),
    "int8-kivi": UniformPolicy("uint8", "int8", key_channel_scales=True),
    "int8-head": UniformPolicy("int8", "int8"),
    "int4": UniformPolicy("int4", "int4"),
    "residual-int8": ResidualPolicy("int8", "int8", 128, key_channel_zero_points=True),
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
        key_header(policy, "kv_format")
        return None if policy.k_format is None and policy.v_format is None else policy
    if callable(kv_format):
        r = getattr(kv_format, "residual_tokens", 0)
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise InputError(f"kv_format: residual_tokens must be a non-negative int, got {r!r}")
        key_header(kv_format, "kv_format")
        return kv_format
    raise InputError(f"kv_format must be None, a policy name or a callable, got {kv_format!r}")


def key_header(source, api: str, key_channel_scales: bool = False, key_channel_zero_points: bool = False) -> str:
    """The header kind of quantized key pages (:mod:`onnxkv.cache.formats`) that options ask for.

    The options are ``source``'s attributes of those names (a selector or
    policy, or None; a missing attribute is False) or-ed with the arguments.
    Returns "float32" (one scale per head), "compact" (``key_channel_scales``:
    a scale and zero point per channel) or "channel-zp"
    (``key_channel_zero_points``: one scale per head, a zero point per
    channel); the last two mean groups = head_size.  Raises
    :class:`InputError` starting with ``api`` when an option is not a bool or
    both are True.
    """
    on = {}
    for name, given in (
        ("key_channel_scales", key_channel_scales),
        ("key_channel_zero_points", key_channel_zero_points),
    ):
        own = getattr(source, name, False)
        for v in (own, given):
            if not isinstance(v, bool):
                raise InputError(f"{api}: {name} must be a bool, got {v!r}")
        on[name] = own or given
    if on["key_channel_scales"] and on["key_channel_zero_points"]:
        raise InputError(
            f"{api}: key_channel_scales and key_channel_zero_points are mutually exclusive (a scale per "
            "channel, or one scale per head with a zero point per channel); both are True"
        )
    if on["key_channel_scales"]:
        return formats.HEADER_COMPACT
    return formats.HEADER_CHANNEL_ZP if on["key_channel_zero_points"] else formats.HEADER_FLOAT32
