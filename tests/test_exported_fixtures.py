"""Parity on models made by the public exporters (tests/data, see its README).

The GenAI model builder's GroupQueryAttention graph and torch.onnx.export's
Concat graph of the same tiny random-weight Llama, against transformers'
logits and tokens recorded by scripts/make_fixtures.py, and against ONNX
Runtime on identical feeds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import onnxkv

DATA = Path(__file__).parent / "data"
REF = np.load(DATA / "tiny_llama_reference.npz")
MODELS = {"genai": DATA / "genai_tiny_llama", "torch": DATA / "torch_tiny_llama" / "model.onnx"}


@pytest.fixture(scope="module", params=sorted(MODELS))
def session(request):
    return onnxkv.Session(MODELS[request.param], threads=2)


def test_conventions(session):
    kind = session.model.convention.kind
    assert kind in ("group_query_attention", "concat")
    assert session.fallback_nodes == []


def test_prefill_and_decode_logits_match_transformers(session):
    from onnxkv.generate.feeds import FeedBuilder

    prompt = REF["prompt_ids"][None, :].astype(np.int64)
    model = session.model
    fetch = [model.io.logits, *model.convention.present_outputs]
    builder = FeedBuilder(session.plan.inputs, model, prompt, np.array([prompt.shape[1]]), 258)
    feeds, _ = builder.first()
    out = session.run(feeds, fetch)
    np.testing.assert_allclose(out["logits"][0], REF["prefill_logits"], atol=1e-4, rtol=0)
    for i in range(16):
        out = session.run(builder.next(REF["greedy_tokens"][i : i + 1].astype(np.int64), out), fetch)
        np.testing.assert_allclose(out["logits"][0, -1], REF["decode_logits"][i], atol=1e-4, rtol=0)


def test_greedy_64_tokens_match_transformers(session):
    prompt = REF["prompt_ids"][None, :]
    res = onnxkv.generate(session, prompt, 64, eos_token_id=[])
    np.testing.assert_array_equal(res.tokens[0], REF["greedy_tokens"])


def test_left_padded_batch_matches_transformers(session):
    res = onnxkv.generate(
        session,
        REF["batch_input_ids"],
        16,
        attention_mask=REF["batch_attention_mask"],
        eos_token_id=[],
        pad_token_id=258,
    )
    np.testing.assert_array_equal(res.tokens, REF["batch_greedy_tokens"])


def test_logits_match_onnxruntime(session):
    pytest.importorskip("onnxruntime")
    from ort_loop import compare_runs, ort_greedy

    prompt = REF["prompt_ids"][None, :].astype(np.int64)
    assert compare_runs(session, prompt, 16) <= 1e-4
    np.testing.assert_array_equal(
        onnxkv.generate(session, prompt, 64, eos_token_id=[]).tokens, ort_greedy(session, prompt, 64)
    )
