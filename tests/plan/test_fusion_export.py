"""Plan-time fusion of exported RMSNorm chains (ai.onnxkv::RMSNormChain) and rotate_half rotary embeddings
(ai.onnxkv::RotateHalf), on whole models and on small graphs whose run-time checks fail.

The oracle is the same model planned without these two fusions.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_fusion_attention import MODELS, _generate, left_padded_batch  # the Concat-cache fixtures, generation

import onnxkv
import onnxkv.plan.fusion_passes as fusion_passes
from onnxkv.plan.fusion_export import repeats_halves
from onnxkv.plan.ops import _body, norm, rotary

#: Plan nodes the fusions remove.  Torch export: each norm is [Cast,] Pow, ReduceMean, Add, Sqrt, Div, Mul,
#: Cast, Mul (the leading Cast is fused into the last norm only; in the layers its output also feeds the residual
#: Add), each rotary Mul, Slice, Slice, Neg, Concat, Mul, Add: 4 * 7 + 8 + 4 * 6; then the residual Add and Cast
#: before the three norms after the first layer's attention, and the Add before the final one: 3 * 2 + 1.
#: Builder: norms Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul and the same rotaries: 5 * 6 + 4 * 6, and the
#: residual Adds before the four norms after the first: 4.
REMOVED = {"torch": 4 * 7 + 8 + 4 * 6 + 3 * 2 + 1, "builder": 5 * 6 + 4 * 6 + 4}


@pytest.fixture
def calls(monkeypatch):
    """Counts the compiled kernel calls of both fused ops and the literal evaluations of their bodies."""
    seen = {"rms_norm": 0, "skip_rms_norm": 0, "rotary": 0, "literal": []}
    rms, skip, rope, evaluate = norm.K.rms_norm, norm.K.skip_rms_norm, rotary._rotary_kernel, _body.Body.evaluate

    def counting_rms(*args):
        seen["rms_norm"] += 1
        return rms(*args)

    def counting_skip(*args):
        seen["skip_rms_norm"] += 1
        return skip(*args)

    def counting_rope(*args):
        seen["rotary"] += 1
        return rope(*args)

    def counting_evaluate(self, names, inputs, rt):
        kinds = {n.op_type for n, _ in self.steps}
        if "Pow" in kinds or "Neg" in kinds or "RMSNormChain" in kinds:
            seen["literal"].append(
                "RotateHalf" if "Neg" in kinds else "SkipRMSNormChain" if "RMSNormChain" in kinds else "RMSNormChain"
            )
        return evaluate(self, names, inputs, rt)

    monkeypatch.setattr(norm.K, "rms_norm", counting_rms)
    monkeypatch.setattr(norm.K, "skip_rms_norm", counting_skip)
    monkeypatch.setattr(rotary, "_rotary_kernel", counting_rope)
    monkeypatch.setattr(_body.Body, "evaluate", counting_evaluate)
    return seen


def _unfused(model, monkeypatch, threads: int = 2) -> onnxkv.Session:
    with monkeypatch.context() as m:
        m.setattr(fusion_passes, "fuse_rms_norm", lambda nodes, protected: nodes)
        m.setattr(fusion_passes, "fuse_rotate_half", lambda nodes, protected, constants: nodes)
        m.setattr(fusion_passes, "fuse_skip_rms_norm", lambda nodes, protected: nodes)
        return onnxkv.Session(model, threads=threads)


@pytest.mark.parametrize("form", sorted(MODELS))
def test_every_norm_and_rotary_is_fused(form, monkeypatch):
    fused = [n.op_type for n in onnxkv.Session(MODELS[form](), threads=1).plan.nodes]
    unfused = [n.op_type for n in _unfused(MODELS[form](), monkeypatch, 1).plan.nodes]
    # two layers: 2 norms each plus the final one, all but the first reading a residual sum; q and k rotated in
    # each layer
    assert fused.count("RMSNormChain") == 1 and fused.count("SkipRMSNormChain") == 4 and fused.count("RotateHalf") == 4
    assert not {"Pow", "ReduceMean", "Sqrt", "Reciprocal", "Div", "Neg", "Slice"} & set(fused)
    assert len(unfused) - len(fused) == REMOVED[form]


@pytest.mark.parametrize("form", sorted(MODELS))
@pytest.mark.parametrize("state", [False, True], ids=["tensors", "state"])
def test_left_padded_batch_matches_the_unfused_plan(form, state, calls, monkeypatch):
    prompt, lengths, tokens = left_padded_batch(form, 33, padding=3, steps=3)
    fused = onnxkv.Session(MODELS[form](), threads=2, compiled_steps=False)  # every run through the ops
    got = _generate(fused, prompt, lengths, tokens, state)
    # prefill + 3 decode steps, each through the kernels only
    assert (calls["rms_norm"], calls["skip_rms_norm"], calls["rotary"], calls["literal"]) == (4, 4 * 4, 4 * 4, [])
    want = _generate(_unfused(MODELS[form](), monkeypatch), prompt, lengths, tokens, state)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


# -- small graphs: run-time checks ---------------------------------------------------------------------------------
def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))


def _rms_model(exponent_input: bool, output_sqrt: bool = False) -> onnx.ModelProto:
    """y = w * (x * 1 / sqrt(mean(x^p, -1) + eps)) over x [2, 3, 8]; ``p`` a graph input or the constant 2."""
    nodes = [
        _const("axes", np.array([-1], np.int64)),
        _const("eps", np.float32(1e-5)),
        _const("one", np.float32(1.0)),
        helper.make_node("Pow", ["x", "p"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1),
        helper.make_node("Add", ["mean", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["std"]),
        helper.make_node("Div", ["one", "std"], ["inv"]),
        helper.make_node("Mul", ["x", "inv"], ["normed"]),
        helper.make_node("Mul", ["w", "normed"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])]
    inits = [numpy_helper.from_array(np.random.default_rng(5).standard_normal(8).astype(np.float32), "w")]
    if exponent_input:
        inputs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, []))
    else:
        nodes.insert(0, _const("p", np.float32(2.0)))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 8])]
    if output_sqrt:
        outputs.append(helper.make_tensor_value_info("std", TensorProto.FLOAT, [2, 3, 1]))
    return helper.make_model(
        helper.make_graph(nodes, "rms", inputs, outputs, inits), opset_imports=[helper.make_opsetid("", 18)]
    )


@pytest.mark.parametrize("exponent", [2.0, 4.0])
def test_rms_chain_with_a_run_time_exponent_checks_it_on_every_call(exponent, calls, monkeypatch):
    x = np.random.default_rng(7).uniform(0.5, 2.0, (2, 3, 8)).astype(np.float32)
    feeds = {"x": x, "p": np.float32(exponent)}
    sess = onnxkv.Session(_rms_model(True), threads=1)
    assert [n.op_type for n in sess.plan.nodes] == ["RMSNormChain"]
    got = sess.run(feeds)["y"]
    want = _unfused(_rms_model(True), monkeypatch, 1).run(feeds)["y"]
    if exponent == 2.0:
        assert (calls["rms_norm"], calls["literal"]) == (1, [])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:  # not an RMS norm: the original nodes, exactly
        assert (calls["rms_norm"], calls["literal"]) == (0, ["RMSNormChain"])
        np.testing.assert_array_equal(got, want)
    w = numpy_helper.to_array(_rms_model(True).graph.initializer[0])
    ref = w * x / np.sqrt(np.mean(x.astype(np.float64) ** exponent, axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_rms_chain_with_float64_input_runs_the_original_nodes(calls, monkeypatch):
    model = _rms_model(False)
    for vi in model.graph.input:
        vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    model.graph.initializer[0].CopyFrom(
        numpy_helper.from_array(numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64), "w")
    )
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output[0] in ("p", "eps", "one"):
            v = numpy_helper.to_array(n.attribute[0].t).astype(np.float64)
            n.attribute[0].t.CopyFrom(numpy_helper.from_array(v, n.output[0]))
    x = np.random.default_rng(8).standard_normal((2, 3, 8))
    got = onnxkv.Session(model, threads=1).run({"x": x})["y"]
    assert (calls["rms_norm"], calls["literal"]) == (0, ["RMSNormChain"])
    np.testing.assert_array_equal(got, _unfused(model, monkeypatch, 1).run({"x": x})["y"])


@pytest.mark.parametrize("param", ["p", "eps", "one"])
def test_rms_chain_with_a_parameter_of_higher_rank_than_x_keeps_its_broadcast_shape(param, calls, monkeypatch):
    """A one-element parameter shaped [1, 1, 1, 1] makes y rank 4 for x rank 3; the kernel used to return
    x's shape."""
    model = _rms_model(False)
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output[0] == param:
            v = numpy_helper.to_array(n.attribute[0].t).reshape(1, 1, 1, 1)
            n.attribute[0].t.CopyFrom(numpy_helper.from_array(v, param))
    model.graph.output[0].type.tensor_type.ClearField("shape")
    x = np.random.default_rng(9).standard_normal((2, 3, 8)).astype(np.float32)
    got = onnxkv.Session(model, threads=1).run({"x": x})["y"]
    assert got.shape == (1, 2, 3, 8) and calls["rms_norm"] == 0
    np.testing.assert_array_equal(got, _unfused(model, monkeypatch, 1).run({"x": x})["y"])


