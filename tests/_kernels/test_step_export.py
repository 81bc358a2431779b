"""The compiled-step kinds of an export's decode (onnxkv._kernels.step): rotary calls, cache-row appends and masked
attention over resizable caches with a ragged mask, replayed bit for bit the kernels' calls and checked against
their NumPy twins, refusing what the operators would not take with nothing written."""

from __future__ import annotations

import numpy as np
import pytest
from onnxkv._kernels._record import CACHE_ROWS, CONVERT, MASKED_DECODE, Recorder
from onnxkv._kernels.rotary import rotary_embedding
from onnxkv._kernels.step import Program

from onnxkv._kernels import add, attention, reference

from .conftest import rand

HIDDEN = np.float32(-3.4028235e38)


def test_a_rotary_replay_reads_its_positions_and_equals_the_kernel_and_its_twin(simd, threads):
    rng = np.random.default_rng(1)
    x, cos, sin = rand(rng, (2, 3, 4, 16)), rand(rng, (20, 6)), rand(rng, (20, 6))
    positions = np.array([[1, 2, 3], [7, 8, 9]], np.int64)
    out = np.empty_like(x)
    rec = Recorder()
    with rec:
        rotary_embedding(x, cos, sin, positions, False, out)
    program = Program(rec.calls, [x, positions])
    for pos in ([[0, 5, 19], [3, 3, 3]], [[19, 18, 17], [0, 1, 2]]):
        x2, p2 = rand(rng, x.shape), np.array(pos, np.int64)
        assert program.run([x2, p2])
        want = np.empty_like(x)
        rotary_embedding(x2, cos, sin, p2, False, want)
        np.testing.assert_array_equal(out, want)
        twin = np.empty_like(x)
        reference.rotary_embedding(x2, cos, sin, p2, False, twin)
        np.testing.assert_allclose(out, twin, rtol=1e-5, atol=1e-5)
    before = out.copy()
    assert not program.run([x2, np.array([[0, 1, 20], [0, 0, 0]], np.int64)]) and program.refused
    assert not program.run([x2, np.array([[0, 1, -1], [0, 0, 0]], np.int64)]) and program.refused
    np.testing.assert_array_equal(out, before)


def _export_program(rng, b=2, hq=4, hkv=2, s=1, d=16, cap=8, t=5, mb=2, ms=1, dtype=np.float32):
    """Two recorded calls as an export's layer makes them: the new keys appended to the K cache at the
    committed length, then the masked attention over both caches; externals (new, K cache, V cache, mask, q).
    ``dtype`` float16: a float16 file's block (q, out, caches and additive mask float16)."""
    new, q = rand(rng, (b, hkv, s, d)).astype(dtype), rand(rng, (b, hq, s, d)).astype(dtype)
    kc, vc = rand(rng, (b, hkv, cap, d)).astype(dtype), rand(rng, (b, hkv, cap, d)).astype(dtype)
    mask = np.zeros((mb, 1, ms, t), dtype)
    out, pos_rows, pos_attn = np.empty_like(q), np.zeros(1, np.int64), np.zeros(1, np.int64)
    scratch = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros((b, s), np.int32)
    half = int(dtype == np.float16)
    calls = [
        (CACHE_ROWS, (new, kc, pos_rows), (b, hkv, s, d, cap, 2 if half else 4), ()),
        (
            MASKED_DECODE,
            (q, kc, vc, mask, out, pos_attn, *scratch),
            (b, hq, hkv, s, d, cap, mb, ms, t, 2 if half else 0, 0, half, half),
            (0.25, 0.0),
        ),
    ]
    program = Program(calls, [new, kc, vc, mask, q], (), [3], [1, 2])
    return program, out, (pos_rows, pos_attn)


def _padded_causal_mask(starts, s, t, mb, dtype=np.float32, hidden=HIDDEN):
    """Row b sees keys starts[b] .. its query's position (the last s keys are the new tokens)."""
    mask = np.full((mb, 1, s, t), hidden, dtype)
    for b in range(mb):
        for j in range(s):
            mask[b, 0, j, starts[b] : t - s + j + 1] = 0.0
    return mask


