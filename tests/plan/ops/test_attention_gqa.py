"""com.microsoft::GroupQueryAttention against ONNX Runtime's CPU kernel."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from _attn_harness import build_op, make_model, run_op, run_ort

from onnxkv.errors import InputError, ModelError
from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._attention_math import causal_attention
from onnxkv.plan.ops.attention_gqa import GroupQueryAttention

pytest.importorskip("onnxruntime")

TOL = 1e-5
OPSETS = {"": 21, "com.microsoft": 1}


def _inputs(
    rng: np.random.Generator,
    b: int,
    s: int,
    hq: int,
    hkv: int,
    d: int,
    past: int | None,
    seqlens_k: list[int],
    total: int,
    rotary: bool = False,
    packed: bool = False,
    **extra: np.ndarray,
) -> dict[str, np.ndarray | None]:
    def f(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    q, k, v = f(b, s, hq * d), f(b, s, hkv * d), f(b, s, hkv * d)
    if packed:
        q, k, v = np.concatenate([q, k, v], axis=-1), None, None
    cos = sin = None
    if rotary:
        angles = rng.uniform(0, 2 * np.pi, (total + 8, d // 2)).astype(np.float32)
        cos, sin = np.cos(angles), np.sin(angles)
    ins = {
        "query": q,
        "key": k,
        "value": v,
        "past_key": None if past is None else f(b, hkv, past, d),
        "past_value": None if past is None else f(b, hkv, past, d),
        "seqlens_k": np.array(seqlens_k, np.int32),
        "total_sequence_length": np.array(total, np.int32),
        "cos_cache": cos,
        "sin_cache": sin,
        "position_ids": None,
        "attention_bias": None,
        "head_sink": None,
    }
    ins.update(extra)
    return ins


def _model(ins, hq: int, hkv: int, **attrs):
    return make_model(
        "GroupQueryAttention", ins, ["output", "present_key", "present_value"], OPSETS,
        domain="com.microsoft", num_heads=hq, kv_num_heads=hkv, **attrs,
    )  # fmt: skip


def _check_against_peers(ins, hq: int, hkv: int, **attrs):
    model = _model(ins, hq, hkv, **attrs)
    want = run_ort(model, ins)
    got, rt = run_op(GroupQueryAttention, model, ins)
    for w, g in zip(want, got):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0)
    return got, rt


CASES = [
    # id, (b, s, hq, hkv, d, past, seqlens_k, total), attrs, rotary
    ("prompt-mha-b1", (1, 7, 4, 4, 32, None, [6], 7), {}, False),
    ("prompt-gqa-b2-padded", (2, 6, 8, 2, 64, None, [5, 2], 6), {}, False),
    ("prompt-mqa-b2-empty-past", (2, 5, 4, 1, 80, 0, [4, 3], 5), {}, False),
    ("prompt-rotary", (2, 6, 4, 2, 32, None, [5, 3], 6), {"do_rotary": 1}, True),
    ("prompt-rotary-interleaved", (2, 6, 4, 2, 64, None, [5, 5], 6), {"do_rotary": 1, "rotary_interleaved": 1}, True),
    ("prompt-window-softcap", (1, 9, 4, 2, 32, None, [8], 9), {"local_window_size": 3, "softcap": 1.5}, False),
    ("decode-mha-b1", (1, 1, 4, 4, 32, 5, [5], 6), {}, False),
    ("decode-gqa-b2", (2, 1, 8, 2, 64, 9, [9, 4], 10), {"do_rotary": 1}, True),
    ("decode-mqa-b2-80", (2, 1, 4, 1, 80, 6, [2, 6], 7), {"do_rotary": 1, "rotary_interleaved": 1}, True),
    ("decode-window", (2, 1, 4, 2, 32, 9, [9, 5], 10), {"local_window_size": 4}, False),
    ("decode-softcap-scale", (2, 1, 4, 2, 32, 4, [4, 1], 5), {"softcap": 2.0, "scale": 0.3}, False),
    ("chunked-prefill", (1, 3, 4, 2, 32, 4, [6], 7), {"do_rotary": 1}, True),
    ("decode-capacity-past", (2, 1, 4, 2, 32, 12, [3, 7], 8), {}, False),
    ("prompt-capacity-past", (2, 5, 4, 2, 32, 12, [4, 2], 5), {"do_rotary": 1}, True),
]


@pytest.mark.parametrize("dims,attrs,rotary", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_ort(dims, attrs, rotary):
    rng = np.random.default_rng(zlib.crc32(repr(dims).encode()))
    b, s, hq, hkv, d, past, seqlens_k, total = dims
    ins = _inputs(rng, b, s, hq, hkv, d, past, seqlens_k, total, rotary=rotary)
    _check_against_peers(ins, hq, hkv, **attrs)


@pytest.mark.parametrize("rotary", [False, True])
def test_packed_qkv(rotary):
    rng = np.random.default_rng(3)
    ins = _inputs(rng, 2, 1, 4, 2, 32, 6, [6, 2], 7, rotary=rotary, packed=True)
    _check_against_peers(ins, 4, 2, do_rotary=int(rotary))


def test_position_ids():
    rng = np.random.default_rng(4)
    prompt = _inputs(rng, 2, 5, 4, 2, 32, None, [4, 2], 5, rotary=True,
                     position_ids=np.array([[3, 4, 5, 6, 7], [0, 1, 2, 0, 0]], np.int64))  # fmt: skip
    _check_against_peers(prompt, 4, 2, do_rotary=1)
    decode = _inputs(rng, 2, 1, 4, 2, 32, 6, [6, 3], 7, rotary=True,
                     position_ids=np.array([[11], [2]], np.int64))  # fmt: skip
    _check_against_peers(decode, 4, 2, do_rotary=1)


def test_attention_bias_and_head_sink():
    rng = np.random.default_rng(5)
    bias = (3 * rng.standard_normal((2, 4, 1, 7))).astype(np.float32)
    sink = rng.standard_normal(4).astype(np.float32)
    ins = _inputs(rng, 2, 1, 4, 2, 32, 6, [6, 3], 7, attention_bias=bias, head_sink=sink)
    _check_against_peers(ins, 4, 2, softcap=2.0, local_window_size=3)
    prompt = _inputs(rng, 1, 5, 4, 2, 32, None, [4], 5,
                     attention_bias=rng.standard_normal((1, 1, 5, 5)).astype(np.float32))  # fmt: skip
    _check_against_peers(prompt, 4, 2)


def test_smooth_softmax():
    rng = np.random.default_rng(6)
    ins = _inputs(rng, 2, 1, 4, 2, 32, 6, [6, 3], 7)
    _check_against_peers(ins, 4, 2, smooth_softmax=1)


def test_storage_counters():
    rng = np.random.default_rng(7)
    b, hkv, d, past = 2, 2, 32, 6
    ins = _inputs(rng, b, 1, 4, hkv, d, past, [6, 3], 7)
    got, rt = _check_against_peers(ins, 4, hkv)
    row = hkv * d * 4
    present = got[1].nbytes
    assert present == b * hkv * 7 * d * 4
    assert rt.counters == {
        "allocations": 2,
        "allocated_bytes": 2 * present,
        "prefix_copied_bytes": 2 * (6 + 3) * row,
        "append_copied_bytes": 2 * b * 1 * row,
    }
    prompt = _inputs(rng, b, 5, 4, hkv, d, None, [4, 2], 5)
    _, rt = _check_against_peers(prompt, 4, hkv)
    assert rt.counters["prefix_copied_bytes"] == 0
    assert rt.counters["append_copied_bytes"] == 2 * b * 5 * row


def test_errors_at_build():
    rng = np.random.default_rng(8)
    ins = _inputs(rng, 1, 1, 4, 2, 32, 3, [3], 4)
    with pytest.raises(ModelError, match="multiple of kv_num_heads=3"):
        build_op(GroupQueryAttention, _model(ins, 4, 3))
    with pytest.raises(ModelError, match="qk_output"):
        build_op(GroupQueryAttention, _model(ins, 4, 2, qk_output=1))
    with pytest.raises(ModelError, match="sliding_window_cache=1 needs a window"):
        build_op(GroupQueryAttention, _model(ins, 4, 2, sliding_window_cache=1))
    with pytest.raises(ModelError, match="causal=0"):
        build_op(GroupQueryAttention, _model(ins, 4, 2, causal=0))
    with pytest.raises(ModelError, match="quantized KV cache"):
        build_op(GroupQueryAttention, _model(ins, 4, 2, k_quant_type="PER_TENSOR"))
    quantized = dict(ins, k_scale=np.ones(1, np.float32))
    with pytest.raises(ModelError, match="input 'k_scale' is not supported"):
        build_op(GroupQueryAttention, _model(quantized, 4, 2))
    for window in (-2, 2**31, 2**62):
        with pytest.raises(ModelError, match=f"local_window_size must be .* got {window}"):
            build_op(GroupQueryAttention, _model(ins, 4, 2, local_window_size=window))


def test_errors_at_run():
    rng = np.random.default_rng(9)
    ins = _inputs(rng, 2, 1, 4, 2, 32, 3, [3, 5], 4)  # row 1 claims 6 tokens, past holds 3
    with pytest.raises(InputError, match=r"seqlens_k\[1\]=5 out of range"):
        run_op(GroupQueryAttention, _model(ins, 4, 2), ins)
    ins = _inputs(rng, 2, 1, 4, 2, 32, 3, [3, -1], 4)
    with pytest.raises(InputError, match=r"seqlens_k\[1\]=-1 out of range"):
        run_op(GroupQueryAttention, _model(ins, 4, 2), ins)
    ins = _inputs(rng, 1, 1, 4, 2, 32, 3, [3], 4)
    ins["query"] = ins["query"][0]
    with pytest.raises(InputError, match="query must be 3-D"):
        run_op(GroupQueryAttention, _model(ins, 4, 2), ins)
    ins = _inputs(rng, 1, 1, 4, 2, 32, 3, [3], 4)
    ins["past_key"] = ins["past_key"][0]
    with pytest.raises(InputError, match="past_key must be"):
        run_op(GroupQueryAttention, _model(ins, 4, 2), ins)
    ins = _inputs(rng, 2, 3, 4, 2, 32, 3, [5, 4], 6)
    with pytest.raises(InputError, match=r"batch_size must be 1, or every row's seqlens_k equal.*\[5, 4\]"):
        run_op(GroupQueryAttention, _model(ins, 4, 2), ins)


@pytest.mark.parametrize("rotary", [False, True])
def test_rows_of_one_length_continue_their_pasts_with_several_tokens_each(rotary):
    """Batch 2, 3 new tokens after a past of 3 in each row (ONNX Runtime takes batch 1 only here): each row's
    outputs are those of the row run alone."""
    rng = np.random.default_rng(11)
    ins = _inputs(rng, 2, 3, 4, 2, 32, 3, [5, 5], 6, rotary=rotary)
    model = _model(ins, 4, 2, do_rotary=int(rotary))
    got, _ = run_op(GroupQueryAttention, model, ins)
    for row in (0, 1):
        alone = {n: (a if a is None or n in ("total_sequence_length", "cos_cache", "sin_cache") else a[row : row + 1])
                 for n, a in ins.items()}  # fmt: skip
        want, _ = run_op(GroupQueryAttention, model, alone)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g[row : row + 1], w)


def test_float16_rotary_decode():
    rng = np.random.default_rng(10)
    ins = _inputs(rng, 2, 1, 4, 2, 32, 5, [5, 2], 6, rotary=True)
    ins = {n: a.astype(np.float16) if a is not None and a.dtype == np.float32 else a for n, a in ins.items()}
    model = _model(ins, 4, 2, do_rotary=1)
    got, _ = run_op(GroupQueryAttention, model, ins)
    for w, g in zip(run_ort(model, ins), got):
        assert g.dtype == w.dtype == np.float16
        np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), atol=2e-3, rtol=0)  # ~1 ulp


def test_numpy_path_matches_streaming_kernel():
    """The NumPy fallback of causal_attention (non-float32) agrees with the compiled kernel."""
    rng = np.random.default_rng(11)
    b, hq, hkv, sq, cap, d = 2, 4, 2, 3, 9, 32
    q = rng.standard_normal((b, hq, sq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, cap, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, cap, d)).astype(np.float32)
    kv_len = np.array([9, 4], np.int32)
    q_pos = np.array([[6, 7, 8], [1, 2, 3]], np.int32)
    for window, softcap in ((-1, 0.0), (2, 1.5)):
        fast = causal_attention(q, k, v, kv_len, q_pos, 0.2, softcap, window, np.empty_like(q))
        slow = np.empty(q.shape, np.float64)
        causal_attention(*(t.astype(np.float64) for t in (q, k, v)), kv_len, q_pos, 0.2, softcap, window, slow)
        np.testing.assert_allclose(fast, slow, atol=TOL, rtol=0)


def test_output_only_counts_nothing():
    """Without present outputs the result is the same; ORT's CPU kernel then skips the past (not a reference)."""
    rng = np.random.default_rng(12)
    ins = _inputs(rng, 2, 1, 4, 2, 32, 5, [5, 2], 6)
    model = make_model(
        "GroupQueryAttention", ins, ["output"], OPSETS, domain="com.microsoft", num_heads=4, kv_num_heads=2
    )
    got, rt = run_op(GroupQueryAttention, model, ins)
    assert len(got) == 1 and rt.counters == {}
    np.testing.assert_allclose(got[0], run_ort(_model(ins, 4, 2), ins)[0], atol=TOL, rtol=0)