def test_rms_chain_whose_intermediate_is_a_graph_output_is_not_fused():
    sess = onnxkv.Session(_rms_model(False, output_sqrt=True), threads=1)
    ops = [n.op_type for n in sess.plan.nodes]
    assert "RMSNormChain" not in ops and "Sqrt" in ops


def _rotate_half(x: str) -> list[onnx.NodeProto]:
    """y = x * cos + cat(-x[..., mid:], x[..., :mid]) * sin as an export writes it (constants zero, mid, end and
    last, and cos and sin, made by the caller)."""
    return [
        helper.make_node("Mul", [x, "cos"], ["xc"]),
        helper.make_node("Slice", [x, "zero", "mid", "last"], ["x1"]),
        helper.make_node("Slice", [x, "mid", "end", "last"], ["x2"]),
        helper.make_node("Neg", ["x2"], ["nx2"]),
        helper.make_node("Concat", ["nx2", "x1"], ["turned"], axis=-1),
        helper.make_node("Mul", ["turned", "sin"], ["rs"]),
        helper.make_node("Add", ["xc", "rs"], ["y"]),
    ]


def _rotary_model(split: int) -> onnx.ModelProto:
    """y = x * cos + cat(-x[..., split:], x[..., :split]) * sin over x [2, 3, 4, 8], cos/sin [2, 1, 4, 8] inputs."""
    nodes = [
        _const("zero", np.array([0], np.int64)),
        _const("mid", np.array([split], np.int64)),
        _const("end", np.array([np.iinfo(np.int64).max], np.int64)),
        _const("last", np.array([-1], np.int64)),
        *_rotate_half("x"),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 8]),
        helper.make_tensor_value_info("cos", TensorProto.FLOAT, [2, 1, 4, 8]),
        helper.make_tensor_value_info("sin", TensorProto.FLOAT, [2, 1, 4, 8]),
    ]
    return helper.make_model(
        helper.make_graph(nodes, "rope", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4, 8])]),
        opset_imports=[helper.make_opsetid("", 18)],
    )


