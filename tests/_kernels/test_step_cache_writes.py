"""Recorded writes into a paged cache and masked attention over its pages (``_record.KIND_PAGE_ROWS``,
``KIND_MASKED_PAGED``: an export's cache Concat and MaskedAttention, an ONNX Attention node, in a paged state)
replayed by a Program: bit for bit the kernels the operators' Python paths call (``page_write`` of the rows
rounded to the pages' type, ``paged_attention`` with the mask's ranges) at every SIMD level and thread count;
values they cannot take (positions past the staged pages, a mask whose query does not end at its own position,
a page the pool does not hold) are refused before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
from onnxkv._kernels._record import DECODE_CACHE_TYPES, MASKED_PAGED, PAGE_ROWS
from onnxkv._kernels.step import Program

import onnxkv._kernels as K
from onnxkv._kernels import reference as R

from .test_decode_token_paged import BS, _case, _restore, _snapshot

HQ, HKV, D = 4, 2, 16


def _rows_of(x: np.ndarray, kv_dtype) -> np.ndarray:
    """Rows [B, H, 1, D] as a paged plane's write rounds them into pages of ``kv_dtype``."""
    if kv_dtype == "bfloat16":
        bits = np.empty(x.shape, np.uint16)
        K.f32_to_bf16(np.ascontiguousarray(x, dtype=np.float32), bits)
        return bits
    return x.astype(np.float16) if kv_dtype == "float16" else x


class Layer:
    """One layer's recorded decode calls over :class:`Paged` caches of ``len(pos)`` rows, each row's new
    position ``pos[b]`` (its committed length): K and V rows written by two KIND_PAGE_ROWS calls and read by
    a KIND_MASKED_PAGED call (``fused``: one KIND_MASKED_PAGED call that writes them itself).  The mask [B, 1,
    1, T] hides the keys before ``start`` (per row) and, unless ``causal``, none after.  ``ragged`` (a fused
    call's): rows of different committed lengths, T the longest's plus one, the mask hiding the keys
    ``pos[b] .. T - 2`` each row never wrote (ONNX Attention over the rows of requests of different lengths)."""

    def __init__(self, rng, pos, kv_dtype=None, mask_kind="float32", start=None, fused=False, causal=0, ragged=0):
        pos = np.asarray(pos, np.int64)
        b, self.kv_dtype, self.fused = len(pos), kv_dtype, fused
        assert ragged or (pos == pos[0]).all()  # every row at one committed length
        t = int(pos.max()) + 1
        self.pg, q, k, v, _, _ = _case(rng, HQ, HKV, D, pos.astype(np.int32), 0, kv_dtype=kv_dtype)
        self.q = np.ascontiguousarray(q.reshape(b, HQ, 1, D))
        self.k, self.v = (np.ascontiguousarray(x.reshape(b, HKV, 1, D)) for x in (k, v))
        self.start = np.zeros(b, np.int64) if start is None else np.asarray(start, np.int64)
        cols = np.arange(t)[None, :]
        seen = (cols >= self.start[:, None]) & ~((cols >= pos[:, None]) & (cols < t - 1))
        if mask_kind == "bool":
            mask = seen
        else:
            mask = np.where(seen, 0.0, -np.inf if mask_kind == "float16" else np.finfo(np.float32).min)
            mask = mask.astype(np.float16 if mask_kind == "float16" else np.float32)
        self.mask = np.ascontiguousarray(mask[:, None, None, :])
        self.lengths = [np.stack([pos, pos + 1]) for _ in range(3)]
        self.out = np.full((b, HQ, 1, D), np.nan, np.float32)
        self.addresses = np.stack([self.pg.k_addr, self.pg.v_addr])
        p, m, kt = self.addresses.shape[1], self.pg.table.shape[1], DECODE_CACHE_TYPES[kv_dtype or "float32"]
        calls = []
        if not fused:
            for plane, new in ((0, self.k), (1, self.v)):
                ints = (b, HKV, 1, D, BS, plane, 0, kt, 0, 0, 0, 0, 0, 0, p, m)
                arrays = (new, self.addresses, self.pg.table, self.lengths[plane], np.zeros(b, np.int32))
                calls.append((PAGE_ROWS, arrays, ints, ()))
        kind = {"float32": 0, "bool": 1, "float16": 2}[mask_kind]
        rows = (self.k, self.v) if fused else (None, None)
        scratch = tuple(np.zeros(b, np.int32) for _ in range(3))
        arrays = (self.q, *rows, self.mask, self.out, self.addresses, self.pg.table, self.lengths[2], *scratch)
        ints = (b, HQ, HKV, D, BS, 0, 1, b, t, kind, causal, 0, kt, ragged, p, m)
        calls.append((MASKED_PAGED, arrays, ints, (D**-0.5, 0.0)))
        self.calls = calls
        self.program = Program(calls, [self.mask, self.addresses, self.pg.table], (), [0, 1, 2])

    def run(self) -> bool:
        return self.program.run([self.mask, self.addresses, self.pg.table])

    def kernels(self, out: np.ndarray) -> None:
        """What the operators' Python paths call on the same values: page_write of each plane's rows, then
        paged_attention of the queries with the mask's ranges."""
        pos = self.lengths[0][0]
        for new, addr in ((self.k, self.pg.k_addr), (self.v, self.pg.v_addr)):
            K.page_write(_rows_of(new, self.kv_dtype), addr, self.pg.table, pos, BS)
        K.paged_attention(
            self.q, self.pg.k_addr, self.pg.v_addr, self.pg.table, BS, HKV, (pos + 1).astype(np.int32),
            pos.astype(np.int32)[:, None], D**-0.5, 0.0, -1, out, kv_start=self.start.astype(np.int32),
            kv_dtype=self.kv_dtype,
        )  # fmt: skip


