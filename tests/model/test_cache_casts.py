"""lift_cache_casts: the Casts of a float16 model's float32 cache pairs moved out of a copy of its graph,
only where that is invisible (each past read only by Casts to float16 and shape readers, each present made
by a Cast to float32 and read by no node, every layer alike); the engine batches requests on the result."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

pytest.importorskip("onnxruntime")

from onnxruntime.transformers.float16 import convert_float_to_float16  # noqa: E402

import onnxkv  # noqa: E402
from onnxkv.model.cache_casts import lift_cache_casts  # noqa: E402
from onnxkv.model.convention import recognize_cache  # noqa: E402
from onnxkv.zoo.builders import MICRO, build_model  # noqa: E402


@pytest.fixture(scope="module")
def fp16() -> onnx.ModelProto:
    return convert_float_to_float16(build_model("gqa", MICRO, seed=5), keep_io_types=True)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def test_lifts_every_pair_and_leaves_the_model_alone(fp16):
    before = fp16.SerializeToString()
    conv = recognize_cache(fp16)
    lifted, boundary = lift_cache_casts(fp16, conv)
    assert fp16.SerializeToString() == before
    casts = sum(n.op_type == "Cast" for n in fp16.graph.node) - sum(n.op_type == "Cast" for n in lifted.graph.node)
    assert casts == 4 * MICRO.num_layers
    f16 = onnx.TensorProto.FLOAT16
    types = {v.name: v.type.tensor_type.elem_type for v in (*lifted.graph.input, *lifted.graph.output)}
    assert all(types[n] == f16 for n in (*conv.past_inputs, *conv.present_outputs))
    assert types[conv.past_inputs[0]] == f16 and types["logits"] == onnx.TensorProto.FLOAT
    assert dict(boundary.inputs) == {n: np.float32 for n in conv.past_inputs}


def test_a_shape_reader_of_a_past_is_allowed(fp16):
    model = _copy(fp16)
    past = recognize_cache(model).past_inputs[0]
    model.graph.node.insert(0, helper.make_node("Shape", [past], ["past_shape"], name="extra_shape"))
    model.graph.output.append(helper.make_tensor_value_info("past_shape", onnx.TensorProto.INT64, [4]))
    assert lift_cache_casts(model, recognize_cache(model)) is not None


def test_a_past_read_as_float32_is_not_lifted(fp16):
    model = _copy(fp16)
    past = recognize_cache(model).past_inputs[3]
    model.graph.node.append(helper.make_node("Identity", [past], ["past_copy"], name="reader"))
    model.graph.output.append(helper.make_tensor_value_info("past_copy", onnx.TensorProto.FLOAT, None))
    assert lift_cache_casts(model, recognize_cache(model)) is None
    session = onnxkv.Session(model, threads=1)
    assert session.cast_boundary is None and session.bindings == []


def test_a_present_read_by_a_node_is_not_lifted(fp16):
    model = _copy(fp16)
    present = recognize_cache(model).present_outputs[-1]
    model.graph.node.append(helper.make_node("Identity", [present], ["present_copy"], name="reader"))
    model.graph.output.append(helper.make_tensor_value_info("present_copy", onnx.TensorProto.FLOAT, None))
    assert lift_cache_casts(model, recognize_cache(model)) is None


def test_a_float32_model_has_nothing_to_lift():
    model = build_model("gqa", MICRO, seed=5)
    assert lift_cache_casts(model, recognize_cache(model)) is None
    assert onnxkv.Session(model, threads=1).cast_boundary is None


def test_the_engine_batches_lifted_requests_as_generate_runs_them_alone(fp16):
    session = onnxkv.Session(fp16, threads=1)
    engine = onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=8))
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, MICRO.vocab_size, n) for n in (9, 3, 14)]
    requests = [engine.add_request(p, 10) for p in prompts]
    engine.run()
    for r, p in zip(requests, prompts, strict=True):
        assert r.tokens == onnxkv.generate(session, p[None], 10, cache="paged").tokens[0].tolist()
