"""onnxkv._kernels.step.Program and _record.Recorder: recorded kernel calls replayed bit for bit,
external arrays checked before anything runs."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from onnxkv._kernels._record import Recorder
from onnxkv._kernels.activation import silu, silu_mul
from onnxkv._kernels.convert import f32_to_bf16
from onnxkv._kernels.matmul import matmul_packed, pack_weight
from onnxkv._kernels.norm import rms_norm, skip_rms_norm
from onnxkv._kernels.step import Program

from .conftest import rand


@pytest.mark.parametrize("rows,k,n", [(1, 64, 48), (3, 40, 100), (8, 128, 256)])
def test_replay_equals_the_calls_run_one_by_one(simd, threads, rows, k, n):
    rng = np.random.default_rng(rows * 1000 + k)
    w1, w2 = pack_weight(rand(rng, (k, n))), pack_weight(rand(rng, (k, n)))
    g, bias = rand(rng, (k,)), rand(rng, (k,))

    def chain(x, skip, h, s, up, gate, act):
        """Every replayable kind: a norm reading an external, products, activations, a skip norm."""
        rms_norm(x, g, 1e-5, h)
        matmul_packed(h, w1, gate)
        matmul_packed(h, w2, up, bias=bias[:n].copy() if n <= k else None)
        silu(gate, gate)
        silu_mul(gate, up, act)
        skip_rms_norm(x, skip, g, bias, 1e-5, h, s)

    def buffers():
        f = np.float32
        return [np.empty((rows, k), f), np.empty((rows, k), f)] + [np.empty((rows, n), f) for _ in range(3)]

    x, skip = rand(rng, (rows, k)), rand(rng, (rows, k))
    got = buffers()
    rec = Recorder()
    with rec:
        chain(x, skip, *got)
    assert not rec.refused and [c[0] for c in rec.calls] == [2, 1, 1, 4, 4, 3]
    program = Program(rec.calls, [x, skip])
    assert program.externals == 2 and program.calls_count == 6
    for _ in range(2):
        x2, skip2 = rand(rng, (rows, k)), rand(rng, (rows, k))
        assert program.run([x2, skip2])
        want = buffers()
        chain(x2, skip2, *want)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


def test_baked_arrays_stay_alive_after_the_caller_drops_them():
    rng = np.random.default_rng(1)
    x = rand(rng, (2, 32))
    rec = Recorder()
    with rec:
        out = np.empty((2, 16), np.float32)
        matmul_packed(x, pack_weight(rand(rng, (32, 16))), out)  # the packed weight: only the recorder holds it
    program = Program(rec.calls, [x])
    del rec
    x2 = rand(rng, (2, 32))
    before = out.copy()
    assert program.run([x2])
    assert not np.array_equal(out, before)


def _one_norm_program(rng, rows=2, k=16):
    x, g = rand(rng, (rows, k)), rand(rng, (k,))
    out = np.empty((rows, k), np.float32)
    rec = Recorder()
    with rec:
        rms_norm(x, g, 1e-5, out)
    return Program(rec.calls, [x]), x, out


def test_run_refuses_external_arrays_unlike_the_recorded_ones_and_runs_nothing():
    rng = np.random.default_rng(2)
    program, x, out = _one_norm_program(rng)
    out[...] = 7.0
    for bad in (
        rand(rng, (3, 16)),  # shape
        rand(rng, (2, 16), np.float64),  # dtype
        rand(rng, (2, 32))[:, ::2],  # not C-contiguous
        out,  # memory the program writes
        [[1.0] * 16] * 2,  # not an array with a buffer of floats
    ):
        assert not program.run([bad])
    assert not program.run([])  # count
    np.testing.assert_array_equal(out, 7.0)


def test_an_external_the_program_writes_must_be_writable():
    rng = np.random.default_rng(3)
    x, g = rand(rng, (2, 16)), rand(rng, (16,))
    rec = Recorder()
    with rec:
        rms_norm(x, g, 1e-5, x)  # in place: the external is written
    program = Program(rec.calls, [x])
    y = rand(rng, (2, 16))
    y.flags.writeable = False
    assert not program.run([y])
    y = rand(rng, (2, 16))
    want = np.empty_like(y)
    rms_norm(y, g, 1e-5, want)
    assert program.run([y])
    np.testing.assert_array_equal(y, want)


def test_operand_straddling_an_external_is_refused_at_build():
    rng = np.random.default_rng(4)
    big = rand(rng, (4, 16))
    g = rand(rng, (16,))
    out = np.empty((2, 16), np.float32)
    rec = Recorder()
    with rec:
        rms_norm(big[1:3], g, 1e-5, out)
    with pytest.raises(ValueError, match="straddles external array 0"):
        Program(rec.calls, [big[2:]])


def test_calls_that_cannot_be_replayed_are_refused_not_noted():
    rng = np.random.default_rng(5)
    rec = Recorder()
    with rec:
        rms_norm(rand(rng, (2, 8), np.float64), rand(rng, (8,), np.float64), 1e-5, np.empty((2, 8)))
        rms_norm(np.empty((0, 8), np.float32), rand(rng, (8,)), 1e-5, np.empty((0, 8), np.float32))
        silu(rand(rng, (4,), np.float64), np.empty(4))
        matmul_packed(np.empty((0, 8), np.float32), pack_weight(rand(rng, (8, 16))), np.empty((0, 16), np.float32))
    assert rec.calls == []
    assert rec.refused == [
        "rms_norm: float64 is not replayed",
        "rms_norm: an empty input (nothing written)",
        "activation: float64 is not replayed",
        "matmul_packed: an empty product (nothing or only the bias written)",
    ]


def test_a_recorder_notes_its_own_thread_only_and_does_not_nest():
    rng = np.random.default_rng(6)
    x, g = rand(rng, (2, 8)), rand(rng, (8,))
    rec = Recorder()
    with rec:
        other = threading.Thread(target=rms_norm, args=(x, g, 1e-5, np.empty_like(x)))
        other.start()
        other.join()
        with pytest.raises(RuntimeError, match="already installed"), Recorder():
            pass
    assert rec.calls == []
    rms_norm(x, g, 1e-5, np.empty_like(x))  # uninstalled: noted nowhere
    assert rec.calls == []


def test_unknown_kinds_are_refused_at_build():
    with pytest.raises(ValueError, match="call 0 has an unknown kind"):
        Program([(99, (), (), ())], [])


def test_more_than_64_externals_are_refused_at_build():
    externals = [np.zeros(1, np.float32) for _ in range(65)]
    with pytest.raises(ValueError, match="65 external arrays, at most 64"):
        Program([], externals)


#: Element types of a decode call's caches (as the kernel takes them) by _record.DECODE_CACHE_TYPES name.
CACHE_TYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def _decode_call(rng, hq=4, hkv=2, d=16, cap=12, rows=20, rot=True, n=1, tokens=np.float32, cache="float32"):
    """The arrays and parameters of one recorded decode-token call of ``n`` tokens (the operand order of
    _record.pxd) of ``tokens`` (float32 or float16) into ``cache`` caches (a DECODE_CACHE_TYPES name)."""
    from onnxkv._kernels._record import DECODE_CACHE_TYPES, DECODE_TOKEN

    q, k, v = (rand(rng, (1, n, w)).astype(tokens) for w in (hq * d, hkv * d, hkv * d))
    cos, sin = (rand(rng, (rows, d // 2)), rand(rng, (rows, d // 2))) if rot else (None, None)
    kc, vc = (_cache_values(rand(rng, (1, hkv, cap, d)), cache) for _ in range(2))
    seq, total = np.array([0], np.int32), np.array([0], np.int32)
    out, io = np.empty((1, n, hq * d), tokens), np.zeros((2, 1), np.int64)
    undo = np.empty((2, 1, hkv, n, d), kc.dtype)
    half = 0 if cos is None else d // 2
    ints = (hq, hkv, cap, d, half, 0, -1, rows, n, hq * d, hkv * d, hkv * d, int(tokens == np.float16))
    ints += (DECODE_CACHE_TYPES[cache], 1)
    call = (DECODE_TOKEN, (q, k, v, cos, sin, kc, vc, seq, total, out, io, undo), ints, (d**-0.5, 0.0))
    arrays = dict(q=q, k=k, v=v, cos=cos, sin=sin, kc=kc, vc=vc, seq=seq, total=total, out=out, io=io, undo=undo)
    return call, arrays


def test_decode_cache_type_codes_are_the_kernels():
    import importlib

    from onnxkv._kernels._record import DECODE_CACHE_TYPES

    assert DECODE_CACHE_TYPES == importlib.import_module("onnxkv._kernels.attention")._KV_TYPES


@pytest.mark.parametrize("tokens, cache, ints", [(np.float32, "float32", (1, 0)), (np.float16, "float16", (1, 0)),
                                                 (np.float16, "float16", (0, 1)), (np.float32, "float16", (0, 0))])  # fmt: skip
def test_a_decode_call_whose_types_are_not_its_arrays_is_refused(tokens, cache, ints):
    call, a = _decode_call(np.random.default_rng(1), tokens=tokens, cache=cache)
    bad = (call[0], call[1], call[2][:12] + ints + (1,), call[3])
    with pytest.raises(ValueError, match=r"decode call 0: token and cache types .* are not its arrays'"):
        Program([bad], [a["kc"], a["vc"]])
    with pytest.raises(ValueError, match=r"decode call 0: token and cache types \(\) are not its arrays'"):
        Program([(call[0], call[1], call[2][:12], call[3])], [a["kc"], a["vc"]])


def _cache_values(x: np.ndarray, cache: str) -> np.ndarray:
    """float32 values ``x`` as a cache of type ``cache`` holds them (bfloat16: uint16 bit patterns)."""
    if cache != "bfloat16":
        return x.astype(CACHE_TYPES[cache])
    out = np.empty(x.shape, np.uint16)
    f32_to_bf16(np.ascontiguousarray(x), out)
    return out


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("rot", [True, False], ids=["rotary", "plain"])
@pytest.mark.parametrize(
    "tokens, cache",
    [
        (np.float32, "float32"),
        (np.float32, "float16"),
        (np.float32, "bfloat16"),
        (np.float16, "float16"),
        (np.float16, "bfloat16"),
    ],
    ids=["f32", "f32-f16cache", "f32-bf16cache", "f16", "f16-bf16cache"],
)
def test_a_decode_token_replay_reads_its_position_and_equals_the_kernel(simd, threads, rot, n, tokens, cache):
    """seqlens_k is the last token's position: the n tokens start at seqlens_k + 1 - n (the committed length)."""
    from onnxkv._kernels import decode_token

    rng = np.random.default_rng(7 + n)
    call, a = _decode_call(rng, cap=14, rows=12, rot=rot, n=n, tokens=tokens, cache=cache)
    program = Program([call], [a["kc"], a["vc"]])
    kv_dtype = "bfloat16" if cache == "bfloat16" else None
    for pos in (1, 4, 12 - n):
        kc, vc = a["kc"].copy(), a["vc"].copy()  # new cache buffers of the same shape: externals
        a["seq"][0], a["total"][0], a["io"][0] = pos + n - 1, pos + n, pos
        a["q"][:] = rand(rng, a["q"].shape)  # baked operands: read at their recorded addresses
        wk, wv, want = kc.copy(), vc.copy(), np.empty_like(a["out"])
        assert decode_token(
            a["q"], a["k"], a["v"], a["cos"], a["sin"], False, wk, wv, pos, 16**-0.5, 0.0, -1, want, kv_dtype=kv_dtype
        )
        assert program.run([kc, vc])
        np.testing.assert_array_equal(a["out"], want)
        np.testing.assert_array_equal(kc, wk)
        np.testing.assert_array_equal(vc, wv)
        assert a["io"][1] == pos


