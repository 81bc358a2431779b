"""NaN in a query propagates through the attention operators' kernel paths, as through the dense softmax.

Queries holding NaN used to come out as zeros on the streaming kernel (its
running max dropped NaN); the operators now give NaN for exactly the query
heads whose scores hold NaN, like onnx.reference, on prompts and on decode
steps with a past.  (ONNX Runtime's GroupQueryAttention gives a prompt query
that sees a single key that key's value whatever its score; its other
results agree.)
"""

from __future__ import annotations

import numpy as np
import pytest
from _attn_harness import make_model, run_op, run_ort, run_reference

from onnxkv.plan.ops.attention_gqa import GroupQueryAttention
from onnxkv.plan.ops.attention_onnx import Attention23


def _f(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("sq,past,mask", [(4, 0, False), (1, 9, False), (1, 9, True)])
def test_attention_nan_query_head(sq, past, mask):
    rng = np.random.default_rng(sq + past)
    b, hq, hkv, d = 2, 4, 2, 32
    q = _f(rng, b, hq, sq, d)
    q[1, 2, :, 5] = np.nan
    ins = {
        "Q": q,
        "K": _f(rng, b, hkv, sq, d),
        "V": _f(rng, b, hkv, sq, d),
        "attn_mask": np.ones((b, 1, sq, past + sq), bool) if mask else None,
        "past_key": _f(rng, b, hkv, past, d) if past else None,
        "past_value": _f(rng, b, hkv, past, d) if past else None,
    }
    model = make_model(
        "Attention", ins, ["Y", "present_key", "present_value"] if past else ["Y"], {"": 23}, is_causal=int(not mask)
    )
    got, _ = run_op(Attention23, model, ins)
    with np.errstate(invalid="ignore"):
        want = run_reference(model, ins)[0]
    np.testing.assert_array_equal(np.isnan(got[0]), np.isnan(want))
    assert np.isnan(got[0][1, 2]).all() and np.isfinite(np.delete(got[0].reshape(b * hq, -1), 6, axis=0)).all()


@pytest.mark.parametrize("s,past", [(5, None), (1, 6)])
def test_group_query_attention_nan_query_head(s, past):
    rng = np.random.default_rng(s)
    b, hq, hkv, d = 2, 4, 2, 32
    total = s if past is None else past + s
    q = _f(rng, b, s, hq * d)
    q[0, :, 1 * d + 3] = np.nan  # query head 1 of row 0
    ins = {
        "query": q,
        "key": _f(rng, b, s, hkv * d),
        "value": _f(rng, b, s, hkv * d),
        "past_key": None if past is None else _f(rng, b, hkv, past, d),
        "past_value": None if past is None else _f(rng, b, hkv, past, d),
        "seqlens_k": np.full(b, total - 1, np.int32),
        "total_sequence_length": np.array(total, np.int32),
    }
    model = make_model(
        "GroupQueryAttention",
        ins,
        ["output", "present_key", "present_value"],
        {"": 21, "com.microsoft": 1},
        domain="com.microsoft",
        num_heads=hq,
        kv_num_heads=hkv,
    )
    got, _ = run_op(GroupQueryAttention, model, ins)
    heads = got[0].reshape(b, s, hq, d)
    assert np.isnan(heads[0, :, 1]).all() and np.isfinite(np.delete(heads, 1, axis=2)).all()
    assert np.isfinite(heads[1]).all()
    want = run_ort(model, ins)[0].reshape(b, s, hq, d)
    np.testing.assert_allclose(np.delete(heads, 1, axis=2), np.delete(want, 1, axis=2), rtol=1e-5, atol=1e-5)
    if past is not None:
        assert np.isnan(want[0, :, 1]).all()
