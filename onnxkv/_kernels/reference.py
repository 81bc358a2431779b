"""NumPy reference twins of the compiled kernels (same signatures, same contracts).

They are slow and allocate freely; they exist to define the expected results in
tests and as the baseline in benchmarks.  Each writes into ``out`` like its
compiled twin.  Computation is in float64 for float32 inputs where it matters,
then cast to the output dtype.
"""

import numpy as np

from onnxkv._kernels.reference_elementwise import (  # noqa: F401 - the twins of activation and masks
    add,
    causal_mask,
    div_scalar,
    erf,
    gelu_tanh_mul,
    mul_scalar,
    sigmoid,
    silu,
    silu_mul,
)
from onnxkv._kernels.reference_integer import (  # noqa: F401 - the twins of imatmul
    dynamic_quantize_linear,
    matmul_dynamic,
    matmul_integer,
)
from onnxkv._kernels.reference_nbits import (  # noqa: F401 - the twins of qmatmul, here with the others
    bnb4_dequantize,
    matmul_nbits_f32,
    matmul_nbits_int8,
    nbits_codes,
    nbits_dequantize,
    quantize_rows_int8,
)


def _acc_dtype(x):
    return np.float64


def rms_norm(x, gamma, eps, out):
    xd = x.astype(np.float64)
    ms = np.mean(xd * xd, axis=-1, keepdims=True)
    out[...] = (xd / np.sqrt(ms + eps) * gamma).astype(out.dtype)


def skip_rms_norm(x, skip, gamma, bias, eps, out, sum_out):
    s = x + skip
    if bias is not None:
        s = s + bias
    s = s.astype(x.dtype)
    if sum_out is not None:
        sum_out[...] = s
    rms_norm(s, gamma, eps, out)


def softmax(x, out, empty_row=0.0):
    """Row softmax; a row of all -inf gives ``empty_row`` in every entry (the kernels' documented rule)."""
    xd = x.astype(np.float64)
    m = np.max(xd, axis=-1, keepdims=True) if xd.shape[-1] else np.zeros(xd.shape[:-1] + (1,))
    dead = np.isneginf(m)
    m = np.where(dead, 0.0, m)
    e = np.exp(xd - m)
    s = np.sum(e, axis=-1, keepdims=True)
    r = np.where(dead, float(empty_row), e / np.where(dead, 1.0, s))
    out[...] = r.astype(out.dtype)


def softcap(x, c, out):
    """NumPy twin of ``softcap``: c * tanh(x / c) in float64, rounded to out's dtype."""
    c64 = float(c.reshape(-1)[0])
    out[...] = (c64 * np.tanh(x.astype(np.float64) / c64)).astype(out.dtype)
    return out


def rotary_embedding(x, cos, sin, positions, interleaved, out):
    positions = np.asarray(positions)
    if positions.size and (positions.min() < 0 or positions.max() >= cos.shape[0]):
        raise ValueError("positions: out of range")
    half = cos.shape[1]
    r = 2 * half
    c = cos[positions][:, :, None, :].astype(np.float64)  # [B, S, 1, half]
    s = sin[positions][:, :, None, :].astype(np.float64)
    xd = x.astype(np.float64)
    res = xd.copy()
    if interleaved:
        x1, x2 = xd[..., 0:r:2], xd[..., 1:r:2]
        res[..., 0:r:2] = x1 * c - x2 * s
        res[..., 1:r:2] = x2 * c + x1 * s
    else:
        x1, x2 = xd[..., :half], xd[..., half:r]
        res[..., :half] = x1 * c - x2 * s
        res[..., half:r] = x2 * c + x1 * s
    out[...] = res.astype(out.dtype)


