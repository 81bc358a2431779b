"""onnxkv.quantize_weights: MatMul -> MatMulNBits in ONNX Runtime's format, run by ONNX Runtime."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

import onnxkv
from onnxkv import InputError, ModelError
from onnxkv.model.quantize_weights import quantize_blockwise
from onnxkv.zoo.builders import MICRO, build_model, save_genai_folder

#: Relative RMS error of the logits of the quantized model against the float one (random-weight MICRO model,
#: accuracy_level 4): Gaussian weights lose about this much per MatMul at 4 bits, compounding over layers.
LOGITS_REL_RMS = {4: 0.3, 8: 0.03}


def dequantize(
    packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, bits: int, block: int
) -> np.ndarray:
    """NumPy reading of MatMulNBits' B [N, blocks, blob] -> float32 [K, N] (independent of onnxkv)."""
    n, blocks, _ = packed.shape
    if bits == 4:
        codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, blocks, block).astype(np.int32)
    else:
        codes = packed.astype(np.int32)
    if zero_points is None:
        zp = np.full((n, blocks), 1 << (bits - 1))
    elif bits == 4:
        zp = np.stack([zero_points & 15, zero_points >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.int32)
    else:
        zp = zero_points.astype(np.int32)
    w = ((codes - zp[:, :, None]).astype(np.float32) * scales[:, :, None]).reshape(n, blocks * block)
    return np.ascontiguousarray(w[:, :k].T), w[:, k:]


def weights(k: int, n: int, seed: int) -> np.ndarray:
    """Gaussian weights with the cases that test rounding and scales: a zero column, a constant column,
    a column of one sign, and ties."""
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    w[:, 0] = 0
    w[:, 1 % n] = 0.75
    w[:, 2 % n] = np.abs(w[:, 2 % n])
    w[: min(k, 8), 3 % n] = [-1, 1, 0.5, -0.5, 0.25, 2, -2, 0.125][: min(k, 8)]
    return w


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("k,n,block", [(64, 8, 16), (100, 5, 32), (256, 12, 128), (47, 6, 16), (200, 3, 256)])
def test_blockwise_matches_onnxruntime_quantizer(bits, symmetric, k, n, block):
    """Codes, scales and zero points are ONNX Runtime's (MlasQuantizeBlockwise through its Python binding)."""
    w = weights(k, n, seed=k + n)
    packed, scales, zero_points = quantize_blockwise(w, bits, block, symmetric)
    blocks = -(-k // block)
    assert packed.shape == (n, blocks, block * bits // 8) and packed.dtype == np.uint8
    assert scales.shape == (n, blocks) and scales.dtype == np.float32
    ref_packed = np.zeros_like(packed)
    ref_scales = np.zeros_like(scales)
    ref_zp = np.zeros((n, -(-blocks * bits // 8)), np.uint8)
    (quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits)(
        ref_packed, w, ref_scales, ref_zp, block, n, k, symmetric
    )
    np.testing.assert_array_equal(scales, ref_scales)
    codes, ref_codes = (
        np.stack([p & 15, p >> 4], -1).reshape(n, -1) if bits == 4 else p.reshape(n, -1) for p in (packed, ref_packed)
    )
    np.testing.assert_array_equal(codes[:, :k], ref_codes[:, :k])  # ORT leaves the padding unspecified
    if symmetric:
        assert zero_points is None
        assert np.all(codes[:, k:] == 1 << (bits - 1))
    else:
        zp_codes = (np.stack([zero_points & 15, zero_points >> 4], -1).reshape(n, -1) if bits == 4 else zero_points)[
            :, :blocks
        ]
        ref_zp_codes = (np.stack([ref_zp & 15, ref_zp >> 4], -1).reshape(n, -1) if bits == 4 else ref_zp)[:, :blocks]
        np.testing.assert_array_equal(zp_codes, ref_zp_codes)
        pad = np.repeat(zp_codes, block, axis=1)[:, k:]
        np.testing.assert_array_equal(codes[:, k:], pad)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_dequantized_weights_are_within_half_a_step(bits, symmetric):
    """Asymmetric: every weight within scale/2.  Symmetric: within |scale|/2, except values of the sign opposite
    to the block's largest magnitude beyond (mid - 1/2) steps, clipped to mid - 1 steps (within |scale|)."""
    k, n, block = 200, 40, 32
    w = weights(k, n, seed=bits)
    packed, scales, zero_points = quantize_blockwise(w, bits, block, symmetric)
    got, padding = dequantize(packed, scales, zero_points, k, bits, block)
    assert np.all(padding == 0)
    step = np.abs(np.repeat(scales, block, axis=1)[:, :k].T)
    err = np.abs(got - w)
    slack = 1e-6 * np.abs(w) + 1e-7
    if symmetric:
        mid = 1 << (bits - 1)
        signed_step = np.repeat(scales, block, axis=1)[:, :k].T
        clipped = np.divide(w, signed_step, out=np.zeros_like(w), where=step > 0) > mid - 0.5
        assert np.all(err[~clipped] <= step[~clipped] / 2 + slack[~clipped])
        assert np.all(err[clipped] <= step[clipped] + slack[clipped])
        assert clipped.any() and not clipped.all()
    else:
        assert np.all(err <= step / 2 + slack)
    assert np.all(got[:, 0] == 0) and np.all(scales[0] == 0)  # an all-zero column: scale 0, exact zeros


def ort_logits(model_path_or_proto, cfg=MICRO, ids=None) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    source = model_path_or_proto if isinstance(model_path_or_proto, str) else model_path_or_proto.SerializeToString()
    session = ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)) if ids is None else ids
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in session.get_inputs():
        if i.name.startswith("past"):
            feeds[i.name] = np.zeros((ids.shape[0], cfg.num_kv_heads, 0, cfg.head_size), np.float32)
    return session.run(["logits"], feeds)[0]


@pytest.fixture(scope="module")
def micro_folder(tmp_path_factory):
    """A random-weight MICRO GenAI folder (model.onnx + model.onnx.data + genai_config.json) and an extra file."""
    folder = tmp_path_factory.mktemp("micro")
    save_genai_folder(build_model("gqa", MICRO, seed=3), MICRO, folder)
    (folder / "tokenizer_config.json").write_text('{"note": "copied as is"}')
    return folder


def initializers(path) -> dict[str, np.ndarray]:
    """Every initializer of the model file ``path`` (external data read by onnx)."""
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_onnxruntime_runs_the_quantized_folder(micro_folder, tmp_path, bits, symmetric):
    """ORT runs the result; with accuracy_level 0 it equals the float model carrying the NumPy-dequantized weights
    (so ORT reads the bytes as meant), and its logits are within LOGITS_REL_RMS of the float model's."""
    float_model = onnx.load(str(micro_folder / "model.onnx"))
    matmuls = {n.input[1]: n.name for n in float_model.graph.node if n.op_type == "MatMul"}
    report = onnxkv.quantize_weights(micro_folder, tmp_path / "q0", bits=bits, symmetric=symmetric, accuracy_level=0)
    assert report.quantized == len(matmuls) == 15 and report.skipped == ()
    q = onnx.load(str(tmp_path / "q0" / "model.onnx"), load_external_data=False)
    nodes = [n for n in q.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 15 and not any(n.op_type == "MatMul" for n in q.graph.node)
    arrays = initializers(tmp_path / "q0" / "model.onnx")
    inits = {t.name: t for t in float_model.graph.initializer}
    for node in nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        weight = node.input[1].removesuffix(f"_Q{bits}")
        k, n = inits[weight].dims
        assert attrs == {"K": k, "N": n, "bits": bits, "block_size": 32}
        assert node.domain == "com.microsoft" and node.name == matmuls[weight] + f"_Q{bits}"
        assert list(node.input[1:]) == [f"{weight}_Q{bits}", f"{weight}_scales"] + (
            [] if symmetric else [f"{weight}_zero_points"]
        )
        zp = None if symmetric else arrays[node.input[3]]
        deq, _ = dequantize(arrays[node.input[1]], arrays[node.input[2]], zp, k, bits, 32)
        inits[weight].CopyFrom(numpy_helper.from_array(deq, weight))
    ours = ort_logits(str(tmp_path / "q0" / "model.onnx"))
    np.testing.assert_allclose(ours, ort_logits(float_model), rtol=1e-4, atol=1e-4)

    onnxkv.quantize_weights(micro_folder, tmp_path / "q4", bits=bits, symmetric=symmetric)
    reference = ort_logits(str(micro_folder / "model.onnx"))
    got = ort_logits(str(tmp_path / "q4" / "model.onnx"))
    assert np.sqrt(np.mean((got - reference) ** 2) / np.mean(reference**2)) < LOGITS_REL_RMS[bits]


def test_folder_output(micro_folder, tmp_path):
    """Other files are copied, the model keeps its file name, weights go to <model>.data, onnxkv loads it."""
    out = tmp_path / "int4"
    report = onnxkv.quantize_weights(micro_folder, out)
    assert sorted(os.listdir(out)) == ["genai_config.json", "model.onnx", "model.onnx.data", "tokenizer_config.json"]
    assert (out / "genai_config.json").read_bytes() == (micro_folder / "genai_config.json").read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"note": "copied as is"}
    assert report.path == out / "model.onnx" and report.bits == 4 and report.block_size == 32
    k_n = sum(
        t.dims[0] * t.dims[1]
        for t in onnx.load(str(micro_folder / "model.onnx"), load_external_data=False).graph.initializer
        if len(t.dims) == 2 and t.name.endswith("MatMul.weight")
    )
    assert report.bytes_before - report.bytes_after == k_n * 4 - k_n // 2 - k_n // 32 * 4
    assert "15 MatMuls quantized to int4 (block 32), 0 left float" in str(report)
    model = onnxkv.load(out)
    assert model.convention.kind == "group_query_attention" and model.vocab_size == MICRO.vocab_size
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert {o.domain: o.version for o in proto.opset_import}["com.microsoft"] == 1
    arrays = initializers(out / "model.onnx")
    for t in proto.graph.initializer:
        external = t.data_location == TensorProto.EXTERNAL
        assert external == (arrays[t.name].nbytes >= 1024), t.name
        if external:
            assert int({e.key: e.value for e in t.external_data}["offset"]) % 64 == 0


def test_file_and_proto_inputs(micro_folder, tmp_path):
    """An .onnx file (external data beside it) or a ModelProto gives the file ``out`` with ``out.data``."""
    report = onnxkv.quantize_weights(micro_folder / "model.onnx", tmp_path / "a" / "q.onnx", bits=8)
    assert report.quantized == 15 and sorted(os.listdir(tmp_path / "a")) == ["q.onnx", "q.onnx.data"]
    proto = build_model("gqa", MICRO, seed=3)
    before = proto.SerializeToString()
    report = onnxkv.quantize_weights(proto, tmp_path / "b.onnx", bits=8)
    assert proto.SerializeToString() == before
    np.testing.assert_array_equal(ort_logits(str(tmp_path / "b.onnx")), ort_logits(str(tmp_path / "a" / "q.onnx")))


def test_proto_with_unreachable_external_data(micro_folder):
    proto = onnx.load(str(micro_folder / "model.onnx"), load_external_data=False)
    with pytest.raises(ModelError, match="keeps its data in an external file .*pass the model's path"):
        onnxkv.quantize_weights(proto, "never-written.onnx")
    assert not os.path.exists("never-written.onnx")


def small_graph() -> onnx.ModelProto:
    """MatMuls over weights each rule treats differently."""
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    nan = f32(32, 4)
    nan[3, 1] = np.nan
    inits = {
        "shared": f32(32, 8),
        "tiny": f32(8, 8),
        "added": f32(32, 8),
        "fed": f32(32, 8),
        "half": f32(32, 8).astype(np.float16),
        "cube": f32(1, 32, 8),
        "nan": nan,
        "solo": f32(48, 5),
    }
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 32])
    nodes = [
        helper.make_node("MatMul", ["x", "shared"], ["a"], name="first"),
        helper.make_node("MatMul", ["x", "shared"], ["b"], name="second"),
        helper.make_node("MatMul", ["a", "tiny"], ["c"], name="tiny_k"),
        helper.make_node("MatMul", ["x", "added"], ["d"], name="also_added"),
        helper.make_node("Add", ["added", "added"], ["e"], name="adder"),
        helper.make_node("MatMul", ["x", "fed"], ["f"], name="fed_weight"),
        helper.make_node("MatMul", ["x", "cube"], ["g"], name="three_d"),
        helper.make_node("MatMul", ["x", "nan"], ["h"], name="not_finite"),
        helper.make_node("MatMul", ["x", "x_t"], ["i"], name="activations"),
        helper.make_node("Transpose", ["x"], ["x_t"], name="t"),
        helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16, name="cast"),
        helper.make_node("MatMul", ["x16", "half"], ["j"], name="fp16"),
        helper.make_node("MatMul", ["x48", "solo"], ["k"], name=""),
    ]
    outputs = [helper.make_tensor_value_info(v, TensorProto.FLOAT, None) for v in "abcdefghik"]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            x,
            helper.make_tensor_value_info("fed", TensorProto.FLOAT, [32, 8]),
            helper.make_tensor_value_info("x48", TensorProto.FLOAT, ["B", 48]),
        ],
        outputs + [helper.make_tensor_value_info("j", TensorProto.FLOAT16, None)],
        initializer=[numpy_helper.from_array(a, n) for n, a in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_which_matmuls_are_quantized(tmp_path):
    report = onnxkv.quantize_weights(small_graph(), tmp_path / "q.onnx", block_size=16)
    assert report.quantized == 3
    reasons = dict(report.skipped)
    assert set(reasons) == {
        "node 'tiny_k' (MatMul)",
        "node 'also_added' (MatMul)",
        "node 'fed_weight' (MatMul)",
        "node 'three_d' (MatMul)",
        "node 'not_finite' (MatMul)",
        "node 'fp16' (MatMul)",
    }
    assert reasons["node 'tiny_k' (MatMul)"] == "its weight 'tiny' has K = 8, below block_size 16"
    assert (
        reasons["node 'also_added' (MatMul)"]
        == "its weight 'added' is also read by node 'adder' (Add) input 0, node 'adder' (Add) input 1"
    )
    assert "also a graph input" in reasons["node 'fed_weight' (MatMul)"]
    assert reasons["node 'three_d' (MatMul)"] == "its weight 'cube' has shape [1, 32, 8], not [K, N] with N >= 1"
    assert reasons["node 'not_finite' (MatMul)"] == "its weight 'nan' holds NaN or infinity"
    assert reasons["node 'fp16' (MatMul)"] == "its weight 'half' is FLOAT16, not FLOAT"
    proto = onnx.load(str(tmp_path / "q.onnx"))
    nbits = {n.name: list(n.input) for n in proto.graph.node if n.op_type == "MatMulNBits"}
    assert nbits == {
        "first_Q4": ["x", "shared_Q4", "shared_scales"],
        "second_Q4": ["x", "shared_Q4", "shared_scales"],
        "": ["x48", "solo_Q4", "solo_scales"],
    }
    names = {t.name for t in proto.graph.initializer}
    assert "shared" not in names and "solo" not in names and {"added", "tiny", "nan", "half", "cube"} <= names
    x = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    feeds = {"x": x, "fed": np.ones((32, 8), np.float32), "x48": np.ones((3, 48), np.float32)}
    got = dict(
        zip(
            [o.name for o in proto.graph.output],
            ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds),
        )
    )
    want = x @ numpy_helper.to_array(small_graph().graph.initializer[0])
    assert np.sqrt(np.mean((got["a"] - want) ** 2) / np.mean(want**2)) < 0.15
    np.testing.assert_array_equal(got["a"], got["b"])


