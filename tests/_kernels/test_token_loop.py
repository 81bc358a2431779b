"""onnxkv._kernels.token_loop.decode_steps: a program replayed once per token, each step fed the argmax of the
last, equals the steps run one by one (NumPy's argmax, the kernels called directly)."""

from __future__ import annotations

import numpy as np
import pytest
from onnxkv._kernels._record import DECODE_TOKEN, MASK_LENGTHS, Recorder
from onnxkv._kernels.gather import gather_rows
from onnxkv._kernels.sampling import sample
from onnxkv._kernels.step import Program
from onnxkv._kernels.token_loop import DONE, EOS, MISMATCH, REFUSED, decode_steps

from onnxkv._kernels import decode_token

from .conftest import rand

HQ, HKV, D, CAP = 2, 1, 16, 24


class Chain:
    """A tiny 'model': the mask's lengths, one decode-token call into two caches at the position they give,
    the logits as the token's row of a table, and a second table's row at the position input.

    Externals: token int64 [1], mask int64 [1, L] (ragged), position int64 [1], key cache, value cache.
    """

    def __init__(self, rng, table, length):
        self.table = table
        self.pos_table = rand(rng, (CAP + 4, 3))
        self.q, self.k, self.v = rand(rng, (1, 1, HQ * D)), rand(rng, (1, 1, HKV * D)), rand(rng, (1, 1, HKV * D))
        self.seqlens, self.total = np.zeros(1, np.int32), np.zeros(1, np.int32)
        self.att = np.empty((1, 1, HQ * D), np.float32)
        self.io = np.zeros((2, 1), np.int64)
        self.logits = np.empty((1, table.shape[1]), np.float32)
        self.at_pos = np.empty((1, 3), np.float32)
        self.token, self.position = np.array([1], np.int64), np.array([length], np.int64)
        self.mask = np.ones((1, length + 1), np.int64)
        self.kc, self.vc = rand(rng, (1, HKV, CAP, D)), rand(rng, (1, HKV, CAP, D))
        calls = [
            (MASK_LENGTHS, (self.mask, self.seqlens, self.total), self.mask.shape, ()),
            (
                DECODE_TOKEN,
                (
                    self.q,
                    self.k,
                    self.v,
                    None,
                    None,
                    self.kc,
                    self.vc,
                    self.seqlens,
                    self.total,
                    self.att,
                    self.io,
                    np.empty((2, 1, HKV, 1, D), np.float32),
                ),
                (HQ, HKV, CAP, D, 0, 0, -1, 0, 1, HQ * D, HKV * D, HKV * D, 0, 0, 1),
                (D**-0.5, 0.0),
            ),
        ]
        rec = Recorder()
        with rec:
            gather_rows(table, self.token, self.logits)
            gather_rows(self.pos_table, self.position, self.at_pos)
        self.program = Program(calls + rec.calls, [self.token, self.mask, self.position, self.kc, self.vc], (), [1])

    def externals(self, columns):
        return [self.token, np.ones((1, columns), np.int64), self.position, self.kc, self.vc]


def _twin(chain, kc, vc, first, length, count, eos=()):
    """The steps one by one: decode_token at each position, the argmax of the table row of each token."""
    tok, tokens, att = first, [], np.empty_like(chain.att)
    for t in range(count):
        pos = length + t
        assert decode_token(chain.q, chain.k, chain.v, None, None, False, kc, vc, pos, D**-0.5, 0.0, -1, att)
        tok = int(np.argmax(chain.table[tok]))
        tokens.append(tok)
        if tok in eos:
            break
    return tokens, att


@pytest.mark.parametrize("kind", ["random", "ties", "nan"])
def test_decode_steps_equal_the_steps_one_by_one(simd, threads, kind):
    rng = np.random.default_rng(5)
    v = 37
    table = rand(rng, (v, v))
    if kind == "ties":  # few distinct values: argmax must take the first maximum
        table = rng.integers(0, 3, (v, v)).astype(np.float32)
    elif kind == "nan":  # NumPy's argmax gives the first NaN
        table[rng.integers(0, v, 12), rng.integers(0, v, 12)] = np.nan
    length, count = 5, 12
    chain = Chain(rng, table, length)
    kc, vc = chain.kc.copy(), chain.vc.copy()
    chain.io[0] = length
    tokens, seconds = np.empty((count, 1), np.int64), np.empty(count)
    steps, why = decode_steps(chain.program, chain.externals(length + count), 0, 1, 2, length + 1,
                              chain.logits.reshape(-1), np.zeros(0, np.int64), tokens, seconds)  # fmt: skip
    want, att = _twin(chain, kc, vc, 1, length, count)
    assert (steps, why) == (count, DONE)
    assert tokens[:, 0].tolist() == want
    assert (seconds > 0).all()
    np.testing.assert_array_equal(chain.kc, kc)
    np.testing.assert_array_equal(chain.vc, vc)
    np.testing.assert_array_equal(chain.att, att)
    assert chain.io.tolist() == [[length + count], [length + count - 1]]
    assert chain.position[0] == length + count - 1  # advanced after each step but the last
    np.testing.assert_array_equal(chain.at_pos[0], chain.pos_table[length + count - 1])


