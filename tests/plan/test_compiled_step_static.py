"""Compiled steps of the static-cache form (TensorScatter + Attention with nonpad_kv_seqlen): every node but the
mask prologue replays, rows written at their own positions equal node-by-node runs bit for bit, a failed run
puts back what the replayed writes replaced, and positions the operator refuses fail as node by node."""

from __future__ import annotations

import numpy as np
import pytest
from state_steps import compiled_kinds, fail_replays
from static_feeds import static_feeds

import onnxkv
from onnxkv.errors import InputError
from onnxkv.plan.compiled_step import Segment
from onnxkv.zoo.builders import MICRO, build_model

C = MICRO.max_length


def _feeds(tokens, write_indices, shown, positions=None):
    return static_feeds(C, tokens, write_indices, shown, positions)


#: Runs of two rows: the prompts, then single tokens at rows' own positions (row 1 rewrites its slot 2 at the
#: third step: a static cache may be written anywhere).
RUNS = [
    ([[5, 6, 7, 8], [9, 10, 11, 12]], [0, 0], [4, 4]),
    ([[13], [14]], [4, 4], [5, 5]),
    ([[15], [16]], [5, 5], [6, 6]),
    ([[17], [18]], [6, 2], [7, 3]),
    ([[19], [20]], [7, 3], [8, 4]),
    ([[21], [22]], [8, 4], [9, 5]),
]


def _run_all(compiled: bool) -> tuple[list, dict, onnxkv.Session]:
    session = onnxkv.Session(build_model("tensorscatter", MICRO, seed=3), threads=1, compiled_steps=compiled)
    name = session.model.io.logits
    with session.new_state() as state:
        logits = [state.run(_feeds(*run), [name])[name].copy() for run in RUNS]
        values = {n: np.array(v) for n, v in state.values.items()}
    return logits, values, session


def test_rows_written_at_their_own_positions_replay_bit_for_bit():
    plain, plain_values, _ = _run_all(False)
    replayed, values, session = _run_all(True)
    for a, b in zip(plain, replayed, strict=True):
        np.testing.assert_array_equal(a, b)
    assert values.keys() == plain_values.keys()
    for n in values:
        np.testing.assert_array_equal(values[n], plain_values[n])
    assert {"TensorScatter", "Attention24"} <= compiled_kinds(session)
    assert not any(step.stale for step in session.plan.steps.idle)


def test_one_step_serves_every_decode_token_of_generate():
    session = onnxkv.Session(build_model("tensorscatter", MICRO, seed=4), threads=1)
    plain = onnxkv.Session(build_model("tensorscatter", MICRO, seed=4), threads=1, compiled_steps=False)
    prompt = np.array([[3, 4, 5]])
    want = onnxkv.generate(plain, prompt, max_new_tokens=12).sequences
    np.testing.assert_array_equal(onnxkv.generate(session, prompt, max_new_tokens=12).sequences, want)
    (step,) = session.plan.steps.idle
    scatter = [k for k, op in enumerate(session.plan.kernels) if type(op).__name__ in ("TensorScatter", "Attention24")]
    compiled = {k for item in step.items if isinstance(item, Segment) for k in range(item.first, item.end)}
    assert scatter and set(scatter) <= compiled


def _state_after_prompt(session):
    state = session.new_state()
    name = session.model.io.logits
    for run in RUNS[:3]:  # records, then replays
        state.run(_feeds(*run), [name])
    return state, name


def test_a_failed_run_after_replayed_writes_puts_back_the_positions_they_replaced():
    session = onnxkv.Session(build_model("tensorscatter", MICRO, seed=5), threads=1)
    state, name = _state_after_prompt(session)
    with state:
        before = {n: np.array(v) for n, v in state.values.items()}, state.length

        def fail(outputs):
            raise RuntimeError("refused by the caller")

        # both rows rewrite committed slots (1 and 3), through the replayed step
        with pytest.raises(RuntimeError, match="refused by the caller"):
            state.run(_feeds([[30], [31]], [1, 3], [2, 4]), [name], before_commit=fail)
        assert state.length == before[1]
        for n, v in state.values.items():
            np.testing.assert_array_equal(v, before[0][n])
        (step,) = session.plan.steps.idle
        assert any(isinstance(item, Segment) for item in step.items) and not step.stale


def test_a_replay_that_raises_after_its_writes_puts_back_the_positions_they_replaced():
    """The replayed scatter calls ran and a later call of the program raised: the slots they rewrote come
    back (their saved bytes handed to the caches on the way out), as after a failed node."""
    session = onnxkv.Session(build_model("tensorscatter", MICRO, seed=6), threads=1)
    state, name = _state_after_prompt(session)
    with state:
        before = {n: np.array(v) for n, v in state.values.items()}, state.length
        fail_replays(session)
        with pytest.raises(MemoryError, match="call 9"):
            state.run(_feeds([[30], [31]], [1, 3], [2, 4]), [name])
        assert state.length == before[1]
        for n, v in state.values.items():
            np.testing.assert_array_equal(v, before[0][n], err_msg=n)


@pytest.mark.parametrize("index", [-1, C, 2**62])
def test_a_position_past_the_cache_fails_as_node_by_node_with_the_state_unchanged(index):
    session = onnxkv.Session(build_model("tensorscatter", MICRO, seed=6), threads=1)
    state, name = _state_after_prompt(session)
    with state:
        before = {n: np.array(v) for n, v in state.values.items()}, state.length
        with pytest.raises(InputError, match="TensorScatter node .*write_indices"):
            state.run(_feeds([[30], [31]], [6, index], [7, 7], positions=[6, 6]), [name])
        assert state.length == before[1]
        for n, v in state.values.items():
            np.testing.assert_array_equal(v, before[0][n])
        (step,) = session.plan.steps.idle
        assert not step.stale  # refused values of one run: the step stays and replays the next
        state.run(_feeds(*RUNS[3]), [name])
