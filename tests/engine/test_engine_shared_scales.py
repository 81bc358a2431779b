"""Engine.describe() names the operators that quantize a run's activations with one scale for all its rows
(ONNX Runtime's quantize_dynamic models), whose requests depend on what runs with them (docs/engine.md)."""

from __future__ import annotations

import onnx
import pytest

import onnxkv
from onnxkv.zoo.builders import MICRO, build_model

pytest.importorskip("onnxruntime")


def test_describe_names_shared_activation_scales(tmp_path):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    onnx.save(build_model("gqa", MICRO, seed=4), str(tmp_path / "float.onnx"))
    quantize_dynamic(
        str(tmp_path / "float.onnx"),
        str(tmp_path / "int8.onnx"),
        weight_type=QuantType.QInt8,
        op_types_to_quantize=["MatMul"],
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )
    quantized = onnxkv.Engine(onnxkv.Session(str(tmp_path / "int8.onnx"), threads=1))
    assert quantized.describe()["shared_activation_scales"] == ["DynamicQuantMatMul"]
    plain = onnxkv.Engine(onnxkv.Session(str(tmp_path / "float.onnx"), threads=1))
    assert plain.describe()["shared_activation_scales"] == []