@pytest.mark.parametrize("n", [2, 5])
def test_a_decode_replay_of_several_tokens_refuses_positions_it_cannot_take(n):
    """Not the committed length, total not the last position + 1, past the rotary tables (12 rows; the
    capacity is 14), the first tokens of a sequence: nothing written."""
    call, a = _decode_call(np.random.default_rng(n), cap=14, rows=12, n=n)
    program = Program([call], [a["kc"], a["vc"]])
    for seq, total, committed in ((n + 3, n + 4, 3), (n + 3, n + 3, 4), (12, 13, 13 - n), (n - 1, n, 0)):
        _assert_refused(program, a, seq, total, committed)


def _assert_refused(program, a, seq, total, committed):
    """The decode call of ``_decode_call`` arrays ``a`` refuses seqlens_k ``seq``, total ``total`` at committed
    length ``committed``: the run returns False and writes no cache byte, no output and no position."""
    a["seq"][0], a["total"][0], a["io"][:, 0] = seq, total, (committed, -7)
    kc, vc, out = a["kc"].copy(), a["vc"].copy(), a["out"].copy()
    assert not program.run([a["kc"], a["vc"]])
    np.testing.assert_array_equal(a["kc"], kc)
    np.testing.assert_array_equal(a["vc"], vc)
    np.testing.assert_array_equal(a["out"], out)
    assert a["io"][1] == -7


