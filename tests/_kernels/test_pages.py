"""page_write: scatter new tokens into pages by address, vs the NumPy twin."""

import numpy as np
import pytest
from fuzzing import examples

import onnxkv._kernels as K
from onnxkv._kernels import reference as R


def _pages(rng, n, h, bs, d, dtype):
    pages = [rng.standard_normal((h, bs, d)).astype(dtype) for _ in range(n)]
    addr = np.array([p.__array_interface__["data"][0] for p in pages], np.uint64)
    return pages, addr


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint16])
@pytest.mark.parametrize("bs,S", [(1, 1), (4, 1), (4, 9), (16, 5), (24, 30)])
def test_page_write_matches_twin(dtype, bs, S):
    rng = np.random.default_rng([bs, S])
    B, H, D = 3, 2, 8
    M = (40 + S) // bs + 1
    pages, addr = _pages(rng, B * M, H, bs, D, np.float32)
    pages = [p.astype(dtype) if dtype != np.uint16 else (p * 1000).astype(np.uint16) for p in pages]
    addr = np.array([p.__array_interface__["data"][0] for p in pages], np.uint64)
    tables = rng.permutation(B * M).astype(np.int32).reshape(B, M)
    starts = rng.integers(0, 40, B)
    new = (rng.standard_normal((B, H, S, D)) * 100).astype(dtype)
    want = [p.copy() for p in pages]
    R.page_write(new, want, tables, starts, bs)
    K.page_write(new, addr, tables, starts, bs)
    for got, exp in zip(pages, want):
        np.testing.assert_array_equal(got, exp)


def test_page_write_checks_before_writing():
    rng = np.random.default_rng(0)
    pages, addr = _pages(rng, 4, 2, 4, 8, np.float32)
    before = [p.copy() for p in pages]
    new = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    tables = np.array([[0, 1, -1, 3]], np.int32)
    with pytest.raises(ValueError, match="tables"):
        K.page_write(new, addr, tables, np.array([6]), 4)  # block 2 is -1
    bad = addr.copy()
    bad[1] = 0
    with pytest.raises(ValueError, match="nonzero address"):
        K.page_write(new, bad, tables, np.array([3]), 4)
    with pytest.raises(ValueError, match="starts"):
        K.page_write(new, addr, tables, np.array([14]), 4)
    with pytest.raises(ValueError, match="C-contiguous"):
        K.page_write(new[:, :, ::2], addr, tables, np.array([0]), 4)
    for p, b in zip(pages, before):
        np.testing.assert_array_equal(p, b)


@pytest.mark.parametrize(
    "starts, message",
    [
        # 2**63 - 1 + 1 wrapped negative, passed the fit check and failed with IndexError
        (
            np.array([2**63 - 1], np.int64),
            "starts: row 0 = 9223372036854775807 does not fit 1 new tokens in 4 blocks of 4 tokens (expected [0, 15])",
        ),
        (
            np.array([2**64 - 1], np.uint64),
            "starts: row 0 = 18446744073709551615 does not fit 1 new tokens in 4 blocks of 4 tokens (expected [0, 15])",
        ),
        (
            np.array([-(2**63)], np.int64),
            "starts: row 0 = -9223372036854775808 does not fit 1 new tokens in 4 blocks of 4 tokens (expected [0, 15])",
        ),
        (np.array([1.5]), "starts: expected an integer array of shape (1,), got float64 (1,)"),  # was truncated to 1
        ([1], "starts: expected an integer array of shape (1,), got list"),
    ],
    ids=["int64-max", "uint64-max", "int64-min", "float", "list"],
)
def test_page_write_checks_starts_in_their_own_width(starts, message):
    rng = np.random.default_rng(1)
    pages, addr = _pages(rng, 4, 2, 4, 8, np.float32)
    before = [p.copy() for p in pages]
    new = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
    with pytest.raises(ValueError) as err:
        K.page_write(new, addr, np.array([[0, 1, 2, 3]], np.int32), starts, 4)
    assert str(err.value) == message
    for p, b in zip(pages, before):
        np.testing.assert_array_equal(p, b)


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int32, np.uint64])
def test_page_write_takes_starts_of_any_integer_width(dtype, simd):
    rng = np.random.default_rng(2)
    pages, addr = _pages(rng, 6, 2, 4, 8, np.float32)
    tables = np.array([[5, 0, 3], [1, 4, 2]], np.int32)
    starts = np.array([3, 7], dtype)
    new = rng.standard_normal((2, 2, 4, 8)).astype(np.float32)
    want = [p.copy() for p in pages]
    R.page_write(new, want, tables, starts, 4)
    K.page_write(new, addr, tables, starts, 4)
    for got, exp in zip(pages, want):
        np.testing.assert_array_equal(got, exp)


