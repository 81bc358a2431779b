"""The built-in page-format policies of onnxkv.cache.policy and make_selector's checks."""
import numpy as np
import pytest

from onnxkv.cache.policy import POLICIES, ResidualPolicy, UniformPolicy, make_selector
from onnxkv.errors import InputError

K = np.random.default_rng(0).standard_normal((1, 2, 4, 8)).astype(np.float32)


@pytest.mark.parametrize("name, formats, channel, residual", [
    ("int8", ("uint8", "int8"), True, 0),          # KIVI layout: keys per channel, values per head
    ("int8-kivi", ("uint8", "int8"), True, 0),
    ("int8-head", ("int8", "int8"), False, 0),
    ("int4", ("int4", "int4"), False, 0),
    ("fp16", ("float16", "float16"), False, 0),
    ("residual-int8", ("uint8", "int8"), True, 128),
    ("residual-int4", ("int4", "int4"), False, 128),
])
def test_builtin_policy_formats(name, formats, channel, residual):
    sel = make_selector(name)
    assert sel(3, 100, K, K) == formats
    assert sel.key_channel_scales is channel
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


def test_unknown_policy_names_the_choices():
    with pytest.raises(InputError, match=r"kv_format must be one of \[.*'int8-head'.*\] or a callable, got 'int3'"):
        make_selector("int3")
    with pytest.raises(InputError, match="kv_format must be None, a policy name or a callable, got 3"):
        make_selector(3)


def test_policies_are_uniform_policies():
    assert all(isinstance(p, UniformPolicy) for p in POLICIES.values())
