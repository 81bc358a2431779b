"""Models quantized by ONNX Runtime's ``quantize_dynamic`` (DynamicQuantizeLinear + MatMulInteger, the
``model_quantized.onnx`` / ``model_int8.onnx`` of many model repositories; embedding and rotary tables
through DequantizeLinear), every cache convention: no node left to the ``onnx.reference`` fallback,
logits as ONNX Runtime's on the same file for the prefill and 8 decode steps, and on the trained
embedded model the same greedy tokens through ``generate`` (in-place caches, contiguous and paged).

Each operator gives ONNX Runtime's bits (tests/plan/ops/test_matmul_integer.py), but the float operators
between them may differ from ONNX Runtime's in the last bit, and DynamicQuantizeLinear turns such a
difference into a whole quantization step wherever a value sits on a rounding boundary: logits then
differ by up to about 0.15 on these random-weight models (and by about 1e-6 where no code flips), so
the logits bound is 0.25 and token equality is checked on the trained model, whose next-token margins
are wide."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

pytest.importorskip("onnxruntime")

from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: E402
from ort_loop import assert_greedy_equals_ort, compare_runs  # noqa: E402

import onnxkv  # noqa: E402
from onnxkv.zoo import embedded  # noqa: E402
from onnxkv.zoo.builders import TINY, build_model  # noqa: E402

FAMILIES = ["gqa", "attention", "concat", "tensorscatter"]
KINDS = [(QuantType.QInt8, False), (QuantType.QUInt8, True)]


def _quantize(source, out, weight_type, per_channel) -> None:
    """quantize_dynamic of MatMul and Gather, the operators it rewrites in a decoder (its "Attention" is ONNX
    Runtime's contrib operator, which it would also take opset-23 Attention nodes for); the zoo's graphs hold
    operators ONNX's shape inference does not type: float by default."""
    quantize_dynamic(
        str(source),
        str(out),
        weight_type=weight_type,
        per_channel=per_channel,
        op_types_to_quantize=["MatMul", "Gather"],
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )


@pytest.fixture(
    scope="module",
    params=[(f, k) for f in FAMILIES for k in KINDS],
    ids=lambda p: f"{p[0]}-{p[1][0].name}-pc{int(p[1][1])}",
)
def quantized(request, tmp_path_factory):
    family, (weight_type, per_channel) = request.param
    folder = tmp_path_factory.mktemp(f"dq_{family}")
    onnx.save(build_model(family, TINY, seed=7), str(folder / "float.onnx"))
    _quantize(folder / "float.onnx", folder / "model.onnx", weight_type, per_channel)
    return onnxkv.Session(str(folder / "model.onnx"), threads=2)


def test_products_run_in_kernels(quantized):
    ops = {n.op_type for n in quantized.model.proto.graph.node}
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= ops
    fallback = {
        n.op_type for n in quantized.model.proto.graph.node if (n.name or n.output[0]) in quantized.fallback_nodes
    }
    assert not fallback & {"MatMulInteger", "DynamicQuantizeLinear"}


def test_logits_match_onnxruntime(quantized):
    prompt = np.random.default_rng(0).integers(0, TINY.vocab_size, (1, 19))
    assert compare_runs(quantized, prompt, 8, atol=0.25) <= 0.25


@pytest.fixture(scope="module", params=KINDS, ids=lambda k: f"{k[0].name}-pc{int(k[1])}")
def quantized_embedded(request, tmp_path_factory):
    """The embedded (trained) model quantized in a folder of its own, with its genai_config.json."""
    weight_type, per_channel = request.param
    source = embedded.embedded_model_dir()
    folder = tmp_path_factory.mktemp("dq_embedded")
    shutil.copy(source / "genai_config.json", folder / "genai_config.json")
    _quantize(source / "model.onnx", folder / "model.onnx", weight_type, per_channel)
    return onnxkv.Session(folder, threads=2)


@pytest.mark.parametrize("cache", [None, "paged"], ids=["contiguous", "paged"])
def test_greedy_tokens_equal_onnxruntime(quantized_embedded, cache):
    prompt = np.array([embedded.encode("The cat sat on the mat and")], np.int64)
    assert_greedy_equals_ort(quantized_embedded, prompt, 32, cache)
