"""GroupQueryAttention with window-sized caches (sliding_window_cache=1) against ONNX Runtime's CPU kernel."""

from __future__ import annotations

import numpy as np
import pytest
from _attn_harness import build_op, make_model, run_op, run_ort

from onnxkv.errors import InputError, ModelError
from onnxkv.plan.ops._gqa_window import window_end
from onnxkv.plan.ops.attention_gqa import GroupQueryAttention

pytest.importorskip("onnxruntime")

OPSETS = {"": 21, "com.microsoft": 1}
HQ, HKV, D = 4, 2, 16


def _inputs(rng, s: int, past: int, buffers, rotary: bool, batch: int = 1) -> dict:
    def f(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    cos = sin = None
    if rotary:
        angles = rng.uniform(0, 2 * np.pi, (64, D // 2)).astype(np.float32)
        cos, sin = np.cos(angles), np.sin(angles)
    return {
        "query": f(batch, s, HQ * D),
        "key": f(batch, s, HKV * D),
        "value": f(batch, s, HKV * D),
        "past_key": buffers[0],
        "past_value": buffers[1],
        "seqlens_k": np.full(batch, past + s - 1, np.int32),
        "total_sequence_length": np.array(past + s, np.int32),
        "cos_cache": cos,
        "sin_cache": sin,
        "position_ids": None,
        "attention_bias": None,
        "head_sink": None,
    }


def _model(ins, window: int, **attrs):
    return make_model(
        "GroupQueryAttention",
        ins,
        ["output", "present_key", "present_value"],
        OPSETS,
        domain="com.microsoft",
        num_heads=HQ,
        kv_num_heads=HKV,
        local_window_size=window,
        sliding_window_cache=1,
        **attrs,
    )


@pytest.mark.parametrize(
    "window,capacity,steps,rotary",
    [
        (4, 6, [5, 1, 1, 1, 3, 1, 1, 1], False),  # prompt inside the buffer, decode steps that compact
        (4, 4, [2, 1, 1, 1, 1, 1, 1], True),  # capacity == window: every step past it compacts
        (3, 8, [11, 1, 2, 1, 1, 4, 1], True),  # prompt longer than the buffer (staged), chunks
    ],
)
def test_steps_match_ort(window, capacity, steps, rotary):
    rng = np.random.default_rng(window * 100 + capacity)
    buffers = (np.zeros((1, HKV, capacity, D), np.float32),) * 2
    past = 0
    for s in steps:
        ins = _inputs(rng, s, past, buffers, rotary)
        model = _model(ins, window, do_rotary=int(rotary))
        want = run_ort(model, ins)
        got, _ = run_op(GroupQueryAttention, model, ins)
        np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=0)
        resident = int(window_end(np.array(past + s), capacity, window))
        for g, w in zip(got[1:], want[1:]):  # ORT leaves rows past the resident ones unspecified
            assert g.shape == w.shape == (1, HKV, capacity, D)
            np.testing.assert_allclose(g[:, :, :resident], w[:, :, :resident], atol=1e-6, rtol=0)
            assert not g[:, :, resident:].any()
        buffers, past = tuple(got[1:]), past + s


def test_batch_rows_of_different_lengths_match_ort():
    rng = np.random.default_rng(7)
    capacity, window = 6, 4
    buffers = tuple(rng.standard_normal((2, HKV, capacity, D)).astype(np.float32) for _ in range(2))
    ins = _inputs(rng, 1, 0, buffers, True, batch=2)
    ins["seqlens_k"] = np.array([5, 9], np.int32)  # absolute totals 6 (buffer full) and 10 (compacted)
    ins["total_sequence_length"] = np.array(10, np.int32)
    model = _model(ins, window, do_rotary=1)
    want = run_ort(model, ins)
    got, _ = run_op(GroupQueryAttention, model, ins)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=0)


def test_window_end_reclaims_whole_gaps():
    past = np.arange(0, 20)
    end = window_end(past, 6, 4)  # gap 3
    assert end[:7].tolist() == list(range(7))
    assert end[7:].tolist() == [4, 5, 6, 4, 5, 6, 4, 5, 6, 4, 5, 6, 4]
    assert (window_end(past, 4, 4)[4:] == 4).all()  # capacity == window: always full


def test_errors():
    rng = np.random.default_rng(1)
    small = (np.zeros((1, HKV, 3, D), np.float32),) * 2
    ins = _inputs(rng, 1, 0, small, False)
    with pytest.raises(InputError, match=r"at least local_window_size=4 positions, got 3"):
        run_op(GroupQueryAttention, _model(ins, 4), ins)
    buffers = (np.zeros((1, HKV, 6, D), np.float32),) * 2
    ins = _inputs(rng, 3, 0, buffers, False)
    ins["seqlens_k"] = np.array([1], np.int32)  # fewer than the 3 new tokens
    with pytest.raises(InputError, match=r"seqlens_k\[0\]=1 out of range"):
        run_op(GroupQueryAttention, _model(ins, 4), ins)
    with pytest.raises(ModelError, match="sliding_window_cache=1 needs a window"):
        build_op(GroupQueryAttention, _model(ins, -1))
    ins["attention_bias"] = np.zeros((1, 1, 3, 3), np.float32)
    with pytest.raises(ModelError, match="attention_bias is not supported with sliding_window_cache=1"):
        build_op(GroupQueryAttention, _model(ins, 4))
