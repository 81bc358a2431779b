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
A float page is just the elements.  A quantized page is a header -- float32
``scale[H*G]`` then float32 ``zero_point[H*G]`` (index h*G + g; G = 1 "per
head", or G = D "per channel"), zero padded to a multiple of 64 bytes -- then
the codes: per head, per token, D codes packed low bits first into
D*bits/8 bytes (so D*bits must be a multiple of 8).  The kernels
``onnxkv._kernels.quantize_page`` / ``dequantize_page`` write and read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxkv.errors import InputError, OutOfMemory

__all__ = ["PageFormat", "FORMATS", "page_format", "groups_for", "header_bytes", "codes_bytes", "page_bytes",
           "params_for", "check_params", "allocate_payload"]


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


def header_bytes(fmt: str | int | PageFormat, heads: int, groups: int) -> int:
    """Bytes of a page header: 0 for float formats, else 8 * heads * groups
    (float32 scale and zero point per group) rounded up to a multiple of 64."""
    f = page_format(fmt)
    h = _count("header_bytes", "heads", heads, 1)
    g = _count("header_bytes", "groups", groups, 1)
    return 0 if f.is_float else -(-8 * h * g // 64) * 64


def codes_bytes(fmt: str | int | PageFormat, heads: int, block_size: int, head_size: int) -> int:
    """Bytes of a page's elements (codes): heads * block_size * head_size * bits / 8.
    Raises :class:`InputError` when head_size * bits is not a multiple of 8 (a
    token's codes must start on a byte boundary)."""
    f = page_format(fmt)
    h = _count("codes_bytes", "heads", heads, 1)
    bs = _count("codes_bytes", "block_size", block_size, 1)
    d = _count("codes_bytes", "head_size", head_size, 1)
    if d * f.bits % 8:
        raise InputError(f"codes_bytes: head_size {d} is not supported by format {f.name}: head_size * {f.bits} "
                         f"bits = {d * f.bits} is not a multiple of 8")
    return h * bs * d * f.bits // 8


def page_bytes(fmt: str | int | PageFormat, heads: int, block_size: int, head_size: int, groups: int = 1) -> int:
    """Payload bytes of one page: :func:`header_bytes` + :func:`codes_bytes`
    (not rounded up to the 64-byte allocation alignment)."""
    return codes_bytes(fmt, heads, block_size, head_size) + header_bytes(fmt, heads, groups)


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
    f = page_format(fmt)
    if f.is_float:
        raise InputError(f"params_for: format {f.name} is a float format and has no scale or zero point")
    if not isinstance(x, np.ndarray) or x.ndim != 3 or x.shape[0] < 1 or x.shape[1] < 1 or x.shape[2] < 1:
        shape = x.shape if isinstance(x, np.ndarray) else type(x).__name__
        raise InputError(f"params_for: x must be a float array [H, n, D] with H, n, D >= 1, got {shape}")
    if x.dtype.kind != "f":
        raise InputError(f"params_for: x must be a float array, got dtype {x.dtype}")
    if not np.isfinite(x).all():
        raise InputError("params_for: x holds non-finite values (NaN or inf); scales need finite data")
    H, _, D = x.shape
    G = groups_for(granularity, D)
    xd = x.astype(np.float64)
    axes = (1, 2) if G == 1 else (1,)
    if f.signed:
        scale = _scale_up(np.abs(xd).max(axis=axes) / f.qmax)
        scale = np.where(scale > 0, scale, np.float32(1))
        zp = np.zeros_like(scale)
    else:
        lo = np.minimum(xd.min(axis=axes), 0.0)
        hi = np.maximum(xd.max(axis=axes), 0.0)
        scale = _scale_up((hi - lo) / (f.qmax - f.qmin))
        scale = np.where(scale > 0, scale, np.float32(1))
        zp = np.clip(np.rint(f.qmin - lo / scale.astype(np.float64)), f.qmin, f.qmax).astype(np.float32)
    return (np.ascontiguousarray(scale, dtype=np.float32).reshape(H * G),
            np.ascontiguousarray(zp, dtype=np.float32).reshape(H * G))


def check_params(api: str, fmt: str | int | PageFormat, scale: np.ndarray, zero_point: np.ndarray,
                 names: tuple[str, str] = ("scale", "zero_point")) -> None:
    """Check given quantization parameters for the integer format ``fmt`` (QuantizeLinear's rules).

    ``scale`` and ``zero_point`` are float32 arrays of one shape (any): every
    scale must be finite and > 0, every zero point an integer in the code range
    [qmin, qmax] of ``fmt``.  Raises :class:`InputError` starting with ``api``
    and naming the first offending element (``names`` label the two arrays).
    """
    f = page_format(fmt)
    if f.is_float:
        raise InputError(f"{api}: format {f.name} is a float format and has no scale or zero point")
    for name, a in zip(names, (scale, zero_point)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float32:
            raise InputError(f"{api}: {name} must be a float32 array, got "
                             f"{a.dtype if isinstance(a, np.ndarray) else type(a).__name__}")
    if scale.shape != zero_point.shape:
        raise InputError(f"{api}: {names[0]} shape {list(scale.shape)} differs from {names[1]} shape "
                         f"{list(zero_point.shape)}")
    bad = ~(np.isfinite(scale) & (scale > 0))
    if bad.any():
        i = tuple(int(x) for x in np.argwhere(bad)[0])
        raise InputError(f"{api}: {names[0]}{list(i)} = {scale[i]!r} (every scale must be finite and > 0)")
    bad = ~((zero_point >= f.qmin) & (zero_point <= f.qmax) & (np.rint(zero_point) == zero_point))
    if bad.any():
        i = tuple(int(x) for x in np.argwhere(bad)[0])
        raise InputError(f"{api}: {names[1]}{list(i)} = {zero_point[i]!r} (every zero point must be an integer in "
                         f"[{f.qmin}, {f.qmax}] for format {f.name})")


def allocate_payload(allocator, fmt: str | int | PageFormat, nbytes: int, api: str) -> tuple[object, np.ndarray]:
    """A 64-byte aligned page payload of ``nbytes`` from ``allocator``: (buffer, uint8 array [nbytes]).

    Any allocator failure becomes :class:`OutOfMemory` naming ``api`` and the
    format (an OutOfMemory of the allocator passes through).
    """
    try:
        buf = allocator.allocate(nbytes, 64)
    except OutOfMemory:
        raise
    except Exception as e:
        raise OutOfMemory(f"{api}: allocating a {page_format(fmt).name} page of {nbytes} bytes failed: {e}") from e
    return buf, buf.view(np.uint8, (nbytes,))
