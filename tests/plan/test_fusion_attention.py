"""Plan-time fusion of eager attention blocks into ai.onnxkv::MaskedAttention, on whole models.

Both Concat-cache graph forms: onnxkv's builder (onnxkv.zoo.concat) and the
real torch.onnx.export fixture (tests/data/torch_tiny_llama).  The oracle is
the same model planned without this fusion (and transformers' logits for the
fixture).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import onnxkv
import onnxkv.plan.fusion_passes as fusion_passes
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.plan.fusion import MASKED_ATTENTION_INPUTS
from onnxkv.plan.ops import masked_attention as ma
from onnxkv.zoo.builders import MICRO, build_model

DATA = Path(__file__).resolve().parents[1] / "data"
REF = np.load(DATA / "tiny_llama_reference.npz")
TORCH = DATA / "torch_tiny_llama" / "model.onnx"
MODELS = {"builder": lambda: build_model("concat", MICRO, seed=3), "torch": lambda: TORCH}


@pytest.fixture
def calls(monkeypatch):
    """Counts MaskedAttention's streaming-kernel calls (with the addresses of the K/V they read) and
    literal evaluations (with their query rows)."""
    seen = {"kernel": 0, "literal_rows": [], "kv_addresses": []}
    kernel, literal = ma._attention_kernel, ma.MaskedAttention._literal

    def counting_kernel(*args, **kwargs):
        seen["kernel"] += 1
        seen["kv_addresses"] += [a.__array_interface__["data"][0] for a in args[1:3]]
        return kernel(*args, **kwargs)

    def counting_literal(self, inputs, rt):
        seen["literal_rows"].append(inputs[0].shape[2])
        return literal(self, inputs, rt)

    monkeypatch.setattr(ma, "_attention_kernel", counting_kernel)
    monkeypatch.setattr(ma.MaskedAttention, "_literal", counting_literal)
    return seen


def _unfused(model, monkeypatch) -> onnxkv.Session:
    with monkeypatch.context() as m:
        m.setattr(fusion_passes, "fuse_masked_attention", lambda nodes, protected: nodes)
        return onnxkv.Session(model, threads=2)


@pytest.mark.parametrize("form", sorted(MODELS))
def test_every_layer_is_fused(form):
    sess = onnxkv.Session(MODELS[form](), threads=1)
    ops = [n.op_type for n in sess.plan.nodes]
    assert ops.count("MaskedAttention") == 2  # both fixtures have two layers
    assert "Softmax" not in ops and "RepeatKvMatMul" not in ops
    # the export scales Q by head_size ** -0.25 in a Mul of its own: it joins the fused node
    q_scales = [
        n.input[MASKED_ATTENTION_INPUTS.index("q_scale")] for n in sess.plan.nodes if n.op_type == "MaskedAttention"
    ]
    if form == "torch":
        assert [float(sess.plan.build_context.constant(x)) for x in q_scales] == [16**-0.25] * 2
    else:
        assert q_scales == ["", ""]


def _generate(sess: onnxkv.Session, prompt: np.ndarray, lengths: np.ndarray, tokens: np.ndarray, state: bool):
    """Logits (and, on the tensor path, presents) of a left-padded prefill and one decode step per column
    of ``tokens`` [B, steps]."""
    model = sess.model
    presents = [] if state else list(model.convention.present_outputs)
    builder = FeedBuilder(sess.plan.inputs, model, prompt, lengths, 0, thread_cache=not state)
    run = sess.new_state().run if state else sess.run
    feeds, _ = builder.first()
    out = run(feeds, [model.io.logits, *presents])
    results = [out[model.io.logits]] + [out[p] for p in presents]
    for step in range(tokens.shape[1]):
        out = run(builder.next(tokens[:, step], out), [model.io.logits, *presents])
        results += [out[model.io.logits]] + [out[p] for p in presents]
    return results


def left_padded_batch(form: str, seed: int, padding: int, steps: int):
    """(prompt [2, 9], lengths, tokens [2, steps]) of random ids for fixture ``form``; row 1 is left-padded."""
    rng = np.random.default_rng(seed)
    vocab = 97 if form == "builder" else 259
    return rng.integers(0, vocab, (2, 9)), np.array([9, 9 - padding]), rng.integers(0, vocab, (2, steps))


def torch_batch_runs(fused: onnxkv.Session, oracle: onnxkv.Session, seed: int, padding: int, state: bool):
    """(got, want): :func:`_generate` of one random left-padded batch of the torch fixture (prefill + 3 decode
    steps) on two sessions of it, checked to hold as many arrays each."""
    prompt, lengths, tokens = left_padded_batch("torch", seed, padding=padding, steps=3)
    got = _generate(fused, prompt, lengths, tokens, state)
    want = _generate(oracle, prompt, lengths, tokens, state)
    assert len(got) == len(want) == (4 if state else 4 * 5)
    return got, want


@pytest.mark.parametrize("form", sorted(MODELS))
@pytest.mark.parametrize("state", [False, True], ids=["tensors", "state"])
def test_left_padded_batch_matches_the_unfused_plan(form, state, calls, monkeypatch):
    prompt, lengths, tokens = left_padded_batch(form, 21, padding=4, steps=4)
    fused = onnxkv.Session(MODELS[form](), threads=2, compiled_steps=False)  # every run through the op
    got = _generate(fused, prompt, lengths, tokens, state)
    # every run of every layer went through the kernel; only the 4 empty padding rows of the prefill were
    # evaluated literally
    assert calls["kernel"] == 2 * 5
    assert calls["literal_rows"] == [4, 4]
    want = _generate(_unfused(MODELS[form](), monkeypatch), prompt, lengths, tokens, state)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_state_run_of_the_torch_export_matches_transformers(calls):
    sess = onnxkv.Session(TORCH, threads=2, compiled_steps=False)  # every run through the op
    state = sess.new_state()
    prompt = REF["prompt_ids"][None, :].astype(np.int64)
    builder = FeedBuilder(sess.plan.inputs, sess.model, prompt, np.array([prompt.shape[1]]), 258, thread_cache=False)
    feeds, _ = builder.first()
    out = state.run(feeds, ["logits"])
    np.testing.assert_allclose(out["logits"][0], REF["prefill_logits"], atol=1e-4, rtol=0)
    for i in range(16):
        out = state.run(builder.next(REF["greedy_tokens"][i : i + 1].astype(np.int64), out), ["logits"])
        np.testing.assert_allclose(out["logits"][0, -1], REF["decode_logits"][i], atol=1e-4, rtol=0)
    assert calls["kernel"] == 2 * 17 and calls["literal_rows"] == []
    # the kernel read the state's caches in place (no copy of K or V)
    caches = {v.__array_interface__["data"][0] for v in state.values.values()}
    assert len(caches) == 4 and set(calls["kv_addresses"][-4:]) == caches


@pytest.mark.parametrize("form", sorted(MODELS))
def test_each_layer_learns_its_layout_once_for_the_prefill_and_once_for_all_decode_steps(form, monkeypatch):
    learnt = []
    scale = ma.MaskedAttention._scale

    def counting(self, inputs):
        learnt.append((self.name, inputs[0].shape[2]))
        return scale(self, inputs)

    monkeypatch.setattr(ma.MaskedAttention, "_scale", counting)
    prompt, lengths, tokens = left_padded_batch(form, 5, padding=2, steps=4)
    _generate(onnxkv.Session(MODELS[form](), threads=2), prompt, lengths, tokens, True)
    # two layers; the key length grows with every step but is not part of what they learn
    assert sorted(s for _, s in learnt) == [1, 1, 9, 9] and len(set(learnt)) == 4
