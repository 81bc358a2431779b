"""GroupQueryAttention's one-token decode path into a state's contiguous cache.

``GroupQueryAttention._decode_token`` serves the common decode call with the
general path's kernels and arguments; these tests check that it is taken where
it should be, that every step's logits and cache contents are bitwise those of
the general path (forced by disabling it), and that calls it does not serve --
or that the general path refuses -- behave exactly as before.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from state_steps import compiled_kinds, fail_replays

import onnxkv
from onnxkv.errors import InputError, OperatorError
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.plan.ops._gqa_decode import FUSED_TOKENS
from onnxkv.plan.ops.attention_gqa import GroupQueryAttention
from onnxkv.plan.registry import bump_baked_epoch
from onnxkv.zoo.builders import MICRO, build_model

PROMPT = 13


def _model(**attrs) -> onnx.ModelProto:
    """The MICRO builder GQA model with ``attrs`` set on every GroupQueryAttention node."""
    model = build_model("gqa", MICRO, seed=41)
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            for name, value in attrs.items():
                node.attribute.append(onnx.helper.make_attribute(name, value))
    return model


def _packed_model() -> onnx.ModelProto:
    """The MICRO GQA model with packed QKV: each GroupQueryAttention reads Concat(q, k, v) as its query
    (key and value omitted), as the GenAI builder's fused qkv_proj feeds it."""
    model = build_model("gqa", MICRO, seed=41)
    nodes = []
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            packed = node.name + "/qkv"
            nodes.append(onnx.helper.make_node("Concat", list(node.input[:3]), [packed], axis=-1))
            node.input[0], node.input[1], node.input[2] = packed, "", ""
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


@pytest.fixture
def spy(monkeypatch):
    """Records whether each _decode_token call served the call (True) or declined (False)."""
    served: list[bool] = []
    original = GroupQueryAttention._decode_token

    def recording(self, inputs, rt):
        result = original(self, inputs, rt)
        served.append(result is not None)
        return result

    monkeypatch.setattr(GroupQueryAttention, "_decode_token", recording)
    return served


