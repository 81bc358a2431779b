"""A recorded paged decode call (``_record.KIND_DECODE_PAGED``) replayed by a Program: bit for bit
``decode_token_paged`` (output and every page) at every SIMD level and thread count, with page addresses and
block tables taken as ragged externals (the pool and the tables grow); values it cannot take, a position past
the pages the run staged among them, are refused before anything is written; the compiled generation loop
runs it step after step up to the staged end."""

from __future__ import annotations

import numpy as np
import pytest
from fuzzing import examples
from onnxkv._kernels._record import DECODE_CACHE_TYPES, DECODE_PAGED, MASK_LENGTHS
from onnxkv._kernels.step import Program
from onnxkv._kernels.token_loop import DONE, REFUSED, decode_steps

import onnxkv._kernels as K

from .test_decode_token_paged import BS, _case, _restore, _snapshot

HQ, HKV, D, CAP, ROWS = 4, 2, 16, 64, 60


class PagedCall:
    """One recorded paged decode call over :class:`Paged` caches of ``len(pos)`` rows: the operands in the
    order of ``_record.pxd``; the address table stacks K (plane 0) and V (plane 1) addresses."""

    def __init__(self, rng, pos, rot=True, packed=False, n=1, tokens=np.float32, kv_dtype=None):
        pos = np.asarray(pos, np.int32)
        self.pos, self.n, self.kv_dtype = pos, n, kv_dtype
        self.pg, self.q, self.k, self.v, self.cos, self.sin = _case(
            rng, HQ, HKV, D, pos, D // 2 if rot else 0, packed, n=n, tokens=tokens, kv_dtype=kv_dtype
        )
        if rot:
            self.cos, self.sin = self.cos[:ROWS].copy(), self.sin[:ROWS].copy()
        b = len(pos)
        # seqlens_k: each row's last new position; total: past every row's
        self.seq, self.total = pos + np.int32(n - 1), np.array([pos.max() + n], np.int32)
        self.lengths = np.stack([pos, pos + n]).astype(np.int64)  # committed, staged end
        self.out = np.full((b, n, HQ * D), np.nan, tokens)
        strides = [x.strides[1 if n > 1 else 0] // x.itemsize for x in (self.q, self.k, self.v)]
        spans = [x if x.flags.c_contiguous else self._span(x) for x in (self.q, self.k, self.v)]
        half, rows = (D // 2, ROWS) if rot else (0, 0)
        self.addresses = np.stack([self.pg.k_addr, self.pg.v_addr])
        arrays = (*spans, self.cos, self.sin, self.addresses, self.pg.table, self.seq, self.total, self.out,
                  self.lengths)  # fmt: skip
        ints = (HQ, HKV, D, BS, half, 0, -1, rows, b, 0, 1, *strides, 0, 0, n, int(tokens == np.float16))
        ints += (DECODE_CACHE_TYPES[kv_dtype or "float32"],)
        self.call = (DECODE_PAGED, arrays, ints, (D**-0.5, 0.0))
        self.program = Program([self.call], [self.addresses, self.pg.table], (), [0, 1])

    @staticmethod
    def _span(x):
        span = sum((x.shape[i] - 1) * (x.strides[i] // x.itemsize) for i in (0, 1)) + x.shape[2]
        return np.lib.stride_tricks.as_strided(x, shape=(span,), strides=(x.itemsize,))

    def kernel(self, out):
        """decode_token_paged on the same values (its figures, or None when it declines)."""
        first = self.seq - np.int32(self.n - 1)
        return K.decode_token_paged(self.q, self.k, self.v, self.cos, self.sin, False, self.pg.k_addr,
                                    self.pg.v_addr, self.pg.table, BS, HKV, first, D**-0.5, 0.0, -1, out,
                                    kv_dtype=self.kv_dtype)  # fmt: skip


def _assert_replay_is_the_kernel(c):
    """The replay of ``c`` writes what decode_token_paged writes on the same values, bit for bit (output and
    every page)."""
    before = _snapshot(c.pg)
    want = np.full_like(c.out, np.nan)
    assert c.kernel(want) is not None
    pages = _snapshot(c.pg)
    _restore(c.pg, before)
    assert c.program.run([c.addresses, c.pg.table])
    np.testing.assert_array_equal(c.out, want)
    for got, w in zip(_snapshot(c.pg), pages, strict=True):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("rot, packed", [(True, False), (False, False), (True, True)], ids=["rot", "plain", "packed"])
def test_a_paged_replay_equals_decode_token_paged_bit_for_bit(simd, threads, rot, packed):
    rng = np.random.default_rng([3, rot, packed])
    c = PagedCall(rng, [0, 17, 31, 15, 59], rot, packed)
    _assert_replay_is_the_kernel(c)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize(
    "tokens, kv_dtype",
    [(np.float32, "float16"), (np.float32, "bfloat16"), (np.float16, "float16"), (np.float16, "bfloat16")],
    ids=["f32-f16pages", "f32-bf16pages", "f16", "f16-bf16pages"],
)
def test_a_narrow_paged_replay_equals_decode_token_paged_bit_for_bit(simd, threads, n, tokens, kv_dtype):
    """Float16 tokens (a float16 file) and 2-byte pages replay as the fused call they recorded."""
    c = PagedCall(np.random.default_rng([n, len(kv_dtype)]), [0, 17, 31, 15] if n == 1 else [13, 13],
                  packed=True, n=n, tokens=tokens, kv_dtype=kv_dtype)  # fmt: skip
    _assert_replay_is_the_kernel(c)


def test_a_paged_decode_call_whose_types_are_not_its_arrays_is_refused():
    c = PagedCall(np.random.default_rng(4), [3, 9], tokens=np.float16, kv_dtype="float16")
    kind, arrays, ints, floats = c.call
    for tail in ((0, 1), (1, 0), (1, 3), ()):
        with pytest.raises(ValueError, match=r"paged decode call 0: token and page types"):
            Program([(kind, arrays, ints[:17] + tail, floats)], [c.addresses, c.pg.table], (), [0, 1])


@pytest.mark.parametrize("n, pos", [(4, [13, 13]), (3, [46]), (2, [1, 1, 1])], ids=["tree", "one-row", "first-page"])
def test_a_replay_of_several_tokens_per_row_equals_decode_token_paged(simd, threads, n, pos):
    """A speculative tree's verification (rows of one length, S tokens each, pages crossed) replays as the
    fused call it recorded."""
    rng = np.random.default_rng([n, len(pos)])
    c = PagedCall(rng, pos, packed=True, n=n)
    _assert_replay_is_the_kernel(c)


def test_a_replay_of_several_tokens_refuses_what_the_general_path_would_treat_otherwise():
    c = PagedCall(np.random.default_rng(19), [13, 13], n=4)  # positions 13..16 of each row
    for change in (
        {"seq": [16, 15], "lengths": [13, 12]},  # rows of different lengths: the general path raises
        {"lengths": [12, 13]},  # row 0 not appending at its committed length
        {"staged": [17, 16]},  # row 1's last token past the pages the run staged
        {"total": [16]},  # not past every row's last position
        {"total": [18]},  # past the committed length + S
        {"seq": [3, 3], "lengths": [0, 0], "staged": [4, 4], "total": [4]},  # S tokens of a total of S: a prompt
        {"seq": [ROWS, ROWS], "lengths": [ROWS - 3] * 2, "staged": [ROWS + 1] * 2, "total": [ROWS + 1]},  # rotary
    ):
        _refused(c, **change)
    assert c.program.run([c.addresses, c.pg.table])


def test_hostile_lengths_and_tables_of_several_tokens_are_refused_or_replay_as_the_kernel():
    """Random seqlens, totals, committed lengths, staged ends and table entries at and past their limits for a
    3-row call of 4 tokens: a replay either refuses with nothing written or runs on values the admission rule
    accepts, writing exactly what decode_token_paged writes on them."""
    c = PagedCall(np.random.default_rng(31), [13, 13, 13], n=4)
    pages = c.addresses.shape[1]
    edges = np.array([-(2**31), -1, 0, 1, 15, 16, ROWS - 4, ROWS, CAP - 1, CAP, pages, 2**31 - 1])
    clean = {"seq": c.seq.copy(), "total": c.total.copy(), "lengths": c.lengths.copy(), "table": c.pg.table.copy()}
    ran = refused = 0
    for it in range(examples(150)):
        rng = np.random.default_rng([32, it])
        c.seq[...], c.total[...], c.lengths[...], c.pg.table[...] = (
            clean[k] for k in ("seq", "total", "lengths", "table")
        )
        for a in (c.seq, c.total, c.lengths.reshape(-1), c.pg.table.reshape(-1)):
            pick = rng.random(a.shape) < 0.15
            a[pick] = rng.choice(edges, int(pick.sum())).astype(a.dtype)
        before, out = _snapshot(c.pg), c.out.copy()
        if not c.program.run([c.addresses, c.pg.table]):
            refused += 1
            assert c.program.refused
            np.testing.assert_array_equal(c.out, out)
            for got, w in zip(_snapshot(c.pg), before, strict=True):
                np.testing.assert_array_equal(got, w)
            continue
        ran += 1
        first = c.seq.astype(np.int64) - 3
        assert (first == c.lengths[0]).all() and (c.seq == c.seq[0]).all() and (c.seq < c.lengths[1]).all()
        assert 4 < int(c.total[0]) <= int(c.lengths[0].max()) + 4 and int(c.total[0]) > int(c.seq.max())
        pages_after = _snapshot(c.pg)
        _restore(c.pg, before)
        want = np.full_like(c.out, np.nan)
        assert c.kernel(want) is not None
        np.testing.assert_array_equal(c.out, want)
        for got, w in zip(pages_after, _snapshot(c.pg), strict=True):
            np.testing.assert_array_equal(got, w)
    assert ran and refused


def test_page_and_block_tables_of_other_sizes_replay_and_keep_their_rows():
    """A grown pool (more page ids) and grown tables (more columns) are the same call on this run's sizes."""
    rng = np.random.default_rng(5)
    c = PagedCall(rng, [3, 40])
    want = np.full_like(c.out, np.nan)
    before = _snapshot(c.pg)
    assert c.kernel(want) is not None
    _restore(c.pg, before)
    extra = 7
    addresses = np.zeros((2, c.addresses.shape[1] + extra), np.uint64)
    addresses[:, : c.addresses.shape[1]] = c.addresses
    tables = np.full((2, c.pg.table.shape[1] + 3), -1, np.int32)
    tables[:, : c.pg.table.shape[1]] = c.pg.table
    assert c.program.run([addresses, tables])
    np.testing.assert_array_equal(c.out, want)
    assert not c.program.run([addresses[:1], tables])  # the planes are the recording's: a mismatch
    assert not c.program.refused
    assert not c.program.run([addresses, tables[:1]])  # so are the rows


def _refused(c, **change):
    """Set ``change`` (seq, total, lengths, staged, table, addresses) and assert the replay refuses: nothing
    written."""
    arrays = {"seq": c.seq, "total": c.total, "lengths": c.lengths[0], "staged": c.lengths[1], "table": c.pg.table,
              "addresses": c.addresses}  # fmt: skip
    saved = {name: a.copy() for name, a in arrays.items()}
    for name, value in change.items():
        arrays[name][...] = value
    before, out = _snapshot(c.pg), c.out.copy()
    assert not c.program.run([c.addresses, c.pg.table])
    assert c.program.refused, change
    np.testing.assert_array_equal(c.out, out)
    for got, w in zip(_snapshot(c.pg), before, strict=True):
        np.testing.assert_array_equal(got, w)
    for name, value in saved.items():
        arrays[name][...] = value


def test_a_paged_replay_refuses_positions_and_pages_it_cannot_take_and_writes_nothing():
    c = PagedCall(np.random.default_rng(9), [5, 20])
    p = c.pg.table[1, 0]
    bad_table = c.pg.table.copy()
    bad_table[1, 0] = c.addresses.shape[1]  # a page id past the pool
    unpaged = c.pg.table.copy()
    unpaged[0, 0] = -1
    zero, odd = c.addresses.copy(), c.addresses.copy()
    zero[1, p] = 0  # the V plane's address of a page row 1 reads
    odd[0, p] += 4
    for change in (
        {"lengths": [5, 19]},  # not at the committed length
        {"staged": [6, 20]},  # row 1's position is past the pages the run staged
        {"seq": [5, 21], "total": [22]},
        {"total": [20]},  # not past every position
        {"total": [22]},  # past the committed length + 1
        {"seq": [0, 0], "lengths": [0, 0], "staged": [1, 1], "total": [1]},  # a first token: no past
        {"seq": [5, -1], "lengths": [5, -1]},
        {"seq": [5, ROWS], "lengths": [5, ROWS], "staged": [6, ROWS + 1], "total": [ROWS + 1]},  # past the rotary
        {"table": bad_table},
        {"table": unpaged},
        {"addresses": zero},
        {"addresses": odd},
    ):
        _refused(c, **change)
    assert c.program.run([c.addresses, c.pg.table])  # the values restored: it runs


def test_a_window_reads_only_the_pages_it_sees():
    """With a window, blocks before the window's first key are not read: an unallocated one is no refusal."""
    rng = np.random.default_rng(10)
    c = PagedCall(rng, [40])
    kind, arrays, ints, floats = c.call
    ints = list(ints)
    ints[6] = 7  # keys 33..40: blocks 2 only
    program = Program([(kind, arrays, tuple(ints), floats)], [c.addresses, c.pg.table], (), [0, 1])
    c.pg.table[0, :2] = -1
    assert program.run([c.addresses, c.pg.table])
    c.pg.table[0, 2] = -1
    assert not program.run([c.addresses, c.pg.table]) and program.refused


def test_paged_tables_are_taken_whole_or_not_at_all():
    c = PagedCall(np.random.default_rng(11), [5])
    with pytest.raises(ValueError, match="ragged external"):
        Program([c.call], [c.addresses, c.pg.table], (), [0])  # the block tables not ragged
    kind, arrays, ints, floats = c.call
    wider = np.zeros((3, c.addresses.shape[1]), np.uint64)
    wider[:2] = c.addresses
    with pytest.raises(ValueError, match="ragged external"):  # the call's table is part of a larger external
        Program([(kind, (*arrays[:5], wider[:2], *arrays[6:]), ints, floats)], [wider, c.pg.table], (), [0, 1])


@pytest.mark.parametrize("staged", [3, 5])
def test_the_compiled_generation_loop_runs_paged_steps_up_to_the_staged_end(staged):
    """decode_steps advances the committed length after each step; a step past the pages the caller staged
    is refused with nothing of it run, and the steps before it equal decode_token_paged one by one."""
    c = PagedCall(np.random.default_rng(12), [9])
    c.lengths[1] = 9 + staged
    mask, token = np.ones((1, 10), np.int64), np.array([1], np.int64)
    calls = [(MASK_LENGTHS, (mask, c.seq, c.total), mask.shape, ()), c.call]
    program = Program(calls, [token, mask, c.addresses, c.pg.table], (), [1, 2, 3])
    before = _snapshot(c.pg)
    want = []
    for pos in range(9, 9 + min(staged, 4)):
        c.seq[0] = pos
        want.append(np.full_like(c.out, np.nan))
        assert c.kernel(want[-1]) is not None
    pages = _snapshot(c.pg)
    _restore(c.pg, before)
    tokens, seconds = np.empty((4, 1), np.int64), np.empty(4)
    steps, why = decode_steps(program, [token, np.ones((1, 13), np.int64), c.addresses, c.pg.table], 0, 1, -1, 10,
                              c.out.reshape(-1), np.zeros(0, np.int64), tokens, seconds)  # fmt: skip
    assert (steps, why) == ((3, REFUSED) if staged == 3 else (4, DONE))
    assert c.lengths[0, 0] == 9 + steps
    np.testing.assert_array_equal(c.out, want[steps - 1])
    for a, w in zip(_snapshot(c.pg), pages, strict=True):
        np.testing.assert_array_equal(a, w)


def test_a_paged_call_whose_planes_or_rows_miss_its_tables_is_refused_at_build():
    c = PagedCall(np.random.default_rng(13), [5, 9])
    kind, arrays, ints, floats = c.call
    block = r"the block size in \[1, 2\*\*31 - 1\]"
    for slot, value, match in ((9, 2, "do not fit"), (10, -1, "do not fit"), (8, 3, "do not fit"), (3, 0, block),
                               (3, 2**31, block)):  # fmt: skip
        bad = list(ints)
        bad[slot] = value
        with pytest.raises(ValueError, match=match):
            Program([(kind, arrays, tuple(bad), floats)], [c.addresses, c.pg.table], (), [0, 1])
