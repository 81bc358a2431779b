"""Stopping a plan's run at a chosen node, for the tests of what a failed or cancelled run leaves behind.

* :func:`failing_after` makes node ``k`` raise right after its kernel ran
  (so its writes are done): the plan reports an
  :class:`~onnxkv.errors.OperatorError` whose message holds
  ``"injected failure after node k"``.
* :class:`CancelOnCheck` is a cancellation token that fires on its ``k``-th
  check (0-based); the plan checks before every node, so the run stops
  before node ``k`` (after node ``k - 1`` ran) -- when it runs node by node
  (:func:`node_by_node`): a compiled step checks before each of its items
  (a Python node or a segment of nodes).
"""

from __future__ import annotations

import contextlib

__all__ = ["CancelOnCheck", "failing_after", "node_by_node"]


class CancelOnCheck:
    """A cancellation token whose ``cancelled`` turns True on its ``k``-th check (0-based): before node ``k``."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.checks = 0

    @property
    def cancelled(self) -> bool:
        self.checks += 1
        return self.checks > self.k


@contextlib.contextmanager
def failing_after(plan, k: int):
    """Make node ``k`` of ``plan`` raise right after its kernel ran; restored on exit.  The plan runs
    node by node meanwhile (a compiled step replays recorded kernel calls, not ``plan._steps``)."""
    run, ins, outs = plan._steps[k]

    def fail(args, rt):
        run(args, rt)
        raise RuntimeError(f"injected failure after node {k}")

    plan._steps[k] = (fail, ins, outs)
    try:
        with node_by_node(plan):
            yield
    finally:
        plan._steps[k] = (run, ins, outs)


@contextlib.contextmanager
def node_by_node(plan):
    """Run ``plan`` without compiled steps (every node through Python) while inside; restored on exit."""
    steps, plan.steps = plan.steps, None
    try:
        yield
    finally:
        plan.steps = steps
