"""qmatmul: pack_nbits / matmul_nbits against their NumPy twins (reference.py) on random data, at every
instruction-set path this machine runs (scalar, AVX2 VPMADDUBSW, AVX-VNNI, AVX-512 VNNI), 1 and 2 threads,
4 and 8 bits, block sizes 16..256, zero points absent / packed uint8 / float32, K not a multiple of the
block size, 1..64 rows; and against ONNX Runtime's MatMulNBits for the layout contract."""

import numpy as np
import pytest
from nbits_weights import make_weight
from onnxkv._kernels.qmatmul import (
    DECODE_M,
    _set_vnni,
    dequantize_nbits,
    int8_path,
    matmul_nbits,
    nbits_columns,
    pack_nbits,
    quantize_rows,
)

import onnxkv._kernels as K
from onnxkv._kernels import reference as R


def _paths():
    """(simd level, vnni switch, expected int8 path) of every path this CPU runs."""
    out = [("scalar", True, "scalar"), ("avx2", False, "avx2")]
    levels = K.simd_levels()
    if "avx2" not in levels:
        return out[:1]
    with K.use_settings(K.current_settings().replace(simd="avx2")):
        if _set_vnni(True)[1] == "avx-vnni":
            out.append(("avx2", True, "avx-vnni"))
    if "avx512" in levels:
        with K.use_settings(K.current_settings().replace(simd="avx512")):
            if _set_vnni(True)[1] == "avx512-vnni":
                out.append(("avx512", True, "avx512-vnni"))
    return out


PATHS = _paths()


@pytest.fixture(params=PATHS, ids=[p[2] for p in PATHS])
def path(request):
    level, vnni, name = request.param
    with K.use_settings(K.current_settings().replace(simd=level)):
        _set_vnni(vnni)
        assert int8_path() == name
        yield name


