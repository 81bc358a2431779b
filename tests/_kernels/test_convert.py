import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import reference as R


def _specials():
    return np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            65504.0,
            65519.99,
            65520.0,
            1e6,
            -1e6,
            6.1035156e-05,
            6.0e-08,
            5.96e-08,
            2.98e-08,
            2.99e-08,
            1e-10,
            -3.0e-06,
            1.0 + 2.0**-11,
            1.0 + 3 * 2.0**-11,
            0.1,
            -7.33,
        ],
        np.float32,
    )


@pytest.mark.parametrize("n", [1, 7, 33, 4096, 200001])
def test_f32_to_f16_matches_numpy(n, threads, simd):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * rng.choice([1e-6, 1e-3, 1.0, 1e3, 1e5], n)).astype(np.float32)
    if n >= 33:
        x[:21] = _specials()
    out, want = np.full(n, 7, np.float16), np.empty(n, np.float16)
    K.f32_to_f16(x, out)
    R.f32_to_f16(x, want)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


@pytest.mark.parametrize("n", [1, 7, 33, 65536, 200001])
def test_f16_to_f32_matches_numpy(n, threads, simd):
    bits = np.arange(n, dtype=np.uint32) % 65536  # every half value (incl. subnormals, inf, nan)
    x = bits.astype(np.uint16).view(np.float16).reshape(-1)
    out, want = np.full(n, 7, np.float32), np.empty(n, np.float32)
    K.f16_to_f32(x, out)
    R.f16_to_f32(x, want)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


def test_convert_nd_and_bad_args():
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
    h = np.empty((2, 3, 4), np.float16)
    K.f32_to_f16(x, h)
    back = np.empty_like(x)
    K.f16_to_f32(h, back)
    np.testing.assert_allclose(back, x, rtol=1e-3)
    out = np.full((2, 3, 4), 5, np.float16)
    with pytest.raises(ValueError, match="out"):
        K.f32_to_f16(x, out[:1])
    with pytest.raises(ValueError, match="x"):
        K.f32_to_f16(x.astype(np.float64), out)
    with pytest.raises(ValueError, match="out"):
        K.f16_to_f32(h, out)
    assert np.all(out == 5)


@pytest.mark.parametrize("n", [1, 7, 33, 4096, 200001])
def test_f32_to_bf16_round_to_nearest_even(n, threads, simd):
    rng = np.random.default_rng(n)
    with np.errstate(over="ignore"):  # some products overflow float32 to inf on purpose
        x = (rng.standard_normal(n) * rng.choice([1e-38, 1e-6, 1.0, 1e5, 3e38], n)).astype(np.float32)
    if n >= 33:
        x[:21] = _specials()
    if n >= 4096:  # exact ties (odd and even) and values next to them
        base = rng.integers(0, 1 << 15, 2000, dtype=np.uint32) << 16
        x[100:2100] = (base | 0x8000).view(np.float32)
        x[2100:4096] = ((base[:1996] | 0x8000) + rng.integers(-2, 3, 1996).astype(np.uint32)).view(np.float32)
        x[40:44] = np.array([3.4028235e38, -3.4028235e38, 1e-45, -1e-45], np.float32)
    out = np.full(n, 7, np.uint16)
    K.f32_to_bf16(x, out)
    want = R.bf16_from_f32(x)
    np.testing.assert_array_equal(out, want)
    back = R.f32_from_bf16(out)
    nan = np.isnan(x)
    assert np.all(np.isnan(back[nan]))
    ml_dtypes = pytest.importorskip("ml_dtypes")  # independent oracle (an ONNX dependency)
    with np.errstate(invalid="ignore", over="ignore"):
        oracle = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(want[~nan], oracle[~nan])


@pytest.mark.parametrize("n", [1, 7, 33, 65536, 200001])
def test_bf16_to_f32_exact(n, threads, simd):
    x = (np.arange(n, dtype=np.uint32) % 65536).astype(np.uint16)  # every bf16 pattern
    out = np.full(n, 7, np.float32)
    K.bf16_to_f32(x, out)
    np.testing.assert_array_equal(out.view(np.uint32), x.astype(np.uint32) << 16)
    np.testing.assert_array_equal(R.f32_from_bf16(x).view(np.uint32), x.astype(np.uint32) << 16)


