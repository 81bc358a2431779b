"""Pages with "channel-zp" headers (one scale per head, one zero point per channel):
quantize_page / dequantize_page / paged_attention (k_header="channel-zp",
k_group=D) against the NumPy twins, and the twins against the header
definition.

Headers are built here by hand from the definition (float32 s[H], float32
w[H], int8 o[H*D], zero padded to 64; decoded scale s[h], zero point
z0 + w[h] * o[h*D + c], z0 = 0 for signed formats and 2^(bits-1) for unsigned
ones), not with onnxkv.cache.formats.  Key data is made from random codes:
x = s * (code - zero_point + noise), |noise| <= 0.45, so a correct quantizer
gives back exactly those codes however far the zero points lie outside the
code range, as long as x / s keeps the noise's margin in float32 (w = 2^k up
to 2^11 with |o| up to 127; the page kernels also take w = 2^16, compared
with the twin byte for byte).  Attention keys use w up to 2^8.
"""

import sys

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import rand
from .test_attention import reset_level
from .test_quant_attention import ALLOC, encode

A = sys.modules["onnxkv._kernels.attention"]
AVX512 = A.set_attention_avx512(True)
AMX = A.set_attention_amx(True)

CZP = "channel-zp"
# integer formats: code -> (bits, lowest code, highest code, z0)
INTS = {
    3: (8, -128, 127, 0),
    2: (8, 0, 255, 128),
    22: (4, -8, 7, 0),
    21: (4, 0, 15, 8),
    26: (2, -2, 1, 0),
    25: (2, 0, 3, 2),
}
FLOATS = (1, 10, 16)
NAMES = {3: "i8", 2: "u8", 22: "i4", 21: "u4", 26: "i2", 25: "u2", 1: "f32", 10: "f16", 16: "bf16"}


