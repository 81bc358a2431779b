"""Plan-time fusion of GroupQueryAttention's mask lengths (ai.onnxkv::MaskLengths), on the builder's graphs
and on small graphs whose run-time checks fail.

The oracle is the same model planned without this fusion, and the fused node's own body.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxkv
import onnxkv.plan.fusion_passes as fusion_passes
from onnxkv.plan.ops import _body
from onnxkv.zoo.builders import MICRO, build_model

MASK_OPS = {"ReduceSum", "Sub", "Shape", "Cast", "ShapeOf"}  # (Gather: the embedding has one too)


def _unfused(model, monkeypatch) -> onnxkv.Session:
    with monkeypatch.context() as m:
        m.setattr(fusion_passes, "fuse_mask_lengths", lambda nodes, protected: nodes)
        return onnxkv.Session(model, threads=1)


@pytest.fixture
def literal(monkeypatch):
    """Counts the literal evaluations of MaskLengths bodies."""
    seen = []
    evaluate = _body.Body.evaluate

    def counting(self, names, inputs, rt):
        if self.node("ReduceSum") is not None and self.node("Shape") is not None:
            seen.append(1)
        return evaluate(self, names, inputs, rt)

    monkeypatch.setattr(_body.Body, "evaluate", counting)
    return seen


def test_the_builder_graph_computes_both_lengths_in_one_node_with_the_unfused_results(monkeypatch, literal):
    model = build_model("gqa", MICRO, seed=21)
    fused, unfused = onnxkv.Session(model, threads=1), _unfused(model, monkeypatch)
    ops = [n.op_type for n in fused.plan.nodes]
    assert ops.count("MaskLengths") == 1 and not MASK_OPS & set(ops)
    assert MASK_OPS & {n.op_type for n in unfused.plan.nodes}
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, MICRO.vocab_size, (2, 6))
    mask = np.ones((2, 6), np.int64)
    mask[1, :2] = 0  # left padding
    for cache in ("tensor", "contiguous"):
        got = onnxkv.generate(fused, prompt, max_new_tokens=5, attention_mask=mask, cache=cache)
        want = onnxkv.generate(unfused, prompt, max_new_tokens=5, attention_mask=mask, cache=cache)
        np.testing.assert_array_equal(got.tokens, want.tokens)
    assert not literal  # every run took the one call


def _mask_graph(one: int = 1, index=1, axes=(1,), mask_type=TensorProto.INT64) -> onnx.ModelProto:
    """The builder's six mask nodes alone: attention_mask -> (seqlens_k, total)."""
    idx = np.array(index, np.int64)
    inits = [
        numpy_helper.from_array(np.array(list(axes), np.int64), "axes"),
        numpy_helper.from_array(np.array([one], np.int32 if mask_type == TensorProto.INT32 else np.int64), "one"),
        numpy_helper.from_array(idx, "index"),
    ]
    nodes = [
        helper.make_node("ReduceSum", ["attention_mask", "axes"], ["r"], keepdims=0),
        helper.make_node("Sub", ["r", "one"], ["s"]),
        helper.make_node("Cast", ["s"], ["seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["sh"]),
        helper.make_node("Gather", ["sh", "index"], ["g"], axis=0),
        helper.make_node("Cast", ["g"], ["total"], to=TensorProto.INT32),
    ]
    graph = helper.make_graph(
        nodes,
        "mask",
        [helper.make_tensor_value_info("attention_mask", mask_type, ["B", "L"])],
        [
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, None),
            helper.make_tensor_value_info("total", TensorProto.INT32, None),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize(
    "kw,literal_runs",
    [({}, 0), ({"index": [1]}, 0), ({"one": 2}, 1), ({"index": 0}, 1), ({"axes": (0,)}, 1),
     ({"mask_type": TensorProto.INT32}, 1)],
    ids=["builder", "index-1d", "other-one", "other-index", "other-axes", "int32-mask"],
)  # fmt: skip
def test_values_equal_the_unfused_graph_and_other_constants_take_the_body(kw, literal_runs, monkeypatch, literal):
    model = _mask_graph(**kw)
    fused, unfused = onnxkv.Session(model, threads=1), _unfused(model, monkeypatch)
    assert [n.op_type for n in fused.plan.nodes] == ["MaskLengths"]
    dtype = np.int32 if kw.get("mask_type") == TensorProto.INT32 else np.int64
    rng = np.random.default_rng(1)
    for shape in [(1, 9), (3, 5), (2, 1)]:
        mask = rng.integers(0, 2, shape).astype(dtype)
        got, want = fused.run({"attention_mask": mask}), unfused.run({"attention_mask": mask})
        for name in ("seqlens_k", "total"):
            assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
            np.testing.assert_array_equal(got[name], want[name])
    assert len(literal) == 3 * literal_runs


def test_a_rank_other_than_two_fails_as_the_unfused_graph(monkeypatch):
    model = _mask_graph()
    fused, unfused = onnxkv.Session(model, threads=1), _unfused(model, monkeypatch)
    errors = []
    for session in (fused, unfused):
        with pytest.raises(onnxkv.errors.OnnxkvError) as e:
            session.run({"attention_mask": np.ones(4, np.int64)})
        errors.append(type(e.value))
    assert errors[0] is errors[1]


def test_a_length_read_before_the_pair_ends_is_left_alone():
    model = _mask_graph()
    g = model.graph
    # a reader of seqlens_k placed between the two chains
    g.node.insert(3, helper.make_node("Identity", ["seqlens_k"], ["early"]))
    g.output.append(helper.make_tensor_value_info("early", TensorProto.INT32, None))
    ops = [n.op_type for n in onnxkv.Session(model, threads=1).plan.nodes]
    assert "MaskLengths" not in ops
