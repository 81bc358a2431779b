"""quantize_page / dequantize_page: bit-exact against the NumPy twins on every
integer format, head size, block size and granularity, with float32 and compact
headers; rounding, saturation, packing order, partial pages and argument checks."""

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R
from onnxkv.cache.formats import compact_params, decode_header, header_bytes, page_bytes, page_format, params_for

from .conftest import rand

INT_FORMATS = ["uint8", "int8", "uint4", "int4", "uint2", "int2"]


def _page(rng, fmt, H, bs, D, G):
    """A page of random bytes (stands for garbage left by earlier tokens)."""
    return rng.integers(0, 256, page_bytes(fmt, H, bs, D, G), dtype=np.uint8)


def _token_bytes(page, fmt, H, bs, D, G, header="float32"):
    """View of a page's codes as [H, bs, bytes per token]."""
    row, hb = D * page_format(fmt).bits // 8, header_bytes(fmt, H, G, header)
    return page[hb : hb + H * bs * row].reshape(H, bs, row)


def _within_half_scale(x, rec, scale, zp, fmt, G):
    """Every non-saturated value reconstructs within scale / 2 (plus float32
    rounding of the division and the product); returns how many were checked."""
    f = page_format(fmt)
    H = x.shape[0]
    s = scale.reshape(H, 1, G).astype(np.float64)
    z = zp.reshape(H, 1, G).astype(np.float64)
    q = np.rint(x / s) + z
    ok = (q >= f.qmin) & (q <= f.qmax)
    err = np.abs(rec.astype(np.float64) - x)
    bound = s / 2 + 2.0**-23 * (np.abs(x) + s)
    assert (err <= bound)[ok].all(), float(np.max((err - bound)[ok]))
    return int(ok.sum())


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("bs", [1, 16, 32])
@pytest.mark.parametrize("gran", ["head", "channel"])
def test_matches_twin_on_partial_pages(fmt, D, bs, gran, threads, simd):
    rng = np.random.default_rng([INT_FORMATS.index(fmt), D, bs, int(gran == "head")])
    H = 5
    G = 1 if gran == "head" else D
    code = page_format(fmt).code
    t0 = int(rng.integers(0, bs))
    n = int(rng.integers(1, bs - t0 + 1))
    x = rand(rng, (H, n, D), scale=3.0) + rng.standard_normal((H, 1, D)).astype(np.float32)
    scale, zp = params_for(x, fmt, gran)
    before = _page(rng, fmt, H, bs, D, G)
    got, want = before.copy(), before.copy()
    K.quantize_page(x, code, scale, zp, G, got, bs, t0)
    R.quantize_page(x, code, scale, zp, G, want, bs, t0)
    np.testing.assert_array_equal(got, want)
    # header as given, zero padded; other tokens' bytes untouched
    np.testing.assert_array_equal(got[: 4 * H * G].view(np.float32), scale)
    np.testing.assert_array_equal(got[4 * H * G : 8 * H * G].view(np.float32), zp)
    assert not got[8 * H * G : header_bytes(fmt, H, G)].any()
    tg, tb = _token_bytes(got, fmt, H, bs, D, G), _token_bytes(before, fmt, H, bs, D, G)
    np.testing.assert_array_equal(tg[:, :t0], tb[:, :t0])
    np.testing.assert_array_equal(tg[:, t0 + n :], tb[:, t0 + n :])

    tokens = t0 + n
    out, ref = np.full((H, tokens, D), np.nan, np.float32), np.empty((H, tokens, D), np.float32)
    K.dequantize_page(got, code, H, bs, D, G, tokens, out)
    R.dequantize_page(got, code, H, bs, D, G, tokens, ref)
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))
    assert _within_half_scale(x, out[:, t0:], scale, zp, fmt, G) > x.size // 2


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("gran", ["head", "channel"])
def test_full_page_parallel_rows(fmt, gran, threads, simd):
    """[8, 32, 128]: large enough that the kernels split rows over threads."""
    rng = np.random.default_rng(INT_FORMATS.index(fmt))
    H, bs, D = 8, 32, 128
    G = 1 if gran == "head" else D
    code = page_format(fmt).code
    x = rand(rng, (H, bs, D))
    scale, zp = params_for(x, fmt, gran)
    got, want = _page(rng, fmt, H, bs, D, G), np.zeros(page_bytes(fmt, H, bs, D, G), np.uint8)
    K.quantize_page(x, code, scale, zp, G, got, bs)
    R.quantize_page(x, code, scale, zp, G, want, bs)
    np.testing.assert_array_equal(got, want)
    out, ref = np.empty_like(x), np.empty_like(x)
    K.dequantize_page(got, code, H, bs, D, G, bs, out)
    R.dequantize_page(got, code, H, bs, D, G, bs, ref)
    np.testing.assert_array_equal(out, ref)
    assert _within_half_scale(x, out, scale, zp, fmt, G) == x.size


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("D", [1, 4, 12, 20, 44, 100])
def test_head_sizes_off_the_vector_width(fmt, D, simd):
    """Head sizes that leave a scalar tail after the 32- (quantize) or 8-wide
    (dequantize) vector loops; those whose codes do not fill bytes are rejected."""
    f = page_format(fmt)
    rng = np.random.default_rng([D, f.code])
    H, bs = 2, 3
    x = rand(rng, (H, bs, D))
    if D * f.bits % 8:
        with pytest.raises(ValueError, match="^head_size"):
            K.quantize_page(x, f.code, np.ones(H, np.float32), np.zeros(H, np.float32), 1, np.zeros(4096, np.uint8), bs)
        return
    scale, zp = params_for(x, fmt, "channel")
    got, want = np.zeros((2, page_bytes(fmt, H, bs, D, D)), np.uint8)
    K.quantize_page(x, f.code, scale, zp, D, got, bs)
    R.quantize_page(x, f.code, scale, zp, D, want, bs)
    np.testing.assert_array_equal(got, want)
    out, ref = np.empty_like(x), np.empty_like(x)
    K.dequantize_page(got, f.code, H, bs, D, D, bs, out)
    R.dequantize_page(got, f.code, H, bs, D, D, bs, ref)
    np.testing.assert_array_equal(out, ref)
    assert _within_half_scale(x, out, scale, zp, fmt, D) == x.size


