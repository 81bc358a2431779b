"""com.microsoft::GatherBlockQuantized against ONNX Runtime (the oracle) on random tables."""

from __future__ import annotations

import tracemalloc
from dataclasses import replace

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi._pybind_state import quantize_matmul_4bits
from ort_loop import compare_runs

import onnxkv
from onnxkv import InputError, ModelError, Session
from onnxkv.plan.ops.gather_block_quantized import GatherBlockQuantized
from onnxkv.zoo.builders import DecoderConfig, build_gqa_model, random_weights, save_genai_folder

#: kind -> (stored element type, bits, lowest and highest quantized value)
KINDS = {
    "u8-4": (np.uint8, 4, 0, 15),
    "u8-8": (np.uint8, 8, 0, 255),
    "int4": (ml_dtypes.int4, 4, -8, 7),
    "uint4": (ml_dtypes.uint4, 4, 0, 15),
}


def pack_last(values: np.ndarray) -> np.ndarray:
    """uint8 nibbles ``values`` [..., n] packed two per byte along the last axis, low first (n padded to even)."""
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros(values.shape[:-1] + (1,), values.dtype)], axis=-1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def stored(kind: str, logical: np.ndarray) -> np.ndarray:
    """Quantized ints ``logical`` in the tensor form of ``kind`` (uint8 4-bit packed along the last axis)."""
    dtype, bits, _, _ = KINDS[kind]
    if kind == "u8-4":
        return pack_last(logical.astype(np.uint8))
    return logical.astype(dtype)