def test_bf16_nd_and_bad_args():
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
    b = np.empty((2, 3, 4), np.uint16)
    K.f32_to_bf16(x, b)
    back = np.empty_like(x)
    K.bf16_to_f32(b, back)
    np.testing.assert_allclose(back, x, rtol=2**-8)
    out = np.full((2, 3, 4), 5, np.uint16)
    with pytest.raises(ValueError, match="out"):
        K.f32_to_bf16(x, out[:1])
    with pytest.raises(ValueError, match="out"):
        K.f32_to_bf16(x, out.astype(np.float16))
    with pytest.raises(ValueError, match="x"):
        K.bf16_to_f32(x, back)
    with pytest.raises(ValueError, match="x"):
        K.bf16_to_f32(b.view(np.float16), back)
    assert np.all(out == 5)


@pytest.mark.parametrize("n", [0, 1, 31, 262144 * 3 + 17])
def test_read_sum(n, threads, simd):
    x = np.random.default_rng(n).integers(-8, 9, n).astype(np.float32)  # exact small integers
    assert K.read_sum(x) == float(x.astype(np.int64).sum())
    with pytest.raises(ValueError, match="x"):
        K.read_sum(x.astype(np.float64))


@pytest.mark.parametrize("shape", [(1,), (3, 5), (2, 1, 7, 9)])
def test_copy_f32_copies_and_its_replay_copies_the_runs_values(shape):
    from onnxkv._kernels._record import Recorder
    from onnxkv._kernels.step import Program

    rng = np.random.default_rng(len(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    out = np.full(shape, np.nan, np.float32)
    rec = Recorder()
    with rec:
        K.copy_f32(x, out)
    np.testing.assert_array_equal(out, x)
    assert not np.shares_memory(out, x)
    program = Program(rec.calls, [x])
    y = rng.standard_normal(shape).astype(np.float32)
    assert program.run([y])
    np.testing.assert_array_equal(out, y)


def test_copy_f32_refuses_bad_arguments_and_a_program_a_call_its_ints_do_not_describe():
    from onnxkv._kernels._record import Recorder
    from onnxkv._kernels.step import Program

    x = np.arange(6, dtype=np.float32)
    with pytest.raises(ValueError, match="out"):
        K.copy_f32(x, np.empty(5, np.float32))
    with pytest.raises(ValueError, match="x"):
        K.copy_f32(x.astype(np.float64), np.empty(6, np.float32))
    with pytest.raises(ValueError, match="out"):
        K.copy_f32(x, x)
    rec = Recorder()
    with rec:
        K.copy_f32(x, np.empty(6, np.float32))
    kind, arrays, ints, floats = rec.calls[0]
    for bad in ((6, 3), (7, 2), (6, 0)):  # no such mode; more values than the arrays; a float16 widening of them
        with pytest.raises(ValueError, match="conversion call 0"):
            Program([(kind, arrays, bad, floats)], [x])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.bool_])
@pytest.mark.parametrize(
    "shapes, axis",
    [(((2, 3, 1, 5), (2, 3, 1, 11)), 3), (((4, 2), (1, 2)), 0), (((2, 0, 3), (2, 4, 3)), 1), (((3, 4), (3, 0)), 1)],
)
def test_concat_pair_equals_numpy_and_is_replayed(dtype, shapes, axis):
    """Rows of each operand copied in turn (an empty operand reads nothing), NumPy's concatenation bit for bit;
    a program replays the call on new operands."""
    from onnxkv._kernels._record import Recorder
    from onnxkv._kernels.step import Program

    rng = np.random.default_rng(sum(map(sum, shapes)))
    a, b = ((rng.standard_normal(s) * 50).astype(dtype) for s in shapes)
    want = np.concatenate((a, b), axis)
    out = np.full_like(want, 7)
    rec = Recorder()
    with rec:
        K.concat_pair(a, b, out, axis)
    np.testing.assert_array_equal(out, want)
    program = Program(rec.calls, [x for x in (a, b) if x.size])
    a2, b2 = ((rng.standard_normal(s) * 50).astype(dtype) for s in shapes)
    assert program.run([x for x in (a2, b2) if x.size])
    np.testing.assert_array_equal(out, np.concatenate((a2, b2), axis))


