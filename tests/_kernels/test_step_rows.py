"""A recorded decode-token call over B rows of a batch (``_record.KIND_DECODE_TOKEN``, B > 1).

The replay reads each row's position from seqlens_k, equals ``decode_token`` on the same rows bit for bit
(rows of different lengths, one token each; rows of one length, several tokens), writes the positions it
appended, keeps the committed bytes a row below the caches' committed length writes over (a right-padded
row rewriting its padding), and refuses -- nothing written -- any row past its committed length, past the
capacity or the rotary tables, a total that is not the longest row's end, and rows of different lengths
with several tokens.  Program refuses position, length, undo and cache operands of another type or shape
than B gives.
"""

import numpy as np
import pytest
from onnxkv._kernels._record import DECODE_CACHE_TYPES, DECODE_TOKEN
from onnxkv._kernels.step import Program

from onnxkv._kernels import decode_token

from .conftest import rand

HQ, HKV, D, CAP, ROWS = 4, 2, 16, 14, 12


def _call(rng, b, n, packed=False):
    """A B-row decode call's operands (the order of _record.pxd) and its arrays by name."""
    if packed:
        qkv = rand(rng, (b, n, (HQ + 2 * HKV) * D))
        q, k, v = qkv[..., : HQ * D], qkv[..., HQ * D : (HQ + HKV) * D], qkv[..., (HQ + HKV) * D :]
        spans = [np.lib.stride_tricks.as_strided(x, shape=((b * n - 1) * qkv.shape[2] + x.shape[2],),
                                                 strides=(4,)) for x in (q, k, v)]  # fmt: skip
        strides = [qkv.shape[2]] * 3
    else:
        q, k, v = (rand(rng, (b, n, w)) for w in (HQ * D, HKV * D, HKV * D))
        spans, strides = [q, k, v], [HQ * D, HKV * D, HKV * D]
    cos, sin = rand(rng, (ROWS, D // 2)), rand(rng, (ROWS, D // 2))
    kc, vc = rand(rng, (b, HKV, CAP, D)), rand(rng, (b, HKV, CAP, D))
    seq, total = np.zeros(b, np.int32), np.zeros(1, np.int32)
    out, io = np.empty((b, n, HQ * D), np.float32), np.zeros((2, b), np.int64)
    undo = np.full((2, b, HKV, n, D), np.nan, np.float32)
    ints = (HQ, HKV, CAP, D, D // 2, 0, -1, ROWS, n, *strides, 0, DECODE_CACHE_TYPES["float32"], b)
    call = (DECODE_TOKEN, (*spans, cos, sin, kc, vc, seq, total, out, io, undo), ints, (D**-0.5, 0.0))
    return call, dict(q=q, k=k, v=v, cos=cos, sin=sin, kc=kc, vc=vc, seq=seq, total=total, out=out, io=io, undo=undo)


def _set(a, pos, n, total=None):
    pos = np.asarray(pos, np.int64)
    a["seq"][:] = pos + n - 1
    a["total"][0] = int(pos.max()) + n if total is None else total
    a["io"][0] = pos


@pytest.mark.parametrize("b, n", [(2, 1), (3, 1), (5, 1), (3, 2)])
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_a_rows_replay_reads_their_positions_and_equals_the_kernel(b, n, packed, simd, threads):
    rng = np.random.default_rng([b, n, packed])
    call, a = _call(rng, b, n, packed)
    program = Program([call], [a["kc"], a["vc"]])
    for _ in range(3):
        pos = np.full(b, rng.integers(1, ROWS - n)) if n > 1 else rng.integers(0, ROWS - n + 1, b)
        pos[0] = max(pos[0], 1)
        _set(a, pos, n)
        kc, vc = a["kc"].copy(), a["vc"].copy()  # new cache buffers of the same shape: externals
        a["q"][...] = rand(rng, a["q"].shape)
        wk, wv, want = kc.copy(), vc.copy(), np.empty_like(a["out"])
        assert decode_token(a["q"], a["k"], a["v"], a["cos"], a["sin"], False, wk, wv, pos.astype(np.int64),
                            D**-0.5, 0.0, -1, want)  # fmt: skip
        assert program.run([kc, vc])
        np.testing.assert_array_equal(a["out"], want)
        np.testing.assert_array_equal(kc, wk)
        np.testing.assert_array_equal(vc, wv)
        assert a["io"][1].tolist() == pos.tolist()


def test_a_rows_replay_refuses_positions_it_cannot_take():
    call, a = _call(np.random.default_rng(3), 3, 1)
    program = Program([call], [a["kc"], a["vc"]])
    for pos, committed, total in (
        ([4, 2, 7], [4, 1, 7], None),  # a row past its committed length
        ([4, 2, 7], [4, 2, 7], 7),  # total not the longest row's end
        ([4, 2, 7], [4, 2, 7], 9),
        ([4, 2, 14], [4, 2, 14], None),  # past the capacity
        ([4, 2, 12], [4, 2, 12], None),  # past the rotary tables (12 rows)
        ([0, 0, 0], [0, 0, 0], None),  # every row empty: a first prompt
        ([4, -1, 7], [4, -1, 7], None),
    ):
        _set(a, pos, 1, total)
        a["io"][0] = committed
        a["io"][1] = -7
        kc, vc, out = a["kc"].copy(), a["vc"].copy(), a["out"].copy()
        assert not program.run([a["kc"], a["vc"]]), pos
        np.testing.assert_array_equal(a["kc"], kc)
        np.testing.assert_array_equal(a["vc"], vc)
        np.testing.assert_array_equal(a["out"], out)
        assert (a["io"][1] == -7).all()


@pytest.mark.parametrize("n", [1, 2])
def test_rows_below_the_committed_length_keep_the_bytes_they_write_over(n):
    """Rows written below the caches' committed length (the longest row's): each copies the committed
    positions it replaces (up to that length) into the undo operand before writing, K then V; rows at or past
    it copy nothing.  The writes and output equal ``decode_token``'s."""
    rng = np.random.default_rng(n)
    b = 4 if n == 1 else 2
    call, a = _call(rng, b, n)
    program = Program([call], [a["kc"], a["vc"]])
    committed = np.array([7, 7, 7, 9][:b] if n == 1 else [8, 8])
    pos = np.array([3, 6, 7, 9][:b] if n == 1 else [7, 7])  # rows 0, 1 (and the second of n = 2) rewrite
    _set(a, pos, n)
    a["io"][0] = committed
    kc, vc = a["kc"].copy(), a["vc"].copy()
    wk, wv, want = kc.copy(), vc.copy(), np.empty_like(a["out"])
    assert decode_token(a["q"], a["k"], a["v"], a["cos"], a["sin"], False, wk, wv, pos, D**-0.5, 0.0, -1, want)
    a["undo"][...] = np.nan
    assert program.run([kc, vc])
    np.testing.assert_array_equal(a["out"], want)
    np.testing.assert_array_equal(kc, wk)
    np.testing.assert_array_equal(vc, wv)
    assert a["io"][1].tolist() == pos.tolist()
    held = int(committed.max())
    for row in range(b):
        kept = max(0, min(n, held - int(pos[row])))
        for plane, old in enumerate((a["kc"], a["vc"])):
            np.testing.assert_array_equal(a["undo"][plane, row, :, :kept], old[row, :, pos[row] : pos[row] + kept])
            assert np.isnan(a["undo"][plane, row, :, kept:]).all()


def test_several_tokens_of_rows_of_different_lengths_are_refused():
    call, a = _call(np.random.default_rng(4), 2, 2)
    program = Program([call], [a["kc"], a["vc"]])
    _set(a, [3, 5], 2)
    kc = a["kc"].copy()
    assert not program.run([a["kc"], a["vc"]])
    np.testing.assert_array_equal(a["kc"], kc)
    _set(a, [5, 5], 2)
    assert program.run([a["kc"], a["vc"]])


@pytest.mark.parametrize(
    "operand, bad",
    [
        (7, np.zeros(2, np.int32)),  # seqlens of fewer rows
        (7, np.zeros(3, np.int64)),  # of another width
        (10, np.zeros((2, 2), np.int64)),  # positions of fewer rows
        (10, np.zeros(6, np.int64)),  # flat
        (9, np.empty((2, 1, HQ * D), np.float32)),  # out of fewer rows
        (5, rand(np.random.default_rng(0), (2, HKV, CAP, D))),  # caches of fewer rows
        (11, np.empty((2, 2, HKV, 1, D), np.float32)),  # undo of fewer rows
    ],
)
def test_operands_that_do_not_fit_the_rows_are_refused(operand, bad):
    call, a = _call(np.random.default_rng(5), 3, 1)
    arrays = list(call[1])
    arrays[operand] = bad
    with pytest.raises(ValueError, match="shapes or integer types"):
        Program([(call[0], tuple(arrays), call[2], call[3])], [])


def test_an_undo_operand_of_another_type_than_the_caches_is_refused():
    call, a = _call(np.random.default_rng(6), 3, 1)
    arrays = list(call[1])
    arrays[11] = np.empty((2, 3, HKV, 1, D), np.float16)
    with pytest.raises(ValueError, match="token and cache types"):
        Program([(call[0], tuple(arrays), call[2], call[3])], [])
