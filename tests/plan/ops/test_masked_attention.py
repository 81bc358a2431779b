"""ai.onnxkv::MaskedAttention: eager attention blocks on the streaming kernel, literal fallback otherwise.

Oracle: ``onnx.reference`` on the unfused graph.  Each block variant is built
as a small graph; the plan must fuse it into one node, and the kernel calls
are counted to tell the kernel path from the literal one.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxkv import OperatorError, Session
from onnxkv.plan.fusion import MASKED_ATTENTION_INPUTS
from onnxkv.plan.ops import masked_attention as ma

B, HQ, HKV, D = 2, 4, 2, 8
FMIN = np.finfo(np.float32).min


def _block(form: str, mask_shape) -> onnx.ModelProto:
    """Q [B, HQ, S, D], K/V [B, h, T, D], mask -> Y, in one of the exporters' spellings.

    ``repeat``: repeat_kv + Transpose + MatMul, then Mul by the scale (onnxkv.zoo.concat);
    ``torch``: Q and Kᵀ each scaled by sqrt(scale), NaN guard after the Softmax (torch.onnx.export);
    ``mha``: no repeat, MatMul(Q, Transpose(K)) / sqrt(D);
    ``casts``: ``repeat`` with transformers' ``softmax(..., dtype=float32).to(q.dtype)``, two Casts to float32;
    ``rounding_casts``: ``repeat`` whose probabilities go through float16 and back (not identities);
    ``softcap``: ``repeat`` with Gemma 2's ``c * tanh(scores / c)`` (c = 2.5) before the mask;
    ``uneven_softcap``: the same with ``d * tanh(scores / c)``, d != c (not the kernel's softcap).
    """
    inits = {
        "axes": np.array([2], np.int64),
        "eshape": np.array([1, 1, HQ // HKV, 1, 1], np.int64),
        "rshape": np.array([0, HQ, -1, D], np.int64),
        "scale": np.array(D**-0.5, np.float32),
        "half": np.array(D**-0.25, np.float32),
        "sqrt_d": np.array(D**0.5, np.float32),
        "zero": np.array(0.0, np.float32),
        "cap": np.array(2.5, np.float32),
        "other_cap": np.array(3.0, np.float32),
    }
    nodes = []

    def node(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out], **attrs))
        return out

    def repeat(x):
        return node(
            "Reshape",
            [node("Expand", [node("Unsqueeze", [x, "axes"], x + "_u"), "eshape"], x + "_e"), "rshape"],
            x + "_r",
        )

    if form == "mha":
        kt = node("Transpose", ["k"], "kt", perm=[0, 1, 3, 2])
        scores = node("Div", [node("MatMul", ["q", kt], "qk"), "sqrt_d"], "scores")
        v = "v"
    elif form in ("repeat", "casts", "rounding_casts", "softcap", "uneven_softcap"):
        kt = node("Transpose", [repeat("k")], "kt", perm=[0, 1, 3, 2])
        scores = node("Mul", [node("MatMul", ["q", kt], "qk"), "scale"], "scores")
        v = repeat("v")
    else:
        kt = node("Mul", [node("Transpose", [repeat("k")], "kt", perm=[0, 1, 3, 2]), "half"], "kts")
        scores = node("MatMul", [node("Mul", ["q", "half"], "qs"), kt], "scores")
        v = repeat("v")
    if form in ("softcap", "uneven_softcap"):
        capped = node("Tanh", [node("Div", [scores, "cap"], "scaled_down")], "tanh")
        scores = node("Mul", ["cap" if form == "softcap" else "other_cap", capped], "capped")
    probs = node("Softmax", [node("Add", ["mask", scores], "biased")], "probs", axis=-1)
    if form == "torch":
        probs = node("Where", [node("IsNaN", [probs], "nan"), "zero", probs], "guarded")
    if form in ("casts", "rounding_casts"):
        first = TensorProto.FLOAT if form == "casts" else TensorProto.FLOAT16
        probs = node("Cast", [node("Cast", [probs], "probs_cast", to=first)], "probs_back", to=TensorProto.FLOAT)
    node("MatMul", [probs, v], "y")
    h = HQ if form == "mha" else HKV
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "block",
        [
            helper.make_tensor_value_info("q", f, [B, HQ, "S", D]),
            helper.make_tensor_value_info("k", f, [B, h, "T", D]),
            helper.make_tensor_value_info("v", f, [B, h, "T", D]),
            helper.make_tensor_value_info("mask", f, [None] * len(mask_shape)),
        ],
        [helper.make_tensor_value_info("y", f, None)],
        [numpy_helper.from_array(a, n) for n, a in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _causal_padded(s: int, t: int, pads, masked=FMIN) -> np.ndarray:
    """[B, 1, s, t] additive mask: queries are the last s keys; row b's first pads[b] keys are padding."""
    j = np.arange(t)[None, None, None, :]
    i = np.arange(t - s, t)[None, None, :, None]
    pad = np.asarray(pads)[:, None, None, None]
    return np.where((j <= i) & (j >= pad), np.float32(0), np.float32(masked)).astype(np.float32)


def _feeds(form: str, s: int, t: int, mask: np.ndarray, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    h = HQ if form == "mha" else HKV
    return {
        "q": rng.standard_normal((B, HQ, s, D)).astype(np.float32),
        "k": rng.standard_normal((B, h, t, D)).astype(np.float32),
        "v": rng.standard_normal((B, h, t, D)).astype(np.float32),
        "mask": mask,
    }


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of the streaming kernel made by MaskedAttention."""
    calls = []
    real = ma._attention_kernel

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(ma, "_attention_kernel", counting)
    return calls


def _check(form: str, feeds: dict, threads: int = 1) -> np.ndarray:
    model = _block(form, feeds["mask"].shape)
    sess = Session(model, threads=threads)
    # the torch form's scale on Q stays a Mul of its own
    assert [n.op_type for n in sess.plan.nodes] == ["Mul", "MaskedAttention"][form != "torch" :]
    got = sess.run(feeds)["y"]
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    return got


@pytest.mark.parametrize("form", ["repeat", "torch", "mha"])
@pytest.mark.parametrize("s,t", [(1, 37), (6, 11)])
@pytest.mark.parametrize("threads", [1, 2])
def test_padding_and_causal_masks_run_on_the_kernel(form, s, t, threads, kernel_calls):
    # batch row 1 is left-padded by 3 keys; float32-min masking as the builder writes it
    mask = _causal_padded(s, t, [0, 3])
    _check(form, _feeds(form, s, t, mask, seed=s + t), threads)
    assert len(kernel_calls) == 1


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the oracle's all -inf rows
@pytest.mark.parametrize("form,masked", [("repeat", FMIN), ("torch", FMIN), ("torch", -np.inf)])
def test_rows_with_no_visible_key_keep_the_exports_result(form, masked, kernel_calls):
    # prefill of a left-padded batch: the first 4 rows of batch row 1 see nothing.  Under float32 min the
    # export averages V uniformly; under -inf it yields NaN, which the torch form's guard turns into 0.
    s = t = 6
    got = _check(form, _feeds(form, s, t, _causal_padded(s, t, [0, 4], masked), seed=7), threads=2)
    assert len(kernel_calls) == 1
    if masked == FMIN:
        assert np.abs(got[1, :, :4]).min() > 0
    else:
        assert not got[1, :, :4].any()


def test_unguarded_empty_rows_match_the_unfused_plan(monkeypatch, kernel_calls):
    # Without a guard the empty rows are whatever the unfused operators make of an all -inf row.
    import onnxkv.plan.fusion_passes as fusion_passes

    s = t = 5
    mask = _causal_padded(s, t, [0, 2], -np.inf)
    feeds = _feeds("repeat", s, t, mask, seed=3)
    got = Session(_block("repeat", mask.shape), threads=1).run(feeds)["y"]
    assert len(kernel_calls) == 1
    monkeypatch.setattr(fusion_passes, "fuse_masked_attention", lambda nodes, protected: nodes)
    unfused = Session(_block("repeat", mask.shape), threads=1)
    assert "MaskedAttention" not in [n.op_type for n in unfused.plan.nodes]
    np.testing.assert_allclose(got, unfused.run(feeds)["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["bias", "hole", "per_head", "ragged_start"])
def test_masks_the_kernel_cannot_express_are_evaluated_literally(case, kernel_calls):
    s, t = 3, 10
    rng = np.random.default_rng(11)
    mask = _causal_padded(s, t, [0, 2])
    if case == "bias":  # ALiBi-like additive bias: not 0 / masked
        mask = mask + rng.uniform(-1, 0, mask.shape).astype(np.float32)
    elif case == "hole":
        mask[0, 0, :, 4] = FMIN
    elif case == "per_head":
        mask = np.repeat(mask, HQ, axis=1)
        mask[:, 1, :, 0] = FMIN
    else:  # rows of one batch row starting at different keys
        mask[1, 0, 0, 2] = FMIN
    _check("repeat", _feeds("repeat", s, t, mask, seed=12), threads=1)
    assert kernel_calls == []


@pytest.mark.parametrize("s,t", [(1, 37), (6, 11)])
def test_casts_of_the_probabilities_to_their_own_type_run_on_the_kernel(s, t, kernel_calls):
    _check("casts", _feeds("casts", s, t, _causal_padded(s, t, [0, 3]), seed=s))
    assert len(kernel_calls) == 1


def test_casts_that_round_the_probabilities_are_evaluated_literally(kernel_calls):
    s, t = 2, 9
    feeds = _feeds("rounding_casts", s, t, _causal_padded(s, t, [0, 1]), seed=5)
    got = _check("rounding_casts", feeds)
    assert kernel_calls == []
    # the literal path kept the float16 rounding of the probabilities (the kernel's result would not)
    exact = Session(_block("casts", feeds["mask"].shape), threads=1).run(feeds)["y"]
    assert np.abs(got - exact).max() > 1e-6


@pytest.mark.parametrize("s,t", [(1, 37), (6, 11)])
def test_softcapped_scores_run_on_the_kernels_softcap(s, t, kernel_calls):
    _check("softcap", _feeds("softcap", s, t, _causal_padded(s, t, [0, 3]), seed=s + 1))
    assert len(kernel_calls) == 1


def test_a_cap_whose_two_constants_differ_is_evaluated_literally(kernel_calls):
    _check("uneven_softcap", _feeds("uneven_softcap", 2, 9, _causal_padded(2, 9, [0, 1]), seed=4))
    assert kernel_calls == []


def test_observable_intermediates_block_the_fusion():
    mask = _causal_padded(1, 8, [0, 1])
    model = _block("repeat", mask.shape)
    model.graph.output.append(helper.make_tensor_value_info("probs", TensorProto.FLOAT, None))
    ops = [n.op_type for n in Session(model, threads=1).plan.nodes]
    assert "MaskedAttention" not in ops and "Softmax" in ops


def test_mask_ranges_describe_exactly_the_visible_keys():
    rng = np.random.default_rng(5)
    for _ in range(50):
        b, s, t = rng.integers(1, 4), rng.integers(1, 6), rng.integers(1, 12)
        start = rng.integers(0, t + 1, b)
        end = rng.integers(-1, t, (b, s))
        j = np.arange(t)
        visible = (j[None, None] >= start[:, None, None]) & (j[None, None] <= end[:, :, None])
        mask = np.where(visible, np.float32(0), rng.choice([FMIN, -np.inf, -1e30]))[:, None].astype(np.float32)
        kv_start, q_pos, empty = ma.mask_ranges(mask, b, s, t)
        again = (j[None, None] >= kv_start[:, None, None]) & (j[None, None] <= q_pos[:, :, None])
        np.testing.assert_array_equal(again, visible)
        np.testing.assert_array_equal(empty, ~visible.any(-1))
    # broadcast forms: one row for the whole batch, one mask row for every query
    kv_start, q_pos, _ = ma.mask_ranges(np.array([FMIN, 0, 0], np.float32), 2, 3, 3)
    assert kv_start.tolist() == [1, 1] and q_pos.tolist() == [[2] * 3] * 2
    assert ma.mask_ranges(np.zeros((1, 1, 1, 3), np.float64), 1, 1, 3) is None


def test_cached_mask_ranges_reuse_only_an_equal_mask(monkeypatch):
    calls = []
    real = ma.mask_ranges
    monkeypatch.setattr(ma, "mask_ranges", lambda *a: calls.append(a) or real(*a))
    buf = np.array([[[[FMIN, 0, 0, 0]]]], np.float32)
    first = ma.cached_mask_ranges(buf, 1, 1, 4)
    assert ma.cached_mask_ranges(buf.copy(), 1, 1, 4) is first and len(calls) == 1  # equal values: reused
    buf[..., 1] = FMIN  # the same buffer holding another mask (a reused plan buffer) is described again
    kv_start, q_pos, _ = ma.cached_mask_ranges(buf, 1, 1, 4)
    assert len(calls) == 2 and kv_start.tolist() == [2] and q_pos.tolist() == [[3]]
    ma.cached_mask_ranges(buf, 2, 1, 4)  # another batch size: described again
    assert len(calls) == 3 and ma.cached_mask_ranges(buf.astype(np.float64), 2, 1, 4) is None


def test_a_cache_prefix_view_is_read_in_place():
    rng = np.random.default_rng(8)
    buf = rng.standard_normal((2, 3, 16, 4)).astype(np.float32)
    view = buf[:, :, :9]
    rows = ma._kv_rows(view)
    assert rows.shape == (2, 3, 16, 4) and rows.flags.c_contiguous
    assert rows.__array_interface__["data"][0] == buf.__array_interface__["data"][0]
    np.testing.assert_array_equal(rows[:, :, :9], view)
    other = buf[:, :, 2:11]  # not a prefix: copied
    copy = ma._kv_rows(other)
    assert not np.shares_memory(copy, buf)
    np.testing.assert_array_equal(copy, other)


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
def test_the_query_scaling_joins_the_fusion(per_channel, kernel_calls):
    # as in exports, Q is made by a node (here q + 0 for the rotary embedding) and then scaled by a constant
    model = _block("torch", (B, 1, 3, 9))
    graph = model.graph
    mul = next(n for n in graph.node if n.output[0] == "qs")
    mul.input[:] = ["q_made", "q_half"]
    graph.node.insert(0, helper.make_node("Add", ["q", "zero"], ["q_made"]))
    scale = np.random.default_rng(8).uniform(0.2, 0.5, D) if per_channel else np.full((), D**-0.25)
    graph.initializer.append(numpy_helper.from_array(scale.astype(np.float32), "q_half"))
    feeds = _feeds("torch", 3, 9, _causal_padded(3, 9, [0, 2]), seed=3)
    sess = Session(model, threads=1)
    assert [n.op_type for n in sess.plan.nodes] == ["Add", "MaskedAttention"]
    fused = sess.plan.nodes[1]
    assert fused.input[0] == "q_made" and fused.input[MASKED_ATTENTION_INPUTS.index("q_scale")] == "q_half"
    got = sess.run(feeds)["y"]
    # a per-channel scale is not the kernel's scalar: the block is evaluated literally
    assert len(kernel_calls) == (0 if per_channel else 1)
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


# -- the layout learnt per key --------------------------------------------------------------------------------------
@pytest.fixture
def layout_calls(monkeypatch):
    """Counts how often a MaskedAttention works out the kernel's layout (MaskedAttention._scale)."""
    calls = []
    real = ma.MaskedAttention._scale

    def counting(self, inputs):
        calls.append(inputs[1].shape)
        return real(self, inputs)

    monkeypatch.setattr(ma.MaskedAttention, "_scale", counting)
    return calls


@pytest.mark.parametrize("form", ["repeat", "torch", "mha"])
def test_decode_steps_of_any_key_length_share_one_layout(form, layout_calls, kernel_calls):
    model = _block(form, (B, 1, 1, 9))
    sess = Session(model, threads=1)
    oracle = ReferenceEvaluator(model)
    for t in (9, 10, 11):  # one decode step after another: the cache grows by one key
        feeds = _feeds(form, 1, t, _causal_padded(1, t, [0, 2]), seed=t)
        np.testing.assert_allclose(sess.run(feeds)["y"], oracle.run(None, feeds)[0], rtol=1e-5, atol=1e-5)
    assert len(layout_calls) == 1 and len(kernel_calls) == 3


def test_a_repeat_that_fixes_the_key_length_is_checked_for_every_length(layout_calls, kernel_calls):
    model = _block("repeat", (B, 1, 1, 6))
    rshape = next(i for i in model.graph.initializer if i.name == "rshape")
    rshape.CopyFrom(numpy_helper.from_array(np.array([0, HQ, 6, D], np.int64), "rshape"))  # T spelled out: 6
    sess = Session(model, threads=1)
    feeds = _feeds("repeat", 1, 6, _causal_padded(1, 6, [0, 1]), seed=3)
    np.testing.assert_allclose(
        sess.run(feeds)["y"], ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-5, atol=1e-5
    )
    assert len(kernel_calls) == 1
    # seven keys do not fit the target: learnt anew, the literal nodes run and fail as the unfused graph does
    with pytest.raises(OperatorError, match="Reshape|reshape"):
        sess.run(_feeds("repeat", 1, 7, _causal_padded(1, 7, [0, 1]), seed=4))
    assert len(layout_calls) == 2 and len(kernel_calls) == 1


@pytest.mark.parametrize("mask_value", [np.finfo(np.float32).min, -np.inf])
def test_a_row_that_sees_no_key_under_a_nan_guard_with_a_fill_tensor(mask_value):
    """The rows that see no key are evaluated literally on their slice of the queries; a [1, 1, S, T] fill
    of the NaN guard was passed whole and the call raised (shape mismatch).  Under -inf such a row is
    NaN after the Softmax, as ONNX's (the guard then fills it)."""
    ort = pytest.importorskip("onnxruntime")
    b, h, s, t, d = 2, 2, 3, 5, 4
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["sc"]),
        helper.make_node("Add", ["sc", "mask"], ["a"]),
        helper.make_node("Softmax", ["a"], ["p"], axis=-1),
        helper.make_node("IsNaN", ["p"], ["isn"]),
        helper.make_node("Where", ["isn", "fill", "p"], ["pg"]),
        helper.make_node("MatMul", ["pg", "v"], ["y"]),
    ]
    shapes = {"q": [b, h, s, d], "k": [b, h, t, d], "v": [b, h, t, d], "mask": [b, 1, s, t]}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in shapes.items()]
    fill = numpy_helper.from_array(np.linspace(0, 0.1, s * t, dtype=np.float32).reshape(1, 1, s, t), "fill")
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, h, s, d])
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, [y], [fill]), opset_imports=[helper.make_opsetid("", 18)]
    )
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(shapes[n]).astype(np.float32) for n in "qkv"}
    feeds["mask"] = np.zeros(shapes["mask"], np.float32)
    for i in range(s):
        feeds["mask"][:, 0, i, t - s + i + 1 :] = mask_value
    feeds["mask"][1, 0, :, : t - s + 1] = mask_value  # batch row 1: its first query sees no key
    sess = Session(model, threads=1)
    assert [n.op_type for n in sess.plan.nodes] == ["MaskedAttention"]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(sess.run(feeds)["y"], want, rtol=1e-5, atol=1e-5)


