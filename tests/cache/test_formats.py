"""Page format registry, page layout arithmetic and params_for."""

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv.cache.formats import FORMATS, codes_bytes, groups_for, header_bytes, page_bytes, page_format, params_for
from onnxkv.errors import InputError

# name: (code, bits, qmin, qmax) -- the table of the page format contract
TABLE = {
    "float32": (1, 32, 0, 0),
    "float16": (10, 16, 0, 0),
    "bfloat16": (16, 16, 0, 0),
    "uint8": (2, 8, 0, 255),
    "int8": (3, 8, -128, 127),
    "uint4": (21, 4, 0, 15),
    "int4": (22, 4, -8, 7),
    "uint2": (25, 2, 0, 3),
    "int2": (26, 2, -2, 1),
}
INT_FORMATS = [n for n, (_, bits, _, _) in TABLE.items() if bits <= 8]


@pytest.mark.parametrize("name", list(TABLE))
def test_lookup_by_name_and_code(name):
    code, bits, qmin, qmax = TABLE[name]
    f = page_format(name)
    assert page_format(code) is f and page_format(np.uint8(code)) is f and page_format(f) is f
    assert (f.name, f.code, f.bits, f.qmin, f.qmax) == (name, code, bits, qmin, qmax)
    assert f.signed == (qmin < 0)
    assert f.is_float == (bits >= 16)
    assert f.dtype == {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}.get(name)
    assert len(FORMATS) == len(TABLE)


@pytest.mark.parametrize("bad", ["int5", "INT4", 0, 99, 22.0, None, True])
def test_unknown_format_names_the_value(bad):
    with pytest.raises(InputError, match=f"unknown page format {bad!r}"):
        page_format(bad)


@pytest.mark.parametrize(
    "fmt, H, G, want",
    [
        ("int8", 8, 1, 64),
        ("int4", 3, 3, 128),
        ("uint2", 5, 80, 3200),
        ("uint4", 8, 128, 8192),
        ("int2", 1, 9, 128),
        ("float16", 8, 1, 0),
        ("bfloat16", 2, 64, 0),
    ],
)
def test_header_bytes(fmt, H, G, want):
    assert header_bytes(fmt, H, G) == want


@pytest.mark.parametrize(
    "fmt, H, bs, D, want",
    [
        ("int8", 2, 16, 64, 2048),
        ("uint4", 2, 16, 80, 1280),
        ("int2", 3, 32, 80, 1920),
        ("uint2", 1, 1, 4, 1),
        ("float32", 2, 16, 64, 8192),
        ("float16", 2, 16, 80, 5120),
        ("bfloat16", 1, 3, 5, 30),
    ],
)
def test_codes_bytes(fmt, H, bs, D, want):
    assert codes_bytes(fmt, H, bs, D) == want
    assert page_bytes(fmt, H, bs, D, 2) == want + header_bytes(fmt, H, 2)


@pytest.mark.parametrize("fmt, D", [("int4", 3), ("uint4", 81), ("int2", 6), ("uint2", 2)])
def test_codes_must_fill_whole_bytes(fmt, D):
    with pytest.raises(InputError, match=f"head_size {D} is not supported by format {fmt}"):
        codes_bytes(fmt, 2, 16, D)
    with pytest.raises(InputError, match="head_size"):
        page_bytes(fmt, 2, 16, D, 1)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: header_bytes("int8", 0, 1), "heads"),
        (lambda: header_bytes("int8", 2, 1.0), "groups"),
        (lambda: codes_bytes("int8", 2, 0, 64), "block_size"),
        (lambda: codes_bytes("int8", 2, 4, True), "head_size"),
    ],
)
def test_layout_rejects_bad_counts(call, name):
    with pytest.raises(InputError, match=name):
        call()


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("gran", ["head", "channel"])
def test_page_bytes_is_what_the_kernels_need(fmt, gran):
    rng = np.random.default_rng(1)
    H, bs, D = 3, 16, 80
    G = groups_for(gran, D)
    x = rng.standard_normal((H, bs, D)).astype(np.float32)
    scale, zp = params_for(x, fmt, gran)
    n = page_bytes(fmt, H, bs, D, G)
    page = np.zeros(n, np.uint8)
    K.quantize_page(x, page_format(fmt).code, scale, zp, G, page, bs)
    assert page[header_bytes(fmt, H, G) :].any()
    with pytest.raises(ValueError, match="too small"):
        K.quantize_page(x, page_format(fmt).code, scale, zp, G, page[:-1], bs)


