"""Standard operators: onnxkv's kernels against onnx.reference on random data."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxkv import Session

RNG = np.random.default_rng(1234)
F = np.float32


def one_node(op, inputs, n_out=1, domain="", opset=21, **attrs):
    """A model with one node whose inputs are graph inputs (None = omitted)."""
    names = [f"x{i}" if v is not None else "" for i, v in enumerate(inputs)]
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, names, outs, domain=domain, **attrs)
    g_in = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for n, v in zip(names, inputs)
        if n
    ]
    g_out = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outs]
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(helper.make_graph([node], "g", g_in, g_out), opset_imports=imports)
    feeds = {n: v for n, v in zip(names, inputs) if n}
    return model, feeds


def check(op, inputs, n_out=1, atol=1e-6, opset=21, **attrs):
    model, feeds = one_node(op, inputs, n_out, opset=opset, **attrs)
    got = Session(model, threads=1).run(feeds)
    want = ReferenceEvaluator(model).run(None, feeds)
    for i, w in enumerate(want):
        g = got[f"y{i}"]
        assert g.shape == np.asarray(w).shape, (op, i, g.shape, np.asarray(w).shape)
        assert g.dtype == np.asarray(w).dtype, (op, i, g.dtype, np.asarray(w).dtype)
        np.testing.assert_allclose(g, w, atol=atol, rtol=1e-5, err_msg=op)


def r(*shape, dtype=F):
    return RNG.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Max", "Min"])
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((1, 4), (3, 1)), ((5,), ())])
def test_binary_broadcast(op, shapes):
    a, b = r(*shapes[0]), r(*shapes[1])
    if op == "Div":
        b = np.where(np.abs(b) < 0.1, 1.0, b).astype(F)
    check(op, [a, b])


@pytest.mark.parametrize("op", ["Mul", "Div"])
@pytest.mark.parametrize("shapes", [((2, 3, 4), ()), ((2, 3, 4), (1,)), ((3, 4), (1, 1)), ((5,), (1, 1)), ((), (2, 3))])
@pytest.mark.parametrize("order", ["value_second", "value_first"])
def test_one_value_products_and_quotients_are_numpys_bit_for_bit(op, shapes, order, monkeypatch):
    """A float32 tensor times (either order) or divided by one float32 value of no higher rank takes the
    one-value kernel (a compiled step replays it), with NumPy's roundings; a value of higher rank broadcasts
    the result to its rank through NumPy."""
    from onnxkv.plan.ops import elementwise

    calls = []
    for name in ("mul_scalar", "div_scalar"):
        real = getattr(elementwise.K, name)
        monkeypatch.setattr(elementwise.K, name, lambda *a, _r=real: (calls.append(1), _r(*a)))
    a, c = np.asarray(r(*shapes[0]) * 40, F), np.asarray(r(*shapes[1]) + 2.5, F)
    if a.size > 3:
        a.reshape(-1)[:3] = [np.nan, np.inf, -0.0]
    ins = [c, a] if order == "value_first" else [a, c]
    model, feeds = one_node(op, ins)
    got = Session(model, threads=1).run(feeds)["y0"]
    with np.errstate(all="ignore"):
        want = np.multiply(*ins) if op == "Mul" else np.divide(*ins)
    np.testing.assert_array_equal(got, want)
    x, v = ins if op == "Div" or ins[1].size == 1 and ins[1].ndim <= ins[0].ndim else ins[::-1]
    kernel = v.size == 1 and v.ndim <= x.ndim
    assert calls == ([1] if kernel else [])


@pytest.mark.parametrize(
    "shapes, axis",
    [(((1, 4, 1, 16), (1, 4, 1, 0)), -1), (((1, 4, 1, 12), (1, 4, 1, 4)), 3), (((2, 3), (5, 3)), 0), (((3,), (3,)), 0)],
)
@pytest.mark.parametrize("dtype", [F, np.float16, np.int64])
def test_a_concat_of_two_tensors_is_one_copy_call(shapes, axis, dtype, monkeypatch):
    """Two C-contiguous inputs of one dtype (an empty one included: a full rotary's pass-through part) are
    copied by ``concat_pair``, a call compiled steps replay; the values are onnx.reference's."""
    from onnxkv.plan.ops import shape

    calls = []
    monkeypatch.setattr(shape, "concat_pair", lambda *a, _r=shape.concat_pair: (calls.append(1), _r(*a)))
    check("Concat", [r(*s).astype(dtype) for s in shapes], axis=axis, atol=0)
    assert calls == [1]


def test_a_compiled_concat_reads_both_inputs_of_every_run():
    """A compiled step's concat_pair call takes each run's two inputs (neither is a cache's past view, which a
    recorded cache append does not read): new arrays every run, the step's replays give their values."""
    model, _ = one_node("Concat", [r(2, 3), r(2, 5)], axis=1)
    sess = Session(model, threads=1)
    for i in range(5):
        a, b = r(2, 3) + i, r(2, 5) - i
        np.testing.assert_array_equal(sess.run({"x0": a, "x1": b})["y0"], np.concatenate((a, b), 1))
    (step,) = sess.plan.steps.idle
    assert [type(item).__name__ for item in step.items] == ["Segment"]


@pytest.mark.parametrize("op", ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"])
def test_compare(op):
    a = RNG.integers(-3, 3, (4, 5)).astype(np.int64)
    b = RNG.integers(-3, 3, (5,)).astype(np.int64)
    check(op, [a, b])


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logic(op):
    check(op, [RNG.random((3, 4)) > 0.5, RNG.random((3, 4)) > 0.5])


def test_integer_div_truncates():
    a = np.array([7, -7, 9, -9], dtype=np.int64)
    b = np.array([2, 2, -4, -4], dtype=np.int64)
    check("Div", [a, b])


@pytest.mark.parametrize("op", ["Neg", "Abs", "Exp", "Sin", "Cos", "Tanh", "Floor", "Ceil", "Sigmoid", "Relu", "Sign"])
def test_unary(op):
    check(op, [r(3, 7)], atol=1e-5)


@pytest.mark.parametrize("op", ["Sqrt", "Log", "Reciprocal"])
def test_unary_positive(op):
    check(op, [np.abs(r(4, 5)) + 0.1], atol=1e-5)


def test_pow_and_not_and_where():
    check("Pow", [np.abs(r(3, 4)) + 0.1, np.array(2.0, F)])
    check("Pow", [np.abs(r(3, 4)) + 0.1, np.array(0.5, F)])
    check("Not", [RNG.random((3, 4)) > 0.5])
    check("Where", [RNG.random((3, 1)) > 0.5, r(3, 4), r(4)])


@pytest.mark.parametrize("to", [TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL])
def test_cast(to):
    check("Cast", [r(3, 4) * 3], to=to)


def test_shape_ops():
    x = r(2, 3, 4)
    check("Shape", [x])
    check("Shape", [x], start=1)
    check("Shape", [x], start=-2, end=-1)
    check("Reshape", [x, np.array([0, -1], np.int64)])
    check("Reshape", [x, np.array([4, 6], np.int64)])
    check("Transpose", [x], perm=[2, 0, 1])
    check("Transpose", [x])
    check("Squeeze", [r(2, 1, 3, 1), np.array([1, 3], np.int64)])
    check("Squeeze", [r(2, 1, 3, 1)])
    check("Unsqueeze", [x, np.array([0, -1], np.int64)])
    check("Flatten", [x], axis=2)
    check("Concat", [x, r(2, 5, 4)], axis=1)
    check("Concat", [x, r(2, 3, 1)], axis=-1)
    check("Expand", [r(3, 1), np.array([2, 3, 4], np.int64)])
    check("Tile", [x, np.array([1, 2, 1], np.int64)])
    check("Identity", [x])
    check("Size", [x])


@pytest.mark.parametrize(
    "starts,ends,axes,steps",
    [
        ([0], [2], [1], [1]),
        ([1, 0], [3, 4], [1, 2], [1, 2]),
        ([-1], [-4], [2], [-1]),
        ([0], [np.iinfo(np.int64).max], [0], [1]),
        ([2], [np.iinfo(np.int64).min], [1], [-1]),
        ([-100], [100], [2], [1]),
    ],
)
def test_slice(starts, ends, axes, steps):
    x = r(3, 4, 5)
    check(
        "Slice",
        [x, np.array(starts, np.int64), np.array(ends, np.int64), np.array(axes, np.int64), np.array(steps, np.int64)],
    )


def test_slice_agrees_with_onnx_over_every_start_end_and_step():
    """Starts below -dim with a negative step used to walk from the last element (36 of 484 cases).

    ONNX Runtime and onnx.reference disagree on two corners, where the operator's clamping rule decides:
    onnx.reference (NumPy slicing) takes a start below -dim with a negative step as before the first
    element (the rule clamps it to 0), ONNX Runtime an end of INT64_MAX with a negative step as past the
    first element (the rule clamps it to dim - 1).  Each is compared with the runtime that follows the rule.
    """
    ort = pytest.importorskip("onnxruntime")
    big, small = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    bounds = [small, -7, -6, -5, -2, -1, 0, 1, 4, 5, 6, big]
    for dim in (0, 1, 5):
        x = np.arange(dim, dtype=F)
        model, _ = one_node("Slice", [x, *[np.zeros(1, np.int64)] * 4])
        model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT  # ONNX Runtime needs it
        sess, ref = Session(model, threads=1), ReferenceEvaluator(model)
        peer = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        for start in bounds:
            for end in bounds:
                for step in (-3, -1, 1, 2):
                    values = ((1, start), (2, end), (3, 0), (4, step))
                    feeds = {"x0": x, **{f"x{i}": np.array([v], np.int64) for i, v in values}}
                    want = ref.run(None, feeds)[0] if end == big and step < 0 else peer.run(None, feeds)[0]
                    assert sess.run(feeds)["y0"].tolist() == want.tolist(), (dim, start, end, step)


def test_integer_div_pow_isinf_and_noop_reductions_agree_with_onnx():
    """Integer Div went through float64 (wrong above 2**53); Pow by a constant 2 of higher rank kept x's
    shape; IsInf detecting neither sign returned a 0-d False; ReduceSumSquare/L2 with noop_with_empty_axes
    returned x itself."""
    a = np.array([2**62 + 1, 2**63 - 1, -7, 7, -7, 7, -8, 0, -(2**63)], np.int64)
    b = np.array([1, 2, 2, -2, -2, 2, 2, -3, 3], np.int64)
    check("Div", [a, b])
    check(
        "Div", [a.astype(np.int32) if False else np.array([-7, 7, -1, 9], np.int32), np.array([2, -2, 3, -4], np.int32)]
    )
    x = r(3)
    model, feeds = one_node("Pow", [x, np.full((1, 1), 2.0, F)])
    model.graph.initializer.append(
        helper.make_tensor("x1", TensorProto.FLOAT, (1, 1), [2.0])
    )  # a constant: the square path
    model.graph.input.remove(model.graph.input[1])
    assert Session(model, threads=1).run({"x0": x})["y0"].shape == (1, 3)
    inf = np.array([np.inf, -np.inf, 1.0, np.nan], F)
    for pos, neg in ((0, 0), (1, 0), (0, 1), (1, 1)):
        check("IsInf", [inf], detect_positive=pos, detect_negative=neg)
    for op in ("ReduceSumSquare", "ReduceL2", "ReduceL1", "ReduceSum", "ReduceMax", "ReduceLogSumExp"):
        check(op, [r(2, 3), np.zeros(0, np.int64)], noop_with_empty_axes=1, opset=18)


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
def test_softmax_family_agrees_with_onnxruntime_at_each_opset(op, opset):
    """Before opset 13 these act on the input coerced to 2-D at ``axis`` (they ran with opset-13 semantics,
    0.6-1.3 off); a Softmax row that is entirely -inf is NaN (the kernel gave zeros); Hardmax ties take the
    first maximum."""
    ort = pytest.importorskip("onnxruntime")
    x = r(2, 3, 4)
    x[0, 1, :] = -np.inf  # a whole last-axis row masked
    x[1, 2, 1] = x[1, 2, 3] = 9.0  # a tie
    for axis in (0, 1, 2, -1):
        model, feeds = one_node(op, [x], opset=opset, axis=axis)
        model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT  # ONNX Runtime needs it
        got = Session(model, threads=1).run(feeds)["y0"]
        with np.errstate(invalid="ignore"):
            want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[
                0
            ]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{op} axis {axis}")


def test_range_near_the_int64_limits_gemm_on_integers_and_quick_gelu_in_float16():
    """Range(-2**62, 2**62, 2**61) came back empty (np.arange overflowed); an int32 Gemm with the default
    beta raised (onnx.reference is its peer: ONNX Runtime has no integer Gemm); QuickGelu refused float16
    (its kernel takes float32 and float64)."""
    ort = pytest.importorskip("onnxruntime")
    cases = [
        ("Range", [np.array(v, np.int64) for v in (-(2**62), 2**62, 2**61)], {}, ""),
        ("Range", [np.array(v, np.int64) for v in (2**63 - 1, -(2**63), -(2**62))], {}, ""),
        (
            "Gemm",
            [
                np.arange(6, dtype=np.int32).reshape(2, 3),
                np.arange(12, dtype=np.int32).reshape(3, 4),
                np.arange(4, dtype=np.int32),
            ],
            {},
            "",
        ),  # fmt: skip
        ("QuickGelu", [r(3, 5).astype(np.float16)], {"alpha": 1.5}, "com.microsoft"),
    ]
    for op, inputs, attrs, domain in cases:
        model, feeds = one_node(op, inputs, domain=domain, **attrs)
        elem = helper.np_dtype_to_tensor_dtype(inputs[0].dtype)
        model.graph.output[0].type.tensor_type.elem_type = elem  # ONNX Runtime needs it
        if op == "Gemm":
            want = ReferenceEvaluator(model).run(None, feeds)[0]
        else:
            want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[
                0
            ]
        got = Session(model, threads=1).run(feeds)["y0"]
        assert got.dtype == want.dtype and got.shape == want.shape, op
        np.testing.assert_allclose(got, want, rtol=1e-3, err_msg=op)


def test_split_gather():
    x = r(6, 4)
    check("Split", [x, np.array([2, 4], np.int64)], n_out=2, axis=0)
    check("Split", [x], n_out=2, axis=1, num_outputs=2, opset=18)
    check("Gather", [x, np.array([[0, 5], [-1, 2]], np.int64)], axis=0)
    check("Gather", [r(2, 3, 4), np.array(1, np.int64)], axis=1)
    check("GatherElements", [r(3, 4), RNG.integers(0, 3, (2, 4)).astype(np.int64)], axis=0)
    check("GatherND", [r(3, 4, 5), np.array([[0, 1], [2, 3]], np.int64)])
    check("GatherND", [r(2, 4, 5), np.array([[1], [3]], np.int64)], batch_dims=1)


def test_range_constantofshape_trilu():
    check("Range", [np.array(2, np.int64), np.array(11, np.int64), np.array(3, np.int64)])
    check("Range", [np.array(0.5, F), np.array(3.0, F), np.array(0.5, F)])
    check("ConstantOfShape", [np.array([2, 3], np.int64)], value=helper.make_tensor("v", TensorProto.INT64, [1], [7]))
    check("Trilu", [r(4, 4), np.array(1, np.int64)], upper=0)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce(op, keepdims):
    x = r(3, 4, 5)
    check(op, [x, np.array([1], np.int64)], keepdims=keepdims, atol=1e-5)
    check(op, [x, np.array([-1, 0], np.int64)], keepdims=keepdims, atol=1e-5)
    check(op, [x], keepdims=keepdims, atol=1e-4)


@pytest.mark.parametrize(
    "dtype,low,high",
    [
        (np.float32, -np.inf, np.inf),
        (np.float16, -np.inf, np.inf),
        (np.int32, -(2**31), 2**31 - 1),
        (np.uint8, 0, 255),
        (np.bool_, False, True),
    ],
)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_max_min_over_an_empty_set_give_the_extreme_values(dtype, low, high, keepdims):
    """Max of nothing is -inf (the dtype's minimum where there is no infinity), min of nothing +inf (its maximum)."""
    x = np.zeros((2, 0, 4), dtype)
    shape = (2, 1, 4) if keepdims else (2, 4)
    for op, want in (("ReduceMax", low), ("ReduceMin", high)):
        model, feeds = one_node(op, [x, np.array([1], np.int64)], keepdims=keepdims)
        got = Session(model, threads=1).run(feeds)["y0"]
        assert got.dtype == x.dtype and got.shape == shape, (op, got.dtype, got.shape)
        np.testing.assert_array_equal(got, np.full(shape, want, dtype), err_msg=op)


def test_argmax_softmax():
    x = r(3, 4, 5)
    check("ArgMax", [x], axis=2, keepdims=0)
    check("ArgMin", [x], axis=1, keepdims=1)
    check("Softmax", [x * 5], axis=-1)
    check("Softmax", [x], axis=1)
    check("LogSoftmax", [x], axis=-1, atol=1e-5)


@pytest.mark.parametrize(
    "shapes", [((4, 8), (8, 3)), ((2, 5, 8), (8, 6)), ((2, 3, 4, 5), (2, 3, 5, 6)), ((3, 4, 5), (5,)), ((5,), (5, 2))]
)
def test_matmul(shapes):
    check("MatMul", [r(*shapes[0]), r(*shapes[1])], atol=1e-5)


def test_gemm_layernorm():
    check("Gemm", [r(3, 4), r(5, 4), r(5)], transB=1, alpha=0.5, beta=2.0, atol=1e-5)
    check("LayerNormalization", [r(3, 8), r(8), r(8)], n_out=1, axis=-1, epsilon=1e-5, atol=1e-5)


def test_rms_normalization_23():
    x, g = r(2, 3, 16), r(16)
    model, feeds = one_node("RMSNormalization", [x, g], opset=23, epsilon=1e-6)
    got = Session(model, threads=1).run(feeds)["y0"]
    want = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _skip_norm_model(x, skip, g, epsilon: float | None = 1e-6):
    """SkipSimplifiedLayerNormalization with outputs 0 (normalised) and 3 (sum) only (no ``epsilon``
    attribute when None)."""
    elem = helper.np_dtype_to_tensor_dtype(x.dtype)
    node = helper.make_node(
        "SkipSimplifiedLayerNormalization",
        ["x0", "x1", "x2"],
        ["y0", "", "", "y3"],
        domain="com.microsoft",
        **({} if epsilon is None else {"epsilon": epsilon}),
    )
    g_in = [helper.make_tensor_value_info(n, elem, v.shape) for n, v in zip(["x0", "x1", "x2"], [x, skip, g])]
    g_out = [helper.make_tensor_value_info(n, elem, x.shape) for n in ("y0", "y3")]
    model = helper.make_model(
        helper.make_graph([node], "g", g_in, g_out),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
    )
    return model, {"x0": x, "x1": skip, "x2": g}


def test_skip_simplified_layer_norm_float64_against_numpy():
    x, skip, g = r(2, 5, 32, dtype=np.float64), r(2, 5, 32, dtype=np.float64), r(32, dtype=np.float64)
    model, feeds = _skip_norm_model(x, skip, g)
    got = Session(model, threads=1).run(feeds)
    s = x + skip
    np.testing.assert_allclose(got["y3"], s, atol=1e-12)
    np.testing.assert_allclose(got["y0"], s / np.sqrt(np.mean(s * s, -1, keepdims=True) + 1e-6) * g, atol=1e-10)


def test_skip_simplified_layer_norm_float16_sums_and_normalises_in_float32():
    """float16 input and skip: the sum is normalised in float32 before its rounding (the float32 kernel), the
    sum output is that sum rounded to float16; ONNX Runtime's values within a float16 step."""
    ort = pytest.importorskip("onnxruntime")
    x, skip, g = r(2, 5, 64, dtype=np.float16), r(2, 5, 64, dtype=np.float16), r(64, dtype=np.float16)
    model, feeds = _skip_norm_model(x, skip, g)
    got = Session(model, threads=1).run(feeds)
    s = x.astype(np.float64) + skip.astype(np.float64)
    want = s / np.sqrt(np.mean(s * s, -1, keepdims=True) + 1e-6) * g.astype(np.float64)
    assert got["y0"].dtype == got["y3"].dtype == np.float16
    np.testing.assert_array_equal(got["y3"], s.astype(np.float32).astype(np.float16))
    np.testing.assert_array_less(np.abs(got["y0"] - want), np.abs(want) * 2.0**-10 + 1e-6)
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(got["y0"].astype(np.float32), theirs[0].astype(np.float32), rtol=2e-3, atol=2e-3)


def test_ms_norms_against_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    x, skip, g = r(2, 5, 32), r(2, 5, 32), r(32)
    model, feeds = _skip_norm_model(x, skip, g)
    got = Session(model, threads=1).run(feeds)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(got["y0"], want[0], atol=1e-5)
    np.testing.assert_allclose(got["y3"], want[1], atol=1e-6)
    node = helper.make_node("SimplifiedLayerNormalization", ["x0", "x1"], ["y0"], epsilon=1e-6, axis=-1)
    model = helper.make_model(
        helper.make_graph(
            [node],
            "g",
            [
                helper.make_tensor_value_info("x0", TensorProto.FLOAT, x.shape),
                helper.make_tensor_value_info("x1", TensorProto.FLOAT, g.shape),
            ],
            [helper.make_tensor_value_info("y0", TensorProto.FLOAT, x.shape)],
        ),
        opset_imports=[helper.make_opsetid("", 21)],
    )
    got = Session(model, threads=1).run({"x0": x, "x1": g})["y0"]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x0": x, "x1": g}
    )
    np.testing.assert_allclose(got, want[0], atol=1e-5)


def test_skip_simplified_layer_norm_without_epsilon_takes_onnxruntimes_default():
    """The contrib schema's default is 1e-12 (onnxkv used SimplifiedLayerNormalization's 1e-5: 1.28 off on
    inputs near 1e-3), also where a MatMul reading the norm fuses it into its prologue."""
    ort = pytest.importorskip("onnxruntime")
    x, skip, g = r(2, 5, 32) * 1e-3, r(2, 5, 32) * 1e-3, r(32)
    model, feeds = _skip_norm_model(x, skip, g, epsilon=None)
    w = helper.make_tensor("w", TensorProto.FLOAT, (32, 16), r(32, 16).ravel())
    model.graph.initializer.append(w)
    model.graph.node.append(helper.make_node("MatMul", ["y0", "w"], ["p"]))
    model.graph.output.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, (2, 5, 16)))
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(Session(model, threads=1).run(feeds)["y0"], want[0], atol=1e-5)
    model.graph.output.remove(model.graph.output[0])  # y0 read by the MatMul alone: fused into its prologue
    sess = Session(model, threads=1)
    assert "PrologueMatMul" in [n.op_type for n in sess.plan.nodes]
    np.testing.assert_allclose(sess.run(feeds)["p"], want[2], rtol=1e-5, atol=1e-5)


def test_fallback_runs_long_tail_operator():
    x = r(2, 3)
    model, feeds = one_node("HardSigmoid", [x], alpha=0.3, beta=0.4)
    sess = Session(model, threads=1)
    assert sess.fallback_nodes, "HardSigmoid should use the onnx.reference fallback"
    np.testing.assert_allclose(sess.run(feeds)["y0"], np.clip(0.3 * x + 0.4, 0, 1), atol=1e-6)


def test_operator_failure_names_node():
    from onnxkv import OperatorError

    model, feeds = one_node("Reshape", [r(2, 3), np.array([4, 4], np.int64)])
    model.graph.node[0].name = "my_reshape"
    with pytest.raises(OperatorError, match="my_reshape"):
        Session(model, threads=1).run(feeds)
