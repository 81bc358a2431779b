"""Plan-time fusion of view/layout operator chains into ai.onnxkv::ViewChain nodes, on the torch export
fixture and on small graphs.

The oracle is the same model planned without this fusion; the chain's kernels run unchanged, so results are
bitwise equal.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_fusion_attention import TORCH, _generate, left_padded_batch, torch_batch_runs

import onnxkv
import onnxkv.plan.fusion_passes as fusion_passes
from onnxkv.plan.context import RunContext
from onnxkv.plan.fusion_view import fuse_view_chains
from onnxkv.plan.ops.view_chain import ViewChain
from onnxkv.plan.registry import BuildContext


def _unfused(model, monkeypatch, threads: int = 2) -> onnxkv.Session:
    with monkeypatch.context() as m:
        m.setattr(fusion_passes, "fuse_view_chains", lambda nodes, protected: nodes)
        return onnxkv.Session(model, threads=threads)


def _body_ops(node: onnx.NodeProto) -> list[str]:
    body = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "body")
    return [n.op_type for n in body.node]


def test_head_split_and_merge_of_the_torch_export_are_fused(monkeypatch):
    nodes = onnxkv.Session(TORCH, threads=1).plan.nodes
    unfused = _unfused(TORCH, monkeypatch, 1).plan.nodes
    chains = [_body_ops(n) for n in nodes if n.op_type == "ViewChain"]
    # per layer: q, k and v split into heads, and the attention output merged back
    assert chains.count(["Reshape", "Transpose"]) == 2 * 3
    assert chains.count(["Reshape", "Transpose", "Reshape"]) == 2
    # (the mask construction's Unsqueeze triples and Reshape pair are inside its ExportMask)
    assert len(chains) == 8 and "ExportMask" in {n.op_type for n in nodes}
    assert len(unfused) - len(nodes) == sum(len(c) - 1 for c in chains) == 2 * (3 * 1 + 2)
    assert not {"Transpose"} & {n.op_type for n in nodes}


@pytest.mark.parametrize("state", [False, True], ids=["tensors", "state"])
def test_left_padded_batch_is_bitwise_the_unfused_plan(state, monkeypatch):
    got, want = torch_batch_runs(onnxkv.Session(TORCH, threads=2), _unfused(TORCH, monkeypatch), 29, 5, state)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# -- small graphs ---------------------------------------------------------------------------------------------------
def _ints(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _model(nodes, outputs=("y",)) -> onnx.ModelProto:
    """x [N, S, 8] -> nodes; ``target`` (a graph input) and a few constant shapes available."""
    inits = [_ints("split", [0, 0, 2, 4]), _ints("merge", [0, 0, -1]), _ints("axis0", [0])]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "S", 8]),
        helper.make_tensor_value_info("target", TensorProto.INT64, [3]),
    ]
    graph = helper.make_graph(
        nodes, "views", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _split_merge(extra_transpose: bool = False) -> list[onnx.NodeProto]:
    """Relu, then split 8 into 2 heads of 4, swap S and heads, [swap back,] merge with a run-time target."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Reshape", ["r", "split"], ["heads"]),
        helper.make_node("Transpose", ["heads"], ["swapped"], perm=[0, 2, 1, 3]),
    ]
    last = "swapped"
    if extra_transpose:
        nodes.append(helper.make_node("Transpose", ["swapped"], ["back"], perm=[0, 2, 1, 3]))
        last = "back"
    nodes.append(helper.make_node("Reshape", [last, "target"], ["y"]))
    return nodes


