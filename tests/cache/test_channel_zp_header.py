"""The channel-zp page header (formats "channel-zp": one scale per head, one zero point per channel):
layout arithmetic, channel_zp_params' rule and bound, encode_header / decode_header round trips and
their checks, check_params' zero-point rule for this kind."""

import numpy as np
import pytest

from onnxkv.cache.formats import (
    HEADER_CHANNEL_ZP,
    HEADERS,
    channel_zp_params,
    check_params,
    decode_header,
    encode_header,
    header_bytes,
    page_bytes,
    page_format,
)
from onnxkv.errors import InputError

INT_FORMATS = ["uint8", "int8", "uint4", "int4", "uint2", "int2"]


def _keys(rng, H, n, D):
    """Key-like data: large per-channel offsets, varied spreads, a constant channel, a tiny channel,
    and (if H > 2) one head of zeros only."""
    x = (
        rng.standard_normal((H, n, D)) * rng.uniform(0.05, 2.0, (1, 1, D)) + rng.standard_normal((1, 1, D)) * 8
    ).astype(np.float32)
    x[:, :, 1] = np.float32(3.5)
    x[:, :, 2] *= np.float32(1e-6)
    if H > 2:
        x[2] = 0.0
    return x


def _reconstruct(x, fmt, scale, zero_point):
    """NumPy twin of quantize + dequantize with per-channel parameters [H * D]: codes
    saturate(rint(x / scale) + zp), values (code - zp) * scale; also the unsaturated codes."""
    f = page_format(fmt)
    H, _, D = x.shape
    s = scale.reshape(H, 1, D).astype(np.float32)
    z = zero_point.reshape(H, 1, D).astype(np.float32)
    raw = np.rint(x.astype(np.float32) / s) + z
    q = np.clip(raw, f.qmin, f.qmax)
    return (q - z) * s, raw


def _unpack(header, H, G):
    s = header[: 4 * H].view(np.float32)
    w = header[4 * H : 8 * H].view(np.float32)
    o = header[8 * H : 8 * H + H * G].view(np.int8).reshape(H, G)
    return s, w, o


@pytest.mark.parametrize(
    "fmt, H, G, want",
    [
        ("int8", 8, 128, 1088),
        ("uint4", 3, 80, 320),
        ("int2", 1, 1, 64),
        ("uint8", 2, 24, 64),
        ("float16", 8, 128, 0),
    ],
)
def test_channel_zp_header_bytes(fmt, H, G, want):
    assert HEADER_CHANNEL_ZP == "channel-zp" and HEADER_CHANNEL_ZP in HEADERS
    assert header_bytes(fmt, H, G, "channel-zp") == want
    assert page_bytes("int8", 8, 16, 128, 128, "channel-zp") == 1088 + 16384


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_channel_zp_params_reconstruct_every_value_within_half_a_scale(fmt):
    rng = np.random.default_rng(31)
    f = page_format(fmt)
    for H, n, D in ((4, 16, 32), (3, 1, 8), (1, 5, 128)):
        x = _keys(rng, H, n, D)
        scale, zp, header = channel_zp_params(x, fmt)
        assert scale.dtype == zp.dtype == np.float32 and scale.shape == zp.shape == (H * D,)
        assert header.dtype == np.uint8 and header.size == header_bytes(fmt, H, D, "channel-zp")
        assert (scale.reshape(H, D) == scale.reshape(H, D)[:, :1]).all()  # one scale per head
        got, raw = _reconstruct(x, fmt, scale, zp)
        r = (1 << (f.bits - 1)) - 1
        assert (np.abs(raw - f.z0) <= r).all()  # no code saturates
        err = np.abs(got - x)
        assert (err <= scale.reshape(H, 1, D) * np.float32(0.5) * (1 + 1e-5)).all(), float(err.max())
        if H > 2:
            np.testing.assert_array_equal(got[2], 0)  # the head of zeros reconstructs exactly


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_channel_zp_params_rule(fmt):
    """s, w and o follow the documented rule (recomputed here in float64), and zero points can
    leave the code range (the offsets are what matters)."""
    rng = np.random.default_rng(32)
    f = page_format(fmt)
    H, n, D = 4, 16, 32
    x = _keys(rng, H, n, D)
    scale, zp, header = channel_zp_params(x, fmt)
    s, w, o = _unpack(header, H, D)
    r = (1 << (f.bits - 1)) - 1
    xd = x.astype(np.float64)
    for h in range(H):
        hi, lo = xd[h].max(axis=0), xd[h].min(axis=0)
        ctr, hr = (hi + lo) / 2, (hi - lo) / 2
        if not (hi.any() or lo.any()):
            assert (s[h], w[h]) == (1, 1) and not o[h].any()
            continue
        cands = [
            (max(hr.max() / (r - 2**k / 2), np.abs(ctr).max() / (127 * 2**k)), k) for k in range(17) if 2**k / 2 < r
        ]
        exact, k = min(cands)
        assert w[h] == 2**k
        assert s[h] >= exact and np.float64(np.nextafter(s[h], np.float32(0))) < exact  # rounded up, once
        np.testing.assert_array_equal(o[h], np.clip(np.rint(-ctr / (np.float64(s[h]) * w[h])), -128, 127))
        np.testing.assert_array_equal(scale[h * D : (h + 1) * D], s[h])
        np.testing.assert_array_equal(zp[h * D : (h + 1) * D], f.z0 + w[h] * o[h].astype(np.float32))
    if f.bits == 8:
        assert (zp < f.qmin).any() or (zp > f.qmax).any()  # offsets beyond the code range


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_encode_decode_round_trip(fmt):
    """decode_header returns exactly what channel_zp_params computed with; encode_header of those
    decoded parameters decodes to the same parameters (w the smallest unit that holds them)."""
    rng = np.random.default_rng(33)
    H, D = 3, 16
    x = _keys(rng, H, 8, D)
    scale, zp, header = channel_zp_params(x, fmt)
    page = np.concatenate([header, rng.integers(0, 256, 100, dtype=np.uint8)])  # codes after the header
    s2, z2 = decode_header(page, fmt, H, D, "channel-zp")
    np.testing.assert_array_equal(s2, scale)
    np.testing.assert_array_equal(z2, zp)
    again = encode_header(fmt, s2, z2, H, "channel-zp")
    assert again.size == header.size
    s3, z3 = decode_header(again, fmt, H, D, "channel-zp")
    np.testing.assert_array_equal(s3, scale)
    np.testing.assert_array_equal(z3, zp)
    _, w, o = _unpack(again, H, D)
    for h in range(H):  # the smallest unit: halving it would push some code out of [-128, 127] or off the grid
        off = z3[h * D : (h + 1) * D].astype(np.float64) - page_format(fmt).z0
        if w[h] > 1:
            half = off / (w[h] / 2)
            assert (np.abs(half) > 127).any() or (half != np.rint(half)).any()