@pytest.mark.parametrize(
    "seq,total,committed",
    [(5, 6, 4), (5, 5, 5), (0, 1, 0), (12, 13, 12), (-1, 0, -1), (2**31 - 1, -(2**31), 2**31 - 1)],
    ids=["not-the-committed-length", "total-not-pos-plus-one", "first-token", "past-capacity", "negative", "wrap"],
)
def test_a_decode_token_replay_refuses_positions_it_cannot_take_and_writes_nothing(seq, total, committed):
    rng = np.random.default_rng(8)
    call, a = _decode_call(rng, cap=12, rows=20)
    _assert_refused(Program([call], [a["kc"], a["vc"]]), a, seq, total, committed)


def test_a_decode_token_replay_refuses_rotary_tables_shorter_than_the_position():
    rng = np.random.default_rng(9)
    call, a = _decode_call(rng, cap=12, rows=6)
    program = Program([call], [a["kc"], a["vc"]])
    a["seq"][0], a["total"][0], a["io"][0] = 6, 7, 6
    assert not program.run([a["kc"], a["vc"]])
    a["seq"][0], a["total"][0], a["io"][0] = 5, 6, 5
    assert program.run([a["kc"], a["vc"]])


def test_written_externals_must_not_overlap_another_external():
    rng = np.random.default_rng(10)
    call, a = _decode_call(rng)
    program = Program([call], [a["kc"], a["vc"]])
    a["seq"][0], a["total"][0], a["io"][0] = 3, 4, 3
    kc = a["kc"].copy()
    assert not program.run([kc, kc])  # the key and value caches one buffer: refused, nothing written
    np.testing.assert_array_equal(kc, a["kc"])
    assert program.run([a["kc"], a["vc"]])