def _assert_replay_is_the_kernels(layer: Layer) -> None:
    before = _snapshot(layer.pg)
    want = np.full_like(layer.out, np.nan)
    layer.kernels(want)
    pages = _snapshot(layer.pg)
    _restore(layer.pg, before)
    assert layer.run(), layer.program.refused
    np.testing.assert_array_equal(layer.out, want)
    for got, w in zip(_snapshot(layer.pg), pages, strict=True):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("kv_dtype", [None, "float16", "bfloat16"])
@pytest.mark.parametrize("fused", [False, True], ids=["concat", "attention"])
@pytest.mark.parametrize("mask_kind", ["float32", "bool"])
def test_a_replayed_layer_equals_page_write_and_paged_attention_bit_for_bit(simd, threads, kv_dtype, fused, mask_kind):
    rng = np.random.default_rng(3)
    for pos in ([5, 5], [16, 16, 16], [40]):  # mid-page, a page's first position, one row
        _assert_replay_is_the_kernels(Layer(rng, pos, kv_dtype, mask_kind, fused=fused))


@pytest.mark.parametrize("causal", [0, 1])
def test_a_mask_with_a_start_per_row_reads_only_the_pages_it_shows(simd, threads, causal):
    """A sliding window's (or left padding's) first key per row: blocks before it are not read, so a block
    without a page there is no refusal; one inside the range is."""
    rng = np.random.default_rng(4)
    _assert_replay_is_the_kernels(Layer(rng, [40, 40], start=[35, 17], causal=causal))
    layer = Layer(rng, [40, 40], start=[35, 17], causal=causal)
    layer.pg.table[0, :2] = -1  # row 0 sees keys 35..40: block 2 only
    layer.pg.table[1, 0] = -1  # row 1 sees keys 17..40: blocks 1 and 2
    assert layer.run()
    layer.pg.table[1, 1] = -1
    _refused(layer)


@pytest.mark.parametrize("kv_dtype", [None, "float16"])
@pytest.mark.parametrize("mask_kind", ["float32", "bool"])
def test_rows_of_different_lengths_attend_over_their_own_keys(simd, threads, kv_dtype, mask_kind):
    """A ragged call (an Attention node over the rows of requests of different lengths): each row writes at its
    own committed length and its query reads its own keys, the ones the mask hides between them and the
    longest row's new position dropped -- bit for bit what the Python path's kernels make."""
    rng = np.random.default_rng(8)
    for pos, start in (([5, 19, 40], None), ([16, 3], [2, 0]), ([33, 33], None), ([7], None)):
        _assert_replay_is_the_kernels(Layer(rng, pos, kv_dtype, mask_kind, start, fused=True, ragged=1))
    _assert_replay_is_the_kernels(Layer(rng, [12, 30], fused=True, ragged=1, causal=1))


