"""Paged attention over pages with per-page formats (onnxkv._kernels.paged_attention
with k_formats / v_formats / k_group / v_group / k_header).

Pages are built with a NumPy quantizer written here from the page layout
contract (symmetric scales for the signed formats, asymmetric for the unsigned
ones, round half to even, header then codes packed low bits first), or, for
keys with compact headers (group "Dc": per channel, k_header="compact"), with
onnxkv.cache.formats.compact_params; each page its own 64-byte aligned
allocation, page ids shuffled.  The kernel must equal
the NumPy twin (reference.paged_attention: dense attention over the
dequantized pages) and the contiguous kernel over the same dequantized values;
and, on bounded inputs, stay near attention over the unquantized float32
values.
"""

import functools

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R
from onnxkv.alloc import SystemAllocator
from onnxkv.cache.formats import compact_params, page_bytes

from .conftest import rand

ALLOC = SystemAllocator()
HEADS = {"mha": (8, 8), "gqa": (32, 8), "mqa": (8, 1)}
FLOATS = (1, 10, 16)  # float32, float16, bfloat16
QUANT = {2: (8, False), 3: (8, True), 21: (4, False), 22: (4, True), 25: (2, False), 26: (2, True)}
ALL = sorted(FLOATS) + sorted(QUANT)
NAMES = {1: "f32", 10: "f16", 16: "bf16", 2: "u8", 3: "i8", 21: "u4", 22: "i4", 25: "u2", 26: "i2"}


def quantize_compact(x, fmt):
    """float32 [H, bs, D] -> (uint8 payload with a compact header, float32 values it represents),
    per-channel parameters of formats.compact_params; packed / read back by the twins."""
    H, bs, D = x.shape
    scale, zp, header = compact_params(x, fmt)
    payload = np.zeros(page_bytes(fmt, H, bs, D, D, "compact"), np.uint8)
    R.quantize_page(x, fmt, scale, zp, D, payload, bs, header=header)
    recon = np.empty_like(x)
    R.dequantize_page(payload, fmt, H, bs, D, D, bs, recon, "compact")
    assert np.all(np.abs(recon - x) <= scale.reshape(H, 1, D) * 0.5 * 1.001 + 1e-6)
    return payload, recon