def table(kind: str, shape, q: int, block: int, zero_points: bool, scale_type=np.float32, seed=0):
    """Random (data, scales, zero_points or None) of logical ``shape`` quantized along ``q``."""
    rng = np.random.default_rng(seed)
    _, bits, lo, hi = KINDS[kind]
    sshape = list(shape)
    sshape[q] = -(-shape[q] // block)
    data = stored(kind, rng.integers(lo, hi + 1, shape))
    scales = (rng.standard_normal(sshape) * 0.1).astype(scale_type)
    zp = stored(kind, rng.integers(lo, hi + 1, sshape)) if zero_points else None
    return data, scales, zp


def gbq_model(data, scales, zp, index_type=TensorProto.INT64, constant=True, tail=(), **attrs) -> onnx.ModelProto:
    """y = GatherBlockQuantized(data, ids, scales, zp) (constants as initializers or graph inputs), then ``tail``
    nodes reading ``y`` and writing ``out``."""
    names = ["data", "ids", "scales"] + (["zp"] if zp is not None else [])
    tensors = [(n, a) for n, a in zip(["data", "scales", "zp"], [data, scales, zp]) if a is not None]
    node = helper.make_node("GatherBlockQuantized", names, ["y"], domain="com.microsoft", name="gbq", **attrs)
    inputs = [helper.make_tensor_value_info("ids", index_type, None)]
    inits = [numpy_helper.from_array(a, n) for n, a in tensors]
    if not constant:
        inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
        inits = []
    out_type = helper.np_dtype_to_tensor_dtype(scales.dtype)
    graph = helper.make_graph(
        [node, *tail],
        "g",
        inputs,
        [helper.make_tensor_value_info("out" if tail else "y", out_type, None)],
        initializer=inits,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def run_both(model: onnx.ModelProto, feeds: dict, oracle: onnx.ModelProto | None = None) -> tuple[np.ndarray, ...]:
    """onnxkv's and ONNX Runtime's output; ORT runs ``oracle`` on the ``ids`` feed alone when given (it cannot
    take int4 feeds)."""
    ours = Session(model, threads=1).run(feeds)
    (name,) = ours
    sess = ort.InferenceSession((oracle or model).SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = sess.run(None, {"ids": feeds["ids"]} if oracle is not None else feeds)[0]
    return ours[name], theirs


def both_forms(constant: bool, ids: np.ndarray, data, scales, zp, **kwargs) -> tuple[np.ndarray, ...]:
    """run_both on the tables as initializers, or fed at run time to onnxkv (ORT gets the initializer form)."""
    oracle = gbq_model(data, scales, zp, **kwargs)
    if constant:
        return run_both(oracle, {"ids": ids})
    feeds = {"ids": ids, **{n: a for n, a in (("data", data), ("scales", scales), ("zp", zp)) if a is not None}}
    return run_both(gbq_model(data, scales, zp, constant=False, **kwargs), feeds, oracle)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("block", [16, 64])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("scale_type", [np.float32, np.float16])
def test_builder_layout_matches_ort(kind, block, zero_points, scale_type):
    """gather_axis 0, quantize_axis last (what the builder emits); a partial last block; ids of rank 2."""
    shape = (37, 80)
    data, scales, zp = table(kind, shape, 1, block, zero_points, scale_type, seed=block)
    bits = KINDS[kind][1]
    model = gbq_model(data, scales, zp, gather_axis=0, quantize_axis=1, block_size=block, bits=bits)
    ids = np.array([[0, 36, 5, 5], [-1, -37, 12, 3]], np.int64)
    ours, theirs = run_both(model, {"ids": ids})
    assert ours.dtype == scale_type and ours.shape == (2, 4, 80)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("index_type", [TensorProto.INT32, TensorProto.INT64])
@pytest.mark.parametrize("constant", [True, False])
def test_index_types_and_runtime_tables(kind, index_type, constant):
    """int32/int64 ids; tables as initializers (checked and packed once) or fed at run time."""
    data, scales, zp = table(kind, (50, 64), 1, 32, True, seed=3)
    attrs = dict(index_type=index_type, block_size=32, bits=KINDS[kind][1], quantize_axis=1)
    session = Session(gbq_model(data, scales, zp, constant=constant, **attrs), threads=1)
    kernel = next(k for k in session.plan.kernels if isinstance(k, GatherBlockQuantized))
    assert (kernel.table is not None) == constant
    ids = np.array([7, -50, 49, 0, -1], helper.tensor_dtype_to_np_dtype(index_type))
    ours, theirs = both_forms(constant, ids, data, scales, zp, **attrs)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("kind", ["int4", "uint4"])
@pytest.mark.parametrize("axes", [(0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1), (0, 0), (1, 1), (2, 2), (-3, -1)])
@pytest.mark.parametrize("constant", [True, False])
def test_int4_any_axes(kind, axes, constant):
    """int4/uint4 tables gather and quantize along any two axes (the same one too); odd slices pack with padding."""
    g, q = axes
    shape = (20, 7, 33)
    data, scales, zp = table(kind, shape, q % 3, 16, True, seed=(g % 3) * 3 + q % 3)
    ids = np.array([[1, -1, 0], [3, 2, -2]], np.int64)
    ours, theirs = both_forms(constant, ids, data, scales, zp, gather_axis=g, quantize_axis=q, block_size=16, bits=4)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("bits", [4, 8])
def test_uint8_rank3_odd_block_count(bits):
    """Packed uint8 zero points with an odd block count per row pad each row's last byte."""
    kind = f"u8-{bits}"
    data, scales, zp = table(kind, (9, 3, 48), 2, 16, True, seed=bits)
    assert zp.shape == ((9, 3, 2) if bits == 4 else (9, 3, 3))
    model = gbq_model(data, scales, zp, TensorProto.INT32, gather_axis=0, quantize_axis=-1, block_size=16, bits=bits)
    ours, theirs = run_both(model, {"ids": np.array([[8], [0], [-4]], np.int32)})
    np.testing.assert_array_equal(ours, theirs)


def test_default_attributes():
    """Omitted attributes: gather_axis 0, quantize_axis 1, block_size 128, bits 4."""
    data, scales, zp = table("u8-4", (6, 256), 1, 128, False)
    ours, theirs = run_both(gbq_model(data, scales, zp), {"ids": np.array([5, 0], np.int64)})
    np.testing.assert_array_equal(ours, theirs)


def test_tied_lm_head_pattern():
    """The builder's tied int4 embedding: MatMulNBits weight [V, blocks, blob] -> Reshape [V, blocks * blob] ->
    GatherBlockQuantized -> Slice off the padding to the hidden size."""
    vocab, hidden, block = 40, 72, 32
    rng = np.random.default_rng(7)
    embedding = rng.standard_normal((vocab, hidden)).astype(np.float32)  # lm_head weight is its transpose
    blocks = -(-hidden // block)
    packed = np.zeros((vocab, blocks, block // 2), np.uint8)
    scales = np.zeros((vocab, blocks), np.float32)
    quantize_matmul_4bits(
        packed, np.ascontiguousarray(embedding.T), scales, np.zeros((vocab, 1), np.uint8), block, vocab, hidden, True
    )
    tail = [helper.make_node("Slice", ["y", "zero", "hidden", "last"], ["out"], name="slice")]
    model = gbq_model(
        packed.reshape(vocab, -1), scales, None, tail=tail, gather_axis=0, quantize_axis=1, block_size=block, bits=4
    )
    model.graph.node[0].input[0] = "reshaped"
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(packed, "weight_Q4"))
    model.graph.node.insert(0, helper.make_node("Reshape", ["weight_Q4", "flat"], ["reshaped"], name="reshape"))
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array(v, np.int64), n)
            for n, v in (("flat", [vocab, blocks * block // 2]), ("zero", [0]), ("hidden", [hidden]), ("last", [-1]))
        ]
    )
    ids = np.array([[3, 39, 0, 17]], np.int64)
    ours, theirs = run_both(model, {"ids": ids})
    assert ours.shape == (1, 4, hidden)
    np.testing.assert_array_equal(ours, theirs)
    step = np.repeat(np.abs(scales[ids[0]]), block, axis=1)[:, :hidden]
    assert np.all(np.abs(ours[0] - embedding[ids[0]]) <= step * (1 + 1e-5))  # symmetric 4-bit: one step at most
    plan = Session(model, threads=1).plan
    (kernel,) = [k for k in plan.kernels if isinstance(k, GatherBlockQuantized)]
    assert np.shares_memory(kernel.table.data.array, plan._template[plan.slot_of["weight_Q4"]])  # no copy


@pytest.mark.parametrize("index_type", [np.int32, np.int64])
@pytest.mark.parametrize("bad", ["high", "low"])
def test_out_of_range_index_is_an_error(index_type, bad):
    """ORT writes zeros for an index outside [-s, s-1]; onnxkv refuses it, naming the node, value and range."""
    data, scales, _ = table("u8-4", (10, 32), 1, 16, False)
    session = Session(
        gbq_model(data, scales, None, helper.np_dtype_to_tensor_dtype(np.dtype(index_type)), block_size=16), threads=1
    )
    value = {"high": 10, "low": -11}[bad]
    with pytest.raises(InputError, match=rf"GatherBlockQuantized node 'gbq': index {value} .*\[-10, 9\]"):
        session.run({"ids": np.array([[0, value, 3]], index_type)})
    extreme = np.iinfo(index_type).max if bad == "high" else np.iinfo(index_type).min
    with pytest.raises(InputError, match=rf"index {extreme} "):
        session.run({"ids": np.array([extreme], index_type)})


def test_empty_indices():
    data, scales, _ = table("int4", (10, 32), 1, 16, False)
    ours, theirs = run_both(gbq_model(data, scales, None, block_size=16), {"ids": np.zeros((2, 0), np.int64)})
    assert ours.shape == theirs.shape == (2, 0, 32)


def test_index_dtype_is_checked():
    data, scales, _ = table("u8-4", (10, 32), 1, 16, False)
    model = gbq_model(data, scales, None, TensorProto.INT16, block_size=16)
    with pytest.raises(InputError, match="indices .* element type int16; expected int32 or int64"):
        Session(model, threads=1).run({"ids": np.array([1], np.int16)})


@pytest.mark.parametrize(
    "attrs,match",
    [
        ({"block_size": 8}, "block_size is 8; expected a power of two >= 16"),
        ({"block_size": 48}, "block_size is 48"),
        ({"bits": 2}, "bits is 2; onnxkv supports 4 and 8"),
        ({"gather_axis": 1}, "uint8 data of shape \\[10, 16\\] needs gather_axis 0"),
        ({"quantize_axis": 0}, "needs gather_axis 0 and quantize_axis the last axis"),
        ({"quantize_axis": 2}, "quantize_axis: axis 2 is out of range for rank 2"),
        (
            {"block_size": 32},
            r"scales have shape \[10, 2\]; data of logical shape \[10, 32\] with block_size 32 along "
            r"axis 1 needs \[10, 1\]",
        ),
    ],
)
def test_bad_attributes_are_model_errors(attrs, match):
    data, scales, _ = table("u8-4", (10, 32), 1, 16, False)
    model = gbq_model(data, scales, None, **{"block_size": 16, **attrs})
    with pytest.raises(ModelError, match="GatherBlockQuantized node 'gbq': .*" + match):
        Session(model, threads=1)


def test_bad_tensors_are_model_errors():
    data, scales, zp = table("u8-4", (10, 32), 1, 16, True)
    for args, match in [
        ((data, scales, zp.view(np.int8)), "zero_points have element type int8; expected uint8"),
        ((data, scales, zp[:, :0]), r"zero_points have shape \[10, 0\]; .* need \[10, 1\]"),
        ((data, scales.astype(np.float64), None), "scales have element type float64"),
        ((data.view(np.int8), scales, None), "data has element type int8"),
        ((data.astype(ml_dtypes.int4), scales[:, :1], None), "int4 data needs bits 4, got 8"),
    ]:
        bits = 8 if "bits 4" in match else 4
        with pytest.raises(ModelError, match=match):
            Session(gbq_model(*args, block_size=16, bits=bits), threads=1)


def test_constant_table_is_held_packed_and_only_gathered_rows_are_dequantized():
    """A constant int4 table is kept two per byte (the plan drops its unpacked copy); a call dequantizes the
    gathered rows only (event counter and traced allocations)."""
    vocab, hidden = 4096, 512
    data, scales, zp = table("int4", (vocab, hidden), 1, 32, True)
    session = Session(gbq_model(data, scales, zp, block_size=32), threads=1, events=True)
    kernel = next(k for k in session.plan.kernels if isinstance(k, GatherBlockQuantized))
    assert kernel.table.data.array.nbytes == vocab * hidden // 2
    assert kernel.absorbed_inputs == (0, 2, 3)
    assert session.plan._template[session.plan.slot_of["data"]] is None
    ids = np.array([[17, 4000]], np.int64)
    session.run({"ids": ids})
    tracemalloc.start()
    try:
        out = session.run({"ids": ids})["y"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * hidden * 4  # the dequantized table would be vocab * hidden * 4 = 8 MiB
    assert session.events.totals()["dequantized_bytes"] == 2 * out.nbytes == 2 * 2 * hidden * 4


def test_tied_int4_decoder_matches_ort(tmp_path):
    """The GenAI builder's int4 export with tied embeddings: every MatMul a MatMulNBits, the embedding a
    GatherBlockQuantized over the LM head's quantized weight (Reshape, then Slice off the block padding).
    onnxkv and ORT agree on prefill and decode logits (needs onnxkv's MatMulNBits)."""
    cfg = DecoderConfig(
        vocab_size=97, hidden_size=80, num_layers=2, num_heads=5, num_kv_heads=1, intermediate_size=128, max_length=128
    )
    w = random_weights(cfg, seed=5)
    save_genai_folder(build_gqa_model(cfg, replace(w, lm_head=np.ascontiguousarray(w.embed.T))), cfg, tmp_path / "f")
    report = onnxkv.quantize_weights(tmp_path / "f", tmp_path / "q", block_size=32, accuracy_level=0)
    assert report.quantized == 2 * 7 + 1
    path = tmp_path / "q" / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    (gather,) = [n for n in graph.node if n.name == "/model/embed_tokens/Gather"]
    flat = -(-cfg.hidden_size // 32) * 32 // 2
    lookup = [
        helper.make_node("Reshape", ["lm_head.MatMul.weight_Q4", "flat_shape"], ["table"], name="/embed/Reshape"),
        helper.make_node(
            "GatherBlockQuantized",
            ["table", "input_ids", "lm_head.MatMul.weight_scales"],
            ["padded"],
            domain="com.microsoft",
            name="/embed/GatherBlockQuantized",
            bits=4,
            block_size=32,
            gather_axis=0,
            quantize_axis=1,
        ),
        helper.make_node("Slice", ["padded", "zero", "hidden", "last"], [gather.output[0]], name="/embed/Slice"),
    ]
    at = list(graph.node).index(gather)
    graph.node.remove(gather)
    for node in reversed(lookup):
        graph.node.insert(at, node)
    (embed,) = [t for t in graph.initializer if t.name == "model.embed_tokens.weight"]
    graph.initializer.remove(embed)
    graph.initializer.extend(
        numpy_helper.from_array(np.array(v, np.int64), n)
        for n, v in (
            ("flat_shape", [cfg.vocab_size, flat]),
            ("zero", [0]),
            ("hidden", [cfg.hidden_size]),
            ("last", [-1]),
        )
    )
    onnx.save(model, str(path))
    session = Session(onnxkv.load(tmp_path / "q"), threads=1)
    assert not session.fallback_nodes
    prompt = np.array([[5, 17, 96, 0, 33, 2]], np.int64)
    assert compare_runs(session, prompt, steps=6, atol=2e-3) >= 0