def test_a_ragged_call_refuses_a_gap_its_mask_shows_and_rows_none_of_which_is_the_longest():
    rng = np.random.default_rng(9)
    assert Layer(rng, [9, 20], fused=True, ragged=1).run()
    shown = Layer(rng, [9, 20], fused=True, ragged=1)
    shown.mask[0, ..., 12] = 0.0  # a key row 0 never wrote, shown
    _refused(shown)
    shorter = Layer(rng, [9, 19], fused=True, ragged=1)
    cols = np.arange(21)
    wider = np.where((cols < np.array([[9], [19]])) | (cols == 20), 0.0, -np.inf).astype(np.float32)
    before, out = _snapshot(shorter.pg), shorter.out.copy()
    # each row's gap hidden, but no row is the longest (T - 1 = 20): the mask is not the past plus one
    assert not shorter.program.run([wider[:, None, None, :], shorter.addresses, shorter.pg.table])
    np.testing.assert_array_equal(shorter.out, out)
    for got, w in zip(_snapshot(shorter.pg), before, strict=True):
        np.testing.assert_array_equal(got, w)
    unequal = Layer(rng, [9, 20], fused=True, ragged=1)
    unequal.calls[-1] = (*unequal.calls[-1][:2], unequal.calls[-1][2][:13] + (0,) + unequal.calls[-1][2][14:],
                         unequal.calls[-1][3])  # fmt: skip
    unequal.program = Program(unequal.calls, [unequal.mask, unequal.addresses, unequal.pg.table], (), [0, 1, 2])
    _refused(unequal)  # a call that is not ragged takes rows of one length only


def test_a_float16_mask_hides_its_keys_with_minus_infinity():
    rng = np.random.default_rng(5)
    _assert_replay_is_the_kernels(Layer(rng, [30, 30], mask_kind="float16", start=[3, 0]))
    layer = Layer(rng, [30, 30], mask_kind="float16", start=[3, 0])
    layer.mask[0, 0, 0, 0] = -65504.0  # a finite bound hides a key only while the scores are small: refused
    _refused(layer)


def _refused(layer: Layer) -> None:
    """The replay refuses its values: no page and no output byte written."""
    before, out = _snapshot(layer.pg), layer.out.copy()
    assert not layer.run()
    assert layer.program.refused
    np.testing.assert_array_equal(layer.out, out)
    for got, w in zip(_snapshot(layer.pg), before, strict=True):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("fused", [False, True], ids=["concat", "attention"])
def test_positions_masks_and_pages_a_replay_cannot_take_are_refused_before_anything_is_written(fused):
    rng = np.random.default_rng(6)
    cases = {
        "committed length": lambda x: [a[0].__setitem__(1, 19) for a in x.lengths],  # rows of two lengths
        "staged end": lambda x: [a[1].__setitem__(0, 20) for a in x.lengths],  # the row's page is not staged
        "negative": lambda x: [a.__setitem__(slice(None), -1) for a in x.lengths],
        "query not at its position": lambda x: x.mask[..., -1].__setitem__(Ellipsis, -np.inf),
        "hole": lambda x: x.mask[1, ..., 4].__setitem__(Ellipsis, -np.inf),
        "nan": lambda x: x.mask[0, ..., 2].__setitem__(Ellipsis, np.nan),
        "page past the pool": lambda x: x.pg.table.__setitem__((1, 0), x.addresses.shape[1]),
        "no page": lambda x: x.pg.table.__setitem__((0, 1), -1),
        "zero address": lambda x: x.addresses.__setitem__((1, x.pg.table[0, 0]), 0),
        "unaligned address": lambda x: x.addresses.__setitem__((0, x.pg.table[1, 1]), x.addresses[0, 0] + 4),
    }
    for name, change in cases.items():
        layer = Layer(rng, [20, 20], fused=fused)
        change(layer)
        try:
            _refused(layer)
        except AssertionError as e:
            raise AssertionError(name) from e
    assert Layer(rng, [20, 20], fused=fused).run()


def test_a_mask_shorter_or_longer_than_the_past_plus_one_is_refused():
    """The mask's keys (its last dim, read when replayed) must be the committed length plus the new one."""
    rng = np.random.default_rng(7)
    layer = Layer(rng, [20, 20])
    for width in (20, 22):
        mask = np.zeros((2, 1, 1, width), np.float32)
        before = _snapshot(layer.pg)
        assert not layer.program.run([mask, layer.addresses, layer.pg.table]) and layer.program.refused
        for got, w in zip(_snapshot(layer.pg), before, strict=True):
            np.testing.assert_array_equal(got, w)


