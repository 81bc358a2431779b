"""ONNX Attention with a mask of row ranges runs on the streaming kernel (kv_start / q_pos), not NumPy.

``attn_mask_ranges`` describes bool and 0 / -inf (or <= -1e30) float masks
whose visible keys are one range per query, starting at one key per batch
row; the operator then takes the kernel and agrees with onnx.reference (and
ONNX Runtime).  Other masks -- a hole, a per-head mask, another bias, a query
that sees nothing under finite masking -- take the dense NumPy path.

Attention-25's ``left_window_size`` / ``right_window_size`` narrow each
query's range further: the kernel's single ``window`` expresses them when
every query's first key is the same distance before its last one (sliding
causal windows, with or without a past, padding or a range mask).
"""

from __future__ import annotations

import numpy as np
import pytest
from _attn_harness import build_op, make_model, run_op, run_ort, run_reference

import onnxkv.plan.ops.attention_onnx as attention_onnx
from onnxkv.errors import ModelError
from onnxkv.plan.ops.attention_onnx import Attention23, Attention25, attn_mask_ranges

FMIN = np.finfo(np.float32).min


def _padded_causal(b, sq, t, pads, dtype=bool):
    """[b, 1, sq, t] mask: row i sees keys pads[i] <= key <= t - sq + query (left padding + causal band)."""
    key = np.arange(t)[None, None, None, :]
    query = np.arange(sq)[None, None, :, None]
    visible = (key >= np.asarray(pads)[:, None, None, None]) & (key <= t - sq + query)
    if dtype is bool:
        return visible
    return np.where(visible, 0.0, dtype).astype(np.float32)


@pytest.fixture
def dense_calls(monkeypatch):
    calls = []
    real = attention_onnx.dense_attention
    monkeypatch.setattr(attention_onnx, "dense_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _run(mask, b=2, hq=4, hkv=2, sq=3, skv=3, past=5, d=32, seed=0, ort=True, **attrs):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    ins = {
        "Q": f(b, hq, sq, d),
        "K": f(b, hkv, skv, d),
        "V": f(b, hkv, skv, d),
        "attn_mask": mask,
        "past_key": f(b, hkv, past, d),
        "past_value": f(b, hkv, past, d),
    }
    model = make_model("Attention", ins, ["Y", "present_key", "present_value"], {"": 23}, **attrs)
    got, _ = run_op(Attention23, model, ins)
    peers = [run_reference(model, ins)] + ([run_ort(model, ins)] if ort else [])
    for want in peers:
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    return got[0]


@pytest.mark.parametrize("dtype", [bool, -np.inf, FMIN])
def test_padding_and_causal_band_take_the_kernel(dtype, dense_calls):
    _run(_padded_causal(2, 3, 8, [0, 4], dtype))
    assert dense_calls == []


def test_bool_mask_with_a_query_that_sees_nothing_gives_zeros_on_the_kernel(dense_calls):
    mask = _padded_causal(2, 3, 8, [0, 7])  # row 1: queries 0 and 1 see no key
    y = _run(mask, ort=False)
    assert dense_calls == [] and (y[1, :, :2] == 0).all() and np.isfinite(y).all()


def test_short_mask_and_is_causal_combine_on_the_kernel(dense_calls):
    mask = np.ones((1, 1, 3, 6), bool)  # the last two keys are masked (missing columns)
    _run(mask, is_causal=1, ort=False)
    assert dense_calls == []


@pytest.mark.parametrize("case", ["hole", "per-head", "bias", "finite-empty", "starts-differ"])
def test_other_masks_take_the_dense_path(case, dense_calls):
    mask = _padded_causal(2, 3, 8, [0, 2], np.float32(FMIN))
    if case == "hole":
        mask[0, 0, :, 1] = FMIN
    elif case == "per-head":
        mask = np.repeat(mask, 4, axis=1)
    elif case == "bias":
        mask[mask == 0] = 0.5
    elif case == "finite-empty":
        mask[1, 0, 0, :] = FMIN  # a query that sees nothing under a finite mask: uniform weights, not zeros
    elif case == "starts-differ":
        mask[0, 0, 2, 0] = FMIN  # query 2 of row 0 starts at key 1, the others at 0
    _run(mask, ort=case not in ("finite-empty",))
    assert dense_calls == [1]


def test_attn_mask_ranges_describe_exactly_the_visible_keys():
    rng = np.random.default_rng(3)
    for _ in range(50):
        b, s, t = rng.integers(1, 4), rng.integers(1, 5), rng.integers(1, 9)
        pads = rng.integers(0, t + 1, b)
        mask = _padded_causal(b, s, t, pads)
        mt = int(rng.integers(1, t + 1))
        kv_start, q_pos, exact = attn_mask_ranges(mask[..., :mt], b, s, t)
        assert exact
        visible = np.zeros((b, 1, s, t), bool)
        visible[..., :mt] = mask[..., :mt]
        key = np.arange(t)
        got = (key >= kv_start[:, None, None, None]) & (key <= q_pos[:, None, :, None])
        np.testing.assert_array_equal(got, visible)
    assert attn_mask_ranges(np.zeros((1, 1, 1, 3), np.float64), 1, 1, 3)[2]
    assert not attn_mask_ranges(np.array([FMIN, 0, 0], np.float32), 1, 1, 3)[2]
    assert attn_mask_ranges(np.zeros((1, 1, 1, 4), np.float32), 1, 1, 3) is None  # longer than the keys
    assert attn_mask_ranges(np.zeros((1, 1, 1, 3), np.int64), 1, 1, 3) is None