@pytest.mark.parametrize("s", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_an_append_then_masked_attention_replays_any_length_and_capacity_as_the_kernels(simd, threads, s, dtype):
    """float16: q widened, the float16 caches read as they are, the float32 result rounded once (the operator's
    Python path); its mask hides keys with -inf."""
    rng = np.random.default_rng(2 + s)
    program, out, (pos_rows, pos_attn) = _export_program(rng, s=s, ms=s, dtype=dtype)
    hidden = HIDDEN if dtype == np.float32 else -np.inf
    for committed, cap, starts in ((4, 8, [0, 2]), (9, 16, [3, 0]), (15, 18, [0, 0])):
        t = committed + s
        new, q = rand(rng, (2, 2, s, 16)).astype(dtype), rand(rng, (2, 4, s, 16)).astype(dtype)
        kc, vc = rand(rng, (2, 2, cap, 16)).astype(dtype), rand(rng, (2, 2, cap, 16)).astype(dtype)
        mask = _padded_causal_mask(starts, s, t, 2, dtype, hidden)
        wk = kc.copy()
        wk[:, :, committed:t] = new
        pos_rows[0] = pos_attn[0] = committed
        assert program.run([new, kc, vc, mask, q]) and not program.refused
        np.testing.assert_array_equal(kc, wk)
        q_pos = np.array([[t - s + j for j in range(s)]] * 2, np.int32)
        kv_len, kv_start = np.full(2, t, np.int32), np.array(starts, np.int32)
        wide, qf = np.empty(q.shape, np.float32), q.astype(np.float32)
        attention(qf, kc, vc, kv_len, q_pos, 0.25, 0.0, -1, wide, kv_start)
        np.testing.assert_array_equal(out, wide.astype(dtype))
        twin = np.empty(q.shape, np.float32)
        reference.attention(qf, kc, vc, kv_len, q_pos, 0.25, 0.0, -1, twin, kv_start)
        tol = 1e-5 if dtype == np.float32 else 2e-3
        np.testing.assert_allclose(out.astype(np.float32), twin, rtol=tol, atol=tol)


@pytest.mark.parametrize("hidden", [np.float16(-65504.0), np.float16(-1.0), np.float16(np.nan)])
def test_a_float16_mask_with_a_finite_or_nan_masked_value_is_refused_with_nothing_written(hidden):
    """-65504 (an export's finfo(float16).min) hides a key only while the scores are small: the operator's
    Python path checks that bound, a replay does not take such a mask."""
    rng = np.random.default_rng(11)
    program, out, (pos_rows, pos_attn) = _export_program(rng, dtype=np.float16)
    new, q = rand(rng, (2, 2, 1, 16)).astype(np.float16), rand(rng, (2, 4, 1, 16)).astype(np.float16)
    kc, vc = rand(rng, (2, 2, 8, 16)).astype(np.float16), rand(rng, (2, 2, 8, 16)).astype(np.float16)
    pos_rows[0] = pos_attn[0] = 5
    assert program.run([new, kc.copy(), vc, _padded_causal_mask([1, 0], 1, 6, 2, np.float16, -np.inf), q])
    before_k, before_out = kc.copy(), out.copy()
    assert not program.run([new, kc, vc, _padded_causal_mask([1, 0], 1, 6, 2, np.float16, hidden), q])
    assert program.refused
    np.testing.assert_array_equal(kc, before_k)
    np.testing.assert_array_equal(out, before_out)


def test_a_masked_decode_call_whose_types_are_not_its_arrays_is_refused():
    rng = np.random.default_rng(12)
    q, kc = rand(rng, (1, 2, 1, 8)), rand(rng, (1, 1, 4, 8))
    mask, out = np.zeros((1, 1, 1, 3), np.float32), np.empty((1, 2, 1, 8), np.float32)
    arrays = (
        q,
        kc,
        kc.copy(),
        mask,
        out,
        np.zeros(1, np.int64),
        *(np.zeros(1, np.int32),) * 2,
        np.zeros((1, 1), np.int32),
    )
    for kinds in ((0, 0, 1, 0), (0, 0, 0, 1), (2, 0, 0, 0), (1, 0, 0, 0), (0, 0)):
        call = (MASKED_DECODE, arrays, (1, 2, 1, 1, 8, 4, 1, 1, 3, *kinds), (0.5, 0.0))
        with pytest.raises(ValueError, match=r"masked decode call 0: mask, token and cache types"):
            Program([call], [kc, arrays[2], mask], (), [2], [0, 1])


def _hole(mask):
    mask[1, 0, 0, 1] = HIDDEN  # row 1 sees keys 0 and 2.. but not 1


def _empty_row(mask):
    mask[0] = HIDDEN  # row 0 sees nothing: the operator's literal path


def _nan(mask):
    mask[0, 0, 0, 2] = np.nan


def _not_hidden_enough(mask):
    mask[0, 0, 0, 0] = -1e29  # exp(-1e29 + score) is not provably 0 next to every visible score


@pytest.mark.parametrize("spoil", [_hole, _empty_row, _nan, _not_hidden_enough])
def test_a_mask_the_kernel_cannot_describe_is_refused_with_nothing_written(spoil):
    rng = np.random.default_rng(7)
    program, out, (pos_rows, pos_attn) = _export_program(rng)
    new, q = rand(rng, (2, 2, 1, 16)), rand(rng, (2, 4, 1, 16))
    kc, vc = rand(rng, (2, 2, 8, 16)), rand(rng, (2, 2, 8, 16))
    mask = _padded_causal_mask([0, 0], 1, 6, 2)
    spoil(mask)
    pos_rows[0] = pos_attn[0] = 5
    before_k, before_out = kc.copy(), out.copy()
    assert not program.run([new, kc, vc, mask, q]) and program.refused
    np.testing.assert_array_equal(kc, before_k)
    np.testing.assert_array_equal(out, before_out)


@pytest.mark.parametrize(
    "committed,t,cap", [(4, 6, 8), (5, 5, 8), (8, 9, 8)], ids=["mask-too-long", "mask-too-short", "cache-full"]
)
def test_lengths_that_disagree_with_the_cache_are_refused_with_nothing_written(committed, t, cap):
    rng = np.random.default_rng(8)
    program, out, (pos_rows, pos_attn) = _export_program(rng)
    new, q = rand(rng, (2, 2, 1, 16)), rand(rng, (2, 4, 1, 16))
    kc, vc = rand(rng, (2, 2, cap, 16)), rand(rng, (2, 2, cap, 16))
    pos_rows[0] = pos_attn[0] = committed
    before = kc.copy()
    assert not program.run([new, kc, vc, _padded_causal_mask([0, 0], 1, t, 2), q]) and program.refused
    np.testing.assert_array_equal(kc, before)


def test_the_new_kinds_take_caches_and_masks_only_whole():
    rng = np.random.default_rng(9)
    program, *_ = _export_program(rng)
    assert program.externals == 5
    new, kc = rand(rng, (2, 2, 1, 16)), rand(rng, (2, 2, 8, 16))
    pos = np.zeros(1, np.int64)
    rows = [(CACHE_ROWS, (new, kc[:1], pos), (1, 2, 1, 16, 8, 4), ())]  # half of a resizable cache
    with pytest.raises(ValueError, match="resizable"):
        Program(rows, [new, kc], (), (), [1])


def test_a_residual_add_replays_as_numpy_adds(simd, threads):
    rng = np.random.default_rng(10)
    x, y = rand(rng, (3, 64)), rand(rng, (3, 64))
    out = np.empty_like(x)
    rec = Recorder()
    with rec:
        add(x.reshape(-1), y.reshape(-1), out.reshape(-1))
    program = Program(rec.calls, [x, y])
    for _ in range(2):
        x2, y2 = rand(rng, x.shape, scale=50.0), rand(rng, y.shape)
        assert program.run([x2, y2])
        np.testing.assert_array_equal(out, x2 + y2)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # infinities, as intended
def test_float16_conversions_replay_as_the_kernels_and_numpys_casts(simd, threads):
    """A float16 node's widening and rounding (convert.f16_to_f32 / f32_to_f16) replay bit for bit: NumPy's
    casts, subnormals, overflow to infinity and infinities included, at any size the chunked kernel splits."""
    from onnxkv._kernels import f16_to_f32, f32_to_f16

    rng = np.random.default_rng(11)
    for n in (7, 4096, 70000):
        h = (rng.standard_normal(n) * rng.choice([1e-6, 1.0, 3e4], n)).astype(np.float16)
        wide, back = np.empty(n, np.float32), np.empty(n, np.float16)
        rec = Recorder()
        with rec:
            f16_to_f32(h, wide)
            np.multiply(wide, 3.0, out=wide)  # NumPy, not recorded: the replay below does not redo it
            f32_to_f16(wide, back)
        assert [c[0] for c in rec.calls] == [CONVERT, CONVERT]
        program = Program(rec.calls, [h])
        for _ in range(2):
            h2 = (rng.standard_normal(n) * 2e4).astype(np.float16)
            h2[:3] = [np.inf, -np.inf, 6e-8]
            assert program.run([h2])
            np.testing.assert_array_equal(wide, h2.astype(np.float32))
            np.testing.assert_array_equal(back.view(np.uint16), wide.astype(np.float16).view(np.uint16))


def test_cache_rows_of_a_float16_cache_replay_at_the_committed_length():
    """A float16 model's cache join: its float16 rows copied as they are at the committed length; element
    bytes other than the arrays' are refused when the program is built."""
    rng = np.random.default_rng(12)
    new = rand(rng, (2, 3, 1, 8)).astype(np.float16)
    kc = np.zeros((2, 3, 6, 8), np.float16)
    pos = np.zeros(1, np.int64)
    program = Program([(CACHE_ROWS, (new, kc, pos), (2, 3, 1, 8, 6, 2), ())], [new, kc], (), (), [1])
    for p in (0, 4, 5):
        pos[0] = p
        n2 = rand(rng, new.shape).astype(np.float16)
        assert program.run([n2, kc])
        np.testing.assert_array_equal(kc[:, :, p : p + 1], n2)
    pos[0] = 6
    before = kc.copy()
    assert not program.run([n2, kc]) and program.refused
    np.testing.assert_array_equal(kc, before)
    with pytest.raises(ValueError, match="element bytes"):
        Program([(CACHE_ROWS, (new, kc, pos), (2, 3, 1, 8, 6, 4), ())], [new, kc], (), (), [1])