@pytest.mark.parametrize("n", [2, 1, 0])
def test_split_and_merge_chain_matches_the_unfused_plan(n, monkeypatch):
    model = _model(_split_merge())
    sess = onnxkv.Session(model, threads=1)
    assert [x.op_type for x in sess.plan.nodes] == ["Relu", "ViewChain"]
    assert _body_ops(sess.plan.nodes[1]) == ["Reshape", "Transpose", "Reshape"]
    x = np.random.default_rng(n).standard_normal((n, 3, 8)).astype(np.float32)
    feeds = {"x": x, "target": np.array([n, 2, 12], np.int64)}
    got = sess.run(feeds)["y"]
    want = _unfused(model, monkeypatch, 1).run(feeds)["y"]
    assert got.shape == want.shape == (n, 2, 12)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, np.maximum(x, 0).reshape(n, 3, 2, 4).transpose(0, 2, 1, 3).reshape(n, 2, 12))


def test_a_second_transpose_starts_a_new_chain():
    sess = onnxkv.Session(_model(_split_merge(extra_transpose=True)), threads=1)
    ops = [x.op_type for x in sess.plan.nodes]
    assert ops == ["Relu", "ViewChain", "ViewChain"]
    assert [_body_ops(x) for x in sess.plan.nodes[1:]] == [["Reshape", "Transpose"], ["Transpose", "Reshape"]]
    x = np.random.default_rng(3).standard_normal((2, 3, 8)).astype(np.float32)
    got = sess.run({"x": x, "target": np.array([2, 3, 8], np.int64)})["y"]
    np.testing.assert_array_equal(got, np.maximum(x, 0))


def test_an_intermediate_graph_output_or_second_reader_ends_the_chain():
    nodes = _split_merge() + [helper.make_node("Neg", ["heads"], ["neg"])]
    sess = onnxkv.Session(_model(nodes, ("y", "swapped", "neg")), threads=1)
    # heads has two readers and swapped is a graph output: no pair of view nodes may fuse
    assert "ViewChain" not in [x.op_type for x in sess.plan.nodes]
    x = np.random.default_rng(4).standard_normal((2, 3, 8)).astype(np.float32)
    out = sess.run({"x": x, "target": np.array([2, 2, 12], np.int64)})
    np.testing.assert_array_equal(out["swapped"], np.maximum(x, 0).reshape(2, 3, 2, 4).transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(out["neg"], -np.maximum(x, 0).reshape(2, 3, 2, 4))


def test_a_view_only_chain_returns_a_view_of_its_data():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Reshape", ["r", "merge"], ["flat"]),
        helper.make_node("Unsqueeze", ["flat", "axis0"], ["u"]),
        helper.make_node("Squeeze", ["u", "axis0"], ["y"]),
        helper.make_node("Sigmoid", ["r"], ["z"]),
    ]
    sess = onnxkv.Session(_model(nodes, ("y", "z")), threads=1)
    fused = [x for x in sess.plan.nodes if x.op_type == "ViewChain"]
    assert len(fused) == 1 and _body_ops(fused[0]) == ["Reshape", "Unsqueeze", "Squeeze"]
    x = np.random.default_rng(5).standard_normal((2, 3, 8)).astype(np.float32)
    out = sess.run({"x": x, "target": np.array([1, 1, 1], np.int64)})
    np.testing.assert_array_equal(out["y"], np.maximum(x, 0))
    np.testing.assert_allclose(out["z"], 1 / (1 + np.exp(-np.maximum(x, 0))), rtol=1e-6)


def test_a_failing_step_names_its_node():
    sess = onnxkv.Session(_model(_split_merge()), threads=1)
    x = np.random.default_rng(6).standard_normal((2, 3, 8)).astype(np.float32)
    with pytest.raises(onnxkv.OperatorError, match="cannot reshape"):
        sess.run({"x": x, "target": np.array([5, 5, 5], np.int64)})


def test_a_body_that_is_not_a_chain_is_rejected():
    body = helper.make_graph(
        [helper.make_node("Reshape", ["other", "s"], ["y"])],
        "b",
        [helper.make_empty_tensor_value_info(v) for v in ("x", "s", "other")],
        [helper.make_empty_tensor_value_info("y")],
    )
    node = helper.make_node("ViewChain", ["x", "s", "other"], ["y"], name="vc", domain="ai.onnxkv", body=body)
    with pytest.raises(onnxkv.ModelError, match="ViewChain node 'vc'"):
        ViewChain(node, BuildContext({"": 18, "ai.onnxkv": 1}))


