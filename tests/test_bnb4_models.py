"""Models quantized by ONNX Runtime's ``MatMulBnb4Quantizer`` (com.microsoft::MatMulBnb4, FP4 and NF4: the
``model_bnb4.onnx`` of Transformers.js repositories), every cache convention: every product in onnxkv's
kernels (siblings fused, norms joined), logits as ONNX Runtime's on the same file for the prefill and 8 decode
steps, decode steps replayed by compiled steps with the node-by-node bits, and on the trained embedded model
the same greedy tokens as ONNX Runtime through ``generate`` (contiguous and paged caches)."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

pytest.importorskip("onnxruntime")

from onnxruntime.quantization.matmul_bnb4_quantizer import MatMulBnb4Quantizer  # noqa: E402
from ort_loop import assert_greedy_equals_ort, compare_runs  # noqa: E402

import onnxkv  # noqa: E402
from onnxkv.plan.compiled_step import Segment  # noqa: E402
from onnxkv.zoo import embedded  # noqa: E402
from onnxkv.zoo.builders import TINY, build_model  # noqa: E402

FAMILIES = ["gqa", "attention", "concat", "tensorscatter"]
QUANT_TYPES = {"fp4": MatMulBnb4Quantizer.FP4, "nf4": MatMulBnb4Quantizer.NF4}


def _quantize(model: onnx.ModelProto, quant_type: int, block_size: int) -> onnx.ModelProto:
    quantizer = MatMulBnb4Quantizer(model, quant_type, block_size)
    quantizer.process()
    return quantizer.model.model


@pytest.fixture(
    scope="module",
    params=[(f, q) for f in FAMILIES for q in QUANT_TYPES],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def quantized(request):
    family, kind = request.param
    return _quantize(build_model(family, TINY, seed=7), QUANT_TYPES[kind], 32)


def test_products_run_in_kernels(quantized):
    session = onnxkv.Session(quantized, threads=2)
    assert {n.op_type for n in quantized.graph.node} >= {"MatMulBnb4"}
    assert not session.fallback_nodes
    kinds = {type(getattr(k, "product", k)).__name__ for k in session.plan.kernels}
    assert {"MatMulBnb4", "SiblingMatMulBnb4"} <= kinds


def test_logits_match_onnxruntime(quantized):
    session = onnxkv.Session(quantized, threads=2)
    prompt = np.random.default_rng(0).integers(0, TINY.vocab_size, (1, 19))
    assert compare_runs(session, prompt, 8, atol=1e-4) <= 1e-4


def test_decode_steps_replay_with_the_node_by_node_bits(quantized):
    prompt = np.array([[3, 9, 27, 81]])
    runs = {}
    for compiled in (False, True):
        session = onnxkv.Session(quantized, threads=1, compiled_steps=compiled)
        runs[compiled] = onnxkv.generate(session, prompt, max_new_tokens=10, eos_token_id=[], temperature=0)
        if compiled:
            replayed = {
                type(getattr(session.plan.kernels[k], "product", session.plan.kernels[k])).__name__
                for step in session.plan.steps.idle
                for item in step.items
                if isinstance(item, Segment)
                for k in range(item.first, item.end)
            }
            assert {"MatMulBnb4", "SiblingMatMulBnb4"} <= replayed
    np.testing.assert_array_equal(runs[False].tokens, runs[True].tokens)


@pytest.fixture(scope="module", params=list(QUANT_TYPES))
def quantized_embedded(request, tmp_path_factory):
    """The embedded (trained) model quantized in a folder of its own, with its genai_config.json (blocks of
    64, as Transformers.js quantizes)."""
    source = embedded.embedded_model_dir()
    folder = tmp_path_factory.mktemp("bnb4_embedded")
    shutil.copy(source / "genai_config.json", folder / "genai_config.json")
    onnx.save(
        _quantize(onnx.load(str(source / "model.onnx")), QUANT_TYPES[request.param], 64), str(folder / "model.onnx")
    )
    return onnxkv.Session(folder, threads=2)


@pytest.mark.parametrize("cache", [None, "paged"], ids=["contiguous", "paged"])
def test_greedy_tokens_equal_onnxruntime(quantized_embedded, cache):
    prompt = np.array([embedded.encode("The cat sat on the mat and")], np.int64)
    assert_greedy_equals_ort(quantized_embedded, prompt, 32, cache)


def test_engine_batches_requests_with_the_tokens_each_gets_alone(quantized_embedded):
    """Requests of different lengths in one batched run per step (siblings and prologues through runs of
    segments) get the tokens generate gives each alone."""
    assert quantized_embedded.takes_segments
    prompts = [embedded.encode(t) for t in ("The cat", "Once upon a time there", "A")]
    engine = onnxkv.Engine(quantized_embedded, cache=onnxkv.CacheConfig("paged", block_size=4), max_batch_tokens=64)
    requests = [engine.add_request(p, max_new_tokens=12, eos_token_id=[]) for p in prompts]
    engine.run()
    for prompt, request in zip(prompts, requests):
        alone = onnxkv.generate(quantized_embedded, [prompt], max_new_tokens=12, eos_token_id=[]).tokens[0]
        np.testing.assert_array_equal(list(request.tokens), alone)
