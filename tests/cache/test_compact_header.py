"""The compact page header (formats "compact"): layout arithmetic, compact_params' rounding-up
rule, encode_header / decode_header round trips and their checks."""

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv.cache.formats import (
    COMPACT_MAX_GROUPS,
    compact_params,
    decode_header,
    encode_header,
    header_bytes,
    page_bytes,
    page_format,
    params_for,
)
from onnxkv.errors import InputError

INT_FORMATS = ["uint8", "int8", "uint4", "int4", "uint2", "int2"]


def _keys(rng, H, n, D):
    """Key-like data: per-channel offsets and spreads, one all-positive and one zero channel,
    one tiny channel, and (if H > 2) one head of zeros only."""
    x = (
        rng.standard_normal((H, n, D)) * rng.uniform(0.05, 4.0, (1, 1, D)) + rng.standard_normal((1, 1, D)) * 3
    ).astype(np.float32)
    x[:, :, 0] = np.abs(x[:, :, 0]) + 1.0
    x[:, :, 1] = 0.0
    x[:, :, 2] *= np.float32(1e-6)
    if H > 2:
        x[2] = 0.0
    return x


def _decode(S, e):
    """S * 2^(-e/16) in the documented float32 steps: (S * fl32(2^(-(e%16)/16))) * 2^-(e//16)."""
    steps = np.array([2.0 ** (-i / 16) for i in range(16)], np.float32)
    return (np.float32(S) * steps[e % 16]) * np.float32(2.0 ** -(e // 16))


@pytest.mark.parametrize(
    "fmt, H, G, want",
    [
        ("uint8", 8, 128, 2112),
        ("int4", 3, 80, 512),
        ("uint2", 1, 1, 64),
        ("int8", 8, 512, 8256),
        ("float16", 8, 128, 0),
    ],
)
def test_compact_header_bytes(fmt, H, G, want):
    assert header_bytes(fmt, H, G, "compact") == want
    assert page_bytes("uint8", 8, 16, 128, 128, "compact") == 2112 + 16384


def test_compact_header_layout_checks():
    with pytest.raises(InputError, match=f"at most {COMPACT_MAX_GROUPS} groups per head, got 513"):
        header_bytes("uint8", 2, 513, "compact")
    with pytest.raises(InputError, match="header must be one of"):
        header_bytes("uint8", 2, 16, "float16")
    x = np.ones((2, 3, 513), np.float32)
    with pytest.raises(InputError, match="compact_params: a compact header holds at most 512"):
        compact_params(x, "uint8")
    with pytest.raises(InputError, match="compact_params: format float32 is a float format"):
        compact_params(x[:, :, :8], "float32")
    with pytest.raises(InputError, match="compact_params: x holds non-finite"):
        compact_params(np.full((2, 3, 8), np.inf, np.float32), "int8")


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_compact_params_reconstruct_every_value_within_half_its_decoded_scale(fmt):
    rng = np.random.default_rng(INT_FORMATS.index(fmt))
    H, n, D = 4, 16, 64
    x = _keys(rng, H, n, D)
    f = page_format(fmt)
    scale, zp, hdr = compact_params(x, fmt)
    assert scale.dtype == zp.dtype == np.float32 and scale.shape == zp.shape == (H * D,)
    assert hdr.dtype == np.uint8 and hdr.shape == (header_bytes(fmt, H, D, "compact"),)
    page = np.zeros(page_bytes(fmt, H, n, D, D, "compact"), np.uint8)
    K.quantize_page(x, f.code, scale, zp, D, page, n, header=hdr)
    out = np.empty_like(x)
    K.dequantize_page(page, f.code, H, n, D, D, n, out, "compact")
    s = np.broadcast_to(scale.reshape(H, 1, D).astype(np.float64), x.shape)
    err = np.abs(out.astype(np.float64) - x)
    assert (err <= s / 2 + 2.0**-23 * (np.abs(x) + s)).all(), float(np.max(err - s / 2))
    assert (out[:, :, 1] == 0).all() and (out[2] == 0).all()  # zero channel and zero head: exactly 0


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_compact_params_rule(fmt):
    """S = the head's largest exact scale rounded up to float32; e = the largest code whose
    decoded scale is still >= the exact one; zero points by params_for's rule with that scale."""
    rng = np.random.default_rng(10 + INT_FORMATS.index(fmt))
    H, n, D = 3, 8, 40
    x = _keys(rng, H, n, D)
    f = page_format(fmt)
    scale, zp, hdr = compact_params(x, fmt)
    S = hdr[: 4 * H].copy().view(np.float32)
    e = hdr[4 * H : 4 * H + H * D].reshape(H, D).astype(np.int64)
    zc = hdr[4 * H + H * D : 4 * H + 2 * H * D].reshape(H, D)
    assert not hdr[4 * H + 2 * H * D :].any()  # zero padding
    xd = x.astype(np.float64)
    if f.signed:
        exact = np.abs(xd).max(axis=1) / f.qmax
        lo = np.zeros_like(exact)
    else:
        lo, hi = np.minimum(xd.min(axis=1), 0), np.maximum(xd.max(axis=1), 0)
        exact = (hi - lo) / (f.qmax - f.qmin)
    for h in range(H):
        top = exact[h].max()
        if top > 0:  # the largest exact scale rounded up to float32, never down
            assert S[h] >= top and np.nextafter(S[h], np.float32(0)) < top
        else:
            assert S[h] == 1
        dec = _decode(S[h], e[h])
        np.testing.assert_array_equal(scale.reshape(H, D)[h], dec)
        assert (dec >= exact[h]).all()  # rounded up ...
        nxt = _decode(S[h], np.minimum(e[h] + 1, 255))
        assert ((e[h] == 255) | (nxt < exact[h])).all()  # ... by the largest code that still does
    assert (e[2] == 255).all() and (zp.reshape(H, D)[2] == (0 if f.signed else f.qmin)).all()  # zero head
    want_zp = np.zeros((H, D)) if f.signed else np.clip(np.rint(f.qmin - lo / scale.reshape(H, D)), f.qmin, f.qmax)
    np.testing.assert_array_equal(zp.reshape(H, D), want_zp)
    np.testing.assert_array_equal(zc, zp.reshape(H, D))
    assert (e < 255).sum() > H  # the codes are used, not all clamped


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_encode_decode_round_trip(fmt):
    rng = np.random.default_rng(20 + INT_FORMATS.index(fmt))
    H, n, D = 3, 5, 24
    x = _keys(rng, H, n, D)
    scale, zp, hdr = compact_params(x, fmt)
    page = np.concatenate([hdr, rng.integers(0, 256, 100, dtype=np.uint8)])
    s2, z2 = decode_header(page, fmt, H, D, "compact")
    np.testing.assert_array_equal(s2, scale)
    np.testing.assert_array_equal(z2, zp)
    again = encode_header(fmt, s2, z2, H, "compact")
    s3, z3 = decode_header(again, fmt, H, D, "compact")
    np.testing.assert_array_equal(s3, scale)
    np.testing.assert_array_equal(z3, zp)
    np.testing.assert_array_equal(again[:4], hdr[:4])  # head 0 is not all zeros: the same bytes
    # float32 headers hold any valid parameters
    fs, fz = params_for(x, fmt, "channel")
    f32 = encode_header(fmt, fs, fz, H)
    assert f32.shape == (header_bytes(fmt, H, D),)
    s4, z4 = decode_header(f32, fmt, H, D)
    np.testing.assert_array_equal(s4, fs)
    np.testing.assert_array_equal(z4, fz)


def test_encode_header_rejects_what_a_compact_header_cannot_hold():
    rng = np.random.default_rng(3)
    x = _keys(rng, 2, 4, 16)
    scale, zp, _ = compact_params(x, "uint8")
    off = scale.copy()
    off[5] = np.nextafter(off[5], np.float32(1))
    with pytest.raises(InputError, match=r"api: scale\[5\] = .* cannot hold it"):
        encode_header("uint8", off, zp, 2, "compact", api="api")
    s8, _, _ = compact_params(x, "int8")
    z8 = np.zeros_like(s8)
    z8[3] = -2
    with pytest.raises(InputError, match=r"zero_point\[3\] = -2.0: a compact header holds zero point 0"):
        encode_header("int8", s8, z8, 2, "compact")
    with pytest.raises(InputError, match="every scale must be finite and > 0"):
        encode_header("uint8", -scale, zp, 2, "compact")
    with pytest.raises(InputError, match=r"heads \* G"):
        encode_header("uint8", scale, zp, 3, "compact")


def test_decode_header_checks_the_page():
    with pytest.raises(InputError, match=r"uint8 \[>= 128\] \(compact header\)"):
        decode_header(np.zeros(100, np.uint8), "uint8", 2, 16, "compact")
    with pytest.raises(InputError, match="float format"):
        decode_header(np.zeros(100, np.uint8), "float16", 2, 16)


def test_decode_header_equals_the_kernels_decoding_for_every_code(simd):
    """Every exponent code 0..255 (and S spanning normal to subnormal results): the page's values
    dequantized by the kernels equal (code - zero point) * scale with decode_header's parameters."""
    rng = np.random.default_rng(7)
    H, G = 3, 256
    S = np.array([0.37, 3e-38, 1.0e30], np.float32)
    e = np.stack([rng.permutation(256) for _ in range(H)]).astype(np.uint8)
    zc = rng.integers(0, 256, (H, G), dtype=np.uint8)
    hb = header_bytes("uint8", H, G, "compact")
    page = np.zeros(hb + H * 2 * G, np.uint8)
    page[: 4 * H] = S.view(np.uint8)
    page[4 * H : 4 * H + H * G] = e.reshape(-1)
    page[4 * H + H * G : 4 * H + 2 * H * G] = zc.reshape(-1)
    codes = rng.integers(0, 256, (H, 2, G), dtype=np.uint8)
    page[hb:] = codes.reshape(-1)
    scale, zp = decode_header(page, "uint8", H, G, "compact")
    np.testing.assert_array_equal(
        scale.reshape(H, G), np.stack([_decode(S[h], e[h].astype(np.int64)) for h in range(H)])
    )
    out = np.empty((H, 2, G), np.float32)
    K.dequantize_page(page, 2, H, 2, G, G, 2, out, "compact")
    want = (codes.astype(np.float32) - zp.reshape(H, 1, G)) * scale.reshape(H, 1, G)
    np.testing.assert_array_equal(out, want)
    assert (scale[G : 2 * G] < np.finfo(np.float32).tiny).any()  # subnormal scales were decoded too


@pytest.fixture(params=[True, False], ids=["simd", "scalar"])
def simd(request):
    K.set_simd_enabled(request.param)
    yield request.param
    K.set_simd_enabled(True)
