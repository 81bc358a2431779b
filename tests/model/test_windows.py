"""A sliding window stated in genai_config.json is applied to the attention nodes, or the model is refused."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper

import onnxkv
from onnxkv import ModelError
from onnxkv.zoo.builders import MICRO, build_model, save_genai_folder

PROMPT = np.arange(3, 15, dtype=np.int64)[None]  # 12 tokens: longer than every window below


def _folder(tmp_path, window: dict | None, family: str = "gqa", node_window: int | None = None):
    model = build_model(family, MICRO)
    if node_window is not None:
        for n in model.graph.node:
            if n.op_type == "GroupQueryAttention":
                for a in n.attribute:
                    if a.name == "local_window_size":
                        a.i = node_window
    folder = tmp_path / "genai"
    save_genai_folder(model, MICRO, folder)
    cfg = json.loads((folder / "genai_config.json").read_text())
    cfg["model"]["decoder"]["sliding_window"] = window
    (folder / "genai_config.json").write_text(json.dumps(cfg))
    return folder


def _windows(proto: onnx.ModelProto) -> list[int]:
    return [
        helper.get_attribute_value(a)
        for n in proto.graph.node
        if n.op_type == "GroupQueryAttention"
        for a in n.attribute
        if a.name == "local_window_size"
    ]


def _tokens(model) -> np.ndarray:
    return onnxkv.generate(onnxkv.Session(model, threads=1), PROMPT, 4, eos_token_id=[]).tokens


@pytest.mark.parametrize("layers,expected", [([], [4, 4]), (None, [4, 4]), ([1], [-1, 4]), ([0, 1], [4, 4])])
def test_config_window_goes_into_the_listed_layers(tmp_path, layers, expected):
    window = {"window_size": 4, "slide_key_value_cache": False, "slide_inputs": False}
    if layers is not None:
        window["layers"] = layers
    m = onnxkv.load(_folder(tmp_path, window))
    assert _windows(m.proto) == expected
    assert [layer.window for layer in m.convention.layers] == [w if w > 0 else None for w in expected]
    assert m.convention.attributes["local_window_size"] == (expected[0] if len(set(expected)) == 1 else expected)
    assert "windows=" in m.convention.describe()


def test_config_window_runs_like_the_node_attribute(tmp_path):
    configured = onnxkv.load(_folder(tmp_path / "a", {"window_size": 4, "layers": []}))
    by_node = onnxkv.load(_folder(tmp_path / "b", None, node_window=4))
    full = onnxkv.load(_folder(tmp_path / "c", None))
    np.testing.assert_array_equal(_tokens(configured), _tokens(by_node))
    assert not np.array_equal(_tokens(configured), _tokens(full))


def test_node_window_equal_to_the_config_is_kept(tmp_path):
    m = onnxkv.load(_folder(tmp_path, {"window_size": 4, "layers": [0, 1]}, node_window=4))
    assert _windows(m.proto) == [4, 4]


@pytest.mark.parametrize(
    "window,match",
    [
        (
            {"window_size": 4, "layers": [0, 1]},
            r"conflicts with layer 0's GroupQueryAttention node .* local_window_size is 6",
        ),
        ({"window_size": 6, "layers": [2]}, r"lists layers \[2\] that the graph does not have"),
        ({"window_size": 6, "slide_key_value_cache": True}, r"slide_key_value_cache is true.*onnxkv does not do"),
        ({"window_size": 6, "slide_inputs": True}, r"slide_inputs is true.*onnxkv does not do"),
        ({"window_size": 0}, r"window_size must be an int in \[1, "),
        ({"window_size": "8"}, r"window_size must be an int"),
        ({"window_size": 6, "layers": [True]}, r"layers must be a list of layer indices"),
        ([6], r"sliding_window must be a JSON object"),
    ],
)
def test_windows_onnxkv_cannot_apply_are_refused(tmp_path, window, match):
    with pytest.raises(ModelError, match=match):
        onnxkv.load(_folder(tmp_path, window, node_window=6))


def test_config_window_on_a_graph_without_group_query_attention_is_refused(tmp_path):
    folder = _folder(tmp_path, {"window_size": 4, "layers": []}, family="concat")
    with pytest.raises(ModelError, match=r"cannot be applied: the graph's cache convention is 'concat'"):
        onnxkv.load(folder)
