"""page_write: scatter new tokens into pages by address, vs the NumPy twin."""
import numpy as np
import pytest

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