def quantize(x, fmt, group, header="float32"):
    """float32 [H, bs, D] -> (uint8 payload, float32 values it represents):
    symmetric scales (zero point 0) for signed formats, asymmetric (over the
    range extended to hold 0) for unsigned, over each head (group 1) or each
    head and channel (group D);
    packed by reference.quantize_page, read back by reference.dequantize_page.
    header "compact": quantize_compact."""
    if header == "compact":
        return quantize_compact(x, fmt)
    bits, signed = QUANT[fmt]
    H, bs, D = x.shape
    axes = (1, 2) if group == 1 else (1,)
    if signed:
        hi = (1 << (bits - 1)) - 1
        scale = np.abs(x).max(axis=axes, keepdims=True) / hi
        zp = np.zeros_like(scale)
    else:
        hi = (1 << bits) - 1
        mn = np.minimum(x.min(axis=axes, keepdims=True), 0)  # the range holds 0
        mx = np.maximum(x.max(axis=axes, keepdims=True), 0)
        scale = (mx - mn) / hi
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    if not signed:
        zp = np.clip(np.rint(-mn / scale), 0, hi).astype(np.float32)
    sc = np.ascontiguousarray(np.broadcast_to(scale, (H, 1, group)).reshape(-1))
    z = np.ascontiguousarray(np.broadcast_to(zp, (H, 1, group)).reshape(-1))
    payload = np.zeros(-(-(8 * H * group) // 64) * 64 + H * bs * D * bits // 8, np.uint8)
    R.quantize_page(x, fmt, sc, z, group, payload, bs)
    recon = np.empty_like(x)
    R.dequantize_page(payload, fmt, H, bs, D, group, bs, recon)
    # one quantization step at most (half a step where nothing saturates)
    assert np.all(np.abs(recon - x) <= scale * (0.5 if signed else 1.0) * 1.001 + 1e-6)
    return payload, recon


def encode(x, fmt, group, header="float32"):
    """One page of format fmt: (storage array, float32 values it represents)."""
    if fmt == 1:
        return x.copy(), x
    if fmt == 10:
        s = x.astype(np.float16)
        return s, s.astype(np.float32)
    if fmt == 16:
        s = R.bf16_from_f32(x)
        return s, R.f32_from_bf16(s)
    return quantize(x, fmt, group, header)


class QPaged:
    """Caches k, v [B, Hkv, Cap, D] (float32) in pages of formats chosen per
    page id by kfmt(pid) / vfmt(pid); physical ids shuffled; quantized key pages
    with k_header headers.  self.kd / self.vd: the dequantized values laid out
    contiguously."""

    def __init__(self, rng, k, v, bs, kfmt, vfmt, kG, vG, k_header="float32"):
        B, Hkv, Cap, D = k.shape
        M = -(-Cap // bs)
        pad = ((0, 0), (0, 0), (0, M * bs - Cap), (0, 0))
        src = {"k": np.pad(k, pad), "v": np.pad(v, pad)}
        self.deq = {"k": np.zeros_like(src["k"]), "v": np.zeros_like(src["v"])}
        ids = rng.permutation(B * M)
        self.table = ids.reshape(B, M).astype(np.int32)
        self.formats = {
            "k": np.array([kfmt(p) for p in range(B * M)], np.uint8),
            "v": np.array([vfmt(p) for p in range(B * M)], np.uint8),
        }
        self.pages = {"k": [None] * (B * M), "v": [None] * (B * M)}
        self.addr = {"k": np.zeros(B * M, np.uint64), "v": np.zeros(B * M, np.uint64)}
        self.group = {"k": kG, "v": vG}
        self.header = {"k": k_header, "v": "float32"}
        self.buffers = []
        for b in range(B):
            for i in range(M):
                pid = int(self.table[b, i])
                for p in "kv":
                    store, val = encode(
                        src[p][b, :, i * bs : (i + 1) * bs], int(self.formats[p][pid]), self.group[p], self.header[p]
                    )
                    buf = ALLOC.allocate(store.nbytes, 64)
                    page = buf.view(store.dtype, store.shape)
                    page[...] = store
                    self.buffers.append(buf)
                    self.pages[p][pid] = page
                    self.addr[p][pid] = buf.address
                    self.deq[p][b, :, i * bs : (i + 1) * bs] = val
        self.kd = np.ascontiguousarray(self.deq["k"][:, :, :Cap])
        self.vd = np.ascontiguousarray(self.deq["v"][:, :, :Cap])
        self.bs = bs

    def kwargs(self):
        return dict(
            k_formats=self.formats["k"],
            v_formats=self.formats["v"],
            k_group=self.group["k"],
            v_group=self.group["v"],
            k_header=self.header["k"],
        )

    def kernel(self, q, Hkv, kv_len, q_pos, scale, softcap, window, out):
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
            softcap,
            window,
            out,
            **self.kwargs(),
        )

    def twin(self, q, Hkv, kv_len, q_pos, scale, softcap, window, out):
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
            softcap,
            window,
            out,
            **self.kwargs(),
        )


def chooser(spec, seed):
    """Format of page id p: one code for every page, or (a tuple) a seeded random pick per page."""
    if isinstance(spec, int):
        return lambda p: spec
    pick = np.random.default_rng(seed).choice(spec, size=100000)
    return lambda p: int(pick[p])


@functools.cache
def case(kspec, vspec, kG, vG, heads, D, bs, kv_len, Sq, seed, window=-1, softcap=0.0, uniform=False):
    """Random data, its paged copy, the twin's result and float32 attention over
    the unquantized values; cached across the thread / SIMD variants."""
    Hq, Hkv = HEADS[heads]
    rng = np.random.default_rng(seed)
    kv_len = np.array(kv_len, np.int32)
    B, Cap = len(kv_len), int(kv_len.max()) + 3
    if uniform:
        q, k, v = (
            rng.uniform(-1, 1, s).astype(np.float32) for s in ((B, Hq, Sq, D), (B, Hkv, Cap, D), (B, Hkv, Cap, D))
        )
    else:
        q, k, v = rand(rng, (B, Hq, Sq, D)), rand(rng, (B, Hkv, Cap, D)), rand(rng, (B, Hkv, Cap, D))
    k_header = "compact" if kG == "Dc" else "float32"  # "Dc": per channel, compact key headers
    kG, vG = (D if kG in ("D", "Dc") else kG), (D if vG == "D" else vG)
    pg = QPaged(rng, k, v, bs, chooser(kspec, seed + 1), chooser(vspec, seed + 2), kG, vG, k_header)
    q_pos = (kv_len[:, None] - Sq + np.arange(Sq)[None, :]).astype(np.int32)
    scale = D**-0.5
    want = np.full_like(q, np.nan)
    pg.twin(q, Hkv, kv_len, q_pos, scale, softcap, window, want)
    exact = np.full_like(q, np.nan)
    K.attention(q, k, v, kv_len, q_pos, scale, softcap, window, exact)
    return q, Hkv, kv_len, q_pos, scale, pg, want, exact


@pytest.fixture(scope="module", autouse=True)
def _drop_cached_cases():
    yield
    case.cache_clear()


def run(*args, **kw):
    """Kernel vs twin vs contiguous kernel on the dequantized values; returns
    (kernel result, float32 attention over the unquantized values, counters)."""
    q, Hkv, kv_len, q_pos, scale, pg, want, exact = case(*args, **kw)
    window, softcap = kw.get("window", -1), kw.get("softcap", 0.0)
    got, contig = np.full_like(q, np.nan), np.full_like(q, np.nan)
    stats = pg.kernel(q, Hkv, kv_len, q_pos, scale, softcap, window, got)
    K.attention(q, pg.kd, pg.vd, kv_len, q_pos, scale, softcap, window, contig)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, contig, rtol=1e-5, atol=1e-5)
    return got, exact, stats