def test_appending_equals_one_call(simd):
    rng = np.random.default_rng(7)
    H, bs, D = 3, 16, 80
    x = rand(rng, (H, bs, D))
    scale, zp = params_for(x, "uint4", "channel")
    whole, parts = _page(rng, "uint4", H, bs, D, D), _page(rng, "uint4", H, bs, D, D)
    K.quantize_page(x, 21, scale, zp, D, whole, bs)
    for a, b in [(0, 5), (5, 6), (6, 16)]:
        K.quantize_page(np.ascontiguousarray(x[:, a:b]), 21, scale, zp, D, parts, bs, a)
    np.testing.assert_array_equal(parts, whole)


def _tie_expected(v):
    """Round half to even of v = k + 0.5, by hand."""
    k = int(np.floor(v))
    return k if k % 2 == 0 else k + 1


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_ties_round_to_even(fmt, simd):
    f = page_format(fmt)
    D = 32
    zp = (f.qmin + f.qmax + 1) // 2
    # x / scale = k + 0.5 exactly (scale a power of two), inside the code range
    ks = np.arange(f.qmin - zp, f.qmax - zp)
    v = np.resize(ks + 0.5, D)
    scale = np.float32(0.25)
    x = (v * scale).astype(np.float32).reshape(1, 1, D)
    s, z = np.array([scale], np.float32), np.array([zp], np.float32)
    expected = np.array([_tie_expected(t) for t in v]) + zp
    for impl in (K, R):
        page = np.zeros(page_bytes(fmt, 1, 1, D, 1), np.uint8)
        impl.quantize_page(x, f.code, s, z, 1, page, 1)
        out = np.empty((1, 1, D), np.float32)
        impl.dequantize_page(page, f.code, 1, 1, D, 1, 1, out)
        np.testing.assert_array_equal(out[0, 0] / scale + zp, expected)


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_saturation_at_both_ends(fmt, simd):
    f = page_format(fmt)
    D = 32
    zp = (f.qmin + f.qmax + 1) // 2
    vals = np.array([1e6, -1e6, np.inf, -np.inf, np.nan, (f.qmax - zp + 0.6), (f.qmin - zp - 0.6), 0.0], np.float32)
    x = np.resize(vals, D).reshape(1, 1, D).astype(np.float32)
    s, z = np.ones(1, np.float32), np.array([zp], np.float32)
    want = np.resize(np.array([f.qmax, f.qmin, f.qmax, f.qmin, f.qmin, f.qmax, f.qmin, zp]), D)
    for impl in (K, R):
        page = np.zeros(page_bytes(fmt, 1, 1, D, 1), np.uint8)
        impl.quantize_page(x, f.code, s, z, 1, page, 1)
        out = np.empty((1, 1, D), np.float32)
        impl.dequantize_page(page, f.code, 1, 1, D, 1, 1, out)
        np.testing.assert_array_equal(out[0, 0] + zp, want)


