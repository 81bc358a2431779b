"""Plan-time fusion of a residual Add [+ Cast] and the RMSNormChain reading it (ai.onnxkv::SkipRMSNormChain),
on the torch export fixture and on small graphs whose run-time checks fail.

The oracle is the same model planned without this fusion.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_fusion_attention import TORCH, torch_batch_runs

import onnxkv
import onnxkv.plan.fusion_passes as fusion_passes
from onnxkv.plan.ops import _body, norm


@pytest.fixture
def calls(monkeypatch):
    """Counts the compiled skip_rms_norm calls and the literal evaluations of SkipRMSNormChain bodies."""
    seen = {"kernel": 0, "literal": 0}
    skip, evaluate = norm.K.skip_rms_norm, _body.Body.evaluate

    def counting_skip(*args):
        seen["kernel"] += 1
        return skip(*args)

    def counting_evaluate(self, names, inputs, rt):
        if self.kernel("RMSNormChain") is not None:
            seen["literal"] += 1
        return evaluate(self, names, inputs, rt)

    monkeypatch.setattr(norm.K, "skip_rms_norm", counting_skip)
    monkeypatch.setattr(_body.Body, "evaluate", counting_evaluate)
    return seen


def _unfused(model, monkeypatch, threads: int = 2) -> onnxkv.Session:
    with monkeypatch.context() as m:
        m.setattr(fusion_passes, "fuse_skip_rms_norm", lambda nodes, protected: nodes)
        return onnxkv.Session(model, threads=threads)


def test_every_residual_norm_of_the_torch_export_is_fused(monkeypatch):
    fused = [n.op_type for n in onnxkv.Session(TORCH, threads=1).plan.nodes]
    unfused = [n.op_type for n in _unfused(TORCH, monkeypatch, 1).plan.nodes]
    # the first norm reads the embedding; the other four a residual sum (Add + Cast in the layers, Add alone
    # before the final norm)
    assert fused.count("SkipRMSNormChain") == 4 and fused.count("RMSNormChain") == 1
    assert unfused.count("RMSNormChain") == 5
    assert len(unfused) - len(fused) == 3 * 2 + 1
    assert fused.count("Add") == unfused.count("Add") - 4


@pytest.mark.parametrize("state", [False, True], ids=["tensors", "state"])
def test_left_padded_batch_matches_the_unfused_plan(state, calls, monkeypatch):
    fused = onnxkv.Session(TORCH, threads=2, compiled_steps=False)  # every run through the op
    got, want = torch_batch_runs(fused, _unfused(TORCH, monkeypatch), 41, 2, state)
    assert calls == {"kernel": 4 * 4, "literal": 0}  # prefill + 3 decode steps, four fused norms each
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


# -- small graphs: run-time checks ---------------------------------------------------------------------------------
def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))


def _model(b_shape, elem=TensorProto.FLOAT, cast: bool = True, stream: bool = True) -> onnx.ModelProto:
    """y = rms_norm(c) * w with c = [Cast](a + b) over a [N, 3, 8]; with ``stream`` also z = 2 * c."""
    dtype = {TensorProto.DOUBLE: np.float64, TensorProto.FLOAT16: np.float16}.get(elem, np.float32)
    nodes = [
        _const("p", dtype(2.0)),
        _const("axes", np.array([-1], np.int64)),
        _const("eps", dtype(1e-5)),
        _const("one", dtype(1.0)),
        _const("two", dtype(2.0)),
        helper.make_node("Add", ["a", "b"], ["s"]),
        helper.make_node("Pow", ["c", "p"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1),
        helper.make_node("Add", ["mean", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["std"]),
        helper.make_node("Div", ["one", "std"], ["inv"]),
        helper.make_node("Mul", ["c", "inv"], ["normed"]),
        helper.make_node("Mul", ["w", "normed"], ["y"]),
    ]
    if cast:
        nodes.insert(6, helper.make_node("Cast", ["s"], ["c"], to=elem))
    else:
        for n in nodes:
            n.input[:] = ["s" if x == "c" else x for x in n.input]
    outputs = [helper.make_tensor_value_info("y", elem, ["N", 3, 8])]
    if stream:
        nodes.append(helper.make_node("Mul", ["c" if cast else "s", "two"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", elem, ["N", 3, 8]))
    inputs = [helper.make_tensor_value_info("a", elem, ["N", 3, 8]), helper.make_tensor_value_info("b", elem, b_shape)]
    w = numpy_helper.from_array(np.random.default_rng(5).uniform(0.5, 1.5, 8).astype(dtype), "w")
    return helper.make_model(
        helper.make_graph(nodes, "skip_rms", inputs, outputs, [w]), opset_imports=[helper.make_opsetid("", 18)]
    )


def _feeds(rows: int, b_shape, dtype=np.float32, seed: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((rows, 3, 8)).astype(dtype), "b": rng.standard_normal(b_shape).astype(dtype)}


@pytest.mark.parametrize("cast", [True, False], ids=["cast", "no_cast"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "norm_only"])
def test_same_shape_float32_addends_run_the_kernel(cast, stream, calls, monkeypatch):
    model = _model(["N", 3, 8], cast=cast, stream=stream)
    sess = onnxkv.Session(model, threads=1)
    ops = [n.op_type for n in sess.plan.nodes]
    assert ops[0] == "SkipRMSNormChain" and "Add" not in ops and "Cast" not in ops
    assert bool(sess.plan.nodes[0].output[1]) == stream
    feeds = _feeds(2, (2, 3, 8))
    got = sess.run(feeds)
    assert calls == {"kernel": 1, "literal": 0}
    want = _unfused(model, monkeypatch, 1).run(feeds)
    assert got.keys() == want.keys()
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-5, atol=1e-6)
    if stream:
        np.testing.assert_array_equal(got["z"], want["z"])  # the sum itself is exact


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "norm_only"])
def test_float16_chains_run_the_float32_kernel_rounded_once(stream, calls, monkeypatch):
    """A float16 export's residual norm: the float16 sum as the Add makes it, normalised by the float32 kernel
    and rounded once (ONNX Runtime's fused float16 norm), within a float16 step of the literal chain; where the
    chain's float16 x² overflows, the fused result stays finite."""
    model = _model(["N", 3, 8], TensorProto.FLOAT16, cast=False, stream=stream)
    sess = onnxkv.Session(model, threads=1)
    assert [n.op_type for n in sess.plan.nodes][0] == "SkipRMSNormChain"
    feeds = _feeds(4, (4, 3, 8), np.float16)
    got = sess.run(feeds)
    assert calls["literal"] == 0
    want = _unfused(model, monkeypatch, 1).run(feeds)
    assert got["y"].dtype == np.float16
    np.testing.assert_allclose(got["y"].astype(np.float32), want["y"].astype(np.float32), rtol=4e-3, atol=4e-3)
    if stream:
        np.testing.assert_array_equal(got["z"], want["z"])  # the float16 sum, as the Add rounds it
    big = {"a": feeds["a"] * np.float16(300), "b": feeds["b"] * np.float16(300)}
    c = (big["a"] + big["b"]).astype(np.float64)  # |c| to about 1,500: c² far beyond float16's 65,504
    w = next(numpy_helper.to_array(i) for i in model.graph.initializer if i.name == "w").astype(np.float64)
    exact = w * c / np.sqrt(np.mean(c * c, -1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(sess.run(big)["y"].astype(np.float64), exact, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("case", ["broadcast_addend", "empty_batch", "float64"])
def test_the_original_nodes_run_when_a_check_fails(case, calls, monkeypatch):
    b_shape = [8] if case == "broadcast_addend" else ["N", 3, 8]
    elem, dtype = (TensorProto.DOUBLE, np.float64) if case == "float64" else (TensorProto.FLOAT, np.float32)
    model = _model(b_shape, elem, cast=case != "float64")  # a Cast to float64 is not the float Cast of exports
    sess = onnxkv.Session(model, threads=1)
    assert [n.op_type for n in sess.plan.nodes] == ["SkipRMSNormChain", "Mul"]
    rows = 0 if case == "empty_batch" else 2
    feeds = _feeds(rows, (8,) if case == "broadcast_addend" else (rows, 3, 8), dtype)
    got = sess.run(feeds)
    assert calls == {"kernel": 0, "literal": 1}
    want = _unfused(model, monkeypatch, 1).run(feeds)
    for name in ("y", "z"):
        assert got[name].shape == want[name].shape == (rows, 3, 8)
        np.testing.assert_array_equal(got[name], want[name])


def test_a_sum_read_before_the_norm_is_not_fused():
    model = _model(["N", 3, 8])
    graph = model.graph
    # move the residual reader before the norm's first node: the fused node could not produce it in time
    mul = graph.node[-1]
    nodes = list(graph.node[:-1])
    nodes.insert(7, mul)
    del graph.node[:]
    graph.node.extend(nodes)
    sess = onnxkv.Session(model, threads=1)
    assert "SkipRMSNormChain" not in [n.op_type for n in sess.plan.nodes]
    feeds = _feeds(2, (2, 3, 8))
    np.testing.assert_array_equal(sess.run(feeds)["z"], 2 * (feeds["a"] + feeds["b"]))
