"""Every argument of generate, beam_search and speculative_generate is checked up front.

A bad value is an InputError whose message starts with the API's name and
names the argument and the value, raised before any model runs (the
session's step counter does not move).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import onnxkv
from onnxkv import InputError
from onnxkv.generate import beam_search, generate, speculative_generate
from onnxkv.zoo.builders import MICRO, build_model

PROMPT = np.array([[1, 2, 3]])
V = MICRO.vocab_size

#: Bad values shared by the APIs' common arguments: (argument, value, what the message must hold).
COMMON = [
    ("input_ids", [[1, 2], [3]], "input_ids must be a rectangular array"),
    ("input_ids", np.array([[1, -2]]), r"input_ids must be in \[0, 97\), got min -2"),
    ("input_ids", np.array([[1, V]]), r"input_ids must be in \[0, 97\), got min 1, max 97"),
    ("input_ids", np.array([[True, False]]), "input_ids must be integers"),
    ("eos_token_id", [1, "a"], r"eos_token_id\[1\] 'a' is outside the vocabulary: expected an int in \[0, 97\)"),
    ("eos_token_id", "1", "eos_token_id must be an int, a list of ints or None, got '1'"),
    ("eos_token_id", 1.0, "eos_token_id must be an int, a list of ints or None, got 1.0"),
    ("eos_token_id", [True], r"eos_token_id\[0\] True is outside"),
    ("eos_token_id", [-1], r"eos_token_id\[0\] -1 is outside"),
    ("eos_token_id", V, r"eos_token_id 97 is outside"),
    ("eos_token_id", {3}, "eos_token_id must be an int, a list of ints or None"),
    ("callback", 3, "callback must be callable or None, got int"),
    ("cache", ["paged"], r"cache must be .*, got \['paged'\]"),
    ("cache", np.array(["paged"]), r"cache must be .*, got array"),
    ("threads", 0, "threads must be an int ≥ 1 or None, got 0"),
    ("threads", True, "threads must be an int ≥ 1 or None, got True"),
]

GENERATE = COMMON + [
    ("max_new_tokens", True, "max_new_tokens must be an int ≥ 0, got True"),
    ("max_new_tokens", 2.0, "max_new_tokens must be an int ≥ 0, got 2.0"),
    ("temperature", float("inf"), "temperature must be a finite number in .*, got inf"),
    ("temperature", float("nan"), "temperature must be a finite number in .*, got nan"),
    ("temperature", True, "temperature .* got True"),
    ("temperature", "1", "temperature .* got '1'"),
    ("do_sample", "yes", "do_sample must be True or False, got 'yes'"),
    ("top_k", 1.5, "top_k must be an int ≥ 0 or None, got 1.5"),
    ("top_k", -1, "top_k must be an int ≥ 0 or None, got -1"),
    ("top_k", True, "top_k .* got True"),
    ("top_p", 0.0, r"top_p must be a finite number in \(0.0, 1.0\], got 0.0"),
    ("top_p", True, "top_p .* got True"),
    ("top_p", float("nan"), "top_p .* got nan"),
    ("seed", 1.5, "seed must be an int ≥ 0 or None, got 1.5"),
    ("pad_token_id", True, "pad_token_id True is outside"),
    ("pad_token_id", "0", "pad_token_id '0' is outside"),
    ("pad_token_id", V, "pad_token_id 97 is outside"),
    ("attention_mask", np.array([[1, 2, 1]]), "attention_mask must hold only 0 and 1"),
    ("prefill_chunk", True, "prefill_chunk .* got True"),
    (
        "cache",
        "auto-ish",
        r"cache must be a CacheConfig, one of 'contiguous', 'paged', 'tensor' or None, got "
        r"'auto-ish'",
    ),
    ("model", 5, "model must be a Session, a Model, a ModelProto or a path, got int"),
]

BEAM = COMMON + [
    ("num_beams", 0, "num_beams must be an int ≥ 1, got 0"),
    ("max_new_tokens", np.float64(2), "max_new_tokens must be an int ≥ 1, got"),
    ("num_return_sequences", 0, "num_return_sequences must be an int ≥ 1, got 0"),
    ("length_penalty", float("nan"), "length_penalty must be a finite number .* got nan"),
    ("length_penalty", float("-inf"), "length_penalty .* got -inf"),
    ("length_penalty", 1e6, r"length_penalty 1000000.0 makes the length factor .* leave the float32 range"),
    ("early_stopping", np.array([1, 0]), r"early_stopping must be True, False or 'never', got array"),
    ("early_stopping", 1, "early_stopping must be True, False or 'never', got 1"),
    ("pad_token_id", -1, "pad_token_id -1 is outside"),
    ("do_sample", True, r"do_sample=True \(beam sampling\) is not supported"),
    ("do_sample", 1, "do_sample must be True or False, got 1"),
    ("cache", "contiguous", r"cache must be a CacheConfig, one of 'paged', 'tensor' or None, got 'contiguous'"),
    (
        "cache",
        onnxkv.CacheConfig("contiguous"),
        r"cache kind 'contiguous' is not supported here; expected one of "
        r"'paged', 'tensor'",
    ),
    ("model", None, "model must be a Session, .* got NoneType"),
]

SPECULATIVE = COMMON + [
    ("draft", 5, "draft must be a Session, a Model, a ModelProto or a path, got int"),
    ("num_draft_tokens", 0, "num_draft_tokens must be an int ≥ 1, got 0"),
    ("max_new_tokens", -1, "max_new_tokens must be an int ≥ 0, got -1"),
    ("prompt_lookup_ngram", 1.0, "prompt_lookup_ngram must be an int ≥ 1, got 1.0"),
    ("do_sample", "yes", "do_sample must be True or False, got 'yes'"),
    ("do_sample", 1, "do_sample must be True or False, got 1"),
    ("temperature", float("nan"), "temperature must be a finite number .* got nan"),
    ("temperature", -1.0, r"temperature must be a finite number in \[0.0, inf\), got -1.0"),
    ("top_k", -1, "top_k must be an int ≥ 0 or None, got -1"),
    ("cache", "tensor", r"cache must be a CacheConfig, one of 'contiguous', 'paged' or None, got 'tensor'"),
    ("cache", onnxkv.CacheConfig("tensor"), r"cache kind 'tensor' is not supported here"),
    ("top_p", 2, r"top_p must be a finite number in \(0.0, 1.0\], got 2"),
    ("seed", -1, "seed must be an int ≥ 0 or None, got -1"),
    ("state_options", [("capacity", 8)], "state_options must be a mapping .* got list"),
    ("state_options", {"cache": "paged"}, r"state_options has 'cache'; expected arguments of Session.new_state"),
    ("state_options", {"nope": 1}, "state_options has 'nope'"),
]


@pytest.fixture(scope="module")
def sess():
    return onnxkv.Session(build_model("gqa", MICRO, seed=5), threads=1)


def _check(fn, api, sess, base, arg, value, match):
    args = dict(base, **{arg: value})
    before = sess._step
    with pytest.raises(InputError, match=rf"^{api}: {match}"):
        fn(**args)
    assert sess._step == before, "a model ran before the argument was checked"


@pytest.mark.parametrize("arg,value,match", GENERATE, ids=[f"{a}={v!r:.20}" for a, v, _ in GENERATE])
def test_generate_checks_every_argument(sess, arg, value, match):
    base = dict(model=sess, input_ids=PROMPT, max_new_tokens=2, cache=None)
    _check(generate, "generate", sess, base, arg, value, match)


@pytest.mark.parametrize("arg,value,match", BEAM, ids=[f"{a}={v!r:.20}" for a, v, _ in BEAM])
def test_beam_search_checks_every_argument(sess, arg, value, match):
    base = dict(model=sess, input_ids=PROMPT, num_beams=2, max_new_tokens=2, cache="paged")
    _check(beam_search, "beam_search", sess, base, arg, value, match)


@pytest.mark.parametrize("arg,value,match", SPECULATIVE, ids=[f"{a}={v!r:.20}" for a, v, _ in SPECULATIVE])
def test_speculative_generate_checks_every_argument(sess, arg, value, match):
    base = dict(model=sess, input_ids=PROMPT, draft=sess, max_new_tokens=2)
    _check(speculative_generate, "speculative_generate", sess, base, arg, value, match)


def test_sampling_temperature_must_be_positive_only_when_sampling(sess):
    with pytest.raises(InputError, match=r"temperature must be a finite number in \(0.0, inf\), got 0.0"):
        speculative_generate(sess, PROMPT, do_sample=True, temperature=0.0, max_new_tokens=2)
    assert speculative_generate(sess, PROMPT, do_sample=False, temperature=0.0, max_new_tokens=2).new_tokens == 2


def test_draft_with_another_vocabulary_is_rejected_before_anything_runs():
    target = onnxkv.Session(build_model("gqa", MICRO, seed=3), threads=1)
    draft = onnxkv.Session(build_model("gqa", dataclasses.replace(MICRO, vocab_size=50), seed=3), threads=1)
    with pytest.raises(
        InputError,
        match=r"^speculative_generate: the draft model's vocabulary is 50, the "
        r"target's 97",
    ):
        speculative_generate(target, PROMPT, draft=draft, max_new_tokens=4)
    assert target._step == 0 and draft._step == 0


def test_beam_search_hypothesis_tables_must_fit_in_memory(sess, monkeypatch):
    monkeypatch.setattr(sess, "position_tables", {})  # a model whose positions nothing bounds
    with pytest.raises(
        InputError,
        match=r"^beam_search: 1 row\(s\) \* num_beams 4 \* max_new_tokens "
        r"1152921504606846976 hypotheses need \d+ bytes, more than",
    ):
        beam_search(sess, PROMPT, 4, 1 << 60, cache="paged")