def test_decode_steps_stop_after_an_end_of_sequence_id():
    rng = np.random.default_rng(6)
    chain = Chain(rng, rand(rng, (29, 29)), 4)
    chain.io[0] = 4
    free, _ = _twin(chain, chain.kc.copy(), chain.vc.copy(), 1, 4, 10)
    eos = np.array([free[3], 10**9], np.int64)
    stop = free.index(free[3]) + 1
    tokens, seconds = np.empty((10, 1), np.int64), np.empty(10)
    steps, why = decode_steps(chain.program, chain.externals(14), 0, 1, 2, 5, chain.logits.reshape(-1), eos,
                              tokens, seconds)  # fmt: skip
    assert (steps, why) == (stop, EOS) and tokens[:steps, 0].tolist() == free[:stop]


def test_a_refused_step_runs_nothing_and_the_steps_before_it_stand():
    """Logits wider than the embedding table: a chosen id past the table's rows is refused by the gather."""
    rng = np.random.default_rng(7)
    table = rand(rng, (40, 40))
    table[:, 30] = 100.0  # every row's argmax is 30
    small = Chain(rng, table[:30].copy(), 3)  # 30 rows: id 30 is out of range
    small.io[0] = 3
    kc = small.kc.copy()
    tokens, seconds = np.empty((5, 1), np.int64), np.empty(5)
    steps, why = decode_steps(small.program, small.externals(8), 0, 1, 2, 4, small.logits.reshape(-1),
                              np.zeros(0, np.int64), tokens, seconds)  # fmt: skip
    assert (steps, why) == (1, REFUSED) and tokens[0, 0] == 30
    # the refused step wrote no cache row: only position 3 (the first step's) changed
    changed = np.flatnonzero((small.kc != kc).any(axis=(0, 1, 3)))
    assert changed.tolist() == [3]


def test_externals_unlike_the_recording_run_nothing_and_bad_arguments_raise():
    rng = np.random.default_rng(8)
    chain = Chain(rng, rand(rng, (9, 9)), 2)
    chain.io[0] = 2
    tokens, seconds = np.empty((4, 1), np.int64), np.empty(4)
    logits, none = chain.logits.reshape(-1), np.zeros(0, np.int64)
    other = chain.externals(6)
    other[3] = np.zeros((1, HKV, CAP + 1, D), np.float32)  # a cache of another capacity
    assert decode_steps(chain.program, other, 0, 1, 2, 3, logits, none, tokens, seconds) == (0, MISMATCH)
    with pytest.raises(ValueError, match="need 6 columns, external 1 has 5"):
        decode_steps(chain.program, chain.externals(5), 0, 1, 2, 3, logits, none, tokens, seconds)
    with pytest.raises(ValueError, match="external 3 must be int64, one per row"):
        decode_steps(chain.program, chain.externals(6), 3, 1, 2, 3, logits, none, tokens, seconds)
    with pytest.raises(ValueError, match="external 0 is not the ragged"):
        decode_steps(chain.program, chain.externals(6), 2, 0, -1, 3, logits, none, tokens, seconds)
    with pytest.raises(ValueError, match="one row per step"):
        decode_steps(chain.program, chain.externals(6), 0, 1, 2, 3, logits, none, tokens, seconds[:2])
    with pytest.raises(ValueError, match="token external 7 out of"):
        decode_steps(chain.program, chain.externals(6), 7, 1, 2, 3, logits, none, tokens, seconds)