# every format alone (K and V), per-head and per-channel keys (float32 and compact headers)
SINGLE = [(f, G, 80 if f in (3, 22) else 128) for f in ALL for G in ((1, "D", "Dc") if f in QUANT else (1,))]


@pytest.mark.parametrize("fmt,kG,D", SINGLE, ids=[f"{NAMES[f]}-kG{g}-D{d}" for f, g, d in SINGLE])
def test_single_format_decode(fmt, kG, D, threads, simd):
    got, exact, stats = run(fmt, fmt, kG, 1, "gqa", D, 16, (700, 333), 1, seed=fmt * 7 + D)
    assert np.isfinite(got).all()
    assert (stats["dequantized_bytes"] > 0) == (fmt in QUANT)


MIXED = tuple(ALL)


@pytest.mark.parametrize(
    "heads,D,bs,kv_len,Sq,window",
    [
        ("gqa", 128, 16, (1000, 517), 1, -1),
        ("mqa", 64, 32, (300, 45, 1), 1, -1),
        ("mha", 80, 16, (260, 199), 1, 100),
        ("gqa", 64, 32, (150, 97), 9, -1),  # causal prefill
        ("mqa", 128, 16, (400,), 20, 37),  # prefill with a window
    ],
)
@pytest.mark.parametrize(
    "kG,vG",
    [(1, 1), ("D", 1), (1, "D"), ("Dc", 1)],
    ids=["per_head", "k_per_channel", "v_per_channel", "k_per_channel_compact"],
)
def test_mixed_formats_per_page(heads, D, bs, kv_len, Sq, window, kG, vG, threads, simd):
    """K and V formats drawn independently per page id (all nine formats)."""
    got, _, _ = run(MIXED, MIXED, kG, vG, heads, D, bs, kv_len, Sq, seed=D + bs + Sq, window=window)
    assert np.isfinite(got).all()