def czp_header(s, w, o):
    """Header bytes (uint8, zero padded to 64) of s, w float32 [H] and o int8 [H*G]."""
    H = s.size
    out = np.zeros(-(-(8 * H + o.size) // 64) * 64, np.uint8)
    out[: 4 * H] = s.view(np.uint8)
    out[4 * H : 8 * H] = w.view(np.uint8)
    out[8 * H : 8 * H + o.size] = o.view(np.uint8)
    return out


def czp_page(rng, fmt, H, bs, D, ks=range(9), amp=20.0):
    """Random parameters and key data of one channel-zp page: per head w = 2^k
    (the ks in random order, repeated to H heads), s such that |x| stays below
    about ``amp``, o uniform in [-127, 127]; codes uniform over the format's
    range; x = s * (code - zp + noise).  Returns (x float32 [H, bs, D], codes int64 [H, bs, D], header,
    decoded scale and zero point float32 [H*D])."""
    bits, qmin, qmax, z0 = INTS[fmt]
    w = (2.0 ** np.resize(rng.permutation(list(ks)), H)).astype(np.float32)  # each k once if H >= len(ks)
    o = rng.integers(-127, 128, (H, D)).astype(np.int8)
    s = (amp / (127 * w + 2**bits) * rng.uniform(0.5, 1.0, H)).astype(np.float32)
    scale = np.repeat(s, D)
    zp = (z0 + w[:, None].astype(np.float64) * o).astype(np.float32).reshape(-1)
    codes = rng.integers(qmin, qmax + 1, (H, bs, D))
    noise = rng.uniform(-0.45, 0.45, (H, bs, D))
    x = (s[:, None, None].astype(np.float64) * (codes - zp.reshape(H, 1, D) + noise)).astype(np.float32)
    return x, codes, czp_header(s, w, o.reshape(-1)), scale, zp


def payload_bytes(fmt, H, bs, D):
    return -(-(8 * H + H * D) // 64) * 64 + H * bs * D * INTS[fmt][0] // 8


def twin_page(x, codes, header, scale, zp, fmt, bs):
    """The twin's channel-zp page of x; asserts it reads back as (codes - zp) * scale exactly."""
    H, _, D = x.shape
    page = np.zeros(payload_bytes(fmt, H, bs, D), np.uint8)
    R.quantize_page(x, fmt, scale, zp, D, page, bs, header=header, header_kind=CZP)
    back = np.empty_like(x)
    R.dequantize_page(page, fmt, H, bs, D, D, bs, back, CZP)
    want = (codes.astype(np.float32) - zp.reshape(H, 1, D)) * scale.reshape(H, 1, D)
    np.testing.assert_array_equal(back, want)
    return page


# ---------------------------------------------------------------- the twin against the definition


@pytest.mark.parametrize("fmt", sorted(INTS), ids=lambda f: NAMES[f])
@pytest.mark.parametrize("D", [32, 96, 128])
def test_twin_gives_back_the_codes(fmt, D):
    """Far zero points (w up to 2^11, x / s up to 2^18 in float32: rounded
    well within the noise's margin): the twin's codes are exactly the ones x
    was made from, its header is the one given, it reads back (code - zp) * s,
    within s/2 of x; the same codes as a float32-header page of the decoded
    parameters."""
    rng = np.random.default_rng([fmt, D])
    H, bs = 5, 16
    x, codes, header, scale, zp = czp_page(rng, fmt, H, bs, D, ks=(0, 3, 8, 11))
    assert np.abs(zp - INTS[fmt][3]).max() > 2**17  # far outside every code range
    page = twin_page(x, codes, header, scale, zp, fmt, bs)
    np.testing.assert_array_equal(page[: header.size], header)
    hb = -(-8 * H * D // 64) * 64  # float32 header of the same parameters
    plain = np.zeros(hb + page.size - header.size, np.uint8)
    R.quantize_page(x, fmt, scale, zp, D, plain, bs)
    np.testing.assert_array_equal(page[header.size :], plain[hb:])
    back = np.empty_like(x)
    R.dequantize_page(page, fmt, H, bs, D, D, bs, back, CZP)
    assert np.all(np.abs(back - x) <= scale.reshape(H, 1, D) * 0.5 + 2.0**-22 * np.abs(x))


@pytest.mark.parametrize("fmt", sorted(INTS), ids=lambda f: NAMES[f])
def test_twin_decodes_the_header_layout(fmt):
    """Header bytes written field by field: scale s[h] per channel, zero point
    z0 + w[h] * o[h*D + c] (o read as signed bytes; w up to 2^16, zero points
    down to -2^23), codes after the padding to 64."""
    bits, qmin, qmax, z0 = INTS[fmt]
    H, D, bs = 3, 8, 2
    s, w = np.array([0.5, 2.0, 0.125], np.float32), np.array([1.0, 256.0, 65536.0], np.float32)
    o = np.array([[-128, -1, 0, 1, 127, 5, -7, 64]] * H, np.int8)
    page = np.zeros(payload_bytes(fmt, H, bs, D), np.uint8)
    page[:64] = czp_header(s, w, o.reshape(-1))
    assert page[:12].view(np.float32).tolist() == [0.5, 2.0, 0.125] and page[12:24].view(np.float32)[0] == 1.0
    assert page[24 : 24 + H * D].view(np.int8).tolist() == o.reshape(-1).tolist() and not page[48:64].any()
    code = qmax  # every code the highest one
    page[64:] = {8: code & 0xFF, 4: (code & 0xF) * 0x11, 2: (code & 3) * 0x55}[bits]
    out = np.empty((H, bs, D), np.float32)
    R.dequantize_page(page, fmt, H, bs, D, D, bs, out, CZP)
    want = (code - (z0 + w[:, None] * o.astype(np.float32))) * s[:, None]
    np.testing.assert_array_equal(out, np.broadcast_to(want[:, None], (H, bs, D)))


def test_twin_refuses_bad_headers_and_groups():
    """Header bytes that do not decode to scale / zero_point or have the wrong
    length, an unknown header kind, channel-zp with groups other than the head
    size: ValueError naming the argument, nothing written."""
    rng = np.random.default_rng(1)
    H, bs, D = 2, 4, 16
    x, codes, header, scale, zp = czp_page(rng, 2, H, bs, D)
    page = np.zeros(payload_bytes(2, H, bs, D), np.uint8)
    bad = header.copy()
    bad[8 * H + 3] ^= 1  # o[3] differs
    calls = [
        ("header", lambda: R.quantize_page(x, 2, scale, zp, D, page, bs, header=bad, header_kind=CZP)),
        (
            "header",
            lambda: R.quantize_page(x, 2, scale * np.float32(2), zp, D, page, bs, header=header, header_kind=CZP),
        ),
        ("header", lambda: R.quantize_page(x, 2, scale, zp, D, page, bs, header=header[:-1], header_kind=CZP)),
        ("header_kind", lambda: R.quantize_page(x, 2, scale, zp, D, page, bs, header=header, header_kind="czp")),
        ("group", lambda: R.dequantize_page(page, 2, H, bs, D, 1, bs, np.empty((H, bs, D), np.float32), CZP)),
        ("header", lambda: R.dequantize_page(page, 2, H, bs, D, D, bs, np.empty((H, bs, D), np.float32), "czp")),
    ]
    for name, call in calls:
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            call()
        assert not page.any()


# ---------------------------------------------------------------- page kernels against the twin


@pytest.mark.parametrize("fmt", sorted(INTS), ids=lambda f: NAMES[f])
@pytest.mark.parametrize("H,D", [(1, 32), (3, 64), (8, 128), (5, 96)])
@pytest.mark.parametrize("bs", [16, 5])
def test_page_kernels_match_twin(fmt, H, D, bs, threads, simd):
    """Tokens t0 .. t0+n of a page of random bytes, with far zero points
    (w up to 2^16) and a few values that saturate (+-1e6, +-inf, NaN): the
    kernel writes the same bytes as the twin (header as given, other tokens
    untouched) and reads back bit for bit what the twin reads: the codes x was
    made from in the heads with w <= 2^11 (larger w: x / s loses the noise's
    margin to float32 rounding)."""
    rng = np.random.default_rng([fmt, H, D, bs])
    x, codes, header, scale, zp = czp_page(rng, fmt, H, bs, D, ks=(0, 1, 5, 8, 16))
    t0 = int(rng.integers(0, bs))
    n = int(rng.integers(1, bs - t0 + 1))
    part = np.ascontiguousarray(x[:, t0 : t0 + n])
    flat = part.reshape(-1)
    hit = rng.choice(flat.size, min(5, flat.size), replace=False)
    flat[hit] = np.array([1e6, -1e6, np.inf, -np.inf, np.nan], np.float32)[: hit.size]
    before = rng.integers(0, 256, payload_bytes(fmt, H, bs, D), dtype=np.uint8)
    got, want = before.copy(), before.copy()
    K.quantize_page(part, fmt, scale, zp, D, got, bs, t0, header=header, header_kind=CZP)
    R.quantize_page(part, fmt, scale, zp, D, want, bs, t0, header=header, header_kind=CZP)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[: header.size], header)
    assert not np.array_equal(got, before)
    out, ref = np.full((H, t0 + n, D), np.nan, np.float32), np.empty((H, t0 + n, D), np.float32)
    K.dequantize_page(got, fmt, H, bs, D, D, t0 + n, out, CZP)
    R.dequantize_page(got, fmt, H, bs, D, D, t0 + n, ref, CZP)
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))
    sure = ~np.isin(np.arange(flat.size), hit).reshape(part.shape)
    sure &= (header[4 * H : 8 * H].view(np.float32) <= 2**11)[:, None, None]
    exact = (codes[:, t0 : t0 + n].astype(np.float32) - zp.reshape(H, 1, D)) * scale.reshape(H, 1, D)
    np.testing.assert_array_equal(out[:, t0:][sure], exact[sure])


def test_page_kernels_refuse_bad_headers():
    """Header bytes that do not decode to scale / zero_point, the wrong length,
    an unknown kind, groups other than the head size: ValueError naming the
    argument, nothing written."""
    rng = np.random.default_rng(2)
    H, bs, D = 2, 4, 16
    x, codes, header, scale, zp = czp_page(rng, 21, H, bs, D)
    page = rng.integers(0, 256, payload_bytes(21, H, bs, D), dtype=np.uint8)
    out = np.full((H, bs, D), 9.0, np.float32)
    bad_o, bad_w = header.copy(), header.copy()
    bad_o[8 * H + 17] ^= 2  # o[17] (head 1, channel 1)
    bad_w[4 * H : 4 * H + 4] = (header[4 * H : 4 * H + 4].view(np.float32) * 2).view(np.uint8)  # w[0] doubled
    zp_one = np.full_like(zp, np.float32(8.0))
    q = dict(
        x=x,
        fmt_code=21,
        scale=scale,
        zero_point=zp,
        group=D,
        out_page=page,
        block_size=bs,
        header=header,
        header_kind=CZP,
    )
    for kw, name in [
        (dict(header=bad_o), "header"),
        (dict(header=bad_w), "header"),
        (dict(zero_point=zp_one), "header"),
        (dict(scale=scale * np.float32(1.5)), "header"),
        (dict(header=header[:-1]), "header"),
        (dict(header_kind="channel_zp"), "header_kind"),
        (dict(group=1, scale=scale[::D].copy(), zero_point=np.full(H, 8.0, np.float32)), "group|header"),
    ]:
        before = page.copy()
        with pytest.raises(ValueError, match=rf"^({name})\b"):
            K.quantize_page(**dict(q, **kw))
        np.testing.assert_array_equal(page, before)
    for args, name in [((D, "channel-zero-point"), "header"), ((1, CZP), "group|header")]:
        with pytest.raises(ValueError, match=rf"^({name})\b"):
            K.dequantize_page(page, 21, H, bs, D, args[0], bs, out, args[1])
        assert (out == 9.0).all()


# ---------------------------------------------------------------- paged attention against the twin


class Cache:
    """B rows of M pages each, page ids shuffled, every page its own 64-byte
    aligned allocation.  Key pages of an integer format: channel-zp (czp_page,
    packed by the twin); float key pages and every value page: encode of
    test_quant_attention (values: float32 headers, one scale per head).
    Page formats per page id: kfmts / vfmts uint8 [B*M].  self.kd / self.vd:
    the values the pages represent, contiguous [B, Hkv, M*bs, D].  Calls use
    self.softcap and self.window (no softcap, no window unless set)."""

    def __init__(self, rng, B, Hkv, D, bs, M, kfmts, vfmts, ks=range(9)):
        P = B * M
        self.table = rng.permutation(P).reshape(B, M).astype(np.int32)
        self.formats = {"k": np.asarray(kfmts, np.uint8), "v": np.asarray(vfmts, np.uint8)}
        self.pages = {"k": [None] * P, "v": [None] * P}
        self.addr = {"k": np.zeros(P, np.uint64), "v": np.zeros(P, np.uint64)}
        self.kd, self.vd = np.zeros((2, B, Hkv, M * bs, D), np.float32)
        self.buffers, self.bs, self.D = [], bs, D
        self.softcap, self.window = 0.0, -1
        for b in range(B):
            for i in range(M):
                pid, blk = int(self.table[b, i]), slice(i * bs, (i + 1) * bs)
                kf, vf = int(self.formats["k"][pid]), int(self.formats["v"][pid])
                if kf in INTS:
                    x, codes, header, scale, zp = czp_page(rng, kf, Hkv, bs, D, ks)
                    kstore = twin_page(x, codes, header, scale, zp, kf, bs)
                    self.kd[b, :, blk] = (codes - zp.reshape(Hkv, 1, D)) * scale.reshape(Hkv, 1, D)
                else:
                    kstore, self.kd[b, :, blk] = encode(rand(rng, (Hkv, bs, D), scale=3.0), kf, 1)
                vstore, self.vd[b, :, blk] = encode(rand(rng, (Hkv, bs, D)), vf, 1)
                for p, store in (("k", kstore), ("v", vstore)):
                    buf = ALLOC.allocate(store.nbytes, 64)
                    page = buf.view(store.dtype, store.shape)
                    page[...] = store
                    self.buffers.append(buf)
                    self.pages[p][pid], self.addr[p][pid] = page, buf.address

    def kwargs(self, **kw):
        return dict(
            dict(k_formats=self.formats["k"], v_formats=self.formats["v"], k_group=self.D, v_group=1, k_header=CZP),
            **kw,
        )

    def kernel(self, q, Hkv, kv_len, q_pos, scale, out, **kw):
        return K.paged_attention(
            q,
            self.addr["k"],
            self.addr["v"],
            self.table,
            self.bs,
            Hkv,
            kv_len,
            q_pos,
            scale,
            self.softcap,
            self.window,
            out,
            **self.kwargs(**kw),
        )

    def twin(self, q, Hkv, kv_len, q_pos, scale, out, **kw):
        R.paged_attention(
            q,
            self.pages["k"],
            self.pages["v"],
            self.table,
            self.bs,
            Hkv,
            kv_len,
            q_pos,
            scale,
            self.softcap,
            self.window,
            out,
            **self.kwargs(**kw),
        )


def setup(seed, Hkv, ratio, D, bs, M, Sq, kspec, vspec, ks=range(9), softcap=0.0, window=-1):
    """Random q, a Cache of two rows (the first full, the second shorter) with page
    formats drawn per page id from kspec / vspec (tuples of codes), the twin's
    result; checks the twin against dense attention over the represented values."""
    rng = np.random.default_rng(seed)
    B, P = 2, 2 * M
    cache = Cache(rng, B, Hkv, D, bs, M, rng.choice(kspec, P), rng.choice(vspec, P), ks)
    cache.softcap, cache.window = softcap, window
    kv_len = np.array([M * bs, max(Sq, M * bs - bs // 2 - 1)], np.int32)
    q_pos = (kv_len[:, None] - Sq + np.arange(Sq)[None, :]).astype(np.int32)
    q, scale = rand(rng, (B, Hkv * ratio, Sq, D)), D**-0.5
    want, dense = np.full_like(q, np.nan), np.full_like(q, np.nan)
    cache.twin(q, Hkv, kv_len, q_pos, scale, want)
    R.attention(q, cache.kd, cache.vd, kv_len, q_pos, scale, softcap, window, dense)
    np.testing.assert_allclose(want, dense, rtol=1e-6, atol=1e-6)
    return cache, q, kv_len, q_pos, scale, want


# (name, simd on, AVX-512 tiles, AMX keys): every instruction set this machine runs
PATHS = (
    [("scalar", False, False, False)]
    + ([("avx2", True, False, False)] if K.cpu_features()["simd_usable"] else [])
    + ([("avx512", True, True, False)] if AVX512 else [])
    + ([("avx512+amx", True, True, True)] if AMX else [])
)


def check_paths(cache, q, kv_len, q_pos, scale, want):
    """1 and 2 threads on every path of PATHS: the kernel within 1e-5 of the
    twin (values are N(0, 1), so the output is of order 1), quantized bytes
    counted exactly when some read page is quantized."""
    Hkv = cache.kd.shape[1]
    quantized = np.isin(np.concatenate([cache.formats["k"], cache.formats["v"]]), list(INTS)).any()
    old = K.get_num_threads()
    try:
        for threads in (1, 2):
            K.set_num_threads(threads)
            for level, simd, avx512, amx in PATHS:
                K.set_simd_enabled(simd)
                A.set_attention_avx512(avx512)
                A.set_attention_amx(amx)
                assert A.attention_simd_level() == level
                out = np.full_like(q, np.nan)
                stats = cache.kernel(q, Hkv, kv_len, q_pos, scale, out)
                np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=f"threads={threads} path={level}")
                assert (stats["dequantized_bytes"] > 0) == quantized
    finally:
        K.set_num_threads(old)
        reset_level()
        A.set_attention_amx(True)


SHAPES = [  # Hkv, GQA ratio, D, block size, pages per row, query tokens
    (1, 1, 32, 16, 1, 1),
    (2, 4, 64, 16, 3, 1),
    (8, 1, 128, 16, 4, 3),
    (3, 4, 96, 5, 4, 1),
    (4, 4, 128, 5, 2, 3),
    (8, 4, 64, 5, 4, 3),
    (5, 1, 96, 16, 2, 3),
    (1, 4, 128, 16, 4, 1),
]


@pytest.mark.parametrize("fmt", sorted(INTS), ids=lambda f: NAMES[f])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "Hkv{}x{}-D{}-bs{}-M{}-Sq{}".format(*s))
def test_twin_attention_over_channel_zp_keys(fmt, shape):
    """The twin with channel-zp key pages equals dense attention over the
    values those pages hold (setup asserts it), which stay finite."""
    want = setup(sum(shape) * 11 + fmt, *shape, (fmt,), (3,))[-1]
    assert np.isfinite(want).all()


@pytest.mark.parametrize("fmt", sorted(INTS), ids=lambda f: NAMES[f])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "Hkv{}x{}-D{}-bs{}-M{}-Sq{}".format(*s))
def test_every_key_format_and_shape(fmt, shape):
    """Key pages all of one integer format with channel-zp headers (w = 2^k,
    k in 0..8), values int8 with one scale per head."""
    check_paths(*setup(sum(shape) * 11 + fmt, *shape, (fmt,), (3,)))


@pytest.mark.parametrize("k", range(9))
@pytest.mark.parametrize("fmt", sorted(INTS), ids=lambda f: NAMES[f])
def test_zero_points_far_outside_the_code_range(fmt, k):
    """Every head's zero-point unit w = 2^k with |o| up to 127 (zero points up
    to 127 * 256 from z0); keys up to about 20 in magnitude."""
    cache, *rest = setup(300 + 9 * fmt + k, 4, 4, 64, 16, 4, 1, (fmt,), (3, 21), ks=(k,))
    if k == 8:
        hdr = np.concatenate([p[16:32].view(np.float32) for p in cache.pages["k"]])
        assert (hdr == 256.0).all()
    check_paths(cache, *rest)


ALL = tuple(sorted(INTS)) + FLOATS


@pytest.mark.parametrize("softcap,window", [(0.0, -1), (30.0, -1), (0.0, 500)], ids=["plain", "softcap", "window"])
@pytest.mark.parametrize("kspec", [(3,), (2,), (21,), (3, 2, 22, 21, 1)], ids=["i8", "u8", "u4", "mixed"])
def test_long_context(kspec, softcap, window):
    """2048 keys per row (the second row 2039): a per-page zero-point share on
    each of 128 pages, rescaled by the running max in between; with a softcap
    or a window of 500 keys."""
    check_paths(*setup(1200 + len(kspec), 2, 4, 128, 16, 128, 1, kspec, (3, 21), softcap=softcap, window=window))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "Hkv{}x{}-D{}-bs{}-M{}-Sq{}".format(*s))