def _decode(
    session, state, steps: int, batch: int = 1, length: int = PROMPT, lengths=None
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Prefill ``length`` random tokens per row (``lengths``: each row's, left-padded to ``length``), then
    ``steps`` greedy-free decode steps of fixed tokens.  Returns the prompt's logits and each decode step's
    last-token logits, and the state's final values (caches)."""
    prompt = np.random.default_rng(7).integers(0, MICRO.vocab_size, (batch, length))
    lengths = np.full(batch, length) if lengths is None else np.asarray(lengths)
    b = FeedBuilder(session.plan.inputs, session.model, prompt, lengths, 0, thread_cache=False)
    feeds, _ = b.first()
    out = state.run(feeds, ["logits"])
    logits = [out["logits"].copy()]
    for i in range(steps):
        tokens = np.array([(17 * i + 3 + r) % MICRO.vocab_size for r in range(batch)])
        out = state.run(b.next(tokens, out), ["logits"])
        logits.append(out["logits"][:, -1].copy())
    return logits, [np.array(v) for v in state.values.values()]


@pytest.mark.parametrize(
    "attrs",
    [{}, {"softcap": 2.5}, {"local_window_size": 6}, "packed"],
    ids=["plain", "softcap", "window", "packed-qkv"],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_token_equals_general_path(attrs, threads, spy, monkeypatch):
    """The prompt (a first prompt of at most FUSED_TOKENS) and every decode step take the path (growth of
    the cache included) with results bitwise equal to the general path's."""
    # node by node: every step calls the path (the compiled step's replays of it: tests/plan/test_compiled_step.py)
    model = _packed_model() if attrs == "packed" else _model(**attrs)
    session = onnxkv.Session(model, threads=threads, compiled_steps=False)
    with session.new_state(cache=onnxkv.CacheConfig(initial_capacity=4)) as st:  # grows during prefill and decode
        got_logits, got_values = _decode(session, st, steps=9)
    assert all(spy) and len(spy) == 10 * MICRO.num_layers
    monkeypatch.setattr(GroupQueryAttention, "_decode_token", lambda self, inputs, rt: None)
    with session.new_state(cache=onnxkv.CacheConfig(initial_capacity=4)) as st:
        want_logits, want_values = _decode(session, st, steps=9)
    for got, want in zip(got_logits + got_values, want_logits + want_values, strict=True):
        np.testing.assert_array_equal(got, want)


#: (model, state cache) of the narrow fused calls: float32 models with a float16 / bfloat16 contiguous cache,
#: float16 files (ONNX Runtime's converter, float32 inputs and outputs) with their float16 or a bfloat16 cache.
NARROW = [("float32", "fp16"), ("float32", "bf16"), ("float16", None), ("float16", "bf16"), ("float16", "fp16")]


@pytest.mark.parametrize(
    "dtype, kv_format", NARROW, ids=["f32-f16cache", "f32-bf16cache", "f16", "f16-bf16", "f16-fp16"]
)
@pytest.mark.parametrize("threads", [1, 2])
def test_narrow_decode_token_equals_general_path(dtype, kv_format, threads, spy, monkeypatch):
    """Float16 tokens and 2-byte caches take the fused path too, bitwise the general path's results: its
    float32 rotary of widened rows, rows rounded into the cache, the attention's result rounded once."""
    model = _model()
    if dtype == "float16":
        pytest.importorskip("onnxruntime")
        from onnxruntime.transformers.float16 import convert_float_to_float16

        model = convert_float_to_float16(model, keep_io_types=True)
    session = onnxkv.Session(model, threads=threads, compiled_steps=False)
    config = onnxkv.CacheConfig("contiguous", initial_capacity=4, kv_format=kv_format)
    with session.new_state(cache=config) as st:
        got_logits, got_values = _decode(session, st, steps=9)
    assert all(spy) and len(spy) == 10 * MICRO.num_layers
    monkeypatch.setattr(GroupQueryAttention, "_decode_token", lambda self, inputs, rt: None)
    with session.new_state(cache=config) as st:
        want_logits, want_values = _decode(session, st, steps=9)
    for got, want in zip(got_logits + got_values, want_logits + want_values, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "attrs",
    [{}, {"softcap": 2.5}, {"local_window_size": 6}, "packed"],
    ids=["plain", "softcap", "window", "packed-qkv"],
)
@pytest.mark.parametrize("lengths", [[PROMPT] * 2, [PROMPT] * 3, [PROMPT, 9, 11]], ids=["two", "three", "padded"])
@pytest.mark.parametrize("threads", [1, 2])
def test_batched_decode_equals_general_path(attrs, lengths, threads, spy, monkeypatch):
    """The decode steps of a batch take the path, one token per row written at each row's length (the rows of
    a padded prompt first over their padding), with results bitwise equal to the general path's; the
    batch's first prompt takes the general path."""
    model = _packed_model() if attrs == "packed" else _model(**attrs)
    session = onnxkv.Session(model, threads=threads, compiled_steps=False)
    batch = len(lengths)
    with session.new_state(cache=onnxkv.CacheConfig(initial_capacity=4)) as st:  # grows during decode
        got_logits, got_values = _decode(session, st, steps=9, batch=batch, lengths=lengths)
    assert spy == [False] * MICRO.num_layers + [True] * 9 * MICRO.num_layers
    monkeypatch.setattr(GroupQueryAttention, "_decode_token", lambda self, inputs, rt: None)
    with session.new_state(cache=onnxkv.CacheConfig(initial_capacity=4)) as st:
        want_logits, want_values = _decode(session, st, steps=9, batch=batch, lengths=lengths)
    for got, want in zip(got_logits + got_values, want_logits + want_values, strict=True):
        np.testing.assert_array_equal(got, want)


def test_calls_it_does_not_serve_take_the_general_path(spy):
    """A prompt longer than FUSED_TOKENS and the tensor path (no state) are declined."""
    session = onnxkv.Session(_model(), threads=2)
    with session.new_state() as st:
        _decode(session, st, steps=0, length=FUSED_TOKENS + 1)
    assert spy and not any(spy)
    spy.clear()
    prompt = np.random.default_rng(8).integers(0, MICRO.vocab_size, (1, PROMPT))
    b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([PROMPT]), 0, thread_cache=True)
    feeds, _ = b.first()
    out = session.run(feeds, ["logits", *session.model.convention.present_outputs])
    session.run(b.next(np.array([5]), out), ["logits"])
    assert spy and not any(spy)


def test_refused_seqlens_k_keeps_the_general_error_and_the_state(spy):
    """A mask longer than the cache (seqlens_k and total_sequence_length past it) is declined by the
    path, refused by the general path with its message, and the state stays as it was."""
    session = onnxkv.Session(_model(), threads=2)
    prompt = np.random.default_rng(9).integers(0, MICRO.vocab_size, (1, PROMPT))
    with session.new_state() as st:
        b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([PROMPT]), 0, thread_cache=False)
        feeds, _ = b.first()
        out = st.run(feeds, ["logits"])
        before = {k: np.array(v) for k, v in st.values.items()}
        feeds = b.next(np.array([4]), out)
        feeds["attention_mask"] = np.ones((1, PROMPT + 3), feeds["attention_mask"].dtype)
        spy.clear()
        with pytest.raises(
            (InputError, OperatorError),
            match=r"total_sequence_length must be in \[1, 14\] \(past length 13 \+ 1 new tokens\), "
            r"got 16",
        ):
            st.run(feeds, ["logits"])
        assert spy == [False]
        for name, value in st.values.items():
            np.testing.assert_array_equal(value, before[name])


@pytest.mark.parametrize("compiled", [False, True], ids=["node-by-node", "compiled"])
def test_a_failed_batched_step_leaves_every_cache_byte_as_it_was(compiled, spy):
    """Rows of a padded batch write over their padding and rows shorter than the longest write past their
    length: a run that fails after the writes (here in ``before_commit``) restores every byte, as the
    general path does."""
    session = onnxkv.Session(_model(), threads=2, compiled_steps=compiled)
    prompt = np.random.default_rng(9).integers(0, MICRO.vocab_size, (3, PROMPT))
    with session.new_state() as st:
        b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([PROMPT, 9, 11]), 0, thread_cache=False)
        feeds, _ = b.first()
        out = st.run(feeds, ["logits"])
        for step in range(9):  # the padded rows pass their padding (4 steps): then rows of three lengths
            if step == 5:  # a new recording, of steps whose rows append at their own lengths
                bump_baked_epoch()
            feeds = b.next(np.array([4, 5, 6]), out)
            before = {k: np.array(v) for k, v in st.values.items()}
            lengths = st.length

            def fail(_):
                raise MemoryError("before_commit")

            with pytest.raises(MemoryError, match="before_commit"):
                st.run(feeds, ["logits"], before_commit=fail)
            assert st.length == lengths
            for name, value in st.values.items():
                np.testing.assert_array_equal(value, before[name], err_msg=f"step {step}: {name}")
            out = st.run(feeds, ["logits"])
    assert any(spy)
    if compiled:  # the last steps replayed the attention (the rows' saves made by the effect)
        assert "GroupQueryAttention" in compiled_kinds(session)


