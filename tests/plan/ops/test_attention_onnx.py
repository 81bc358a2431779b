"""ONNX Attention (23, 24) against onnx.reference, and ONNX Runtime where it runs the case.

Windows (Attention-25) and the kernel's ranges: test_attention_onnx_ranges.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from _attn_harness import build_op, make_model, run_op, run_ort, run_reference
from onnx import TensorProto, helper

from onnxkv.errors import InputError, ModelError
from onnxkv.plan.ops.attention_onnx import Attention23, Attention24

TOL = 1e-5
OUTPUTS = ["Y", "present_key", "present_value", "qk"]


def _f(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _inputs(rng, b, hq, hkv, sq, skv, d, past=None, dv=None, three_d=False, mask=None, nonpad=None):
    dv = dv or d
    if three_d:
        q, k, v = _f(rng, b, sq, hq * d), _f(rng, b, skv, hkv * d), _f(rng, b, skv, hkv * dv)
    else:
        q, k, v = _f(rng, b, hq, sq, d), _f(rng, b, hkv, skv, d), _f(rng, b, hkv, skv, dv)
    ins = {
        "Q": q,
        "K": k,
        "V": v,
        "attn_mask": mask,
        "past_key": None if past is None else _f(rng, b, hkv, past, d),
        "past_value": None if past is None else _f(rng, b, hkv, past, dv),
    }
    if nonpad is not None:
        ins["nonpad_kv_seqlen"] = np.asarray(nonpad, np.int64)
    return ins


def _ort_infinities(a: np.ndarray) -> np.ndarray:
    """ORT writes masked scores as the lowest finite float; onnx.reference (and onnxkv) as -inf."""
    return np.where(a <= np.finfo(a.dtype).min, -np.inf, a) if a.dtype.kind == "f" else a


def _check_against_peers(ins, opset=23, outputs=3, ort=True, reference=True, **attrs):
    names = OUTPUTS[:outputs]
    if outputs > 1 and ins["past_key"] is None:
        names = [names[0], "", ""] + names[3:]
    model = make_model("Attention", ins, names, {"": opset}, **attrs)
    cls = Attention24 if opset >= 24 else Attention23
    got, rt = run_op(cls, model, ins)
    assert len(got) == len(model.graph.node[0].output)
    got = [g for g in got if g is not None]
    oracles = [run_reference(model, ins)] if reference else []
    if ort:
        oracles.append([_ort_infinities(a) for a in run_ort(model, ins)])
    for want in oracles:
        assert len(want) == len(got)
        for w, g in zip(want, got):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(g, w, atol=TOL, rtol=0)
    return got, rt


def test_mha_4d_prompt_no_mask():
    _check_against_peers(_inputs(np.random.default_rng(0), 2, 4, 4, 5, 5, 32))


@pytest.mark.parametrize("d", [32, 64, 80])
def test_causal_gqa_prompt(d):
    _check_against_peers(_inputs(np.random.default_rng(d), 2, 8, 2, 6, 6, d), is_causal=1)


def test_causal_decode_with_past_mqa():
    _check_against_peers(_inputs(np.random.default_rng(1), 2, 4, 1, 1, 1, 32, past=7), is_causal=1)


def test_causal_chunk_with_past_3d():
    ins = _inputs(np.random.default_rng(2), 2, 4, 2, 3, 3, 64, past=5, three_d=True)
    _check_against_peers(ins, is_causal=1, q_num_heads=4, kv_num_heads=2)


def test_value_head_size_differs_softcap_scale():
    ins = _inputs(np.random.default_rng(3), 1, 4, 2, 4, 4, 32, past=2, dv=16, three_d=True)
    _check_against_peers(ins, is_causal=1, q_num_heads=4, kv_num_heads=2, softcap=1.5, scale=0.2)


def test_bool_mask_short_broadcast_with_causal():
    rng = np.random.default_rng(4)
    mask = rng.random((3, 6)) > 0.3  # [Sq, T - 2]: last two key columns padded as masked
    _check_against_peers(
        _inputs(rng, 2, 4, 2, 3, 3, 32, past=5, mask=mask), is_causal=1, ort=False
    )  # ORT needs a full mask


def test_float_mask_and_fully_masked_row():
    rng = np.random.default_rng(5)
    mask = rng.standard_normal((2, 1, 4, 4)).astype(np.float32)
    mask[1, 0, 2, :] = -np.inf  # one row sees nothing -> zeros
    _check_against_peers(_inputs(rng, 2, 4, 2, 4, 4, 32, mask=mask), softcap=2.0)
    bool_mask = rng.random((2, 4, 4, 4)) > 0.5
    bool_mask[0, 1, 3] = False
    _check_against_peers(_inputs(rng, 2, 4, 2, 4, 4, 32, mask=bool_mask), is_causal=1, ort=False)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_qk_matmul_output_modes(mode):
    rng = np.random.default_rng(6 + mode)
    mask = rng.standard_normal((1, 1, 2, 7)).astype(np.float32)
    ins = _inputs(rng, 2, 4, 2, 2, 2, 32, past=5, mask=mask)
    # onnx.reference returns the softcapped scores in mode 0; the spec and ORT return Q·K itself.
    _check_against_peers(ins, outputs=4, is_causal=1, softcap=3.0, qk_matmul_output_mode=mode, reference=mode != 0)
    _check_against_peers(ins, outputs=4, is_causal=1, qk_matmul_output_mode=mode)


def test_softmax_precision_double():
    ins = _inputs(np.random.default_rng(10), 1, 2, 2, 3, 3, 32, mask=np.ones((3, 3), bool))
    _check_against_peers(ins, softmax_precision=TensorProto.DOUBLE, ort=False)


@pytest.mark.parametrize("causal", [0, 1])
def test_nonpad_kv_seqlen_static_cache(causal):
    rng = np.random.default_rng(11 + causal)
    # Static cache of 8 slots; row 0 holds 6 valid keys, row 1 holds 2 (< Sq: leading rows see nothing).
    ins = _inputs(rng, 2, 4, 2, 3, 8, 32, nonpad=[6, 2])
    _check_against_peers(ins, opset=24, is_causal=causal)
    mask = rng.random((3, 8)) > 0.2
    ins = _inputs(rng, 2, 4, 2, 3, 8, 32, mask=mask, nonpad=[8, 4])
    _check_against_peers(ins, opset=24, is_causal=causal)


@pytest.mark.parametrize(
    "nonpad, match",
    [
        (np.array([6, 2**64 - 1], np.uint64), r"nonpad_kv_seqlen\[1\] = 18446744073709551615 is outside \[0, 8\]"),
        (np.array([-(2**63), 2], np.int64), r"nonpad_kv_seqlen\[0\] = -9223372036854775808 is outside \[0, 8\]"),
        (np.array([9, 2], np.int32), r"nonpad_kv_seqlen\[0\] = 9 is outside \[0, 8\] \(the keys of the row\)"),
        (np.array([6.5, 2.0]), r"nonpad_kv_seqlen must be \[2\] integers, got float64 \(2,\)"),
        (np.array([6, 2, 1], np.int64), r"nonpad_kv_seqlen must be \[2\] integers, got int64 \(3,\)"),
    ],
    ids=["uint64", "int64-min", "int32", "float", "shape"],
)
def test_nonpad_kv_seqlen_is_checked_in_its_own_width(nonpad, match):
    ins = dict(_inputs(np.random.default_rng(12), 2, 4, 2, 3, 8, 32), nonpad_kv_seqlen=nonpad)
    model = make_model("Attention", ins, ["Y"], {"": 24})
    with pytest.raises(InputError, match=match):
        run_op(Attention24, model, ins)


def test_storage_counters():
    rng = np.random.default_rng(13)
    ins = _inputs(rng, 2, 4, 2, 1, 1, 32, past=6)
    got, rt = _check_against_peers(ins, is_causal=1)
    past_bytes = ins["past_key"].nbytes
    new_bytes = ins["K"].nbytes
    assert rt.counters == {
        "allocations": 2,
        "allocated_bytes": got[1].nbytes + got[2].nbytes,
        "prefix_copied_bytes": 2 * past_bytes,
        "append_copied_bytes": 2 * new_bytes,
    }


def test_errors():
    rng = np.random.default_rng(14)
    ins = _inputs(rng, 1, 4, 2, 2, 2, 32, three_d=True)
    model = make_model("Attention", ins, ["Y"], {"": 23}, q_num_heads=4, kv_num_heads=3)
    with pytest.raises(ModelError, match="multiple of kv_num_heads=3"):
        build_op(Attention23, model)
    model = make_model("Attention", ins, ["Y"], {"": 23})
    with pytest.raises(InputError, match="q_num_heads and kv_num_heads"):
        run_op(Attention23, model, ins)
    bad = dict(ins, Q=ins["Q"][0])
    model = make_model("Attention", bad, ["Y"], {"": 23}, q_num_heads=4, kv_num_heads=2)
    with pytest.raises(InputError, match="must all be 3-D or all 4-D"):
        run_op(Attention23, model, bad)
    gqa = _inputs(rng, 1, 3, 2, 2, 2, 32)
    model = make_model("Attention", gqa, ["Y"], {"": 23})
    with pytest.raises(InputError, match="multiple of key/value heads 2"):
        run_op(Attention23, model, gqa)
    both = _inputs(rng, 1, 2, 2, 1, 1, 32, past=3, nonpad=[3])
    model = make_model("Attention", both, ["Y", "pk", "pv"], {"": 24})
    with pytest.raises(InputError, match="nonpad_kv_seqlen cannot be combined"):
        run_op(Attention24, model, both)
    model = make_model("Attention", ins, ["Y"], {"": 25}, left_window_size=2)
    with pytest.raises(ModelError, match="left_window_size"):
        build_op(Attention24, model)


def test_float16_inputs():
    rng = np.random.default_rng(15)
    ins = _inputs(rng, 2, 4, 2, 3, 3, 32, past=4)
    ins = {n: a.astype(np.float16) if a is not None else None for n, a in ins.items()}
    model = make_model("Attention", ins, OUTPUTS[:3], {"": 23}, is_causal=1)
    got, _ = run_op(Attention23, model, ins)
    for g, w in zip(got, run_reference(model, ins)):
        assert g.dtype == w.dtype == np.float16
        np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), atol=5e-3, rtol=0)


@pytest.mark.parametrize(
    "dtype", [np.float16, helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16)], ids=["float16", "bfloat16"]
)
@pytest.mark.parametrize("layout", ["4d-past-mask", "3d-scores"])
def test_narrow_inputs_are_computed_in_float32_and_rounded_once(dtype, layout):
    """float16/bfloat16: every output is the float32 computation on the same values, rounded once, and the
    presents are the inputs themselves (ONNX's node tests check the agreement with onnx.reference)."""
    rng = np.random.default_rng(16)
    if layout == "4d-past-mask":
        ins = _inputs(rng, 2, 4, 2, 3, 3, 32, past=4, mask=np.where(rng.random((3, 7)) > 0.3, 0, -np.inf))
        outputs, attrs = OUTPUTS[:3], {"is_causal": 1}
    else:
        ins = _inputs(rng, 2, 4, 2, 3, 3, 16, three_d=True)
        outputs, attrs = ["Y", "", "", "qk"], {"q_num_heads": 4, "kv_num_heads": 2, "qk_matmul_output_mode": 3}
    narrow = {n: None if a is None else a.astype(dtype) for n, a in ins.items()}
    wide = {n: None if a is None else a.astype(np.float32) for n, a in narrow.items()}
    model = make_model("Attention", narrow, outputs, {"": 23}, **attrs)
    got, _ = run_op(Attention23, model, narrow)
    want, _ = run_op(Attention23, make_model("Attention", wide, outputs, {"": 23}, **attrs), wide)
    got, want = [g for g in got if g is not None], [w for w in want if w is not None]
    for g, w in zip(got, want):
        assert g.dtype == dtype
        np.testing.assert_array_equal(g, w.astype(dtype))
    if layout == "4d-past-mask":
        for present, past, new in zip(got[1:], ("past_key", "past_value"), ("K", "V")):
            np.testing.assert_array_equal(present, np.concatenate([narrow[past], narrow[new]], axis=2))
