"""Prompt lookup: the search over a whole sequence and the index over a growing one propose alike."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from fuzzing import hypothesis_settings
from hypothesis import given
from hypothesis import strategies as st

import onnxkv
from onnxkv.generate.lookup import MAX_INDEXED_NGRAM, PromptIndex, prompt_lookup
from onnxkv.zoo.builders import MICRO, build_model


def test_prompt_lookup_proposals():
    t = np.array([1, 2, 3, 9, 8, 1, 2, 3, 7, 1, 2, 3], dtype=np.int64)
    np.testing.assert_array_equal(prompt_lookup(t, 3, 2), [7, 1])  # the most recent occurrence
    np.testing.assert_array_equal(prompt_lookup(t, 3, 10), [7, 1, 2, 3])
    t = np.array([5, 6, 7, 4, 5], dtype=np.int64)
    np.testing.assert_array_equal(prompt_lookup(t, 3, 2), [6, 7])  # falls back to the 1-gram [5]
    assert prompt_lookup(np.array([1, 2, 3, 4]), 3, 4).size == 0
    assert prompt_lookup(np.array([4, 4]), 3, 0).size == 0


def test_index_proposals():
    index = PromptIndex(3, [1, 2, 3, 9, 8, 1, 2, 3, 7, 1, 2, 3])
    np.testing.assert_array_equal(index.propose(2), [7, 1])
    np.testing.assert_array_equal(index.propose(10), [7, 1, 2, 3])
    index = PromptIndex(3, [5, 6, 7, 4, 5])
    np.testing.assert_array_equal(index.propose(2), [6, 7])
    assert PromptIndex(3, [1, 2, 3, 4]).propose(4).size == 0
    assert PromptIndex(3, [4, 4]).propose(0).size == 0
    assert PromptIndex(2).propose(3).size == 0 and PromptIndex(2, [7]).propose(3).size == 0
    proposal = PromptIndex(1, [4, 4]).propose(1)
    assert proposal.dtype == np.int64 and proposal.tolist() == [4]  # the occurrence overlapping the last token


@pytest.mark.parametrize("ngram", [0, MAX_INDEXED_NGRAM + 1])
def test_index_refuses_an_ngram_out_of_range(ngram):
    with pytest.raises(ValueError, match=f"ngram must be in \\[1, {MAX_INDEXED_NGRAM}\\], got {ngram}"):
        PromptIndex(ngram)


@hypothesis_settings(300)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=60),
    cuts=st.lists(st.integers(1, 5), max_size=30),
    ngram=st.integers(1, MAX_INDEXED_NGRAM),
    k=st.integers(0, 6),
)
def test_index_proposes_what_the_search_proposes_at_every_length(tokens, cuts, ngram, k):
    """Tokens appended in random chunks (a small alphabet, so n-grams repeat): after each chunk the index's
    proposal equals the search's over the whole sequence."""
    index = PromptIndex(ngram)
    done = 0
    for cut in [*cuts, len(tokens)]:
        index.extend(tokens[done : done + cut])
        done = min(done + cut, len(tokens))
        got = index.propose(k)
        want = prompt_lookup(np.array(tokens[:done], dtype=np.int64), ngram, k)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)
        if done == len(tokens):
            break
    assert index.tokens == tokens


@pytest.mark.parametrize("ngram", [2, MAX_INDEXED_NGRAM + 4])
def test_speculative_lookup_searches_with_the_index_up_to_its_ngram(ngram, monkeypatch):
    """speculative_generate proposes from the index (no search over the sequence per step) up to
    MAX_INDEXED_NGRAM, and with the search beyond it; the tokens are greedy generate's either way."""
    spec = importlib.import_module("onnxkv.generate.speculative")
    searches = []
    search = spec.prompt_lookup
    monkeypatch.setattr(spec, "prompt_lookup", lambda *a: searches.append(a) or search(*a))
    target = onnxkv.Session(build_model("gqa", MICRO, seed=3), threads=1)
    ids = np.tile(np.random.default_rng(5).integers(0, MICRO.vocab_size, (1, 4)), 3)
    got = spec.speculative_generate(target, ids, max_new_tokens=20, eos_token_id=[], prompt_lookup_ngram=ngram)
    np.testing.assert_array_equal(got.sequences, onnxkv.generate(target, ids, 20, eos_token_id=[]).sequences)
    assert got.proposed > 0
    assert (len(searches) > 0) == (ngram > MAX_INDEXED_NGRAM)
