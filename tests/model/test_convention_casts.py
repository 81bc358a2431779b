"""Cache conventions of float16 models with float32 inputs and outputs (ONNX Runtime's float16 converter
with keep_io_types=True, the model_fp16.onnx of many repositories): each past reaches its joining node
through a Cast and each present leaves through one.  The pairs are recognised (by the graph names), the
session moves the Casts to its boundary (onnxkv.model.cache_casts) so the pairs run in place on float16
caches, and every cache kind gives ONNX Runtime's tokens while Session.run keeps the declared types."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

pytest.importorskip("onnxruntime")

from onnxruntime.transformers.float16 import convert_float_to_float16  # noqa: E402
from ort_loop import compare_runs, ort_greedy, ort_session, step_feeds  # noqa: E402

import onnxkv  # noqa: E402
from onnxkv.model.convention import recognize_cache  # noqa: E402
from onnxkv.model.rewrite import inplace_bindings  # noqa: E402
from onnxkv.zoo.builders import MICRO, build_model  # noqa: E402

KINDS = {"gqa": "group_query_attention", "attention": "attention", "concat": "concat"}


@pytest.fixture(scope="module", params=sorted(KINDS))
def fp16(request, tmp_path_factory):
    model = convert_float_to_float16(build_model(request.param, MICRO, seed=3), keep_io_types=True)
    path = tmp_path_factory.mktemp("fp16") / "model.onnx"
    onnx.save(model, str(path))
    return request.param, onnxkv.Session(str(path), threads=1)


def test_pairs_recognised_through_casts_and_lifted(fp16):
    family, session = fp16
    proto = session.model.proto
    conv = recognize_cache(proto)
    assert conv.kind == KINDS[family]
    assert [(x.past_key, x.past_value, x.present_key, x.present_value) for x in conv.layers] == [
        (f"past_key_values.{i}.key", f"past_key_values.{i}.value", f"present.{i}.key", f"present.{i}.value")
        for i in range(MICRO.num_layers)
    ]
    elem = {i.name: i.type.tensor_type.elem_type for i in proto.graph.input}
    assert elem["past_key_values.0.key"] == onnx.TensorProto.FLOAT  # the model as the file declares it
    assert inplace_bindings(proto, conv) == []
    # ... and as the session runs it: float16 pairs, every one bound, the Casts at the boundary
    assert len(session.bindings) == 2 * MICRO.num_layers
    held = {g.name: g.dtype for g in session.plan.inputs}
    assert all(held[name] == np.float16 for name in conv.past_inputs)
    assert set(session.cast_boundary.inputs) == set(conv.past_inputs)
    assert set(session.cast_boundary.outputs) == set(conv.present_outputs)


@pytest.mark.parametrize("cache", [None, "tensor", "paged"])
def test_generate_gives_onnxruntimes_tokens(fp16, cache):
    _, session = fp16
    prompt = np.random.default_rng(1).integers(0, MICRO.vocab_size, (1, 7))
    np.testing.assert_array_equal(
        onnxkv.generate(session, prompt, 16, cache=cache).tokens, ort_greedy(session, prompt, 16)
    )


def test_session_run_keeps_the_declared_types(fp16):
    """float32 pasts in, float32 presents out, ORT's values (prefill and decode steps on the same feeds)."""
    _, session = fp16
    prompt = np.random.default_rng(2).integers(0, MICRO.vocab_size, (2, 5))
    compare_runs(session, prompt, 3, atol=2e-2)
    feeds, _ = step_feeds(session, prompt).first()
    feeds = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feeds.items()}
    out = session.run(feeds)
    present = session.model.convention.present_outputs[0]
    assert out[present].dtype == np.float32
    theirs = dict(zip(session.output_names, ort_session(session.model).run(session.output_names, feeds)))
    np.testing.assert_allclose(out[present], theirs[present], rtol=4e-3, atol=4e-3)  # float16 steps apart


def test_session_run_names_a_past_of_another_type(fp16):
    _, session = fp16
    prompt = np.random.default_rng(3).integers(0, MICRO.vocab_size, (1, 4))
    feeds, _ = step_feeds(session, prompt).first()
    past = session.model.convention.past_inputs[0]
    feeds[past] = feeds[past].astype(np.float64)
    with pytest.raises(onnxkv.InputError, match=f"Session.run: input '{past}' must be float32"):
        session.run(feeds)


def test_state_exports_presents_in_the_declared_type(fp16):
    """A state holds the caches as float16; presents asked of a run come back float32, and a float32
    initial cache is taken as the graph's Casts take it."""
    _, session = fp16
    prompt = np.random.default_rng(4).integers(0, MICRO.vocab_size, (1, 6))
    state = session.new_state(cache="paged")
    feeds, _ = step_feeds(session, prompt).first()
    feeds = {k: v for k, v in feeds.items() if k not in session.model.convention.past_inputs}
    present = session.model.convention.present_outputs[0]
    out = state.run(feeds, [session.model.io.logits, present])
    assert out[present].dtype == np.float32 and out[present].shape[2] == 6
    held = state.values
    assert all(v.dtype == np.float16 for v in held.values())
    again = session.new_state(initial={k: v.astype(np.float32) for k, v in held.items()})
    for k, v in again.values.items():
        np.testing.assert_array_equal(v, held[k])


def test_beam_search_and_speculative_decoding_on_the_float16_caches(fp16):
    """Beam forks and speculative checkpoints work on the lifted float16 caches: beams on pages equal beams on
    tensors, and speculative decoding (the model as its own draft) gives generate's greedy tokens."""
    _, session = fp16
    prompt = np.random.default_rng(5).integers(0, MICRO.vocab_size, (1, 6))
    paged = onnxkv.beam_search(session, prompt, 3, 8, cache="paged").sequences
    np.testing.assert_array_equal(paged, onnxkv.beam_search(session, prompt, 3, 8, cache="tensor").sequences)
    greedy = onnxkv.generate(session, prompt, 8, eos_token_id=[]).tokens
    spec = onnxkv.speculative_generate(session, prompt, draft=session, max_new_tokens=8, eos_token_id=[])
    np.testing.assert_array_equal(spec.sequences[:, prompt.shape[1] :], greedy)


def test_a_float16_exports_attention_runs_on_the_kernel_with_onnxruntimes_tokens(tmp_path, monkeypatch):
    """The float16 Concat-cache export's attention blocks (MaskedAttention over float16 caches, a float16
    -65504 mask) take the streaming kernel in the prompt and in every decode step of a left-padded batch;
    greedy tokens stay ONNX Runtime's."""
    from onnxkv.plan.ops import masked_attention as ma

    calls = []
    real = ma._attention_kernel
    monkeypatch.setattr(ma, "_attention_kernel", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    model = convert_float_to_float16(build_model("concat", MICRO, seed=4), keep_io_types=True)
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    session = onnxkv.Session(str(path), threads=2)
    prompt = np.random.default_rng(6).integers(1, MICRO.vocab_size, (2, 9))
    mask = np.ones_like(prompt)
    mask[1, :3] = 0  # row 1 left-padded
    got = onnxkv.generate(session, prompt, 12, attention_mask=mask, eos_token_id=[]).tokens
    np.testing.assert_array_equal(got, ort_greedy(session, prompt, 12, mask))
    assert calls.count(9) == MICRO.num_layers and calls.count(1) == 11 * MICRO.num_layers
