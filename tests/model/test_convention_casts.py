"""Cache conventions of float16 models with float32 inputs and outputs (ONNX Runtime's float16 converter
with keep_io_types=True, the model_fp16.onnx of many repositories): each past reaches its joining node
through a Cast and each present leaves through one.  The pairs are recognised (by the graph names), no
binding runs them in place, and generate threads the caches as tensors with ONNX Runtime's tokens."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

pytest.importorskip("onnxruntime")

from onnxruntime.transformers.float16 import convert_float_to_float16  # noqa: E402
from ort_loop import ort_greedy  # noqa: E402

import onnxkv  # noqa: E402
from onnxkv.model.convention import recognize_cache  # noqa: E402
from onnxkv.model.rewrite import inplace_bindings  # noqa: E402
from onnxkv.zoo.builders import MICRO, build_model  # noqa: E402

KINDS = {"gqa": "group_query_attention", "attention": "attention", "concat": "concat"}


@pytest.fixture(scope="module", params=sorted(KINDS))
def fp16(request, tmp_path_factory):
    model = convert_float_to_float16(build_model(request.param, MICRO, seed=3), keep_io_types=True)
    path = tmp_path_factory.mktemp("fp16") / "model.onnx"
    onnx.save(model, str(path))
    return request.param, onnxkv.Session(str(path), threads=1)


def test_pairs_recognised_through_casts(fp16):
    family, session = fp16
    proto = session.model.proto
    conv = recognize_cache(proto)
    assert conv.kind == KINDS[family]
    assert [(x.past_key, x.past_value, x.present_key, x.present_value) for x in conv.layers] == [
        (f"past_key_values.{i}.key", f"past_key_values.{i}.value", f"present.{i}.key", f"present.{i}.value")
        for i in range(MICRO.num_layers)
    ]
    elem = {i.name: i.type.tensor_type.elem_type for i in proto.graph.input}
    assert elem["past_key_values.0.key"] == onnx.TensorProto.FLOAT
    assert inplace_bindings(proto, conv) == []


def test_generate_threads_the_caches_with_onnxruntime_tokens(fp16):
    _, session = fp16
    prompt = np.random.default_rng(1).integers(0, MICRO.vocab_size, (1, 7))
    np.testing.assert_array_equal(onnxkv.generate(session, prompt, 16).tokens, ort_greedy(session, prompt, 16))
    with pytest.raises(onnxkv.InputError, match="needs a model with a recognised in-place cache"):
        onnxkv.generate(session, prompt, 2, cache="paged")