F16MIN = float(np.finfo(np.float16).min)


def _float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """The block converted to float16 throughout (inputs and outputs too), as ONNX Runtime's converter
    makes a float16 export: a float32-min mask value becomes float16's lowest finite value."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(model, keep_io_types=False)


def _float16_feeds(form: str, s: int, t: int, pads, masked: float, seed: int) -> dict:
    feeds = {x: a.astype(np.float16) for x, a in _feeds(form, s, t, _causal_padded(s, t, pads, 0), seed).items()}
    feeds["mask"] = np.where(_causal_padded(s, t, pads) == 0, np.float16(0), np.float16(masked))
    return feeds


def _expected(feeds: dict, scale: float) -> np.ndarray:
    """softmax(scale q.kᵀ + mask) v in float64 over the float16 inputs, a hidden key (mask <= -65504)
    weighing exactly 0 (no row here sees no key)."""
    q, k, v = (feeds[x].astype(np.float64) for x in "qkv")
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scores = np.where(feeds["mask"] <= F16MIN, -np.inf, scale * q @ np.swapaxes(k, -1, -2))
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("form", ["repeat", "torch", "mha"])
@pytest.mark.parametrize("s,t", [(1, 37), (6, 11)])
@pytest.mark.parametrize("masked", [F16MIN, -np.inf])
def test_float16_blocks_run_on_the_kernel_in_float32(form, s, t, masked, kernel_calls):
    """A float16 block (a float16 export's attention) runs the kernel on its widened query, float16 K/V
    read as they are, and rounds Y once: within float16 rounding of the exact expression, where the
    node-by-node float16 evaluation rounds the scores, the probabilities and the products."""
    feeds = _float16_feeds(form, s, t, [0, 3], masked, s + t)
    sess = Session(_float16(_block(form, feeds["mask"].shape)), threads=2)
    assert "MaskedAttention" in [n.op_type for n in sess.plan.nodes]
    got = sess.run(feeds)["y"]
    assert got.dtype == np.float16 and len(kernel_calls) == 1
    want = _expected(feeds, D**-0.5)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3, atol=2e-3)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # float16 scores + -65504, literally
def test_float16_scores_that_could_cross_the_finite_mask_are_evaluated_literally(monkeypatch, kernel_calls):
    """A finite float16 mask (-65504) hides a key only while the scores are far smaller: queries and keys
    large enough that a hidden score could come near the visible ones keep the node-by-node evaluation
    (the unfused plan's result, bit for bit); -inf hides a key whatever the scores."""
    import onnxkv.plan.fusion_passes as fusion_passes

    s, t = 4, 9
    feeds = _float16_feeds("repeat", s, t, [0, 2], F16MIN, 5)
    feeds["q"] = feeds["q"] * np.float16(40)
    feeds["k"][1, :, 0] *= np.float16(200)  # a padding key: 2 |scale| max|q| max|k| above 60000
    model = _float16(_block("repeat", feeds["mask"].shape))
    got = Session(model, threads=1).run(feeds)["y"]
    assert kernel_calls == []
    with monkeypatch.context() as m:
        m.setattr(fusion_passes, "fuse_masked_attention", lambda nodes, protected: nodes)
        np.testing.assert_array_equal(got, Session(model, threads=1).run(feeds)["y"])
    inf_mask = dict(feeds, mask=np.where(feeds["mask"] == 0, np.float16(0), np.float16(-np.inf)))
    Session(model, threads=1).run(inf_mask)
    assert len(kernel_calls) == 1


def test_hidden_scores_vanish_bounds_the_scores_of_hidden_keys_only():
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 4, 3, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 10, 8)).astype(np.float16)
    kv_start = np.array([0, 2], np.int32)
    q_pos = np.array([[7, 8, 9], [7, 8, 9]], np.int32)
    empty = np.zeros((2, 3), bool)
    assert ma.hidden_scores_vanish(q, k, 1.0, kv_start, q_pos, empty)
    big = k.copy()
    big[1, 0, 1] = 6e4  # a padding key of batch row 1: hidden, and large
    assert not ma.hidden_scores_vanish(q, big, 1.0, kv_start, q_pos, empty)
    big = k.copy()
    big[0, 1, 5] = 6e4  # a key every row sees: never hidden, so not bounded
    assert ma.hidden_scores_vanish(q, big, 1.0, kv_start, q_pos, empty)
    nan = k.copy()
    nan[0, 0, 9] = np.nan  # hidden from the first row
    assert not ma.hidden_scores_vanish(q, nan, 1.0, kv_start, q_pos, empty)
    # decode over a cache without padding: nothing is hidden, nothing is read
    assert ma.hidden_scores_vanish(q[:, :, :1] * 1e6, k, 1.0, np.zeros(2, np.int32), np.full((2, 1), 9), empty[:, :1])