# -- the view path --------------------------------------------------------------------------------------------------
class _CountingRun(RunContext):
    """A run context whose ``empty`` hands out NumPy arrays and counts them."""

    def __init__(self) -> None:
        self.taken = 0

        def take(_rt, _index, shape, dtype):
            self.taken += 1
            return np.empty(shape, dtype)

        super().__init__(take, False, 0)


def _kernel(nodes: list[onnx.NodeProto], constants: dict[str, np.ndarray]) -> ViewChain:
    """The ViewChain kernel of the one chain ``nodes`` make (first input: the data)."""
    fused = fuse_view_chains(nodes, set())
    assert len(fused) == 1 and fused[0].op_type == "ViewChain"
    return ViewChain(fused[0], BuildContext({"": 18, "ai.onnxkv": 1}, constants))


def _literal(kernel: ViewChain, inputs: list) -> np.ndarray:
    """The chain run one kernel after the other (the fused node's literal path)."""
    return kernel._chain(inputs[0], inputs, _CountingRun())


#: Head split target of :func:`_split`: [B, S, 24] -> [B, S, 4, 6] (a build-time constant).
SPLIT = np.array([0, 0, 4, 6], np.int64)


def _split() -> list[onnx.NodeProto]:
    """[B, S, 24] -> [B, 4, S, 6]."""
    return [
        helper.make_node("Reshape", ["q", "split"], ["h"]),
        helper.make_node("Transpose", ["h"], ["t"], perm=[0, 2, 1, 3]),
    ]


