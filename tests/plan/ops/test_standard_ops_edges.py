"""Standard and contrib operators at the edges a differential fuzzer found wrong: empty axes, infinities, 0-d
inputs, narrow floats, against ONNX Runtime (the reference peer) or the operator's formula."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_standard_ops import one_node

from onnxkv import Session

ort = pytest.importorskip("onnxruntime")


def _run_both(model, feeds, out_type: int | None = None) -> tuple[list, list]:
    """(onnxkv's outputs, ONNX Runtime's), in the graph's output order."""
    if out_type is not None:
        for o in model.graph.output:
            o.type.tensor_type.elem_type = out_type
    names = [o.name for o in model.graph.output]
    got = Session(model, threads=1).run(feeds)
    with np.errstate(invalid="ignore", over="ignore"):
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    return [got[n] for n in names], want


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_softmax_of_a_slice_holding_infinity_is_nan_as_onnxruntime_gives(op, opset, dtype):
    """exp(x - max) with max = +inf: NaN at +inf (inf - inf) and throughout after the sum.  The NumPy path
    (float32 off the last axis, float16 everywhere) replaced a non-finite max by 0 and gave [0, nan, 0]."""
    x = np.array([[1.0, np.inf, 2.0], [np.inf, np.inf, 0.0], [-np.inf, -np.inf, -np.inf], [0.5, 1.0, -1.0]], dtype)
    for axis in (0, 1):
        model, feeds = one_node(op, [x], opset=opset, axis=axis)
        (got,), (want,) = _run_both(model, feeds, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
        atol = 1e-3 if dtype == np.float16 else 1e-6  # float16: a few ulp of LogSoftmax's last column
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=atol, equal_nan=True, err_msg=f"axis {axis}")


@pytest.mark.parametrize(
    ("op", "opset", "shape", "axis"),
    [
        ("Softmax", 13, (2, 0, 3), 1),
        ("LogSoftmax", 13, (3, 0), -1),
        ("Softmax", 11, (2, 0, 3), 1),
        ("LogSoftmax", 11, (0, 3), 0),
        ("Hardmax", 13, (2, 0), 1),
    ],
)
def test_softmax_family_over_an_empty_axis_gives_the_empty_input(op, opset, shape, axis):
    model, feeds = one_node(op, [np.zeros(shape, np.float32)], opset=opset, axis=axis)
    (got,), (want,) = _run_both(model, feeds, TensorProto.FLOAT)
    assert got.shape == want.shape == shape and got.dtype == np.float32


@pytest.mark.parametrize("constant", [False, True])
@pytest.mark.parametrize(("a", "b"), [((3, 0), (0, 4)), ((2, 3, 0), (0, 4)), ((3, 2), (2, 0)), ((0, 2), (2, 5))])
def test_matmul_with_an_empty_dimension(a, b, constant):
    """K = 0 gives zeros, N = 0 or M = 0 an empty product (reshaping by -1 over a 0 dim raised)."""
    x, w = np.ones(a, np.float32), np.ones(b, np.float32)
    model, feeds = one_node("MatMul", [x, w])
    if constant:
        model.graph.initializer.append(numpy_helper.from_array(w, "x1"))
        del model.graph.input[1]
        del feeds["x1"]
    (got,), (want,) = _run_both(model, feeds, TensorProto.FLOAT)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_gather_nd_over_an_empty_batch():
    model, feeds = one_node("GatherND", [np.zeros((0, 3, 4), np.float32), np.zeros((0, 2, 1), np.int64)], batch_dims=1)
    (got,), (want,) = _run_both(model, feeds, TensorProto.FLOAT)
    assert got.shape == want.shape == (0, 2, 4)


def test_float_range_is_start_plus_i_times_delta_in_the_input_type():
    """np.arange's fill drifted from the spec's start + i * delta (5.9e-5 at 194 float32 elements)."""
    start, limit, delta = np.float32(11.865), np.float32(-17.137), np.float32(-0.1497)
    model, feeds = one_node("Range", [np.array(start), np.array(limit), np.array(delta)])
    got = Session(model, threads=1).run(feeds)["y0"]
    n = int(np.ceil((float(limit) - float(start)) / float(delta)))
    np.testing.assert_array_equal(got, start + np.arange(n, dtype=np.float32) * delta)
    assert got.dtype == np.float32


def test_mean_broadcasts_its_inputs():
    """Mean ran through onnx.reference, whose Mean does not broadcast ((5,) with (3, 1) raised)."""
    xs = [
        np.arange(5, dtype=np.float32),
        np.arange(3, dtype=np.float32)[:, None],
        np.float32(2.0) + np.zeros(1, np.float32),
    ]
    model, feeds = one_node("Mean", xs)
    (got,), (want,) = _run_both(model, feeds, TensorProto.FLOAT)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got.shape == (3, 5)