@pytest.mark.parametrize("case", ["halves", "unequal_halves", "uneven_split"])
def test_rotate_half_falls_back_to_the_original_nodes_when_a_check_fails(case, calls, monkeypatch):
    rng = np.random.default_rng(9)
    angles = rng.uniform(0, 6.0, (2, 1, 4, 4)).astype(np.float32)
    if case == "unequal_halves":
        angles = np.concatenate([angles, angles + 0.5], axis=-1)
    else:
        angles = np.concatenate([angles, angles], axis=-1)
    feeds = {"x": rng.standard_normal((2, 3, 4, 8)).astype(np.float32), "cos": np.cos(angles), "sin": np.sin(angles)}
    model = _rotary_model(3 if case == "uneven_split" else 4)
    sess = onnxkv.Session(model, threads=1)
    assert [n.op_type for n in sess.plan.nodes] == ["RotateHalf"]
    got = sess.run(feeds)["y"]
    want = _unfused(model, monkeypatch, 1).run(feeds)["y"]
    if case == "halves":
        assert (calls["rotary"], calls["literal"]) == (1, [])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert (calls["rotary"], calls["literal"]) == (0, ["RotateHalf"])
        np.testing.assert_array_equal(got, want)


def test_float16_rotate_half_runs_the_kernel_rounded_once(calls, monkeypatch):
    """float16 x, cos and sin (a float16 export) take the kernel on their float32 widening, y rounded once:
    within a float16 step of the float64 rotation (the literal chain rounds three times)."""
    model = _rotary_model(4)
    for vi in (*model.graph.input, *model.graph.output):
        vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    rng = np.random.default_rng(16)
    angles = rng.uniform(0, 6.0, (2, 1, 4, 4))
    angles = np.concatenate([angles, angles], axis=-1)
    x = rng.standard_normal((2, 3, 4, 8)).astype(np.float16)
    cos, sin = np.cos(angles).astype(np.float16), np.sin(angles).astype(np.float16)
    got = onnxkv.Session(model, threads=1).run({"x": x, "cos": cos, "sin": sin})["y"]
    assert (calls["rotary"], calls["literal"]) == (1, []) and got.dtype == np.float16
    x64, c64, s64 = (t.astype(np.float64) for t in (x, cos, sin))
    exact = x64 * c64 + np.concatenate([-x64[..., 4:], x64[..., :4]], axis=-1) * s64
    np.testing.assert_array_less(np.abs(got - exact), np.abs(exact) * 2.0**-10 + 1e-6)
    want = _unfused(model, monkeypatch, 1).run({"x": x, "cos": cos, "sin": sin})["y"]
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=4e-3, atol=4e-3)


