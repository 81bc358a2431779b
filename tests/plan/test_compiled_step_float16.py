"""Compiled steps of float16 files (ONNX Runtime's converter with float32 inputs and outputs, as Transformers.js
ships model_fp16.onnx): the products, norms, rotary, SwiGLU gates, residual Adds and boundary Casts replay as
recorded calls with their widenings and roundings, bit for bit the node-by-node runs; the Concat joins of the
float16 caches replay, and so does the attention of one-row steps (GroupQueryAttention's fused decode call, the
Concat form's masked kernel over its float16 caches); left-padded rows keep it in Python (a float16 mask's
finite masked value needs the Python path's bound)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("onnxruntime")

from onnxruntime.transformers.float16 import convert_float_to_float16  # noqa: E402

import onnxkv  # noqa: E402
from onnxkv.generate.feeds import FeedBuilder  # noqa: E402
from onnxkv.plan.compiled_step import Segment  # noqa: E402
from onnxkv.plan.ops.attention_gqa import GroupQueryAttention  # noqa: E402
from onnxkv.plan.ops.masked_attention import MaskedAttention  # noqa: E402
from onnxkv.zoo.builders import MICRO, build_model  # noqa: E402

DATA = Path(__file__).parents[1] / "data" / "arch"

#: Per graph form, the operators a decode step keeps in Python (besides the nodes that build an export's mask).
PYTHON = {
    "gqa": {"GroupQueryAttention"},
    "concat": {"MaskedAttention", "ViewChain"},
    "attention": {"Attention23", "RotaryEmbedding23"},
    "q4f16": {"GroupQueryAttention"},
}
MASK_NODES = {"ExportMask"}


@pytest.fixture(scope="module", params=sorted(PYTHON))
def model(request, tmp_path_factory):
    """(form, float16 model); ``q4f16``: the GroupQueryAttention graph with 4-bit MatMulNBits (float
    activations) before the conversion, as Transformers.js' model_q4f16.onnx."""
    if request.param != "q4f16":
        return request.param, convert_float_to_float16(build_model(request.param, MICRO, seed=7), keep_io_types=True)
    path = tmp_path_factory.mktemp("q4f16") / "model.onnx"
    onnxkv.quantize_weights(build_model("gqa", MICRO, seed=7), path, bits=4, block_size=16, accuracy_level=0)
    return "q4f16", convert_float_to_float16(onnx.load(str(path)), keep_io_types=True)


def _logits(session, prompt: np.ndarray, lengths, steps: int) -> list[np.ndarray]:
    """Logits of a prompt and of ``steps`` greedy decode steps of one state (copies)."""
    name = session.model.io.logits
    b = FeedBuilder(session.plan.inputs, session.model, prompt, np.asarray(lengths), 0, thread_cache=False)
    feeds, _ = b.first()
    got = []
    with session.new_state() as state:
        for _ in range(steps + 1):
            out = state.run(feeds, [name])
            got.append(out[name].copy())
            feeds = b.next(out[name][:, -1].argmax(-1).astype(np.int64)[:, None], out)
    return got


@pytest.mark.parametrize("threads", [1, 2])
def test_float16_decode_steps_replay_bit_for_bit(model, threads):
    form, proto = model
    compiled = onnxkv.Session(proto, threads=threads)
    plain = onnxkv.Session(proto, threads=threads, compiled_steps=False)
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, MICRO.vocab_size, (2, 6))
    lengths = [6, 4]  # row 1 left-padded by 2
    prompt[1, :2] = 0
    got, want = _logits(compiled, prompt, lengths, 9), _logits(plain, prompt, lengths, 9)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    (step,) = compiled.plan.steps.idle
    python = {type(compiled.plan.kernels[k]).__name__ for k in step.items if type(k) is int}
    assert python <= PYTHON[form] | MASK_NODES and not step.stale
    compiled_ops = {
        type(compiled.plan.kernels[k]).__name__
        for it in step.items
        if isinstance(it, Segment)
        for k in range(it.first, it.end)
    }
    assert compiled_ops & {"PrologueMatMul", "SiblingMatMul", "MatMul", "MatMulNBits", "SkipRMSNormChain", "RotateHalf"}
    assert step.compiled_nodes >= len(compiled.plan.nodes) // 2


#: Per graph form, the operators a one-row decode step keeps in Python: the attention of the Concat and
#: GroupQueryAttention forms replays too (the fused decode call; the masked kernel, its mask all zeros).
PYTHON_ONE_ROW = {"gqa": set(), "concat": set(), "attention": PYTHON["attention"], "q4f16": set()}


@pytest.mark.parametrize("threads", [1, 2])
def test_one_row_float16_decode_steps_replay_their_attention_bit_for_bit(model, threads, monkeypatch):
    """Nine decode steps after the prompt (which runs plain): the first records, the other eight replay their
    attention (its operator's Python path runs twice per layer, the prompt's included)."""
    form, proto = model
    plain = onnxkv.Session(proto, threads=threads, compiled_steps=False)
    prompt = np.random.default_rng(5).integers(1, MICRO.vocab_size, (1, 7))
    want = _logits(plain, prompt, [7], 9)
    calls = []
    for cls in (GroupQueryAttention, MaskedAttention):  # before the plan binds the operators' run methods
        monkeypatch.setattr(cls, "run", lambda self, *a, _run=cls.run: calls.append(1) or _run(self, *a))
    compiled = onnxkv.Session(proto, threads=threads)
    got = _logits(compiled, prompt, [7], 9)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    (step,) = compiled.plan.steps.idle
    python = {type(compiled.plan.kernels[k]).__name__ for k in step.items if type(k) is int}
    assert python <= PYTHON_ONE_ROW[form] | MASK_NODES and not step.stale
    if form != "attention":
        assert len(calls) == 2 * MICRO.num_layers


def test_float16_generate_gives_the_same_tokens_compiled_or_not(model):
    _, proto = model
    prompt = np.random.default_rng(4).integers(1, MICRO.vocab_size, (1, 5))
    runs = [
        onnxkv.generate(onnxkv.Session(proto, threads=1, compiled_steps=c), prompt, 16, eos_token_id=[]).tokens
        for c in (True, False)
    ]
    np.testing.assert_array_equal(*runs)


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_a_windowed_float16_export_replays_bit_for_bit_past_its_window(cache):
    """A torch export of a windowed model (window 8), converted to float16: past the window its mask hides
    keys with float16's lowest finite value, so each layer's attention segment refuses those runs and its
    nodes run in Python, allocating their values anew.  The segment after it reads one of them, whose memory
    the recording had handed to that segment's own output: such a segment runs in Python too, never writing
    the run's value into the other's memory while it exports a stale array of its own (the logits were
    several units off from the ninth token)."""
    proto = convert_float_to_float16(onnx.load(str(DATA / "mistral" / "torch" / "model.onnx")), keep_io_types=True)
    prompt = np.array([[1, 5, 7, 9, 11, 3, 4, 8]])
    got = {}
    for compiled in (True, False):
        session = onnxkv.Session(proto, threads=1, compiled_steps=compiled)
        name = session.model.io.logits
        b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([8]), 0, thread_cache=False)
        feeds, _ = b.first()
        got[compiled] = []
        with session.new_state(cache=cache) as state:
            for _ in range(14):
                out = state.run(feeds, [name])
                got[compiled].append(out[name].copy())
                feeds = b.next(out[name][:, -1].argmax(-1).astype(np.int64)[:, None], out)
    for g, w in zip(got[True], got[False], strict=True):
        np.testing.assert_array_equal(g, w)
