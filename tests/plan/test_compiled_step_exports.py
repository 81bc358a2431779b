"""Compiled steps of exports whose graphs join their caches themselves: a Concat-cache export (the cache Concat,
MaskedAttention, RotateHalf, the fused norms and the views between them) and an opset-23 Attention graph (Attention,
RotaryEmbedding, the residual Adds) replay as one segment, bit for bit the node-by-node runs, through cache growth,
new states, padded rows and masks the kernel cannot describe."""

from __future__ import annotations

import numpy as np
import pytest

import onnxkv
from onnxkv import CacheConfig
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.plan.compiled_step import Segment
from onnxkv.zoo.builders import MICRO, build_model

#: The node that builds the graphs' masks from attention_mask (their fused chain): a Python node (its shapes grow).
MASK_NODES = {"ExportMask"}
#: Per graph form, operators its decode step now replays.
COMPILED = {
    "concat": {"Concat", "MaskedAttention", "RotateHalf", "SkipRMSNormChain", "ViewChain"},
    "attention": {"Attention23", "RotaryEmbedding23", "Add"},
}
ATTENTION = {"concat": "MaskedAttention", "attention": "Attention23"}


@pytest.fixture(params=sorted(COMPILED))
def form(request) -> str:
    return request.param


def _runs(session, state, prompt, lengths, tokens, masks=None):
    """Logits of a (left-padded) prompt and of each row of ``tokens`` [steps, B] after it (copies);
    ``masks[i]``, when given, replaces step i's attention_mask."""
    name = session.model.io.logits
    b = FeedBuilder(session.plan.inputs, session.model, prompt, np.asarray(lengths), 0, thread_cache=False)
    feeds, _ = b.first()
    out = state.run(feeds, [name])
    got = [out[name].copy()]
    for i, t in enumerate(tokens):
        feeds = b.next(np.asarray(t, np.int64), out)
        if masks is not None and masks[i] is not None:
            feeds = dict(feeds, attention_mask=masks[i](feeds["attention_mask"]))
        out = state.run(feeds, [name])
        got.append(out[name].copy())
    return got


def _kinds(session, step):
    return {type(session.plan.kernels[k]).__name__ for it in step.items if isinstance(it, Segment)
            for k in range(it.first, it.end)}  # fmt: skip


def test_a_decode_step_is_one_segment_of_every_node_but_the_mask(form):
    session = onnxkv.Session(build_model(form, MICRO, seed=21), threads=1)
    onnxkv.generate(session, np.array([[3, 4, 5]]), max_new_tokens=12)
    (step,) = session.plan.steps.idle
    segments = [it for it in step.items if isinstance(it, Segment)]
    python = {type(session.plan.kernels[k]).__name__ for k in step.items if type(k) is int}
    assert len(segments) == 1 and python <= MASK_NODES and not step.stale
    assert COMPILED[form] <= _kinds(session, step)


@pytest.mark.parametrize("threads", [1, 2])
def test_replays_through_cache_growth_and_new_states_equal_node_by_node(form, threads, recordings):
    """The caches are resizable externals of the appends and of the attention: one recorded step serves a
    cache that grew (4 -> 8 -> 16) and new states of other capacities."""
    model = build_model(form, MICRO, seed=22)
    rng = np.random.default_rng(3)
    prompt, tokens = rng.integers(1, MICRO.vocab_size, (1, 3)), rng.integers(1, MICRO.vocab_size, (12, 1))
    runs = {}
    for compiled in (False, True):
        session = onnxkv.Session(model, threads=threads, compiled_steps=compiled)
        for capacity in (4, 7, 30):
            with session.new_state(cache=CacheConfig("contiguous", initial_capacity=capacity)) as state:
                runs[compiled, capacity] = _runs(session, state, prompt, [3], tokens)
                assert state.length == 15
        if compiled:
            assert any(ATTENTION[form] in _kinds(session, step) for step in session.plan.steps.idle)
            assert len(recordings) == 2  # the prompt's run (then replayed by a later state's) and the decode step
    for capacity in (4, 7, 30):
        for plain, replayed in zip(runs[False, capacity], runs[True, capacity], strict=True):
            np.testing.assert_array_equal(plain, replayed)


def test_left_padded_rows_replay_their_own_visible_ranges(form):
    model = build_model(form, MICRO, seed=23)
    rng = np.random.default_rng(4)
    prompt = rng.integers(1, MICRO.vocab_size, (3, 6))
    prompt[0, :2] = prompt[2, :5] = 0  # left padding of rows 0 and 2
    tokens = rng.integers(1, MICRO.vocab_size, (7, 3))
    runs = {}
    for compiled in (False, True):
        session = onnxkv.Session(model, threads=2, compiled_steps=compiled)
        with session.new_state() as state:
            runs[compiled] = _runs(session, state, prompt, [4, 6, 1], tokens)
        if compiled:
            assert any(ATTENTION[form] in _kinds(session, step) for step in session.plan.steps.idle)
    for plain, replayed in zip(runs[False], runs[True], strict=True):
        np.testing.assert_array_equal(plain, replayed)


