"""Shape folding turns the repeat_kv reshape targets of the fused attention operators into templates over the
cache's shape (onnxkv.plan.fusion.RESHAPE_FROM_X), so the Shape/Gather/Unsqueeze/Concat chains computing them
leave the plan.

The oracle is the same model planned without the templates (ShapeFolder._template disabled).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_fusion_attention import TORCH, torch_batch_runs

import onnxkv
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.plan.fusion import RESHAPE_FROM_X
from onnxkv.plan.ops import masked_attention as ma
from onnxkv.plan.shape_fold import ShapeFolder


def _plain(model, monkeypatch, threads: int = 2) -> onnxkv.Session:
    with monkeypatch.context() as m:
        m.setattr(ShapeFolder, "_template", lambda self, name, dims, constants: None)
        return onnxkv.Session(model, threads=threads)


def _attr(node: onnx.NodeProto, name: str):
    return next((list(helper.get_attribute_value(a)) for a in node.attribute if a.name == name), None)


def test_the_torch_export_loses_the_repeat_target_chains(monkeypatch):
    sess, plain = onnxkv.Session(TORCH, threads=1), _plain(TORCH, monkeypatch, 1)
    fused = [n for n in sess.plan.nodes if n.op_type == "MaskedAttention"]
    assert len(fused) == 2 and all(_attr(n, RESHAPE_FROM_X) == [6, 9] for n in fused)
    for n in fused:  # the templates: [batch, 4 query heads, keys, 16] with batch and keys from the cache
        for pos in (6, 9):
            np.testing.assert_array_equal(sess.plan.build_context.constant(n.input[pos]), [0, 4, 0, 16])
    # per layer, the K and V targets would each cost a ShapeOf(present) (what is left of Shape, 2 Gather,
    # 2 Unsqueeze and a Concat after shape folding)
    assert len(plain.plan.nodes) - len(sess.plan.nodes) == 2 * 2

    def shape_readers(plan):
        return [
            n for n in plan.nodes if n.op_type in ("Shape", "ShapeOf") and any(x.startswith("present") for x in n.input)
        ]

    assert len(shape_readers(plain.plan)) == 4 and shape_readers(sess.plan) == []


@pytest.mark.parametrize("state", [False, True], ids=["tensors", "state"])
def test_left_padded_batch_matches_the_plan_without_templates(state, monkeypatch):
    got, want = torch_batch_runs(onnxkv.Session(TORCH, threads=2), _plain(TORCH, monkeypatch), 17, 3, state)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_a_mask_with_a_hole_evaluates_the_body_with_the_rebuilt_targets(monkeypatch):
    literal = []
    original = ma.MaskedAttention._literal

    def counting_literal(self, inputs, rt):
        literal.append(tuple(int(v) for v in inputs[6]))
        return original(self, inputs, rt)

    rng = np.random.default_rng(23)
    prompt = rng.integers(0, 259, (1, 8))
    mask = np.ones((1, 8), np.int64)
    mask[0, 3] = 0  # a hole inside the row: not a key range, so the streaming kernel cannot run

    def logits(sess):
        builder = FeedBuilder(sess.plan.inputs, sess.model, prompt, np.array([8]), 0, thread_cache=True)
        feeds, _ = builder.first()
        feeds["attention_mask"] = mask
        return sess.run(feeds, ["logits"])["logits"]

    monkeypatch.setattr(ma.MaskedAttention, "_literal", counting_literal)
    got = logits(onnxkv.Session(TORCH, threads=2))
    assert literal == [(1, 4, 8, 16)] * 2  # both layers, the exact target of the K repeat
    np.testing.assert_allclose(got, logits(_plain(TORCH, monkeypatch)), rtol=1e-5, atol=1e-5)


# -- a repeat_kv product outside an attention block -----------------------------------------------------------------
def _ints(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _repeat_product_model() -> onnx.ModelProto:
    """y = q @ repeat_kv(k)^T with the Shape-derived targets of exports; q [N, 4, S, 8], k [N, 2, T, 8]."""
    nodes = [
        helper.make_node("Shape", ["k"], ["k_shape"]),
        helper.make_node("Gather", ["k_shape", "zero"], ["n"], axis=0),
        helper.make_node("Gather", ["k_shape", "two"], ["t"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axis0"], ["n1"]),
        helper.make_node("Unsqueeze", ["t", "axis0"], ["t1"]),
        helper.make_node("Concat", ["n1", "kv_heads", "group", "t1", "head"], ["expand_shape"], axis=0),
        helper.make_node("Concat", ["n1", "heads", "t1", "head"], ["target"], axis=0),
        helper.make_node("Unsqueeze", ["k", "axis2"], ["k5"]),
        helper.make_node("Expand", ["k5", "expand_shape"], ["k_rep5"]),
        helper.make_node("Reshape", ["k_rep5", "target"], ["k_rep"]),
        helper.make_node("Transpose", ["k_rep"], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "k_t"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("zero", 0), ("two", 2))]
    inits += [
        _ints("axis0", [0]),
        _ints("axis2", [2]),
        _ints("kv_heads", [2]),
        _ints("group", [2]),
        _ints("heads", [4]),
        _ints("head", [8]),
    ]
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, ["N", 4, "S", 8]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, ["N", 2, "T", 8]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    return helper.make_model(
        helper.make_graph(nodes, "repeat", inputs, outputs, inits), opset_imports=[helper.make_opsetid("", 18)]
    )


@pytest.mark.parametrize("n, t", [(2, 5), (1, 1), (0, 3)])
def test_repeat_kv_product_with_a_template_target(n, t, monkeypatch):
    model = _repeat_product_model()
    sess = onnxkv.Session(model, threads=1)
    assert [x.op_type for x in sess.plan.nodes] == ["RepeatKvMatMul"]
    node = sess.plan.nodes[0]
    assert _attr(node, RESHAPE_FROM_X) == [4]
    np.testing.assert_array_equal(sess.plan.build_context.constant(node.input[4]), [0, 4, 0, 8])
    rng = np.random.default_rng(n * 10 + t)
    feeds = {
        "q": rng.standard_normal((n, 4, 3, 8)).astype(np.float32),
        "k": rng.standard_normal((n, 2, t, 8)).astype(np.float32),
    }
    got = sess.run(feeds)["y"]
    want = _plain(model, monkeypatch, 1).run(feeds)["y"]
    assert got.shape == want.shape == (n, 4, 3, t)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        got, feeds["q"] @ np.repeat(feeds["k"], 2, axis=1).swapaxes(-1, -2), rtol=1e-5, atol=1e-5
    )


def test_no_keys_fail_as_in_the_original_graph(monkeypatch):
    # target [n, 4, 0, 8]: Reshape (allowzero=0) copies the 0 entry from the expanded tensor, which does not fit
    model = _repeat_product_model()
    rng = np.random.default_rng(4)
    feeds = {"q": rng.standard_normal((2, 4, 3, 8)).astype(np.float32), "k": np.zeros((2, 2, 0, 8), np.float32)}
    for sess in (onnxkv.Session(model, threads=1), _plain(model, monkeypatch, 1)):
        with pytest.raises(onnxkv.errors.OperatorError, match="cannot reshape"):
            sess.run(feeds)