def _merge() -> list[onnx.NodeProto]:
    """[B, H, S, D] -> [B, S, H * D] with run-time targets ``bhsd`` and ``bsh``."""
    return [
        helper.make_node("Reshape", ["a", "bhsd"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["t", "bsh"], ["y"]),
    ]


@pytest.mark.parametrize("batch", [1, 2])
def test_a_decode_head_split_is_a_view_of_its_input(batch):
    kernel = _kernel(_split(), {"split": SPLIT})
    q = np.random.default_rng(batch).standard_normal((batch, 1, 24)).astype(np.float32)
    rt = _CountingRun()
    for _ in range(2):  # learnt on the first call, remembered on the second
        (y,) = kernel.run([q, SPLIT], rt)
        assert rt.taken == 0 and np.shares_memory(y, q) and y.flags.c_contiguous
        np.testing.assert_array_equal(y, _literal(kernel, [q, SPLIT]))
        assert y.shape == (batch, 4, 1, 6)
    assert kernel._memo.keys() == [(batch, 1, 24)]


@pytest.mark.parametrize("seq", [1, 3])
def test_a_merge_with_run_time_targets_is_a_view_only_for_one_position(seq):
    kernel = _kernel(_merge(), {})
    assert kernel._keyed == (1, 2)
    a = np.random.default_rng(seq).standard_normal((2, 4, seq, 6)).astype(np.float32)
    inputs = [a, np.array([2, 4, seq, 6], np.int64), np.array([2, seq, 24], np.int64)]
    rt = _CountingRun()
    (y,) = kernel.run(inputs, rt)
    want = a.transpose(0, 2, 1, 3).reshape(2, seq, 24)
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(y, _literal(kernel, inputs))
    # one position: the Transpose only moves a length-1 axis, so no copy; more: the chain's one copy
    assert (np.shares_memory(y, a), rt.taken) == ((True, 0) if seq == 1 else (False, 1))


def test_other_target_values_are_learnt_separately():
    kernel = _kernel(_merge(), {})
    a = np.random.default_rng(7).standard_normal((1, 2, 1, 6)).astype(np.float32)
    flat = [a, np.array([1, 2, 1, 6], np.int64), np.array([1, 1, 12], np.int64)]
    split = [a, np.array([1, 2, 1, 6], np.int64), np.array([1, 12, 1], np.int64)]
    for inputs in (flat, split, flat):
        (y,) = kernel.run(inputs, _CountingRun())
        np.testing.assert_array_equal(y, _literal(kernel, inputs))
        assert y.shape == tuple(inputs[2]) and np.shares_memory(y, a)
    assert len(kernel._memo.keys()) == 2


def test_a_non_contiguous_input_takes_the_literal_chain():
    kernel = _kernel(_split(), {"split": SPLIT})
    wide = np.random.default_rng(8).standard_normal((2, 1, 48)).astype(np.float32)
    q = wide[:, :, ::2]
    rt = _CountingRun()
    (y,) = kernel.run([q, SPLIT], rt)
    assert rt.taken == 1 and not np.shares_memory(y, wide) and y.flags.c_contiguous
    np.testing.assert_array_equal(y, q.reshape(2, 1, 4, 6).transpose(0, 2, 1, 3))


def test_a_chain_that_fails_raises_from_the_literal_chain_every_time():
    kernel = _kernel(_merge(), {})
    a = np.random.default_rng(9).standard_normal((1, 2, 1, 6)).astype(np.float32)
    inputs = [a, np.array([1, 5, 1, 6], np.int64), np.array([1, 1, 12], np.int64)]
    for _ in range(2):
        with pytest.raises(ValueError, match="cannot reshape"):
            kernel.run(inputs, _CountingRun())


def test_the_memo_starts_over_when_full():
    kernel = _kernel(_split(), {"split": SPLIT})
    for n in range(kernel._memo.size + 1):
        q = np.random.default_rng(n).standard_normal((1, n + 1, 24)).astype(np.float32)
        (y,) = kernel.run([q, SPLIT], _CountingRun())
        np.testing.assert_array_equal(y, q.reshape(1, n + 1, 4, 6).transpose(0, 2, 1, 3))
    assert len(kernel._memo.keys()) == 1


@pytest.mark.parametrize("state", [False, True], ids=["tensors", "state"])
def test_decode_steps_of_the_torch_export_run_no_literal_chain(state, monkeypatch):
    literal_shapes = []
    chain = ViewChain._chain

    def counting(self, x, inputs, rt):
        if self._transposes:  # chains without one always run literally (as views)
            literal_shapes.append(x.shape)
        return chain(self, x, inputs, rt)

    monkeypatch.setattr(ViewChain, "_chain", counting)
    prompt, lengths, tokens = left_padded_batch("torch", 11, padding=2, steps=3)
    _generate(onnxkv.Session(TORCH, threads=2), prompt, lengths, tokens[:, :0], state)
    prefill = len(literal_shapes)
    assert prefill == 2 * 4  # per layer: the q, k and v splits and the merge of all 9 positions copy
    got = _generate(onnxkv.Session(TORCH, threads=2), prompt, lengths, tokens, state)
    assert len(literal_shapes) == 2 * prefill  # ... and the 3 decode steps none
    want = _generate(_unfused(TORCH, monkeypatch), prompt, lengths, tokens, state)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_a_chain_without_transpose_runs_its_views_without_learning():
    kernel = _kernel(
        [helper.make_node("Unsqueeze", ["v", "a0"], ["u"]), helper.make_node("Unsqueeze", ["u", "a0"], ["w"])],
        {"a0": np.array([0], np.int64)},
    )
    for n in (5, 6, 7):  # a vector growing by one position per decode step
        v = np.random.default_rng(n).integers(0, 9, n)
        (y,) = kernel.run([v, np.array([0], np.int64)], _CountingRun())
        assert y.shape == (1, 1, n) and np.shares_memory(y, v)
        np.testing.assert_array_equal(y[0, 0], v)
    assert kernel._memo.keys() == []
