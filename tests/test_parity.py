"""Whole-model parity with ONNX Runtime for every cache convention (fp32).

Logits within 1e-4 for the prefill and 16 decode steps on identical feeds, and
greedy token sequences identical for 64 steps.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from ort_loop import compare_runs, ort_greedy  # noqa: E402

import onnxkv  # noqa: E402
from onnxkv.zoo.builders import MICRO, TINY, build_model  # noqa: E402

FAMILIES = ["gqa", "attention", "concat", "tensorscatter"]


@pytest.fixture(scope="module", params=FAMILIES)
def micro_session(request):
    return onnxkv.Session(build_model(request.param, MICRO, seed=3), threads=2)


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_session(request):
    return onnxkv.Session(build_model(request.param, TINY, seed=5), threads=2)


def test_logits_match_prefill_and_16_decode_steps(tiny_session):
    prompt = np.random.default_rng(0).integers(0, TINY.vocab_size, (1, 23))
    worst = compare_runs(tiny_session, prompt, 16)
    assert worst <= 1e-4


def test_batched_left_padded_logits_match(micro_session):
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, MICRO.vocab_size, (2, 9))
    mask = np.ones_like(prompt)
    mask[1, :4] = 0
    assert compare_runs(micro_session, prompt, 6, mask=mask) <= 1e-4


def test_greedy_64_tokens_identical(tiny_session):
    prompt = np.random.default_rng(2).integers(0, TINY.vocab_size, (1, 11))
    ours = onnxkv.generate(tiny_session, prompt, 64).tokens
    theirs = ort_greedy(tiny_session, prompt, 64)
    np.testing.assert_array_equal(ours, theirs)


def test_all_families_generate_the_same_tokens():
    prompt = np.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    outs = [onnxkv.generate(build_model(f, MICRO, seed=9), prompt, 16).tokens for f in FAMILIES]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