def test_a_mask_of_each_rows_ones_first_is_written_by_the_loop():
    """With ``mask_ones`` the loop writes the mask each step reads (row b's first mask_ones[b] + t columns
    ones, as C-contiguous [B, mask_len + t]): from a zeroed buffer, the steps of an all-ones mask; counts
    that do not fit raise before anything runs."""
    rng = np.random.default_rng(12)
    length, count = 3, 6
    chain = Chain(rng, rand(rng, (9, 9)), length)
    chain.io[0] = length
    kc, vc = chain.kc.copy(), chain.vc.copy()
    tokens, seconds = np.empty((count, 1), np.int64), np.empty(count)
    logits, none = chain.logits.reshape(-1), np.zeros(0, np.int64)
    want = decode_steps(chain.program, chain.externals(length + count), 0, 1, 2, length + 1, logits, none, tokens,
                        seconds)  # fmt: skip
    want_tokens = tokens.copy()
    chain.kc[...], chain.vc[...] = kc, vc
    chain.io[0], chain.token[0], chain.position[0] = length, 1, length
    zeros = [chain.token, np.zeros((1, length + count), np.int64), chain.position, chain.kc, chain.vc]
    got = decode_steps(chain.program, zeros, 0, 1, 2, length + 1, logits, none, tokens, seconds,
                       mask_ones=np.array([length + 1]))  # fmt: skip
    assert got == want and tokens.tolist() == want_tokens.tolist()
    for bad, match in ((np.array([length + 2]), r"mask_ones\[0\] = 5 is not in \[0, 4\]"),
                       (np.array([-1]), r"mask_ones\[0\] = -1"), (np.array([1, 1]), "one count per row")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            decode_steps(chain.program, zeros, 0, 1, 2, length + 1, logits, none, tokens, seconds, mask_ones=bad)


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.9, 8, 0.9)])
def test_sampled_steps_draw_as_the_sampling_kernel_one_by_one(temperature, top_k, top_p):
    rng = np.random.default_rng(11)
    v, length, count = 41, 4, 15
    chain = Chain(rng, rand(rng, (v, v), scale=2.0), length)
    chain.io[0] = length
    uniforms = rng.random(count)
    tokens, seconds = np.empty((count, 1), np.int64), np.empty(count)
    steps, why = decode_steps(chain.program, chain.externals(length + count), 0, 1, 2, length + 1,
                              chain.logits.reshape(-1), np.zeros(0, np.int64), tokens, seconds, temperature, top_k,
                              top_p, uniforms)  # fmt: skip
    want, tok = [], 1
    for t in range(count):
        tok = int(sample(chain.table[tok][None], temperature, top_k or None, top_p, uniforms[t : t + 1])[0])
        want.append(tok)
    assert (steps, why) == (count, DONE) and tokens[:, 0].tolist() == want
    assert len(set(want)) > 3  # draws, not an argmax chain


def test_sampled_steps_check_their_arguments():
    rng = np.random.default_rng(12)
    chain = Chain(rng, rand(rng, (9, 9)), 2)
    tokens, seconds = np.empty((3, 1), np.int64), np.empty(3)
    args = (chain.program, chain.externals(5), 0, 1, 2, 3, chain.logits.reshape(-1), np.zeros(0, np.int64), tokens,
            seconds)  # fmt: skip
    for extra, match in (
        ((1.0, 0, 1.0, None), "one uniform number per step and row"),
        ((1.0, 0, 1.0, np.full(2, 0.5)), "one uniform number per step and row"),
        ((1.0, 0, 1.0, np.array([0.5, 1.0, 0.2])), r"uniforms\[1\] = 1.0 is not in \[0, 1\)"),
        ((-1.0, 0, 1.0, np.full(3, 0.5)), "temperature -1.0"),
        ((1.0, -2, 1.0, np.full(3, 0.5)), "top_k -2"),
        ((1.0, 0, 0.0, np.full(3, 0.5)), "top_p 0.0"),
    ):
        with pytest.raises(ValueError, match=match):
            decode_steps(*args, *extra)


def _rows(rng, B, v, length, count):
    """A B-row 'model': each row's logits are the table row of its token (the mask's lengths computed too).
    Returns the table, the token, mask and position externals, the logits and the program."""
    table = rand(rng, (v, v), scale=2.0)
    token, position = rng.integers(0, v, B).astype(np.int64), np.full(B, length, np.int64)
    mask, seqlens, total = np.ones((B, length + count), np.int64), np.zeros(B, np.int32), np.zeros(1, np.int32)
    logits = np.empty((B, v), np.float32)
    rec = Recorder()
    with rec:
        gather_rows(table, token, logits)
    recorded = np.ones((B, length + 1), np.int64)
    calls = [(MASK_LENGTHS, (recorded, seqlens, total), recorded.shape, ())]
    return table, token, mask, position, logits, Program(calls + rec.calls, [token, recorded, position], (), [1])


