"""A run asked for some outputs skips the nodes that only feed the others (Plan.needed): a prompt chunk
whose caller wants only its cache runs no LM head; cache outputs and in-place writes always run."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

import onnxkv
from onnxkv import Session
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.zoo.builders import MICRO, build_model


def _two_branches():
    """x -> Relu -> a; x -> Neg -> Exp -> b: two outputs that share nothing but the input."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in ("a", "b")]
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("Neg", ["x"], ["n"], name="neg"),
        helper.make_node("Exp", ["n"], ["b"], name="exp"),
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], outs), opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def test_only_the_nodes_of_the_asked_outputs_run():
    session = Session(_two_branches(), threads=1, events=True)
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    assert session.plan.needed((session.plan.slot_of["a"],)) == [True, False, False]
    got = session.run({"x": x}, ["a"])
    np.testing.assert_array_equal(got["a"], np.maximum(x, 0))
    assert [e.node for e in session.events if e.action == "execute"] == ["relu"]
    session.events.clear()
    got = session.run({"x": x}, ["b"])
    np.testing.assert_allclose(got["b"], np.exp(-x))
    assert [e.node for e in session.events if e.action == "execute"] == ["neg", "exp"]
    assert session.plan.needed(tuple(session.plan.output_slots)) is None  # both: every node


def test_a_chunk_that_asks_for_nothing_writes_the_same_cache():
    """State.run(feeds, []) runs every cache writer but not the LM head: the next chunk's logits, which
    read the whole cache, equal those after a first chunk that fetched its logits."""
    session = Session(build_model("gqa", MICRO), threads=1, events=True)
    model = session.model
    prompt = np.random.default_rng(1).integers(3, MICRO.vocab_size, (1, 40))
    results = []
    for first_fetch in ([model.io.logits], []):
        b = FeedBuilder(session.plan.inputs, model, prompt[:, :24], np.array([24]), 0, thread_cache=False)
        feeds, _ = b.first()
        with session.new_state() as state:
            session.events.clear()
            out = state.run(feeds, first_fetch)
            ops = [e.op for e in session.events if e.action == "execute"]
            out = state.run(b.next(prompt[:, 24:], out), [model.io.logits])
            results.append((out[model.io.logits].copy(), ops))
    (with_logits, ops_all), (without, ops_skipped) = results
    np.testing.assert_array_equal(without, with_logits)
    assert len(ops_skipped) < len(ops_all)
    assert ops_all.count("MatMul") > ops_skipped.count("MatMul")  # the LM head did not run
    assert ops_skipped.count("GroupQueryAttention") == ops_all.count("GroupQueryAttention") == MICRO.num_layers


def test_generate_in_chunks_skips_the_heads_of_all_but_the_last_chunk():
    session = Session(build_model("gqa", MICRO), threads=1, events=True)
    prompt = np.random.default_rng(2).integers(3, MICRO.vocab_size, (1, 60))
    chunked = onnxkv.generate(session, prompt, 4, eos_token_id=[], prefill_chunk=16)
    steps = {}
    for e in session.events:
        if e.action == "execute":
            steps.setdefault(e.step, []).append(e.op)
    prompt_steps = sorted(steps)[:4]  # 60 tokens in chunks of 16: 4 runs
    heads = [steps[s].count("MatMul") for s in prompt_steps]
    assert heads[:3] == [heads[0]] * 3 and heads[3] > heads[0]
    whole = onnxkv.generate(
        Session(build_model("gqa", MICRO), threads=1), prompt, 4, eos_token_id=[], prefill_chunk=None
    )
    np.testing.assert_array_equal(chunked.tokens, whole.tokens)


def test_nodes_no_output_depends_on_are_dropped_and_decode_steps_replay():
    """A node whose value nothing reads (an exporter's leftover) is not part of the plan: a run asked for
    every output needs every node, so decode steps still replay as compiled steps (one recording, no
    Python node runs when the steps replay)."""
    model = build_model("gqa", MICRO)
    hidden = next(n for n in model.graph.node if n.op_type == "MatMul").output[0]
    model.graph.node.extend(
        [
            helper.make_node("Relu", [hidden], ["dead_relu"], name="dead_relu"),
            helper.make_node("Neg", ["dead_relu"], ["dead_neg"], name="dead_neg"),
        ]
    )
    session = Session(model, threads=1)
    assert not {"dead_relu", "dead_neg"} & {n.name for n in session.plan.nodes}
    assert session.plan.needed(tuple(session.plan.output_slots)) is None
    prompt = np.random.default_rng(2).integers(3, MICRO.vocab_size, (1, 6))
    want = onnxkv.generate(Session(build_model("gqa", MICRO), threads=1), prompt, 8, eos_token_id=[]).tokens
    got = onnxkv.generate(session, prompt, 8, eos_token_id=[])
    np.testing.assert_array_equal(got.tokens, want)
    assert session.plan.steps.idle and all(s.compiled_nodes == len(session.plan.nodes) for s in session.plan.steps.idle)
