"""com.microsoft::MatMulBnb4 through Session: ONNX Runtime's results on the same file (FP4 and NF4, blocks
that start inside a column, blocks above the kernel's 256, prompt rows, float16 A), the weight packed once
and absorbed, siblings fused into one product with the same results, and load errors for what onnxkv does
not run."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxkv import Session
from onnxkv._kernels import reference as R
from onnxkv.errors import ModelError, OperatorError
from onnxkv.plan.ops.matmul_bnb4 import CODEBOOKS, MatMulBnb4, SiblingMatMulBnb4, kernel_block
from onnxkv.plan.ops.matmul_nbits import DECODE_M, STEP_M

ort = pytest.importorskip("onnxruntime")


def bnb4_arrays(rng, K, N, bs, dtype=np.float32):
    """Random B (every code 0..15, odd N * K leaving a padding nibble) and absmax (positive, varied)."""
    B = rng.integers(0, 256, (N * K + 1) // 2, dtype=np.uint8)
    absmax = rng.uniform(0.05, 2.0, -(-N * K // bs)).astype(dtype)
    return B, absmax


def bnb4_model(K, N, bs=64, quant_type=1, dtype=np.float32, seed=0, members=1, override=None, **attrs):
    """y_i = MatMulBnb4(x, B_i, absmax_i) for ``members`` weights reading one x, random constants."""
    rng = np.random.default_rng(seed)
    nodes, inits, outputs = [], [], []
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    for i in range(members):
        B, absmax = bnb4_arrays(rng, K, N, bs, dtype)
        arrays = {f"B{i}": B, f"absmax{i}": absmax, **(override or {})}
        inits += [
            numpy_helper.from_array(arrays[f"B{i}"], f"B{i}"),
            numpy_helper.from_array(arrays[f"absmax{i}"], f"absmax{i}"),
        ]
        a = dict(K=K, N=N, block_size=bs, quant_type=quant_type, **attrs)
        nodes.append(helper.make_node("MatMulBnb4", ["x", f"B{i}", f"absmax{i}"], [f"y{i}"], name=f"bnb{i}",
                                      domain="com.microsoft", **a))  # fmt: skip
        outputs.append(helper.make_tensor_value_info(f"y{i}", et, ["B", "S", N]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", et, ["B", "S", "K"])], outputs, inits)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )


def ort_run(model, x):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})


def _initializer(model, name):
    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name))


@pytest.mark.parametrize(
    "K,N,bs",
    [
        (256, 96, 64),  # blocks within columns
        (64, 33, 32),  # N * K multiple of the block, N not of 16
        (48, 40, 32),  # K not a multiple of the block: blocks start inside columns (kernel blocks of 16)
        (96, 50, 64),  # kernel blocks of 32
        (80, 3, 16),
    ],
)
@pytest.mark.parametrize("quant_type", [0, 1])
def test_matches_onnxruntime(K, N, bs, quant_type):
    model = bnb4_model(K, N, bs, quant_type, seed=K + N)
    s = Session(model, threads=2)
    rng = np.random.default_rng(1)
    for rows in (1, 3, DECODE_M, DECODE_M + 5, 40):
        x = rng.standard_normal((1, rows, K)).astype(np.float32)
        (want,), got = ort_run(model, x), s.run({"x": x})["y0"]
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_blocks_above_256():
    """The operator allows any power of two from 16 (ONNX Runtime's CPU kernel runs 16..256): a block of 1,024
    is kernel blocks of 256 with its absmax repeated, against the contract's dequantization."""
    K, N, bs = 1024, 24, 1024
    model = bnb4_model(K, N, bs, 1, seed=11)
    s = Session(model)
    (k,) = [k for k in s.plan.kernels if isinstance(k, MatMulBnb4)]
    assert k.weight.block_size == 256
    w = R.bnb4_dequantize(_initializer(model, "B0"), _initializer(model, "absmax0"), K, N, bs, CODEBOOKS[1])
    x = np.random.default_rng(0).standard_normal((1, 3, K)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(s.run({"x": x})["y0"], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_weight_is_the_operators_definition():
    """The packed weight read back equals the contract's dequantization (codebook value times absmax, one
    float32 product), independent of ONNX Runtime."""
    K, N, bs = 48, 21, 32
    model = bnb4_model(K, N, bs, 0, seed=5)
    (k,) = [k for k in Session(model).plan.kernels if isinstance(k, MatMulBnb4)]
    assert k.weight.block_size == kernel_block(K, bs) == 16 and k.weight.lut is not None and not k.int8
    want = R.bnb4_dequantize(_initializer(model, "B0"), _initializer(model, "absmax0"), K, N, bs, CODEBOOKS[0])
    np.testing.assert_array_equal(R.nbits_dequantize(k.weight), want)


def test_prompt_rows_and_float16():
    """Past STEP_M rows (dequantized panels, not compilable) as below it; float16 A and absmax."""
    model = bnb4_model(128, 40, 64, 1, seed=3)
    x = np.random.default_rng(2).standard_normal((2, STEP_M // 2 + 3, 128)).astype(np.float32)
    s = Session(model)
    np.testing.assert_allclose(s.run({"x": x})["y0"], ort_run(model, x)[0], rtol=1e-5, atol=1e-4)
    (k,) = [k for k in s.plan.kernels if isinstance(k, MatMulBnb4)]
    assert k.compilable([x[:1, :4]]) and not k.compilable([x])
    m16 = bnb4_model(128, 40, 64, 1, dtype=np.float16, seed=4)
    x16 = x[:1, :5].astype(np.float16)
    got = Session(m16).run({"x": x16})["y0"]
    assert got.dtype == np.float16
    absmax = _initializer(m16, "absmax0").astype(np.float32)
    want = x16.astype(np.float32) @ R.bnb4_dequantize(_initializer(m16, "B0"), absmax, 128, 40, 64, CODEBOOKS[1])
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_weight_packed_once_and_absorbed():
    model = bnb4_model(128, 64, 64)
    s = Session(model)
    (k,) = [k for k in s.plan.kernels if isinstance(k, MatMulBnb4)]
    assert set(k.absorbed_inputs) == {1, 2}
    assert all(s.plan._template[s.plan.slot_of[n]] is None for n in ("B0", "absmax0"))


@pytest.mark.parametrize("quant_type", [0, 1])
def test_siblings_fuse_into_one_product_with_the_same_results(quant_type):
    model = bnb4_model(96, 40, 32, quant_type, seed=9, members=3)
    fused = Session(model, threads=2)
    assert any(isinstance(k, SiblingMatMulBnb4) for k in fused.plan.kernels)
    x = np.random.default_rng(3).standard_normal((1, 5, 96)).astype(np.float32)
    for rows in (1, 5):
        got = fused.run({"x": x[:, :rows]})
        for i in range(3):
            alone = Session(_alone(model, i))
            np.testing.assert_array_equal(got[f"y{i}"], alone.run({"x": x[:, :rows]})[f"y{i}"])
            np.testing.assert_allclose(got[f"y{i}"], ort_run(model, x[:, :rows])[i], rtol=1e-5, atol=1e-4)


def _alone(model: onnx.ModelProto, i: int) -> onnx.ModelProto:
    """``model`` keeping member i only (so nothing fuses it with a sibling)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    keep = m.graph.node[i]
    del m.graph.node[:]
    m.graph.node.append(keep)
    outputs = [o for o in m.graph.output if o.name == f"y{i}"]
    del m.graph.output[:]
    m.graph.output.extend(outputs)
    return m


@pytest.mark.parametrize(
    "attrs,message",
    [
        (dict(quant_type=2), r"quant_type=2: expected 0 \(FP4\) or 1 \(NF4\)"),
        (dict(transB=0), "transB=0, training_mode=0: onnxkv runs transB=1"),
        (dict(training_mode=1), "transB=1, training_mode=1"),
        (dict(block_size=48), "block_size=48: expected a power of two >= 16"),
        (dict(K=24, block_size=32), "K=24 with block_size=32: absmax blocks start 8 values apart"),
        (dict(N=2**40), "K=128, N=1099511627776"),
    ],
)
def test_bad_attributes_are_load_errors(attrs, message):
    base = dict(K=128, N=16, bs=64, quant_type=1)
    base.update({k: v for k, v in attrs.items() if k in ("K", "quant_type")})
    if "block_size" in attrs:
        base["bs"] = attrs["block_size"] if attrs["block_size"] & (attrs["block_size"] - 1) == 0 else 64
    model = bnb4_model(base["K"], 16, base["bs"], base["quant_type"])
    node = model.graph.node[0]
    for name, value in attrs.items():
        found = [a for a in node.attribute if a.name == name]
        if found:
            found[0].i = value
        else:
            node.attribute.append(helper.make_attribute(name, value))
    with pytest.raises(ModelError, match=f"MatMulBnb4 node 'bnb0'.*{message}"):
        Session(model)


@pytest.mark.parametrize(
    "name,array,message",
    [
        ("B0", np.zeros(1000, np.uint8), r"B: expected uint8 with 1024 elements \(N \* K codes\), got uint8 \[1000\]"),
        ("B0", np.zeros(1024, np.int8), "B: expected uint8 with 1024 elements"),
        ("absmax0", np.ones(33, np.float32), r"absmax: expected float with 32 elements, got float32 \[33\]"),
        ("absmax0", np.ones(32, np.int32), "absmax: expected float with 32 elements, got int32"),
    ],
)
def test_weights_of_the_wrong_size_are_load_errors(name, array, message):
    with pytest.raises(ModelError, match=f"MatMulBnb4 node 'bnb0': {message}"):
        Session(bnb4_model(128, 16, 64, override={name: array}))


def test_runtime_weights_are_refused_and_wrong_widths_name_the_node():
    model = bnb4_model(128, 16, 64)
    model.graph.input.append(helper.make_tensor_value_info("a2", TensorProto.FLOAT, [32]))
    model.graph.node[0].input[2] = "a2"
    with pytest.raises(ModelError, match=r"input absmax \('a2'\) must be an initializer"):
        Session(model)
    s = Session(bnb4_model(128, 16, 64))
    with pytest.raises(OperatorError, match=r"MatMulBnb4 node 'bnb0': input A must be float32 or float16 \[..., 128\]"):
        s.run({"x": np.ones((1, 1, 100), np.float32)})