def test_rows_sample_with_their_own_parameters_or_take_their_argmax():
    """Per-row temperature (0: the argmax), top_k and top_p: each row draws as the sampling kernel does with
    its own parameters and its uniform of the step (an argmax row's uniforms are not read)."""
    rng = np.random.default_rng(13)
    B, v, length, count = 4, 29, 3, 10
    table, token, mask, position, logits, program = _rows(rng, B, v, length, count)
    temperature, top_k, top_p = np.array([0.8, 0.0, 1.4, 1.0]), np.array([0, 3, 6, 0]), np.array([1.0, 0.5, 0.9, 0.7])
    uniforms = rng.random(count * B)
    uniforms[1::B] = 2.0  # the argmax row's: out of range, never read
    tokens, seconds = np.empty((count, B), np.int64), np.empty(count)
    first = token.copy()
    steps, why = decode_steps(program, [token, mask, position], 0, 1, 2, length + 1, logits.reshape(-1),
                              np.zeros(0, np.int64), tokens, seconds, temperature, top_k, top_p,
                              np.where(uniforms > 1, 0.5, uniforms))  # fmt: skip
    assert (steps, why) == (count, DONE)
    for b in range(B):
        tok, want = int(first[b]), []
        for t in range(count):
            row = table[tok][None]
            if temperature[b] == 0:
                tok = int(np.argmax(row))
            else:
                tok = int(
                    sample(row, temperature[b], int(top_k[b]) or None, top_p[b], uniforms[t * B + b : t * B + b + 1])[0]
                )
            want.append(tok)
        assert tokens[:, b].tolist() == want, f"row {b}"
    with pytest.raises(ValueError, match="row 2: temperature -1.0"):
        decode_steps(program, [token, mask, position], 0, 1, 2, length + 1, logits.reshape(-1), np.zeros(0, np.int64),
                     tokens, seconds, np.array([1.0, 0.0, -1.0, 1.0]), 0, 1.0, np.full(count * B, 0.5))  # fmt: skip
    with pytest.raises(ValueError, match=r"one per row \(4\)"):
        decode_steps(program, [token, mask, position], 0, 1, 2, length + 1, logits.reshape(-1), np.zeros(0, np.int64),
                     tokens, seconds, np.ones(3), 0, 1.0, np.full(count * B, 0.5))  # fmt: skip


def test_rows_end_at_their_own_end_ids():
    """eos [B, E] (-1: no id): each row ends after one of its own ids and is fed the pad id from then on; an
    id another row ends at does not end it."""
    rng = np.random.default_rng(14)
    B, v, length, count = 3, 23, 2, 9
    table, token, mask, position, logits, program = _rows(rng, B, v, length, count)
    first, chains = token.copy(), []
    for b in range(B):  # each row's argmax chain
        tok, chain = int(first[b]), []
        for _ in range(count):
            tok = int(np.argmax(table[tok]))
            chain.append(tok)
        chains.append(chain)
    ends = np.full((B, 2), -1, np.int64)
    ends[0, 0], ends[2, 1] = chains[0][2], chains[2][5]  # row 1 has no end id
    tokens, seconds, finished = np.empty((count, B), np.int64), np.empty(count), np.zeros(B, np.uint8)
    steps, why = decode_steps(program, [token, mask, position], 0, 1, 2, length + 1, logits.reshape(-1), ends,
                              tokens, seconds, finished=finished, pad=7)  # fmt: skip
    assert (steps, why) == (count, DONE)
    for b, end in ((0, 2), (1, count), (2, 5)):
        want = chains[b][: end + 1] + [7] * (count - end - 1)
        assert tokens[:, b].tolist() == want, f"row {b}"
    assert finished.tolist() == [1, 0, 1]
    with pytest.raises(ValueError, match=r"eos must be int64 \[E\], \[1, E\] or \[3, E\]"):
        decode_steps(program, [token, mask, position], 0, 1, 2, length + 1, logits.reshape(-1),
                     np.zeros((2, 1), np.int64), tokens, seconds)  # fmt: skip