@pytest.mark.parametrize(
    "heads,D,bs,Sq", [("gqa", 12, 16, 1), ("mqa", 24, 8, 5), ("mha", 36, 32, 3), ("gqa", 40, 16, 1)]
)
@pytest.mark.parametrize("kG,vG", [(1, 1), ("D", "D"), ("Dc", "D")], ids=["per_head", "per_channel", "compact_keys"])
def test_head_sizes_not_a_multiple_of_16(heads, D, bs, Sq, kG, vG, threads, simd):
    """All nine formats per page with head sizes that leave an 8-lane chunk
    (12, 24, 40) or a scalar tail (12, 36) after the 16-lane chunks."""
    got, _, _ = run(MIXED, MIXED, kG, vG, heads, D, bs, (300, 77), Sq, seed=D * 3 + bs)
    assert np.isfinite(got).all()


FOUR_BIT = [(22, 21, 1), (21, 22, 1), ((22, 1), (21, 1), 1), ((1, 21), 22, 7), ((3, 22), (21, 10), 1)]


@pytest.mark.parametrize("D", [16, 24, 40, 128])
@pytest.mark.parametrize("kspec,vspec,Sq", FOUR_BIT, ids=["i4-u4", "u4-i4", "i4f32-u4f32", "prefill", "i8i4-u4f16"])
def test_4bit_pages_alone_and_between_others(D, kspec, vspec, Sq, threads, simd):
    """4-bit pages with per-head scales, alone and next to other formats: on
    AVX-512 their tiles read codes in an interleaved lane order against query
    rows in that order and accumulate values into accumulators in that order,
    added to the natural ones at the end of the work unit.  Head sizes of only
    16-lane chunks (16, 128), with an 8-lane chunk (24, 40); decode and
    prefill; random normal data, so the running max grows and rescales both
    accumulator sets."""
    got, _, _ = run(kspec, vspec, 1, 1, "gqa", D, 16, (333, 150), Sq, seed=D * 5 + Sq)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("vspec", [21, 2, 25, (21, 2)], ids=["u4", "u8", "u2", "u4-u8"])
def test_unsigned_values_over_thousands_of_keys(vspec, threads, simd):
    """Unsigned value pages (non-zero zero points) over 3001 keys: each tile's
    zero-point share is applied to the accumulators it summed into at once
    (4-bit tiles: the interleaved ones), so the sums of p s c never grow far
    past the result and cancel (uint4 was ~1.4e-5 from the twin here when the
    share was deferred to the end of the work unit)."""
    got, _, _ = run(22, vspec, 1, 1, "gqa", 128, 16, (3001, 1700), 1, seed=81)
    assert np.isfinite(got).all()


def test_old_pages_int4_recent_float32(threads, simd):
    """The intended use: a sequence's old pages int4 (per-channel keys), its
    newest 256 tokens' pages float32; with a softcap."""
    bs, n, Hq, Hkv, D = 16, 1200, 32, 8, 128
    rng = np.random.default_rng(5)
    q, k, v = rand(rng, (1, Hq, 1, D)), rand(rng, (1, Hkv, n, D)), rand(rng, (1, Hkv, n, D))
    M = -(-n // bs)
    ids = np.random.default_rng(0).permutation(M)  # QPaged's shuffle with the same seed
    recent = {int(ids[i]) for i in range(M) if (i + 1) * bs > n - 256}
    fmt = lambda p: 1 if p in recent else 22  # noqa: E731
    pg = QPaged(np.random.default_rng(0), k, v, bs, fmt, fmt, D, 1)
    fmts = pg.formats["k"][pg.table[0]]
    assert (fmts[-16:] == 1).all() and (fmts[:-16] == 22).all()
    kv_len, q_pos = np.array([n], np.int32), np.array([[n - 1]], np.int32)
    got, want = np.full_like(q, np.nan), np.full_like(q, np.nan)
    pg.kernel(q, Hkv, kv_len, q_pos, D**-0.5, 30.0, -1, got)
    pg.twin(q, Hkv, kv_len, q_pos, D**-0.5, 30.0, -1, want)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "fmt,kG,tol",
    [
        (3, 1, 0.01),
        (3, "D", 0.01),
        (2, 1, 0.01),
        (22, 1, 0.15),
        (22, "D", 0.15),
        (21, "D", 0.15),
        (2, "Dc", 0.01),
        (21, "Dc", 0.15),
    ],
)
def test_accuracy_vs_unquantized(fmt, kG, tol, threads):
    """uniform[-1, 1] data: the output stays within tol of float32 attention
    over the unquantized values (8-bit: 0.01, 4-bit: 0.15 max abs diff)."""
    got, exact, _ = run(fmt, fmt, kG, 1, "gqa", 128, 16, (2000,), 1, seed=fmt, uniform=True)
    err = float(np.max(np.abs(got - exact)))
    print(f"max abs diff vs float32: {err:.5f}")
    assert err <= tol, err
    assert err > 0.0  # quantized for real