def test_encode_header_chooses_power_of_two_units():
    H, D = 2, 4
    scale = np.full(H * D, 0.25, np.float32)
    zp = np.array([0, 64, -128, 254, 1024, -2048, 4064, 0], np.float32)  # head 0: w 2, head 1: w 32
    s, w, o = _unpack(encode_header("int8", scale, zp, H, "channel-zp"), H, D)
    assert w.tolist() == [2.0, 32.0] and s.tolist() == [0.25, 0.25]
    assert o.tolist() == [[0, 32, -64, 127], [32, -64, 127, 0]]
    zp_u = zp + 128  # unsigned: offsets from z0 = 128
    _, w_u, o_u = _unpack(encode_header("uint8", scale, zp_u, H, "channel-zp"), H, D)
    assert w_u.tolist() == w.tolist() and (o_u == o).all()


def test_encode_header_rejects_what_a_channel_zp_header_cannot_hold():
    H, D = 2, 4
    scale = np.full(H * D, 0.5, np.float32)
    zp = np.zeros(H * D, np.float32)
    bad = scale.copy()
    bad[6] = 0.25
    with pytest.raises(
        InputError,
        match=r"api: scale\[6\] = 0.25 differs from scale\[4\] = 0.5: a channel-zp "
        r"header holds one scale per head \(head 1\)",
    ):
        encode_header("int8", bad, zp, H, "channel-zp", "api")
    frac = zp.copy()
    frac[3] = 2.5
    with pytest.raises(InputError, match=r"zero_point\[3\] = 2.5 \(every zero point must be an integer"):
        encode_header("int8", scale, frac, H, "channel-zp")
    mixed = zp.copy()
    mixed[4:6] = [129, 1024]  # 129 needs w = 1, 1024 needs w >= 8: no unit holds both
    with pytest.raises(
        InputError,
        match=r"zero_point\[4\] = 129.0: no power of two w <= 2\^16 makes every zero "
        r"point of head 1 minus 0 a multiple w \* o with o in \[-128, 127\]",
    ):
        encode_header("int8", scale, mixed, H, "channel-zp")
    far = zp.copy()
    far[5] = 127 * 65536 + 65536  # in check_params' reach (128 * 2^16) but beyond 127 * 2^16
    with pytest.raises(InputError, match=r"zero_point\[5\] = 8388608.0: no power of two"):
        encode_header("int8", scale, far, H, "channel-zp")
    beyond = zp.copy()
    beyond[0] = -(128 * 65536 + 1)
    with pytest.raises(
        InputError,
        match=r"zero_point\[0\] = -8388609.0 \(every zero point must be an integer with "
        r"\|zero_point - 0\| <= 8388608 \(channel-zp header\)",
    ):
        encode_header("int8", scale, beyond, H, "channel-zp")


def test_check_params_code_range_rule_depends_on_the_header():
    scale = np.full(4, 0.5, np.float32)
    zp = np.array([0, 300, -1000, 128], np.float32)
    with pytest.raises(
        InputError,
        match=r"api: zero_point\[1\] = 300.0 \(every zero point must be an integer in "
        r"\[-128, 127\] for format int8\)",
    ):
        check_params("api", "int8", scale, zp)
    check_params("api", "int8", scale, zp, header="channel-zp")  # integers outside the code range: fine
    check_params("api", "uint8", scale, zp + 128, header="channel-zp")
    with pytest.raises(InputError, match=r"zero_point\[0\] = -8388481.0 .*\|zero_point - 128\| <= 8388608"):
        check_params("api", "uint8", scale, np.float32([-(1 << 23) + 127, 0, 0, 0]), header="channel-zp")


def test_channel_zp_params_rejects_bad_input():
    with pytest.raises(InputError, match="channel_zp_params: format float16 is a float format"):
        channel_zp_params(np.ones((1, 2, 8), np.float32), "float16")
    with pytest.raises(InputError, match="channel_zp_params: x holds non-finite values"):
        channel_zp_params(np.full((1, 2, 8), np.inf, np.float32), "int8")
    with pytest.raises(InputError, match=r"channel_zp_params: x must be a float array \[H, n, D\]"):
        channel_zp_params(np.ones((2, 8), np.float32), "int8")
