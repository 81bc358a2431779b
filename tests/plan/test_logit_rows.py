"""Runs given ``logits_at``: the logits of chosen positions, the LM head computed for those rows alone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

import onnxkv
from onnxkv.errors import InputError
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.zoo.builders import FAMILIES, TINY, build_model
from onnxkv.zoo.embedded import embedded_model_dir

V, H = 50, 16


@pytest.fixture(scope="module", params=["embedded", *FAMILIES])
def session(request):
    if request.param == "embedded":
        return onnxkv.Session(str(embedded_model_dir()))
    return onnxkv.Session(build_model(request.param, TINY))


def _prompt(sess, seed=0, lengths=(11, 7, 9), thread_cache=True):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, min(90, sess.model.vocab_size or 90), size=(len(lengths), max(lengths))).astype(np.int64)
    builder = FeedBuilder(sess.plan.inputs, sess.model, ids, np.array(lengths), 0, thread_cache=thread_cache)
    return builder.first()


def _head_bytes(sess, feeds, at):
    """Bytes the head's logits output was allocated with in a recorded run (a counted quantity)."""
    sess.events.clear()
    sess.events.enabled = True
    try:
        out = sess.run(feeds, [sess.model.io.logits], logits_at=at)
    finally:
        sess.events.enabled = False
    head = sess.plan.logit_head(sess.model.io.logits)
    node = sess.plan.nodes[head.node]
    rows = [e for e in sess.events if e.node == (node.name or node.output[0]) and e.action == "execute"]
    return out, rows[-1].allocated_bytes


def test_every_built_family_has_a_head_and_rows_equal_the_full_logits(session):
    io = session.model.io
    assert session.plan.logit_head(io.logits) is not None
    feeds, read = _prompt(session)
    full = session.run(feeds, [io.logits])[io.logits]
    for at in (read, np.zeros(3, np.int64), np.array([3, 0, 5], np.uint8)):
        part = session.run(feeds, [io.logits], logits_at=at)[io.logits]
        assert part.shape == (3, 1, full.shape[-1])
        np.testing.assert_allclose(part[:, 0], full[np.arange(3), at.astype(np.int64)], rtol=1e-5, atol=1e-5)
    at = np.array([[0, 3], [6, 1], [2, 2]], np.int32)  # K = 2 positions per row (a run of segments reads K rows)
    part = session.run(feeds, [io.logits], logits_at=at)[io.logits]
    assert part.shape == (3, 2, full.shape[-1])
    np.testing.assert_allclose(part, full[np.arange(3)[:, None], at], rtol=1e-5, atol=1e-5)


def test_the_head_computes_only_the_chosen_rows(session):
    feeds, read = _prompt(session)
    out, nbytes = _head_bytes(session, feeds, read)
    vocab = out[session.model.io.logits].shape[-1]
    assert nbytes == 3 * 1 * vocab * 4  # not 3 * 11 * vocab * 4
    out, nbytes = _head_bytes(session, feeds, np.stack([read, read - 1], axis=1))
    assert nbytes == 3 * 2 * vocab * 4


def test_a_state_run_with_logits_at_equals_its_rows_and_keeps_its_cache(session):
    io = session.model.io
    feeds, read = _prompt(session, thread_cache=False)
    a, b = session.new_state(), session.new_state()
    full = a.run(feeds, [io.logits])[io.logits]
    part = b.run(feeds, [io.logits], logits_at=read)[io.logits]
    np.testing.assert_allclose(part[:, 0], full[np.arange(3), read], rtol=1e-5, atol=1e-5)
    assert a.length == b.length
    a.close()
    b.close()


@pytest.mark.parametrize(
    "at, words",
    [
        (np.array([1, 2]), "shape (2,)"),
        (np.array([0, 11, 3]), "from 0 to 11"),
        (np.array([0, -1, 3]), "from -1 to 3"),
        (np.array([0, 2**64 - 1, 3], np.uint64), "18446744073709551615"),
        (np.array([0.0, 1.0, 2.0]), "dtype float64"),
        (np.array([[0, 1, 2]]), "shape (1, 3)"),
        (np.zeros((3, 0), np.int64), "shape (3, 0)"),
        (np.array([[0, 1], [2, 11], [3, 3]]), "from 0 to 11"),
    ],
)
def test_bad_positions_are_refused_before_the_state_changes(at, words):
    sess = onnxkv.Session(build_model("gqa", TINY))
    feeds, _ = _prompt(sess, thread_cache=False)
    state = sess.new_state()
    with pytest.raises(InputError, match="logits_at") as e:
        state.run(feeds, [sess.model.io.logits], logits_at=at)
    assert words in str(e.value)
    assert "[0, 11)" in str(e.value) or "3 integer positions" in str(e.value)
    assert state.length == 0
    state.close()


