"""Paged streaming attention (onnxkv._kernels.paged_attention).

The kernel reads K/V through block tables of page addresses.  Every result is
compared with the NumPy twin (reference.paged_attention, float64 math over the
gathered visible blocks) and with the contiguous kernel (attention) on the same
keys laid out contiguously.  Pages are allocated one by one (64-byte aligned,
onnxkv.alloc.SystemAllocator) and their physical order is shuffled.  Blocks no
query sees are mapped to -1 or to pages full of NaN: a kernel that read them
would fail the comparison (NaN values) or read out of bounds.
"""

import functools
import sys

import numpy as np
import pytest
from fuzzing import examples

import onnxkv._kernels as K
from onnxkv._kernels import reference as R
from onnxkv._kernels._validate import paged_blocks_read
from onnxkv.alloc import SystemAllocator

from .conftest import rand

HEADS = {"mha": (8, 8), "gqa": (32, 8), "mqa": (8, 1)}
STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
NAN = {np.dtype(np.float32): np.nan, np.dtype(np.float16): np.nan, np.dtype(np.uint16): 0x7FC0}  # bf16 NaN bits
ALLOC = SystemAllocator()


def to_cache(x, dtype):
    """float32 array -> cache storage of `dtype` (bf16: uint16 bit patterns)."""
    if dtype == "bfloat16":
        return R.bf16_from_f32(x)
    return np.ascontiguousarray(x.astype(STORAGE[dtype]))


def kvd(dtype):
    return None if dtype == "float32" else dtype