@pytest.mark.parametrize(
    "fmt, codes, byte",
    [
        ("int4", [1, -2], [0xE1]),
        ("uint4", [3, 12], [0xC3]),
        ("int2", [1, -2, 0, -1], [0xC9]),
        ("uint2", [0, 1, 2, 3], [0xE4]),
        ("int8", [-1, 5], [0xFF, 0x05]),
        ("uint8", [200, 7], [0xC8, 0x07]),
    ],
)
def test_packing_low_bits_first(fmt, codes, byte, simd):
    f = page_format(fmt)
    D = len(codes)
    x = np.array(codes, np.float32).reshape(1, 1, D) * np.float32(0.5)
    s, z = np.array([0.5], np.float32), np.zeros(1, np.float32)
    for impl in (K, R):
        page = np.zeros(page_bytes(fmt, 1, 1, D, 1), np.uint8)
        impl.quantize_page(x, f.code, s, z, 1, page, 1)
        assert page[64:].tolist() == byte
        assert page[:8].tobytes() == s.tobytes() + z.tobytes()
        out = np.empty((1, 1, D), np.float32)
        impl.dequantize_page(page, f.code, 1, 1, D, 1, 1, out)
        assert (out[0, 0] / np.float32(0.5)).tolist() == codes


def _args(rng):
    H, n, bs, D = 2, 3, 4, 8
    x = rand(rng, (H, n, D))
    scale, zp = params_for(x, "int4", "head")
    return dict(
        x=x,
        fmt_code=22,
        scale=scale,
        zero_point=zp,
        group=1,
        out_page=_page(rng, "int4", H, bs, D, 1),
        block_size=bs,
        t0=0,
    )


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(fmt_code=1), "fmt_code"),
        (dict(fmt_code=99), "fmt_code"),
        (dict(fmt_code="int4"), "fmt_code"),
        (dict(fmt_code=1 << 40), "fmt_code"),
        (dict(x="x64"), "x"),
        (dict(x="x2d"), "x"),
        (dict(x="d3"), "head_size"),
        (dict(group=3), "group"),
        (dict(group=0), "group"),
        (dict(scale="neg"), "scale"),
        (dict(scale="nan"), "scale"),
        (dict(scale="short"), "scale"),
        (dict(zero_point="frac"), "zero_point"),
        (dict(zero_point="big"), "zero_point"),
        (dict(zero_point="f64"), "zero_point"),
        (dict(out_page="small"), "out_page"),
        (dict(out_page="u16"), "out_page"),
        (dict(out_page="ro"), "out_page"),
        (dict(t0=2), "t0"),
        (dict(t0=-1), "t0"),
        (dict(block_size=0), "block_size"),
        (dict(t0=2**63), "t0"),
        (dict(block_size=2**64), "block_size"),
        (dict(group=2**63), "group"),
    ],
)
def test_quantize_rejects_bad_arguments(change, name):
    rng = np.random.default_rng(3)
    a = _args(rng)
    subst = {
        "x64": a["x"].astype(np.float64),
        "x2d": a["x"][0],
        "d3": np.ones((2, 3, 3), np.float32),
        "neg": -a["scale"],
        "nan": np.full_like(a["scale"], np.nan),
        "short": a["scale"][:1],
        "frac": a["zero_point"] + np.float32(0.5),
        "big": a["zero_point"] + np.float32(8),
        "f64": a["zero_point"].astype(np.float64),
        "small": a["out_page"][:-1],
        "u16": a["out_page"].view(np.uint16),
        "ro": a["out_page"].copy(),
    }
    for k, v in change.items():
        a[k] = subst[v] if isinstance(v, str) and v in subst else v
    if change.get("out_page") == "ro":
        a["out_page"].flags.writeable = False
    before = a["out_page"].copy()
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        K.quantize_page(**a)
    np.testing.assert_array_equal(a["out_page"], before)


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(fmt_code=10), "fmt_code"),
        (dict(heads=0), "heads"),
        (dict(head_size=6, out="d6"), "head_size"),
        (dict(tokens=5), "tokens"),
        (dict(page="small"), "page"),
        (dict(page="i8"), "page"),
        (dict(out="shape"), "out"),
        (dict(out="f64"), "out"),
        (dict(group=2), "group"),
        # sizes past int64 raised OverflowError converting to C
        (dict(heads=2**64), "heads"),
        (dict(block_size=2**63), "block_size"),
        (dict(head_size=2**63), "head_size"),
        (dict(tokens=2**64), "tokens"),
        (dict(heads=np.uint64(2**64 - 1)), "heads"),
    ],
)
def test_dequantize_rejects_bad_arguments(change, name):
    rng = np.random.default_rng(4)
    H, bs, D = 2, 4, 8
    page = _page(rng, "int2", H, bs, D, 1)
    a = dict(
        page=page,
        fmt_code=26,
        heads=H,
        block_size=bs,
        head_size=D,
        group=1,
        tokens=3,
        out=np.full((H, 3, D), 9, np.float32),
    )
    subst = {
        "small": page[:-1],
        "i8": page.view(np.int8),
        "shape": np.empty((H, 2, D), np.float32),
        "f64": np.empty((H, 3, D)),
        "d6": np.empty((H, 3, 6), np.float32),
    }
    for k, v in change.items():
        a[k] = subst[v] if isinstance(v, str) else v
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        K.dequantize_page(**a)
    if change.get("out") is None:
        assert (a["out"] == 9).all()