def _roundtrip_error(x, fmt, gran):
    """|dequantize(quantize(x)) - x| and scale / 2 (broadcast to x) with params_for's parameters."""
    H, n, D = x.shape
    G = groups_for(gran, D)
    f = page_format(fmt)
    scale, zp = params_for(x, fmt, gran)
    assert scale.dtype == zp.dtype == np.float32 and scale.shape == zp.shape == (H * G,)
    assert (scale > 0).all() and np.isfinite(scale).all()
    assert (zp == np.rint(zp)).all() and (zp >= f.qmin).all() and (zp <= f.qmax).all()
    page = np.zeros(page_bytes(fmt, H, n, D, G), np.uint8)
    K.quantize_page(x, f.code, scale, zp, G, page, n)
    out = np.empty_like(x)
    K.dequantize_page(page, f.code, H, n, D, G, n, out)
    s = np.broadcast_to(scale.reshape(H, 1, G).astype(np.float64), x.shape)
    return np.abs(out.astype(np.float64) - x), s / 2 + 2.0**-23 * (np.abs(x) + s)


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("gran", ["head", "channel"])
def test_params_reconstruct_every_value_within_half_a_scale(fmt, gran):
    rng = np.random.default_rng([INT_FORMATS.index(fmt), int(gran == "head")])
    H, n, D = 4, 16, 64
    x = rng.standard_normal((H, n, D)).astype(np.float32) * 2
    x[1] = np.abs(x[1]) + 0.5  # all positive head
    x[2] = -np.abs(x[2]) - 0.5  # all negative head
    x[3] *= 1e-3  # small range
    err, bound = _roundtrip_error(x, fmt, gran)
    assert (err <= bound).all(), float(np.max(err - bound))


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_params_rule(fmt):
    f = page_format(fmt)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 8, 16)).astype(np.float32)
    scale, zp = params_for(x, fmt, "head")
    xd = x.astype(np.float64)
    if f.signed:
        exact = np.abs(xd).max(axis=(1, 2)) / f.qmax
        assert (zp == 0).all()
    else:
        lo, hi = np.minimum(xd.min(axis=(1, 2)), 0), np.maximum(xd.max(axis=(1, 2)), 0)
        exact = (hi - lo) / (f.qmax - f.qmin)
        np.testing.assert_array_equal(zp, np.clip(np.rint(f.qmin - lo / scale), f.qmin, f.qmax))
    # rounded up to float32, never down
    assert (scale >= exact).all() and (np.nextafter(scale, np.float32(0)) < exact).all()


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("value", [0.0, 3.0, -2.5])
def test_params_of_constant_groups(fmt, value):
    x = np.full((2, 4, 8), value, np.float32)
    scale, zp = params_for(x, fmt, "channel")
    if value == 0.0:
        assert (scale == 1).all()
    err, bound = _roundtrip_error(x, fmt, "channel")
    assert (err <= bound).all()
    if value == 0.0:
        assert (err == 0).all()


def test_params_rejects_bad_input():
    x = np.ones((2, 3, 4), np.float32)
    with pytest.raises(InputError, match="float format"):
        params_for(x, "float16", "head")
    with pytest.raises(InputError, match="granularity"):
        params_for(x, "int8", "token")
    with pytest.raises(InputError, match="non-finite"):
        params_for(np.where(x > 0, np.nan, x).astype(np.float32), "int8", "head")
    with pytest.raises(InputError, match=r"\[H, n, D\]"):
        params_for(x[0], "int8", "head")
    with pytest.raises(InputError, match="dtype int32"):
        params_for(x.astype(np.int32), "int8", "head")
    with pytest.raises(InputError, match="unknown page format 'int3'"):
        params_for(x, "int3", "head")
