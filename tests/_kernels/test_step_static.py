"""The compiled-step kinds of the static-cache form (onnxkv._kernels.step): rows scattered into a static cache at
positions read when replayed, the bytes they replace saved, and attention over the whole caches up to each row's
``nonpad_kv_seqlen``, replayed bit for bit the kernels' calls and checked against their NumPy twins, refusing what
the operators would not take with nothing written."""

from __future__ import annotations

import numpy as np
import pytest
from onnxkv._kernels._record import NONPAD_DECODE, SCATTER_ROWS
from onnxkv._kernels.step import Program

from onnxkv._kernels import attention, reference

from .conftest import rand

B, HQ, HKV, D, CAP = 2, 4, 2, 16, 12


def _static_program(rng, s=1, mb=B, ms=1, mask_dtype=np.bool_, causal=1):
    """The calls of a static-cache layer: the new keys scattered into the K cache at write_indices, then the
    attention over both whole caches up to ``ends``; externals (new, K cache, V cache, mask, q, write_indices,
    ends).  Returns (program, out, saved, starts)."""
    new, q = rand(rng, (B, HKV, s, D)), rand(rng, (B, HQ, s, D))
    kc, vc = rand(rng, (B, HKV, CAP, D)), rand(rng, (B, HKV, CAP, D))
    mask = np.zeros((mb, 1, ms, CAP), mask_dtype)
    w, ends = np.zeros(B, np.int64), np.ones(B, np.int64)
    out, saved, starts = np.empty_like(q), np.zeros_like(new), np.zeros(B, np.int64)
    scratch = np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros((B, s), np.int32)
    kind = 1 if mask_dtype == np.bool_ else 0
    calls = [
        (SCATTER_ROWS, (new, kc, w, saved, starts), (B, HKV, s, D, CAP, 4), ()),
        (
            NONPAD_DECODE,
            (q, kc, vc, mask, out, ends, *scratch),
            (B, HQ, HKV, s, D, CAP, mb, ms, CAP, kind, causal, 0, 0),
            (0.25, 0.0),
        ),
    ]
    program = Program(calls, [new, kc, vc, mask, q, w, ends], (), (), [1, 2])
    return program, out, saved, starts


def _row_mask(first, ends, s, dtype):
    """Row b shows the keys first[b] .. ends[b] - 1 (every query; the causal bound does the rest)."""
    shown, hidden = (True, False) if dtype == np.bool_ else (0.0, -np.inf)
    mask = np.full((B, 1, s, CAP), hidden, dtype)
    for b in range(B):
        mask[b, 0, :, first[b] : ends[b]] = shown
    return mask