@pytest.mark.parametrize("kspec,kG", [(3, 1), (22, "D"), (MIXED, "D"), (22, "Dc"), (MIXED, "Dc")])
def test_dequantized_bytes_counted(kspec, kG, threads):
    """Decode reads every page of the visible range once: the counter equals
    the quantized codes plus header entries of those pages (float pages 0;
    compact key headers: S and two bytes per channel)."""
    D, bs, n = 64, 16, 1000
    q, Hkv, kv_len, q_pos, scale, pg, want, exact = case(kspec, 21, kG, 1, "gqa", D, bs, (n,), 1, seed=2)
    got = np.full_like(q, np.nan)
    stats = pg.kernel(q, Hkv, kv_len, q_pos, scale, 0.0, -1, got)
    expect = 0
    for i in range(-(-n // bs)):
        pid, ntok = int(pg.table[0, i]), min(bs, n - i * bs)
        for p in "kv":
            f = int(pg.formats[p][pid])
            if f in QUANT:
                head = 4 + 2 * pg.group[p] if pg.header[p] == "compact" else 2 * pg.group[p] * 4
                expect += Hkv * (head + ntok * D * QUANT[f][0] // 8)
    assert stats["dequantized_bytes"] == expect
    assert stats["workspace_peak_bytes"] > 0


@pytest.mark.parametrize("fmt", sorted(QUANT))
@pytest.mark.parametrize("kG", [1, "D"])
def test_compact_key_headers_of_random_bytes(fmt, kG, threads, simd):
    """Key pages of random codes under random compact headers (every exponent code, any zero-point
    code of the format; per head or per channel): the kernel equals the twin, which decodes the
    headers with reference.dequantize_page."""
    rng = np.random.default_rng(fmt)
    bits, signed = QUANT[fmt]
    Hq, Hkv, D, bs, n = 8, 2, 48, 16, 200
    G = D if kG == "D" else 1
    M = -(-n // bs)
    hb = -(-(4 * Hkv + 2 * Hkv * G) // 64) * 64
    k_pages, v_pages, bufs = [], [], []
    for _ in range(M):
        page = rng.integers(0, 256, hb + Hkv * bs * D * bits // 8, dtype=np.uint8)
        page[:hb] = 0
        page[: 4 * Hkv] = rng.uniform(0.01, 0.1, Hkv).astype(np.float32).view(np.uint8)
        page[4 * Hkv : 4 * Hkv + Hkv * G] = rng.integers(0, 256, Hkv * G)
        page[4 * Hkv + Hkv * G : 4 * Hkv + 2 * Hkv * G] = 0 if signed else rng.integers(0, 1 << bits, Hkv * G)
        for src, pages in ((page, k_pages), (rand(rng, (Hkv, bs, D)), v_pages)):
            buf = ALLOC.allocate(src.nbytes, 64)
            arr = buf.view(src.dtype, src.shape)
            arr[...] = src
            bufs.append(buf)
            pages.append(arr)
    addr = [np.array([b.address for b in bufs[i::2]], np.uint64) for i in (0, 1)]
    table = rng.permutation(M).astype(np.int32)[None, :]
    kw = dict(k_formats=np.full(M, fmt, np.uint8), v_formats=np.ones(M, np.uint8), k_group=G, k_header="compact")
    q = rand(rng, (1, Hq, 1, D))
    kv_len, q_pos = np.array([n], np.int32), np.array([[n - 1]], np.int32)
    got, want = np.full_like(q, np.nan), np.full_like(q, np.nan)
    stats = K.paged_attention(q, *addr, table, bs, Hkv, kv_len, q_pos, 0.2, 0.0, -1, got, **kw)
    R.paged_attention(q, k_pages, v_pages, table, bs, Hkv, kv_len, q_pos, 0.2, 0.0, -1, want, **kw)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert stats["dequantized_bytes"] == M * Hkv * (4 + 2 * G) + n * Hkv * D * bits // 8


def test_workspace_does_not_grow_with_the_cache():
    old = K.get_num_threads()
    K.set_num_threads(1)
    try:
        sizes = []
        for n in (4096, 8192):
            q, Hkv, kv_len, q_pos, scale, pg, _, _ = case(22, 22, 1, 1, "gqa", 64, 32, (n,), 1, seed=n)
            sizes.append(pg.kernel(q, Hkv, kv_len, q_pos, scale, 0.0, -1, np.empty_like(q))["workspace_peak_bytes"])
    finally:
        K.set_num_threads(old)
    assert sizes[0] == sizes[1] < 64 * 1024


def test_float_call_unchanged_reports_no_dequantization():
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, (1, 4, 1, 64)), rand(rng, (1, 2, 40, 64)), rand(rng, (1, 2, 40, 64))
    pg = QPaged(rng, k, v, 16, lambda p: 1, lambda p: 1, 1, 1)
    a, b = np.empty_like(q), np.empty_like(q)
    kl, qp = np.array([40], np.int32), np.array([[39]], np.int32)
    st = K.paged_attention(q, pg.addr["k"], pg.addr["v"], pg.table, 16, 2, kl, qp, 0.125, 0.0, -1, a)
    pg.kernel(q, 2, kl, qp, 0.125, 0.0, -1, b)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert st["dequantized_bytes"] == 0


# ---------------------------------------------------------------- errors


def _bad_cases():
    rng = np.random.default_rng(0)
    D = 8
    q = rand(rng, (1, 4, 1, D))
    pg = QPaged(rng, rand(rng, (1, 2, 16, D)), rand(rng, (1, 2, 16, D)), 4, lambda p: 3, lambda p: 22, 1, 1)
    ok = dict(
        q=q,
        k_pages=pg.addr["k"],
        v_pages=pg.addr["v"],
        block_tables=pg.table,
        block_size=4,
        kv_heads=2,
        kv_len=np.array([16], np.int32),
        q_pos=np.array([[15]], np.int32),
        scale=0.3,
        softcap=0.0,
        window=-1,
        **pg.kwargs(),
    )
    kf = pg.formats["k"]
    yield "k_formats", ValueError, dict(ok, k_formats=kf.astype(np.int32))
    yield "k_formats", ValueError, dict(ok, k_formats=kf[:-1].copy())
    bad = kf.copy()
    bad[1] = 4  # uint16: not a page format
    yield "k_formats", ValueError, dict(ok, k_formats=bad)
    yield "v_formats", ValueError, dict(ok, v_formats=np.full_like(kf, 99))
    yield "k_group", ValueError, dict(ok, k_group=2)
    yield "v_group", TypeError, dict(ok, v_group=1.0)
    yield "k_header", ValueError, dict(ok, k_header="float16")
    q6 = rand(rng, (1, 4, 1, 6))  # 6 int2 codes: 12 bits, not whole bytes
    yield "v_formats", ValueError, dict(ok, q=q6, v_formats=np.full_like(kf, 25), k_formats=None)
    t = pg.table.copy()
    t[0, 1] = -1
    yield "block_tables", ValueError, dict(ok, block_tables=t)


CASES = list(_bad_cases())


@pytest.mark.parametrize("case_", range(len(CASES)), ids=lambda i: f"{CASES[i][0]}-{i}")
def test_bad_arguments_raise_before_writing(case_):
    name, exc, kw = CASES[case_]
    out = np.full(kw["q"].shape, 42.0, np.float32)
    with pytest.raises(exc, match=name):
        K.paged_attention(out=out, **kw)
    assert np.all(out == 42.0)
