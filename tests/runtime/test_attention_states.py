"""ONNX Attention in states: Attention-25 sliding windows and bfloat16 caches, contiguous and paged.

A state runs the Attention node in place (the new keys appended to the
state's cache, attention over the cache); its logits must equal those of
``onnx.reference`` over the whole sequence, and a paged state must read
the pages without gathering them.  A bfloat16 model's state holds its
caches as uint16 bit patterns, which the operator reads as bfloat16.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import onnxkv
from onnxkv import CacheConfig
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.zoo.builders import MICRO, build_model

WINDOW = 3


def _windowed(model: onnx.ModelProto, left: int) -> onnx.ModelProto:
    """``model`` at opset 25 with ``left_window_size=left`` on every Attention node."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = 25
    for node in model.graph.node:
        if node.op_type == "Attention":
            node.attribute.append(helper.make_attribute("left_window_size", left))
    return model


@pytest.fixture(scope="module")
def windowed():
    return onnxkv.Session(_windowed(build_model("attention", MICRO, seed=8), WINDOW), threads=1, events=True)


def _feeds(session, ids, lengths, state: bool = True) -> FeedBuilder:
    """Feeds of a left-padded generation; ``state``: the pasts come from a state (else empty ones are fed)."""
    return FeedBuilder(session.plan.inputs, session.model, ids, np.asarray(lengths), 0, thread_cache=not state)


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_sliding_window_decode_in_a_state_equals_onnx_reference_over_the_whole_sequence(windowed, cache):
    rng = np.random.default_rng(0)
    prompt, lengths, steps = rng.integers(3, MICRO.vocab_size, (2, 7)), [7, 4], 6  # row 1 left-padded by 3
    logits = windowed.model.io.logits
    builder = _feeds(windowed, prompt, lengths)
    feeds, _ = builder.first()
    got, copied, tokens = [], [], []
    config = CacheConfig(cache, block_size=4) if cache == "paged" else CacheConfig(cache)
    with windowed.new_state(cache=config) as state:
        for _ in range(steps):
            windowed.events.clear()
            out = state.run(feeds, [logits])
            copied.append(sum(e.prefix_copied_bytes for e in windowed.events if e.action == "cache_write"))
            got.append(out[logits][:, -1].copy())
            tokens.append(np.argmax(got[-1], axis=-1))
            feeds = builder.next(tokens[-1], out)
    full = np.concatenate([prompt, np.stack(tokens[:-1], axis=1)], axis=1)
    whole, _ = _feeds(windowed, full, np.add(lengths, steps - 1), state=False).first()
    want = ReferenceEvaluator(windowed.model.proto).run([logits], whole)[0]
    for step, g in enumerate(got):
        np.testing.assert_allclose(g, want[:, prompt.shape[1] - 1 + step], rtol=1e-4, atol=1e-4)
    assert copied == [0] * steps  # contiguous: in place; paged: the kernel reads the pages


def _attention_model(elem_type: int) -> onnx.ModelProto:
    """One causal Attention node over a past/present cache pair, all of ``elem_type``."""
    node = helper.make_node(
        "Attention",
        ["q", "k", "v", "", "past_key_values.0.key", "past_key_values.0.value"],
        ["y", "present.0.key", "present.0.value"],
        name="attn",
        is_causal=1,
    )
    shapes = {
        "q": ["b", 2, "s", 8],
        "k": ["b", 1, "s", 8],
        "v": ["b", 1, "s", 8],
        "past_key_values.0.key": ["b", 1, "p", 8],
        "past_key_values.0.value": ["b", 1, "p", 8],
    }
    inputs = [helper.make_tensor_value_info(n, elem_type, s) for n, s in shapes.items()]
    outputs = [helper.make_tensor_value_info(n, elem_type, None) for n in node.output]
    return helper.make_model(
        helper.make_graph([node], "g", inputs, outputs), opset_imports=[helper.make_opsetid("", 23)], ir_version=10
    )


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("elem_type", [TensorProto.BFLOAT16, TensorProto.FLOAT16], ids=["bfloat16", "float16"])
def test_narrow_attention_in_a_state_equals_the_stateless_run(elem_type, cache):
    session = onnxkv.Session(_attention_model(elem_type), threads=1)
    assert session.bindings, "the past/present pair must be served in place"
    dtype = helper.tensor_dtype_to_np_dtype(elem_type)
    rng = np.random.default_rng(1)
    keys, values = np.zeros((1, 1, 0, 8), dtype), np.zeros((1, 1, 0, 8), dtype)
    with session.new_state(cache=CacheConfig(cache, block_size=4) if cache == "paged" else CacheConfig(cache)) as state:
        for n in (5, 1, 1, 3):
            q, k, v = (rng.standard_normal((1, h, n, 8)).astype(dtype) for h in (2, 1, 1))
            got = state.run({"q": q, "k": k, "v": v}, ["y"])["y"]
            want = session.run(
                {"q": q, "k": k, "v": v, "past_key_values.0.key": keys, "past_key_values.0.value": values}, ["y"]
            )["y"]
            assert got.dtype == want.dtype == dtype
            np.testing.assert_array_equal(got, want)
            keys, values = np.concatenate([keys, k], axis=2), np.concatenate([values, v], axis=2)
        np.testing.assert_array_equal(state.values["past_key_values.0.key"].view(dtype), keys)