@pytest.mark.parametrize("s", [1, 3])
@pytest.mark.parametrize("mask_dtype", [np.bool_, np.float32], ids=["bool", "additive"])
def test_scattered_rows_then_attention_up_to_each_rows_end_replay_as_the_kernels(simd, threads, s, mask_dtype):
    rng = np.random.default_rng(3 + s)
    program, out, saved, starts = _static_program(rng, s=s, ms=s, mask_dtype=mask_dtype)
    for w, first in (([0, 4], [0, 1]), ([CAP - s, 2], [3, 0]), ([5, 5], [0, 0])):
        w = np.array(w, np.int64)
        ends = w + s
        new, q = rand(rng, (B, HKV, s, D)), rand(rng, (B, HQ, s, D))
        kc, vc = rand(rng, (B, HKV, CAP, D)), rand(rng, (B, HKV, CAP, D))
        mask = _row_mask(first, ends, s, mask_dtype)
        want_k, replaced = kc.copy(), np.stack([kc[b, :, w[b] : w[b] + s] for b in range(B)])
        for b in range(B):
            want_k[b, :, w[b] : w[b] + s] = new[b]
        assert program.run([new, kc, vc, mask, q, w, ends]) and not program.refused
        np.testing.assert_array_equal(kc, want_k)
        np.testing.assert_array_equal(saved, replaced)
        np.testing.assert_array_equal(starts, w)
        q_pos = (ends[:, None] - s + np.arange(s)[None, :]).astype(np.int32)
        kv_len, kv_start = ends.astype(np.int32), np.array(first, np.int32)
        direct = np.empty_like(q)
        attention(q, kc, vc, kv_len, q_pos, 0.25, 0.0, -1, direct, kv_start)
        np.testing.assert_array_equal(out, direct)
        twin = np.empty_like(q)
        reference.attention(q, kc, vc, kv_len, q_pos, 0.25, 0.0, -1, twin, kv_start)
        np.testing.assert_allclose(out, twin, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "spoil",
    ["index-negative", "index-past-capacity", "end-past-keys", "end-negative", "end-before-mask"],
)
def test_positions_and_ends_the_operators_would_refuse_are_refused_with_nothing_written(spoil):
    rng = np.random.default_rng(9)
    program, out, saved, starts = _static_program(rng)
    new, q = rand(rng, (B, HKV, 1, D)), rand(rng, (B, HQ, 1, D))
    kc, vc = rand(rng, (B, HKV, CAP, D)), rand(rng, (B, HKV, CAP, D))
    w = np.array([3, 6], np.int64)
    ends, first = w + 1, [0, 2]
    assert program.run([new, kc.copy(), vc, _row_mask(first, ends, 1, np.bool_), q, w, ends])
    before = kc.copy(), out.copy(), saved.copy(), starts.copy()
    if spoil == "index-negative":
        w = np.array([-1, 6], np.int64)
    elif spoil == "index-past-capacity":
        w = np.array([3, CAP], np.int64)
    elif spoil == "end-past-keys":
        ends = np.array([4, CAP + 1], np.int64)
    elif spoil == "end-negative":
        ends = np.array([-1, 7], np.int64)
    else:  # row 1's end comes before the first key its mask shows: no key to attend to
        ends = np.array([4, 2], np.int64)
    mask = _row_mask(first, w + 1 if spoil == "end-before-mask" else np.maximum(ends, 1), 1, np.bool_)
    assert not program.run([new, kc, vc, mask, q, w, ends]) and program.refused
    for got, was in zip((kc, out, saved, starts), before, strict=True):
        np.testing.assert_array_equal(got, was)


def test_calls_whose_positions_ends_or_scratch_do_not_fit_their_rows_are_refused_when_built():
    """A call reads and writes its int64 positions and ends and its scratch as [B] (or [B, S]) arrays of those
    widths: one of another width or shape would be read or written past its end (found by fuzzing)."""
    rng = np.random.default_rng(4)
    new, kc = rand(rng, (B, HKV, 1, D)), rand(rng, (B, HKV, CAP, D))
    w, starts, saved = np.zeros(B, np.int64), np.zeros(B, np.int64), np.zeros_like(new)
    bad = [
        (np.zeros((B, HKV, 2, D), np.float32), w, starts),
        (saved, np.zeros(B + 1, np.int64), starts),
        (saved, np.zeros(B, np.int32), starts),
        (saved, w, np.zeros(B, np.int32)),
        (saved, w, np.zeros(B, np.uint64)),
    ]
    for sv, ws, st in bad:
        with pytest.raises(ValueError, match="call 0"):
            Program([(SCATTER_ROWS, (new, kc, ws, sv, st), (B, HKV, 1, D, CAP, 4), ())], [new, kc, ws])
    q, vc, out = rand(rng, (B, HQ, 1, D)), rand(rng, (B, HKV, CAP, D)), np.empty((B, HQ, 1, D), np.float32)
    mask = np.ones((B, 1, 1, CAP), np.bool_)
    for ends, kv_len, q_pos in (
        (np.zeros(1, np.int64), np.zeros(B, np.int32), np.zeros((B, 1), np.int32)),
        (np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros((B, 1), np.int32)),
        (np.zeros(B, np.int64), np.zeros(B, np.int64), np.zeros((B, 1), np.int32)),
        (np.zeros(B, np.int64), np.zeros(B, np.int32), np.zeros((B, 2), np.int32)),
    ):
        call = (NONPAD_DECODE, (q, kc, vc, mask, out, ends, kv_len, np.zeros(B, np.int32), q_pos),
                (B, HQ, HKV, 1, D, CAP, B, 1, CAP, 1, 1, 0, 0), (0.25, 0.0))  # fmt: skip
        with pytest.raises(ValueError, match="call 0"):
            Program([call], [q, kc, vc, mask, ends], (), (), [1, 2])