def test_mixed_formats_and_float_pages(shape):
    """Key and value formats drawn per page id from the six integer and three
    float formats: channel-zp key pages next to header-less float pages in one
    table, values with float32 headers per head."""
    cache, *rest = setup(700 + sum(shape), *shape, ALL, ALL)
    check_paths(cache, *rest)


def test_many_pages_of_mixed_formats():
    """Forty pages of every format per row: the pages' corrections do not mix."""
    cache, *rest = setup(900, 2, 4, 64, 16, 20, 1, ALL, ALL)
    assert set(cache.formats["k"].tolist()) == set(ALL)
    check_paths(cache, *rest)


BAD_ATTENTION_ARGS = [
    (dict(k_group=1), "k_group|k_header"),
    (dict(k_header="channelzp"), "k_header"),
    (dict(k_header="channel-zp-8"), "k_header"),
]


@pytest.mark.parametrize("impl", ["kernel", "twin"])
def test_attention_refuses_bad_header_arguments(impl):
    """k_header "channel-zp" with k_group != D, an unknown k_header: ValueError
    naming the argument, out not written."""
    cache, q, kv_len, q_pos, scale, _ = setup(5, 2, 2, 32, 16, 2, 1, (3, 22), (3,))
    for kw, name in BAD_ATTENTION_ARGS:
        out = np.full_like(q, 42.0)
        with pytest.raises(ValueError, match=rf"^({name})\b"):
            getattr(cache, impl)(q, 2, kv_len, q_pos, scale, out, **kw)
        assert (out == 42.0).all()


