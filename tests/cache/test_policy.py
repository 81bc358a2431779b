"""The built-in page-format policies of onnxkv.cache.policy and make_selector's checks."""

import numpy as np
import pytest

from onnxkv.cache.policy import POLICIES, ResidualPolicy, UniformPolicy, key_header, make_selector
from onnxkv.errors import InputError

K = np.random.default_rng(0).standard_normal((1, 2, 4, 8)).astype(np.float32)


@pytest.mark.parametrize(
    "name, formats, header, residual",
    [
        ("int8", ("int8", "int8"), "channel-zp", 0),  # keys: scale per head, zero point per channel
        ("int8-kivi", ("uint8", "int8"), "compact", 0),  # KIVI layout: keys per channel, values per head
        ("int8-head", ("int8", "int8"), "float32", 0),
        ("int4", ("int4", "int4"), "float32", 0),
        ("fp16", ("float16", "float16"), "float32", 0),
        ("residual-int8", ("int8", "int8"), "channel-zp", 128),
        ("residual-int4", ("int4", "int4"), "float32", 128),
    ],
)
def test_builtin_policy_formats(name, formats, header, residual):
    sel = make_selector(name)
    assert sel(3, 100, K, K) == formats
    assert sel.key_channel_scales is (header == "compact")
    assert sel.key_channel_zero_points is (header == "channel-zp")
    assert key_header(sel, "test") == header
    assert sel.residual_tokens == residual
    assert isinstance(sel, ResidualPolicy) == (residual > 0)


def test_native_policies_select_nothing():
    assert make_selector(None) is None
    assert make_selector("fp32") is None and make_selector("native") is None


def test_callable_selector_checked():
    def sel(layer, past, k, v):
        return "int8", None

    assert make_selector(sel) is sel
    sel.residual_tokens = -1
    with pytest.raises(InputError, match="residual_tokens must be a non-negative int, got -1"):
        make_selector(sel)
    sel.residual_tokens = 0
    sel.key_channel_scales = "yes"
    with pytest.raises(InputError, match="key_channel_scales must be a bool, got 'yes'"):
        make_selector(sel)
    sel.key_channel_scales = True
    sel.key_channel_zero_points = 1
    with pytest.raises(InputError, match="key_channel_zero_points must be a bool, got 1"):
        make_selector(sel)
    sel.key_channel_zero_points = True
    with pytest.raises(
        InputError, match="kv_format: key_channel_scales and key_channel_zero_points are mutually exclusive"
    ):
        make_selector(sel)
    sel.key_channel_scales = False
    assert make_selector(sel) is sel and key_header(sel, "x") == "channel-zp"


def test_policy_with_both_key_options_is_rejected():
    both = UniformPolicy("int8", "int8", key_channel_scales=True, key_channel_zero_points=True)
    with pytest.raises(
        InputError, match="kv_format: key_channel_scales and key_channel_zero_points are mutually exclusive"
    ):
        make_selector(both)


def test_key_header_ors_arguments_with_the_source():
    assert key_header(None, "api") == "float32"
    assert key_header(None, "api", key_channel_scales=True) == "compact"
    assert key_header(POLICIES["int8-head"], "api", key_channel_zero_points=True) == "channel-zp"
    with pytest.raises(InputError, match="new_state: key_channel_scales and key_channel_zero_points are mutually"):
        key_header(POLICIES["int8"], "new_state", key_channel_scales=True)
    with pytest.raises(InputError, match="api: key_channel_zero_points must be a bool, got 'no'"):
        key_header(None, "api", key_channel_zero_points="no")


def test_unknown_policy_names_the_choices():
    with pytest.raises(InputError, match=r"kv_format must be one of \[.*'int8-head'.*\] or a callable, got 'int3'"):
        make_selector("int3")
    with pytest.raises(InputError, match="kv_format must be None, a policy name or a callable, got 3"):
        make_selector(3)


def test_policies_are_uniform_policies():
    assert all(isinstance(p, UniformPolicy) for p in POLICIES.values())