def test_a_replay_that_raises_after_its_rows_wrote_over_their_padding_restores_them():
    """A replayed step of a padded batch (rows writing over their padding) whose program raises after the
    decode calls ran: the committed bytes those calls wrote over come back, as after a failed node."""
    session = onnxkv.Session(_model(), threads=2)
    prompt = np.random.default_rng(10).integers(0, MICRO.vocab_size, (3, PROMPT))
    with session.new_state() as st:
        b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([PROMPT, 4, 9]), 0, thread_cache=False)
        feeds, _ = b.first()
        out = st.run(feeds, ["logits"])
        for _ in range(2):  # the second step replays the first's recording
            feeds = b.next(np.array([4, 5, 6]), out)
            out = st.run(feeds, ["logits"])
        assert "GroupQueryAttention" in compiled_kinds(session)
        (step,) = session.plan.steps.idle
        assert len(step.items) == 1
        fail_replays(session)
        feeds = b.next(np.array([7, 8, 9]), out)
        before = {k: np.array(v) for k, v in st.values.items()}
        lengths = st.lengths.copy()
        with pytest.raises(MemoryError, match="call 9"):
            st.run(feeds, ["logits"])
        np.testing.assert_array_equal(st.lengths, lengths)
        for name, value in st.values.items():
            np.testing.assert_array_equal(value, before[name], err_msg=name)
