"""Loading files and folders, recognising cache conventions, rejecting bad models."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxkv
from onnxkv import ModelError, UnsupportedOperatorError
from onnxkv.models.builders import MICRO, build_model, save_genai_folder


@pytest.mark.parametrize("family,kind", [("gqa", "group_query_attention"), ("attention", "attention"),
                                         ("concat", "concat"), ("tensorscatter", "tensor_scatter")])
def test_conventions_are_recognised(family, kind):
    m = onnxkv.load(build_model(family, MICRO))
    c = m.convention
    assert c.kind == kind
    assert [layer.index for layer in c.layers] == list(range(MICRO.num_layers))
    assert c.layers[0].past_key == "past_key_values.0.key" and c.layers[1].present_value == "present.1.value"
    assert c.kv_heads == MICRO.num_kv_heads and c.head_size == MICRO.head_size
    assert m.io.input_ids == "input_ids" and m.io.logits == "logits"
    if kind == "tensor_scatter":
        assert c.capacity == MICRO.max_length
    assert kind in c.describe()


def test_gqa_attributes_are_reported():
    c = onnxkv.load(build_model("gqa", MICRO)).convention
    assert c.attributes["do_rotary"] == 1 and c.attributes["local_window_size"] == -1
    assert c.num_heads == MICRO.num_heads


def test_genai_folder_reads_config(tmp_path):
    save_genai_folder(build_model("gqa", MICRO), MICRO, tmp_path)
    m = onnxkv.load(tmp_path)
    cfg = json.loads((tmp_path / "genai_config.json").read_text())
    assert m.genai_config == cfg
    assert m.max_length == cfg["search"]["max_length"]
    assert m.vocab_size == MICRO.vocab_size
    assert m.eos_token_id == [MICRO.eos_token_id]


def test_external_data_is_loaded(tmp_path):
    proto = build_model("concat", MICRO)
    path = tmp_path / "m.onnx"
    saved = onnx.ModelProto()
    saved.CopyFrom(proto)
    onnx.save(saved, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.onnx.data", size_threshold=0)
    assert (tmp_path / "m.onnx.data").exists()
    loaded = onnxkv.load(path)
    # weights are memory-mapped from the data file, not copied into the proto
    assert set(loaded.external) == {i.name for i in proto.graph.initializer}
    w = next(iter(loaded.external.values()))
    assert isinstance(w, np.memmap) and not w.flags.writeable
    assert all(not i.raw_data for i in loaded.proto.graph.initializer)
    a = onnxkv.Session(loaded, threads=1)
    b = onnxkv.Session(proto, threads=1)
    feeds = {"input_ids": np.array([[1, 2]]), "attention_mask": np.ones((1, 2), np.int64),
             "position_ids": np.array([[0, 1]])}
    for i in range(MICRO.num_layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros((1, MICRO.num_kv_heads, 0, MICRO.head_size), np.float32)
    np.testing.assert_array_equal(a.run(feeds)["logits"], b.run(feeds)["logits"])


def test_unknown_domain_is_rejected_at_load_naming_nodes():
    node = helper.make_node("Foo", ["x"], ["y"], domain="com.example", name="strange_node")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.example", 1)])
    with pytest.raises(UnsupportedOperatorError, match="strange_node.*com.example::Foo"):
        onnxkv.load(m)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        onnxkv.load(tmp_path / "nope.onnx")
    with pytest.raises(FileNotFoundError):
        onnxkv.load(tmp_path)  # empty folder
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelError):
        onnxkv.load(bad)
    d = tmp_path / "dir"
    d.mkdir()
    (d / "genai_config.json").write_text("{broken")
    with pytest.raises(ModelError, match="not valid JSON"):
        onnxkv.load(d)


def test_model_without_cache_is_none():
    node = helper.make_node("Neg", ["x"], ["y"])
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    assert onnxkv.load(helper.make_model(g)).convention.kind == "none"