def kv_to_f32(x, kv_dtype=None):
    """K/V cache values as float32: float32 as is, float16 widened, and uint16
    bfloat16 bit patterns (only with kv_dtype="bfloat16") widened exactly."""
    if kv_dtype is not None and not isinstance(kv_dtype, str):
        kv_dtype = np.dtype(kv_dtype).name
    if kv_dtype == "bfloat16":
        if x.dtype != np.uint16:
            raise ValueError("k: kv_dtype='bfloat16' needs uint16 bit patterns")
        return f32_from_bf16(x)
    if x.dtype == np.uint16:
        raise ValueError("k: uint16 arrays are only accepted with kv_dtype='bfloat16'")
    return x.astype(np.float32)


def attention(q, k, v, kv_len, q_pos, scale, softcap, window, out, kv_start=None, *, kv_dtype=None, bf16=False):
    """Masked softmax attention with explicit score matrices (float64 math).
    FLOAT16/BFLOAT16 caches are converted to float32 first (kv_to_f32).  bf16: the prefill unit of
    prefill_precision="bf16" -- q * scale, k, v and the probabilities (exp(s - max), before the sum that
    normalises them) rounded to bfloat16 (bf16_round); the kernel rounds them against its running max."""
    k = kv_to_f32(k, kv_dtype)
    v = kv_to_f32(v, kv_dtype)
    if bf16:
        q, k, v, scale = bf16_round(q * np.float32(scale)), bf16_round(k), bf16_round(v), 1.0
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    if kv_start is None:
        kv_start = np.zeros(B, np.int32)
    res = np.zeros((B, Hq, Sq, D), np.float64)
    for b in range(B):
        n = int(kv_len[b])  # keys >= kv_len are never read
        j = np.arange(n)
        p = q_pos[b].astype(np.int64)[:, None]  # [Sq, 1]
        mask = (j[None, :] <= p) & (j[None, :] < kv_len[b]) & (j[None, :] >= kv_start[b])
        if window >= 0:
            mask &= j[None, :] >= p - window
        mask = np.tile(mask, (G, 1))  # rows ordered (g, t)
        kb = k[b, :, :n].astype(np.float64)  # [Hkv, n, D]
        vb = v[b, :, :n].astype(np.float64)
        qb = q[b].astype(np.float64).reshape(Hkv, G * Sq, D)
        s = (qb @ kb.transpose(0, 2, 1)) * scale  # [Hkv, G*Sq, n]
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        s = np.where(mask[None], s, -np.inf)
        m = s.max(axis=-1, keepdims=True) if n else np.full(s.shape[:-1] + (1,), -np.inf)
        dead = np.isneginf(m)
        e = np.exp(s - np.where(dead, 0.0, m))
        den = e.sum(axis=-1, keepdims=True)
        if bf16:
            e = bf16_round(e.astype(np.float32)).astype(np.float64)
        w = np.where(dead, 0.0, e / np.where(dead, 1.0, den))
        res[b] = _weighted_values(w, vb, mask).reshape(Hq, Sq, D)
    out[...] = res.astype(out.dtype)


def _weighted_values(w, v, mask):
    """sum_j w[h, r, j] * v[h, j] over the keys row r sees (mask [rows, n]): a key a row does not see adds
    nothing, not even 0 * NaN; a visible key adds w * v as IEEE does (0 * inf is NaN)."""
    finite = np.isfinite(v)
    with np.errstate(invalid="ignore"):
        res = w @ np.where(finite, v, 0.0)
        for h, j, d in zip(*np.nonzero(~finite)):
            res[h, mask[:, j], d] += w[h, mask[:, j], j] * v[h, j, d]
    return res


