"""Plan-time fusion of an RMS norm / SiluMul with the packed product reading it (ai.onnxkv::PrologueMatMul).

The oracle is the same model planned without this fusion: outputs and caches
must be bit for bit equal, on the fused path (decode rows and prompts of any
length, compilable up to STEP_M rows) and on the literal body (inputs the
prologue's kernel does not take).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxkv
import onnxkv.plan.fusion_passes as fusion_passes
import onnxkv.plan.ops.prologue_matmul as prologue_module
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.plan.ops._body import Body
from onnxkv.zoo.builders import MICRO, build_model


def _session(model, fused: bool, monkeypatch, threads: int = 1) -> onnxkv.Session:
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(fusion_passes, "fuse_prologue_matmuls", lambda nodes, protected, constants: nodes)
        return onnxkv.Session(model, threads=threads)


def test_builder_graph_fuses_every_norm_and_gate_with_its_projection(monkeypatch):
    model = build_model("gqa", MICRO, seed=3)
    fused = _session(model, True, monkeypatch).plan.nodes
    plain = _session(model, False, monkeypatch).plan.nodes
    kinds = sorted(
        next(a.g for a in n.attribute if a.name == "body").node[0].op_type
        for n in fused
        if n.op_type == "PrologueMatMul"
    )
    # per layer: input norm + q/k/v (a skip norm after layer 0), post-attention skip norm + gate/up, SiluMul +
    # down; then the final skip norm + lm_head
    L = MICRO.num_layers
    assert kinds == sorted(
        ["SimplifiedLayerNormalization"] + ["SkipSimplifiedLayerNormalization"] * (2 * L) + ["SiluMul"] * L
    )
    assert len(plain) - len(fused) == 3 * L + 1
    assert not any(
        n.op_type in ("SiluMul", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization") for n in fused
    )


def _generate(session, prompt_len: int, steps: int, evaluate_calls: list, check: bool = False):
    prompt = np.random.default_rng(prompt_len).integers(0, MICRO.vocab_size, (1, prompt_len))
    b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([prompt_len]), 0, thread_cache=False)
    got = []
    with session.new_state() as st:
        feeds, _ = b.first()
        out = st.run(feeds, ["logits"])
        got.append(out["logits"].copy())
        if check:  # the prompt: the fused kernels, above the compilable row limit too
            assert evaluate_calls == []
        evaluate_calls.clear()
        for i in range(steps):
            out = st.run(b.next(np.array([(7 * i + 1) % MICRO.vocab_size]), out), ["logits"])
            got.append(out["logits"].copy())
        got += [np.array(v) for v in st.values.values()]
    return got


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("prompt_len", [5, 20])
def test_results_are_bitwise_those_of_the_unfused_plan(threads, prompt_len, monkeypatch):
    """Decode steps and prompts take the fused path (no literal evaluation), a prompt above the compilable
    row limit too (lowered to 8 here: the model's positions stop at 128); the plan without the fusion is the
    oracle."""
    monkeypatch.setattr(prologue_module, "STEP_M", 8)
    calls = []
    original = Body.evaluate

    def spy(self, names, inputs, rt):
        calls.append(self)
        return original(self, names, inputs, rt)

    monkeypatch.setattr(Body, "evaluate", spy)
    model = build_model("gqa", MICRO, seed=4)
    got = _generate(_session(model, True, monkeypatch, threads), prompt_len, 6, calls, check=True)
    assert calls == []  # every decode step ran the fused kernels
    want = _generate(_session(model, False, monkeypatch, threads), prompt_len, 6, [])
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def _norm_graph(y_readers: int, y_is_output: bool):
    """y = SimplifiedLayerNormalization(x, g); z = y @ w; with 2 readers also n = Neg(y) (y a graph output if
    asked)."""
    rng = np.random.default_rng(8)
    inits = [
        numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "g"),
        numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w"),
    ]
    nodes = [
        helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y"], epsilon=1e-5),
        helper.make_node("MatMul", ["y", "w"], ["z"]),
    ]
    outputs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)]
    if y_readers == 2:
        nodes.append(helper.make_node("Neg", ["y"], ["n"]))
        outputs.append(helper.make_tensor_value_info("n", TensorProto.FLOAT, None))
    if y_is_output:
        outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 16])], outputs, inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize(
    "readers, y_is_output, fused",
    [(1, False, True), (1, True, False), (2, False, False)],
    ids=["one-reader", "observable", "two-readers"],
)
def test_only_a_norm_read_by_one_product_alone_is_fused(readers, y_is_output, fused, monkeypatch):
    model = _norm_graph(readers, y_is_output)
    sess = _session(model, True, monkeypatch)
    assert any(n.op_type == "PrologueMatMul" for n in sess.plan.nodes) == fused
    x = np.random.default_rng(9).standard_normal((3, 16)).astype(np.float32)
    got = sess.run({"x": x})
    want = _session(model, False, monkeypatch).run({"x": x})
    assert got.keys() == want.keys()
    for k in got:
        np.testing.assert_array_equal(got[k], want[k])


def test_non_float32_norm_input_takes_the_literal_body_with_its_error(monkeypatch):
    """A float64 x: the fused node evaluates the two nodes, whose MatMul refuses it as it would unfused."""
    model = _norm_graph(1, False)
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    model.graph.initializer[0].CopyFrom(
        numpy_helper.from_array(numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64), "g")
    )
    x = np.random.default_rng(10).standard_normal((2, 16))
    errors = []
    for fused in (True, False):
        with pytest.raises(onnxkv.OnnxkvError) as e:
            _session(model, fused, monkeypatch).run({"x": x})
        errors.append(str(e.value))
    assert "A must be float32" in errors[0] and "A must be float32" in errors[1]


def test_compilable_up_to_step_m_rows_and_fused_above(monkeypatch):
    """Up to STEP_M rows a compiled step may record the node; above it the node still runs its own kernels
    (not the body), its product's output taken from the run's buffers."""
    monkeypatch.setattr(prologue_module, "STEP_M", 8)
    model = _norm_graph(1, False)
    sess = _session(model, True, monkeypatch)
    (op,) = [k for n, k in zip(sess.plan.nodes, sess.plan.kernels) if n.op_type == "PrologueMatMul"]
    g = numpy_helper.to_array(model.graph.initializer[0])
    rng = np.random.default_rng(12)
    for rows, compilable in [(8, True), (9, False)]:
        x = rng.standard_normal((rows, 16)).astype(np.float32)
        assert op.compilable([x, g]) is compilable
        assert op._fused(x, [x, g])
    taken = []

    def take(rt, index, shape, dtype):
        taken.append(index)
        return np.empty(shape, dtype)

    monkeypatch.setattr(Body, "evaluate", lambda *a: pytest.fail("the body was evaluated"))
    x = rng.standard_normal((40, 16)).astype(np.float32)
    (z,) = op.run([x, g], onnxkv.plan.context.RunContext(take, False, 0))
    assert taken == [0]
    want = _session(model, False, monkeypatch).run({"x": x})["z"]
    np.testing.assert_array_equal(z, want)