# ---------------------------------------------------------------- compact headers


def _compact_page(rng, fmt, H, bs, D):
    """A page of random bytes with a random valid compact header (S > 0, any exponent codes,
    zero-point codes inside the format's range): (page, decoded scale, decoded zero point)."""
    f = page_format(fmt)
    page = rng.integers(0, 256, page_bytes(fmt, H, bs, D, D, "compact"), dtype=np.uint8)
    page[: 4 * H] = rng.uniform(0.01, 4.0, H).astype(np.float32).view(np.uint8)
    page[4 * H + H * D : 4 * H + 2 * H * D] = 0 if f.signed else rng.integers(0, f.qmax + 1, H * D)
    scale, zp = decode_header(page, fmt, H, D, "compact")
    return page, scale, zp


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("D", [12, 64, 80, 128])
@pytest.mark.parametrize("bs", [1, 16])
def test_compact_header_matches_twin(fmt, D, bs, threads, simd):
    """Random compact headers: the kernels write the header as given and the same codes as the
    twin, and read back (decoding every exponent code) bit for bit as the twin does."""
    f = page_format(fmt)
    rng = np.random.default_rng([INT_FORMATS.index(fmt), D, bs, 99])
    H = 5
    before, scale, zp = _compact_page(rng, fmt, H, bs, D)
    hb = header_bytes(fmt, H, D, "compact")
    header = before[:hb].copy()
    t0 = int(rng.integers(0, bs))
    n = int(rng.integers(1, bs - t0 + 1))
    x = rand(rng, (H, n, D), scale=3.0)
    got, want = before.copy(), before.copy()
    K.quantize_page(x, f.code, scale, zp, D, got, bs, t0, header=header)
    R.quantize_page(x, f.code, scale, zp, D, want, bs, t0, header=header)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[:hb], header)
    tg, tb = _token_bytes(got, fmt, H, bs, D, D, "compact"), _token_bytes(before, fmt, H, bs, D, D, "compact")
    np.testing.assert_array_equal(tg[:, :t0], tb[:, :t0])
    np.testing.assert_array_equal(tg[:, t0 + n :], tb[:, t0 + n :])
    out, ref = np.full((H, t0 + n, D), np.nan, np.float32), np.empty((H, t0 + n, D), np.float32)
    K.dequantize_page(got, f.code, H, bs, D, D, t0 + n, out, "compact")
    R.dequantize_page(got, f.code, H, bs, D, D, t0 + n, ref, "compact")
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))
    assert _within_half_scale(x, out[:, t0:], scale, zp, fmt, D) > 0


def test_compact_header_arguments_are_checked():
    rng = np.random.default_rng(8)
    H, bs, D = 2, 4, 16
    x = rand(rng, (H, bs, D))
    scale, zp, header = compact_params(x, "uint8")
    page = np.zeros(page_bytes("uint8", H, bs, D, D, "compact"), np.uint8)
    off = scale.copy()
    off[3] *= np.float32(1.5)
    for kw, msg in [
        (dict(header=header[:-1]), "^header: a compact header of 2 heads and 16 groups per head has 128"),
        (dict(header=header.astype(np.int8)), "^header: dtype int8"),
        (dict(scale=off), r"^header: decodes to scale\[3\]"),
        (dict(zero_point=zp + np.float32(1)), r"^header: decodes to scale\[0\]"),
    ]:
        a = dict(x=x, fmt_code=2, scale=scale, zero_point=zp, group=D, out_page=page, block_size=bs, header=header)
        a.update(kw)
        with pytest.raises(ValueError, match=msg):
            K.quantize_page(**a)
        assert not page.any()
    with pytest.raises(ValueError, match="^group: a compact header holds at most 512 groups per head, got 520"):
        K.quantize_page(
            rand(rng, (1, 1, 520)),
            2,
            np.ones(520, np.float32),
            np.zeros(520, np.float32),
            520,
            np.zeros(4096, np.uint8),
            1,
            header=np.zeros(1088, np.uint8),
        )
    out = np.full((H, bs, D), 9, np.float32)
    with pytest.raises(ValueError, match="^header: expected one of 'float32', 'compact', 'channel-zp', got 'f32'"):
        K.dequantize_page(page, 2, H, bs, D, D, bs, out, "f32")
    with pytest.raises(ValueError, match="^page: page of 127 bytes is too small"):
        K.dequantize_page(page[:127], 2, H, 1, D, D, 1, out[:, :1], "compact")
    assert (out == 9).all()
