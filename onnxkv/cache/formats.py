"""Page formats of the paged KV cache: registry, page layout arithmetic, and the
choice of quantization parameters.

Every page of one plane (the keys, or the values, of one layer) has its own
format, named by its ONNX TensorProto element type code:

=========  ====  ====  ===========  ==========================
format     code  bits  code range   reconstruction
=========  ====  ====  ===========  ==========================
float32       1    32  --           x
float16      10    16  --           x
bfloat16     16    16  --           x (uint16 bit patterns)
uint8         2     8  0 .. 255     (q - zp) * scale
int8          3     8  -128 .. 127  (q - zp) * scale
uint4        21     4  0 .. 15      (q - zp) * scale
int4         22     4  -8 .. 7      (q - zp) * scale
uint2        25     2  0 .. 3       (q - zp) * scale
int2         26     2  -2 .. 1      (q - zp) * scale
=========  ====  ====  ===========  ==========================

A page holds ``[H, bs, D]`` (heads, block_size tokens, head size), head-major.
A float page is just the elements.  A quantized page is a header, zero padded
to a multiple of 64 bytes, then the codes: per head, per token, D codes packed
low bits first into D*bits/8 bytes (so D*bits must be a multiple of 8).  The
kernels ``onnxkv._kernels.quantize_page`` / ``dequantize_page`` write and read
it.  Scales and zero points come per group (h, g), index h*G + g: G = 1 "per
head", or G = D "per channel".  Three header kinds:

``"float32"``
    float32 ``scale[H*G]`` then float32 ``zero_point[H*G]``: any parameters
    (explicit page tensors, per-head planes of states).  8 bytes per group.
``"compact"``
    float32 ``S[H]``, uint8 ``e[H*G]``, uint8 ``zc[H*G]`` (G <= 512; the
    per-channel key planes of paged states).  The group's scale is
    ``S[h] * 2^(-e/16)``, computed in float32 as ``(S[h] * steps[e % 16]) *
    2^-(e // 16)`` with ``steps[i]`` = 2^(-i/16) rounded to float32 (two
    rounded products; the second is exact unless the result is subnormal);
    its zero point is the code ``zc`` (0 for signed formats).  2 bytes per
    group plus 4 per head: at block size 16 and head size 128, the key pages
    of 8 heads cost 2112 + 16384 bytes in UINT8 (0.282x float32) instead of
    8192 + 16384 (0.375x).
``"channel-zp"``
    float32 ``s[H]``, float32 ``w[H]``, int8 ``o[H*G]`` with G = D (the key
    planes of the built-in "int8" policy): one scale per head, one zero point
    per channel.  The group's scale is ``s[h]``; its zero point is the integer
    ``z0 + w[h] * o[h*G + g]`` (``w[h]`` a power of two in 1 .. 2^16, ``z0`` 0
    for signed formats and 2^(bits-1) for unsigned ones), which may lie
    outside the code range.  8 bytes per head plus 1 per group: at block size
    16, 8 heads and head size 128 an int8 key page costs 1088 + 16384 bytes
    (0.267x float32).

=============  =========================  ===============================
header kind    bytes (before padding)     H = 8, G = D = 128 (G = 1)
=============  =========================  ===============================
"float32"      8 * H * G                  8192 (64)
"compact"      4 * H + 2 * H * G          2112
"channel-zp"   8 * H + H * G              1088
=============  =========================  ===============================

:func:`compact_params` chooses a compact header from the data: S = the
largest exact scale of the head (rounded up to float32), and per group the
largest e whose decoded scale is still >= the group's exact scale (scales are
rounded up, never down, as in :func:`params_for`).  :func:`channel_zp_params`
chooses a channel-zp header: per head the scale and zero-point unit that
minimise the scale while every channel's midpoint is a zero point and every
code stays within 2^(bits-1) - 1 of ``z0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxkv._kernels._validate import COMPACT_MAX_GROUPS
from onnxkv.alloc.checked import lease
from onnxkv.errors import InputError

#: Header kind of quantized pages: float32 scale and zero point per group.
HEADER_FLOAT32 = "float32"
#: Header kind of quantized pages: float32 S per head, exponent and zero-point bytes per group.
HEADER_COMPACT = "compact"
#: Header kind of per-channel key pages: float32 scale and zero-point unit per head, int8 zero-point code per channel.
HEADER_CHANNEL_ZP = "channel-zp"
HEADERS = (HEADER_FLOAT32, HEADER_COMPACT, HEADER_CHANNEL_ZP)
#: Largest zero-point unit w of a channel-zp header (w = 2^k, k <= 16).
CHANNEL_ZP_MAX_UNIT_LOG2 = 16
#: 2^(-i/16) rounded to float32 (i = 0..15) and 2^-k (k = 0..15): the factors of a compact scale.
_STEPS = np.array([2.0 ** (-i / 16) for i in range(16)], np.float32)
_OCTAVES = np.array([2.0**-k for k in range(16)], np.float32)

__all__ = [
    "PageFormat",
    "FORMATS",
    "HEADERS",
    "HEADER_FLOAT32",
    "HEADER_COMPACT",
    "HEADER_CHANNEL_ZP",
    "COMPACT_MAX_GROUPS",
    "CHANNEL_ZP_MAX_UNIT_LOG2",
    "page_format",
    "groups_for",
    "header_bytes",
    "codes_bytes",
    "page_bytes",
    "params_for",
    "compact_params",
    "channel_zp_params",
    "encode_header",
    "decode_header",
    "check_params",
    "allocate_payload",
]


@dataclass(frozen=True)
class PageFormat:
    """One page format.

    ``code`` is the ONNX element type; ``bits`` the bits per element (code);
    ``is_float`` says the page stores the values themselves (``dtype`` is then
    their NumPy storage dtype: float32, float16, or uint16 bit patterns for
    bfloat16; ``None`` for integer formats).  ``signed``, ``qmin`` and ``qmax``
    describe the code range of integer formats (False, 0, 0 for float formats).
    """

    name: str
    code: int
    bits: int
    signed: bool
    qmin: int
    qmax: int
    is_float: bool
    dtype: np.dtype | None

    @property
    def z0(self) -> int:
        """The zero-point origin of a channel-zp header: 0 for signed formats, 2^(bits-1) for unsigned
        ones (and float formats, which have none: 0)."""
        return 0 if self.signed or self.is_float else 1 << (self.bits - 1)


def _int_format(name: str, code: int, bits: int, signed: bool) -> PageFormat:
    qmin, qmax = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    return PageFormat(name, code, bits, signed, qmin, qmax, False, None)


FORMATS: tuple[PageFormat, ...] = (
    PageFormat("float32", 1, 32, False, 0, 0, True, np.dtype(np.float32)),
    PageFormat("float16", 10, 16, False, 0, 0, True, np.dtype(np.float16)),
    PageFormat("bfloat16", 16, 16, False, 0, 0, True, np.dtype(np.uint16)),
    _int_format("uint8", 2, 8, False),
    _int_format("int8", 3, 8, True),
    _int_format("uint4", 21, 4, False),
    _int_format("int4", 22, 4, True),
    _int_format("uint2", 25, 2, False),
    _int_format("int2", 26, 2, True),
)
_BY_NAME = {f.name: f for f in FORMATS}
_BY_CODE = {f.code: f for f in FORMATS}


def page_format(key: str | int | PageFormat) -> PageFormat:
    """The format named ``key`` ("int4"), or with ONNX element type code ``key``
    (22); a :class:`PageFormat` is returned as is.  Anything else raises
    :class:`InputError` naming the value."""
    if isinstance(key, PageFormat):
        return key
    if isinstance(key, str):
        fmt = _BY_NAME.get(key)
    elif isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
        fmt = _BY_CODE.get(int(key))
    else:
        fmt = None
    if fmt is None:
        known = ", ".join(f"{f.name} ({f.code})" for f in FORMATS)
        raise InputError(f"page_format: unknown page format {key!r} (expected one of {known})")
    return fmt


def groups_for(granularity: str, head_size: int) -> int:
    """G of a granularity: "head" -> 1 (one scale per head), "channel" -> head_size
    (one scale per head and channel, the KIVI choice for keys)."""
    if granularity == "head":
        return 1
    if granularity == "channel":
        return head_size
    raise InputError(f"granularity: expected 'head' or 'channel', got {granularity!r}")


def _count(api: str, name: str, value: int, lo: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < lo:
        raise InputError(f"{api}: {name} must be an int >= {lo}, got {value!r}")
    return int(value)


def _header_kind(api: str, header: str, groups: int) -> str:
    if not isinstance(header, str) or header not in HEADERS:
        raise InputError(f"{api}: header must be one of {list(HEADERS)}, got {header!r}")
    if header == HEADER_COMPACT and groups > COMPACT_MAX_GROUPS:
        raise InputError(
            f"{api}: a compact header holds at most {COMPACT_MAX_GROUPS} groups per head, got {groups} "
            f"(per-channel scales need head_size <= {COMPACT_MAX_GROUPS})"
        )
    return header


def header_bytes(fmt: str | int | PageFormat, heads: int, groups: int, header: str = HEADER_FLOAT32) -> int:
    """Bytes of a page header, rounded up to a multiple of 64: 0 for float formats;
    8 * heads * groups for ``header`` "float32" (float32 scale and zero point per group);
    4 * heads + 2 * heads * groups for ``header`` "compact" (groups <= 512);
    8 * heads + heads * groups for ``header`` "channel-zp" (float32 s and w per head, int8 o per group)."""
    f = page_format(fmt)
    h = _count("header_bytes", "heads", heads, 1)
    g = _count("header_bytes", "groups", groups, 1)
    n = {HEADER_FLOAT32: 8 * h * g, HEADER_COMPACT: 4 * h + 2 * h * g, HEADER_CHANNEL_ZP: 8 * h + h * g}[
        _header_kind("header_bytes", header, g)
    ]
    return 0 if f.is_float else -(-n // 64) * 64


def codes_bytes(fmt: str | int | PageFormat, heads: int, block_size: int, head_size: int) -> int:
    """Bytes of a page's elements (codes): heads * block_size * head_size * bits / 8.
    Raises :class:`InputError` when head_size * bits is not a multiple of 8 (a
    token's codes must start on a byte boundary)."""
    f = page_format(fmt)
    h = _count("codes_bytes", "heads", heads, 1)
    bs = _count("codes_bytes", "block_size", block_size, 1)
    d = _count("codes_bytes", "head_size", head_size, 1)
    if d * f.bits % 8:
        raise InputError(
            f"codes_bytes: head_size {d} is not supported by format {f.name}: head_size * {f.bits} "
            f"bits = {d * f.bits} is not a multiple of 8"
        )
    return h * bs * d * f.bits // 8


def page_bytes(
    fmt: str | int | PageFormat,
    heads: int,
    block_size: int,
    head_size: int,
    groups: int = 1,
    header: str = HEADER_FLOAT32,
) -> int:
    """Payload bytes of one page: :func:`header_bytes` + :func:`codes_bytes`
    (not rounded up to the 64-byte allocation alignment)."""
    return codes_bytes(fmt, heads, block_size, head_size) + header_bytes(fmt, heads, groups, header)


def _scale_up(exact: np.ndarray) -> np.ndarray:
    """float32 scales >= the float64 ``exact`` values (rounded up, never down),
    so that no value of the group falls outside the representable range."""
    s = exact.astype(np.float32)
    return np.where(s.astype(np.float64) < exact, np.nextafter(s, np.float32(np.inf)), s)


def params_for(x: np.ndarray, fmt: str | int | PageFormat, granularity: str) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point (float32 [H * G] each, index h*G + g) for quantizing
    ``x`` (float [H, n, D], n >= 1, finite) to the integer format ``fmt``.

    The group of (h, g) is every x[h, :, :] for granularity "head" (G = 1) or
    every x[h, :, g] for "channel" (G = D).  Rule, per group:

    * signed formats (symmetric): zp = 0, scale = max|x| / qmax;
    * unsigned formats (asymmetric, ONNX DynamicQuantizeLinear): the range
      [lo, hi] = [min(min x, 0), max(max x, 0)] (it holds 0 so that the zero
      point is a code), scale = (hi - lo) / (qmax - qmin),
      zp = clamp(round_half_even(qmin - lo / scale), qmin, qmax);
    * scales are rounded up to float32 (never down), so every value of the group
      lies in the representable range: quantizing it saturates at most by the
      last half step and reconstructs within scale / 2 (up to float32 rounding);
    * a group of zeros only (whose scale would be 0) gets scale = 1 and the zp
      above: every value quantizes to the code zp and reconstructs to 0 exactly;
      a tiny nonzero range rounds up to a positive (possibly subnormal) scale.
    """
    f, xd = _quantizable("params_for", x, fmt)
    H, _, D = x.shape
    G = groups_for(granularity, D)
    exact, lo = _exact_scales(f, xd, (1, 2) if G == 1 else (1,))
    scale = _scale_up(exact)
    scale = np.where(scale > 0, scale, np.float32(1))
    zp = _zero_points(f, lo, scale)
    return (
        np.ascontiguousarray(scale, dtype=np.float32).reshape(H * G),
        np.ascontiguousarray(zp, dtype=np.float32).reshape(H * G),
    )


def _quantizable(api: str, x: np.ndarray, fmt: str | int | PageFormat) -> tuple[PageFormat, np.ndarray]:
    """The integer format ``fmt`` and ``x`` (float [H, n, D], n >= 1, finite) as float64, or InputError."""
    f = page_format(fmt)
    if f.is_float:
        raise InputError(f"{api}: format {f.name} is a float format and has no scale or zero point")
    if not isinstance(x, np.ndarray) or x.ndim != 3 or x.shape[0] < 1 or x.shape[1] < 1 or x.shape[2] < 1:
        shape = x.shape if isinstance(x, np.ndarray) else type(x).__name__
        raise InputError(f"{api}: x must be a float array [H, n, D] with H, n, D >= 1, got {shape}")
    if x.dtype.kind != "f":
        raise InputError(f"{api}: x must be a float array, got dtype {x.dtype}")
    if not np.isfinite(x).all():
        raise InputError(f"{api}: x holds non-finite values (NaN or inf); scales need finite data")
    return f, x.astype(np.float64)


def _exact_scales(f: PageFormat, xd: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per group (``xd`` reduced over ``axes``): the exact float64 scale of :func:`params_for`'s
    rule and the low end ``lo`` of the group's range (0 for signed formats)."""
    if f.signed:
        exact = np.abs(xd).max(axis=axes) / f.qmax
        return exact, np.zeros_like(exact)
    lo = np.minimum(xd.min(axis=axes), 0.0)
    hi = np.maximum(xd.max(axis=axes), 0.0)
    return (hi - lo) / (f.qmax - f.qmin), lo


def _zero_points(f: PageFormat, lo: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 zero points of groups with range low end ``lo`` and float32 ``scale`` (0 for signed formats)."""
    if f.signed:
        return np.zeros(scale.shape, np.float32)
    return np.clip(np.rint(f.qmin - lo / scale.astype(np.float64)), f.qmin, f.qmax).astype(np.float32)


def _compact_scales(S: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Decoded compact scales float32 [H, G]: (S[h] * steps[e % 16]) * 2^-(e // 16), in float32."""
    e = e.astype(np.intp)
    return (S.astype(np.float32)[:, None] * _STEPS[e & 15]) * _OCTAVES[e >> 4]


def _pack_compact(S: np.ndarray, e: np.ndarray, zc: np.ndarray) -> np.ndarray:
    """The compact header bytes (uint8, zero padded to 64) of S float32 [H], e and zc uint8 [H, G]."""
    H, G = e.shape
    out = np.zeros(-(-(4 * H + 2 * H * G) // 64) * 64, np.uint8)
    out[: 4 * H] = np.ascontiguousarray(S, dtype=np.float32).view(np.uint8)
    out[4 * H : 4 * H + H * G] = e.reshape(-1)
    out[4 * H + H * G : 4 * H + 2 * H * G] = zc.reshape(-1)
    return out


def compact_params(x: np.ndarray, fmt: str | int | PageFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-channel parameters of ``x`` (float [H, n, D], n >= 1, finite, D <= 512) in a compact header.

    Returns (scale, zero_point, header): the decoded float32 scale and zero
    point [H * D] (index h*D + c; what the codes are computed with, e.g. by
    ``_kernels.quantize_page(..., header=header)``) and the header bytes
    (uint8 [:func:`header_bytes` (fmt, H, D, "compact")]).  Rule, per head h:
    S = the largest exact scale of :func:`params_for`'s per-channel rule over
    the head's channels, rounded up to float32 (1 if every channel is zeros);
    per channel, e = the largest code in 0..255 whose decoded scale is still
    >= the channel's exact scale (so scales round up, never down, and every
    value reconstructs within half its decoded scale up to float32 rounding);
    the zero point is :func:`params_for`'s rule with the decoded scale (0 for
    signed formats).
    """
    f, xd = _quantizable("compact_params", x, fmt)
    H, _, D = x.shape
    _header_kind("compact_params", HEADER_COMPACT, D)
    exact, lo = _exact_scales(f, xd, (1,))
    S = _scale_up(exact.max(axis=1))
    S = np.where(S > 0, S, np.float32(1))
    table = _compact_scales(S, np.arange(256)[None, :]).astype(np.float64)  # [H, 256], non-increasing in e
    e = np.empty((H, D), np.uint8)
    for h in range(H):  # the codes whose scale is >= exact are a prefix of the table: e is its last one
        e[h] = np.searchsorted(-table[h], -exact[h], side="right") - 1
    scale = _compact_scales(S, e)
    zp = _zero_points(f, lo, scale)
    return scale.reshape(H * D), zp.reshape(H * D), _pack_compact(S, e, zp.astype(np.uint8))


def _pack_channel_zp(s: np.ndarray, w: np.ndarray, o: np.ndarray) -> np.ndarray:
    """The channel-zp header bytes (uint8, zero padded to 64) of s, w float32 [H] and o int8 [H, G]."""
    H, G = o.shape
    out = np.zeros(-(-(8 * H + H * G) // 64) * 64, np.uint8)
    out[: 4 * H] = np.ascontiguousarray(s, dtype=np.float32).view(np.uint8)
    out[4 * H : 8 * H] = np.ascontiguousarray(w, dtype=np.float32).view(np.uint8)
    out[8 * H : 8 * H + H * G] = np.ascontiguousarray(o, dtype=np.int8).reshape(-1).view(np.uint8)
    return out


def _channel_zp_decoded(f: PageFormat, s: np.ndarray, w: np.ndarray, o: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decoded float32 scale and zero point [H * G] of a channel-zp header's s, w [H] and o [H, G]:
    scale s[h], zero point z0 + w[h] * o (exact in float32: |w * o| <= 2^23)."""
    H, G = o.shape
    scale = np.repeat(s.astype(np.float32), G)
    zp = np.float32(f.z0) + w.astype(np.float32)[:, None] * o.astype(np.float32)
    return scale, zp.astype(np.float32).reshape(H * G)


def channel_zp_params(x: np.ndarray, fmt: str | int | PageFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-head scales and per-channel zero points of ``x`` (float [H, n, D], n >= 1, finite) in a
    channel-zp header.

    Returns (scale, zero_point, header): the decoded float32 scale and zero
    point [H * D] (index h*D + c; what the codes are computed with) and the
    header bytes (uint8 [:func:`header_bytes` (fmt, H, D, "channel-zp")]).
    Rule, with r = 2^(bits-1) - 1 and, per head h and channel c (float64),
    ctr_c = (max_t x + min_t x) / 2, hr_c = (max_t x - min_t x) / 2,
    HR = max_c hr_c, CT = max_c |ctr_c|: for every w = 2^k with w / 2 < r and
    k <= 16, s_k = max(HR / (r - w/2), CT / (127 w)); the smallest s_k wins
    (ties: the smallest k) and is rounded up to float32 (never down); a head
    of zeros gets s = 1, w = 1.  Then o_c = clip(rint(-ctr_c / (s w)), -128,
    127) and the zero point is z0 + w o_c (z0: 0 signed, 2^(bits-1) unsigned):
    the code of x is rint(x / s) + z0 + w o_c, and the sign puts the channel's
    midpoint at code z0.  Every |x / s + w o_c| <= hr_c / s + w / 2 <= r, so
    codes do not saturate (beyond float32 rounding) and every value
    reconstructs within s / 2.
    """
    f, xd = _quantizable("channel_zp_params", x, fmt)
    H, _, D = x.shape
    r = (1 << (f.bits - 1)) - 1
    hi, lo = xd.max(axis=1), xd.min(axis=1)
    ctr, hr = (hi + lo) / 2, (hi - lo) / 2
    HR, CT = hr.max(axis=1), np.abs(ctr).max(axis=1)
    units = np.array([2.0**k for k in range(CHANNEL_ZP_MAX_UNIT_LOG2 + 1) if 2.0**k / 2 < r])
    cand = np.maximum(HR[None, :] / (r - units[:, None] / 2), CT[None, :] / (127 * units[:, None]))  # [K, H]
    best = np.argmin(cand, axis=0)  # the first minimum: the smallest k on ties
    exact = cand[best, np.arange(H)]
    zeros = exact == 0  # HR = CT = 0: every value of the head is 0
    s = np.where(zeros, np.float32(1), _scale_up(exact)).astype(np.float32)
    w = np.where(zeros, 1.0, units[best]).astype(np.float32)
    o = np.clip(np.rint(-ctr / (s.astype(np.float64) * w)[:, None]), -128, 127).astype(np.int8)
    scale, zp = _channel_zp_decoded(f, s, w, o)
    return scale, zp, _pack_channel_zp(s, w, o)


def _encode_channel_zp(api: str, f: PageFormat, scale: np.ndarray, zero_point: np.ndarray, h: int) -> np.ndarray:
    """Channel-zp header bytes holding ``scale`` / ``zero_point`` [h * G] exactly, or InputError naming the element."""
    G = scale.size // h
    s = scale.reshape(h, G)
    bad = np.flatnonzero(s != s[:, :1])
    if bad.size:
        i = int(bad[0])
        raise InputError(
            f"{api}: scale[{i}] = {float(scale[i])!r} differs from scale[{i - i % G}] = "
            f"{float(scale[i - i % G])!r}: a channel-zp header holds one scale per head (head {i // G})"
        )
    off = zero_point.astype(np.float64).reshape(h, G) - f.z0  # integers (check_params)
    units = 2.0 ** np.arange(CHANNEL_ZP_MAX_UNIT_LOG2 + 1)
    in_range = (off[None] >= -128 * units[:, None, None]) & (off[None] <= 127 * units[:, None, None])  # [K, h, G]
    fits = in_range & (np.mod(off[None], units[:, None, None]) == 0)
    w = np.empty(h, np.float32)
    for head in range(h):
        ok = np.flatnonzero(fits[:, head].all(axis=1))
        if ok.size:
            w[head] = units[ok[0]]
            continue
        wide = np.flatnonzero(in_range[:, head].all(axis=1))  # the units whose range holds every offset
        c = int(np.argmax(np.abs(off[head]))) if not wide.size else int(np.flatnonzero(~fits[wide[0], head])[0])
        i = head * G + c
        raise InputError(
            f"{api}: zero_point[{i}] = {float(zero_point[i])!r}: no power of two w <= "
            f"2^{CHANNEL_ZP_MAX_UNIT_LOG2} makes every zero point of head {head} minus {f.z0} a multiple "
            "w * o with o in [-128, 127]: a channel-zp header cannot hold it"
        )
    o = (off / w.astype(np.float64)[:, None]).astype(np.int8)
    return _pack_channel_zp(s[:, 0], w, o)


def encode_header(
    fmt: str | int | PageFormat,
    scale: np.ndarray,
    zero_point: np.ndarray,
    heads: int,
    header: str = HEADER_FLOAT32,
    api: str = "encode_header",
) -> np.ndarray:
    """The header bytes (uint8 [:func:`header_bytes`]) holding ``scale`` / ``zero_point``.

    ``scale`` and ``zero_point`` are float32 [heads * G] (valid as
    :func:`check_params` states).  ``header`` "float32" stores them as they
    are; "compact" stores them exactly or raises :class:`InputError`: per head
    S is the largest scale, and every scale must be S * 2^(-e/16) as decoded
    for some e in 0..255 (true of every header :func:`compact_params` wrote,
    whose decoded parameters :func:`decode_header` returns); zero points must be
    codes of 0..255 (0 for signed formats).  "channel-zp" stores them exactly
    or raises :class:`InputError` naming the element: every scale of a head
    must be equal, and the head's zero points minus z0 (integers, possibly
    outside the code range) must be w * o for one power of two w <= 2^16 (the
    smallest one is stored) and o in [-128, 127] (true of every header
    :func:`channel_zp_params` wrote).  Errors start with ``api``.
    """
    f = page_format(fmt)
    check_params(api, f, scale, zero_point, header=header)
    h = _count(api, "heads", heads, 1)
    if scale.ndim != 1 or scale.size % h:
        raise InputError(f"{api}: scale must be [heads * G] with heads {h}, got shape {list(scale.shape)}")
    G = scale.size // h
    if _header_kind(api, header, G) == HEADER_CHANNEL_ZP:
        return _encode_channel_zp(api, f, scale, zero_point, h)
    out = np.zeros(header_bytes(f, h, G, header), np.uint8)
    if header == HEADER_FLOAT32:
        out[: 4 * h * G] = scale.view(np.uint8)
        out[4 * h * G : 8 * h * G] = zero_point.view(np.uint8)
        return out
    s = scale.reshape(h, G)
    S = s.max(axis=1)
    table = _compact_scales(S, np.arange(256)[None, :])
    e = np.empty((h, G), np.intp)
    for i in range(h):  # the first code whose decoded scale is <= the scale: equal, or the scale has none
        e[i] = np.minimum(np.searchsorted(-table[i], -s[i], side="left"), 255)
    bad = np.flatnonzero(np.take_along_axis(table, e, axis=1) != s)
    if bad.size:
        i = int(bad[0])
        raise InputError(
            f"{api}: scale[{i}] = {float(scale[i])!r} is not S * 2^(-e/16) for S = "
            f"{float(S[i // G])!r} (the largest scale of head {i // G}) and a code e in 0..255: a compact "
            "header cannot hold it"
        )
    if f.signed and (zero_point != 0).any():
        i = int(np.flatnonzero(zero_point != 0)[0])
        raise InputError(
            f"{api}: zero_point[{i}] = {float(zero_point[i])!r}: a compact header holds zero point 0 for "
            f"signed formats ({f.name})"
        )
    return _pack_compact(S, e.astype(np.uint8), zero_point.reshape(h, G).astype(np.uint8))


def decode_header(
    page: np.ndarray, fmt: str | int | PageFormat, heads: int, groups: int, header: str = HEADER_FLOAT32
) -> tuple[np.ndarray, np.ndarray]:
    """The float32 scale and zero point [heads * groups] (index h*G + g) stored in the header
    of ``page`` (uint8 [>= header bytes], a quantized page of the integer format ``fmt``)."""
    f = page_format(fmt)
    if f.is_float:
        raise InputError(f"decode_header: format {f.name} is a float format and has no header")
    hb = header_bytes(f, heads, groups, header)
    if not isinstance(page, np.ndarray) or page.dtype != np.uint8 or page.ndim != 1 or page.size < hb:
        got = f"{page.dtype} {list(page.shape)}" if isinstance(page, np.ndarray) else type(page).__name__
        raise InputError(f"decode_header: page must be uint8 [>= {hb}] ({header} header), got {got}")
    n = heads * groups
    if header == HEADER_FLOAT32:
        params = page[: 8 * n].copy().view(np.float32)
        return params[:n], params[n:]
    if header == HEADER_CHANNEL_ZP:
        sw = page[: 8 * heads].copy().view(np.float32)
        o = page[8 * heads : 8 * heads + n].copy().view(np.int8).reshape(heads, groups)
        return _channel_zp_decoded(f, sw[:heads], sw[heads:], o)
    S = page[: 4 * heads].copy().view(np.float32)
    e = page[4 * heads : 4 * heads + n].reshape(heads, groups)
    return _compact_scales(S, e).reshape(n), page[4 * heads + n : 4 * heads + 2 * n].astype(np.float32)


def check_params(
    api: str,
    fmt: str | int | PageFormat,
    scale: np.ndarray,
    zero_point: np.ndarray,
    names: tuple[str, str] = ("scale", "zero_point"),
    header: str = HEADER_FLOAT32,
) -> None:
    """Check given quantization parameters for the integer format ``fmt`` (QuantizeLinear's rules).

    ``scale`` and ``zero_point`` are float32 arrays of one shape (any): every
    scale must be finite and > 0, every zero point an integer in the code range
    [qmin, qmax] of ``fmt`` -- except for ``header`` "channel-zp", whose zero
    points are integers with |zp - z0| <= 128 * 2^16 (z0: 0 signed, 2^(bits-1)
    unsigned; outside the code range is allowed).  Raises :class:`InputError`
    starting with ``api`` and naming the first offending element (``names``
    label the two arrays).
    """
    f = page_format(fmt)
    if f.is_float:
        raise InputError(f"{api}: format {f.name} is a float format and has no scale or zero point")
    for name, a in zip(names, (scale, zero_point)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float32:
            raise InputError(
                f"{api}: {name} must be a float32 array, got "
                f"{a.dtype if isinstance(a, np.ndarray) else type(a).__name__}"
            )
    if scale.shape != zero_point.shape:
        raise InputError(
            f"{api}: {names[0]} shape {list(scale.shape)} differs from {names[1]} shape {list(zero_point.shape)}"
        )
    bad = ~(np.isfinite(scale) & (scale > 0))
    if bad.any():
        i = tuple(int(x) for x in np.argwhere(bad)[0])
        raise InputError(f"{api}: {names[0]}{list(i)} = {float(scale[i])!r} (every scale must be finite and > 0)")
    if header == HEADER_CHANNEL_ZP:
        reach = 128 << CHANNEL_ZP_MAX_UNIT_LOG2
        lo, hi, what = f.z0 - reach, f.z0 + reach, f"with |zero_point - {f.z0}| <= {reach} (channel-zp header)"
    else:
        lo, hi, what = f.qmin, f.qmax, f"in [{f.qmin}, {f.qmax}]"
    bad = ~((zero_point >= lo) & (zero_point <= hi) & (np.rint(zero_point) == zero_point))
    if bad.any():
        i = tuple(int(x) for x in np.argwhere(bad)[0])
        raise InputError(
            f"{api}: {names[1]}{list(i)} = {float(zero_point[i])!r} (every zero point must be an integer "
            f"{what} for format {f.name})"
        )


def allocate_payload(allocator, fmt: str | int | PageFormat, nbytes: int, api: str) -> tuple[object, np.ndarray]:
    """A 64-byte aligned page payload of ``nbytes`` from ``allocator``: (buffer, uint8 array [nbytes]).

    Leased and checked by :func:`onnxkv.alloc.checked.lease` (give it back
    with :func:`~onnxkv.alloc.checked.release`): :class:`~onnxkv.errors.OutOfMemory` or
    :class:`InputError` naming ``api``, the format and the allocator when
    the allocator fails or returns a buffer that breaks its contract.
    """
    return lease(allocator, nbytes, 64, np.uint8, (nbytes,), f"{api}: a {page_format(fmt).name} page")
