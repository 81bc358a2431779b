"""CacheConfig: every field checked on construction, and its translation into State's keywords."""

from __future__ import annotations

import dataclasses

import pytest

import onnxkv
from onnxkv import CacheConfig, InputError, KeyLayout
from onnxkv.cache.policy import POLICIES, UniformPolicy
from onnxkv.runtime.cache_config import cache_request, state_keywords


def test_defaults_and_kinds():
    assert CacheConfig() == CacheConfig("contiguous")
    for kind in ("contiguous", "paged", "tensor"):
        assert CacheConfig(kind).kind == kind
    assert CacheConfig("paged", key_layout="channel", kv_format="int4").key_layout is KeyLayout.CHANNEL
    with pytest.raises(dataclasses.FrozenInstanceError):
        CacheConfig().kind = "paged"
    assert onnxkv.runtime.CacheConfig is CacheConfig


BAD = [
    (dict(kind="ring"), r"kind must be 'contiguous', 'paged' or 'tensor', got 'ring'"),
    (dict(kind=None), r"kind must be .* got None"),
    (dict(kind="paged", block_size=0), r"block_size must be an int ≥ 1 or None, got 0"),
    (dict(kind="paged", block_size=True), r"block_size must be an int ≥ 1 or None, got True"),
    (dict(kind="paged", max_pages=2.0), r"max_pages must be an int ≥ 1 or None, got 2.0"),
    (dict(capacity=-3), r"capacity must be an int ≥ 1 or None, got -3"),
    (dict(initial_capacity="8"), r"initial_capacity must be an int ≥ 1 or None, got '8'"),
    (dict(block_size=4), r"block_size=4 needs kind='paged', got kind='contiguous'"),
    (dict(kind="tensor", max_pages=4), r"max_pages=4 needs kind='paged', got kind='tensor'"),
    (dict(kind="paged", initial_capacity=8), r"initial_capacity=8 needs kind='contiguous' \(a paged cache grows"),
    (dict(kind="tensor", capacity=8), r"capacity=8 needs a state's cache \(kind='contiguous' or 'paged'\)"),
    (dict(kind="tensor", kv_format="fp16"), r"kv_format='fp16' needs a state's cache"),
    (
        dict(kv_format="int8"),
        r"kv_format='int8' \(page formats\) needs kind='paged', got kind='contiguous'; a "
        r"contiguous cache takes None, 'fp32', 'fp16' or 'bf16'",
    ),
    (
        dict(kind="paged", kv_format="float16"),
        r"kv_format must be None, one of 'fp32', 'fp16', 'bf16', 'int4', .* "
        r"or a FormatSelector callable, got 'float16'",
    ),
    (dict(kind="paged", kv_format=8), r"kv_format must be None, .* got 8"),
    (
        dict(kind="paged", kv_format="int8", key_layout="rows"),
        r"key_layout must be a KeyLayout \('head', "
        r"'channel', 'channel-zp'\) or None, got 'rows'",
    ),
    (
        dict(kind="paged", key_layout=KeyLayout.HEAD),
        r"key_layout='head' needs quantized key pages .* got "
        r"kv_format=None",
    ),
    (dict(kind="paged", kv_format="bf16", key_layout="channel"), r"key_layout='channel' needs quantized key pages"),
    (
        dict(kind="paged", kv_format=POLICIES["int8"], key_layout=KeyLayout.CHANNEL),
        r"key_layout='channel' conflicts with the kv_format selector's own layout 'channel-zp'",
    ),
]


@pytest.mark.parametrize("kwargs,match", BAD, ids=[str(k) for k, _ in BAD])
def test_bad_fields_raise_naming_the_field_value_and_expectation(kwargs, match):
    with pytest.raises(InputError, match=r"^CacheConfig: " + match):
        CacheConfig(**kwargs)


def test_replace_checks_again():
    with pytest.raises(InputError, match="block_size=4 needs kind='paged'"):
        dataclasses.replace(CacheConfig("paged", block_size=4), kind="contiguous")


def test_state_keywords_of_each_kind_and_format():
    assert state_keywords(CacheConfig()) == {"cache": "contiguous", "capacity": None, "initial_capacity": 32}
    assert state_keywords(CacheConfig(initial_capacity=8), 100)["initial_capacity"] == 8
    assert state_keywords(CacheConfig(), 100)["initial_capacity"] == 100
    assert state_keywords(CacheConfig("paged", capacity=64)) == {
        "cache": "paged",
        "capacity": 64,
        "initial_capacity": 32,
        "block_size": 16,
        "max_pages": None,
    }
    assert state_keywords(CacheConfig("paged", block_size=4, max_pages=9))["max_pages"] == 9
    for name, dtype in (("fp32", "float32"), ("fp16", "float16"), ("bf16", "bfloat16")):
        for kind in ("contiguous", "paged"):
            kw = state_keywords(CacheConfig(kind, kv_format=name))
            assert kw["cache_dtype"] == dtype and "kv_format" not in kw
    assert state_keywords(CacheConfig("paged", kv_format="int8"))["kv_format"] == "int8"
    with pytest.raises(InputError, match="kind='tensor' has no state"):
        state_keywords(CacheConfig("tensor"))


def test_key_layout_replaces_a_named_policy_layout():
    kw = state_keywords(CacheConfig("paged", kv_format="int8", key_layout=KeyLayout.HEAD))
    assert kw["kv_format"] == UniformPolicy("int8", "int8")
    kw = state_keywords(CacheConfig("paged", kv_format="residual-int4", key_layout="channel"))
    assert kw["kv_format"] == dataclasses.replace(POLICIES["residual-int4"], key_channel_scales=True)
    assert "key_channel_scales" not in kw
    kw = state_keywords(CacheConfig("paged", kv_format="int8", key_layout="channel-zp"))
    assert kw["kv_format"] == POLICIES["int8"]


def test_key_layout_of_a_selector_travels_as_state_keywords():
    def selector(layer, past_length, k, v):
        return "int8", None

    kw = state_keywords(CacheConfig("paged", kv_format=selector, key_layout=KeyLayout.CHANNEL_ZERO_POINT))
    assert kw["kv_format"] is selector
    assert (kw["key_channel_scales"], kw["key_channel_zero_points"]) == (False, True)
    assert "key_channel_scales" not in state_keywords(CacheConfig("paged", kv_format=selector))


def test_cache_request_reads_kinds_configs_and_none():
    assert cache_request("api", None, ("paged",)).config is None
    assert cache_request("api", None, ("paged",)).kind("tensor") == "tensor"
    assert cache_request("api", "paged", ("paged",)).config == CacheConfig("paged")
    config = CacheConfig("paged", block_size=4)
    assert cache_request("api", config, ("paged",)).config is config
    with pytest.raises(InputError, match=r"^api: cache must be a CacheConfig, one of 'paged' or None, got 3"):
        cache_request("api", 3, ("paged",))
    with pytest.raises(InputError, match=r"^api: capacity= cannot be combined with cache=CacheConfig"):
        cache_request("api", config, ("paged",), {"capacity": 4})