def _graph(extra_nodes, extra_outputs=(), const=None):
    const = np.array(3.0, np.float32) if const is None else const
    rng = np.random.default_rng(1)
    emb = rng.standard_normal((V, H)).astype(np.float32)
    w = rng.standard_normal((H, V)).astype(np.float32)
    nodes = [oh.make_node("Gather", ["emb", "input_ids"], ["hid"]), oh.make_node("MatMul", ["hid", "W"], ["z"])]
    nodes += extra_nodes
    outputs = [oh.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "S", V])]
    outputs += [oh.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in extra_outputs]
    graph = oh.make_graph(
        nodes,
        "head",
        [oh.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "S"])],
        outputs,
        [nh.from_array(emb, "emb"), nh.from_array(w, "W"), nh.from_array(const, "c")],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


SOFTCAP = [
    oh.make_node("Div", ["z", "c"], ["d"]),
    oh.make_node("Tanh", ["d"], ["t"]),
    oh.make_node("Mul", ["t", "c"], ["logits"]),
]


@pytest.mark.parametrize(
    "model, found",
    [
        (_graph(SOFTCAP), True),  # a softcap after the head: row-wise, with scalar constants
        (_graph(SOFTCAP, const=np.full((1, 1, V), 3.0, np.float32)), True),  # broadcasts along V only
        (_graph(SOFTCAP, extra_outputs=["hid"]), False),  # the head's input is a graph output
        (_graph(SOFTCAP, extra_outputs=["t"]), False),  # a value between head and logits is an output
        (_graph(SOFTCAP, const=np.full((1, 6, 1), 3.0, np.float32)), False),  # a constant per position
        (_graph([oh.make_node("Softmax", ["z"], ["logits"], axis=1)]), False),  # mixes positions
    ],
)
def test_the_head_is_taken_only_where_rows_stay_independent(model, found):
    sess = onnxkv.Session(model)
    assert (sess.plan.logit_head("logits") is not None) is found
    ids = np.random.default_rng(2).integers(0, V, size=(2, 6))
    at = np.array([5, 2])
    full = sess.run({"input_ids": ids}, ["logits"])["logits"]
    part = sess.run({"input_ids": ids}, ["logits"], logits_at=at)["logits"]
    assert part.shape == (2, 1, V)
    np.testing.assert_allclose(part[:, 0], full[np.arange(2), at], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["reduced", "rank-4 constant", "overridable constant"])
def test_a_logits_output_of_another_shape_is_returned_as_computed(case):
    """A constant [1, 1, 1, V] after the head makes the logits rank 4: taking rows before it gave
    [1, B, 1, V].  A default the caller may replace (an initializer listed as an input) is no constant."""
    if case == "reduced":
        model = _graph([oh.make_node("ReduceSum", ["z", "axes"], ["logits"], keepdims=0)])
        model.graph.initializer.append(nh.from_array(np.array([1], np.int64), "axes"))
        shape = (2, V)
    else:
        model = _graph(SOFTCAP, const=np.full((1, 1, 1, V) if case == "rank-4 constant" else (), 3.0, np.float32))
        model.graph.output[0].type.tensor_type.ClearField("shape")
        shape = (1, 2, 6, V) if case == "rank-4 constant" else (2, 6, V)
        if case == "overridable constant":
            model.graph.input.append(oh.make_tensor_value_info("c", TensorProto.FLOAT, None))
    sess = onnxkv.Session(model)
    assert sess.plan.logit_head("logits") is None
    ids = np.random.default_rng(3).integers(0, V, size=(2, 6))
    feeds = (
        {"input_ids": ids}
        if case != "overridable constant"
        else {"input_ids": ids, "c": np.full((1, 6, 1), 2.0, np.float32)}
    )
    full = sess.run(feeds, ["logits"])["logits"]
    part = sess.run(feeds, ["logits"], logits_at=np.array([5, 2]))["logits"]
    assert full.shape == shape and part.shape == (shape if case != "overridable constant" else (2, 1, V))
    np.testing.assert_array_equal(part, full if case != "overridable constant" else full[np.arange(2), [5, 2]][:, None])


def test_generate_feeds_the_head_one_row_per_prompt(session):
    """generate's prompt run asks for the last token's logits only: its tokens are those of a run
    computing every row (the same product, fewer rows)."""
    prompt = [1, 5, 9, 13, 22, 7, 3, 8, 2, 4, 6]
    runs = []
    real = session.plan.run

    def spy(*args, **kw):
        runs.append(kw.get("logits_at", args[7] if len(args) > 7 else None))
        return real(*args, **kw)

    session.plan.run = spy
    try:
        got = onnxkv.generate(session, np.array([prompt]), max_new_tokens=4).tokens
    finally:
        del session.plan.run
    assert runs[0] is not None and runs[0][1].tolist() == [len(prompt) - 1]
    assert all(r is None for r in runs[1:])
    ids = np.array([prompt])
    expect = []
    for _ in range(4):
        feeds, _ = FeedBuilder(session.plan.inputs, session.model, ids, np.array([ids.shape[1]]), 0).first()
        logits = session.run(feeds, [session.model.io.logits])[session.model.io.logits]
        expect.append(int(np.argmax(logits[0, -1])))
        ids = np.concatenate([ids, [[expect[-1]]]], axis=1)
    assert np.asarray(got).ravel().tolist() == expect


def test_onnx_checker_accepts_the_hand_built_graphs():
    onnx.checker.check_model(_graph(SOFTCAP))
