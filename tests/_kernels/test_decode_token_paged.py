"""decode_token_paged: rotary, each row's new K/V row written into its page and paged attention of one
token per row (rows of their own lengths) in one call.

Bit for bit the unfused compiled calls (rotary_embedding, page_write, paged_attention) and within float32
tolerance of the NumPy twin, on random data over MHA / GQA / MQA, head sizes, rotary widths, interleaving,
softcap and window, packed QKV rows, 1 and 2 threads, every SIMD level.  Arguments it does not take are
declined (None) with no page and no output byte written.
"""

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .conftest import rand
from .test_attention_decode_token import decode_matrix
from .test_paged_attention import Paged

BS, CAP = 16, 64


def _case(rng, hq, hkv, d, pos, rot_half, packed=False, cap=CAP, n=1, tokens=np.float32, kv_dtype=None):
    """Pages holding random caches of len(pos) rows (every block allocated, ids shuffled; float32, or
    ``kv_dtype`` "float16" / "bfloat16" bit patterns), the ``n`` new tokens' q, k, v per row of ``tokens``
    (slices of packed rows if ``packed``), rotary tables or None."""
    b = len(pos)
    kc, vc = (_pages_of(rand(rng, (b, hkv, cap, d)), kv_dtype) for _ in range(2))
    if packed:
        qkv = rand(rng, (b, n, (hq + 2 * hkv) * d)).astype(tokens)
        q, k, v = qkv[..., : hq * d], qkv[..., hq * d : (hq + hkv) * d], qkv[..., (hq + hkv) * d :]
    else:
        q, k, v = (rand(rng, (b, n, w)).astype(tokens) for w in (hq * d, hkv * d, hkv * d))
    cos = sin = None
    if rot_half:
        ang = rng.uniform(-3, 3, (cap, rot_half))
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    return Paged(rng, kc, vc, BS), q, k, v, cos, sin


def _pages_of(x: np.ndarray, kv_dtype) -> np.ndarray:
    """float32 cache values as pages of ``kv_dtype`` hold them (None: float32; bfloat16: uint16 bits)."""
    return R.bf16_from_f32(x) if kv_dtype == "bfloat16" else x.astype(np.float16) if kv_dtype == "float16" else x


def _snapshot(pg: Paged) -> list:
    return [p.copy() for p in pg.k_pages + pg.v_pages]


def _restore(pg: Paged, snap: list) -> None:
    for page, saved in zip(pg.k_pages + pg.v_pages, snap, strict=True):
        page[...] = saved


def _unfused(pg, q, k, v, cos, sin, interleaved, hkv, pos, scale, softcap, window, out, kv_dtype=None):
    """The compiled calls the fused kernel stands for: rotary (float16 tokens widened first), page_write of the
    rows (rounded to the pages' type, ``kv_dtype`` "float16" or "bfloat16", as a paged plane's write rounds
    them), paged_attention, its result in out's type."""
    b, n, d = q.shape[0], q.shape[1], k.shape[2] // hkv
    hq = q.shape[2] // d
    p = pos.astype(np.int64)[:, None] + np.arange(n)[None, :]
    q4, k4 = (np.ascontiguousarray(x).astype(np.float32).reshape(b, n, -1, d) for x in (q, k))
    if cos is not None:
        qr, kr = np.empty_like(q4), np.empty_like(k4)
        K.rotary_embedding(q4, cos, sin, p, interleaved, qr)
        K.rotary_embedding(k4, cos, sin, p, interleaved, kr)
        q4, k4 = qr, kr
    v4 = np.ascontiguousarray(v).reshape(b, n, hkv, d)
    for new, addr in ((k4, pg.k_addr), (v4, pg.v_addr)):
        rows = np.ascontiguousarray(new.transpose(0, 2, 1, 3))
        if kv_dtype == "bfloat16":
            bits = np.empty(rows.shape, np.uint16)
            K.f32_to_bf16(np.ascontiguousarray(rows, dtype=np.float32), bits)
            rows = bits
        elif kv_dtype == "float16":
            rows = rows.astype(np.float16)
        K.page_write(rows, addr, pg.table, pos.astype(np.int64), BS)
    res = np.empty((b, hq, n, d), np.float32)
    K.paged_attention(
        np.ascontiguousarray(q4.transpose(0, 2, 1, 3)), pg.k_addr, pg.v_addr, pg.table, BS, hkv,
        (pos + n).astype(np.int32), p.astype(np.int32), scale, softcap, window, res, kv_dtype=kv_dtype,
    )  # fmt: skip
    out.reshape(b, n, hq, d)[...] = res.transpose(0, 2, 1, 3)