def _dequant_direct(B, scales, zp, K_, N, bits, bs):
    """ONNX Runtime's definition, straight from the ORT-layout inputs."""
    nblk = -(-K_ // bs)
    q = R.nbits_codes(B, K_, N, bits, bs).astype(np.float32)
    if zp is None:
        z = np.full((N, nblk), 1 << (bits - 1), np.float32)
    elif zp.dtype == np.float32:
        z = zp.reshape(N, nblk)
    else:
        zb = zp.reshape(N, -1)
        z = zb if bits == 8 else np.stack([zb & 15, zb >> 4], -1).reshape(N, -1)[:, :nblk]
    blk = np.arange(K_) // bs
    return ((q - z[:, blk]) * scales.reshape(N, nblk)[:, blk]).T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("bs", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("zp_kind", ["none", "uint8", "float"])
def test_pack_round_trip(bits, bs, zp_kind):
    rng = np.random.default_rng(bits * 1000 + bs)
    K_, N = bs * 2 + 5, 37
    B, s, z = make_weight(rng, K_, N, bits, bs, zp_kind)
    w = pack_nbits(B, s, z, K_, N, bits, bs)
    np.testing.assert_array_equal(R.nbits_dequantize(w), _dequant_direct(B, s, z, K_, N, bits, bs))
    cols = dequantize_nbits(w, 0, w.P)
    np.testing.assert_array_equal(cols[:, :N], R.nbits_dequantize(w))
    assert not cols[:, N:].any()


CASES = [  # (bits, block size, K, N, rows, zero points)
    (4, 32, 256, 80, 1, "none"),
    (4, 32, 100, 33, 3, "uint8"),
    (4, 16, 64, 64, 8, "float"),
    (4, 64, 1000, 48, 2, "uint8"),
    (4, 128, 384, 100, 5, "none"),
    (4, 256, 600, 17, 1, "float"),
    (8, 32, 256, 80, 1, "none"),
    (8, 32, 100, 33, 4, "uint8"),
    (8, 16, 48, 96, 7, "float"),
    (8, 128, 700, 40, 1, "uint8"),
    (8, 256, 512, 64, 2, "none"),
]


@pytest.mark.parametrize("bits,bs,K_,N,M,zp_kind", CASES)
def test_int8_matches_twin(path, threads, bits, bs, K_, N, M, zp_kind):
    rng = np.random.default_rng(K_ * N + M)
    B, s, z = make_weight(rng, K_, N, bits, bs, zp_kind)
    w = pack_nbits(B, s, z, K_, N, bits, bs)
    x = rng.standard_normal((M, K_)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32) if M % 2 else None
    got, want = np.empty((M, N), np.float32), np.empty((M, N), np.float32)
    matmul_nbits(x, w, got, bias, int8=True)
    R.matmul_nbits_int8(x, w, want, bias)
    # the integer dot products are exact; only the fma emulation of the twin may differ by an ulp
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    # and int8 activations stay close to the float product
    exact = np.empty_like(want)
    R.matmul_nbits_f32(x, w, exact, bias)
    assert np.abs(got - exact).max() < 0.05 * np.abs(exact).max()


@pytest.mark.parametrize("bits,bs,K_,N,M,zp_kind", CASES)
def test_float_matches_twin(path, threads, bits, bs, K_, N, M, zp_kind):
    rng = np.random.default_rng(K_ * N + M + 1)
    B, s, z = make_weight(rng, K_, N, bits, bs, zp_kind)
    w = pack_nbits(B, s, z, K_, N, bits, bs)
    x = rng.standard_normal((M, K_)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32) if M % 2 == 0 else None
    got, want = np.empty((M, N), np.float32), np.empty((M, N), np.float32)
    matmul_nbits(x, w, got, bias, int8=False)
    R.matmul_nbits_f32(x, w, want, bias)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("M", [DECODE_M + 1, 16, 33, 64])
@pytest.mark.parametrize("bits", [4, 8])
def test_prefill_rows(path, threads, M, bits):
    """More rows than DECODE_M: int8 products keep the int8 contract (the block kernels), float products
    run on dequantized panels."""
    rng = np.random.default_rng(M + bits)
    K_, N, bs = 200, 90, 32
    B, s, z = make_weight(rng, K_, N, bits, bs, "uint8")
    w = pack_nbits(B, s, z, K_, N, bits, bs)
    x = rng.standard_normal((M, K_)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    got, want = np.empty((M, N), np.float32), np.empty((M, N), np.float32)
    matmul_nbits(x, w, got, bias, int8=True)
    R.matmul_nbits_int8(x, w, want, bias)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    matmul_nbits(x, w, got, bias, int8=False)
    R.matmul_nbits_f32(x, w, want, bias)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("M", [1, 3, DECODE_M + 1, 40])
@pytest.mark.parametrize("bits,zp_kind,lut", [(4, "uint8", False), (8, "float", False), (4, "none", True)])
def test_column_views_compute_their_columns_bit_for_bit(path, threads, M, bits, zp_kind, lut):
    """``nbits_columns`` (the weight of one output of a sibling product): its product equals those columns of
    the whole weight's product, int8 and float activations, decode and prefill row counts, last panel
    partial; its arrays are views of the weight's."""
    rng = np.random.default_rng(M * bits)
    K_, N, bs = 100, 75, 32
    B, s, z = make_weight(rng, K_, N, bits, bs, zp_kind)
    w = pack_nbits(B, s, z, K_, N, bits, bs, lut=_codebook(rng) if lut else None)
    x = rng.standard_normal((M, K_)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    for int8 in (False,) if lut else (True, False):
        whole = np.empty((M, N), np.float32)
        matmul_nbits(x, w, whole, bias, int8=int8)
        for n0, n1 in ((0, 16), (16, 50), (48, 75), (64, 70), (0, 75)):
            v = nbits_columns(w, n0, n1)
            assert (v.N, v.P) == (n1 - n0, -(-n1 // 16) - n0 // 16) and np.shares_memory(v.qw, w.qw)
            got = np.empty((M, n1 - n0), np.float32)
            matmul_nbits(x, v, got, bias[n0:n1], int8=int8)
            np.testing.assert_array_equal(got, whole[:, n0:n1])


def test_column_views_refuse_bounds_off_a_panel_or_outside_the_weight():
    rng = np.random.default_rng(0)
    B, s, z = make_weight(rng, 64, 40, 4, 32, "none")
    w = pack_nbits(B, s, z, 64, 40, 4, 32)
    for n0, n1 in ((8, 24), (0, 41), (16, 16), (-16, 8), (32, 20), (0, 16.5), (16.0, 40), (0, True), (0, 2**64)):
        with pytest.raises(ValueError, match=rf"nbits_columns: columns \[{n0!r}, {n1!r}\) of a weight of N=40"):
            nbits_columns(w, n0, n1)
    with pytest.raises(TypeError):
        nbits_columns(None, 0, 16)


def _extreme_8bit(rng, K_, N, bs):
    """8-bit weights at the ends of the range (0 and 255, some 127 and 128) and activation rows whose
    int8 blocks are all +-127: the largest VPMADDUBSW pairs of every path, both signs."""
    B, s, z = make_weight(rng, K_, N, 8, bs, "uint8")
    B[...] = rng.choice(np.array([0, 255, 127, 128], np.uint8), B.shape, p=[0.4, 0.4, 0.1, 0.1])
    B[0] = 0
    B[1] = 255
    x = np.where(rng.random((40, K_)) < 0.5, -1.0, 1.0).astype(np.float32)
    x[0] = 1.0
    x[1] = -1.0
    return B, s, z, x


@pytest.mark.parametrize("weights", ["4-bit", "8-bit", "8-bit extremes"])
def test_paths_agree_bit_for_bit(weights):
    """The int8 contract has one result: every path gives the same bits (also at the largest products
    the 8-bit paths' int16 pairs can hold), equal to the twin's within rounding."""
    rng = np.random.default_rng(5)
    bits = 4 if weights == "4-bit" else 8
    if weights == "8-bit extremes":
        B, s, z, x = _extreme_8bit(rng, 320, 70, 32)
    else:
        B, s, z = make_weight(rng, 320, 70, bits, 32, "uint8")
        x = rng.standard_normal((40, 320)).astype(np.float32)
    w = pack_nbits(B, s, z, 320, 70, bits, 32)
    want = np.empty((40, 70), np.float32)
    R.matmul_nbits_int8(x, w, want)
    results = {}
    for level, vnni, name in PATHS:
        for M in (3, 40):  # decode- and prompt-sized: the int8 contract holds at every row count
            with K.use_settings(K.current_settings().replace(simd=level)):
                _set_vnni(vnni)
                results[name, M] = np.empty((M, 70), np.float32)
                matmul_nbits(x[:M], w, results[name, M])
    for (name, M), r in results.items():
        np.testing.assert_array_equal(r, results[PATHS[0][2], M], err_msg=name)
    np.testing.assert_array_equal(results[PATHS[0][2], 40][:3], results[PATHS[0][2], 3])
    np.testing.assert_allclose(results[PATHS[0][2], 40], want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("bs", [16, 32, 64, 256])
@pytest.mark.parametrize("K_", [1, 15, 33, 100, 512])
def test_activation_blocks_match_twin(path, bs, K_):
    """The int8 activation blocks of every path equal the twin byte for byte: partial last blocks, blocks
    with a NaN or an inf, all-zero blocks, values that scale to exact .5 ties and to +-127."""
    rng = np.random.default_rng(K_ * 7 + bs)
    x = (rng.standard_normal((5, K_)) * rng.choice([1e-3, 1.0, 50.0], (5, 1))).astype(np.float32)
    x[1, : min(K_, bs)] = 0.0
    x[2, K_ // 2] = np.nan
    x[3, -1] = -np.inf
    x[4, :] = np.round(rng.uniform(-127, 127, K_)) + 0.5  # amax-scaled ties (127 / amax ~ 1)
    x[4, 0] = 127.0 if K_ > 1 else x[4, 0]
    # 127 / amax overflows below amax = 127 / FLT_MAX (3.7e-37): a zero block; just above, a scaled one
    tiny = (rng.standard_normal((2, K_)) * np.array([[1e-39], [1e-35]])).astype(np.float32)
    x = np.vstack([x, tiny])
    got = quantize_rows(x, bs)
    want = R.quantize_rows_int8(x, bs)
    for g, w, name in zip(got, want, ("xq", "xs", "xsum")):
        np.testing.assert_array_equal(g, w, err_msg=f"{name} on {path}")


def test_nan_inf_and_zero_blocks(path):
    rng = np.random.default_rng(9)
    B, s, z = make_weight(rng, 96, 20, 4, 32, "none")
    w = pack_nbits(B, s, z, 96, 20, 4, 32)
    x = rng.standard_normal((4, 96)).astype(np.float32)
    x[0, 5] = np.nan
    x[1, 70] = np.inf
    x[2, 32:64] = 0.0
    got, want = np.empty((4, 20), np.float32), np.empty((4, 20), np.float32)
    matmul_nbits(x, w, got)
    R.matmul_nbits_int8(x, w, want)
    assert np.isnan(got[:2]).all()
    np.testing.assert_allclose(got[2:], want[2:], rtol=1e-6, atol=1e-6)
    matmul_nbits(x, w, got, int8=False)
    assert np.isnan(got[0]).all() and not np.isfinite(got[1]).any()


@pytest.mark.parametrize("M", [1, DECODE_M, DECODE_M + 1])
def test_float_path_gives_infinities_and_large_products_as_dequantized_weights_do(path, M):
    """The float path (decode rows and prompt panels) gives what x @ dequant(w) gives where d - zp * xsum
    is not finite: an inf times weights of one sign is an inf, not inf - inf; 3e37 times a weight of 1
    (code 255, zero point 254) is 3e37, not an overflow of 3e37 * 255.  Other blocks keep the fast form."""
    rng = np.random.default_rng(M)
    K_, N, bs = 512, 40, 64
    q = rng.integers(0, 256, (N, K_)).astype(np.uint8)
    q[:, :bs] = 9  # zero point 128 (8-bit, none given): block 0's weights are (9 - 128) * scale
    scales = (rng.random((N, K_ // bs)) * 0.01 + 0.001).astype(np.float32)
    w = pack_nbits(q.reshape(N, K_ // bs, bs), scales.reshape(-1), None, K_, N, 8, bs)
    x = rng.standard_normal((M, K_)).astype(np.float32)
    x[0, 3] = np.inf
    got, want = np.empty((M, N), np.float32), np.empty((M, N), np.float32)
    matmul_nbits(x, w, got, int8=False)
    R.matmul_nbits_f32(x, w, want)
    assert (got[0] == -np.inf).all()
    np.testing.assert_allclose(got[1:], want[1:], rtol=1e-4, atol=1e-4 * np.abs(want[1:]).max(initial=0))
    q1 = np.full((N, 2 * bs), 255, np.uint8)
    zp = np.full(2 * N, 254, np.uint8)
    w1 = pack_nbits(q1.reshape(N, 2, bs), np.ones(2 * N, np.float32), zp, 2 * bs, N, 8, bs)
    big = np.zeros((M, 2 * bs), np.float32)
    big[:, 0] = 3e37  # block 0 past FLT_MAX in the fast form, block 1 (ones) within it
    big[:, bs:] = 1.0
    matmul_nbits(big, w1, got, int8=False)
    np.testing.assert_array_equal(got, np.float32(3e37) + np.float32(bs))


def test_agrees_with_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    for bits, zp_kind in ((4, "none"), (4, "uint8"), (8, "uint8"), (4, "float")):
        K_, N, bs = 160, 48, 32
        B, s, z = make_weight(rng, K_, N, bits, bs, zp_kind)
        x = rng.standard_normal((2, K_)).astype(np.float32)
        inits = [numpy_helper.from_array(B, "B"), numpy_helper.from_array(s, "s")]
        if z is not None:
            inits.append(numpy_helper.from_array(z, "z"))
        node = helper.make_node(
            "MatMulNBits",
            ["x", "B", "s"] + (["z"] if z is not None else []),
            ["y"],
            domain="com.microsoft",
            K=K_,
            N=N,
            bits=bits,
            block_size=bs,
            accuracy_level=0,
        )
        graph = helper.make_graph(
            [node],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K_])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, N])],
            inits,
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        )
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[
            0
        ]
        got = np.empty((2, N), np.float32)
        matmul_nbits(x, pack_nbits(B, s, z, K_, N, bits, bs), got, int8=False)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_bad_arguments():
    rng = np.random.default_rng(0)
    B, s, z = make_weight(rng, 64, 16, 4, 32, "uint8")
    with pytest.raises(ValueError, match="bits: expected 4 or 8, got 3"):
        pack_nbits(B, s, z, 64, 16, 3, 32)
    with pytest.raises(ValueError, match="block_size: expected a power of two in \\[16, 256\\], got 48"):
        pack_nbits(B, s, z, 64, 16, 4, 48)
    with pytest.raises(ValueError, match="B: expected 512 bytes"):
        pack_nbits(B[:8], s, z, 64, 16, 4, 32)
    with pytest.raises(ValueError, match="scales: expected 32 elements"):
        pack_nbits(B, s[:5], z, 64, 16, 4, 32)
    with pytest.raises(ValueError, match="zero_points: expected 16 uint8 elements"):
        pack_nbits(B, s, z[:3], 64, 16, 4, 32)
    with pytest.raises(ValueError, match="scales: expected a float32 array"):
        pack_nbits(B, s.astype(np.float64), z, 64, 16, 4, 32)
    w = pack_nbits(B, s, z, 64, 16, 4, 32)
    x = np.ones((1, 64), np.float32)
    with pytest.raises(ValueError, match="x: expected shape \\(M, 64\\)"):
        matmul_nbits(np.ones((1, 63), np.float32), w, np.empty((1, 16), np.float32))
    with pytest.raises(ValueError, match="out"):
        matmul_nbits(x, w, np.empty((1, 15), np.float32))
    with pytest.raises(ValueError, match="bias"):
        matmul_nbits(x, w, np.empty((1, 16), np.float32), np.ones(3, np.float32))
    assert not w.qw.flags.writeable and not w.sc.flags.writeable


def test_decode_products_share_the_late_team_heuristic():
    """matmul_nbits takes its team size from the heuristic matmul_packed uses (one solo product consumed
    per call while products are to run alone), and a single-thread setting never touches it."""
    from onnxkv._kernels.matmul import _set_adaptive

    rng = np.random.default_rng(2)
    B, s, z = make_weight(rng, 512, 512, 4, 32, "none")
    w = pack_nbits(B, s, z, 512, 512, 4, 32)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    got, want = np.empty((1, 512), np.float32), np.empty((1, 512), np.float32)
    R.matmul_nbits_int8(x, w, want)
    old = _set_adaptive(True, solo=3)
    try:
        with K.use_settings(K.current_settings().replace(threads=2)):
            matmul_nbits(x, w, got)
        assert _set_adaptive(True, solo=3) == (True, 2)
        with K.use_settings(K.current_settings().replace(threads=1)):
            matmul_nbits(x, w, got)
        assert _set_adaptive(True, solo=0) == (True, 3)
    finally:
        _set_adaptive(*old)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def _codebook(rng):
    """A 16-value codebook (MatMulBnb4's are fixed; any values exercise the lookup): random, with a zero."""
    lut = rng.standard_normal(16).astype(np.float32)
    lut[7] = 0.0
    return lut


@pytest.mark.parametrize(
    "bs,K_,N,M",
    [(16, 64, 33, 1), (32, 256, 80, 3), (64, 200, 48, DECODE_M), (128, 384, 17, DECODE_M + 1), (32, 96, 70, 40)],
)
def test_codebook_weights_match_twin(path, threads, bs, K_, N, M):
    """Codes standing for lut[q] (w = lut[q] * scale) on the float path: decode rows on the block kernels,
    more rows on dequantized panels, against the twin (lut[q] * scale, float64 products)."""
    rng = np.random.default_rng(K_ + N + M)
    B, s, _ = make_weight(rng, K_, N, 4, bs, "none")
    lut = _codebook(rng)
    w = pack_nbits(B, s, None, K_, N, 4, bs, lut=lut)
    assert w.zconst == 0.0 and not w.lut.flags.writeable and w.nbytes == w.qw.nbytes + w.sc.nbytes + 64
    q = R.nbits_codes(B, K_, N, 4, bs)
    blk = np.arange(K_) // bs
    np.testing.assert_array_equal(R.nbits_dequantize(w), (lut[q] * s.reshape(N, -1)[:, blk]).T)
    cols = dequantize_nbits(w, 0, w.P)
    np.testing.assert_array_equal(cols[:, :N], R.nbits_dequantize(w))
    x = rng.standard_normal((M, K_)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32) if M % 2 else None
    want = x.astype(np.float64) @ R.nbits_dequantize(w).astype(np.float64) + (0 if bias is None else bias)
    got = np.empty((M, N), np.float32)
    matmul_nbits(x, w, got, bias, int8=False)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_codebook_paths_agree_and_infinities_propagate():
    """Every path gives the scalar path's products to float32 rounding, and an inf in x gives what x @ W
    gives (inf * 0 = NaN where a column holds the zero code, inf where it does not)."""
    rng = np.random.default_rng(4)
    K_, N, bs = 64, 32, 32
    B, s, _ = make_weight(rng, K_, N, 4, bs, "none")
    w = pack_nbits(B, s, None, K_, N, 4, bs, lut=_codebook(rng))
    x = rng.standard_normal((3, K_)).astype(np.float32)
    x[1, 5] = np.inf
    outs = []
    for level in dict.fromkeys(p[0] for p in PATHS):  # the float path depends on the level alone
        with K.use_settings(K.current_settings().replace(simd=level)):
            out = np.empty((3, N), np.float32)
            matmul_nbits(x, w, out, int8=False)
            outs.append(out)
    with np.errstate(invalid="ignore"):
        want = x.astype(np.float64) @ R.nbits_dequantize(w).astype(np.float64)
    assert np.isnan(want[1]).any() and np.isinf(want[1]).any()
    for out in outs:
        np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
        np.testing.assert_allclose(out[[0, 2]], want[[0, 2]], rtol=1e-5, atol=1e-5 * np.abs(want[[0, 2]]).max())
        finite = ~np.isnan(want[1])
        np.testing.assert_array_equal(out[1, finite], want[1, finite])


def test_codebook_bad_arguments():
    rng = np.random.default_rng(0)
    B, s, z = make_weight(rng, 64, 16, 4, 32, "uint8")
    lut = _codebook(rng)
    with pytest.raises(ValueError, match=r"lut: expected a float32 array of shape \(16,\), got float64"):
        pack_nbits(B, s, None, 64, 16, 4, 32, lut=lut.astype(np.float64))
    with pytest.raises(ValueError, match=r"lut: expected a float32 array of shape \(16,\)"):
        pack_nbits(B, s, None, 64, 16, 4, 32, lut=lut[:8])
    with pytest.raises(ValueError, match="lut: a codebook takes 4-bit codes and no zero points, got bits=4 and zero"):
        pack_nbits(B, s, z, 64, 16, 4, 32, lut=lut)
    B8, s8, _ = make_weight(rng, 64, 16, 8, 32, "none")
    with pytest.raises(ValueError, match="got bits=8"):
        pack_nbits(B8, s8, None, 64, 16, 8, 32, lut=lut)
    w = pack_nbits(B, s, None, 64, 16, 4, 32, lut=lut)
    with pytest.raises(ValueError, match="int8=True on a codebook weight"):
        matmul_nbits(np.ones((1, 64), np.float32), w, np.empty((1, 16), np.float32), int8=True)