# -- small graphs: the halves proof ---------------------------------------------------------------------------------
def _proof_nodes(kind: str) -> list[onnx.NodeProto]:
    """Nodes making ``c`` from graph input ``f`` [2, 3, 4] (and ``g``, the same shape) as ``kind`` says."""
    cat = helper.make_node("Concat", ["f", "f"], ["cat"], axis=-1)
    if kind == "concat_cos_scaled":
        return [
            cat,
            helper.make_node("Cos", ["cat"], ["cc"]),
            _const("k", np.float32(1.5)),
            helper.make_node("Mul", ["cc", "k"], ["m"]),
            helper.make_node("Cast", ["m"], ["cm"], to=1),
            _const("ax", np.array([1], np.int64)),
            helper.make_node("Unsqueeze", ["cm", "ax"], ["c"]),
        ]
    if kind == "concat_of_two":
        return [helper.make_node("Concat", ["f", "g"], ["c"], axis=-1)]
    if kind == "concat_axis_0":
        return [helper.make_node("Concat", ["f", "f"], ["c"], axis=0)]
    if kind == "times_unequal_halves":
        return [cat, _const("k", np.arange(8, dtype=np.float32)), helper.make_node("Mul", ["cat", "k"], ["c"])]
    if kind == "times_repeated_halves":
        return [
            cat,
            _const("k", np.tile(np.arange(4, dtype=np.float32), 2)),
            helper.make_node("Mul", ["cat", "k"], ["c"]),
        ]
    if kind == "reshaped":
        return [cat, _const("s", np.array([2, 3, 2, 4], np.int64)), helper.make_node("Reshape", ["cat", "s"], ["c"])]
    if kind == "graph_input":
        return [helper.make_node("Identity", ["f"], ["c"])]
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind, proven",
    [
        ("concat_cos_scaled", True),
        ("times_repeated_halves", True),
        ("concat_of_two", False),
        ("concat_axis_0", False),
        ("times_unequal_halves", False),
        ("reshaped", False),
        ("graph_input", False),
    ],
)
def test_repeats_halves_proves_only_what_holds(kind, proven):
    assert repeats_halves("c", _proof_nodes(kind)) is proven
    if proven:  # the property itself, on the values the nodes compute
        sess = onnxkv.Session(
            helper.make_model(
                helper.make_graph(
                    _proof_nodes(kind),
                    "proof",
                    [helper.make_tensor_value_info(v, TensorProto.FLOAT, [2, 3, 4]) for v in "fg"],
                    [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)],
                ),
                opset_imports=[helper.make_opsetid("", 18)],
            ),
            threads=1,
        )
        rng = np.random.default_rng(12)
        c = sess.run(
            {
                "f": rng.standard_normal((2, 3, 4)).astype(np.float32),
                "g": rng.standard_normal((2, 3, 4)).astype(np.float32),
            }
        )["c"]
        np.testing.assert_array_equal(c[..., :4], c[..., 4:])