def _check(pg, q, k, v, cos, sin, interleaved, hkv, pos, scale, softcap, window):
    """The fused call equals the unfused calls bit for bit (output and every page), the twin within float32
    tolerance, and writes no page position but the rows' own."""
    b, n, hq_d = q.shape
    before = _snapshot(pg)
    got = np.full((b, n, hq_d), np.nan, np.float32)
    stats = K.decode_token_paged(q, k, v, cos, sin, interleaved, pg.k_addr, pg.v_addr, pg.table, BS, hkv, pos,
                                 scale, softcap, window, got)  # fmt: skip
    assert stats is not None and set(stats) == {"dequantized_bytes", "workspace_peak_bytes"}
    fused_pages = _snapshot(pg)
    _restore(pg, before)
    want = np.full_like(got, np.nan)
    _unfused(pg, q, k, v, cos, sin, interleaved, hkv, pos, scale, softcap, window, want)
    np.testing.assert_array_equal(got, want)
    for a, w in zip(fused_pages, _snapshot(pg), strict=True):
        np.testing.assert_array_equal(a, w)
    written = {(int(pg.table[r, (pos[r] + t) // BS]), int((pos[r] + t) % BS)) for r in range(b) for t in range(n)}
    pages = len(pg.k_pages)
    for i, (a, w) in enumerate(zip(fused_pages, before, strict=True)):
        keep = np.ones(a.shape[1], bool)
        for page, off in written:
            keep[off] &= page != i % pages
        np.testing.assert_array_equal(a[:, keep], w[:, keep])
    _restore(pg, before)
    twin = np.empty_like(got)
    R.decode_token_paged(q, k, v, cos, sin, interleaved, pg.k_pages, pg.v_pages, pg.table, BS, hkv, pos, scale,
                         softcap, window, twin)  # fmt: skip
    np.testing.assert_allclose(got, twin, rtol=1e-5, atol=1e-5)


@decode_matrix
def test_equals_unfused_calls_and_twin(hq, hkv, d, rot, interleaved, softcap, window, threads, simd):
    rng = np.random.default_rng([hq, hkv, d, len(rot), interleaved, int(softcap), window + 1])
    half = {"none": 0, "full": d // 2, "partial": d // 4}[rot]
    pos = np.array([0, 17, 37, 15, 63], np.int32)  # first position, mid page, page ends, the last position
    pg, q, k, v, cos, sin = _case(rng, hq, hkv, d, pos, half, packed=rot == "full")
    _check(pg, q, k, v, cos, sin, interleaved, hkv, pos, float(d**-0.5), softcap, window)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("rot", [True, False], ids=["rotary", "plain"])
@pytest.mark.parametrize(
    "tokens, kv_dtype",
    [(np.float32, "float16"), (np.float32, "bfloat16"), (np.float16, "float16"), (np.float16, "bfloat16")],
    ids=["f32-f16pages", "f32-bf16pages", "f16", "f16-bf16pages"],
)
def test_narrow_tokens_and_pages_equal_unfused_calls_and_twin(n, rot, tokens, kv_dtype, threads, simd):
    """Float16 tokens (a float16 file) and float16 / bfloat16 pages (its pool, or kv_format fp16 / bf16 of a
    float32 model): the rows rounded into the pages, float16 tokens widened first and their output rounded."""
    rng = np.random.default_rng([n, rot, len(kv_dtype), tokens == np.float16])
    pos = np.array([0, 17, 30, 15], np.int32) if n == 1 else np.array([5, 29, 12], np.int32)
    kc, vc = rand(rng, (len(pos), 2, CAP, 32)), rand(rng, (len(pos), 2, CAP, 32))
    pages = [R.bf16_from_f32(x) if kv_dtype == "bfloat16" else x.astype(np.float16) for x in (kc, vc)]
    pg = Paged(rng, *pages, BS)
    qkv = rand(rng, (len(pos), n, 8 * 32)).astype(tokens)  # packed rows: q of 4 heads, k and v of 2
    q, k, v = qkv[..., :128], qkv[..., 128:192], qkv[..., 192:]
    cos = sin = None
    if rot:
        ang = rng.uniform(-3, 3, (CAP, 8))
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    before = _snapshot(pg)
    got = np.full((len(pos), n, 128), np.nan, tokens)
    stats = K.decode_token_paged(q, k, v, cos, sin, False, pg.k_addr, pg.v_addr, pg.table, BS, 2, pos, 0.25, 0.0,
                                 -1, got, kv_dtype=kv_dtype)  # fmt: skip
    assert stats is not None
    fused = _snapshot(pg)
    _restore(pg, before)
    want = np.full_like(got, np.nan)
    _unfused(pg, q, k, v, cos, sin, False, 2, pos, 0.25, 0.0, -1, want, kv_dtype)
    np.testing.assert_array_equal(got, want)
    for a, w in zip(fused, _snapshot(pg), strict=True):
        np.testing.assert_array_equal(a, w)
    _restore(pg, before)
    twin = np.empty_like(got)
    R.decode_token_paged(q, k, v, cos, sin, False, pg.k_pages, pg.v_pages, pg.table, BS, 2, pos, 0.25, 0.0, -1,
                         twin, kv_dtype=kv_dtype)  # fmt: skip
    tol = 2e-3 if tokens == np.float16 else 1e-5
    np.testing.assert_allclose(got.astype(np.float32), twin.astype(np.float32), rtol=tol, atol=tol)
    # declined with nothing written: a page type that is not one, float16 tokens into float32 pages (the
    # addresses cannot tell a page's type: the caller names it)
    _restore(pg, before)
    for page_type in ("int8", 5) + ((None, "float32") if tokens == np.float16 else ()):
        out = np.zeros_like(got)
        r = K.decode_token_paged(q, k, v, cos, sin, False, pg.k_addr, pg.v_addr, pg.table, BS, 2, pos, 0.25, 0.0,
                                 -1, out, kv_dtype=page_type)  # fmt: skip
        assert r is None and not out.any()
        for a, w in zip(_snapshot(pg), before, strict=True):
            np.testing.assert_array_equal(a, w)


def _declined(pg, args: dict, case: str) -> None:
    """decode_token_paged(**args) returns None with no page and no output byte written."""
    before = _snapshot(pg)
    out = args["out"]
    out_before = out.copy()
    assert K.decode_token_paged(**args) is None, case
    for a, w in zip(_snapshot(pg), before, strict=True):
        np.testing.assert_array_equal(a, w)
    np.testing.assert_array_equal(out, out_before)


def test_declines_what_it_does_not_take():
    rng = np.random.default_rng(3)
    pos = np.array([5, 20], np.int32)
    pg, q, k, v, cos, sin = _case(rng, 8, 2, 32, pos, 16)
    base = dict(q=q, k=k, v=v, cos=cos, sin=sin, interleaved=False, k_pages=pg.k_addr, v_pages=pg.v_addr,
                block_tables=pg.table, block_size=BS, kv_heads=2, pos=pos, scale=0.2, softcap=0.0, window=-1,
                out=np.full((2, 1, 256), 7.0, np.float32))  # fmt: skip
    bad_table = pg.table.copy()
    bad_table[1, 20 // BS] = -1  # the block row 1 writes has no page
    cases = {
        "q float64": dict(q=q.astype(np.float64)),
        "pos negative": dict(pos=np.array([5, -1], np.int32)),
        "pos past the table": dict(pos=np.array([5, CAP], np.int32)),
        "pos int64": dict(pos=pos.astype(np.int64)),
        "pos past the rotary table": dict(cos=cos[:10], sin=sin[:10]),
        "sin without cos": dict(cos=None),
        "written block without a page": dict(block_tables=bad_table),
        "kv_heads not dividing": dict(kv_heads=3),
        "out of one token, q of two": dict(
            q=np.repeat(q, 2, axis=1), k=np.repeat(k, 2, axis=1), v=np.repeat(v, 2, axis=1)
        ),
        "rows of two tokens not one after another": dict(
            q=np.repeat(q, 2, axis=1)[::-1],
            k=np.repeat(k, 2, axis=1),
            v=np.repeat(v, 2, axis=1),
            out=np.full((2, 2, 256), 7.0, np.float32),
        ),
        "last token past the table": dict(
            q=np.repeat(q, 2, axis=1),
            k=np.repeat(k, 2, axis=1),
            v=np.repeat(v, 2, axis=1),
            pos=np.array([5, CAP - 1], np.int32),
            out=np.full((2, 2, 256), 7.0, np.float32),
        ),
        "pos near the int32 limit": dict(
            q=np.repeat(q, 2, axis=1),
            k=np.repeat(k, 2, axis=1),
            v=np.repeat(v, 2, axis=1),
            pos=np.array([5, 2**31 - 1], np.int32),
            out=np.full((2, 2, 256), 7.0, np.float32),
        ),
        "out strided": dict(out=np.full((2, 1, 512), 7.0, np.float32)[:, :, ::2]),
        "block_size 0": dict(block_size=0),
        "window not an int": dict(window=1.5),
    }
    for case, change in cases.items():
        _declined(pg, {**base, **change}, case)
    alias = base["out"]
    _declined(pg, {**base, "q": alias, "out": alias}, "out is q")
    # a page the call reads (row 0's first block) or writes (row 1's block of position 20) inside out or q
    page_bytes = pg.k_pages[0].nbytes
    for case, plane, block, arg in (
        ("out over a value page read", "v", (0, 0), "out"),
        ("out over a key page written", "k", (1, 20 // BS), "out"),
        ("q over a key page written", "k", (1, 20 // BS), "q"),
    ):
        buf = _aligned(max(page_bytes, base[arg].nbytes))
        buf[...] = 7.0
        view = buf[: base[arg].size].reshape(base[arg].shape)
        addr = (pg.k_addr if plane == "k" else pg.v_addr).copy()
        addr[pg.table[block]] = buf.ctypes.data
        _declined(pg, {**base, arg: view, f"{plane}_pages": addr}, case)
        np.testing.assert_array_equal(buf, 7.0)


def _aligned(nbytes: int) -> np.ndarray:
    """float32 zeros of at least ``nbytes`` on a 64-byte boundary (where a page may start)."""
    raw = np.zeros(nbytes + 64, np.uint8)
    return raw[(-raw.ctypes.data) % 64 :][: nbytes // 4 * 4].view(np.float32)


def test_long_rows_split_like_paged_attention(threads):
    """Rows long enough for the thread split (2 KV heads, hundreds of keys): the unfused result bit for bit."""
    rng = np.random.default_rng(11)
    pos = np.array([1199, 640, 3], np.int32)
    pg, q, k, v, cos, sin = _case(rng, 8, 2, 64, pos, 32, cap=1200)
    _check(pg, q, k, v, cos, sin, False, 2, pos, 0.125, 0.0, -1)


@pytest.mark.parametrize("n", [2, 4, 7])
@pytest.mark.parametrize("window", [-1, 9])
def test_several_tokens_per_row_equal_unfused_calls_and_twin(n, window, threads, simd):
    """S tokens per row (a speculative tree's rows, a verification): each token sees its row's keys up to its
    own position, pages crossed between the tokens; packed rows; bit for bit the unfused calls."""
    rng = np.random.default_rng([n, window + 1])
    pos = np.array([13, 13, 13], np.int32) if n > 2 else np.array([0, 30, 57], np.int32)
    pg, q, k, v, cos, sin = _case(rng, 8, 2, 32, pos, 16, packed=True, n=n)
    _check(pg, q, k, v, cos, sin, False, 2, pos, 0.2, 0.0, window)
    pg, q, k, v, cos, sin = _case(rng, 4, 4, 16, pos[:1], 0, n=n)  # one row, no rotary, MHA
    _check(pg, q, k, v, cos, sin, False, 4, pos[:1], 0.25, 30.0, window)