def decode_token(q, k, v, cos, sin, interleaved, k_cache, v_cache, pos, scale, softcap, window, out, *, kv_dtype=None):
    """Twin of the fused kernel: rotary on each row's S tokens' q and k at ``pos[b] + t`` (``pos`` an int or
    int [B]; float16 tokens widened to float32 first), rows written at ``pos[b] .. pos[b] + S - 1`` (rounded to
    the cache's type: float16, or bfloat16 bit patterns with kv_dtype="bfloat16"), causal attention of each
    query over [0, its position] of its row, its result rounded to out's type."""
    b, n = q.shape[:2]
    hkv, d = k_cache.shape[1], k_cache.shape[3]
    hq = q.shape[2] // d
    p = np.broadcast_to(np.asarray(pos, np.int64).reshape(-1), (b,))[:, None] + np.arange(n)[None, :]  # [B, S]
    q4, k4 = q.reshape(b, n, hq, d).astype(np.float32), k.reshape(b, n, hkv, d).astype(np.float32)
    if cos is not None:
        for x in (q4, k4):
            rotary_embedding(np.ascontiguousarray(x), cos, sin, p, interleaved, x)
    for cache, rows in ((k_cache, k4), (v_cache, v.reshape(b, n, hkv, d).astype(np.float32))):
        for r in range(b):
            row = rows[r].transpose(1, 0, 2)
            cache[r, :, p[r, 0] : p[r, 0] + n] = bf16_from_f32(row) if kv_dtype == "bfloat16" else row
    res, qh = np.empty((b, hq, n, d), np.float32), np.ascontiguousarray(q4.transpose(0, 2, 1, 3))
    attention(
        qh, k_cache, v_cache, (p[:, -1] + 1).astype(np.int32), p.astype(np.int32), scale, softcap, window, res,
        kv_dtype=kv_dtype,
    )  # fmt: skip
    out.reshape(b, n, hq, d)[...] = res.transpose(0, 2, 1, 3)
    return True