@pytest.mark.parametrize("axis, proven", [(0, True), (1, False)])
def test_repeats_halves_follows_a_gather_over_a_leading_axis_of_a_constant_table(axis, proven):
    table = np.tile(np.random.default_rng(13).standard_normal((6, 2)).astype(np.float32), 2)  # [6, 4]: halves equal
    nodes = [helper.make_node("Gather", ["table", "pos"], ["c"], axis=axis)]
    assert repeats_halves("c", nodes, {"table": table}) is proven


def _proven_rotary_model(split_input: bool) -> onnx.ModelProto:
    """:func:`_rotary_model` (split 4) with cos/sin = Cos/Sin(Concat([f, f], axis=-1)) of an input ``f``
    [2, 1, 4, 4]; the split point is a graph input ``mid`` when ``split_input``."""
    model = _rotary_model(4)
    graph = model.graph
    nodes = [n for n in graph.node if not (split_input and n.output[0] == "mid")]
    nodes[:0] = [
        helper.make_node("Concat", ["f", "f"], ["cat"], axis=-1),
        helper.make_node("Cos", ["cat"], ["cos"]),
        helper.make_node("Sin", ["cat"], ["sin"]),
    ]
    inputs = [graph.input[0], helper.make_tensor_value_info("f", TensorProto.FLOAT, [2, 1, 4, 4])]
    if split_input:
        inputs.append(helper.make_tensor_value_info("mid", TensorProto.INT64, [1]))
    return helper.make_model(
        helper.make_graph(nodes, "rope", inputs, list(graph.output)), opset_imports=[helper.make_opsetid("", 18)]
    )


@pytest.mark.parametrize("mid", [4, 3, None], ids=["split_4", "split_3", "constant_split"])
def test_a_proven_rotate_half_runs_the_kernel_and_still_checks_its_layout(mid, calls, monkeypatch):
    model = _proven_rotary_model(mid is not None)
    sess = onnxkv.Session(model, threads=1)
    fused = [(n, k) for n, k in zip(sess.plan.nodes, sess.plan.kernels) if n.op_type == "RotateHalf"]
    assert len(fused) == 1 and fused[0][1]._halves_proven
    rng = np.random.default_rng(14)
    feeds = {
        "x": rng.standard_normal((2, 3, 4, 8)).astype(np.float32),
        "f": rng.uniform(0, 6.0, (2, 1, 4, 4)).astype(np.float32),
    }
    if mid is not None:
        feeds["mid"] = np.array([mid], np.int64)
    got = [sess.run(feeds)["y"] for _ in range(2)]  # the second call reuses the learnt layout
    want = _unfused(model, monkeypatch, 1).run(feeds)["y"]
    if mid == 3:  # a run-time split off the middle: the literal chain, every time
        assert (calls["rotary"], calls["literal"]) == (0, ["RotateHalf"] * 2)
        for g in got:
            np.testing.assert_array_equal(g, want)
    else:
        assert (calls["rotary"], calls["literal"]) == (2, [])
        for g in got:
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def test_a_run_time_split_is_replayed_only_when_it_is_fixed_for_the_step():
    """A RotateHalf whose slice bound is a graph input (its value may change while the shapes stay) stays a
    Python node of compiled steps and follows each run's split; with a constant bound it is replayed."""
    rng = np.random.default_rng(15)
    feeds = {
        "x": rng.standard_normal((2, 3, 4, 8)).astype(np.float32),
        "f": rng.uniform(0, 6.0, (2, 1, 4, 4)).astype(np.float32),
    }
    for keyed in (True, False):
        model = _proven_rotary_model(keyed)
        sess = onnxkv.Session(model, threads=1)
        plain = onnxkv.Session(model, threads=1, compiled_steps=False)
        for mid in (4, 4, 3, 4, 3) if keyed else (None,) * 3:
            run = dict(feeds, mid=np.array([mid], np.int64)) if keyed else feeds
            np.testing.assert_array_equal(sess.run(run)["y"], plain.run(run)["y"])
        (step,) = sess.plan.steps.idle
        python = [sess.plan.nodes[k].op_type for k in step.items if type(k) is int]
        assert ("RotateHalf" in python) is keyed  # the angles' Cos and Sin have no compiled kernel