def test_a_pinned_external_must_be_the_recorded_memory():
    # a caller's memory the calls reuse (a value an earlier segment made, whose buffer this segment writes again):
    # an operand inside the pinned external is that memory, so another array there refuses the replay
    rng = np.random.default_rng(11)
    x, y = rand(rng, (2, 16)), rand(rng, (1, 16))
    rec = Recorder()
    with rec:
        silu(y, x[1:])  # writes into the external's memory
    assert Program(rec.calls, [x]).run([x.copy()])  # unpinned: the write goes to the array passed
    program = Program(rec.calls, [x], [0])
    other = x.copy()
    assert not program.run([other])
    np.testing.assert_array_equal(other, x)
    assert program.run([x])


@pytest.mark.parametrize("rows", [1, 3, 12])
@pytest.mark.parametrize("int8", [True, False], ids=["int8", "float"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_a_block_quantized_product_replays_bit_for_bit(simd, threads, rows, int8, with_bias):
    from nbits_weights import make_weight
    from onnxkv._kernels.qmatmul import matmul_nbits, pack_nbits

    rng = np.random.default_rng(rows)
    K_, N = 96, 40
    w = pack_nbits(*make_weight(rng, K_, N, 4, 32, "uint8"), K_, N, 4, 32)
    bias = rand(rng, (N,)) if with_bias else None
    x, out = rand(rng, (rows, K_)), np.empty((rows, N), np.float32)
    rec = Recorder()
    with rec:
        matmul_nbits(x, w, out, bias, int8=int8)
    assert not rec.refused and [c[0] for c in rec.calls] == [7]
    program = Program(rec.calls, [x])
    del w  # the program keeps the weight alive
    for _ in range(2):
        x2 = rand(rng, (rows, K_))
        want = np.empty_like(out)
        matmul_nbits(x2, rec.calls[0][1][1], want, bias, int8=int8)
        assert program.run([x2])
        np.testing.assert_array_equal(out, want)


def test_an_opaque_operand_must_be_a_packed_weight():
    rng = np.random.default_rng(12)
    x, out = rand(rng, (1, 32)), np.empty((1, 16), np.float32)
    with pytest.raises(TypeError, match="PackedNBits"):
        Program([(7, (x, np.zeros(4, np.uint8), None, out), (1, 1), ())], [x])


def _mask_lengths_call(mask, seqlens, total):
    from onnxkv._kernels._record import MASK_LENGTHS

    return (MASK_LENGTHS, (mask, seqlens, total), mask.shape, ())


def _mask_lengths_twin(mask):
    """MaskLengths' values as NumPy computes them (int64 sum, minus one, to int32; total = L)."""
    return np.subtract(mask.sum(axis=1), np.int64(1)).astype(np.int32), np.int32(mask.shape[1])


@pytest.mark.parametrize("rows", [1, 3])
def test_mask_lengths_replays_any_mask_length_of_a_ragged_external_as_numpy_computes_it(rows):
    """The ragged external's last dim is read on every replay; hostile values (negative, huge: the int64 sum
    wraps) give NumPy's values; the other dims are still checked."""
    rng = np.random.default_rng(rows)
    mask = np.ones((rows, 5), np.int64)
    seqlens, total = np.empty(rows, np.int32), np.empty(1, np.int32)
    program = Program([_mask_lengths_call(mask, seqlens, total)], [mask], (), [0])
    big = np.iinfo(np.int64).max
    for length in (5, 6, 1, 40, 0):
        for values in (np.ones((rows, length), np.int64), rng.integers(-big, big, (rows, length), dtype=np.int64)):
            assert program.run([values])
            want_seqlens, want_total = _mask_lengths_twin(values)
            np.testing.assert_array_equal(seqlens, want_seqlens)
            assert total[0] == want_total
    assert not program.run([np.ones((rows + 1, 5), np.int64)])  # a different batch
    assert not program.run([np.ones((rows, 5), np.int32)])  # another dtype


def test_a_fixed_mask_external_keeps_its_recorded_length():
    mask = np.ones((1, 4), np.int64)
    seqlens, total = np.empty(1, np.int32), np.empty(1, np.int32)
    program = Program([_mask_lengths_call(mask, seqlens, total)], [mask])
    assert not program.run([np.ones((1, 5), np.int64)])
    assert program.run([np.full((1, 4), 2, np.int64)]) and seqlens[0] == 7 and total[0] == 4


def test_ragged_externals_and_prelude_calls_are_checked_at_build():
    rng = np.random.default_rng(4)
    mask = np.ones((2, 8), np.int64)
    seqlens, total = np.empty(2, np.int32), np.empty(1, np.int32)
    x, g = rand(rng, (2, 16)), rand(rng, (16,))
    rec = Recorder()
    with rec:
        rms_norm(x, g, 1e-5, x)  # writes its (external) input in place
    with pytest.raises(ValueError, match="operand 0 of call 0 lies in ragged external array 0"):
        Program(rec.calls, [x], (), [0])  # only a prelude call may take a ragged external
    with pytest.raises(ValueError, match="operand 0 of call 0 lies in ragged external array 0"):
        Program([_mask_lengths_call(mask[:1], seqlens, total)], [mask], (), [0])  # not whole
    with pytest.raises(ValueError, match="operand 0 of call 0 is not C-contiguous"):
        Program([_mask_lengths_call(mask[:, :4], seqlens, total)], [mask], (), [0])  # the calls read C order
    with pytest.raises(ValueError, match="operand 0 of prelude call 0 must be external"):
        Program([_mask_lengths_call(mask, seqlens, total)], [])  # baked: it would run before its producer
    with pytest.raises(ValueError, match="operand 1 of prelude call 0 must be external iff"):
        Program([_mask_lengths_call(mask, seqlens, total)], [mask, seqlens])
    with pytest.raises(ValueError, match="another call writes the memory a prelude call writes"):
        wide = np.empty((2, 16), np.float32)
        with Recorder() as rec2:
            rms_norm(x, g, 1e-5, wide)
        Program([_mask_lengths_call(mask, wide[0, :2].view(np.int32), total), *rec2.calls], [mask, x], (), [0])
    as_float = mask.view(np.float32)
    with Recorder() as rec3:
        rms_norm(as_float, rand(rng, (16,)), 1e-5, as_float)
    with pytest.raises(ValueError, match="prelude call 0 reads an external array a call writes"):
        Program([_mask_lengths_call(mask, seqlens, total), *rec3.calls], [mask])


def test_a_refused_call_after_a_prelude_call_runs_nothing_but_the_prelude():
    """A decode call may check what a prelude call wrote (its seqlens); when it refuses, no other call ran."""
    from onnxkv._kernels._record import DECODE_TOKEN

    rng = np.random.default_rng(5)
    call, a = _decode_call(rng)
    arrays = list(call[1])
    mask = np.ones((1, 6), np.int64)
    arrays[7], arrays[8] = np.empty(1, np.int32), np.empty(1, np.int32)
    decode = (DECODE_TOKEN, tuple(arrays), call[2], call[3])
    program = Program([_mask_lengths_call(mask, arrays[7], arrays[8]), decode], [mask, a["kc"], a["vc"]], (), [0])
    kc0 = a["kc"].copy()
    arrays[10][0] = 5  # the committed length: a mask of 6 ones gives seqlens 5, total 6
    assert program.run([mask, a["kc"], a["vc"]])
    assert arrays[10][1] == 5 and not np.array_equal(a["kc"], kc0)
    kc1 = a["kc"].copy()
    assert not program.run([np.ones((1, 8), np.int64), a["kc"], a["vc"]])  # seqlens 7: not the committed 5
    np.testing.assert_array_equal(a["kc"], kc1)
    assert arrays[7][0] == 7 and arrays[8][0] == 8  # the prelude ran (its own memory only)


def test_resizable_caches_replay_at_any_capacity_and_a_full_cache_is_refused():
    """A decode call's caches as resizable externals: the replay reads their capacity (a cache that grew, a
    new state's), refuses a position past it (``refused``: this run's values) and caches of two capacities."""
    from onnxkv._kernels import decode_token

    rng = np.random.default_rng(21)
    call, a = _decode_call(rng, cap=8, rows=40, n=2)
    program = Program([call], [a["kc"], a["vc"]], (), (), [0, 1])
    for cap, pos in ((8, 6), (20, 6), (20, 18), (5, 3)):
        kc, vc = rand(rng, (1, 2, cap, 16)), rand(rng, (1, 2, cap, 16))
        a["seq"][0], a["total"][0], a["io"][0] = pos + 1, pos + 2, pos
        wk, wv, want = kc.copy(), vc.copy(), np.empty_like(a["out"])
        assert decode_token(a["q"], a["k"], a["v"], a["cos"], a["sin"], False, wk, wv, pos, 16**-0.5, 0.0, -1, want)
        assert program.run([kc, vc]) and not program.refused
        np.testing.assert_array_equal(a["out"], want)
        np.testing.assert_array_equal(kc, wk)
        np.testing.assert_array_equal(vc, wv)
    kc, vc = rand(rng, (1, 2, 7, 16)), rand(rng, (1, 2, 7, 16))
    a["seq"][0], a["total"][0], a["io"][0] = 6, 7, 5  # tokens 5 and 6 need a capacity of 7: fits
    assert program.run([kc, vc])
    a["seq"][0], a["total"][0], a["io"][0] = 7, 8, 6  # 6 and 7: past it
    before = kc.copy()
    assert not program.run([kc, vc]) and program.refused
    np.testing.assert_array_equal(kc, before)
    assert not program.run([kc, rand(rng, (1, 2, 9, 16))]) and program.refused  # two capacities
    assert not program.run([kc, rand(rng, (1, 3, 7, 16))]) and not program.refused  # another head count


def test_only_a_decode_calls_caches_may_be_resizable():
    rng = np.random.default_rng(22)
    x = rand(rng, (1, 2, 8, 16))
    rec = Recorder()
    with rec:
        rms_norm(x.reshape(16, 16), rand(rng, (16,)), 1e-5, np.empty((16, 16), np.float32))
    with pytest.raises(ValueError, match="lies in resizable external array 0"):
        Program(rec.calls, [x], (), (), [0])
