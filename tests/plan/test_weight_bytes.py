"""Session.weight_bytes (onnxkv.plan.weight_bytes): every packed weight counted once under the kernels,
constants read from file mappings apart from those held in memory, the same totals for a model however its
file stores the weights, and subgraph plans counted with their node."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnxkv
from onnxkv.model import inline_data
from onnxkv.zoo.builders import MICRO, build_model


def _packed(session) -> int:
    """Bytes of the packed weights, read from the kernels directly (float32 panels and 4/8-bit panels)."""
    total = 0
    for kernel in session.plan.kernels:
        product = getattr(kernel, "product", kernel)
        packed = getattr(product, "packed", None)
        weight = getattr(product, "weight", None)
        total += packed.nbytes if isinstance(packed, np.ndarray) else 0
        total += weight.nbytes if weight is not None else 0
    return total


def _constants(session) -> tuple[int, int]:
    """(mapped, in-memory) bytes of the plan's run-time constants."""
    arrays = [a for a in session.plan._template if isinstance(a, np.ndarray)]
    mapped = sum(a.nbytes for a in arrays if isinstance(a, np.memmap))
    return mapped, sum(a.nbytes for a in arrays) - mapped


def test_in_memory_model():
    session = onnxkv.Session(build_model("gqa", MICRO, seed=1), threads=1)
    w = session.weight_bytes()
    assert w.kernels >= _packed(session) > 0 and w.mapped == 0
    assert w.in_memory == _constants(session)[1] and w.resident == w.kernels + w.in_memory


@pytest.mark.parametrize("storage", ["external", "inline"])
def test_files_give_the_same_packed_bytes_and_say_what_is_mapped(tmp_path, monkeypatch, storage):
    monkeypatch.setattr(inline_data, "MIN_BYTES", 1024)
    proto = build_model("gqa", MICRO, seed=1)
    path = tmp_path / "model.onnx"
    if storage == "external":
        onnx.save(proto, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    else:
        onnx.save(proto, str(path))
    session = onnxkv.Session(path, threads=1)
    w, alone = session.weight_bytes(), onnxkv.Session(build_model("gqa", MICRO, seed=1), threads=1).weight_bytes()
    assert w.kernels == alone.kernels >= _packed(session) > 0
    mapped, held = _constants(session)
    assert (w.mapped, w.in_memory) == (mapped, held) and w.mapped > 0
    assert w.mapped + w.in_memory == alone.in_memory  # the same constants, stored elsewhere


def test_quantized_weights_count_their_packed_panels(tmp_path):
    source = tmp_path / "float.onnx"
    onnx.save(build_model("gqa", MICRO, seed=2), str(source))
    onnxkv.quantize_weights(source, tmp_path / "q.onnx", bits=4)
    session = onnxkv.Session(tmp_path / "q.onnx", threads=1)
    w = session.weight_bytes()
    packed = _packed(session)
    assert packed > 0 and w.kernels >= packed
    assert w.kernels < onnxkv.Session(source, threads=1).weight_bytes().kernels / 4


def test_subgraph_plans_count_with_their_node():
    """A Loop body's MatMul packs its weight inside the body's plan: counted once, as a kernel's."""
    from onnx import TensorProto, helper

    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    body = helper.make_graph(
        [helper.make_node("MatMul", ["x_in", "w"], ["x_out"]), helper.make_node("Identity", ["cond_in"], ["c"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [1, 64])],
        [onnx.numpy_helper.from_array(w, "w")],
    )  # fmt: skip
    loop = helper.make_node("Loop", ["n", "", "x"], ["y"], body=body)
    graph = helper.make_graph(
        [loop],
        "g",
        [helper.make_tensor_value_info("n", TensorProto.INT64, []), helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    session = onnxkv.Session(model, threads=1)
    assert session.weight_bytes().kernels >= w.nbytes
    out = session.run({"n": np.array(2), "x": np.ones((1, 64), np.float32)})["y"]
    np.testing.assert_allclose(out, np.ones((1, 64), np.float32) @ w @ w, rtol=1e-4, atol=1e-4)