def _run_window(rng, b=2, hq=4, hkv=2, sq=5, skv=5, past=0, nonpad=None, mask=None, d=16, **attrs):
    """Attention-25 on random inputs against onnx.reference; returns Y."""
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    ins = {
        "Q": f(b, hq, sq, d),
        "K": f(b, hkv, skv, d),
        "V": f(b, hkv, skv, d),
        "attn_mask": mask,
        "past_key": f(b, hkv, past, d) if past else None,
        "past_value": f(b, hkv, past, d) if past else None,
        "nonpad_kv_seqlen": None if nonpad is None else np.asarray(nonpad, np.int64),
    }
    outputs = ["Y", "present_key", "present_value"] if past else ["Y"]
    model = make_model("Attention", ins, outputs, {"": 25}, **attrs)
    got, _ = run_op(Attention25, model, ins)
    for g, w in zip(got, run_reference(model, ins)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    return got[0]


@pytest.mark.parametrize(
    "attrs,kw",
    [
        ({"is_causal": 1, "left_window_size": 2}, {}),
        ({"is_causal": 1, "left_window_size": 0}, {}),
        ({"is_causal": 1, "left_window_size": 3}, {"sq": 2, "skv": 2, "past": 6}),
        ({"is_causal": 1, "left_window_size": 3}, {"sq": 1, "skv": 1, "past": 9}),
        ({"is_causal": 1, "left_window_size": 3, "right_window_size": 1}, {"sq": 3, "skv": 3, "past": 4}),
        ({"left_window_size": 1, "right_window_size": 2}, {}),
        ({"left_window_size": 2, "right_window_size": 40}, {"sq": 3, "skv": 3, "past": 4}),
        ({"right_window_size": 0}, {}),
        ({"is_causal": 1, "left_window_size": 2}, {"sq": 3, "skv": 8, "nonpad": [7, 2]}),
        ({"is_causal": 1, "left_window_size": 2, "softcap": 2.0}, {"mask": _padded_causal(2, 5, 5, [0, 2])}),
    ],
    ids=[
        "causal",
        "self-only",
        "past",
        "decode",
        "causal-right",
        "both-sides",
        "right-beyond-keys",
        "right-only",
        "nonpad",
        "mask-ranges",
    ],
)
def test_windows_take_the_kernel_and_agree_with_onnx_reference(attrs, kw, dense_calls):
    _run_window(np.random.default_rng(20), **kw, **attrs)
    assert dense_calls == []


def test_window_with_a_bias_mask_takes_the_dense_path(dense_calls):
    rng = np.random.default_rng(30)
    _run_window(rng, mask=rng.standard_normal((5, 5)).astype(np.float32), is_causal=1, left_window_size=1)
    assert dense_calls == [1]


def test_window_hiding_every_key_of_a_query_gives_zeros():
    y = _run_window(np.random.default_rng(31), sq=3, skv=8, nonpad=[8, 1], is_causal=1, left_window_size=0)
    assert (y[1, :, :2] == 0).all() and np.isfinite(y).all()  # row 1: offset -2, queries 0 and 1 see no key


def test_kernel_ranges_describe_exactly_the_keys_the_bias_leaves_visible():
    """Whenever the kernel takes a call, its (kv_start, q_pos, window) see exactly the keys of the dense bias."""
    rng = np.random.default_rng(32)
    taken = 0
    for trial in range(400):
        b, sq, total = int(rng.integers(1, 4)), int(rng.integers(1, 6)), int(rng.integers(1, 10))
        attrs = {
            "is_causal": int(rng.integers(0, 2)),
            "left_window_size": int(rng.integers(-1, total + 2)),
            "right_window_size": int(rng.integers(-1, total + 2)),
        }
        op = build_op(Attention25, make_model("Attention", {"Q": np.zeros(1)}, ["Y"], {"": 25}, **attrs))
        nonpad = rng.integers(0, total + 1, b).astype(np.int64) if trial % 3 == 0 else None
        offsets = nonpad - sq if nonpad is not None else np.full(b, int(rng.integers(0, total + 1)), np.int64)
        kv_len = nonpad if nonpad is not None else np.full(b, total, np.int64)
        mask = _padded_causal(b, sq, total, rng.integers(0, total + 1, b)) if trial % 2 else None
        seen = op._kernel_ranges(mask, b, sq, total, offsets, kv_len)
        if mask is None and attrs["left_window_size"] < 0:
            assert seen is not None, attrs  # no mask, no left window: always the kernel
        if seen is None:
            continue
        taken += 1
        kv_start, q_pos, window = seen
        start = np.zeros(b, np.int64) if kv_start is None else kv_start
        key = np.arange(total)[None, None, :]
        got = (key >= start[:, None, None]) & (key <= q_pos[:, :, None]) & (key < kv_len[:, None, None])
        if window >= 0:
            got &= key >= q_pos[:, :, None] - window
        bias = op._bias(mask, b, 1, sq, total, offsets, nonpad, np.dtype(np.float32))
        np.testing.assert_array_equal(
            got, np.isfinite(np.broadcast_to(bias, (b, 1, sq, total))[:, 0]), err_msg=str((attrs, nonpad, offsets))
        )
    assert taken > 200


@pytest.mark.parametrize("name", ["left_window_size", "right_window_size"])
def test_window_below_minus_one_is_a_model_error_naming_the_attribute(name):
    model = make_model("Attention", {"Q": np.zeros(1)}, ["Y"], {"": 25}, **{name: -2})
    with pytest.raises(
        ModelError,
        match=rf"Attention node 'n0': attribute {name} must be -1 \(unbounded\) or "
        r">= 0, got -2",
    ):
        build_op(Attention25, model)