def _partial_rotary_model(rot: int, heads: int = 3, head: int = 8) -> onnx.ModelProto:
    """A projection's heads [1, H, 1, D] (MatMul, Reshape, Transpose of one token) whose first ``rot`` dims are
    rotated (Slice, rotate_half chain, cos/sin of an input ``f`` [1, 1, 1, rot / 2] with equal halves) and
    concatenated with the rest (Slice): a partial-rotary export's q (rot = D: an empty rest)."""
    w = np.random.default_rng(21).standard_normal((16, heads * head)).astype(np.float32)
    nodes = [
        _const("zero", np.array([0], np.int64)),
        _const("rot", np.array([rot], np.int64)),
        _const("mid", np.array([rot // 2], np.int64)),
        _const("end", np.array([np.iinfo(np.int64).max], np.int64)),
        _const("last", np.array([-1], np.int64)),
        _const("heads", np.array([1, 1, heads, head], np.int64)),
        helper.make_node("MatMul", ["inp", "w"], ["proj"]),
        helper.make_node("Reshape", ["proj", "heads"], ["q4"]),
        helper.make_node("Transpose", ["q4"], ["x"], perm=[0, 2, 1, 3]),
        helper.make_node("Slice", ["x", "zero", "rot", "last"], ["xr"]),
        helper.make_node("Slice", ["x", "rot", "end", "last"], ["xp"]),
        helper.make_node("Concat", ["f", "f"], ["cat"], axis=-1),
        helper.make_node("Cos", ["cat"], ["cos"]),
        helper.make_node("Sin", ["cat"], ["sin"]),
        *_rotate_half("xr"),
        helper.make_node("Concat", ["y", "xp"], ["out"], axis=-1),
    ]
    inputs = [
        helper.make_tensor_value_info("inp", TensorProto.FLOAT, [1, 1, 16]),
        helper.make_tensor_value_info("f", TensorProto.FLOAT, [1, 1, 1, rot // 2]),
    ]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, heads, 1, head])]
    graph = helper.make_graph(nodes, "partial", inputs, outputs, [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("rot", [8, 6, 4])
def test_a_partial_rotation_of_heads_is_replayed_bit_for_bit(rot):
    """The rotated part and the rest of each head are strided Slices of the heads: a compiled step packs them
    by rows (``copy_rows``), rotates the first and concatenates the two (``concat_pair``), and its replays equal
    the node-by-node runs bit for bit."""
    model = _partial_rotary_model(rot)
    sess = onnxkv.Session(model, threads=1)
    plain = onnxkv.Session(model, threads=1, compiled_steps=False)
    rng = np.random.default_rng(rot)
    for _ in range(4):
        feeds = {
            "inp": rng.standard_normal((1, 1, 16)).astype(np.float32),
            "f": rng.uniform(0, 6.0, (1, 1, 1, rot // 2)).astype(np.float32),
        }
        np.testing.assert_array_equal(sess.run(feeds)["out"], plain.run(feeds)["out"])
    (step,) = sess.plan.steps.idle
    python = {sess.plan.nodes[k].op_type for k in step.items if type(k) is int}
    assert python == {"Cos", "Sin"}  # the angles: no compiled kernel
    segment_ops = [sess.plan.nodes[k].op_type for it in step.items if not isinstance(it, int)
                   for k in range(it.first, it.end)]  # fmt: skip
    assert segment_ops.count("Slice") == 2 and "RotateHalf" in segment_ops and segment_ops.count("Concat") == 2
