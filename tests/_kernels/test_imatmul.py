"""imatmul: pack_int8_weight / matmul_integer / dynamic_quantize_linear against their NumPy twins
(reference.py) on random data, at every path this machine runs (scalar, AVX2, AVX-512 VNNI), 1 and 2
threads, uint8 and int8 operands, zero points absent / one / per row and column, K not a multiple of
4, N not a multiple of 16, 1..64 rows, sums that wrap int32; and dynamic_quantize_linear against ONNX
Runtime's DynamicQuantizeLinear, bit for bit."""

import zlib

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxkv._kernels.imatmul import (
    dynamic_quantize_linear,
    integer_path,
    matmul_dynamic,
    matmul_integer,
    pack_int8_weight,
)
from onnxkv._kernels.qmatmul import _set_vnni

import onnxkv._kernels as K
from onnxkv._kernels import reference as R


def _paths():
    """(simd level, vnni switch, expected path) of every path this CPU runs."""
    out = [("scalar", True, "scalar")]
    levels = K.simd_levels()
    if "avx2" in levels:
        out.append(("avx2", True, "avx2"))
    if "avx512" in levels:
        out.append(("avx512", False, "avx2"))
        with K.use_settings(K.current_settings().replace(simd="avx512")):
            if _set_vnni(True)[1] == "avx512-vnni":
                out.append(("avx512", True, "avx512-vnni"))
    return out


PATHS = _paths()


@pytest.fixture(params=PATHS, ids=[f"{p[0]}-{p[2]}" for p in PATHS])
def path(request):
    level, vnni, name = request.param
    with K.use_settings(K.current_settings().replace(simd=level)):
        _set_vnni(vnni)
        assert integer_path() == name
        yield name


def _ints(rng, dtype, shape):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


def _zero_point(rng, dtype, kind: str, count: int):
    return {"none": None, "one": _ints(rng, dtype, 1), "each": _ints(rng, dtype, count)}[kind]