def test_cast_of_a_scalar_to_float8e8m0():
    model, feeds = one_node("Cast", [np.array(4.0, np.float32)], opset=24, to=TensorProto.FLOAT8E8M0)
    got = Session(model, threads=1).run(feeds)["y0"]
    assert got.shape == () and float(got.astype(np.float32)) == 4.0


@pytest.mark.parametrize("op", ["SkipSimplifiedLayerNormalization", "SkipLayerNormalization"])
def test_float16_skip_norms_normalise_the_sum_before_rounding_it(op):
    """The sum x + skip (+ bias) is normalised in float32 and only output 3 is rounded to float16, as ONNX
    Runtime does: rounding first cost about one float16 ulp more (0.012-0.017 at |y| near 16)."""
    rng = np.random.default_rng(7)
    n = 64
    x, skip = (rng.standard_normal((4, n)) * 8).astype(np.float16), (rng.standard_normal((4, n)) * 8).astype(np.float16)
    gamma = (rng.standard_normal(n) * 4).astype(np.float16)
    extra = [np.zeros(n, np.float16)] if op == "SkipLayerNormalization" else []  # beta
    bias = (rng.standard_normal(n)).astype(np.float16)
    inputs = [x, skip, gamma, *extra, bias] if op == "SkipLayerNormalization" else [x, skip, gamma, bias]
    model, feeds = one_node(op, inputs, n_out=4, domain="com.microsoft", epsilon=1e-6)
    model.graph.node[0].output[1] = model.graph.node[0].output[2] = ""
    del model.graph.output[1:3]
    (y, s), (want_y, want_s) = _run_both(model, feeds, TensorProto.FLOAT16)
    np.testing.assert_array_equal(s, want_s)
    np.testing.assert_allclose(y.astype(np.float32), want_y.astype(np.float32), rtol=0, atol=0.0079)
    wide = x.astype(np.float64) + skip + bias
    if op == "SkipLayerNormalization":
        wide = wide - wide.mean(-1, keepdims=True)
        truth = wide / np.sqrt((wide**2).mean(-1, keepdims=True) + 1e-6) * gamma
    else:
        truth = wide / np.sqrt((wide**2).mean(-1, keepdims=True) + 1e-6) * gamma
    assert np.abs(y - truth).max() <= np.abs(want_y - truth).max() + 1e-3


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_float16_rms_norms_run_the_float32_kernel_on_the_widening(bias, threads):
    """float16 SkipSimplifiedLayerNormalization and SimplifiedLayerNormalization (a float16 builder graph's
    norms): the float32 sum of the widenings (+ bias) normalised by the float32 kernel and rounded once, the
    sum output that sum rounded -- the same values, bit for bit, as the kernels called on NumPy's casts."""
    from onnxkv import _kernels as K

    rng = np.random.default_rng(8)
    n = 96
    x, skip = ((rng.standard_normal((3, 7, n)) * 6).astype(np.float16) for _ in range(2))
    gamma, b = (rng.standard_normal(n) * 2).astype(np.float16), rng.standard_normal(n).astype(np.float16)
    model, feeds = one_node(
        "SkipSimplifiedLayerNormalization",
        [x, skip, gamma, *([b] if bias else [])],
        n_out=4,
        domain="com.microsoft",
        epsilon=1e-6,
    )
    model.graph.node[0].output[1] = model.graph.node[0].output[2] = ""
    del model.graph.output[1:3]
    got = Session(model, threads=threads).run(feeds)
    wide = x.astype(np.float32) + skip.astype(np.float32)
    if bias:
        wide += b.astype(np.float32)
    normed = np.empty_like(wide)
    K.rms_norm(wide.reshape(-1, n), gamma.astype(np.float32), 1e-6, normed.reshape(-1, n))
    np.testing.assert_array_equal(got["y3"].view(np.uint16), wide.astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(got["y0"].view(np.uint16), normed.astype(np.float16).view(np.uint16))
    model, feeds = one_node("SimplifiedLayerNormalization", [x, gamma], epsilon=1e-6, axis=-1)
    y = Session(model, threads=threads).run(feeds)["y0"]
    K.rms_norm(x.astype(np.float32).reshape(-1, n), gamma.astype(np.float32), 1e-6, normed.reshape(-1, n))
    np.testing.assert_array_equal(y.view(np.uint16), normed.astype(np.float16).view(np.uint16))