def test_derived_masks_and_a_head_program_are_checked_before_anything_runs():
    """The masks the loop writes for an ExportMask node (``derived``) and a head program are refused, with
    nothing run, unless they name what they must (the graph-level tests in tests/plan/test_step_loop.py run
    them on Attention graphs and torch exports)."""
    rng = np.random.default_rng(9)
    chain = Chain(rng, rand(rng, (9, 9)), 2)
    chain.io[0] = 2
    kc = chain.kc.copy()
    tokens, seconds = np.empty((4, 1), np.int64), np.empty(4)
    logits, none = chain.logits.reshape(-1), np.zeros(0, np.int64)
    values = np.zeros((1, 2))
    for derived, dv, kw, match in (
        (np.array([[1, 0, 0, 1, 0]]), values, {}, r"derived\[0\] names external 1, out of \[0, 5\) or taken"),
        (np.array([[3, 0, 0, 1, 0]]), values, {}, r"derived\[0\] = \(3, 0, 0, 1\) is not a ragged"),
        (np.array([[3, 2, 0, 1, 0]]), values, {}, "is not a ragged"),
        (np.array([[3, 0, -1, 1, 0]]), values, {}, "is not a ragged"),
        (np.array([[3, 0, 0, 1, 0]]), np.zeros((2, 2)), {}, r"derived must be int64 \[n, 5\]"),
        (np.array([[3, 0, 0, 1]]), values, {}, r"derived must be int64 \[n, 5\]"),
        (np.array([[3, 0, 0, 1, 0]]), values, {"mask_ones": np.array([3])}, "mask_ones must be None"),
        (np.array([[3, 0, 0, 1, 2]]), values, {}, r"derived\[0\] padded = 2"),
        # left padding: each row's start before its last column, for masks of every row
        (np.array([[3, 0, 0, 1, 0]]), values, {"derived_starts": np.array([3])}, r"derived_starts\[0\] = 3"),
        (np.array([[3, 0, 0, 1, 0]]), values, {"derived_starts": np.array([-1])}, r"derived_starts\[0\] = -1"),
        (np.array([[3, 0, 0, 1, 0]]), values, {"derived_starts": np.array([0, 0])}, "one per row"),
        (None, None, {"derived_starts": np.array([0])}, "must come with derived masks"),
        # rows of different lengths: each row's ones before the last column, not with left padding
        (np.array([[3, 0, 0, 1, 1]]), values, {"derived_gaps": np.array([3])}, r"derived_gaps\[0\] = 3"),
        (np.array([[3, 0, 0, 1, 1]]), values, {"derived_gaps": np.array([-1])}, r"derived_gaps\[0\] = -1"),
        (np.array([[3, 0, 0, 1, 1]]), values, {"derived_gaps": np.array([0, 0])}, "derived_gaps must come with"),
        (None, None, {"derived_gaps": np.array([0])}, "derived_gaps must come with derived masks"),
        (
            np.array([[3, 0, 0, 1, 1]]),
            values,
            {"derived_gaps": np.array([0]), "derived_starts": np.array([0])},
            "without derived_starts",
        ),
    ):
        with pytest.raises(ValueError, match=match):
            decode_steps(chain.program, chain.externals(6), 0, 1, 2, 3, logits, none, tokens, seconds,
                         derived=derived, derived_values=dv, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="mask external -1 out of"):
        decode_steps(chain.program, chain.externals(6), 0, -1, 2, 3, logits, none, tokens, seconds)
    with pytest.raises(ValueError, match="token external -1 out of"):
        decode_steps(chain.program, chain.externals(6), -1, 1, 2, 3, logits, none, tokens, seconds)
    with pytest.raises(ValueError, match="head externals given without a head program"):
        decode_steps(chain.program, chain.externals(6), 0, 1, 2, 3, logits, none, tokens, seconds, head_token_ext=0)
    with pytest.raises(ValueError, match=r"head token external 5 out of \[0, 5\)"):
        decode_steps(chain.program, chain.externals(6), 0, 1, 2, 3, logits, none, tokens, seconds,
                     head=chain.program, head_externals=chain.externals(6), head_token_ext=5)  # fmt: skip
    with pytest.raises(ValueError, match="external 3 must be int64, one per row"):
        decode_steps(chain.program, chain.externals(6), 0, 1, 2, 3, logits, none, tokens, seconds,
                     head=chain.program, head_externals=chain.externals(6), head_token_ext=3)  # fmt: skip
    np.testing.assert_array_equal(chain.kc, kc)
    assert chain.io[0, 0] == 2
