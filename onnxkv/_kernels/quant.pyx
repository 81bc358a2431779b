"""Quantize float32 K/V rows into an integer page and dequantize them back.

A quantized page of ``heads`` H, ``block_size`` bs and ``head_size`` D holds a
header -- float32 ``scale[H*G]`` then float32 ``zero_point[H*G]`` (index h*G + g,
G = ``group``: 1 per head, or D per channel), zero padded to a multiple of 64
bytes -- followed by the codes: head-major, token-major inside a head, each
token's D codes packed low bits first into D*bits/8 bytes (signed codes two's
complement).  Or the compact header (``header`` "compact"; G <= 512): float32
``S[H]``, uint8 ``e[H*G]``, uint8 ``zc[H*G]``, zero padded to a multiple of 64
bytes, decoded to scale = (S[h] * 2^(-(e & 15)/16) in float32) * 2^-(e >> 4)
and zero_point = zc (``onnxkv.cache.formats`` encodes it).  Or the
channel-zero-point header (``header`` "channel-zp", G = D): float32 ``s[H]``,
float32 ``w[H]``, int8 ``o[H*G]``, zero padded to a multiple of 64 bytes,
decoded to scale = s[h] and zero_point = z0 + w[h] * o (z0 = 0 for signed
formats, 2^(bits-1) for unsigned ones; integers that may lie outside the code
range).  Format codes are
ONNX element types: 2 uint8, 3 int8, 21 uint4, 22 int4, 25 uint2, 26 int2;
D*bits must be a multiple of 8.  The C row helpers live in ``quant.h`` (shared
with the fused attention kernel).

Quantization is ONNX QuantizeLinear: q = saturate(rint(x / scale) + zp), round
half to even, float32 division, saturation to the format's code range (+-inf
saturate, NaN gives the lowest code).  Dequantization is (q - zp) * scale in
float32.  AVX2 and scalar paths are bit-identical to each other and to
``reference.quantize_page`` / ``reference.dequantize_page``.  Parallel over the
H * tokens rows when the page is large enough.
"""
from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memset
from libc.float cimport FLT_MAX
from cython.parallel cimport prange

import numpy as np

from onnxkv._kernels._runtime cimport okv_settings, okv_settings_get
from . import _validate as V

cdef extern from "quant.h" nogil:
    int okv_q_bits(int fmt)
    int okv_q_qmin(int fmt)
    int okv_q_qmax(int fmt)
    int64_t okv_q_row_bytes(int fmt, int64_t D)
    int64_t okv_q_header_bytes(int64_t H, int64_t G)
    int64_t okv_q_compact_header_bytes(int64_t H, int64_t G)
    int64_t okv_q_czp_header_bytes(int64_t H, int64_t G)
    void okv_q_czp_decode(const uint8_t *hdr, int64_t H, int64_t G, int64_t h, int fmt, float *scale, float *zp)
    void okv_q_compact_decode(float S, const uint8_t *e, const uint8_t *z, float *scale, float *zp, int64_t G,
                              int simd)
    void okv_quant_row(const float *x, int fmt, const float *scale, const float *zp, int per_channel,
                       uint8_t *codes, int64_t D, int simd)
    void okv_dequant_row(const uint8_t *codes, int fmt, const float *scale, const float *zp, int per_channel,
                         float *out, int64_t D, int simd)

DEF PAR_MIN = 16384   # elements of a call below which one thread does all rows
# Header kind codes of _validate.header_kind (V.HDR_COMPACT, V.HDR_CZP), for nogil code.
DEF HDR_COMPACT = 1
DEF HDR_CZP = 2

_FORMATS = "2 uint8, 3 int8, 21 uint4, 22 int4, 25 uint2, 26 int2"
U8 = np.dtype(np.uint8)