def test_concat_pair_names_bad_arguments_and_a_program_a_call_its_ints_do_not_describe():
    from onnxkv._kernels._record import Recorder
    from onnxkv._kernels.step import Program

    a, b = np.ones((2, 3), np.float32), np.zeros((2, 4), np.float32)
    out = np.empty((2, 7), np.float32)
    with pytest.raises(ValueError, match="b: shape"):
        K.concat_pair(a, np.zeros((3, 4), np.float32), np.empty((3, 7), np.float32), 1)
    with pytest.raises(ValueError, match="b: dtype"):
        K.concat_pair(a, b.astype(np.float64), out, 1)
    with pytest.raises(ValueError, match="axis 2 out of range"):
        K.concat_pair(a, b, out, 2)
    with pytest.raises(ValueError, match="out: expected shape"):
        K.concat_pair(a, b, np.empty((2, 6), np.float32), 1)
    with pytest.raises(ValueError, match="out: must not overlap a"):
        big = np.empty(14, np.float32)
        K.concat_pair(big[:6].reshape(2, 3), b, big.reshape(2, 7), 1)
    with pytest.raises(ValueError, match="numbers or booleans"):
        K.concat_pair(a.astype(object), b.astype(object), out.astype(object), 1)
    rec = Recorder()
    with rec:
        K.concat_pair(a, b, out, 1)
    kind, arrays, ints, floats = rec.calls[0]
    for bad in ((2, 12, 20), (2, 12, 0), (0, 12, 16), (2, 12)):  # more bytes than b; b read as empty; no rows
        with pytest.raises(ValueError, match="concatenation call 0"):
            Program([(kind, arrays, bad, floats)], [a, b])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
@pytest.mark.parametrize(
    "shape, index",
    [
        ((1, 3, 1, 8), (Ellipsis, slice(0, 6))),  # a rotation's part of each head
        ((1, 3, 1, 8), (Ellipsis, slice(6, None))),  # the rest
        ((2, 3, 4), (slice(None), slice(1, 3))),  # whole rows of an inner axis
        ((4, 5), (slice(None, None, 2),)),  # every other row
        ((6,), (slice(2, 5),)),  # contiguous: one row
    ],
)
def test_copy_rows_packs_a_strided_view_and_is_replayed(dtype, shape, index):
    from onnxkv._kernels._record import Recorder
    from onnxkv._kernels.step import Program

    rng = np.random.default_rng(len(shape))
    base = (rng.standard_normal(shape) * 30).astype(dtype)
    view = base[index]
    out = np.full(view.shape, 7, dtype)
    rec = Recorder()
    with rec:
        assert K.copy_rows(view, out)
    np.testing.assert_array_equal(out, view)
    program = Program(rec.calls, [base])
    base2 = (rng.standard_normal(shape) * 30).astype(dtype)
    assert program.run([base2])
    np.testing.assert_array_equal(out, base2[index])


def test_copy_rows_declines_other_layouts_and_a_program_a_call_its_ints_do_not_describe():
    from onnxkv._kernels._record import Recorder
    from onnxkv._kernels.step import Program

    base = np.arange(16, dtype=np.float32).reshape(4, 4)
    out = np.full((4, 4), 7, np.float32)
    assert not K.copy_rows(base.T, out)  # interleaved: no row layout, nothing written
    assert not K.copy_rows(base[:, ::-1], out)  # negative strides
    np.testing.assert_array_equal(out, 7)
    with pytest.raises(ValueError, match="out: expected shape"):
        K.copy_rows(base[:, :2], out)
    with pytest.raises(ValueError, match="out: must not overlap x"):
        K.copy_rows(base[:, 1:3], base.reshape(-1)[8:].reshape(4, 2))
    rec = Recorder()
    with rec:
        K.copy_rows(base[:, 1:3], np.empty((4, 2), np.float32))
    kind, arrays, ints, floats = rec.calls[0]
    for bad in ((4, 8, 20), (5, 8, 16), (4, 16, 8), (4, 8)):  # a longer span; more rows; rows overlapping
        with pytest.raises(ValueError, match="row-copy call 0"):
            Program([(kind, arrays, bad, floats)], [base])