class Paged:
    """A paged copy of contiguous caches k, v [B, Hkv, Cap, D]: one aligned
    allocation per page, physical page ids shuffled.  Blocks outside ``read``
    (bool [B, M]) get no page: table entry -1, or (``nan_pages``) a page full of
    NaN bit patterns."""

    def __init__(self, rng, k, v, bs, read=None, nan_pages=False):
        B, Hkv, Cap, D = k.shape
        M = -(-Cap // bs)
        pad = ((0, 0), (0, 0), (0, M * bs - Cap), (0, 0))
        kp, vp = np.pad(k, pad), np.pad(v, pad)
        read = np.ones((B, M), bool) if read is None else read
        ids = rng.permutation(B * M)
        self.table = np.full((B, M), -1, np.int32)
        self.k_pages, self.v_pages = [None] * (B * M), [None] * (B * M)
        self.buffers = []
        for b in range(B):
            for i in range(M):
                if not read[b, i] and not (nan_pages and (b + i) % 2):
                    continue  # unallocated: -1
                pid = int(ids[b * M + i])
                self.table[b, i] = pid
                for src, pages in ((kp, self.k_pages), (vp, self.v_pages)):
                    page = self.page(k.dtype, (Hkv, bs, D))
                    page[...] = src[b, :, i * bs : (i + 1) * bs] if read[b, i] else NAN[k.dtype]
                    pages[pid] = page
        self.k_addr = np.array([0 if p is None else p.__array_interface__["data"][0] for p in self.k_pages], np.uint64)
        self.v_addr = np.array([0 if p is None else p.__array_interface__["data"][0] for p in self.v_pages], np.uint64)
        self.bs = bs

    def page(self, dtype, shape):
        buf = ALLOC.allocate(int(np.prod(shape)) * np.dtype(dtype).itemsize, 64)
        self.buffers.append(buf)
        return buf.view(dtype, shape)

    def kernel(self, q, Hkv, kv_len, q_pos, scale, softcap, window, out, dtype):
        K.paged_attention(
            q,
            self.k_addr,
            self.v_addr,
            self.table,
            self.bs,
            Hkv,
            kv_len,
            q_pos,
            scale,
            softcap,
            window,
            out,
            kv_dtype=kvd(dtype),
        )

    def twin(self, q, Hkv, kv_len, q_pos, scale, softcap, window, out, dtype):
        R.paged_attention(
            q,
            self.k_pages,
            self.v_pages,
            self.table,
            self.bs,
            Hkv,
            kv_len,
            q_pos,
            scale,
            softcap,
            window,
            out,
            kv_dtype=kvd(dtype),
        )


@functools.cache
def case(dtype, heads, D, bs, kv_len, Sq, seed, softcap, window, q_pos, skip_unread):
    """Random data, its paged copy and the twin's result; cached, so that the
    thread / SIMD variants of a test share them (hashable arguments only)."""
    Hq, Hkv = HEADS[heads] if isinstance(heads, str) else heads
    rng = np.random.default_rng(seed)
    kv_len = np.array(kv_len, np.int32)
    B, Cap = len(kv_len), max(int(kv_len.max()), 1) + 5
    q = rand(rng, (B, Hq, Sq, D))
    k = to_cache(rand(rng, (B, Hkv, Cap, D)), dtype)
    v = to_cache(rand(rng, (B, Hkv, Cap, D)), dtype)
    if q_pos is None:
        q_pos = (kv_len[:, None] - Sq + np.arange(Sq)[None, :]).astype(np.int64)
    q_pos = np.array(q_pos, np.int64)
    read = paged_blocks_read(kv_len, q_pos, window, bs, -(-Cap // bs)) if skip_unread else None
    pg = Paged(rng, k, v, bs, read, nan_pages=skip_unread)
    want = np.full_like(q, np.nan)
    pg.twin(q, Hkv, kv_len, q_pos, D**-0.5, softcap, window, want, dtype)
    return q, k, v, Hkv, kv_len, q_pos, pg, want


@pytest.fixture(scope="module", autouse=True)
def _drop_cached_cases():
    yield
    case.cache_clear()


def check_against_twin(
    dtype, heads, D, bs, kv_len, Sq, seed, softcap=0.0, window=-1, q_pos=None, skip_unread=False, tol=1e-5
):
    """Kernel vs twin vs contiguous kernel at the current thread / SIMD setting."""
    q, k, v, Hkv, kv_len, q_pos, pg, want = case(
        dtype, heads, D, bs, tuple(kv_len), Sq, seed, softcap, window, q_pos, skip_unread
    )
    scale = q.shape[-1] ** -0.5
    got, contig = np.full_like(q, np.nan), np.full_like(q, np.nan)
    pg.kernel(q, Hkv, kv_len, q_pos, scale, softcap, window, got, dtype)
    K.attention(q, k, v, kv_len, q_pos.astype(np.int32), scale, softcap, window, contig, kv_dtype=kvd(dtype))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(got, contig, rtol=tol, atol=tol)
    return got


# decode grid: every head layout, head size, block size and dtype; contexts up to 8192
DECODE = [
    ("float32", "gqa", 128, 16, 1),
    ("float32", "mha", 64, 1, 17),
    ("float32", "mqa", 80, 24, 1000),
    ("float32", "gqa", 64, 32, 8192),
    ("float32", "gqa", 80, 1, 300),
    ("float16", "gqa", 128, 16, 4100),
    ("float16", "mha", 80, 24, 333),
    ("float16", "mqa", 64, 32, 65),
    ("bfloat16", "gqa", 80, 32, 1000),
    ("bfloat16", "mqa", 128, 24, 8192),
    ("bfloat16", "mha", 64, 16, 31),
    ("float16", "gqa", 64, 1, 40),
]


@pytest.mark.parametrize("dtype,heads,D,bs,ctx", DECODE, ids=lambda x: str(x))
def test_decode(dtype, heads, D, bs, ctx, threads, simd):
    B = 1 if ctx > 4096 else 2
    kv_len = [ctx, max(1, ctx // 3)][:B]  # rows with different lengths
    check_against_twin(dtype, heads, D, bs, kv_len, 1, seed=ctx + D + bs)


@pytest.mark.parametrize(
    "dtype,bs,Sq,past",
    [("float32", 16, 7, 40), ("float16", 24, 33, 100), ("bfloat16", 1, 5, 3), ("float32", 32, 70, 0)],
)
def test_prefill_causal(dtype, bs, Sq, past, threads, simd):
    kv_len = [past + Sq, past + Sq - 2]
    out = check_against_twin(dtype, "gqa", 64, bs, kv_len, Sq, seed=Sq * 31 + bs)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("window,Sq,bs", [(0, 1, 16), (50, 1, 16), (100, 1, 24), (37, 9, 16), (64, 40, 32), (20, 3, 1)])
def test_window_skips_pages_outside(window, Sq, bs, threads, simd):
    """Blocks wholly outside every query's window are -1 or NaN pages: not read."""
    out = check_against_twin(
        "float32", "gqa", 64, bs, [1500, 777], Sq, seed=window + Sq, window=window, skip_unread=True
    )
    assert np.isfinite(out).all()


def test_window_gap_between_queries_skipped(threads, simd):
    """Queries far apart: the pages between their windows are never read."""
    q_pos = ((100, 2500, 2501), (5, 6, 1999))
    out = check_against_twin(
        "float16", "mqa", 80, 16, [2600, 2000], 3, seed=5, window=48, q_pos=q_pos, skip_unread=True
    )
    assert np.isfinite(out).all()


@pytest.mark.parametrize("softcap,Sq", [(5.0, 1), (30.0, 6)])
def test_softcap(softcap, Sq, threads, simd):
    check_against_twin("float32", "mha", 80, 24, [900, 64], Sq, seed=int(softcap), softcap=softcap)


def test_rows_without_visible_keys_give_zeros(threads, simd):
    out = check_against_twin("float32", "gqa", 64, 16, [0, 1, 700], 1, seed=3)
    assert np.all(out[0] == 0.0) and np.all(np.abs(out[2]) > 0)


@pytest.mark.parametrize("bs", [16, 24])
def test_cache_split_merge(bs, threads, simd):
    """One (batch, KV head) group: with 2 threads the cache is split at page
    boundaries and the partial states are merged."""
    check_against_twin("float32", (4, 1), 128, bs, [3000], 1, seed=bs)
    check_against_twin("float32", (2, 1), 64, bs, [5000], 4, seed=bs + 1, window=1000, skip_unread=True)


@pytest.mark.parametrize("window,Sq", [(-1, 1), (300, 1), (90, 3)])
def test_one_row_all_heads_split_across_threads(window, Sq, threads, simd):
    """B = 1, GQA: one work unit per cache chunk reads every KV head of its
    pages; with 2 threads the chunks' states are merged per head."""
    out = check_against_twin(
        "float32", "gqa", 128, 16, [5000], Sq, seed=window + 7, window=window, softcap=20.0, skip_unread=window >= 0
    )
    assert np.isfinite(out).all()


def test_many_split_chunks_merged_in_parallel():
    """The private split switch (several cache chunks per thread) on a prefill
    of 16 tokens: per-head units, a partial state large enough for the merge to
    run on the whole team."""
    A = sys.modules["onnxkv._kernels.attention"]
    old, old_threads = A._set_split_tasks(8), K.get_num_threads()
    try:
        K.set_num_threads(2)
        check_against_twin("float16", (32, 2), 128, 16, [8192], 16, seed=3)
    finally:
        A._set_split_tasks(old)
        K.set_num_threads(old_threads)


@pytest.mark.parametrize("heads_per_unit", [1, 2, 3, 0])
def test_heads_per_unit_switch_keeps_results(heads_per_unit, threads):
    """The private switch for the KV heads of a paged decode work unit (0: all;
    3 -> 2, the largest divisor of 8 below) changes the schedule only."""
    A = sys.modules["onnxkv._kernels.attention"]
    old = A._set_paged_heads(heads_per_unit)
    try:
        check_against_twin("bfloat16", "gqa", 64, 24, [3000], 1, seed=9, window=700, skip_unread=True)
    finally:
        A._set_paged_heads(old)


def test_kv_len_and_q_pos_int32_or_int64():
    rng = np.random.default_rng(11)
    q = rand(rng, (2, 32, 2, 64))
    k = rand(rng, (2, 8, 105, 64))
    v = rand(rng, (2, 8, 105, 64))
    pg = Paged(rng, k, v, 16)
    kl = np.array([100, 50], np.int32)
    qp = np.array([[98, 99], [48, 49]], np.int32)
    a, bb = np.empty_like(q), np.empty_like(q)
    pg.kernel(q, 8, kl, qp, 0.125, 0.0, -1, a, "float32")
    pg.kernel(q, 8, kl.astype(np.int64), qp.astype(np.int64), 0.125, 0.0, -1, bb, "float32")
    np.testing.assert_array_equal(a, bb)


# ---------------------------------------------------------------- errors


def _bad_cases():
    rng = np.random.default_rng(0)
    B, Hq, Hkv, Sq, D, bs = 2, 4, 2, 2, 8, 4
    q = rand(rng, (B, Hq, Sq, D))
    k = rand(rng, (B, Hkv, 16, D))
    pg = Paged(rng, k, rand(rng, (B, Hkv, 16, D)), bs)
    kl = np.array([9, 16], np.int32)
    qp = np.array([[7, 8], [14, 15]], np.int64)
    ok = dict(
        q=q,
        k_pages=pg.k_addr,
        v_pages=pg.v_addr,
        block_tables=pg.table,
        block_size=bs,
        kv_heads=Hkv,
        kv_len=kl,
        q_pos=qp,
        scale=0.3,
        softcap=0.0,
        window=-1,
    )
    t = pg.table.copy()
    t[1, 2] = 8  # out of range id
    yield "block_tables", ValueError, dict(ok, block_tables=t)
    t = pg.table.copy()
    t[0, 0] = -1  # visible keys live in block 0 of row 0
    yield "block_tables", ValueError, dict(ok, block_tables=t)
    kz = pg.k_addr.copy()
    kz[pg.table[1, 0]] = 0
    yield "k_pages", ValueError, dict(ok, k_pages=kz)
    vz = pg.v_addr.copy()
    vz[pg.table[0, 2]] += 8  # misaligned page
    yield "v_pages", ValueError, dict(ok, v_pages=vz)
    yield "v_pages", ValueError, dict(ok, v_pages=pg.v_addr[:-1].copy())
    yield "k_pages", ValueError, dict(ok, k_pages=pg.k_addr.astype(np.int64))
    yield "block_tables", ValueError, dict(ok, block_tables=pg.table.astype(np.int64))
    yield "block_tables", ValueError, dict(ok, block_tables=pg.table[:1].copy())
    yield "block_size", ValueError, dict(ok, block_size=0)
    yield "block_size", TypeError, dict(ok, block_size=4.0)
    yield "kv_heads", ValueError, dict(ok, kv_heads=3)
    yield "kv_heads", TypeError, dict(ok, kv_heads="2")
    yield "kv_len", ValueError, dict(ok, kv_len=np.array([9, 17], np.int32))  # beyond M*bs
    yield "kv_len", ValueError, dict(ok, kv_len=kl.astype(np.float32))
    yield "q_pos", ValueError, dict(ok, q_pos=qp[:, :1].copy())
    yield "q_pos", ValueError, dict(ok, q_pos=qp + (1 << 40))
    yield "q", ValueError, dict(ok, q=q.astype(np.float64))
    yield "kv_dtype", ValueError, dict(ok, kv_dtype="int8")
    yield "window", ValueError, dict(ok, window=-3)


CASES = list(_bad_cases())


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"{CASES[i][0]}-{i}")
def test_bad_arguments_raise_before_writing(case):
    name, exc, kw = CASES[case]
    out = np.full((2, 4, 2, 8), 42.0, np.float32)
    with pytest.raises(exc, match=name):
        K.paged_attention(out=out, **kw)
    assert np.all(out == 42.0)


def test_bad_table_message_names_row_and_entry():
    name, exc, kw = CASES[1]
    with pytest.raises(ValueError, match=r"row 0, block 0 .* entry is -1"):
        K.paged_attention(out=np.empty((2, 4, 2, 8), np.float32), **kw)


def test_window_makes_minus_one_entries_legal():
    """The -1 entry of CASES[1] (block 0 of row 0: keys 0..3) is fine once a
    window hides it from both queries of row 0 (positions 7, 8; window 2)."""
    _, _, kw = CASES[1]
    out = np.full((2, 4, 2, 8), np.nan, np.float32)
    K.paged_attention(out=out, **dict(kw, window=2))
    assert np.isfinite(out).all()


def test_out_overlapping_q_rejected():
    _, _, kw = CASES[0]
    kw = dict(kw, block_tables=np.zeros((2, 4), np.int32))
    with pytest.raises(ValueError, match="out"):
        K.paged_attention(out=kw["q"], **kw)


# ---------------------------------------------------------------- hostile tables, lengths and positions

#: Integers at the limits of the widths a table entry, length or position may come in.
EDGES = (-(2**63), -(2**31) - 1, -(2**31), -1, 2**31 - 1, 2**31, 2**32 + 4, 2**62 + 1, 2**63 - 1)


def _hostile_ints(rng, shape, lo, hi, rate):
    """Ints in [lo, hi], a fraction ``rate`` replaced by an edge of some width (or just past the range)."""
    values = rng.integers(lo, hi + 1, shape).astype(object)
    edges = np.array(EDGES + (lo - 1, hi + 1), object)
    pick = rng.random(shape) < rate
    values[pick] = rng.choice(edges, int(pick.sum()))
    return values


def _as(values, dtype):
    """``values`` (object ints) as ``dtype``, or None when one does not fit it (the call is then skipped)."""
    info = np.iinfo(dtype)
    flat = [int(x) for x in np.asarray(values, object).reshape(-1)]
    if any(not info.min <= x <= info.max for x in flat):
        return None
    return np.array(flat, dtype).reshape(np.shape(values))


def _hostile_paged_call(rng):
    """Keyword arguments of a random paged_attention call (often hostile) and whether its contract accepts it,
    decided from the arguments alone in Python ints."""
    B, Hkv, group, Sq, D = (
        int(rng.integers(1, 4)),
        int(rng.integers(1, 3)),
        int(rng.integers(1, 3)),
        int(rng.integers(1, 4)),
        8,
    )
    bs, M, P = int(rng.choice([1, 2, 4])), int(rng.integers(1, 5)), int(rng.integers(1, 8))
    pages = [[ALLOC.allocate(Hkv * bs * D * 4, 64).view(np.float32, (Hkv, bs, D)) for _ in range(P)] for _ in range(2)]
    for plane in pages:
        for page in plane:
            page[...] = rng.standard_normal(page.shape)
    rate = float(rng.choice([0.0, 0.1, 0.3]))  # a third of the calls keep to the contract's ranges
    table = _hostile_ints(rng, (B, M), 0, P - 1, rate)
    kv_len = _hostile_ints(rng, (B,), 0, M * bs, rate)
    q_pos = _hostile_ints(rng, (B, Sq), -1, M * bs, rate)
    window = int(rng.choice([-1, -1, 0, 1, 3, 2**62, 2**62 + 1] if rate else [-1, 0, 1, 3, 2**62]))
    table_dtype = np.int64 if rate and rng.random() < 0.1 else np.int32
    len_dtype, pos_dtype = (
        rng.choice([np.int32, np.int64, np.uint32] if rate else [np.int32, np.int64]) for _ in range(2)
    )
    args = dict(
        q=rand(rng, (B, Hkv * group, Sq, D)),
        block_tables=_as(table, table_dtype),
        kv_len=_as(kv_len, len_dtype),
        q_pos=_as(q_pos, pos_dtype),
        window=window,
        block_size=bs,
        kv_heads=Hkv,
        scale=D**-0.5,
        softcap=0.0,
    )
    if any(args[name] is None for name in ("block_tables", "kv_len", "q_pos")):
        return None
    lens, pos = [int(x) for x in kv_len], [[int(x) for x in row] for row in q_pos]
    ok = (
        table_dtype == np.int32
        and len_dtype != np.uint32
        and pos_dtype != np.uint32
        and all(0 <= n <= min(M * bs, 2**31 - 1) for n in lens)
        and all(-(2**31) <= p < 2**31 for row in pos for p in row)
        and window <= 2**62
    )
    if ok:  # every block a query sees holds a page id (the rule, one token at a time)
        for b in range(B):
            for p in pos[b]:
                lo, hi = (max(p - window, 0) if window >= 0 else 0), min(p + 1, lens[b])
                for i in range(lo // bs, (hi - 1) // bs + 1) if lo < hi else ():
                    ok = ok and 0 <= int(table[b, i]) < P
    return args, pages, ok


def test_hostile_tables_lengths_and_positions_are_refused_or_match_the_twin(simd):
    """Random calls with entries, lengths, positions and windows at the limits of their widths: a call the
    contract accepts equals the twin, any other raises and leaves ``out`` alone (pages are never written)."""
    accepted = refused = 0
    for it in range(examples(60)):
        rng = np.random.default_rng([23, it])
        drawn = _hostile_paged_call(rng)
        if drawn is None:
            continue
        args, pages, ok = drawn
        addrs = [np.array([p.__array_interface__["data"][0] for p in plane], np.uint64) for plane in pages]
        out = np.full(args["q"].shape, 42.0, np.float32)
        where = f"case [23, {it}] (valid: {ok}): {args}"
        if not ok:
            with pytest.raises((ValueError, TypeError)):
                K.paged_attention(k_pages=addrs[0], v_pages=addrs[1], out=out, **args)
            assert np.all(out == 42.0), where
            refused += 1
            continue
        K.paged_attention(k_pages=addrs[0], v_pages=addrs[1], out=out, **args)
        want = np.full_like(out, np.nan)
        R.paged_attention(k_pages=pages[0], v_pages=pages[1], out=want, **args)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=where)
        accepted += 1
    assert accepted >= examples(60) // 10 and refused >= examples(60) // 10
