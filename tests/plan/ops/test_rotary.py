"""RotaryEmbedding: com.microsoft against ONNX Runtime, ONNX-23 against onnx.reference and ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest
from _attn_harness import build_op, make_model, run_op, run_ort, run_reference

from onnxkv.errors import InputError, ModelError
from onnxkv.plan.ops.rotary import RotaryEmbedding23, RotaryEmbeddingMS

TOL = 1e-5
MS_OPSETS = {"": 21, "com.microsoft": 1}


def _caches(rng: np.random.Generator, rows: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    angles = rng.uniform(0, 2 * np.pi, (rows, half)).astype(np.float32)
    return np.cos(angles), np.sin(angles)


def _check(got: list, want: list) -> None:
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0)


MS_CASES = [
    # id, input shape, position ids shape, attrs
    ("3d-start-offset", (2, 5, 4 * 32), (1,), {}),
    ("3d-per-token", (2, 5, 4 * 64), (2, 5), {"interleaved": 1}),
    ("4d-bnsh", (2, 4, 3, 80), (2, 3), {}),
    ("3d-partial", (1, 4, 2 * 64), (1, 4), {"rotary_embedding_dim": 32, "num_heads": 2}),
    ("4d-partial-interleaved", (1, 2, 4, 32), (1,), {"rotary_embedding_dim": 16, "num_heads": 2, "interleaved": 1}),
]


@pytest.mark.parametrize("shape,pos_shape,attrs", [c[1:] for c in MS_CASES], ids=[c[0] for c in MS_CASES])
def test_ms_matches_ort(shape, pos_shape, attrs):
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    head = shape[-1] if len(shape) == 4 else shape[-1] // attrs.get("num_heads", 4 if shape[-1] % 4 == 0 else 2)
    rot = attrs.get("rotary_embedding_dim", head)
    cos, sin = _caches(rng, 16, rot // 2)
    pos = rng.integers(0, 10, pos_shape).astype(np.int64)
    ins = {
        "input": rng.standard_normal(shape).astype(np.float32),
        "position_ids": pos,
        "cos_cache": cos,
        "sin_cache": sin,
    }
    model = make_model("RotaryEmbedding", ins, ["y"], MS_OPSETS, domain="com.microsoft", **attrs)
    got, _ = run_op(RotaryEmbeddingMS, model, ins)
    _check(got, run_ort(model, ins))


ONNX_CASES = [
    ("4d", (2, 4, 3, 32), True, {}),
    ("4d-interleaved", (2, 2, 5, 64), True, {"interleaved": 1}),
    ("3d-num-heads", (2, 3, 4 * 80), True, {"num_heads": 4}),
    ("3d-partial", (1, 4, 2 * 64), True, {"num_heads": 2, "rotary_embedding_dim": 32}),
    ("no-position-ids", (2, 2, 5, 32), False, {}),
]


@pytest.mark.parametrize("shape,with_pos,attrs", [c[1:] for c in ONNX_CASES], ids=[c[0] for c in ONNX_CASES])
def test_onnx23_matches_reference_and_ort(shape, with_pos, attrs):
    rng = np.random.default_rng(shape[-1] + len(attrs))
    x = rng.standard_normal(shape).astype(np.float32)
    b = shape[0]
    s = shape[2] if len(shape) == 4 else shape[1]
    head = shape[-1] if len(shape) == 4 else shape[-1] // attrs["num_heads"]
    rot = attrs.get("rotary_embedding_dim", head)
    if with_pos:
        cos, sin = _caches(rng, 12, rot // 2)
        pos = rng.integers(0, 12, (b, s)).astype(np.int64)
    else:
        cos, sin = (c.reshape(b, s, rot // 2) for c in _caches(rng, b * s, rot // 2))
        pos = None
    ins = {"X": x, "cos_cache": cos, "sin_cache": sin, "position_ids": pos}
    model = make_model("RotaryEmbedding", ins, ["Y"], {"": 23}, **attrs)
    got, _ = run_op(RotaryEmbedding23, model, ins)
    _check(got, run_reference(model, ins))
    _check(got, run_ort(model, ins))


def test_errors():
    rng = np.random.default_rng(0)
    cos, sin = _caches(rng, 4, 16)
    ins = {"X": rng.standard_normal((1, 2, 3, 32)).astype(np.float32), "cos_cache": cos, "sin_cache": sin,
           "position_ids": np.array([[0, 1, 4]], np.int64)}  # fmt: skip
    model = make_model("RotaryEmbedding", ins, ["Y"], {"": 23})
    with pytest.raises(InputError, match=r"position ids must lie in \[0, 4\)"):
        run_op(RotaryEmbedding23, model, ins)
    flat = dict(ins, X=ins["X"].reshape(1, 3, 64), position_ids=np.array([[0, 1, 2]], np.int64))
    with pytest.raises(InputError, match="num_heads is required"):
        run_op(RotaryEmbedding23, make_model("RotaryEmbedding", flat, ["Y"], {"": 23}), flat)
    rank2 = dict(ins, X=ins["X"].reshape(6, 32))
    with pytest.raises(InputError, match="3-D or 4-D"):
        run_op(RotaryEmbedding23, make_model("RotaryEmbedding", rank2, ["Y"], {"": 23}), rank2)
    with pytest.raises(ModelError, match="rotary_embedding_dim must be"):
        build_op(RotaryEmbedding23, make_model("RotaryEmbedding", ins, ["Y"], {"": 23}, rotary_embedding_dim=3))
    ms = {"input": ins["X"], "position_ids": np.array([0], np.int64), "cos_cache": cos, "sin_cache": sin}
    with pytest.raises(ModelError, match="is_packed_batching"):
        build_op(RotaryEmbeddingMS, make_model("RotaryEmbedding", ms, ["y"], MS_OPSETS, domain="com.microsoft",
                                               is_packed_batching=1))  # fmt: skip


@pytest.mark.parametrize(
    "position_ids, match",
    [
        (
            np.array([2**63 - 1], np.int64),  # start + s used to wrap negative (a range of garbage in the message)
            r"lie in \[0, 16\) \(cos_cache rows\), got a start of 9223372036854775807 for 3 tokens "
            r"\(valid starts: \[0, 13\]\)",
        ),
        (np.array([14], np.int64), r"got a start of 14 for 3 tokens \(valid starts: \[0, 13\]\)"),
        (np.array([[0, 1, 2**64 - 1], [0, 1, 2]], np.uint64), r"got 18446744073709551615 at \[0, 2\]"),
        (np.array([[0, 1, 2], [0, 1, 2]], np.float32), "position ids must be integers, got float32"),
    ],
    ids=["int64-max-start", "start", "uint64", "float"],
)
def test_ms_position_ids_are_checked_in_their_own_width(position_ids, match):
    rng = np.random.default_rng(20)
    cos, sin = _caches(rng, 16, 16)
    ins = {
        "input": rng.standard_normal((2, 3, 4 * 32)).astype(np.float32),
        "position_ids": position_ids,
        "cos_cache": cos,
        "sin_cache": sin,
    }
    model = make_model("RotaryEmbedding", ins, ["y"], MS_OPSETS, domain="com.microsoft")
    with pytest.raises(InputError, match=match):
        run_op(RotaryEmbeddingMS, model, ins)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.uint64])
def test_onnx_position_ids_of_any_integer_width_rotate_as_int64(dtype):
    rng = np.random.default_rng(21)
    cos, sin = _caches(rng, 16, 16)
    ins = {
        "X": rng.standard_normal((2, 4, 3, 32)).astype(np.float32),
        "cos_cache": cos,
        "sin_cache": sin,
        "position_ids": rng.integers(0, 16, (2, 3)).astype(dtype),
    }
    model = make_model("RotaryEmbedding", ins, ["Y"], {"": 23})
    got, _ = run_op(RotaryEmbedding23, model, ins)
    want, _ = run_op(RotaryEmbedding23, model, dict(ins, position_ids=ins["position_ids"].astype(np.int64)))
    np.testing.assert_array_equal(got[0], want[0])