def _hole(mask: np.ndarray) -> np.ndarray:
    mask = mask.copy()
    mask[:, 1] = 0  # a hidden key between visible ones: no single range, the literal path's answer
    return mask


def _too_long(mask: np.ndarray) -> np.ndarray:
    return np.ones((mask.shape[0], mask.shape[1] + 2), mask.dtype)


@pytest.mark.parametrize("kind", [_hole, _too_long], ids=["hole", "too-long"])
def test_a_mask_the_kernel_cannot_describe_runs_node_by_node_with_the_same_outcome(form, kind):
    model = build_model(form, MICRO, seed=24)
    rng = np.random.default_rng(5)
    prompt, tokens = rng.integers(1, MICRO.vocab_size, (1, 4)), rng.integers(1, MICRO.vocab_size, (6, 1))
    masks = [None, None, kind, None, None, None]  # the third decode step's mask is hostile
    outcomes = {}
    for compiled in (False, True):
        session = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        with session.new_state() as state:
            try:
                outcomes[compiled] = ("ran", _runs(session, state, prompt, [4], tokens, masks), state.length)
            except onnxkv.errors.OnnxkvError as e:
                outcomes[compiled] = (type(e).__name__, str(e), state.length)
    assert outcomes[False][0] == outcomes[True][0] and outcomes[False][2] == outcomes[True][2]
    if outcomes[False][0] == "ran":
        for plain, replayed in zip(outcomes[False][1], outcomes[True][1], strict=True):
            np.testing.assert_array_equal(plain, replayed)
    else:
        assert outcomes[False][1] == outcomes[True][1]


def test_runs_without_a_state_keep_the_cache_joins_python_nodes_and_equal_node_by_node(form):
    """Threaded as tensors the Concat (or Attention) joins arrays of this run only: it refuses the recording
    (its copy would be baked into the step) and the step replays the rest."""
    model = build_model(form, MICRO, seed=25)
    prompt = np.random.default_rng(6).integers(1, MICRO.vocab_size, (1, 4))
    got = {}
    for compiled in (False, True):
        session = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        got[compiled] = onnxkv.generate(session, prompt, max_new_tokens=10, cache="tensor").tokens
        if compiled:
            for step in session.plan.steps.idle:
                assert not {"Concat", "Attention23"} & _kinds(session, step)
    np.testing.assert_array_equal(got[False], got[True])


@pytest.mark.parametrize(
    "arch",
    ["llama_tied", "mistral", "qwen2", "qwen3", "smollm3", "granite", "gemma2", "gemma3", "phi3", "phi3_partial"],
)
def test_transformers_exports_replay_all_but_the_mask_equal_node_by_node(arch):
    """transformers 5 torch.onnx.export fixtures: their mask is one ExportMask, their rotary tables one
    PositionTable, their head merges reshape to ShapeOf values of the step's own tensors (kept for the step),
    Qwen3's per-head norms transpose unit axes (views), Gemma's and Granite's scales multiply or divide by one
    value, Gemma 2's logits are capped by one Softcap node, and Phi-3's rotation takes slice bounds computed
    from the step's shapes and concatenates the pass-through part (empty, or with partial rotary the rest of
    each head, a strided Slice packed by rows): a decode step replays every node but the mask
    (the norm's cast of the embedding to float32 is a recorded copy), bit for bit the node-by-node runs."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data" / "arch" / arch / "torch" / "model.onnx"
    rng = np.random.default_rng(7)
    prompt, tokens = rng.integers(1, 250, (1, 5)), rng.integers(1, 250, (10, 1))
    runs = {}
    for compiled in (False, True):
        session = onnxkv.Session(path, threads=2, compiled_steps=compiled)
        with session.new_state() as state:
            runs[compiled] = _runs(session, state, prompt, [5], tokens)
        if compiled:
            (step,) = session.plan.steps.idle
            python = {type(session.plan.kernels[k]).__name__ for k in step.items if type(k) is int}
            assert python == {"ExportMask"} and {"PositionTable", "Cast"} <= _kinds(session, step)
            assert ("Softcap" in _kinds(session, step)) == (arch == "gemma2")
            assert ("Mul" in _kinds(session, step)) == (arch in ("granite", "gemma2", "gemma3"))
    for plain, replayed in zip(runs[False], runs[True], strict=True):
        np.testing.assert_array_equal(plain, replayed)
