"""speculative_generate over paged caches whose kv_format converts full pages: greedy output equals greedy
generate with the same cache, however the verification runs fall across page conversions."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import onnxkv
from onnxkv.cache.policy import ResidualPolicy
from onnxkv.generate.speculative import speculative_generate
from onnxkv.zoo import embedded
from onnxkv.zoo.builders import MICRO, build_model

FORMATS = {"int8": "int8", "int4": "int4", "residual-int4": ResidualPolicy("int4", "int4", 6)}


@pytest.fixture(scope="module", params=["gqa", "attention", "concat"])
def pair(request):
    """(target, draft): MICRO models of one family with different random weights (near-ties everywhere, so
    any difference in what the target reads shows in its tokens)."""
    return (
        onnxkv.Session(build_model(request.param, MICRO, seed=3), threads=1),
        onnxkv.Session(build_model(request.param, MICRO, seed=4), threads=1),
    )


class _Runs(list):
    """Token counts of every run of the first state of a session made since the last :meth:`clear` (the
    target's: speculative_generate makes it before the draft's), recorded as they happen."""

    def __init__(self, monkeypatch, session) -> None:
        super().__init__()
        self.first = None
        real = onnxkv.State.run

        def run(state, feeds, *args, **kw):
            if state.session is session and self.first in (None, state):
                self.first = state
                self.append(feeds[session.model.io.input_ids].shape[1])
            return real(state, feeds, *args, **kw)

        monkeypatch.setattr(onnxkv.State, "run", run)

    def clear(self) -> None:
        super().clear()
        self.first = None


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_equals_generate_with_a_converting_kv_format(pair, fmt, block_size):
    target, other = pair
    cache = onnxkv.CacheConfig("paged", block_size=block_size, kv_format=FORMATS[fmt])
    for seed, k in ((1, 4), (2, 7)):
        ids = np.random.default_rng(seed).integers(0, MICRO.vocab_size, (1, 9))
        want = onnxkv.generate(target, ids, 40, eos_token_id=[], cache=cache).sequences
        for kw in ({}, {"draft": other}, {"draft": target}, {"draft": other, "tree": (3, k)}):
            got = speculative_generate(
                target, ids, max_new_tokens=40, eos_token_id=[], num_draft_tokens=k, cache=cache, **kw
            )
            np.testing.assert_array_equal(got.sequences, want, err_msg=f"{kw} k={k}")


def test_verification_runs_end_where_a_conversion_falls_due(pair, monkeypatch):
    """The draft is the target itself, so every proposal is accepted: each verification of 1 + 4 tokens
    runs in pieces that end on the page boundaries of block size 4 (a conversion after each)."""
    target, _ = pair
    ids = np.random.default_rng(3).integers(0, MICRO.vocab_size, (1, 9))
    sizes = _Runs(monkeypatch, target)
    cache = onnxkv.CacheConfig("paged", block_size=4, kv_format="int8")
    got = speculative_generate(target, ids, draft=target, max_new_tokens=21, eos_token_id=[], cache=cache)
    assert got.acceptance_rate == 1.0
    # the prompt (9), then the target verifies [last, 4 proposed] at lengths 9, 14, 19 and 24 (5 tokens
    # each, 21 in all): its runs end at 12, 14 | 16, 19 | 20, 24 | 28, 29
    assert sizes == [9, 3, 2, 2, 3, 1, 4, 4, 1]
    np.testing.assert_array_equal(
        got.sequences, onnxkv.generate(target, ids, 21, eos_token_id=[], cache=cache).sequences
    )


def test_a_rejected_proposal_never_runs_past_a_conversion(pair, monkeypatch):
    """Prompt lookup on random tokens proposes little that the target accepts: the pieces after a rejection
    are never run, so every verification's runs stop at its first rejected token's piece."""
    target, _ = pair
    ids = np.tile(np.random.default_rng(4).integers(0, MICRO.vocab_size, (1, 5)), 3)
    sizes = _Runs(monkeypatch, target)
    cache = onnxkv.CacheConfig("paged", block_size=4, kv_format="int4")
    got = speculative_generate(target, ids, max_new_tokens=30, eos_token_id=[], num_draft_tokens=6, cache=cache)
    assert sum(sizes) - ids.shape[1] <= got.new_tokens - 1 + got.proposed
    np.testing.assert_array_equal(
        got.sequences, onnxkv.generate(target, ids, 30, eos_token_id=[], cache=cache).sequences
    )


def test_a_long_prompt_runs_in_generates_chunks(monkeypatch):
    """A prompt longer than the session's prompt chunk (made 32 tokens here) is fed in those chunks, as
    generate feeds it, so its pages convert at the same lengths."""
    target = onnxkv.Session(build_model("gqa", MICRO, seed=5), threads=1)
    for name in ("onnxkv.generate.generate", "onnxkv.generate.verification"):
        monkeypatch.setattr(importlib.import_module(name), "prompt_chunk", lambda kernels, block_size=None: 32)
    ids = np.random.default_rng(5).integers(0, MICRO.vocab_size, (1, 100))
    cache = onnxkv.CacheConfig("paged", block_size=16, kv_format="int4")
    sizes = _Runs(monkeypatch, target)
    want = onnxkv.generate(target, ids, 24, eos_token_id=[], cache=cache).sequences
    assert sizes[:4] == [32, 32, 32, 4]
    sizes.clear()
    got = speculative_generate(target, ids, max_new_tokens=24, eos_token_id=[], cache=cache)
    np.testing.assert_array_equal(got.sequences, want)
    assert sizes[:4] == [32, 32, 32, 4]


def test_greedy_equals_generate_on_the_embedded_pair_with_quantized_pages():
    if not embedded.embedded_draft_dir().exists():
        pytest.skip("embedded draft model not built")
    target = onnxkv.Session(embedded.embedded_model_dir(), threads=1)
    draft = onnxkv.Session(embedded.embedded_draft_dir(), threads=1)
    ids = np.array([embedded.encode("    def __init__(self):\n        self.x = 1\n" * 3)])
    for fmt in ("int8", "int4"):
        cache = onnxkv.CacheConfig("paged", block_size=16, kv_format=fmt)
        want = onnxkv.generate(target, ids, 96, eos_token_id=[], cache=cache).sequences
        for kw in ({}, {"draft": draft}, {"draft": draft, "tree": (2, 4)}):
            got = speculative_generate(target, ids, max_new_tokens=96, eos_token_id=[], cache=cache, **kw)
            np.testing.assert_array_equal(got.sequences, want, err_msg=f"{fmt} {kw}")
