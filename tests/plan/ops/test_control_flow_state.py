"""Control flow in a decoder run by a State: KV caches beside an If, caches kept out of subgraphs, cancellation."""

from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper
from ort_loop import ort_session

from onnxkv import CacheConfig, Session
from onnxkv.errors import Cancelled
from onnxkv.runtime.state import Cancellation
from onnxkv.zoo.concat import build_concat_model
from onnxkv.zoo.config import MICRO

MASK = "/model/attn_mask/Where"


def _decoder_with_if(read_past: bool = False) -> onnx.ModelProto:
    """The Concat-cache decoder whose attention bias comes from an If on the sequence length.

    Prefill (more than one new token) takes the causal ``Where``; a decode step the same bias computed
    another way.  With ``read_past`` the prefill branch also reads layer 0's past keys (adding 0 times
    their sum), which puts that cache through control flow.
    """
    model = build_concat_model(MICRO)
    graph = model.graph
    index, where = next((i, n) for i, n in enumerate(graph.node) if n.name == MASK)
    allowed, zero, low = where.input
    then_nodes = [h.make_node("Where", [allowed, zero, low], ["then_bias"])]
    if read_past:
        then_nodes += [
            h.make_node("ReduceSum", ["past_key_values.0.key"], ["past_sum"], keepdims=0),
            h.make_node("Mul", ["past_sum", zero], ["nothing"]),
            h.make_node("Add", ["then_bias", "nothing"], ["then_out"]),
        ]
    then_out = h.make_tensor_value_info(then_nodes[-1].output[0], T.FLOAT, None)
    then_branch = h.make_graph(then_nodes, "prefill", [], [then_out])
    else_branch = h.make_graph(
        [
            h.make_node("Cast", [allowed], ["allowed_f"], to=T.FLOAT),
            h.make_node("Sub", ["one_f", "allowed_f"], ["blocked"]),
            h.make_node("Mul", ["blocked", low], ["else_bias"]),
        ],
        "decode",
        [],
        [h.make_tensor_value_info("else_bias", T.FLOAT, None)],
        [numpy_helper.from_array(np.array(1, np.float32), "one_f")],
    )
    seq = "/model/attn_mask/Gather_seq/output_0"
    graph.initializer.append(numpy_helper.from_array(np.array(1, np.int64), "one_token"))
    del graph.node[index]
    graph.node.insert(
        index,
        h.make_node(
            "If",
            ["prefill"],
            list(where.output),
            name="/model/attn_mask/If",
            then_branch=then_branch,
            else_branch=else_branch,
        ),
    )
    graph.node.insert(index, h.make_node("Greater", [seq, "one_token"], ["prefill"], name="/model/attn_mask/Greater"))
    return model