def decode_token_paged(q, k, v, cos, sin, interleaved, k_pages, v_pages, tables, bs, kv_heads, pos, scale, softcap,
                       window, out, *, kv_dtype=None):  # fmt: skip
    """Twin of the fused paged kernel: rotary on each row's q and k at ``pos[b] + t`` (q, k, v [B, S, W];
    float16 widened first), the rows written into the pages (``k_pages`` / ``v_pages`` the page arrays, as
    :func:`paged_attention` takes them; rounded to their type, bfloat16 bit patterns with
    kv_dtype="bfloat16"), then paged attention of each row's token ``t`` over its positions [0, pos[b] + t],
    its result rounded to out's type."""
    b, n, d = q.shape[0], q.shape[1], k.shape[2] // kv_heads
    hq = q.shape[2] // d
    p = np.asarray(pos, np.int64)[:, None] + np.arange(n)[None, :]  # [B, S]
    q4, k4 = q.reshape(b, n, hq, d).astype(np.float32), k.reshape(b, n, kv_heads, d).astype(np.float32)
    v4 = v.reshape(b, n, kv_heads, d).astype(np.float32)
    if cos is not None:
        for x in (q4, k4):
            rotary_embedding(x.copy(), cos, sin, p, interleaved, x)
    if kv_dtype == "bfloat16":
        k4, v4 = bf16_from_f32(k4), bf16_from_f32(v4)
    for r in range(b):
        for t in range(n):
            page, off = int(tables[r, p[r, t] // bs]), int(p[r, t] % bs)
            k_pages[page][:, off], v_pages[page][:, off] = k4[r, t], v4[r, t]
    qh, kl = np.ascontiguousarray(q4.transpose(0, 2, 1, 3)), (p[:, -1] + 1).astype(np.int32)
    res = np.empty((b, hq, n, d), np.float32)
    paged_attention(
        qh, k_pages, v_pages, tables, bs, kv_heads, kl, p.astype(np.int32), scale, softcap, window, res,
        kv_dtype=kv_dtype,
    )  # fmt: skip
    out.reshape(b, n, hq, d)[...] = res.transpose(0, 2, 1, 3)
    return True


def f16_to_f32(x, out):
    out[...] = x.astype(np.float32)


def f32_to_f16(x, out):
    with np.errstate(over="ignore"):
        out[...] = x.astype(np.float16)


def matmul_rows(x, w, out, bias=None):
    """out = x @ w (+ bias), computed in float64."""
    r = x.astype(np.float64) @ w.astype(np.float64)
    if bias is not None:
        r = r + bias
    out[...] = r.astype(out.dtype)


def pack_weight(w, panel=16):
    """w [K, N] -> [ceil(N / panel), K, panel]: wp[p, k, j] = w[k, panel * p + j], zero past N."""
    k, n = w.shape
    p = -(-n // panel)
    padded = np.zeros((k, p * panel), w.dtype)
    padded[:, :n] = w
    return np.ascontiguousarray(padded.reshape(k, p, panel).transpose(1, 0, 2))


def matmul_packed(x, wp, out, bias=None):
    """out = x @ w (+ bias) for wp = pack_weight(w), w [K, out.shape[1]] float32 or float16 (widened exactly);
    float64 sums."""
    n = out.shape[1]
    w = wp.transpose(1, 0, 2).reshape(wp.shape[1], -1)[:, :n]
    matmul_rows(x, w, out, bias)


def f32_from_bf16(u):
    """bfloat16 bit patterns (uint16) -> float32 (exact: the bits become the
    upper half of the float32)."""
    u = np.asarray(u, dtype=np.uint16)
    return (u.astype(np.uint32) << np.uint32(16)).view(np.float32)


def bf16_from_f32(x):
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even;
    overflow gives +-inf, NaN stays NaN (quiet bit set)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = np.where(nan, (u >> 16) | 0x40, r)
    return r.astype(np.uint16)


def bf16_round(x):
    """The bfloat16 rounding of the bf16 products (matmul_bf16.h): nearest even, a subnormal to a zero of its
    sign, NaN quiet; returned as float32 values."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    r = f32_from_bf16(bf16_from_f32(x))
    return np.where((u & 0x7F800000) == 0, np.copysign(np.float32(0), x), r).astype(np.float32)


def matmul_bf16(x, wp, out, bias=None):
    """``matmul_packed`` with prefill_precision="bf16" (>= BF16_MIN_ROWS rows): the float64 product of the
    bfloat16-rounded x and w (+ bias), stored as float32."""
    n = out.shape[1]
    w = wp.transpose(1, 0, 2).reshape(wp.shape[1], -1)[:, :n]
    y = bf16_round(x).astype(np.float64) @ bf16_round(w).astype(np.float64)
    out[...] = y if bias is None else y + bias


def bf16_to_f32(x, out):
    out[...] = f32_from_bf16(x)


def f32_to_bf16(x, out):
    out[...] = bf16_from_f32(x)


_FLOAT_FORMATS = {1: "float32", 10: "float16", 16: "bfloat16"}  # page format code -> kv_dtype


def paged_attention(
    q,
    k_pages,
    v_pages,
    block_tables,
    block_size,
    kv_heads,
    kv_len,
    q_pos,
    scale,
    softcap,
    window,
    out,
    *,
    kv_start=None,
    kv_dtype=None,
    k_formats=None,
    v_formats=None,
    k_group=1,
    v_group=1,
    k_header="float32",
):
    """NumPy twin of the compiled ``paged_attention`` (same arguments, same result).

    NumPy cannot dereference addresses, so ``k_pages`` / ``v_pages`` are the
    pages themselves: sequences indexed by page id (a list, or an ndarray
    [P, kv_heads, block_size, D]) whose entries are arrays [kv_heads, block_size,
    D] of the cache storage dtype (uint16 bit patterns for kv_dtype="bfloat16"),
    or None for "no page".  Each row's blocks holding a key visible to some
    query (``_validate.paged_blocks_read``) are gathered into a contiguous
    float32 cache -- the other blocks stay zero and are never looked at -- and
    :func:`attention` computes the result.  A read block whose entry is not a
    page raises ValueError.

    Per-page formats (k_formats / v_formats uint8 [P] codes, k_group /
    v_group): a page of a float format is an array [kv_heads, block_size, D]
    of its storage dtype (float32, float16, uint16 bfloat16 bits); a page of
    a quantized format is its payload (bytes: header then codes), dequantized
    by :func:`dequantize_page` (key pages with header kind ``k_header``:
    "float32", "compact", or "channel-zp" with ``k_group`` = D; ValueError
    naming k_header / k_group otherwise).  Returns None (the compiled kernel's
    counters have no twin).
    """
    from ._validate import paged_blocks_read

    B, Hq, Sq, D = q.shape
    M, bs = block_tables.shape[1], int(block_size)
    _header_group("k_header", k_header, "k_group", k_group, D)
    read = paged_blocks_read(kv_len, q_pos, int(window), bs, M, kv_start)

    def page_f32(pages, pid, formats, group, header="float32"):
        page = pages[pid]
        if formats is None:
            return kv_to_f32(page, kv_dtype)
        fmt = int(formats[pid])
        if fmt in _FLOAT_FORMATS:
            return kv_to_f32(page, _FLOAT_FORMATS[fmt])
        vals = np.empty((kv_heads, bs, D), np.float32)
        dequantize_page(
            np.ascontiguousarray(page).reshape(-1).view(np.uint8), fmt, kv_heads, bs, D, group, bs, vals, header
        )
        return vals

    for b in range(B):
        nblk = -(-int(kv_len[b]) // bs)
        kc = np.zeros((1, kv_heads, nblk * bs, D), np.float32)
        vc = np.zeros_like(kc)
        for i in np.flatnonzero(read[b]):
            pid = int(block_tables[b, i])
            if not 0 <= pid < len(k_pages) or k_pages[pid] is None or v_pages[pid] is None:
                raise ValueError(f"block_tables: row {b}, block {i} is read but maps to no page ({pid})")
            kc[0, :, i * bs : (i + 1) * bs] = page_f32(k_pages, pid, k_formats, k_group, k_header)
            vc[0, :, i * bs : (i + 1) * bs] = page_f32(v_pages, pid, v_formats, v_group)
        attention(
            q[b : b + 1],
            kc,
            vc,
            np.asarray(kv_len[b : b + 1]),
            np.asarray(q_pos[b : b + 1]),
            scale,
            softcap,
            window,
            out[b : b + 1],
            None if kv_start is None else np.asarray(kv_start[b : b + 1]),
        )


# Integer page formats (ONNX element type code -> bits, lowest code, highest code).
_QFORMATS = {2: (8, 0, 255), 3: (8, -128, 127), 21: (4, 0, 15), 22: (4, -8, 7), 25: (2, 0, 3), 26: (2, -2, 1)}


#: Header bytes (before the padding to 64) of each header kind, from (heads H, groups per head G):
#: float32 scale and zero point per group; compact: float32 S per head, exponent and zero-point codes per
#: group; channel-zp: float32 s and w per head, int8 zero-point codes o per group (G = head size).
_HEADER_BYTES = {
    "float32": lambda H, G: 8 * H * G,
    "compact": lambda H, G: 4 * H + 2 * H * G,
    "channel-zp": lambda H, G: 8 * H + H * G,
}


def _header_group(header_name, header, group_name, group, head_size):
    """Check a header kind (one of _HEADER_BYTES) and its groups per head: "channel-zp" needs G = head_size."""
    if not isinstance(header, str) or header not in _HEADER_BYTES:
        raise ValueError(f"{header_name}: expected one of {list(_HEADER_BYTES)}, got {header!r}")
    if header == "channel-zp" and group != head_size:
        raise ValueError(
            f"{group_name}: a 'channel-zp' header needs one group per channel (the head size {head_size}), got {group}"
        )


def _qlayout(fmt_code, heads, head_size, group, header="float32"):
    """(bits, qmin, qmax, header bytes, bytes per token row) of an integer page."""
    if fmt_code not in _QFORMATS:
        raise ValueError(f"fmt_code: {fmt_code} is not an integer page format (expected one of {list(_QFORMATS)})")
    bits, qmin, qmax = _QFORMATS[fmt_code]
    if head_size * bits % 8:
        raise ValueError(f"head_size: {head_size} * {bits} bits is not a multiple of 8")
    _header_group("header", header, "group", group, head_size)
    return bits, qmin, qmax, -(-_HEADER_BYTES[header](heads, group) // 64) * 64, head_size * bits // 8


# 2^(-i/16) and 2^-k rounded to float32: a compact header's scale is (S * _STEPS[e & 15]) * _OCTAVES[e >> 4].
_STEPS = np.array([2.0 ** (-i / 16) for i in range(16)], np.float32)
_OCTAVES = np.array([2.0**-k for k in range(16)], np.float32)


def _header_params(page, fmt_code, H, G, header):
    """float32 (scale, zero_point) [H, 1, G] of a page's header of kind ``header``.

    channel-zp: scale s[h] for every group of head h; zero_point z0 + w[h] * o[h*G + g] (z0 = 0 for signed
    formats, 2^(bits-1) for unsigned; exact in float32: |w * o| <= 2^23)."""
    if header == "float32":
        hdr = page[: 8 * H * G].copy().view(np.float32)
        return hdr[: H * G].reshape(H, 1, G), hdr[H * G :].reshape(H, 1, G)
    if header == "channel-zp":
        sw = page[: 8 * H].copy().view(np.float32)
        s, w = sw[:H].reshape(H, 1, 1), sw[H:].reshape(H, 1, 1)
        o = page[8 * H : 8 * H + H * G].view(np.int8).reshape(H, 1, G).astype(np.float32)
        bits, qmin, _ = _QFORMATS[fmt_code]
        z0 = np.float32(0 if qmin < 0 else 1 << (bits - 1))
        return np.broadcast_to(s, (H, 1, G)).copy(), z0 + w * o
    S = page[: 4 * H].copy().view(np.float32).reshape(H, 1, 1)
    e = page[4 * H : 4 * H + H * G].reshape(H, 1, G).astype(np.intp)
    zc = page[4 * H + H * G : 4 * H + 2 * H * G].reshape(H, 1, G)
    return (S * _STEPS[e & 15]) * _OCTAVES[e >> 4], zc.astype(np.float32)


def quantize_page(
    x, fmt_code, scale, zero_point, group, out_page, block_size, t0=0, header=None, header_kind="compact"
):
    """NumPy twin of the compiled ``quantize_page``: q = saturate(rint(x / scale)
    + zero_point) in float32 (``np.rint`` rounds half to even; NaN gives the
    lowest code), packed low bits first; writes the header (float32 from scale /
    zero_point, or the ``header`` bytes of kind ``header_kind`` -- "compact" or
    "channel-zp" (group = head size) -- as given) and the code bytes of tokens
    t0 .. t0+n only.  Given header bytes must have that kind's length and
    decode exactly to ``scale`` / ``zero_point`` (ValueError naming ``header``
    otherwise; nothing written)."""
    H, n, D = x.shape
    G = int(group)
    if header is not None and header_kind not in ("compact", "channel-zp"):
        raise ValueError(f"header_kind: header bytes are 'compact' or 'channel-zp', got {header_kind!r}")
    kind = "float32" if header is None else header_kind
    bits, qmin, qmax, hb, row = _qlayout(fmt_code, H, D, G, kind)
    if header is not None:
        if header.shape != (hb,):
            raise ValueError(
                f"header: a {kind!r} header of {H} heads and {G} groups per head has {hb} bytes, "
                f"got shape {header.shape}"
            )
        dec_s, dec_z = (a.reshape(-1) for a in _header_params(header, fmt_code, H, G, kind))
        same = (dec_s == scale) & (dec_z == zero_point)
        if not same.all():
            i = int(np.argmin(same))
            raise ValueError(
                f"header: decodes to scale[{i}] = {dec_s[i]!r}, zero_point[{i}] = {dec_z[i]!r}, "
                f"but scale[{i}] = {scale[i]!r}, zero_point[{i}] = {zero_point[i]!r}"
            )
    v = np.rint(x / scale.reshape(H, 1, G)) + zero_point.reshape(H, 1, G)
    v = np.minimum(np.where(v >= qmin, v, np.float32(qmin)), np.float32(qmax))
    per = 8 // bits
    q = (v.astype(np.int64) & ((1 << bits) - 1)).reshape(H, n, row, per)
    packed = np.bitwise_or.reduce(q << (np.arange(per) * bits), axis=-1).astype(np.uint8)
    if header is None:
        out_page[:hb] = 0
        out_page[: 4 * H * G] = scale.view(np.uint8)
        out_page[4 * H * G : 8 * H * G] = zero_point.view(np.uint8)
    else:
        out_page[:hb] = header
    out_page[hb : hb + H * block_size * row].reshape(H, block_size, row)[:, t0 : t0 + n] = packed


def dequantize_page(page, fmt_code, heads, block_size, head_size, group, tokens, out, header="float32"):
    """NumPy twin of the compiled ``dequantize_page``: out = (q - zero_point) *
    scale in float32 for tokens 0 .. tokens of every head (parameters from the
    page's header of kind ``header``: "float32", "compact", or "channel-zp"
    with group = head size)."""
    H, D, G = int(heads), int(head_size), int(group)
    bits, qmin, qmax, hb, row = _qlayout(fmt_code, H, D, G, header)
    per = 8 // bits
    codes = page[hb : hb + H * block_size * row].reshape(H, block_size, row)[:, :tokens].astype(np.int64)
    q = ((codes[..., None] >> (np.arange(per) * bits)) & ((1 << bits) - 1)).reshape(H, tokens, D)
    if qmin < 0:
        q = np.where(q > qmax, q - (1 << bits), q)
    scale, zero_point = _header_params(page, fmt_code, H, G, header)
    out[...] = (q.astype(np.float32) - zero_point) * scale


def page_write(new: np.ndarray, pages: list, tables: np.ndarray, starts: np.ndarray, block_size: int) -> None:
    """Twin of ``onnxkv._kernels.page_write``; ``pages`` are the page arrays [H, block_size, D] by page id."""
    B, H, S, D = new.shape
    for b in range(B):
        for t in range(S):
            pos = int(starts[b]) + t
            pages[int(tables[b, pos // block_size])][:, pos % block_size] = new[b, :, t]


def top_indices(x: np.ndarray, n: int) -> np.ndarray:
    """Twin of ``sampling.top_indices``: indices of the ``n`` largest entries of every row of ``x`` [R, N]
    (no NaN, n <= N), best first; ties go to the lower index.  A partition, then a sort of n entries."""
    out = np.empty((x.shape[0], n), dtype=np.int64)
    for r in range(x.shape[0]):
        v = -x[r]
        kth = np.partition(v, n - 1)[n - 1]
        better = np.flatnonzero(v < kth)
        idx = np.concatenate([better, np.flatnonzero(v == kth)[: n - better.size]])
        out[r] = idx[np.lexsort((idx, v[idx]))]
    return out


def sample(logits, temperature, top_k, top_p, u, probs=None):
    """Twin of ``sampling.sample``: one token per row of ``logits`` [B, V], drawn with ``u`` [B] after
    temperature, top-k and top-p, in float64 NumPy (``probs`` [B, V] receives the filtered probabilities)."""
    x = logits.astype(np.float64)
    with np.errstate(over="ignore"):  # a tiny temperature: -inf below the largest, as the kernel has it
        x = (x - x.max(axis=-1, keepdims=True)) / temperature
    v = x.shape[-1]
    if top_k is not None and top_k < v:
        kth = np.partition(x, v - top_k, axis=-1)[:, v - top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    x = x - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        cum = np.cumsum(sorted_p, axis=-1)
        keep_sorted = (cum - sorted_p) < top_p  # always keeps the most likely token
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    if probs is not None:
        probs[...] = p
    ids = (np.cumsum(p, axis=-1) <= u[:, None]).sum(axis=-1)
    last = v - 1 - np.argmax((p > 0)[:, ::-1], axis=-1)  # the last token of nonzero probability (0 if none)
    return np.minimum(ids, last).astype(np.int64)
