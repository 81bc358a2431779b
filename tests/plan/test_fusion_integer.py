"""Plan fusion of ONNX Runtime's dynamically quantized products: each DynamicQuantizeLinear / MatMulInteger /
Cast / Mul / Mul chain of a constant weight becomes one DynamicQuantMatMul (its DynamicQuantizeLinear gone
with its last reader), with the unfused plan's outputs bit for bit; a chain whose values something else
reads stays as it is."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxkv import Session
from onnxkv.alloc import SystemAllocator
from onnxkv.plan.ops.matmul_integer import DynamicQuantMatMul, MatMulInteger
from onnxkv.plan.plan import Plan


def chains_model(extra_reader: bool = False, swap: bool = False):
    """x -> DQL -> two products (q: per-tensor int8 weight; k: per-column uint8 weight and zero points), each
    Cast and scaled as quantize_dynamic writes them; ``extra_reader`` makes k's int32 product an output too."""
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(rng.integers(-128, 128, (32, 24)).astype(np.int8), "Wq"),
        numpy_helper.from_array(np.array(0, np.int8), "zq"),
        numpy_helper.from_array(np.array(0.013, np.float32), "sq"),
        numpy_helper.from_array(rng.integers(0, 256, (32, 8)).astype(np.uint8), "Wk"),
        numpy_helper.from_array(rng.integers(100, 150, 8).astype(np.uint8), "zk"),
        numpy_helper.from_array((rng.random(8) * 0.02 + 0.001).astype(np.float32), "sk"),
    ]
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="dql")]
    for p in ("q", "k"):
        nodes += [
            helper.make_node("MatMulInteger", ["xq", f"W{p}", "xz", f"z{p}"], [f"i{p}"], name=f"mmi_{p}"),
            helper.make_node("Cast", [f"i{p}"], [f"f{p}"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"s{p}", "xs"] if swap else ["xs", f"s{p}"], [f"scale_{p}"]),
            helper.make_node("Mul", [f"scale_{p}", f"f{p}"] if swap else [f"f{p}", f"scale_{p}"], [f"y{p}"]),
        ]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("yq", "yk")]
    if extra_reader:
        outs.append(helper.make_tensor_value_info("ik", TensorProto.INT32, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 32])], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("swap", [False, True], ids=["xs_first", "ws_first"])
def test_chains_fuse_with_the_unfused_bits(swap):
    model = chains_model(swap=swap)
    session = Session(model, threads=2)
    kinds = [type(k).__name__ for k in session.plan.kernels]
    assert kinds == ["DynamicQuantMatMul", "DynamicQuantMatMul"]
    unfused = Plan(model, SystemAllocator(), fuse=False)
    assert not any(isinstance(k, DynamicQuantMatMul) for k in unfused.kernels)
    reference = Session(model, threads=2)
    reference.plan = unfused
    for rows in (1, 3):
        x = (np.random.default_rng(rows).standard_normal((3, 32)) * 5).astype(np.float32)
        x[rows - 1 :] *= 0.5
        got, want = session.run({"x": x}), reference.run({"x": x})
        for name in ("yq", "yk"):
            np.testing.assert_array_equal(got[name], want[name])


def test_a_chain_with_another_reader_stays():
    session = Session(chains_model(extra_reader=True), threads=1)
    kinds = [type(k) for k in session.plan.kernels]
    assert kinds.count(DynamicQuantMatMul) == 1 and kinds.count(MatMulInteger) == 1
    assert "DynamicQuantizeLinear" in {type(k).__name__ for k in session.plan.kernels}