def _int(name, x, lo):
    """``x`` as a Python int in [lo, 2**31 - 1]: sizes and token counts the C code multiplies in int64."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise ValueError(f"{name}: expected an int, got {type(x).__name__}")
    if not lo <= x <= V.I32_MAX:
        raise ValueError(f"{name}: must be in [{lo}, {V.I32_MAX}], got {x}")
    return int(x)


def _layout(fmt_code, head_size, group):
    """Check the format code, D*bits % 8 and the group; return (fmt, bits)."""
    fmt = _int("fmt_code", fmt_code, 0)
    bits = okv_q_bits(fmt) if fmt < 256 else 0
    if bits == 0:
        raise ValueError(f"fmt_code: {fmt_code} is not an integer page format (expected one of {_FORMATS})")
    if head_size * bits % 8:
        raise ValueError(f"head_size: {head_size} codes of {bits} bits do not fill whole bytes "
                         f"(format {fmt} needs head_size * {bits} to be a multiple of 8)")
    g = _int("group", group, 1)
    if g != 1 and g != head_size:
        raise ValueError(f"group: must be 1 (per head) or head_size {head_size} (per channel), got {g}")
    return fmt, bits


def _page(name, page, nbytes, writeable):
    V.array(name, page, (U8,), ndim=1, writeable=writeable)
    if page.shape[0] < nbytes:
        raise ValueError(f"{name}: page of {page.shape[0]} bytes is too small (layout needs {nbytes} bytes)")


cdef Py_ssize_t _first_bad_scale(const float[::1] s) noexcept nogil:
    """Index of the first scale that is not finite and > 0, or -1."""
    cdef Py_ssize_t i
    for i in range(s.shape[0]):
        if not (s[i] > 0 and s[i] <= FLT_MAX):
            return i
    return -1


cdef Py_ssize_t _first_bad_zero_point(const float[::1] z, float qmin, float qmax) noexcept nogil:
    """Index of the first zero point that is not an integer in [qmin, qmax], or -1 (integers
    up to 2^24 in magnitude: qmin / qmax of a channel-zero-point header are +-2^24)."""
    cdef Py_ssize_t i
    for i in range(z.shape[0]):
        if not (z[i] >= qmin and z[i] <= qmax and z[i] == <float><int>z[i]):
            return i
    return -1


cdef void _decode_compact(const uint8_t *hdr, int64_t H, int64_t G, float *scale, float *zp,
                          int simd) noexcept nogil:
    """scale[H*G] / zp[H*G] of the compact header at hdr (S read bytewise: hdr need not be aligned)."""
    cdef int64_t h
    cdef float S
    for h in range(H):
        memcpy(&S, hdr + 4 * h, sizeof(float))
        okv_q_compact_decode(S, hdr + 4 * H + h * G, hdr + 4 * H + H * G + h * G, scale + h * G, zp + h * G, G, simd)


cdef void _decode_header(int kind, const uint8_t *hdr, int64_t H, int64_t G, int fmt, float *scale, float *zp,
                         int simd) noexcept nogil:
    """scale[H*G] / zp[H*G] of the header of kind ``kind`` (V.HDR_*) at hdr (copied out or decoded:
    hdr need not be aligned)."""
    cdef int64_t h
    if kind == HDR_COMPACT:
        _decode_compact(hdr, H, G, scale, zp, simd)
    elif kind == HDR_CZP:
        for h in range(H):
            okv_q_czp_decode(hdr, H, G, h, fmt, scale + h * G, zp + h * G)
    else:
        memcpy(scale, hdr, H * G * sizeof(float))
        memcpy(zp, hdr + H * G * sizeof(float), H * G * sizeof(float))


_NO_HEADER = np.zeros(1, U8)


def _check_header(header, kind, H, G, fmt, scale, zero_point):
    """Check the given header bytes of kind ``kind`` (V.HDR_COMPACT or V.HDR_CZP) for quantize_page:
    their length, and that they decode exactly to scale / zero_point."""
    V.array("header", header, (U8,), ndim=1)
    hb = _header_bytes(kind, H, G)
    name = V.HEADERS[kind]
    if header.shape[0] != hb:
        raise ValueError(f"header: a {name} header of {H} heads and {G} groups per head has {hb} bytes, "
                         f"got {header.shape[0]}")
    dec_s = np.empty(H * G, np.float32)
    dec_z = np.empty(H * G, np.float32)
    cdef const uint8_t[::1] hv = header
    cdef float[::1] ds = dec_s
    cdef float[::1] dz = dec_z
    _decode_header(kind, &hv[0], H, G, fmt, &ds[0], &dz[0], okv_settings_get().simd)
    bad = np.flatnonzero((dec_s != scale) | (dec_z != zero_point))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"header: decodes to scale[{i}] = {dec_s[i]!r}, zero_point[{i}] = {dec_z[i]!r}, but the "
                         f"codes were asked for scale {scale[i]!r}, zero_point {zero_point[i]!r} (pass the "
                         "header's own decoded parameters)")


def _check_czp_group(kind, G, D):
    """A channel-zp header has one zero point per channel: G must be the head size D."""
    if kind == V.HDR_CZP and G != D:
        raise ValueError(f"group: a channel-zp header has one zero point per channel: group must be head_size {D}, "
                         f"got {G}")


def _header_bytes(kind, H, G):
    if kind == V.HDR_COMPACT:
        return okv_q_compact_header_bytes(H, G)
    return okv_q_czp_header_bytes(H, G) if kind == V.HDR_CZP else okv_q_header_bytes(H, G)


def quantize_page(x, fmt_code, scale, zero_point, group, out_page, block_size, t0=0, header=None,
                  header_kind="compact"):
    """Quantize ``x`` into tokens ``t0 .. t0+n`` of a page and write its header.

    x: float32 [H, n, D] (C-contiguous; t0 + n <= block_size).  fmt_code: an
    integer format code (2, 3, 21, 22, 25, 26).  scale, zero_point: float32
    [H*G] with G = ``group`` (1 or D); scale finite and > 0, zero_point integer
    valued inside the code range.  out_page: writeable uint8 [>= page bytes], the
    whole page payload (header + H * block_size * D*bits/8 code bytes).

    header: None (the float32 header: scale, zero_point, zero padding), or
    the uint8 header bytes of kind ``header_kind``, written as given, that must
    decode exactly to ``scale`` / ``zero_point`` (the codes are computed from
    those): "compact" (G <= 512) or "channel-zp" (G = D; its zero points are
    integers that may lie outside the code range).

    Writes the whole header and the code bytes of tokens t0 .. t0+n of every
    head; every other token's bytes are left untouched (so a partly filled page
    can be appended to).  All arguments are checked (``ValueError`` naming the
    argument) before anything is written.
    """
    V.array("x", x, (V.F32,), ndim=3)
    H, n, D = x.shape
    _int("x.shape[0] (heads)", H, 1)
    _int("x.shape[2] (head_size)", D, 1)
    fmt, bits = _layout(fmt_code, D, group)
    G = int(group)
    bs = _int("block_size", block_size, 1)
    t = _int("t0", t0, 0)
    if t + n > bs:
        raise ValueError(f"t0: tokens t0={t} .. {t + n} of x (n={n}) do not fit a page of block_size {bs}")
    qmin, qmax = okv_q_qmin(fmt), okv_q_qmax(fmt)
    V.array("scale", scale, (V.F32,), shape=(H * G,))
    V.array("zero_point", zero_point, (V.F32,), shape=(H * G,))
    i = _first_bad_scale(scale)
    if i >= 0:
        raise ValueError(f"scale: every scale must be finite and > 0, got scale[{i}] = {scale[i]}")
    kind = V.HDR_FLOAT32
    if header is not None:
        V.header_kind("header_kind", header_kind, 1)
        kind = V.header_kind("group", header_kind, G)
    if kind == V.HDR_FLOAT32 and header is not None:
        raise ValueError("header_kind: header bytes are given, so it must be 'compact' or 'channel-zp', "
                         "got 'float32' (pass header=None for the float32 header)")
    _check_czp_group(kind, G, D)
    zlo, zhi = qmin, qmax
    if kind == V.HDR_CZP:
        zlo, zhi = -16777216, 16777216
    i = _first_bad_zero_point(zero_point, zlo, zhi)
    if i >= 0:
        raise ValueError(f"zero_point: every zero point must be an integer in [{zlo}, {zhi}] for format {fmt}, "
                         f"got zero_point[{i}] = {zero_point[i]}")
    if kind != V.HDR_FLOAT32:
        _check_header(header, kind, H, G, fmt, scale, zero_point)
    hb = _header_bytes(kind, H, G)
    row = okv_q_row_bytes(fmt, D)
    _page("out_page", out_page, hb + H * bs * row, True)
    for other, oname in ((x, "x"), (scale, "scale"), (zero_point, "zero_point"), (header, "header")):
        V.no_overlap("out_page", out_page, other, oname)

    cdef const float[:, :, ::1] xv = x
    cdef const float[::1] sv = scale
    cdef const float[::1] zv = zero_point
    cdef const uint8_t[::1] hv = header if header is not None else _NO_HEADER
    cdef uint8_t[::1] pv = out_page
    cdef uint8_t *base = &pv[0]
    cdef int64_t cH = H, cn = n, cD = D, cG = G, cbs = bs, ct0 = t, chb = hb, crow = row
    cdef okv_settings s = okv_settings_get()
    cdef int cfmt = fmt, per_channel = G != 1, simd = s.simd, given = header is not None
    cdef Py_ssize_t r, rows = cH * cn
    cdef int64_t h, tok
    cdef int nt = s.threads if rows * cD >= PAR_MIN else 1
    with nogil:
        if given:
            memcpy(base, &hv[0], chb)
        else:
            memcpy(base, &sv[0], cH * cG * sizeof(float))
            memcpy(base + cH * cG * sizeof(float), &zv[0], cH * cG * sizeof(float))
            memset(base + 2 * cH * cG * sizeof(float), 0, chb - 2 * cH * cG * sizeof(float))
        for r in prange(rows, num_threads=nt, schedule='static'):
            h = r // cn
            tok = r - h * cn
            okv_quant_row(&xv[h, tok, 0], cfmt, &sv[h * cG], &zv[h * cG], per_channel,
                          base + chb + (h * cbs + ct0 + tok) * crow, cD, simd)


def dequantize_page(page, fmt_code, heads, block_size, head_size, group, tokens, out, header="float32"):
    """Dequantize tokens 0 .. tokens of every head of a page into ``out``.

    page: uint8 [>= page bytes], a page payload written by :func:`quantize_page`
    (header scale/zero_point read from it as stored, or decoded from a compact
    header; no check of their values).  fmt_code, group: as for
    :func:`quantize_page`.  heads, block_size, head_size: the page's H, bs, D.
    tokens: 0 <= tokens <= block_size.  out: writeable float32 [H, tokens, D],
    not overlapping ``page``; receives (q - zp) * scale.  header: the page's
    header kind: "float32", "compact" (G <= 512) or "channel-zp" (G = D).
    """
    H = _int("heads", heads, 1)
    bs = _int("block_size", block_size, 1)
    D = _int("head_size", head_size, 1)
    fmt, bits = _layout(fmt_code, D, group)
    G = int(group)
    n = _int("tokens", tokens, 0)
    if n > bs:
        raise ValueError(f"tokens: {n} exceeds block_size {bs}")
    kind = V.header_kind("header", header, G)
    _check_czp_group(kind, G, D)
    hb = _header_bytes(kind, H, G)
    row = okv_q_row_bytes(fmt, D)
    _page("page", page, hb + H * bs * row, False)
    V.array("out", out, (V.F32,), shape=(H, n, D), writeable=True)
    V.no_overlap("out", out, page, "page")
    if n == 0:
        return

    cdef const uint8_t[::1] pv = page
    cdef float[:, :, ::1] ov = out
    cdef const uint8_t *base = &pv[0]
    cdef int64_t cH = H, cn = n, cD = D, cG = G, cbs = bs, chb = hb, crow = row
    cdef okv_settings s = okv_settings_get()
    cdef int cfmt = fmt, per_channel = G != 1, simd = s.simd, ckind = kind
    cdef Py_ssize_t r, rows = cH * cn
    cdef int64_t h, tok
    cdef int nt = s.threads if rows * cD >= PAR_MIN else 1
    # The header is copied out (or decoded): a caller's page array need not be 4-byte aligned.
    cdef float *hdr = <float *>malloc(2 * cH * cG * sizeof(float))
    if hdr == NULL:
        raise MemoryError("dequantize_page: could not allocate the header copy")
    with nogil:
        _decode_header(ckind, base, cH, cG, cfmt, hdr, hdr + cH * cG, simd)
        for r in prange(rows, num_threads=nt, schedule='static'):
            h = r // cn
            tok = r - h * cn
            okv_dequant_row(base + chb + (h * cbs + tok) * crow, cfmt, hdr + h * cG, hdr + cH * cG + h * cG,
                            per_channel, &ov[h, tok, 0], cD, simd)
    free(hdr)