def test_name_clash_gets_a_suffix(tmp_path):
    model = small_graph()
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.float32), "solo_scales"))
    model.graph.output.append(helper.make_tensor_value_info("solo_scales", TensorProto.FLOAT, [1]))
    onnxkv.quantize_weights(model, tmp_path / "q.onnx", block_size=16)
    proto = onnx.load(str(tmp_path / "q.onnx"))
    (node,) = [n for n in proto.graph.node if n.op_type == "MatMulNBits" and n.input[0] == "x48"]
    assert list(node.input) == ["x48", "solo_Q4", "solo_scales_1"]


@pytest.mark.parametrize(
    "argument,value,expected",
    [
        ("bits", 3, "4 or 8"),
        ("bits", True, "4 or 8"),
        ("bits", 2, "4 or 8"),
        ("block_size", 8, "a power of two from 16 to 256"),
        ("block_size", 48, "a power of two"),
        ("block_size", 512, "a power of two"),
        ("block_size", 32.0, "a power of two"),
        ("symmetric", 1, "True or False"),
        ("accuracy_level", 5, "an int from 0 to 4"),
        ("accuracy_level", -1, "an int from 0 to 4"),
    ],
)
def test_arguments_are_checked(argument, value, expected, tmp_path):
    with pytest.raises(InputError, match=rf"quantize_weights: {argument} is {value!r}; expected {expected}"):
        onnxkv.quantize_weights(small_graph(), tmp_path / "q.onnx", **{argument: value})
    assert not (tmp_path / "q.onnx").exists()


def test_out_never_overwrites_the_source(micro_folder):
    with pytest.raises(InputError, match="is the source folder"):
        onnxkv.quantize_weights(micro_folder, micro_folder)
    with pytest.raises(InputError, match="would overwrite the source file .*model.onnx"):
        onnxkv.quantize_weights(micro_folder / "model.onnx", micro_folder / "model.onnx")
    with pytest.raises(InputError, match="out is 3; expected a path"):
        onnxkv.quantize_weights(micro_folder, 3)


def test_out_never_overwrites_the_source_data(micro_folder, tmp_path):
    """A model file whose external data is named like the output's data file."""
    for name in ("model.onnx.data", "genai_config.json"):
        (tmp_path / name).write_bytes((micro_folder / name).read_bytes())
    (tmp_path / "m.onnx").write_bytes((micro_folder / "model.onnx").read_bytes())
    with pytest.raises(InputError, match="would overwrite the source file .*model.onnx.data"):
        onnxkv.quantize_weights(tmp_path / "m.onnx", tmp_path / "model.onnx")
    assert sorted(os.listdir(tmp_path)) == ["genai_config.json", "m.onnx", "model.onnx.data"]
