"""Cache conventions: what :func:`onnxkv.model.convention.recognize_cache` reads from the graph alone."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import onnx
import pytest
from onnx import helper

import onnxkv
from onnxkv.model.convention import recognize_cache

BUILDER = pathlib.Path(__file__).resolve().parents[1] / "data" / "genai_tiny_llama"
PROMPT = np.array([[1, 2, 3]], np.int64)


def _bare_builder_file(tmp_path) -> pathlib.Path:
    """The builder's model.onnx (past inputs [batch, 2, past, 'kv_cache_dim']) without its genai_config.json."""
    for name in ("model.onnx", "model.onnx.data"):
        shutil.copyfile(BUILDER / name, tmp_path / name)
    return tmp_path / "model.onnx"


def test_builder_head_size_comes_from_the_query_product_without_genai_config(tmp_path):
    path = _bare_builder_file(tmp_path)
    proto = onnx.load(path, load_external_data=False)
    assert proto.graph.input[2].type.tensor_type.shape.dim[3].dim_param == "kv_cache_dim"
    conv = recognize_cache(proto)
    assert (conv.num_heads, conv.kv_heads, conv.head_size) == (4, 2, 16)  # packed qkv: 128 = (4 + 2 * 2) * 16
    alone = onnxkv.generate(onnxkv.Session(path, threads=1), PROMPT, max_new_tokens=5, temperature=0)
    folder = onnxkv.generate(onnxkv.Session(BUILDER, threads=1), PROMPT, max_new_tokens=5, temperature=0)
    assert not folder.finished[0]  # no EOS within 5 tokens: the folder's eos_token_id changes nothing here
    np.testing.assert_array_equal(alone.tokens, folder.tokens)


def test_int4_builder_file_reads_matmul_nbits_width(tmp_path):
    path = _bare_builder_file(tmp_path)
    out = tmp_path / "q4" / "model.onnx"
    onnxkv.quantize_weights(path, out, bits=4)
    proto = onnx.load(out, load_external_data=False)
    assert any(n.op_type == "MatMulNBits" for n in proto.graph.node)
    assert recognize_cache(proto).head_size == 16
    tokens = onnxkv.generate(onnxkv.Session(out, threads=1), PROMPT, max_new_tokens=4, temperature=0)
    assert tokens.tokens.shape == (1, 4)


def _query_product(proto: onnx.ModelProto) -> onnx.NodeProto:
    gqa = next(n for n in proto.graph.node if n.op_type == "GroupQueryAttention")
    return next(n for n in proto.graph.node if gqa.input[0] in n.output)


def test_a_query_width_that_does_not_divide_into_the_heads_leaves_the_head_size_unknown(tmp_path):
    proto = onnx.load(_bare_builder_file(tmp_path), load_external_data=False)
    product = _query_product(proto)
    weight = next(t for t in proto.graph.initializer if t.name == product.input[1])
    weight.dims[-1] = 130  # 130 is no multiple of 4 + 2 * 2 heads
    assert recognize_cache(proto).head_size is None


def test_a_query_made_by_another_operator_leaves_the_head_size_unknown(tmp_path):
    proto = onnx.load(_bare_builder_file(tmp_path), load_external_data=False)
    product = _query_product(proto)
    idx = list(proto.graph.node).index(product)
    proto.graph.node.insert(idx + 1, helper.make_node("Relu", [product.output[0]], ["relu_q"]))
    gqa = next(n for n in proto.graph.node if n.op_type == "GroupQueryAttention")
    gqa.input[0] = "relu_q"
    assert recognize_cache(proto).head_size is None


def test_a_stated_head_size_dim_wins_over_the_product(tmp_path):
    proto = onnx.load(_bare_builder_file(tmp_path), load_external_data=False)
    for vi in proto.graph.input:
        if vi.name.startswith("past_key_values"):
            vi.type.tensor_type.shape.dim[3].dim_value = 16
    assert recognize_cache(proto).head_size == 16


def test_a_float16_conversion_of_the_builder_file_keeps_its_head_size(tmp_path):
    """ONNX Runtime's float16 converter (float32 inputs) casts each past before the attention reads it."""
    pytest.importorskip("onnxruntime")
    from onnxruntime.transformers.float16 import convert_float_to_float16

    proto = convert_float_to_float16(onnx.load(_bare_builder_file(tmp_path)), keep_io_types=True)
    gqa = next(n for n in proto.graph.node if n.op_type == "GroupQueryAttention")
    assert gqa.input[3] != "past_key_values.0.key"  # a Cast of it
    assert recognize_cache(proto).head_size == 16