def _spinning(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its logits passed through a Loop of ``trips`` iterations whose body does nothing."""
    graph = model.graph
    lm_head = next(n for n in graph.node if n.output[0] == "logits")
    lm_head.output[0] = "raw_logits"
    body = h.make_graph(
        [],
        "spin_body",
        [
            h.make_tensor_value_info("i", T.INT64, []),
            h.make_tensor_value_info("c", T.BOOL, []),
            h.make_tensor_value_info("l", T.FLOAT, None),
        ],
        [h.make_tensor_value_info("c", T.BOOL, []), h.make_tensor_value_info("l", T.FLOAT, None)],
    )
    graph.node.append(h.make_node("Loop", ["trips", "", "raw_logits"], ["logits"], name="spin", body=body))
    graph.input.append(h.make_tensor_value_info("trips", T.INT64, []))
    return model


def _feeds(tokens: np.ndarray, past: int) -> dict:
    batch, count = tokens.shape
    return {
        "input_ids": tokens,
        "attention_mask": np.ones((batch, past + count), np.int64),
        "position_ids": np.broadcast_to(np.arange(past, past + count), tokens.shape).copy(),
    }


def _empty_past(batch: int) -> dict:
    shape = (batch, MICRO.num_kv_heads, 0, MICRO.head_size)
    return {
        f"past_key_values.{i}.{r}": np.zeros(shape, np.float32)
        for i in range(MICRO.num_layers)
        for r in ("key", "value")
    }


def _presents_as_past(out: dict) -> dict:
    return {
        f"past_key_values.{i}.{r}": out[f"present.{i}.{r}"] for i in range(MICRO.num_layers) for r in ("key", "value")
    }


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_a_decoder_with_an_if_runs_through_a_state_with_in_place_caches_like_onnx_runtime(cache):
    session = Session(_decoder_with_if(), threads=1)
    assert len(session.bindings) == 2 * MICRO.num_layers  # the If reads no cache: every pair stays in place
    peer = ort_session(session.model)
    names = [o.name for o in session.model.proto.graph.output]
    state = session.new_state(cache=CacheConfig(cache, block_size=4 if cache == "paged" else None))
    tokens = np.array([[5, 17, 42, 3, 8, 11]], np.int64)
    past, ort_past = 0, _empty_past(1)
    for step in range(5):
        feeds = _feeds(tokens, past)
        theirs = dict(zip(names, peer.run(names, {**feeds, **ort_past})))
        ours = state.run(feeds)
        np.testing.assert_allclose(ours["logits"], theirs["logits"], atol=1e-4, err_msg=f"step {step}")
        past += tokens.shape[1]
        assert state.length == past
        ort_past = _presents_as_past(theirs)
        tokens = theirs["logits"][:, -1:].argmax(-1).astype(np.int64)


def test_a_cache_read_inside_a_subgraph_keeps_the_tensor_path_with_the_same_outputs():
    through = Session(_decoder_with_if(read_past=True), threads=1)
    assert through.bindings == [] and through.new_state().bound_inputs == []
    beside = Session(_decoder_with_if(), threads=1)
    peer = ort_session(through.model)
    names = [o.name for o in through.model.proto.graph.output]
    tokens = np.array([[5, 17, 42, 3]], np.int64)
    past, pasts = 0, _empty_past(1)
    state = beside.new_state()
    for step in range(3):
        feeds = _feeds(tokens, past)
        ours = through.run({**feeds, **pasts})
        theirs = dict(zip(names, peer.run(names, {**feeds, **pasts})))
        in_place = state.run(feeds)
        for name in names:
            np.testing.assert_allclose(ours[name], theirs[name], atol=1e-4, err_msg=f"step {step}: {name}")
        np.testing.assert_array_equal(ours["logits"], in_place["logits"])
        past += tokens.shape[1]
        pasts = _presents_as_past(ours)
        tokens = ours["logits"][:, -1:].argmax(-1).astype(np.int64)


def test_cancelling_a_state_stops_a_loop_between_iterations_and_leaves_the_state_as_it_was():
    session = Session(_spinning(_decoder_with_if()), threads=1)
    state, twin = session.new_state(), session.new_state()
    prompt = _feeds(np.array([[5, 17, 42]], np.int64), 0)
    np.testing.assert_array_equal(
        state.run({**prompt, "trips": np.array(1)})["logits"], twin.run({**prompt, "trips": np.array(3)})["logits"]
    )
    step = _feeds(np.array([[9]], np.int64), 3)
    token = Cancellation()
    timer = threading.Timer(0.2, token.cancel)
    timer.start()
    try:
        with pytest.raises(Cancelled, match=r"run cancelled in Loop node 'spin' before iteration \d+"):
            state.run({**step, "trips": np.array(1 << 62)}, cancel=token)  # the body has no node: only the Loop checks
    finally:
        timer.cancel()
    assert state.length == 3 and state.steps == 1
    np.testing.assert_array_equal(
        state.run({**step, "trips": np.array(1)})["logits"], twin.run({**step, "trips": np.array(1)})["logits"]
    )


def test_a_loop_event_counts_what_its_body_allocated():
    body = h.make_graph(
        [h.make_node("Add", ["y_in", "y_in"], ["y_out"])],
        "body",
        [
            h.make_tensor_value_info("i", T.INT64, []),
            h.make_tensor_value_info("c", T.BOOL, []),
            h.make_tensor_value_info("y_in", T.FLOAT, None),
        ],
        [h.make_tensor_value_info("c", T.BOOL, []), h.make_tensor_value_info("y_out", T.FLOAT, None)],
    )
    graph = h.make_graph(
        [h.make_node("Loop", ["M", "", "y0"], ["y"], name="twice", body=body)],
        "g",
        [h.make_tensor_value_info("M", T.INT64, []), h.make_tensor_value_info("y0", T.FLOAT, [8])],
        [h.make_tensor_value_info("y", T.FLOAT, [8])],
    )
    session = Session(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), events=True)
    out = session.run({"M": np.array(3, np.int64), "y0": np.ones(8, np.float32)})
    np.testing.assert_array_equal(out["y"], np.full(8, 8))
    (event,) = [e for e in session.events if e.node == "twice"]
    assert (event.allocations, event.allocated_bytes) == (3, 3 * 32)
