"""Test helper: the feeds of a prompt and of fixed decode steps, readers of a state's results, and a failing
replay."""

from __future__ import annotations

import numpy as np

from onnxkv.generate.feeds import FeedBuilder


def step_feeds(session, tokens: int, steps: int) -> list[dict]:
    """Feeds of a random ``tokens``-token prompt (seeded by ``tokens``), then of ``steps`` decode steps of
    fixed tokens: one list drives any number of states of ``session`` through the same positions."""
    vocab = session.model.vocab_size
    prompt = np.random.default_rng(tokens).integers(0, vocab, (1, tokens))
    b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([tokens]), 0, thread_cache=False)
    first, _ = b.first()
    out = [first]
    with session.new_state() as st:
        result = st.run(first, ["logits"])
        for i in range(steps):
            out.append(b.next(np.array([(5 * i + 1) % vocab]), result))
            result = st.run(out[-1], ["logits"])
    return out


def last_logits(state, feeds: dict) -> np.ndarray:
    """Run ``state`` on ``feeds``; the logits of row 0's last position (a copy)."""
    return state.run(feeds, ["logits"])["logits"][0, -1].copy()


def values_copy(state) -> dict[str, np.ndarray]:
    """Copies of ``state.values``."""
    return {k: v.copy() for k, v in state.values.items()}


def assert_same_values(a: dict, b: dict) -> None:
    """``a`` and ``b`` hold the same names and byte-equal arrays."""
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def compiled_kinds(session) -> set[str]:
    """The operator names of the plan nodes that ``session``'s idle compiled steps replay (their segments)."""
    from onnxkv.plan.compiled_step import Segment

    return {
        type(session.plan.kernels[k]).__name__
        for step in session.plan.steps.idle
        for item in step.items
        if isinstance(item, Segment)
        for k in range(item.first, item.end)
    }


class FailingProgram:
    """A segment's program that runs every call, then raises as a call whose workspace could not be had: a
    replay failing after its calls wrote."""

    def __init__(self, program):
        self.program = program
        self.refused = False

    def run(self, externals):
        self.program.run(externals)
        raise MemoryError("Program: call 9 could not allocate its workspace")


def fail_replays(session) -> None:
    """Make every segment of ``session``'s idle compiled steps a :class:`FailingProgram`."""
    from onnxkv.plan.compiled_step import Segment

    for step in session.plan.steps.idle:
        for item in step.items:
            if isinstance(item, Segment):
                item.program = FailingProgram(item.program)


def count_decode_steps(monkeypatch) -> list[int]:
    """From now on (until monkeypatch undoes it), the steps each State.decode_steps call runs (0 when it
    declined), in call order."""
    from onnxkv.runtime.state import State

    ran: list[int] = []
    real = State.decode_steps

    def counting(self, *args, **kwargs):
        run = real(self, *args, **kwargs)
        ran.append(0 if run is None else run.steps)
        return run

    monkeypatch.setattr(State, "decode_steps", counting)
    return ran