CASES = [  # (M, K, N)
    (1, 1, 1),
    (1, 7, 5),
    (1, 256, 16),
    (1, 1023, 47),
    (2, 130, 33),
    (3, 64, 64),
    (4, 5, 17),
    (5, 300, 31),
    (8, 128, 80),
    (17, 61, 19),
    (64, 96, 48),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("adt", [np.uint8, np.int8], ids=["a_u8", "a_s8"])
@pytest.mark.parametrize("bdt", [np.uint8, np.int8], ids=["b_u8", "b_s8"])
@pytest.mark.parametrize("zps", [("none", "none"), ("one", "one"), ("each", "each"), ("one", "each")])
def test_matmul_integer_matches_reference(path, threads, adt, bdt, zps):
    rng = np.random.default_rng(zlib.crc32(f"{path} {threads} {np.dtype(adt)} {np.dtype(bdt)} {zps}".encode()))
    with K.use_settings(K.current_settings().replace(threads=threads)):
        for M, K_, N in CASES:
            a, b = _ints(rng, adt, (M, K_)), _ints(rng, bdt, (K_, N))
            az, bz = _zero_point(rng, adt, zps[0], M), _zero_point(rng, bdt, zps[1], N)
            w = pack_int8_weight(b, bz)
            out = np.full((M, N), -7, np.int32)
            matmul_integer(a, w, az, out)
            np.testing.assert_array_equal(out, R.matmul_integer(a, b, az, bz), err_msg=f"M={M} K={K_} N={N}")


def test_matmul_integer_wraps_as_int32(path):
    """Sums past 2^31 wrap as ONNX Runtime's int32 accumulation does (mod 2^32)."""
    K_ = 40_000
    a = np.full((2, K_), 255, np.uint8)
    a[1, ::3] = 0
    b = np.full((K_, 3), -128, np.int8)
    b[:, 1] = 127
    out = np.empty((2, 3), np.int32)
    matmul_integer(a, pack_int8_weight(b, np.array([127], np.int8)), np.array([0], np.uint8), out)
    want = R.matmul_integer(a, b, None, np.array([127], np.int8))
    assert (np.abs(a.astype(np.int64) @ (b.astype(np.int64) - 127)) > 2**31).any()
    np.testing.assert_array_equal(out, want)


def test_zero_rows_are_checked_and_write_nothing():
    """M = 0 returns before the kernel, after every argument check (a zero point for 2 rows is refused)."""
    w = pack_int8_weight(np.ones((3, 4), np.int8))
    a, out = np.empty((0, 3), np.uint8), np.empty((0, 4), np.int32)
    assert matmul_integer(a, w, np.array([7], np.uint8), out) is None and out.shape == (0, 4)
    with pytest.raises(ValueError, match="a_zero_point: expected a uint8 array of 1 or M=0"):
        matmul_integer(a, w, np.array([1, 2], np.uint8), out)


def test_pack_layout():
    rng = np.random.default_rng(5)
    b = _ints(rng, np.uint8, (6, 20))
    w = pack_int8_weight(b, np.array([3], np.uint8))
    assert (w.K, w.N, w.P, w.K4) == (6, 20, 2, 8)
    lines = np.asarray(w.wq).reshape(w.P, w.K4 // 4, 16, 4)  # [panel, line, column, kk]
    back = lines.transpose(1, 3, 0, 2).reshape(w.K4, w.P * 16)
    np.testing.assert_array_equal(back[:6, :20], (b ^ 0x80).view(np.int8))
    assert not back[6:].any() and not back[:, 20:].any()
    assert (np.asarray(w.bzp)[:20] == 3 - 128).all()
    assert not np.asarray(w.wq).flags.writeable


@pytest.mark.parametrize(
    "args, message",
    [
        ((np.ones((3, 4), np.float32), None), "B: expected an int8 or uint8"),
        ((np.ones(3, np.int8), None), "B: expected an int8 or uint8"),
        ((np.ones((0, 4), np.int8), None), "1 <= K"),
        ((np.ones((3, 4), np.int8), np.array([1, 2], np.int8)), "zero_point: expected a int8 array of 1 or N=4"),
        ((np.ones((3, 4), np.int8), np.array([1], np.uint8)), "zero_point: expected a int8"),
    ],
)
def test_pack_refuses(args, message):
    with pytest.raises(ValueError, match=message):
        pack_int8_weight(*args)


def test_matmul_integer_refuses_before_writing():
    w = pack_int8_weight(np.ones((3, 4), np.int8))
    out = np.full((2, 4), 9, np.int32)
    a = np.ones((2, 3), np.uint8)
    for args, message in [
        ((a.astype(np.int16), w, None, out), "a: dtype int16"),
        ((np.ones((2, 5), np.uint8), w, None, out), r"a: expected shape \(M, 3\)"),
        ((a, w, None, out.astype(np.int64)), "out: dtype int64"),
        ((a, w, None, np.empty((3, 4), np.int32)), r"out: expected shape \(2, 4\)"),
        ((a, w, np.array([1, 2, 3], np.uint8), out), "a_zero_point: expected a uint8 array of 1 or M=2"),
        ((a, w, np.array([1], np.int8), out), "a_zero_point: expected a uint8"),
        ((a, w, None, out[:, ::2]), "out: expected shape"),
    ]:
        with pytest.raises(ValueError, match=message):
            matmul_integer(*args)
    assert (out == 9).all()


def _ort_dql():
    graph = helper.make_graph(
        [helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])],
        "dql",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
        [
            helper.make_tensor_value_info("y", TensorProto.UINT8, None),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("z", TensorProto.UINT8, None),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


EDGES = [
    [1, np.nan, -2, 3],
    [np.nan, 1, 2],
    [np.inf, 1, -1],
    [-np.inf, 1, 2],
    [np.inf, -np.inf],
    [5, 5, 5],
    [-3, -3],
    [1e-45, 0],
    [3e38, -3e38],
    [0.0, -0.0, 0.0],
    [np.nan],
    [2.5, -2.5, 0.5, 1.5],
]


@pytest.mark.parametrize("level", ["scalar", "avx512"])
def test_dynamic_quantize_linear_equals_onnxruntime(level):
    try:
        settings = K.current_settings().replace(simd=level)
    except ValueError as e:
        pytest.skip(str(e))
    sess = _ort_dql()
    rng = np.random.default_rng(11)
    cases = [np.array(e, np.float32) for e in EDGES]
    for t in range(300):
        x = (rng.standard_normal(int(rng.integers(1, 3000))) * 10 ** rng.uniform(-30, 30)).astype(np.float32)
        cases.append(np.abs(x) if t % 5 == 0 else -np.abs(x) if t % 7 == 0 else x)
    with K.use_settings(settings):
        for x in cases:
            y, s, z = sess.run(None, {"x": x})
            got = np.empty(x.size, np.uint8)
            scale, zp = dynamic_quantize_linear(x, got)
            np.testing.assert_array_equal(got, y, err_msg=str(x[:8]))
            assert (np.float32(scale), zp) == (s, z), x[:8]
            ry, rs, rz = R.dynamic_quantize_linear(x)
            np.testing.assert_array_equal(ry, y)
            assert (rs, rz) == (s, z)


def test_dynamic_quantize_linear_shapes_and_refusals():
    x = np.random.default_rng(2).standard_normal((3, 5)).astype(np.float32)
    y = np.empty((3, 5), np.uint8)
    assert dynamic_quantize_linear(x, y) == (
        float(R.dynamic_quantize_linear(x)[1]),
        int(R.dynamic_quantize_linear(x)[2]),
    )
    assert dynamic_quantize_linear(np.empty(0, np.float32), np.empty(0, np.uint8)) == (1.0, 0)
    with pytest.raises(ValueError, match="x: dtype float64"):
        dynamic_quantize_linear(x.astype(np.float64), y)
    with pytest.raises(ValueError, match="y: expected 15 elements"):
        dynamic_quantize_linear(x, np.empty(14, np.uint8))
    with pytest.raises(ValueError, match="y: must not overlap x"):
        dynamic_quantize_linear(x, x.view(np.uint8).reshape(-1)[:15])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bdt", [np.uint8, np.int8], ids=["b_u8", "b_s8"])
@pytest.mark.parametrize("zp", ["none", "one", "each"])
def test_matmul_dynamic_equals_the_chain(path, threads, bdt, zp):
    """DynamicQuantizeLinear, MatMulInteger, Cast and the scale in one call: the chain's bits."""
    rng = np.random.default_rng(zlib.crc32(f"dyn {path} {threads} {np.dtype(bdt)} {zp}".encode()))
    with K.use_settings(K.current_settings().replace(threads=threads)):
        for M, K_, N in CASES:
            x = (rng.standard_normal((M, K_)) * 10 ** rng.uniform(-2, 2)).astype(np.float32)
            b = _ints(rng, bdt, (K_, N))
            bz = _zero_point(rng, bdt, zp, N)
            ws = (rng.random(N) * 0.02 + 1e-4).astype(np.float32)
            out = np.full((M, N), np.nan, np.float32)
            matmul_dynamic(x, pack_int8_weight(b, bz), ws, out)
            np.testing.assert_array_equal(out, R.matmul_dynamic(x, b, bz, ws), err_msg=f"M={M} K={K_} N={N}")


def test_matmul_dynamic_refuses_before_writing():
    w = pack_int8_weight(np.ones((3, 4), np.int8))
    x, ws, out = np.ones((2, 3), np.float32), np.ones(4, np.float32), np.full((2, 4), 9.0, np.float32)
    for args, message in [
        ((x.astype(np.float64), w, ws, out), "x: dtype float64"),
        ((np.ones((2, 5), np.float32), w, ws, out), r"x: expected shape \(M, 3\)"),
        ((x, w, np.ones(3, np.float32), out), r"ws: expected shape \(4,\)"),
        ((x, w, ws, np.empty((2, 4), np.int32)), "out: dtype int32"),
    ]:
        with pytest.raises(ValueError, match=message):
            matmul_dynamic(*args)
    assert (out == 9).all()
    matmul_dynamic(np.empty((0, 3), np.float32), w, ws, np.empty((0, 4), np.float32))
