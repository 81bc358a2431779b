"""Decode steps of a state check their kernel arguments at C speed.

The Python argument checks of onnxkv._kernels (module _validate) are the slow
path taken only by arguments the compiled checks refuse; a decode step with
valid arguments must never reach them (counted).  Results are compared with
the float32 contiguous state.
"""

from __future__ import annotations

import collections
import sys

import numpy as np
import pytest

import onnxkv
from onnxkv import CacheConfig
from onnxkv._kernels import _validate as V
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.zoo.builders import MICRO, build_model

ATTENTION = sys.modules["onnxkv._kernels.attention"]


class _Counting:
    """Stands in for the _validate module: forwards every attribute, counting calls by function name."""

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()

    def __getattr__(self, name):
        value = getattr(V, name)
        if not callable(value) or isinstance(value, type):
            return value

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return value(*args, **kwargs)

        return counted


@pytest.fixture
def counting(monkeypatch):
    """Counter of the _validate calls of every compiled kernel module while the test runs."""
    proxy = _Counting()
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("onnxkv._kernels.") and getattr(mod, "V", None) is V:
            monkeypatch.setattr(mod, "V", proxy)
    return proxy


@pytest.fixture(scope="module", params=["gqa", "attention", "concat"])
def session(request):
    return onnxkv.Session(build_model(request.param, MICRO, seed=31), threads=2)


def _decode(session, state, counter, steps=4):
    """Prefill 13 tokens, then ``steps`` decode steps; returns (the last-token logits of each step, the
    _validate calls counted during the decode steps)."""
    prompt = np.random.default_rng(5).integers(0, MICRO.vocab_size, (1, 13))
    b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([13]), 0, thread_cache=False)
    feeds, _ = b.first()
    out = state.run(feeds, ["logits"])
    counter.calls.clear()
    got = []
    for i in range(steps):
        out = state.run(b.next(np.array([(11 * i + 2) % MICRO.vocab_size]), out), ["logits"])
        got.append(out["logits"][0, -1].copy())
    return np.array(got), dict(counter.calls)


def test_contiguous_decode_never_reaches_python_checks(session, counting):
    with session.new_state() as st:
        got, calls = _decode(session, st, counting)
    assert calls == {}
    assert np.isfinite(got).all() and got.std() > 0


def test_float16_cache_decode_never_reaches_python_checks(counting):
    session = onnxkv.Session(build_model("gqa", MICRO, seed=31), threads=2)
    with session.new_state() as ref:
        want, _ = _decode(session, ref, counting)
    with session.new_state(cache=CacheConfig(kv_format="fp16")) as st:
        got, calls = _decode(session, st, counting)
    assert calls == {}
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)


def test_paged_decode_attention_never_reaches_python_checks(session, counting, monkeypatch):
    """The paged attention kernel checks its arguments (every table entry it reads
    included) in C; other kernels of a paged step (page writes) are not counted here."""
    attention_calls = _Counting()
    monkeypatch.setattr(ATTENTION, "V", attention_calls)
    with session.new_state() as ref:
        want, _ = _decode(session, ref, counting)
    with session.new_state(cache=CacheConfig("paged", block_size=4)) as st:
        got, _ = _decode(session, st, counting)
    assert dict(attention_calls.calls) == {}
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_counter_sees_python_checks(counting):
    """The counter is live: arguments the C checks refuse (an int eps) are counted."""
    import onnxkv._kernels as K

    x = np.random.default_rng(6).standard_normal((2, 8)).astype(np.float32)
    out = np.empty_like(x)
    K.rms_norm(x, np.ones(8, np.float32), 1, out)
    assert counting.calls["array"] >= 1