def test_calls_whose_ints_do_not_describe_their_arrays_are_refused_at_build():
    layer = Layer(np.random.default_rng(8), [20, 20])
    externals = ([layer.mask, layer.addresses, layer.pg.table], (), [0, 1, 2])
    rows, attention = layer.calls[0], layer.calls[-1]
    for bad in (
        (6, 1),  # float16 rows, but the rows are float32
        (7, 3),  # no such page type
        (5, 2),  # no such plane
        (0, 3),  # three rows, tables of two
        (3, 8),  # another head size
    ):
        ints = list(rows[2])
        ints[bad[0]] = bad[1]
        with pytest.raises(ValueError, match="page-row call"):
            Program([(rows[0], rows[1], tuple(ints), rows[3])], *externals)
    for bad in (
        (9, 3),  # no such mask kind
        (9, 1),  # a bool mask, but the mask is float32
        (11, 1),  # float16 queries, but they are float32
        (2, 3),  # 4 query heads over 3 KV heads
        (6, 2),  # no such plane
        (7, 3),  # the mask's rows are neither 1 nor the batch
        (13, 2),  # ragged is 0 or 1
    ):
        ints = list(attention[2])
        ints[bad[0]] = bad[1]
        with pytest.raises(ValueError, match="paged masked call"):
            Program([(attention[0], attention[1], tuple(ints), attention[3])], *externals)
    arrays = list(attention[1])
    arrays[1] = layer.k  # K rows without V rows
    with pytest.raises(ValueError, match="paged masked call"):
        Program([(attention[0], tuple(arrays), attention[2], attention[3])], *externals)
    with pytest.raises(ValueError, match="ragged external"):  # the mask taken as a fixed array
        Program([attention], [layer.addresses, layer.pg.table], (), [0, 1])


def test_the_twin_agrees_within_float32_tolerance():
    """The replay against the NumPy twin of attention over the caches the pages hold (float32 pages)."""
    rng = np.random.default_rng(9)
    layer = Layer(rng, [33, 33], start=[0, 9])
    assert layer.run()
    b, t = 2, 34
    keys, values = (np.stack([_gathered(layer.pg, pages, r, t) for r in range(b)]) for pages in
                    (layer.pg.k_pages, layer.pg.v_pages))  # fmt: skip
    want = np.empty_like(layer.out)
    R.attention(layer.q, keys, values, np.full(b, t), np.full((b, 1), t - 1), D**-0.5, 0.0, -1, want, layer.start)
    np.testing.assert_allclose(layer.out, want, rtol=2e-5, atol=2e-6)


def _gathered(pg, pages, row: int, t: int) -> np.ndarray:
    """Row ``row``'s first ``t`` positions [Hkv, t, D] read through the block table."""
    return np.concatenate([pages[pg.table[row, i]] for i in range(-(-t // BS))], axis=1)[:, :t]


def test_tables_of_other_types_strided_operands_and_empty_heads_are_refused_at_build():
    """The replay reads page addresses as uint64, block tables as int32 and every operand as [address, +
    nbytes) in C order: anything else, an empty head count or head size, and a block size past 2**31 - 1 are
    refused before a call is taken (a strided ``out`` was written past its view; no heads divided by zero)."""
    layer = Layer(np.random.default_rng(10), [20, 20])
    externals = [layer.mask, layer.addresses, layer.pg.table]

    def build(call):
        return Program([call], externals, (), [0, 1, 2])

    rows, attention = layer.calls[0], layer.calls[-1]
    for call, at in ((rows, (1, 2)), (attention, (5, 6))):
        kind, arrays, ints, floats = call
        wrong = [(at[0], layer.addresses.astype(t)) for t in (np.uint32, np.float64)]
        wrong += [(at[1], layer.pg.table.astype(t)) for t in (np.int64, np.int8)]
        for position, bad in wrong:
            changed = list(arrays)
            changed[position] = bad
            with pytest.raises(ValueError, match="page addresses must be uint64"):  # before its operands are placed
                build((kind, tuple(changed), ints, floats))
        block = list(ints)
        block[4] = 2**31
        with pytest.raises(ValueError, match="block size in"):
            build((kind, arrays, tuple(block), floats))
    kind, arrays, ints, floats = attention
    reversed_out = np.full((4, HQ, 1, D), 7.0, np.float32)[:2][::-1]
    with pytest.raises(ValueError, match="operand 4 of call 0 is not C-contiguous"):
        build((kind, (*arrays[:4], reversed_out, *arrays[5:]), ints, floats))
    empty = np.zeros((2, 0, 1, D), np.float32)
    no_heads = list(ints)
    no_heads[1] = 0
    with pytest.raises(ValueError, match="paged masked call"):
        build((kind, (empty, None, None, arrays[3], empty.copy(), *arrays[5:]), tuple(no_heads), floats))
    kind, arrays, ints, floats = rows
    with pytest.raises(ValueError, match="page-row call"):
        build((kind, (np.zeros((2, HKV, 1, 0), np.float32), *arrays[1:]), (*ints[:3], 0, *ints[4:]), floats))