def test_page_write_names_the_block_of_a_bad_entry():
    rng = np.random.default_rng(3)
    pages, addr = _pages(rng, 4, 2, 4, 8, np.float32)
    new = rng.standard_normal((2, 2, 3, 8)).astype(np.float32)
    tables = np.array([[0, 1, 3, 3], [2, 2**31 - 1, 0, 0]], np.int32)
    with pytest.raises(
        ValueError,
        match=r"^tables: row 1, block 1 is written but holds 2147483647 \(expected a page "
        r"id in \[0, 4\) with a nonzero address\)$",
    ):
        K.page_write(new, addr, tables, np.array([1, 2], np.int64), 4)


def test_hostile_tables_and_starts_are_refused_or_match_the_twin(simd):
    """Random writes with table entries and starts at the limits of their widths (every integer dtype of
    starts): a write the contract accepts equals the twin, any other raises and writes no page."""
    edges = np.array([-(2**63), -(2**31), -1, 2**31 - 1, 2**31, 2**32 + 4, 2**63 - 1, 2**64 - 1], object)
    accepted = refused = 0
    for it in range(examples(60)):
        rng = np.random.default_rng([29, it])
        B, H, S, D, bs, M, P = (
            int(rng.integers(lo, hi)) for lo, hi in ((1, 4), (1, 3), (0, 6), (1, 5), (1, 5), (1, 5), (1, 9))
        )
        pages, addr = _pages(rng, P, H, bs, D, np.float32)
        rate = float(rng.choice([0.0, 0.2]))
        table = rng.integers(0, P, (B, M)).astype(object)
        starts = rng.integers(0, max(M * bs - S, 0) + 1, B).astype(object)
        for values in (table, starts):
            pick = rng.random(values.shape) < rate
            values[pick] = rng.choice(edges, int(pick.sum()))
        dtype = np.dtype(rng.choice([np.int8, np.uint16, np.int32, np.int64, np.uint64]))
        info = np.iinfo(dtype)
        if any(not -(2**31) <= int(x) < 2**31 for x in table.reshape(-1)) or any(
            not info.min <= int(x) <= info.max for x in starts
        ):
            continue
        tables, st = table.astype(np.int32), starts.astype(dtype)
        # distinct pages per written slot keep the twin's result independent of the write order
        written = [(b, (int(s) + t) // bs) for b, s in enumerate(starts) for t in range(S)]
        ok = all(0 <= int(s) <= M * bs - S for s in starts) or not S
        ok = ok and all(0 <= int(table[b, i]) < P for b, i in written)
        if ok and len({int(table[b, i]) for b, i in set(written)}) != len(set(written)):
            continue
        new = rng.standard_normal((B, H, S, D)).astype(np.float32)
        want = [p.copy() for p in pages]
        where = f"case [29, {it}] (valid: {ok}): starts {starts.tolist()} {dtype}, table {table.tolist()}"
        if ok:
            K.page_write(new, addr, tables, st, bs)
            R.page_write(new, want, tables, st, bs)
            accepted += 1
        else:
            with pytest.raises(ValueError):
                K.page_write(new, addr, tables, st, bs)
            refused += 1
        for got, exp in zip(pages, want):
            np.testing.assert_array_equal(got, exp, err_msg=where)
    assert accepted >= examples(60) // 10 and refused >= examples(60) // 10