# -- integer inputs: checked in their own width, before any conversion or allocation ------------------------------


def _run_bounded(model, ins, limit=1 << 20):
    """Run the node with a run context whose output allocations fail the test above ``limit`` bytes: no
    output may be sized by an unchecked length."""

    def empty(rt, index, shape, dtype):
        assert int(np.prod(shape)) * dtype.itemsize <= limit, f"output {index} of shape {shape} allocated"
        return np.empty(shape, dtype)

    args = list(ins.values())[: len(model.graph.node[0].input)]
    return build_op(GroupQueryAttention, model).run(args, RunContext(empty, recording=False, step=0))


@pytest.mark.parametrize(
    "name, value, match",
    [
        (
            "seqlens_k",
            np.array([3, 2**32 + 4], np.int64),
            r"seqlens_k\[1\] = 4294967300 is outside the int32 range \[-2147483648, 2147483647\]",
        ),
        ("seqlens_k", np.array([3, 2**64 - 1], np.uint64), r"seqlens_k\[1\] = 18446744073709551615 is outside"),
        ("seqlens_k", np.array([3.0, 2.0], np.float32), "seqlens_k must be int32, got float32"),
        (
            "total_sequence_length",
            np.array(2**63 - 1, np.int64),
            r"total_sequence_length\[0\] = 9223372036854775807 is outside the int32 range",
        ),
        ("total_sequence_length", np.array(4.0), "total_sequence_length must be int32, got float64"),
        (
            "total_sequence_length",
            np.array(2**31 - 1, np.int32),
            r"total_sequence_length must be in \[1, 4\] \(past length 3 \+ 1 new tokens\), got 2147483647",
        ),
    ],
    ids=["seqlens-int64", "seqlens-uint64", "seqlens-float", "total-int64", "total-float", "total-past-the-cache"],
)
def test_integer_inputs_are_checked_in_their_own_width_before_any_allocation(name, value, match):
    ins = _inputs(np.random.default_rng(10), 2, 1, 4, 2, 32, 3, [3, 2], 4)
    ins[name] = value
    with pytest.raises(InputError, match=match):
        _run_bounded(_model(ins, 4, 2), ins)