@pytest.mark.parametrize("ratio", [2, 3, 5, 6, 8])
@pytest.mark.parametrize("fmt", [3, 2, 21], ids=lambda f: NAMES[f])
def test_query_rows_per_kv_head(fmt, ratio):
    """2..8 query rows share a KV head (AMX takes the zero points' share of 8-bit
    codes as one more tile product for up to 5 rows, more rows otherwise)."""
    check_paths(*setup(1000 + 10 * fmt + ratio, 2, ratio, 64, 16, 3, 1, (fmt,), (3,)))


def test_dequantized_bytes_counted():
    """Decode reads every page of the visible range once: the counter equals the
    codes of the tokens read plus the header entries of those pages
    (channel-zp keys: s, w and D zero-point codes per head; values: float32
    scale and zero point per head; float pages 0)."""
    Hkv, D, bs, M = 2, 64, 16, 20
    cache, q, kv_len, q_pos, scale, want = setup(1100, Hkv, 4, D, bs, M, 1, ALL, ALL)
    expect = 0
    for b, n in enumerate(kv_len.tolist()):
        for i in range(-(-n // bs)):
            pid, ntok = int(cache.table[b, i]), min(bs, n - i * bs)
            for p, head in (("k", 8 + D), ("v", 8)):
                f = int(cache.formats[p][pid])
                if f in INTS:
                    expect += Hkv * (head + ntok * D * INTS[f][0] // 8)
    old = K.get_num_threads()
    try:
        for threads in (1, 2):
            K.set_num_threads(threads)
            out = np.full_like(q, np.nan)
            stats = cache.kernel(q, Hkv, kv_len, q_pos, scale, out)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
            assert stats["dequantized_bytes"] == expect > 0
    finally:
        K.set_num_threads(old)
