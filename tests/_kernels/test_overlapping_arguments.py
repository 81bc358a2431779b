"""Kernels refuse an ``out`` that overlaps an argument they read while they write it (positions, lengths,
tables, page addresses), and arguments of the wrong kind, before anything is written.  Found by a fuzzing
helper: with ``out`` over ``positions`` or ``block_tables`` the first rows written rewrote the indices the
later rows read (segfaults); ``copy_rows`` copied object pointers without references."""

from __future__ import annotations

import numpy as np
import pytest

from onnxkv import _kernels as K
from onnxkv._kernels import qmatmul as KQ
from onnxkv._kernels import sampling as KS

B, H, D, BS = 2, 1, 16, 4


def _aligned(n: int, dtype) -> np.ndarray:
    raw = np.zeros(n * np.dtype(dtype).itemsize + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off : off + n * np.dtype(dtype).itemsize].view(dtype)


def _inside(out: np.ndarray, dtype, shape, values) -> np.ndarray:
    """An array of ``dtype`` and ``shape`` over the first bytes of ``out``, holding ``values``."""
    n = int(np.prod(shape))
    view = out.reshape(-1).view(np.uint8)[: n * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
    view[...] = values
    return view


def _pages(n: int):
    pages = [_aligned(H * BS * D, np.float32) for _ in range(2 * n)]
    for p in pages:
        p[:] = 1.0
    k = np.array([p.ctypes.data for p in pages[:n]], np.uint64)
    v = np.array([p.ctypes.data for p in pages[n:]], np.uint64)
    return pages, k, v


def test_rotary_refuses_out_over_its_positions():
    x = np.ones((1, 2, 1, D), np.float32)
    cos, sin = np.ones((4, D // 2), np.float32), np.zeros((4, D // 2), np.float32)
    out = np.zeros_like(x)
    positions = _inside(out, np.int64, (1, 2), [[0, 1]])
    with pytest.raises(ValueError, match="out: must not overlap positions"):
        K.rotary_embedding(x, cos, sin, positions, False, out)
    assert positions.tolist() == [[0, 1]]


@pytest.mark.parametrize("what", ["kv_len", "q_pos", "kv_start"])
def test_attention_refuses_out_over_its_lengths_and_positions(what):
    q, k = np.ones((B, H, 1, D), np.float32), np.ones((B, H, BS, D), np.float32)
    out = np.zeros_like(q)
    args = {"kv_len": np.full(B, BS, np.int32), "q_pos": np.full((B, 1), BS - 1, np.int32), "kv_start": None}
    args[what] = _inside(out, np.int32, (B,) if what != "q_pos" else (B, 1), BS - 1 if what == "q_pos" else 0)
    if what == "kv_len":
        args[what][...] = BS
    with pytest.raises(ValueError, match=f"out: must not overlap {what}"):
        K.attention(q, k, k, args["kv_len"], args["q_pos"], 0.1, 0.0, -1, out, kv_start=args["kv_start"])


@pytest.mark.parametrize("what", ["block_tables", "kv_len", "q_pos", "kv_start", "k_pages"])
def test_paged_attention_refuses_out_over_what_it_reads(what):
    keep, k_pages, v_pages = _pages(1)
    q = np.ones((B, H, 1, D), np.float32)
    out = np.zeros_like(q)
    args = {
        "block_tables": np.zeros((B, 1), np.int32),
        "kv_len": np.full(B, BS, np.int32),
        "q_pos": np.full((B, 1), BS - 1, np.int32),
        "kv_start": None,
        "k_pages": k_pages,
    }
    if what == "k_pages":
        args[what] = _inside(out, np.uint64, (1,), k_pages)
    else:
        shape = (B, 1) if what in ("block_tables", "q_pos") else (B,)
        args[what] = _inside(out, np.int32, shape, {"kv_len": BS, "q_pos": BS - 1}.get(what, 0))
    with pytest.raises(ValueError, match=f"out: must not overlap {what}"):
        K.paged_attention(q, args["k_pages"], v_pages, args["block_tables"], BS, H, args["kv_len"], args["q_pos"],
                          0.1, 0.0, -1, out, kv_start=args["kv_start"])  # fmt: skip
    assert keep


@pytest.mark.parametrize("what", ["pos", "block_tables", "cos"])
def test_fused_paged_decode_declines_out_over_what_it_reads(what):
    """decode_token_paged returns None (nothing written) and the unfused calls' checks name the argument."""
    keep, k_pages, v_pages = _pages(4)
    q = np.ones((B, 1, H * D), np.float32)
    out = np.zeros_like(q)
    pos, tables = np.array([0, 1], np.int32), np.array([[0, 1], [2, 3]], np.int32)
    cos, sin = np.ones((8, D // 2), np.float32), np.zeros((8, D // 2), np.float32)
    if what == "pos":
        pos = _inside(out, np.int32, (B,), [0, 1])
    elif what == "block_tables":
        tables = _inside(out, np.int32, (B, 2), [[0, 1], [2, 3]])
    else:
        cos = _inside(out, np.float32, (1, D // 2), 1.0)
        sin = np.zeros_like(cos)
    before = [p.copy() for p in keep]
    got = K.decode_token_paged(q, q, q, cos, sin, False, k_pages, v_pages, tables, BS, H, pos, 0.1, 0.0, -1, out)
    assert got is None
    for p, b in zip(keep, before, strict=True):
        np.testing.assert_array_equal(p, b)


def test_copy_rows_refuses_arrays_of_object_references():
    base = np.array([[str(i) * 20] for i in range(64)], dtype=object).reshape(8, 8)
    with pytest.raises(ValueError, match="x: expected a numpy.ndarray of numbers or booleans, got object"):
        K.copy_rows(base[2:6], np.empty((4, 8), dtype=object))
    record = np.zeros(8, dtype=[("a", "f4"), ("b", "O")])
    with pytest.raises(ValueError, match="numbers or booleans"):
        K.copy_rows(record[::2], np.zeros(4, dtype=record.dtype))


def test_sampling_and_integer_arguments_of_the_wrong_kind_are_refused():
    rng = np.random.default_rng(0)
    buf = np.zeros((3, 8))
    u = buf[1, :3]
    u[...] = [0.1, 0.5, 0.9]
    with pytest.raises(ValueError, match="probs: must not overlap u"):
        KS.sample(rng.standard_normal((3, 8)), 1.0, None, None, u, buf)
    for kw, match in (({"temperature": True}, "temperature"), ({"top_k": True}, "top_k"), ({"top_k": 2.5}, "top_k")):
        args = {"temperature": 1.0, "top_k": None, **kw}
        with pytest.raises(ValueError, match=match):
            KS.sample(np.zeros((1, 4)), args["temperature"], args["top_k"], None, np.array([0.5]))
    q, k = np.ones((1, 1, 1, 8), np.float32), np.ones((1, 1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="window: expected an int, got bool"):
        K.attention(q, k, k, np.array([4], np.int32), np.array([[3]], np.int32), 0.1, 0.0, True, np.empty_like(q))
    a = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match="axis must be an int, got 1.9"):
        K.concat_pair(a, a, np.empty((2, 4), np.float32), 1.9)
    w = K.pack_nbits(np.zeros((16, 1, 8), np.uint8), np.ones(16, np.float32), None, 16, 16, 4, 16)
    for p0, p1 in ((0, True), (0.0, 1), (0, 1.5)):
        with pytest.raises(ValueError, match="p0, p1: expected ints"):
            KQ.dequantize_nbits(w, p0, p1)
    with pytest.raises(ValueError, match=r"B: expected 73786976294838206464 bytes \(\[N=16, 576460752303423488 blocks"):
        K.pack_nbits(np.zeros((16, 1, 8), np.uint8), np.ones(16, np.float32), None, 2**63 - 1, 16, 4, 16)
