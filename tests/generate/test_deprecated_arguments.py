"""The spellings generate, beam_search and speculative_generate replaced still work, with a DeprecationWarning.

Each deprecated call gives the result of its new spelling, and its warning
names the replacement and points at the calling line.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from deprecations import warns_deprecated

import onnxkv
from onnxkv import CacheConfig, InputError
from onnxkv._deprecation import OnnxkvDeprecationWarning
from onnxkv.generate import beam_search, generate, speculative_generate
from onnxkv.zoo.builders import MICRO, build_model

PROMPT = np.array([[5, 9, 2, 7, 1]])


@pytest.fixture(scope="module")
def sess():
    return onnxkv.Session(build_model("gqa", MICRO, seed=5), threads=1)


def test_the_old_names_of_the_first_argument(sess):
    want = generate(sess, PROMPT, 4, eos_token_id=[])
    with warns_deprecated(__file__, r"^generate: the keyword session_or_model= is deprecated; pass model="):
        got = generate(session_or_model=sess, input_ids=PROMPT, max_new_tokens=4, eos_token_id=[])
    np.testing.assert_array_equal(got.tokens, want.tokens)
    want = beam_search(sess, PROMPT, 2, 3, eos_token_id=[])
    with warns_deprecated(__file__, r"^beam_search: the keyword session_or_model= is deprecated"):
        got = beam_search(session_or_model=sess, input_ids=PROMPT, num_beams=2, max_new_tokens=3, eos_token_id=[])
    np.testing.assert_array_equal(got.sequences, want.sequences)
    want = speculative_generate(sess, PROMPT, max_new_tokens=4, eos_token_id=[])
    with warns_deprecated(__file__, r"^speculative_generate: the keyword target= is deprecated; pass model="):
        got = speculative_generate(target=sess, input_ids=PROMPT, max_new_tokens=4, eos_token_id=[])
    np.testing.assert_array_equal(got.sequences, want.sequences)
    with pytest.raises(InputError, match=r"^generate: session_or_model= is the deprecated name of model"):
        generate(sess, PROMPT, 4, session_or_model=sess)


def test_temperature_without_do_sample_still_samples_in_generate(sess):
    want = generate(sess, PROMPT, 6, do_sample=True, temperature=0.7, seed=3, eos_token_id=[])
    with warns_deprecated(
        __file__,
        r"^generate: temperature=0.7 without do_sample=True samples for one more "
        r"release; pass do_sample=True",
    ):
        got = generate(sess, PROMPT, 6, temperature=0.7, seed=3, eos_token_id=[])
    np.testing.assert_array_equal(got.tokens, want.tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OnnxkvDeprecationWarning)
        greedy = generate(sess, PROMPT, 6, eos_token_id=[])
        np.testing.assert_array_equal(generate(sess, PROMPT, 6, temperature=0.0, eos_token_id=[]).tokens, greedy.tokens)
        # transformers' rule everywhere else: without do_sample, temperature, top_k and top_p change nothing
        np.testing.assert_array_equal(
            generate(sess, PROMPT, 6, top_k=3, top_p=0.5, eos_token_id=[]).tokens, greedy.tokens
        )
        spec = speculative_generate(sess, PROMPT, temperature=0.7, top_k=3, max_new_tokens=6, eos_token_id=[])
        np.testing.assert_array_equal(spec.sequences, greedy.sequences)


def test_cache_auto_is_none(sess):
    want = generate(sess, PROMPT, 4, eos_token_id=[])
    with warns_deprecated(__file__, r"^generate: cache='auto' is deprecated; leave cache=None"):
        got = generate(sess, PROMPT, 4, cache="auto", eos_token_id=[])
    np.testing.assert_array_equal(got.tokens, want.tokens)


GENERATE_LEGACY = [
    (dict(capacity=64), CacheConfig(capacity=64), r"capacity= is deprecated; pass cache=onnxkv.CacheConfig"),
    (
        dict(cache_dtype="float16"),
        CacheConfig(kv_format="fp16"),
        r"cache_dtype= is deprecated; .*cache_dtype= -> "
        r"kv_format='fp16'",
    ),
    (dict(cache="paged", block_size=4), CacheConfig("paged", block_size=4), r"block_size= is deprecated"),
    (
        dict(cache="paged", block_size=4, kv_format="int8"),
        CacheConfig("paged", block_size=4, kv_format="int8"),
        r"block_size=, kv_format= are deprecated",
    ),
]


@pytest.mark.parametrize("legacy,config,match", GENERATE_LEGACY, ids=[str(k) for k, _, _ in GENERATE_LEGACY])
def test_state_keywords_of_generate(sess, legacy, config, match):
    want = generate(sess, PROMPT, 12, eos_token_id=[], cache=config)
    with warns_deprecated(__file__, r"^generate: " + match):
        got = generate(sess, PROMPT, 12, eos_token_id=[], **legacy)
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_deprecated_keywords_are_checked(sess):
    with pytest.raises(InputError, match=r"^generate: capacity= cannot be combined with cache=CacheConfig"):
        generate(sess, PROMPT, 2, cache=CacheConfig(), capacity=8)
    with (
        pytest.warns(OnnxkvDeprecationWarning),
        pytest.raises(
            InputError,
            match=r"^generate: cache_dtype='float16' needs a state's cache, got cache kind "
            r"'tensor'",
        ),
    ):
        generate(sess, PROMPT, 2, cache="tensor", cache_dtype="float16")
    with pytest.raises(TypeError, match="unexpected keyword argument 'kv_fromat'"):
        generate(sess, PROMPT, 2, kv_fromat="int8")
    with pytest.raises(TypeError, match="unexpected keyword argument 'capacity'"):
        beam_search(sess, PROMPT, 2, 2, capacity=8)
    with pytest.raises(TypeError, match="unexpected keyword argument 'capacity'"):
        speculative_generate(sess, PROMPT, capacity=8)


def test_block_size_of_beam_search(sess):
    want = beam_search(sess, PROMPT, 3, 6, eos_token_id=[], cache=CacheConfig("paged", block_size=4))
    with warns_deprecated(__file__, r"^beam_search: block_size= is deprecated; pass cache=onnxkv.CacheConfig"):
        got = beam_search(sess, PROMPT, 3, 6, eos_token_id=[], cache="paged", block_size=4)
    np.testing.assert_array_equal(got.sequences, want.sequences)
    np.testing.assert_array_equal(got.committed_bytes, want.committed_bytes)


@pytest.mark.parametrize(
    "cache,options,config",
    [
        (None, {"capacity": 64}, CacheConfig(capacity=64)),
        ("paged", {"block_size": 4}, CacheConfig("paged", block_size=4)),
        ("contiguous", {}, CacheConfig()),
    ],
)
def test_state_options_of_speculative_generate(sess, cache, options, config):
    want = speculative_generate(sess, PROMPT, max_new_tokens=10, eos_token_id=[], cache=config)
    with warns_deprecated(
        __file__,
        r"^speculative_generate: state_options= is deprecated; pass "
        r"cache=onnxkv.CacheConfig",
    ):
        got = speculative_generate(sess, PROMPT, max_new_tokens=10, eos_token_id=[], cache=cache, state_options=options)
    np.testing.assert_array_equal(got.sequences, want.sequences)
    with pytest.raises(
        InputError,
        match=r"^speculative_generate: state_options= cannot be combined with "
        r"cache=CacheConfig",
    ):
        speculative_generate(sess, PROMPT, max_new_tokens=2, cache=config, state_options=options)