@pytest.mark.parametrize(
    "position_ids, s, match",
    [
        (
            np.array([[2**64 - 1], [2]], np.uint64),
            1,
            r"position ids must lie in \[0, 12\) \(cos_cache rows\), got 18446744073709551615 at \[0, 0\]",
        ),
        (
            np.array([[2**63 - 1] * 3, [0, 1, 2]], np.int64),
            3,
            r"lie in \[0, 11\) \(cos_cache rows\), got a start of 9223372036854775807 for 3 tokens "
            r"\(valid starts: \[0, 8\]\)",
        ),
        (np.array([[1.0], [2.0]], np.float32), 1, "position ids must be integers, got float32"),
    ],
    ids=["uint64", "int64-max-start", "float"],
)
def test_position_ids_are_checked_in_their_own_width(position_ids, s, match):
    rng = np.random.default_rng(11)
    past, seqlens, total = (3, [3, 2], 4) if s == 1 else (None, [2, 2], 3)
    ins = _inputs(rng, 2, s, 4, 2, 32, past, seqlens, total, rotary=True, position_ids=position_ids)
    ins["cos_cache"], ins["sin_cache"] = ins["cos_cache"][:12], ins["sin_cache"][:12]
    with pytest.raises(InputError, match=match):
        _run_bounded(_model(ins, 4, 2, do_rotary=1), ins)
